"""SQL against real SQLite: the sandboxed executor (`sandbox`), result matching (`matching`), the SQL in a
completion (`extract`), execution accuracy (`scoring`) and pass rates over K samples (`passrates`).
Uses `inputs`, `stats`, `runtime`.
"""
