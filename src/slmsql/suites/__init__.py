"""Test suites (Zhong, Yu and Klein, EMNLP 2020) built from a schema and gold queries, written from the paper's
description: the schema and its fill order (`schema`), the golds' literals by column (`pools`), a candidate
database's rows and file (`fill`), a gold's near misses (`neighbours`), the rule that keeps a candidate (`distill`),
and one db_id's suite with the manifest (`build`), which `slmsql suite build` runs (docs/stages/suite.md)."""
