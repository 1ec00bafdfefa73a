"""The markdown tables of comparison rows that a sweep's report and a study's report both print: the pooled test's
(a verdict for the seeds trained) and the one with seeds random too (a verdict for the method); and a study's
diagnosis per arm, which the card of one of its cells prints too (stages/publish.py). ASCII signs and
3-decimal p: the terminal tables docs/studies.md reproduces (the card's own tables use stats.wording's)."""

from __future__ import annotations

from slmsql.stats.wording import bound, pct


def pts(x) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}"


def ci(low, high) -> str:
    """An interval in points, ASCII signs; a bound that rounds to 0 shows its side of 0 (stats.wording.bound)."""
    return f"[{bound(low, '-')}, {bound(high, '-')}]"


def pv(p) -> str:
    return "n/a" if p is None else "< 0.001" if p < 0.001 else f"{p:.3f}"


def _verdict(r: dict) -> str:
    return r["verdict"] if r["verdict"] is not None else f"no verdict: {r.get('reason') or 'n/a'}"


def pooled_table(rows: list[dict], level: str, head: str = "variant", label=lambda r: r["variant"],
                 base_column: str = "") -> list[str]:
    """One line per row: EX over seeds, the difference with its interval, p, Holm's p and the verdict (a row
    without one says why). `base_column`: a column of each row's own `ex_b`, headed so (a sweep's start axis:
    "start EX"; a study's rows against the start or another arm)."""
    out = [f"| {head} |{f' {base_column} |' if base_column else ''} EX mean | sd (points) | min - max | diff, points "
           f"[{level} CI, unadjusted] | p (unadjusted) | p (Holm) | verdict |", f"|---|{'---:|' if base_column else ''}---:|---:|---|---|"
           "---:|---:|---|"]
    for r in rows:
        sd = "n/a" if r["ex_sd"] is None else f"{100 * r['ex_sd']:.1f}"
        start = f" {pct(r['ex_b'])} |" if base_column else ""
        out.append(f"| {label(r)} |{start} {pct(r['ex_mean'])} | {sd} | {pct(r['ex_min'])} - {pct(r['ex_max'])} | "
                   f"{pts(r['diff'])} {ci(r['diff_ci_low'], r['diff_ci_high'])} | {pv(r['p'])} | "
                   f"{pv(r['p_holm'])} | {_verdict(r)} |")
    return out


def method_table(rows: list[dict], family: int, level: str, head: str = "variant",
                 label=lambda r: r["variant"]) -> list[str]:
    """The same comparisons with seeds as a random unit (stats/seedstats.py): what the pooled table says of the
    seeds trained, this says of the method; marked where the two verdicts differ. Empty without rows. The sd
    column is the spread of the per-seed differences (each seed's EX minus its comparison's), which the test's
    t on seeds - 1 df is built on."""
    if not rows:
        return []
    out = [f"Over seeds (seeds a random unit too: a verdict for the method, not these seeds; Holm over "
           f"{family}):", "",
           f"| {head} | sd of the per-seed differences (points) | diff [{level} CI, unadjusted] over seeds | df | "
           "p (unadjusted) | p (Holm) | verdict |",
           "|---|---:|---|---:|---:|---:|---|"]
    for r in rows:
        df = "n/a" if r["seed_p"] is None else "inf" if r["seed_df"] is None else f"{r['seed_df']:.1f}"
        sd = "n/a" if r.get("seed_diff_sd") is None else f"{100 * r['seed_diff_sd']:.1f}"
        differs = f" (pooled: {r['verdict']})" if r["seed_verdict"] != r["verdict"] else ""
        verdict = r["seed_verdict"] if r["seed_verdict"] is not None else f"no verdict: {r.get('reason') or 'n/a'}"
        out.append(f"| {label(r)} | {sd} | {pts(r['diff'])} {ci(r['seed_diff_ci_low'], r['seed_diff_ci_high'])} | "
                   f"{df} | {pv(r['seed_p'])} | "
                   f"{pv(r['seed_p_holm'])} | {verdict}{differs} |")
    return out + [""]


def diagnosis_table(arms: list[dict], eval_sets: list[str]) -> list[str]:
    """Per arm, why it gained or did not (a study report's `diagnosis`, studies/report.py): its training log's
    figures, means over its seeds ("not recorded": records from before the diagnosis), and the questions it turned
    right and wrong against the start on each eval set; under an arm of several seeds, a row for each seed."""
    out = ["**Diagnosis.** Per arm, means over its recorded seeds, then each seed on its own row: the sampled "
           "training pass rate of the first and last 10 logged steps, the share of groups whose correctness varied "
           "and of groups with zero reward variance, completions cut at the token budget (first and last 10 steps), "
           "the mean reward std, gradient norm and completion length (tokens) over the logged steps, "
           "how many steps drew each band question (min-max), and the questions the start got wrong and the cell "
           "right (turned right) and the reverse, per eval set. \"not recorded\": its records predate the "
           "diagnosis.", "",
           "| arm | seeds | train pass rate, first -> last 10 steps | groups varying | zero reward std | cut at the "
           "token budget, first -> last 10 | reward std | grad norm | length | draws per band question |"
           + "".join(f" {es}: turned right / wrong |" for es in eval_sets),
           "|---|---|---|---:|---:|---|---:|---:|---:|---|" + "---:|" * len(eval_sets)]
    for a in arms:
        lacking = [s for s in a["seeds"] if s not in a["diagnosed"]]
        seeds = (", ".join(map(str, a["seeds"])) or "none recorded") + (
            f" (diagnosis not recorded: {', '.join(map(str, lacking))})" if lacking and a["diagnosed"] else "")
        figures = _figures(a) if a["diagnosed"] else ["not recorded" if a["seeds"] else "n/a"] * COLUMNS
        turned = [f"{t['right']:.1f} / {t['wrong']:.1f}" if t else "n/a" for t in (a["turned"][es] for es in eval_sets)]
        out.append(f"| {a['arm']} | {seeds} |" + "".join(f" {x} |" for x in figures + turned))
        for c in a.get("cells", []) if len(a["seeds"]) > 1 else []:  # reports from before per-seed rows have none
            figures = _figures(c["diagnosis"]) if c["diagnosis"] else ["not recorded"] * COLUMNS
            turned = [f"{t['right']} / {t['wrong']}" if t else "n/a" for t in (c["turned"][es] for es in eval_sets)]
            out.append(f"| {a['arm']} | seed {c['seed']} |" + "".join(f" {x} |" for x in figures + turned))
    return out


COLUMNS = 8  # the training-log columns of a row


def _figures(d: dict) -> list[str]:
    """The training-log columns of one row, from an arm's means or one seed's figures (the same keys; a record
    from before the telemetry lacks reward_std, grad_norm and length: n/a)."""
    draws = "n/a" if d["draws_min"] is None else f"{d['draws_min']}-{d['draws_max']}"
    num = lambda k, form: "n/a" if d.get(k) is None else form.format(d[k])  # noqa: E731
    return [_first_last(d, "pass", "{:.2f}"), _share(d["groups_vary"]), _share(d["zero_std"]),
            _first_last(d, "cut", "{:.0%}"), num("reward_std", "{:.2f}"), num("grad_norm", "{:.2f}"),
            num("length", "{:.0f}"), draws]


def _first_last(arm: dict, name: str, form: str) -> str:
    first, last = arm[f"{name}_first10"], arm[f"{name}_last10"]
    return "n/a" if first is None or last is None else f"{form.format(first)} -> {form.format(last)}"


def _share(x) -> str:
    return "n/a" if x is None else f"{x:.0%}"
