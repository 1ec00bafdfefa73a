"""Plan: size a study by power from a pilot (`power.plan` per comparison), before the study runs.

The pilot's report (a sweep's `report/sweep.json`, or a study's `report.json`: a one-cell study is a pilot too)
carries each comparison's difference and variance components (`seedstats.summary`); without one, a one-seed pilot's discordance and difference (and a between-seed sd from
elsewhere) stand in. Writes plan.json and plan.md, logged to an MLflow run: the declared plan is in the store
before the study that follows it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from slmsql.errors import DataError
from slmsql.inputs.data import write_json
from slmsql.runtime.outputs import Staged
from slmsql.stats.inference import StatsError
from slmsql.stats.power import Components, check_target, plan, seed_variance_interval

NEEDED = ("eval_set", "n", "diff", "var_question", "var_within", "var_seed")  # and a name: variant or label


def comparisons(cfg) -> tuple[list[dict], int, int, list[str]]:
    """(label, effect, n, Components) per comparison to plan, the pilot's seeds, its family size, and notes on
    what the plan rests on (printed with it)."""
    if not cfg.pilot:
        if not cfg.discordance:
            raise DataError("give --pilot (a sweep's report/sweep.json or a study's report.json) or --discordance "
                            "with --effect",
                            "command line", field="pilot")
        if not cfg.n:
            raise DataError("without --pilot, give the design's questions", "command line", field="n")
        seed_sd = None if cfg.seed_sd < 0 else cfg.seed_sd
        try:
            c = Components.from_discordance(cfg.discordance, cfg.effect, seed_sd)
        except ValueError as e:
            raise DataError(str(e), "command line", field="discordance") from None
        notes = [] if cfg.effect else [
            "--discordance without --effect plans for an effect of 0, which no design detects (its power is the "
            "test's level; no number of questions reaches the target); its minimum detectable difference takes the "
            "whole discordance as variance, the most it can be. For the sizing table give --effect (the pilot's "
            "difference, or the smallest gain worth finding)."]
        return [{"label": "given", "effect": cfg.effect, "n": cfg.n, "components": c}], 1, 1, notes
    path = Path(cfg.pilot)
    try:
        rep = json.loads(path.read_text(encoding="utf-8"))
        rows = rep["rows"]
    except FileNotFoundError:
        raise DataError("no such file", path, field="pilot") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"not a sweep's or a study's report: {e}", path, field="pilot") from None
    out = []
    for i, r in enumerate(rows):
        missing = [k for k in NEEDED if k not in r] + ([] if "variant" in r or "label" in r else ["variant"])
        if missing:
            raise DataError(f"rows[{i}] has no {missing[0]}: a report from before the variance components; "
                            "rerun the sweep or `slmsql study report` to rewrite it", path, field=missing[0])
        if cfg.eval_sets and r["eval_set"] not in cfg.eval_sets:
            continue
        var_seed = r["var_seed"] if r["var_seed"] is not None else (None if cfg.seed_sd < 0 else cfg.seed_sd ** 2)
        out.append({"label": f"{r.get('variant') or r['label']} / {r['eval_set']}", "effect": cfg.effect or r["diff"], "n": r["n"],
                    "components": Components(r["var_question"], r["var_within"], var_seed)})
    if not out:
        raise DataError(f"no comparison on eval sets {cfg.eval_sets}", path, field="eval_sets")
    seeds = len(rep.get("seeds", [])) or 1
    return out, seeds, len(rows), pilot_notes(cfg, seeds)


def pilot_notes(cfg, seeds: int) -> list[str]:
    """What a plan from a pilot rests on: its effect (unless --effect) and its between-seed variance's df."""
    notes = []
    if not cfg.effect:
        notes.append("The effect planned for is each comparison's own pilot difference: an estimate from a small "
                     "study, and one that looked good enough to follow up overstates the true effect on average "
                     "(the winner's curse), so the power at it is optimistic. Plan for the smallest gain worth "
                     "finding with --effect where you can name one.")
    if seeds >= 2:
        lo, hi = seed_variance_interval(seeds)
        notes.append(f"The between-seed variance comes from {seeds} pilot seeds: {seeds - 1} degree(s) of freedom; "
                     f"the true one may be {lo:.2g} to {hi:.4g} times the estimate (95% chi-square interval), so the "
                     "method's (over seeds) power and sizes are rough." + (
                         " Give --seed-sd from a study with more seeds where you have one." if seeds <= 3 else ""))
    return notes


