"""Plan: size a study by power from a pilot sweep (`power.plan` per comparison), before the study runs.

The pilot's report (`report/sweep.json`) carries each comparison's difference and variance components
(`seedstats.summary`); without one, a one-seed pilot's discordance and difference (and a between-seed sd from
elsewhere) stand in. Writes plan.json and plan.md, logged to an MLflow run: the declared plan is in the store
before the study that follows it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..data import write_json
from ..errors import DataError
from ..outputs import Staged
from ..power import Components, plan

NEEDED = ("variant", "eval_set", "n", "diff", "var_question", "var_within", "var_seed")


def comparisons(cfg) -> tuple[list[dict], int, int]:
    """(label, effect, n, Components) per comparison to plan, the pilot's seeds and its family size."""
    if not cfg.pilot:
        if not cfg.discordance:
            raise DataError("give --pilot (a sweep's report/sweep.json) or --discordance with --effect",
                            "command line", field="pilot")
        if not cfg.n:
            raise DataError("without --pilot, give the design's questions", "command line", field="n")
        seed_sd = None if cfg.seed_sd < 0 else cfg.seed_sd
        try:
            c = Components.from_discordance(cfg.discordance, cfg.effect, seed_sd)
        except ValueError as e:
            raise DataError(str(e), "command line", field="discordance") from None
        return [{"label": "given", "effect": cfg.effect, "n": cfg.n, "components": c}], 1, 1
    path = Path(cfg.pilot)
    try:
        rep = json.loads(path.read_text(encoding="utf-8"))
        rows = rep["rows"]
    except FileNotFoundError:
        raise DataError("no such file", path, field="pilot") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"not a sweep report (report/sweep.json): {e}", path, field="pilot") from None
    out = []
    for i, r in enumerate(rows):
        missing = [k for k in NEEDED if k not in r]
        if missing:
            raise DataError(f"rows[{i}] has no {missing[0]}: a report from before the variance components; "
                            "rerun the sweep (it reuses its cells) to rewrite it", path, field=missing[0])
        if cfg.eval_sets and r["eval_set"] not in cfg.eval_sets:
            continue
        var_seed = r["var_seed"] if r["var_seed"] is not None else (None if cfg.seed_sd < 0 else cfg.seed_sd ** 2)
        out.append({"label": f"{r['variant']} / {r['eval_set']}", "effect": cfg.effect or r["diff"], "n": r["n"],
                    "components": Components(r["var_question"], r["var_within"], var_seed)})
    if not out:
        raise DataError(f"no comparison on eval sets {cfg.eval_sets}", path, field="eval_sets")
    return out, len(rep.get("seeds", [])) or 1, len(rows)


def markdown(plans: list[dict]) -> str:
    pts = lambda x: "n/a" if x is None else "not reachable" if math.isinf(x) else f"{100 * x:.1f}"  # noqa: E731
    pc = lambda x: "n/a" if x is None else f"{x:.0%}"  # noqa: E731
    lines = []
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
        lines.append("")
    return "\n".join(lines)


def _n(n: int | None, p: dict) -> str:
    return f"more than {p['max_n']}" if n is None else str(n)


def main(cfg) -> list[dict]:
    import mlflow

    from .. import tracking

    rows, pilot_seeds, pilot_family = comparisons(cfg)  # every check before the run starts
    st = Staged(cfg.output_dir, cfg.overwrite)
    plans = [{"label": r["label"], **plan(r["components"], r["effect"], cfg.n or r["n"], cfg.seeds or pilot_seeds,
                                          cfg.family or pilot_family, cfg.alpha, cfg.power, cfg.max_seeds,
                                          cfg.max_n)} for r in rows]
    text = markdown(plans)
    with tracking.stage_run("plan", cfg):
        with st:
            # JSON has no inf: an MDD no gain up to 1 reaches is written "unreachable"
            write_json(st.work / "plan.json", {"plans": [{k: "unreachable" if v == math.inf else v
                                                          for k, v in p.items()} for p in plans]})
            (st.work / "plan.md").write_text(text + "\n", encoding="utf-8")
        mlflow.log_artifacts(str(st.out))
        mlflow.log_metrics({"comparisons": len(plans)})
    print(f"\nslmsql plan\n\n{text}\nplan: {st.out}\n", flush=True)
    return plans
