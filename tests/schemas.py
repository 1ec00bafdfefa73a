"""Test helper: three tiny databases (one question alone on its schema), questions on them as gold JSONL and a tiny
untrained model whose BPE knows their words: prompts that share a schema prefix, built in a second."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from slmsql.toy.tiny_model import build_tiny_model

SCHEMAS = {
    "shop": "CREATE TABLE item (id INTEGER PRIMARY KEY, name TEXT, price REAL, kind TEXT);"
            "CREATE TABLE sale (id INTEGER PRIMARY KEY, item_id INTEGER REFERENCES item(id), qty INTEGER);",
    "school": "CREATE TABLE pupil (id INTEGER PRIMARY KEY, name TEXT, age INTEGER, class TEXT);",
    "zoo": "CREATE TABLE animal (id INTEGER PRIMARY KEY, species TEXT, legs INTEGER);",
}
QUESTIONS = [("shop", "How many items are there?"), ("shop", "Name the cheapest item."),
             ("shop", "What is the total quantity sold?"), ("shop", "List the kinds of items."),
             ("shop", "Which item sold the most?"), ("school", "How many pupils are older than 10?"),
             ("school", "List the names of pupils in class A."), ("school", "What is the average age?"),
             ("zoo", "How many animals have four legs?")]  # zoo: one question, nothing to share
TINY = dict(vocab_size=300, hidden=32, layers=2, heads=4, ffn=64)


def build(root: Path) -> tuple[Path, Path]:
    """(root, model folder): <root>/dbs/<db>/<db>.sqlite, <root>/gold.jsonl, the model in <root>/tiny."""
    for db, ddl in SCHEMAS.items():
        (root / "dbs" / db).mkdir(parents=True)
        with sqlite3.connect(root / "dbs" / db / f"{db}.sqlite") as con:
            con.executescript(ddl)
        con.close()
    gold = [{"id": f"q{i}", "db_id": db, "question": q, "sql": "SELECT 1"} for i, (db, q) in enumerate(QUESTIONS)]
    (root / "gold.jsonl").write_text("".join(json.dumps(g) + "\n" for g in gold))
    model = build_tiny_model(root / "tiny", [*SCHEMAS.values(), *(q for _, q in QUESTIONS)] * 4, **TINY)
    return root, model
