import json

import pytest

from slmsql.data import check_databases, read_gold
from slmsql.errors import DataError


def write(path, text):
    path.write_text(text)
    return path


def test_canonical_jsonl(tmp_path):
    p = write(tmp_path / "g.jsonl", '{"id": 1, "db_id": "a", "question": "q?", "sql": "SELECT 1", '
                                    '"difficulty": "simple", "pass_rate": 0.5}\n\n')
    [ex] = read_gold(p)
    assert (ex.id, ex.db_id, ex.difficulty, ex.extra) == ("1", "a", "simple", {"pass_rate": 0.5})
    assert ex.to_json()["pass_rate"] == 0.5


def test_bird_dev_json(tmp_path):
    rec = {"question_id": 7, "db_id": "a", "question": "q?", "evidence": "hint", "SQL": "SELECT 1",
           "difficulty": "moderate"}
    [ex] = read_gold(write(tmp_path / "dev.json", json.dumps([rec])))
    assert (ex.id, ex.sql, ex.evidence, ex.difficulty) == ("7", "SELECT 1", "hint", "moderate")


def test_spider_dev_json(tmp_path):
    recs = [{"db_id": "a", "question": "q1", "query": "SELECT 1", "sql": {"select": []}, "query_toks": []},
            {"db_id": "a", "question": "q2", "query": "SELECT 2"}]
    exs = read_gold(write(tmp_path / "dev.json", json.dumps(recs)))
    assert [(e.id, e.sql) for e in exs] == [("0", "SELECT 1"), ("1", "SELECT 2")]
    assert exs[0].extra == {}


@pytest.mark.parametrize("text, match", [
    ('{"id": 1, "db_id": "a", "question": "q", "sql": "S"}\n{"id": 2, "db_id": "a",\n', r"g.jsonl:2: malformed JSON"),
    ('{"id": 1, "db_id": "a", "question": "q"}\n', r"g.jsonl:1: field 'sql': missing"),
    ('{"id": 1, "db_id": "a", "question": " ", "sql": "S"}\n', r"field 'question': missing or empty"),
    ('{"id": 1, "db_id": "a", "question": "q", "sql": "S"}\n{"id": 1, "db_id": "a", "question": "r", "sql": "S"}\n',
     r"g.jsonl:2: field 'id': duplicate id '1'"),
    ("", "file is empty"),
    ("[1, 2]\n", "expected a JSON object"),
])
def test_bad_input_names_file_line_field(tmp_path, text, match):
    with pytest.raises(DataError, match=match):
        read_gold(write(tmp_path / "g.jsonl", text))


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_gold(tmp_path / "nope.jsonl")


def test_databases_checked(tmp_path, shop):
    exs = read_gold(write(tmp_path / "g.jsonl", '{"id": 1, "db_id": "shop", "question": "q", "sql": "S"}\n'
                                               '{"id": 2, "db_id": "ghost", "question": "q", "sql": "S"}\n'))
    with pytest.raises(DataError, match="unknown db_id 'ghost'"):
        check_databases(exs, shop, "g.jsonl")
    (shop / "ghost").mkdir()
    (shop / "ghost" / "ghost.sqlite").write_text("not a database")
    with pytest.raises(DataError, match="is not an SQLite database"):
        check_databases(exs, shop, "g.jsonl")
