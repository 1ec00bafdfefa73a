"""The tables runs log to MLflow, built for a person to read in the UI: the question, the SQL on both sides,
the outcome under its one name (`scoring.outcome_name`, as in the `exec/<outcome>` metrics), numbers rounded.

Text goes through `data.safe_text` (MLflow's JSON table writer refuses what UTF-8 cannot hold).
"""

from __future__ import annotations

import json
import re

from slmsql.inputs.data import safe_text
from slmsql.sql.extract import completion_text, extract_sql
from slmsql.sql.scoring import outcome_name

DIGITS = 4  # rewards and advantages pass through float32: 0.200000003 is 0.2


def _text(value) -> str:
    """A completion or prompt as text: chat turns (lists of {role, content}, arrays in TRL's parquet) -> the
    last turn's content."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, str):
        return value
    try:
        return completion_text(value)
    except (TypeError, KeyError, IndexError):
        return json.dumps(value, default=str)


def prompt_key(prompt) -> str:
    """What identifies a question in a chat prompt: its last user turn (schema + question)."""
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    return users[-1] if users else json.dumps(prompt, default=str)


def completions_table(df, questions: dict, rewards: list[str]):
    """TRL's completions frame (step, prompt, completion, <reward>..., advantage, extra columns) as
    step | question | sql | completion | gold_sql | status | <reward>... | advantage.
    `questions`: prompt_key(prompt) -> the Example it was built from (for the question and gold SQL)."""
    import pandas as pd

    rows = []
    for rec in df.to_dict("records"):
        ex = questions.get(prompt_key(rec["prompt"]))
        text = _text(rec["completion"])
        row = {"step": int(rec["step"]) if "step" in rec else None, "id": ex.id if ex else None,
               "question": ex.question if ex else None, "sql": extract_sql(text)[0], "completion": text,
               "gold_sql": ex.sql if ex else None, "status": rec.get("status")}
        row.update({name: round(float(rec[name]), DIGITS) for name in rewards if name in rec})
        row["advantage"] = round(float(rec["advantage"]), DIGITS) if "advantage" in rec else None
        rows.append(row)
    return pd.DataFrame(safe_text(rows))


def evaluation_table(examples, results: list[dict], preds: dict | None = None):
    """One row per question: id | db_id | difficulty | question | gold_sql | predicted_sql | completion | status |
    correct | error. `predicted_sql` is the SQL scored (no fences); `completion` the raw model text it came from
    (`preds`: id -> prediction; empty for a prediction given as SQL)."""
    import pandas as pd

    by_id, preds = {e.id: e for e in examples}, preds or {}
    rows = [{"id": r["id"], "db_id": r["db_id"], "difficulty": r.get("difficulty"),
             "question": by_id[r["id"]].question, "gold_sql": by_id[r["id"]].sql, "predicted_sql": r["predicted_sql"],
             "completion": (preds.get(r["id"]) or {}).get("completion"),
             "status": outcome_name(r["correct"], r["status"]), "correct": bool(r["correct"]), "error": r["error"]}
            for r in results]
    return pd.DataFrame(safe_text(rows))


def disagreements_table(examples, results: list[dict], baseline: dict[str, dict], this_name: str,
                        baseline_name: str):
    """The questions exactly one of the two paired runs got right (McNemar's discordant pairs):
    id | question | right (the run that got it right) | gold_sql | predicted_sql | status | baseline_sql |
    baseline_status. `baseline`: the baseline run's results.jsonl rows by id."""
    import pandas as pd

    by_id = {e.id: e for e in examples}
    rows = []
    for r in results:
        b = baseline[r["id"]]
        if bool(r["correct"]) == bool(b["correct"]):
            continue
        rows.append({"id": r["id"], "question": by_id[r["id"]].question,
                     "right": this_name if r["correct"] else baseline_name, "gold_sql": by_id[r["id"]].sql,
                     "predicted_sql": r["predicted_sql"], "status": outcome_name(r["correct"], r["status"]),
                     "baseline_sql": b.get("predicted_sql"), "baseline_status": outcome_name(b["correct"], b["status"])})
    columns = ["id", "question", "right", "gold_sql", "predicted_sql", "status", "baseline_sql", "baseline_status"]
    return pd.DataFrame(safe_text(rows), columns=columns)


def _sql_block(sql) -> str:
    """SQL in a Markdown code block (a fence longer than any backtick run inside it); none: a plain note."""
    if not sql:
        return "_no SQL_\n"
    fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", sql)), default=0))
    return f"{fence}sql\n{sql.strip()}\n{fence}\n"


def sql_report(examples, results: list[dict], baseline: dict[str, dict], this_name: str, baseline_name: str) -> str:
    """A paired evaluation as Markdown, to read the SQL side by side: every question with its gold SQL, this run's
    and the baseline's, each in a ```sql block; the questions only one run got right (McNemar's discordant pairs)
    first, then those both got wrong, then both right."""
    by_id = {e.id: e for e in examples}

    def order(r):
        a, b = bool(r["correct"]), bool(baseline[r["id"]]["correct"])
        return 0 if a != b else 1 if not a else 2

    heads = ("Only one run right", "Both wrong", "Both right")
    lines = [f"# {this_name} vs {baseline_name}: the SQL side by side\n"]
    section = None
    for r in sorted(results, key=order):
        b, ex = baseline[r["id"]], by_id[r["id"]]
        if order(r) != section:
            section = order(r)
            lines.append(f"## {heads[section]} ({sum(order(x) == section for x in results)})\n")
        right = this_name if r["correct"] and not b["correct"] else baseline_name if b["correct"] and not \
            r["correct"] else ""
        lines += [f"### {r['id']}{f' — right: {right}' if right else ''}\n", f"{ex.question}\n",
                  "Gold:\n", _sql_block(ex.sql),
                  f"{this_name} ({outcome_name(r['correct'], r['status'])}):\n", _sql_block(r["predicted_sql"]),
                  f"{baseline_name} ({outcome_name(b['correct'], b['status'])}):\n", _sql_block(b.get("predicted_sql"))]
    return "\n".join(lines)
