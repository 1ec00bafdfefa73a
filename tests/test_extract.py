from slmsql.sql.extract import extract_sql, has_sql_block


def test_last_sql_block_wins():
    text = "First try:\n```sql\nSELECT 1\n```\nBetter:\n```sql\nSELECT 2;\n```\n"
    assert extract_sql(text) == ("SELECT 2", "sql_block")


def test_unclosed_block_at_end_of_truncated_completion():
    assert extract_sql("```sql\nSELECT a FROM t WHERE") == ("SELECT a FROM t WHERE", "sql_block")


def test_fallbacks():
    assert extract_sql("```\nselect a from t\n```") == ("select a from t", "bare_block")
    assert extract_sql("  WITH x AS (SELECT 1) SELECT * FROM x;") == ("WITH x AS (SELECT 1) SELECT * FROM x",
                                                                      "bare_sql")


def test_prose_is_no_sql_not_an_error():
    assert extract_sql("I cannot answer that.") == (None, "no_sql")
    assert extract_sql("") == (None, "no_sql")
    assert extract_sql(None) == (None, "no_sql")
    assert extract_sql("```sql\n\n```") == (None, "no_sql")
    assert extract_sql("```\nThe answer is 3\n```") == (None, "no_sql")


def test_has_sql_block_needs_a_closed_non_empty_block():
    assert has_sql_block("```sql\nSELECT 1\n```")
    assert has_sql_block("```SQL\nSELECT 1\n```")
    assert not has_sql_block("```sql\nSELECT 1")
    assert not has_sql_block("```sql\n  \n```")
    assert not has_sql_block("SELECT 1")
