import hashlib
import re
import sqlite3
from pathlib import Path

import pytest

from slmsql.toy import world as toy
from slmsql.inputs.data import DIFFICULTIES, check_databases, db_path, read_gold, schema_of
from slmsql.errors import SlmsqlError

SPLITS = ("sft", "rl_source", "dev", "dev_cross")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy") / "world"
    summary = toy.generate(out, seed=0)
    return out, summary, {s: read_gold(out / f"{s}.jsonl") for s in SPLITS}


def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def ro(root, db_id):
    return sqlite3.connect(f"file:{db_path(root / 'databases', db_id)}?mode=ro", uri=True)


def test_same_seed_same_bytes_other_seed_differs(world, tmp_path):
    out, _, _ = world
    toy.generate(tmp_path / "again", seed=0)
    toy.generate(tmp_path / "other", seed=1)
    same, other = digests(tmp_path / "again"), digests(tmp_path / "other")
    assert same == digests(out)
    assert any(p.endswith(".sqlite") for p in same)
    assert other["sft.jsonl"] != same["sft.jsonl"]
    assert other["databases/shop_000/shop_000.sqlite"] != same["databases/shop_000/shop_000.sqlite"]


def test_counts_and_summary(world):
    out, summary, splits = world
    assert {s: len(e) for s, e in splits.items()} == {"sft": 2000, "rl_source": 300, "dev": 200, "dev_cross": 200}
    for s, examples in splits.items():
        counts = summary["counts"][s]
        assert counts == {"total": len(examples), **{d: sum(e.difficulty == d for e in examples) for d in DIFFICULTIES}}
        assert all(counts[d] > 0.1 * len(examples) for d in DIFFICULTIES)  # every level well represented
        assert summary["databases"][s] == sorted({e.db_id for e in examples})
        check_databases(examples, out / "databases")
    assert summary["seconds"] >= 0 and (out / "summary.json").is_file()


def test_every_gold_executes_with_a_useful_result(world):
    out, _, splits = world
    cons = {}
    for examples in splits.values():
        for e in examples:
            con = cons.setdefault(e.db_id, ro(out, e.db_id))
            rows = con.execute(e.sql).fetchall()
            assert rows and any(v is not None for r in rows for v in r), (e.id, e.sql)
    for con in cons.values():
        con.close()


def test_limit_boundaries_have_no_ties(world):
    """The sort key of the rows up to one past the limit are all distinct, so no tie decides the answer."""
    out, _, splits = world
    shape = re.compile(r"^SELECT (.+?) FROM (.+) ORDER BY (.+?) (ASC|DESC) LIMIT (\d+)$")
    limited = [e for ex in splits.values() for e in ex if "LIMIT" in e.sql]
    assert len(limited) > 50
    for e in limited:
        m = shape.match(e.sql)
        assert m, e.sql
        _, rest, key, order, k = m.groups()
        con = ro(out, e.db_id)
        keys = [r[0] for r in con.execute(f"SELECT {key} FROM {rest} ORDER BY {key} {order} LIMIT {int(k) + 1}")]
        con.close()
        assert len(keys) >= int(k) and len(set(keys)) == len(keys), (e.sql, keys)


def test_cross_databases_are_unseen_but_use_known_words(world):
    out, summary, splits = world
    train = {e.db_id for s in ("sft", "rl_source", "dev") for e in splits[s]}
    cross = {e.db_id for e in splits["dev_cross"]}
    assert len(train) == 40 and len(cross) == 10 and not train & cross

    def identifiers(db_id):
        con = ro(out, db_id)
        tables = [n for n, _ in schema_of(db_path(out / "databases", db_id))]
        cols = {t: tuple(r[1] for r in con.execute(f"PRAGMA table_info({t})")) for t in tables}
        con.close()
        return cols

    train_words, train_schemas = set(), set()
    for db in train:
        cols = identifiers(db)
        train_words |= set(cols) | {c for cs in cols.values() for c in cs}
        train_schemas.add(tuple(sorted(cols.items())))
    for db in cross:
        cols = identifiers(db)
        assert set(cols) | {c for cs in cols.values() for c in cs} <= train_words, db
        assert tuple(sorted(cols.items())) not in train_schemas, db


def test_questions_and_sql_unique_across_splits(world):
    _, _, splits = world
    every = [e for ex in splits.values() for e in ex]
    assert len({(e.db_id, e.question) for e in every}) == len(every)
    assert len({(e.db_id, e.sql) for e in every}) == len(every)
    assert len({e.id for e in every}) == len(every)
    assert {e.difficulty for e in every} == set(DIFFICULTIES)


def test_sql_covers_the_planned_constructs(world):
    _, _, splits = world
    sql = "\n".join(e.sql for e in splits["sft"])
    for construct in ("WHERE", " = '", " < ", " > ", " LIKE ", " BETWEEN ", " IS NULL", " IS NOT NULL", "COUNT(*)",
                      "SUM(", "AVG(", "MIN(", "MAX(", "GROUP BY", "HAVING", "ORDER BY", "LIMIT", " JOIN ",
                      " IN (SELECT", " NOT IN (SELECT", "> (SELECT AVG(", "DISTINCT", "strftime("):
        assert construct in sql, construct


def test_databases_look_like_the_spec(world):
    out, summary, _ = world
    db_ids = sorted({d for ds in summary["databases"].values() for d in ds})
    domains = {d.rsplit("_", 1)[0] for d in db_ids}
    assert len(domains) >= 6
    types, nulls = set(), 0
    for db_id in db_ids:
        con = ro(out, db_id)
        tables = [n for n, _ in schema_of(db_path(out / "databases", db_id))]
        assert 3 <= len(tables) <= 4
        fks = 0
        for t in tables:
            info = con.execute(f"PRAGMA table_info({t})").fetchall()
            assert 4 <= len(info) <= 6 and sum(r[5] for r in info) == 1, (db_id, t)
            types |= {r[2] for r in info}
            fks += len(con.execute(f"PRAGMA foreign_key_list({t})").fetchall())
            nulls += sum(con.execute(f"SELECT COUNT(*) FROM {t} WHERE {r[1]} IS NULL").fetchone()[0] for r in info)
        assert fks >= 2, db_id
        assert con.execute("PRAGMA foreign_key_check").fetchall() == []
        con.close()
    assert types == {"INTEGER", "TEXT", "REAL", "DATE"} and nulls > 0


def test_refuses_non_empty_dir_unless_overwrite(tmp_path):
    out = tmp_path / "w"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SlmsqlError, match="not empty"):
        toy.generate(out, seed=3)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    toy.generate(out, seed=3, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "sft.jsonl").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]  # no temporary directories left behind
    (tmp_path / "f").write_text("x")
    with pytest.raises(SlmsqlError, match="not a directory"):
        toy.generate(tmp_path / "f", seed=3, overwrite=True)


def test_empty_existing_dir_is_fine(tmp_path):
    (tmp_path / "w").mkdir()
    assert toy.generate(tmp_path / "w", seed=4)["counts"]["dev"]["total"] == 200


@pytest.mark.parametrize("seed, size, match", [("3", "small", "seed must be an integer"),
                                               (1.5, "small", "seed must be an integer"),
                                               (True, "small", "seed must be an integer"),
                                               (3, "huge", "unknown size")])
def test_bad_arguments(tmp_path, seed, size, match):
    with pytest.raises(SlmsqlError, match=match):
        toy.generate(tmp_path / "w", seed=seed, size=size)
    assert not (tmp_path / "w").exists()
