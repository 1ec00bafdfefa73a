"""A study's report, built from its records alone (no MLflow store): `report.json` (the numbers), `report.md` (the
document) and `forest.png`, written into the study's folder by `slmsql study report` (docs/stages/study.md).

Each declared comparison is one row of one Holm family, in declared order. An arm against the start is a sweep's
row (studies/compare.py: seeds pooled per question; seeds random too); an arm against an arm pairs seed s with
seed s. The family always has its declared size: a comparison whose records are not all there enters it as p = 1
and gets no verdict, its estimate from the seeds present shown as incomplete, so a verdict never gets easier as
records go missing. The missing cells are named, and so is the machine (float path) and code of every cell. Per arm, a
diagnosis: the means over its seeds of its records' training-log figures (studies/diagnosis.py; "not recorded" for
records from before them), and the questions its seeds turned right and wrong against the start, per eval set;
then each seed's own figures, so a seed that went its own way is not hidden in a mean.

The report is a function of the records: no clock, no paths of this machine, so regenerating it from the same
records gives the same bytes.
"""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path

from slmsql.errors import DataError
from slmsql.inputs.data import dumps
from slmsql.stats import inference, seedstats
from slmsql.stats.wording import bound, pct, pts, pval
from slmsql.studies import compare, diagnosis, tables

SCHEMA = "slmsql.study-report/1"
START = "start"  # the start record's cell id
FILES = ("report.json", "report.md", "forest.png")


def _where(cell: str) -> str:
    return f"records/{cell}.json"


def build(study: dict, start: dict | None, cells: list[dict], references: list[dict] = ()) -> dict:
    """The report of `study` (spec.Study.as_dict()) from its start record (None: missing), cell records and
    reference records."""
    alpha = float(study["alpha"])
    declared = {c["cell"]: c for c in study["cells"]}
    got = _recorded(declared, cells)
    ids = {es: _questions(es, start, got) for es in study["eval_sets"]}
    missing = ([] if start is not None else [START]) + [c for c in declared if c not in got]
    rows = [_row(i, comp, declared, start, got, ids[comp["eval_set"]], alpha)
            for i, comp in enumerate(study["comparisons"])]
    # one seed declared: nothing to make a random unit of, no method family
    compare.adjust(rows, alpha, seed_family=rows if len(study["seeds"]) > 1 else [], complete=lambda r: r["complete"])
    # outside the family: each row its own family of one, so its p is unadjusted and its verdict at alpha alone
    secondary = [_row(i, comp, declared, start, got, ids[comp["eval_set"]], alpha)
                 for i, comp in enumerate(study.get("secondary") or [])]
    for row in secondary:
        compare.adjust([row], alpha, seed_family=[row] if len(study["seeds"]) > 1 else [],
                       complete=lambda r: r["complete"])
    for row in rows + secondary:
        compare.finite(row)
    m = len(rows)
    return _json_safe({
        "schema": SCHEMA, "study": study["name"], "title": study.get("title") or study["name"],
        "question": study["question"], "alpha": alpha, "arms": list(study["arms"]), "seeds": list(study["seeds"]),
        "plan": study.get("plan") or {},
        "method": inference.POOLED_METHOD, "arm_method": compare.ARM_METHOD, "seed_method": seedstats.METHOD,
        "comparisons": m,
        "adjustment": f"Holm over the {m} declared comparison{'s' if m != 1 else ''} (one with records missing "
                      "enters as p = 1)",
        "records": {"cells": len(got), "declared": len(declared), "start": start is not None},
        "missing": missing,
        "start": None if start is None else {"fingerprint": (start.get("start") or {}).get("fingerprint"),
                                             "code_version": start.get("code_version")},
        # the declaration's hash its start's record binds (None: no start record, or one from before the binding)
        "declaration": ((start or {}).get("declaration") or {}).get("sha256"),
        "amendments": list(study.get("amendments") or []),
        "eval_sets": [{"name": es, "n": None if ids[es] is None else len(ids[es]),
                       "ex_b": None if start is None else _ex([start["results"][es][q][0] for q in ids[es]])}
                      for es in study["eval_sets"]],
        "rows": rows,
        **({"secondary": secondary} if study.get("secondary") else {}),  # only where declared: other reports unchanged
        "diagnosis": [_diagnosis(arm, start, [r for r in got.values() if r["arm"] == arm], ids)
                      for arm in study["arms"]],
        # a study that declares references (none: no keys, so the reports of those before them read as they did)
        **({"references": [_reference(r, start, ids, alpha) for r in references],
            "references_missing": [f"ref-{name}" for name in study["references"]
                                   if name not in {r["config"]["reference"] for r in references}]}
           if study.get("references") else {}),
        "provenance": [_provenance(r) for r in ([start] if start is not None else []) + list(got.values())
                       + list(references)],
        # how many machines' floats the pooled records come from (they pool: docs/stages/study.md "Float paths")
        "float_paths": len({json.dumps(r.get("float_path") or {}, sort_keys=True)
                            for r in ([start] if start is not None else []) + list(got.values())}),
    })


