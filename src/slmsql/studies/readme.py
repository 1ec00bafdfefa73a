"""The result table of README.md and docs/index.md ("## The result it computes"), its study rows generated from
`studies/*/report.json` (scripts/results_table.py writes them; tests/test_study_report.py fails when the files say
otherwise).

The table sits between two marker lines, whole: an HTML comment inside a markdown table ends it (GitHub and
MkDocs both), so the markers wrap the table and the generator keeps its typed rows (the seed's published counts)
in place. A generated row is known by its first cell, which names its study's folder (`studies/NAME`); every
other row is typed and kept, above the generated ones.

A study shows each of its declared comparisons, or those its plan lists under `readme` (comparison indexes or
eval set names). The table holds only rows with numbers: a study with no records is named on a line under it,
"declared, not yet run", and one with records missing on another, with how many of its cells are recorded. The
interval is the comparison's own (unadjusted) 95% interval, the p its Holm-adjusted p, and the header says so; a
bound that rounds to 0 shows its side of 0 (stats.wording.bound). A study's references (policies it evaluates but does
not train) follow its rows on the same eval sets, their difference from the start descriptive, with no verdict.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from slmsql.errors import DataError
from slmsql.stats.wording import bound, pct, pts, pval

BEGIN = "<!-- generated: studies/*/report.json (scripts/results_table.py) -->"
END = "<!-- end generated -->"
FILES = ("README.md", "docs/index.md")
MARK = "| `studies/"  # how a generated row begins
NONE = "—"
HEADER = ["| experiment | eval set (n) | before → after GRPO | difference [unadjusted 95% CI] | p (Holm-adjusted, or "
          "family of 1) | verdict |", "|---|---|---|---|---|---|"]
NOT_RUN = "Declared, not yet run (no records):"  # the lines under the table begin so
RUNNING = "Records not all in (no numbers until they are):"


def reports(root) -> list[tuple[str, dict]]:
    """(folder name, report) of every `studies/*/report.json` under root, by folder name."""
    out = []
    for path in sorted(Path(root).glob("studies/*/report.json")):
        try:
            out.append((path.parent.name, json.loads(path.read_text(encoding="utf-8"))))
        except json.JSONDecodeError as e:
            raise DataError(f"malformed JSON: {e.msg}", path, e.lineno) from None
    return out


def rows(name: str, report: dict, where="report.json") -> list[str]:
    """A study's table rows: one per comparison shown; none for a study with records missing (`waiting`)."""
    shown = _shown(report, where)
    if report["missing"]:  # the study, not only a row: its claims wait for its records
        return []
    out = []
    for i, r in enumerate(shown):
        what = f"`studies/{name}`: {report['title'] if i == 0 else 'same study'} ({r['label']})"
        n = NONE if r["n"] is None else r["n"]
        p = f"Holm {pval(r['p_holm'])}" if report["comparisons"] > 1 else f"{pval(r['p'])} (family of 1)"
        verdict = r["verdict"]
        if r["seed_verdict"] is not None and r["seed_verdict"] != verdict:
            verdict += f"; over seeds: {r['seed_verdict']}"
        cells = [what, f"{r['eval_set']} ({n})", f"{pct(r['ex_b'])} → {pct(r['ex_mean'])}",
                 f"{pts(r['diff'])} [{bound(r['diff_ci_low'])}, {bound(r['diff_ci_high'])}]", p, verdict]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    sets = {r["eval_set"] for r in shown}
    for ref in report.get("references") or []:  # evaluated beside the start, not trained: no verdict
        model = f"`{ref['model']}`" + (" with an adapter" if ref["adapter"] else "")
        for x in (x for x in ref["sets"] if x["eval_set"] in sets):
            cells = [f"`studies/{name}`: same study (reference {ref['name']}: {model}, not trained)",
                     f"{x['eval_set']} ({x['n']})", f"start {pct(x['ex_start'])}; reference {pct(x['ex'])}",
                     f"{pts(x['diff'])} [{bound(x['diff_ci_low'])}, {bound(x['diff_ci_high'])}]",
                     f"McNemar {pval(x['mcnemar_p'])}, unadjusted", "a reference: outside the family, no verdict"]
            out.append("| " + " | ".join(cells) + " |")
    return out


