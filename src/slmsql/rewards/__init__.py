"""GRPO's rewards: pure functions in one registry (`registry`), with the SQL similarity (`sqlsim`) and result
cell (`cells`) measures the partial rewards use. Uses `sql`.
"""