def _recorded(declared: dict, cells: list[dict]) -> dict:
    """cell id -> record, in declared order; a record of no declared cell, or one twice, is refused."""
    got = {}
    for rec in cells:
        cell = rec.get("cell")
        if cell not in declared:
            raise DataError(f"{cell!r} is not a declared cell of the study", _where(cell), field="cell")
        if cell in got:
            raise DataError("the same cell given twice", _where(cell), field="cell")
        for key in ("arm", "seed"):
            if rec.get(key) != declared[cell][key]:
                raise DataError(f"{rec.get(key)!r}, but the study declares {declared[cell][key]!r} for {cell}",
                                _where(cell), field=key)
        got[cell] = rec
    return {c: got[c] for c in declared if c in got}


def _questions(es: str, start: dict | None, got: dict) -> list[str] | None:
    """The question ids of eval set `es`: the start's, which every cell must have scored exactly (without a start
    record, the first cell's). None where no record has any."""
    records = ([(START, start)] if start is not None else []) + list(got.items())
    for cell, rec in records:
        if es not in (rec.get("results") or {}):
            raise DataError(f"no results for eval set {es!r}", _where(cell), field=f"results.{es}")
    if not records:
        return None
    first, ref = records[0][0], set(records[0][1]["results"][es])
    for cell, rec in records[1:]:
        mine = set(rec["results"][es])
        if mine != ref:
            extra, lack = sorted(mine - ref), sorted(ref - mine)
            raise DataError(f"scored other questions than {'the start' if first == START else first} on {es!r}: "
                            f"{len(extra)} not there {extra[:3]}, {len(lack)} of its missing {lack[:3]}",
                            _where(cell), field=f"results.{es}")
    return sorted(ref)


def _row(index: int, comp: dict, declared: dict, start, got: dict, ids, alpha: float) -> dict:
    arm, against, es = comp["arm"], comp["against"], comp["eval_set"]
    need = [c for c, d in declared.items() if d["arm"] in (arm, against)]
    missing = ([START] if start is None else []) + [c for c in need if c not in got]
    row = {"index": index, "label": f"{arm} vs {against}", "arm": arm, "against": against, "eval_set": es,
           "complete": not missing, "missing": missing,
           "reason": f"records missing: {', '.join(missing)}" if missing else None}

    def seeds_of(name):  # {seed: per-question correct}, in declared order
        return {r["seed"]: [bool(r["results"][es][q][0]) for q in ids] for r in got.values() if r["arm"] == name}

    a = seeds_of(arm)
    if against == START:
        base = [bool(start["results"][es][q][0]) for q in ids] if start is not None else None
        stats = compare.vs_start(list(a.values()), base, alpha) if a and base is not None else None
        if stats is not None:
            stats.update(diff_seeds=[x - stats["ex_b"] for x in stats["ex_seeds"]], seed_ids=list(a))
        elif base is not None:  # nothing to compare yet, but the start's EX is known
            stats = {"ex_b": _ex(base)}
    else:
        stats = compare.vs_arm(a, seeds_of(against), alpha)  # on the seeds both have
    # the numbers of a row with records missing are from the seeds present (`seed_ids`)
    return {**row, **_empty(), "n": None if ids is None else len(ids), **(stats or {})}


