"""The markdown tables of comparison rows that a sweep's report and a study's report both print: the pooled test's
(a verdict for the seeds trained) and the one with seeds random too (a verdict for the method). ASCII signs and
3-decimal p: the terminal tables docs/studies.md reproduces (the card uses stats.wording's)."""

from __future__ import annotations

from slmsql.stats.wording import pct


def pts(x) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}"


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
           f"[{level} CI] | p | p (Holm) | verdict |", f"|---|{'---:|' if base_column else ''}---:|---:|---|---|"
           "---:|---:|---|"]
    for r in rows:
        sd = "n/a" if r["ex_sd"] is None else f"{100 * r['ex_sd']:.1f}"
        start = f" {pct(r['ex_b'])} |" if base_column else ""
        out.append(f"| {label(r)} |{start} {pct(r['ex_mean'])} | {sd} | {pct(r['ex_min'])} - {pct(r['ex_max'])} | "
                   f"{pts(r['diff'])} [{pts(r['diff_ci_low'])}, {pts(r['diff_ci_high'])}] | {pv(r['p'])} | "
                   f"{pv(r['p_holm'])} | {_verdict(r)} |")
    return out


def method_table(rows: list[dict], family: int, head: str = "variant", label=lambda r: r["variant"]) -> list[str]:
    """The same comparisons with seeds as a random unit (stats/seedstats.py): what the pooled table says of the
    seeds trained, this says of the method; marked where the two verdicts differ. Empty without rows."""
    if not rows:
        return []
    out = [f"Over seeds (seeds a random unit too: a verdict for the method, not these seeds; Holm over "
           f"{family}):", "",
           f"| {head} | between-seed sd of the diff (points) | diff [CI] over seeds | df | p | p (Holm) | verdict |",
           "|---|---:|---|---:|---:|---:|---|"]
    for r in rows:
        df = "n/a" if r["seed_p"] is None else "inf" if r["seed_df"] is None else f"{r['seed_df']:.1f}"
        sd = "n/a" if r["var_seed"] is None else f"{100 * r['var_seed'] ** 0.5:.1f}"
        differs = f" (pooled: {r['verdict']})" if r["seed_verdict"] != r["verdict"] else ""
        verdict = r["seed_verdict"] if r["seed_verdict"] is not None else f"no verdict: {r.get('reason') or 'n/a'}"
        ci = f"[{pts(r['seed_diff_ci_low'])}, {pts(r['seed_diff_ci_high'])}]"
        out.append(f"| {label(r)} | {sd} | {pts(r['diff'])} {ci} | {df} | {pv(r['seed_p'])} | "
                   f"{pv(r['seed_p_holm'])} | {verdict}{differs} |")
    return out + [""]