def row_notes(p: dict) -> list[str]:
    """Notes on one comparison's plan: no variance at all, or an effect of 0."""
    c = p["components"]
    notes = []
    if c["var_question"] == c["var_within"] == 0 and not c["var_seed"]:
        notes.append("its pilot differences have no variance (the pilot changed no answer, or every seed changed "
                     "the same ones the same way): any gain > 0 is detected, which holds only as far as a study "
                     "varies as little as its pilot did")
    if p["effect"] == 0:
        notes.append("an effect of 0 is detected by no design: the sizing table is 'not reachable'")
    return notes


def markdown(plans: list[dict], notes: list[str]) -> str:
    pts = lambda x: ("n/a" if x is None else "not reachable" if math.isinf(x) else "any gain > 0" if x == 0  # noqa: E731
                     else f"{100 * x:.1f}")
    pc = lambda x: "n/a" if x is None else f"{x:.0%}"  # noqa: E731
    lines = [f"Note: {n}\n" for n in notes]
    for p in plans:
        lines += [f"**{p['label']}**: effect {100 * p['effect']:+.1f} points; design {p['seeds']} seed(s) x "
                  f"{p['n']} questions, Holm family {p['family']} at alpha {p['alpha']} (planned at alpha / "
                  f"{p['family']})", "",
                  f"- power at the effect: {pc(p['power_pooled'])} for these seeds (pooled), "
                  f"{pc(p['power_method'])} for the method (seeds random)",
                  f"- minimum detectable difference at {p['target']:.0%} power, points: {pts(p['mdd_pooled'])} "
                  f"(pooled), {pts(p['mdd_method'])} (method)", "",
                  f"| seeds | questions for {p['target']:.0%} power, pooled | ... for the method |", "|---:|---:|---:|"]
        for s in p["sizes"]:
            method = "n/a" if p["power_method"] is None or s["seeds"] < 2 else _n(s["n_method"], p)
            lines.append(f"| {s['seeds']} | {_n(s['n_pooled'], p)} | {method} |")
        lines += [""] + [f"Note ({p['label']}): {n}" for n in p["notes"]] + ([""] if p["notes"] else [])
    return "\n".join(lines)


def _n(n, p: dict) -> str:
    return f"more than {p['max_n']}" if n is None else "not reachable" if math.isinf(n) else str(n)


def _json(v):
    """JSON has no inf: an MDD no gain up to 1 reaches, or a size no design reaches, is written "unreachable"."""
    if isinstance(v, dict):
        return {k: _json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json(x) for x in v]
    return "unreachable" if isinstance(v, float) and math.isinf(v) else v


def main(cfg) -> list[dict]:
    import mlflow

    from slmsql.tracking import runs as tracking

    rows, pilot_seeds, pilot_family, notes = comparisons(cfg)  # every check before the run starts
    family = cfg.family or pilot_family
    try:
        check_target(cfg.power, family, cfg.alpha)
    except StatsError as e:
        raise DataError(str(e), "command line", field="power") from None
    st = Staged(cfg.output_dir, cfg.overwrite)
    plans = [{"label": r["label"], **plan(r["components"], r["effect"], cfg.n or r["n"], cfg.seeds or pilot_seeds,
                                          family, cfg.alpha, cfg.power, cfg.max_seeds, cfg.max_n)} for r in rows]
    for p in plans:
        p["notes"] = row_notes(p)
    text = markdown(plans, notes)
    with tracking.stage_run("plan", cfg):
        with st:
            write_json(st.work / "plan.json", _json({"notes": notes, "plans": plans}))
            (st.work / "plan.md").write_text(text + "\n", encoding="utf-8")
        mlflow.log_artifacts(str(st.out))
        mlflow.log_metrics({"comparisons": len(plans)})
    print(f"\nslmsql plan\n\n{text}\nplan: {st.out}\n", flush=True)
    return plans
