"""The partial rewards against hand-computed values: Reasoning-SQL's on the SQL text (rewards/sqlsim.py), QATCH's on the
executed results (rewards/cells.py), and the registry's rewards built on them, which share one execution per completion."""

import sqlite3

import pytest
from inline import InlineExecutor

from slmsql.rewards import cells, registry as rewards, sqlsim
from slmsql.sql.matching import Digests

SCHEMA = {"item": ["id", "name", "price", "kind"], "sale": ["id", "item_id", "qty"]}
ITEM = {"table:item"} | {f"column:item.{c}" for c in SCHEMA["item"]}  # what `SELECT * FROM item` reads


def items(sql, schema=SCHEMA):
    return set(sqlsim.schema_items(sql, schema))


# ---- syntax ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sql, expected", [
    ("SELECT name FROM item WHERE kind = 'office'", 1.0),
    ("SELECT nme FROM nothing", 1.0),                       # parses: whether it runs is execution's business
    ("WITH t AS (SELECT 1 AS x) SELECT x FROM t", 1.0),
    ("SELECT 1 UNION SELECT 2", 1.0),
    ("SELECT name FROM", 0.0),                               # cut off
    ("SELECT name FROM item WHERE kind = 'off", 0.0),        # unterminated string (a truncated completion)
    ("hello world", 0.0),                                    # sqlglot reads an expression; not a query
    ("SELECT 1; SELECT 2", 0.0),                             # two statements: the sandbox refuses them too
    ("DELETE FROM item", 0.0),
    ("", 0.0), ("  ", 0.0), (None, 0.0),
])
def test_syntax(sql, expected):
    assert sqlsim.syntax(sql) == expected


# ---- schema linking ----------------------------------------------------------------------------------------

def test_schema_items_resolve_aliases_joins_and_unqualified_columns():
    assert items("SELECT i.name FROM item AS i JOIN sale s ON s.item_id = i.id WHERE s.qty > 2") == {
        "table:item", "table:sale", "column:item.name", "column:item.id", "column:sale.item_id", "column:sale.qty"}
    # the same reading without aliases, columns left for the schema to place
    assert items("SELECT name FROM item JOIN sale ON item_id = item.id WHERE qty > 2") == \
        items("SELECT i.name FROM item AS i JOIN sale s ON s.item_id = i.id WHERE s.qty > 2")
    assert items("SELECT NAME FROM Item WHERE KIND = 'x'") == {"table:item", "column:item.name", "column:item.kind"}


def test_schema_items_expand_stars():
    assert items("SELECT * FROM item") == ITEM
    assert items("SELECT i.* FROM item i JOIN sale s ON s.item_id = i.id") == ITEM | {"table:sale",
                                                                                       "column:sale.item_id"}
    assert items("SELECT * FROM item, sale") == ITEM | {"table:sale"} | {f"column:sale.{c}" for c in SCHEMA["sale"]}
    assert items("SELECT COUNT(*) FROM item") == {"table:item"}  # counts rows: reads no column
    assert items("SELECT * FROM item", schema=None) == {"table:item"}  # no schema: nothing to expand it to


def test_schema_items_look_through_subqueries_and_ctes():
    # a subquery's and a CTE's columns count where they are read from a table; the CTE is not a table
    assert items("SELECT name FROM item WHERE id IN (SELECT item_id FROM sale)") == {
        "table:item", "table:sale", "column:item.name", "column:item.id", "column:sale.item_id"}
    assert items("WITH t AS (SELECT name, price FROM item) SELECT name FROM t WHERE price > 3") == {
        "table:item", "column:item.name", "column:item.price"}
    assert items("SELECT x.n FROM (SELECT name AS n FROM item) x") == {"table:item", "column:item.name"}
    # correlated: `item.id` inside the subquery resolves to the outer query's item
    assert items("SELECT name FROM item WHERE EXISTS (SELECT 1 FROM sale WHERE sale.item_id = item.id)") == {
        "table:item", "table:sale", "column:item.name", "column:item.id", "column:sale.item_id"}


def test_schema_items_keep_what_nothing_resolves():
    assert items("SELECT zz.name FROM item") == {"table:item", "column:?.name"}  # unknown alias
    assert items("SELECT id FROM item JOIN sale") == {"table:item", "table:sale", "column:?.id"}  # ambiguous
    assert items("SELECT nme FROM item") == {"table:item", "column:?.nme"}  # no such column
    assert sqlsim.schema_items("SELECT name FROM", SCHEMA) is None
    assert sqlsim.schema_items("", SCHEMA) is None and sqlsim.schema_items(None, SCHEMA) is None