def _reference(rec: dict, start: dict | None, ids: dict, alpha: float) -> dict:
    """A reference's EX per eval set with its Wilson interval, and beside the start's on the same questions: the
    difference with its exact interval and McNemar's exact p, unadjusted (a reference is outside the Holm family:
    descriptive, no verdict)."""
    cfg = rec["config"]
    out = {"name": cfg["reference"], "model": cfg["model"], "adapter": cfg["adapter"], "sets": []}
    for es, qs in ids.items():
        mine = (rec.get("results") or {}).get(es)
        if mine is None or qs is None or set(mine) != set(qs):
            raise DataError(f"scored other questions than the start on {es!r}", _where(rec["cell"]),
                            field=f"results.{es}")
        c = inference.compare([bool(mine[q][0]) for q in qs], [bool(start["results"][es][q][0]) for q in qs], alpha)
        out["sets"].append({"eval_set": es, "n": c["n"], "ex": c["ex_a"], "ex_ci_low": c["ex_a_ci_low"],
                            "ex_ci_high": c["ex_a_ci_high"], "ex_start": c["ex_b"], "diff": c["diff"],
                            "diff_ci_low": c["diff_ci_low"], "diff_ci_high": c["diff_ci_high"],
                            "mcnemar_p": c["mcnemar_p"]})
    return out


def _diagnosis(arm: str, start: dict | None, recs: list[dict], ids: dict) -> dict:
    """One arm's diagnosis: the means over its seeds of its records' training-log figures (over the records that
    carry one: older records lack it), the spread of its band draws over all of them, and per eval set the
    questions its seeds turned right and wrong against the start (a mean over seeds; None without the start); and
    each seed's own (`cells`): a mean hides a seed that went its own way (a collapse shows in one seed's row)."""
    cells = [{"seed": r["seed"], "diagnosis": r.get("diagnosis"), "turned": _turned(start, r, ids)} for r in recs]
    have = [c["diagnosis"] for c in cells if c["diagnosis"] is not None]
    mean = diagnosis.mean  # of the numbers given: a figure a log lacked (None) is left out

    def spread(key, pick):
        values = [d[key] for d in have if d[key] is not None]
        return pick(values) if values else None

    turned = {es: None if start is None or not cells else
              {side: mean([c["turned"][es][side] for c in cells]) for side in ("right", "wrong")} for es in ids}
    return {"arm": arm, "seeds": [r["seed"] for r in recs],
            "diagnosed": [r["seed"] for r in recs if r.get("diagnosis") is not None],
            **{k: mean([d.get(k) for d in have]) for k in diagnosis.KEYS if not k.startswith("draws_")},
            "draws_min": spread("draws_min", min), "draws_max": spread("draws_max", max), "turned": turned,
            "cells": cells}


def _turned(start: dict | None, rec: dict, ids: dict) -> dict:
    """Per eval set, the questions the start got wrong and this record right, and the reverse (None: no start)."""
    if start is None:
        return dict.fromkeys(ids)
    counts = {es: diagnosis.turned({q: start["results"][es][q][0] for q in qs},
                                   {q: rec["results"][es][q][0] for q in qs}) for es, qs in ids.items()}
    return {es: {"right": right, "wrong": wrong} for es, (right, wrong) in counts.items()}


def _empty() -> dict:
    return {**dict.fromkeys(compare.STAT_KEYS), **dict.fromkeys(compare.SEED_KEYS), "seeds": 0, "ex_seeds": [],
            "diff_seeds": [], "seed_ids": []}


def _ex(correct: list[bool]) -> float | None:
    return sum(correct) / len(correct) if correct else None


def _provenance(rec: dict) -> dict:
    """Which machine (float path) and code produced a record, and when, with its MLflow runs."""
    return {"cell": rec["cell"], "arm": rec.get("arm"), "seed": rec.get("seed"),
            "code_version": rec.get("code_version"), "float_path": rec.get("float_path") or {},
            "finished_at": rec.get("finished_at"), "mlflow": rec.get("mlflow") or {}}


