"""The statistics: paired tests and intervals (`inference`), over-seeds inference (`seedstats`), power and planning
(`power`), and the words a result is said in (`wording`). Uses only `errors`.
"""