def waiting(studies: list[tuple[str, dict]]) -> list[str]:
    """The lines under the table for the studies without numbers: those with no record at all, then those with
    records missing (how many of their cells are in). Empty when every study has its records."""
    none, some = [], []
    for name, rep in studies:
        rec = rep["records"]
        if not rep["missing"]:
            continue
        if rec["cells"] == 0 and not rec["start"]:
            none.append(f"`studies/{name}` ({rep['title']})")
        else:
            start = "" if rec["start"] else ", no start record"
            some.append(f"`studies/{name}` ({rec['cells']} of {rec['declared']} cells{start})")
    return [f"{head} {', '.join(names)}." for head, names in ((NOT_RUN, none), (RUNNING, some)) if names]


def _shown(report: dict, where) -> list[dict]:
    chosen = (report.get("plan") or {}).get("readme")
    if chosen is None:
        return report["rows"]
    sets = {es["name"] for es in report["eval_sets"]}
    if not isinstance(chosen, list) or any(not (c in sets or (isinstance(c, int) and 0 <= c < len(report["rows"])))
                                           for c in chosen):
        raise DataError(f"expected a list of comparison indexes (0 to {len(report['rows']) - 1}) or eval set names "
                        f"{sorted(sets)}, got {chosen!r}", where, field="plan.readme")
    return [r for r in report["rows"] if r["index"] in chosen or r["eval_set"] in chosen]


def generated(root) -> tuple[list[str], list[str]]:
    """Every study's rows, by folder name, and the lines under the table (`waiting`)."""
    root = Path(root)
    studies = reports(root)
    return ([line for name, rep in studies for line in rows(name, rep, root / "studies" / name / "report.json")],
            waiting(studies))


def rewrite(text: str, new_rows: list[str], path="README.md", notes: list[str] = ()) -> str:
    """`text` with its marked table's generated rows replaced by `new_rows` (typed rows kept, first) and the lines
    under it by `notes`; the header is HEADER."""
    lines = text.split("\n")
    try:
        begin, end = lines.index(BEGIN), lines.index(END)
    except ValueError:
        raise DataError(f"no marked table: expected a line {BEGIN!r} and, after it, a line {END!r}", path) from None
    if end < begin:
        raise DataError(f"{END!r} before {BEGIN!r}", path, end + 1)
    table = [x for x in lines[begin + 1:end] if x.strip() and not x.startswith((NOT_RUN, RUNNING))]
    for i, x in enumerate(lines[begin + 1:end], begin + 2):
        if x.strip() and not x.startswith(("|", NOT_RUN, RUNNING)):
            raise DataError("between the markers only the table is generated: move this line out", path, i)
    if len(table) < 2:
        raise DataError("no table between the markers (a header line and a |---| line)", path, begin + 1)
    typed = [x for x in table[2:] if not x.startswith(MARK)]
    under = [x for note in notes for x in (note, "")]
    return "\n".join(lines[:begin + 1] + ["", *HEADER, *typed, *new_rows, "", *under] + lines[end:])


def update(root, check: bool = False) -> list[str]:
    """Rewrite FILES under root (check: write nothing); returns the files that were (or would be) changed."""
    root = Path(root)
    (new_rows, notes), changed = generated(root), []
    for name in FILES:
        path = root / name
        text = path.read_text(encoding="utf-8")
        new = rewrite(text, new_rows, path, notes)
        if new != text:
            changed.append(name)
            if not check:  # whole or not at all: a reader never sees half a README
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(new, encoding="utf-8")
                os.replace(tmp, path)
    return changed