def _json_safe(obj):
    """JSON has no NaN or inf: None in their place, anywhere in the report."""
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


# ---- report.md ------------------------------------------------------------------------------------------------

def markdown(report: dict) -> str:
    r = report
    rec = r["records"]
    start = ", and the start" if rec["start"] else "; the start's record missing"
    lines = [f"# {r['title']}", "", f"**Question.** {r['question']}", "",
             f"Study `{r['study']}`: arms {', '.join(r['arms'])}; seeds {r['seeds']}; records: {rec['cells']} of "
             f"{rec['declared']} cells{start}.", "", "**Plan.**", ""]
    lines += [f"- **{k}**: {v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
              for k, v in r["plan"].items()] or ["(none declared)"]
    # no headings below the title: docs/studies.md includes the report under a section of its own
    lines += ["", f"**Results.** Pooled test (a verdict for the seeds trained): {r['method']}; an arm against an arm: "
              f"{r['arm_method']}. Over seeds (a verdict for the method): {r['seed_method']}. p (Holm): "
              f"{r['adjustment']}; the verdict compares it with alpha = {r['alpha']}. EX sd / min-max: between seeds. "
              "A row with records missing has no verdict: its numbers are from the seeds present.", ""]
    level = f"{1 - r['alpha']:.0%}"
    family = len(r["rows"]) if len(r["seeds"]) > 1 else 0
    for es in r["eval_sets"]:
        mine = [x for x in r["rows"] if x["eval_set"] == es["name"]]
        if not mine:
            continue
        n = "n/a" if es["n"] is None else es["n"]
        # all against the start: its EX in the heading, as a sweep's table; else each row's own in a column
        arms = any(x["against"] != START for x in mine)
        lines += [f"**{es['name']}**: n = {n}; starting EX {pct(es['ex_b'])}.", "",
                  *tables.pooled_table(mine, level, "comparison", lambda x: x["label"],
                                       "EX compared with" if arms else ""), "",
                  # the rows with something to show: a planned study's has none, and no table
                  *tables.method_table([x for x in mine if x["diff"] is not None] if family else [], family, level,
                                       "comparison", lambda x: x["label"])]
    lines += _secondary_tables(r, level)
    lines += [*tables.diagnosis_table(r["diagnosis"], [es["name"] for es in r["eval_sets"]]), ""]
    lines += _references_table(r, level)
    lines += ["**Missing records.**", ""]
    lines += [f"- `{c}` ({_where(c)})" for c in r["missing"] + r.get("references_missing", [])] or [
        "None: every declared cell and the start have their record."]
    lines += ["", "**Amendments.**", ""]
    lines += [f"- {a['date']}: declaration `{a['declaration']}`: {a['reason']}" for a in r["amendments"]] or [
        "None: the declaration is the one its records were made under." if r["declaration"] else
        "None declared; the declaration is not bound to the records (no start record, or one made before the "
        "binding: `slmsql study run` binds it)."]
    lines += ["", "**Provenance.**", ""]
    if r["start"] is not None:
        lines += [f"Start: fingerprint `{r['start']['fingerprint']}` (its policy and band; every cell's record names "
                  "the same)." + (f" Declaration: `{r['declaration']}` (its Holm family, alpha, eval sets' files and "
                                  "databases; bound in the start's record)." if r["declaration"] else ""), ""]
    return "\n".join(lines + _provenance_table(r["provenance"]))


def _secondary_tables(r: dict, level: str) -> list[str]:
    """The comparisons declared outside the Holm family: each p unadjusted ("p (Holm)" is the same p), each verdict
    at alpha alone; supporting evidence, not the study's answer."""
    if not r.get("secondary"):
        return []
    out = ["**Secondary comparisons.** Declared outside the Holm family: each row's p is unadjusted (its \"p "
           "(Holm)\" is a family of one) and its verdict is at alpha alone; they support the answer, they are not "
           "it.", ""]
    several = len(r["seeds"]) > 1
    for es in r["eval_sets"]:
        mine = [x for x in r["secondary"] if x["eval_set"] == es["name"]]
        if mine:
            out += [f"**{es['name']}** (secondary): n = {'n/a' if es['n'] is None else es['n']}; starting EX "
                    f"{pct(es['ex_b'])}.", "",
                    *tables.pooled_table(mine, level, "comparison", lambda x: x["label"], "EX compared with"), "",
                    *tables.method_table([x for x in mine if x["diff"] is not None] if several else [], 1, level,
                                         "comparison", lambda x: x["label"])]
    return out


