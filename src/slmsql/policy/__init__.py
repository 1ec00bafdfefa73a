"""The policy a stage runs: base model by Hub id or path, adapter stack, dtype, tokenizer and chat template
(`models`), resolved once with its checks into one `Policy` (`resolve`). Uses `configs`, `inputs`, `runtime`,
`checks`, `tracking`.
"""