def test_schema_linking_is_the_jaccard_of_what_both_read():
    gold = "SELECT name FROM item WHERE kind = 'office'"  # {item, item.name, item.kind}
    assert sqlsim.schema_linking(gold, gold, SCHEMA) == 1.0
    assert sqlsim.schema_linking("SELECT i.name FROM item AS i WHERE i.kind = 'x'", gold, SCHEMA) == 1.0
    assert sqlsim.schema_linking("SELECT * FROM item", gold, SCHEMA) == 3 / 5  # 3 shared of 5 read
    assert sqlsim.schema_linking("SELECT name FROM item", gold, SCHEMA) == 2 / 3
    # every table: {item, 4 item columns, sale, 3 sale columns} (9) against the gold's 3
    assert sqlsim.schema_linking("SELECT * FROM item, sale", gold, SCHEMA) == 3 / 9
    assert sqlsim.schema_linking("SELECT qty FROM sale", gold, SCHEMA) == 0.0
    assert sqlsim.schema_linking("SELECT name FROM", gold, SCHEMA) == 0.0
    assert sqlsim.schema_linking(None, gold, SCHEMA) == 0.0


def test_schema_of_reads_the_database(shop):
    db = shop / "shop" / "shop.sqlite"
    con = sqlite3.connect(db)
    con.execute('CREATE TABLE "Sale Line" (id INTEGER, Item_Id INTEGER)')
    con.commit()
    con.close()
    assert sqlsim.schema_of(str(db)) == {"item": ["id", "name", "price", "kind"], "sale line": ["id", "item_id"]}


# ---- n-gram ------------------------------------------------------------------------------------------------

def test_ngram_is_the_jaccard_of_token_bigrams():
    gold = "SELECT name FROM item WHERE kind = 'office'"
    # 7 gold bigrams: select name, name from, from item, item where, where kind, kind =, = 'office'
    assert sqlsim.ngram("SELECT name FROM item", gold) == 3 / 7
    assert sqlsim.ngram("select NAME from ITEM where KIND = 'office';", gold) == 1.0  # case, a trailing ;
    assert sqlsim.ngram("SELECT name FROM item WHERE kind = 'Office'", gold) == 6 / 8  # literals keep case
    assert sqlsim.ngram("SELECT name FROM item WHERE kind = 'off", gold) == 0.0  # does not tokenize
    assert sqlsim.ngram("SELECT", gold) == 0.0  # one token: no bigram
    assert sqlsim.ngram("", gold) == 0.0 and sqlsim.ngram(None, gold) == 0.0
    assert sqlsim.bigrams("SELECT a.b FROM t") == {("select", "a"), ("a", "."), (".", "b"), ("b", "from"),
                                                   ("from", "t")}


# ---- QATCH cells -------------------------------------------------------------------------------------------

def test_cell_measures_match_qatch_examples():
    target = [("a", "b"), ("c", "d")]
    assert cells.cell_precision([("a", "b"), ("c", "e")], target) == 0.75
    assert cells.cell_precision([("a",), ("b",), ("c",), ("d",)], target) == 1.0  # shape is not its business
    assert cells.cell_recall([("a", "x"), ("y", "d")], target) == 0.5
    assert cells.cell_recall([("a", "a"), ("b", "b"), ("c", "d")], target) == 1.0
    assert cells.tuple_cardinality([("a", "b"), (3, 2)], target + [("c", "d"), ("f", "g")]) == 0.5
    assert cells.tuple_cardinality(target + [("c", "d"), ("f", "g")], [("a", "b"), (3, 2)]) == 0.5


def test_cell_measures_on_empty_results():
    for measure in (cells.cell_precision, cells.cell_recall, cells.tuple_cardinality):
        assert measure((), ()) == 1.0
        assert measure((), [(1,)]) == 0.0 and measure([(1,)], ()) == 0.0


def test_cells_compare_values_as_the_answer_matching_does():
    assert cells.cell_precision([(1.0,), ("1",)], [(1,)]) == 0.5  # 1.0 == 1, '1' != 1
    assert cells.cell_recall([(0.1 + 0.2,)], [(0.3,)]) == 1.0  # floats to 9 significant digits


def test_cells_on_digests_equal_cells_on_values():
    pred, gold = [("pen", 1.5), ("cup", 4)], [("pen", 1.5), ("pad", 2.25), ("pot", 4.0)]
    for measure in (cells.cell_precision, cells.cell_recall, cells.tuple_cardinality):
        plain = measure(pred, gold)
        assert measure(Digests.of(pred), gold) == measure(pred, Digests.of(gold)) == \
            measure(Digests.of(pred), Digests.of(gold)) == plain
    assert cells.cell_precision(pred, gold) == 3 / 4 and cells.cell_recall(pred, gold) == 3 / 6  # pen 1.5 4 of 6


