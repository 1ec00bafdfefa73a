import json

import pytest

from slmsql.inputs.data import check_databases, db_path, read_gold, read_jsonl, safe_text, write_json, write_jsonl
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


# ---- db_id is a name, never a path ----------------------------------------------------------------------

@pytest.mark.parametrize("db_id", ["../../x", "..", ".", "a/b", "/abs", "a\\b", "a\u0000b"])
def test_db_id_that_is_a_path_is_refused(tmp_path, db_id):
    line = json.dumps({"id": 2, "db_id": db_id, "question": "q", "sql": "S"})
    p = write(tmp_path / "g.jsonl", '{"id": 1, "db_id": "a", "question": "q", "sql": "S"}\n' + line + "\n")
    with pytest.raises(DataError, match=r"g.jsonl:2: field 'db_id': db_id .* is not a database name"):
        read_gold(p)
    with pytest.raises(DataError, match=r"field 'db_id': db_id .* is not a database name"):
        db_path(tmp_path, db_id)


def test_db_id_that_is_a_path_is_refused_in_dev_json(tmp_path):
    recs = [{"question_id": 0, "db_id": "a", "question": "q", "SQL": "S"},
            {"question_id": 1, "db_id": "../a", "question": "q", "SQL": "S"}]
    with pytest.raises(DataError, match=r"dev.json:1: field 'db_id': db_id '../a' is not a database name"):
        read_gold(write(tmp_path / "dev.json", json.dumps(recs)))


def test_db_id_names_that_are_fine(tmp_path):
    for db_id in ("california_schools", "a.b", "..a", "x y", "données"):
        assert db_path(tmp_path, db_id) == tmp_path / db_id / f"{db_id}.sqlite"


# ---- writing any Python string --------------------------------------------------------------------------

ODD = ["\ud800", "a\udfffb", "\udc80\udcff", "\udbff", "café 数据 😀", "", "\x00\n\"\\", "\\ud800"]


def test_jsonl_round_trips_any_string(tmp_path):
    """Lone surrogates (from a JSON "\\ud800" escape, or surrogateescape'd bytes) write and read back exactly."""
    rows = [{"id": i, "sql": s, s: [s]} for i, s in enumerate(ODD)]
    write_jsonl(tmp_path / "r.jsonl", rows)
    raw = (tmp_path / "r.jsonl").read_bytes()
    raw.decode("utf-8")  # strict: the file is valid UTF-8
    assert read_jsonl(tmp_path / "r.jsonl") == rows
    assert "café 数据 😀".encode() in raw  # text UTF-8 can hold stays readable, not \\u-escaped
    assert b'"\\ud800"' in raw and b'"\\\\ud800"' in raw  # a surrogate escaped; a literal backslash-u kept apart
    write_jsonl(tmp_path / "pair.jsonl", [{"sql": "\ud83d\ude00"}])  # JSON's limit: a split pair reads as one
    assert read_jsonl(tmp_path / "pair.jsonl") == [{"sql": "\U0001f600"}]
    write_json(tmp_path / "m.json", {"rows": rows})
    assert json.loads((tmp_path / "m.json").read_text(encoding="utf-8")) == {"rows": rows}


def test_gold_with_a_lone_surrogate_round_trips(tmp_path):
    p = write(tmp_path / "g.jsonl", '{"id": "q\\ud800", "db_id": "a", "question": "why \\udc80?", "sql": "S"}\n')
    exs = read_gold(p)
    assert (exs[0].id, exs[0].question) == ("q\ud800", "why \udc80?")
    write_jsonl(tmp_path / "again.jsonl", exs)
    assert read_gold(tmp_path / "again.jsonl") == exs


def test_safe_text_replaces_only_lone_surrogates():
    """The display copy for MLflow tables and pandas (whose Arrow text refuses lone surrogates)."""
    import pandas as pd

    assert safe_text("a\ud800b\udfff") == "a\ufffdb\ufffd"
    assert safe_text("café 😀") == "café 😀"
    rows = [{"id": "q\udc80", "sql": "SELECT '\ud800'", "ms": 1.5, "turns": [{"content": "\ud800"}, None]}]
    assert safe_text(rows) == [{"id": "q\ufffd", "sql": "SELECT '\ufffd'", "ms": 1.5,
                                "turns": [{"content": "\ufffd"}, None]}]
    with pytest.raises(UnicodeEncodeError):
        pd.DataFrame(rows)
    assert pd.DataFrame(safe_text(rows))["sql"].tolist() == ["SELECT '\ufffd'"]
