"""MLflow: stage runs and the client helpers (`runs`), the outbox that keeps records through an outage
(`durable`), LoggedModel lineage (`lineage`), the words runs are described in (`descriptions`), completions
tables (`tables`), figures (`figures`) and the documented metric names (`vocabulary`).
Uses `configs`, `inputs`, `stats`, `runtime`, `sql`, `rewards`.
"""