# ---- the registered rewards --------------------------------------------------------------------------------

GOLD = "SELECT name FROM item WHERE kind = 'office'"  # pen, pad
COMPLETIONS = [
    f"```sql\n{GOLD}\n```",                                   # right, as written
    "```sql\nSELECT i.name FROM item i WHERE i.price < 3\n```",  # right, another way
    "```sql\nSELECT name FROM item\n```",                     # runs: pen cup pad pot
    "```sql\nSELECT name, kind FROM item WHERE kind = 'office'\n```",  # runs: a column too many
    "```sql\nSELECT nme FROM item\n```",                      # error
    "no idea",                                                # no SQL
    "```sql\nSELECT name FROM\n```",                          # unparsable
]


class Counting(InlineExecutor):
    def __init__(self):
        super().__init__()
        self.batches = 0

    def run(self, jobs):
        self.batches += 1
        return super().run(jobs)


@pytest.fixture
def batch(shop):
    return {"sql": [GOLD] * len(COMPLETIONS), "db_path": [str(shop / "shop" / "shop.sqlite")] * len(COMPLETIONS)}


def test_rewards_per_completion(batch):
    fns = dict(zip(rewards.REGISTRY, rewards.build(list(rewards.REGISTRY), executor=InlineExecutor())))
    got = {name: fn(prompts=["p"] * 7, completions=COMPLETIONS, **batch) for name, fn in fns.items()}
    assert got["syntax"] == [1, 1, 1, 1, 1, 0, 0]
    # gold reads {item, name, kind}; the alias rewrite {item, name, price}; all of item is 5 items
    assert got["schema_linking"] == [1.0, 2 / 4, 2 / 3, 1.0, 1 / 4, 0.0, 0.0]
    assert got["ngram"][0] == 1.0 and got["ngram"][2] == 3 / 7 and got["ngram"][5:] == [0.0, 2 / 7]
    assert got["cell_precision"] == [1.0, 1.0, 2 / 4, 2 / 3, 0.0, 0.0, 0.0]  # pen pad / pen pad office
    assert got["cell_recall"] == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert got["tuple_cardinality"] == [1.0, 1.0, 2 / 4, 1.0, 0.0, 0.0, 0.0]
    assert got["execution"] == [1.0, 1.0, 0.1, 0.1, 0.0, 0.0, 0.0]


def test_rewards_share_one_execution_per_batch(batch):
    executor = Counting()
    fns = rewards.build(["execution", "cell_precision", "cell_recall", "tuple_cardinality", "format"],
                        executor=executor)
    for fn in fns:  # as TRL calls them: each on the same batch in turn
        fn(prompts=["p"] * 7, completions=COMPLETIONS, **batch)
    assert executor.batches == 1
    conversational = [[{"role": "assistant", "content": c}] for c in COMPLETIONS[::-1]]
    for fn in fns:  # the next batch (other completions) runs once more, once
        fn(prompts=["p"] * 7, completions=conversational, **batch)
    assert executor.batches == 2


def test_cell_rewards_alone_execute_for_themselves(batch):
    (fn,) = rewards.build(["cell_recall"], executor=InlineExecutor())
    assert fn(prompts=["p"] * 7, completions=COMPLETIONS, **batch)[:3] == [1.0, 1.0, 1.0]


def test_every_reward_says_what_it_measures_and_where_it_comes_from():
    sources = {"execution": "Arctic-Text2SQL-R1", "format": "Reasoning-SQL", "syntax": "Reasoning-SQL",
               "schema_linking": "Reasoning-SQL", "ngram": "Reasoning-SQL", "cell_precision": "QATCH",
               "cell_recall": "QATCH", "tuple_cardinality": "QATCH"}
    assert set(sources) == set(rewards.REGISTRY)
    for name, source in sources.items():
        assert source in rewards.describe(name), name


def test_the_cli_reference_and_the_vocabulary_name_every_registered_reward():
    import dataclasses
    import re

    from slmsql import configs
    from slmsql.tracking import vocabulary

    help_ = {f.name: f for f in dataclasses.fields(configs.GRPOStageConfig)}["rewards"].metadata["help"]
    named = re.findall(r"\w+", help_.split("registry:", 1)[1].split("(", 1)[0])
    assert named == list(rewards.REGISTRY)  # a reward added to the registry and not to the help fails here
    table = vocabulary.vocabulary_markdown()
    for name in rewards.REGISTRY:
        assert vocabulary.documented(f"rewards/{name}/mean", "grpo") and f"`{name}`: " in table