def _references_table(r: dict, level: str) -> list[str]:
    """The references (evaluated, not trained): EX and beside the start, descriptive."""
    if not r.get("references"):
        return []
    out = [f"**References.** Policies evaluated beside the start, not trained: outside the Holm family, so their "
           f"differences carry no verdict (McNemar's exact p, unadjusted; {level} intervals: Wilson for EX, exact "
           "for the paired difference).", "",
           "| reference | model | eval set | n | EX [CI] | minus the start's EX, points [CI] | McNemar p |",
           "|---|---|---|---:|---|---|---:|"]
    for ref in r["references"]:
        model = f"`{ref['model']}`" + (f" + `{ref['adapter']}`" if ref["adapter"] else "")
        for x in ref["sets"]:
            out.append(f"| {ref['name']} | {model} | {x['eval_set']} | {x['n']} | {pct(x['ex'])} "
                       f"[{pct(x['ex_ci_low'])}, {pct(x['ex_ci_high'])}] | {pts(x['diff'])} [{bound(x['diff_ci_low'])}, "
                       f"{bound(x['diff_ci_high'])}] | {pval(x['mcnemar_p'])} |")
    return out + [""]


def _provenance_table(prov: list[dict]) -> list[str]:
    """Which machine (float path) and code produced which cell: cells pool only where the study accepts the code,
    and a float path that differs is there to see."""
    if not prov:
        return ["No records yet."]
    keys = list(dict.fromkeys(k for p in prov for k in p["float_path"]))
    paths = {json.dumps(p["float_path"], sort_keys=True) for p in prov}
    codes = {p["code_version"] for p in prov}
    pooled = (" Cells from different float paths pool: a float path decides near-ties, not what a cell was "
              "trained and scored with (docs/stages/study.md \"Float paths\")." if len(paths) > 1 else "")
    out = [f"{len(paths)} float path(s), {len(codes)} code version(s).{pooled}", "",
            "| cell | code version |" + "".join(f" {k} |" for k in keys), "|---|---|" + "---|" * len(keys)]
    for p in prov:  # no finishing times here (they are in report.json): the same results read the same
        out.append(f"| {p['cell']} | {p['code_version']} |" + "".join(f" {p['float_path'].get(k, '')} |" for k in keys))
    return out


# ---- forest.png and the files ---------------------------------------------------------------------------------

def forest(report: dict):
    """Each comparison's difference with its interval, per eval set; grey dots: single seeds; hollow, dashed: no
    verdict (records missing)."""
    from slmsql.tracking.figures import forest_figure

    return forest_figure(report, label="label")


def write(folder, report: dict) -> None:
    """report.json, report.md and forest.png into `folder`. All three are made in memory first and each is
    replaced in one rename (tmp + os.replace): an error leaves the previous files as they were, no partial one."""
    folder = Path(folder)
    data = {"report.json": (dumps(report, indent=2, allow_nan=False) + "\n").encode("utf-8"),
            "report.md": (markdown(report) + "\n").encode("utf-8"), "forest.png": _png(report)}
    tmps = []
    try:
        for name in FILES:
            tmp = folder / f".{name}.tmp"
            tmps.append(tmp)
            tmp.write_bytes(data[name])
        for tmp, name in zip(tmps, FILES):
            os.replace(tmp, folder / name)
    finally:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)


def _png(report: dict) -> bytes:
    import matplotlib.pyplot as plt

    fig = forest(report)
    try:
        buf = io.BytesIO()
        # no "Software" stamp (matplotlib's version): the same records give the same bytes
        fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
        return buf.getvalue()
    finally:
        plt.close(fig)
