"""What slmsql reads: the example records and their files (`data`), the prompt built from a schema (`prompts`),
token counts (`tokens`), and where a model comes from, a Hub id or a path (`sources`). Uses only `errors`.
"""
