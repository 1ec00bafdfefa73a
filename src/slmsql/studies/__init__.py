"""Studies as data: a study declared in one file (`studies/<name>/study.yaml`), its cells kept as records
(`records/<cell>.json`) that any machine can add to, and its report built from the records alone."""
