"""Test suites (Zhong, Yu and Klein, EMNLP 2020) built from a schema and gold queries. So far: `neighbours`,
the near-miss queries a suite must tell apart from each gold."""
