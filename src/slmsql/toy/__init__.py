"""The embedded toy world: many small SQLite databases and gold questions, offline (`world`, `lexicon`).
Uses `inputs`, `runtime`.
"""
