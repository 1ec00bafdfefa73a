"""Test suites (Zhong, Yu and Klein, EMNLP 2020) built from a schema and gold queries. So far the library parts
`neighbours` (the near misses a suite must tell apart from each gold) and `distill` (which generated databases
to keep); filling databases and the `slmsql suite build` stage are not written yet."""
