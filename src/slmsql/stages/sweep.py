"""Sweep: GRPO variants x training seeds from a starting policy and its RL set, compared with that policy.
Several starts (`--model A,B`, each with its own `--data`) make a start axis: every variant x seed trains from
each, each cell is compared with its own start, and the table (one Holm family) holds them all.

plan (grid, cell configs, files, baseline runs: all checked before any run starts) -> baseline evaluations
(the given runs, or the starting policy evaluated once per eval set) -> cells: `grpo`, then `evaluate` on
every eval set against the baseline, each a child run of this one, reused when a finished run with the same
parameters and code version exists (`slmsql.workflow.steps`) -> report.

Every cell logs the same metric names (grpo's, evaluate's `ex` and `vs_baseline/*`) and carries the tags
`slmsql.variant` and `slmsql.seed`, so MLflow's compare view lines them up. The report pools each variant's
seeds per eval set (`inference.compare_seeds`: mean EX, between-seed sd / min / max, a paired t-test per question
with its interval), adjusts the p-values by Holm over every variant x eval set (the whole table is one family:
a verdict anywhere in it is a claim), and takes the verdict from the adjusted p. That verdict is about the
seeds trained; each comparison is also made with the seeds as a random unit (`seedstats.summary`: a verdict for the
method, with its own Holm over the same family), shown beside it where there are 2 seeds or more. The interval
and the unadjusted p are per comparison and agree with each other; the Holm p is what can make a verdict "no
significant difference" where that interval excludes 0 (significant alone, not after trying every variant).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from slmsql import configs
from slmsql.configs import EvaluateConfig, GRPOStageConfig, SweepConfig, Variant, param_text
from slmsql.errors import DataError, SlmsqlError
from slmsql.inputs.data import read_jsonl, write_json
from slmsql.runtime.outputs import Staged
from slmsql.stats import inference, seedstats
from slmsql.stats.wording import pct
from slmsql.studies import compare, tables
from slmsql.workflow.steps import project_path

log = logging.getLogger(__name__)
# fields of a cell's evaluate run that the sweep sets itself (the rest come from --evaluate-recipe / overrides)
EVAL_OWNED = ("model", "adapter", "data", "db_root", "dataset_name", "baseline_run", "predictions", "alpha")
STEP_OWNED = ("output_dir", "experiment", "run_name", "overwrite", "resume", "seed")  # set per step
ROW_KEYS = ("ex_mean", "ex_sd", "ex_min", "ex_max", "diff", "diff_ci_low", "diff_ci_high", "p", "p_holm", "verdict",
            "seed_diff_ci_low", "seed_diff_ci_high", "seed_p", "seed_p_holm", "seed_verdict")


@dataclass(frozen=True)
class EvalSet:
    name: str
    data: str
    db_root: str


@dataclass(frozen=True)
class Start:
    """A starting policy and its RL data: each start's cells are compared with that start's own evaluation."""
    name: str
    model: str
    base_adapter: str
    data: str
    eval_set: EvalSet | None = None  # --start-eval-data: an eval set of this start's own (its RL band, say)


@dataclass
class Plan:
    variants: list[Variant]  # with several starts, one per start x grid variant, labelled `start=NAME ...`
    grpo: dict  # variant label -> GRPOStageConfig of its cells (seed, output_dir set per cell)
    evaluate: EvaluateConfig  # every evaluation's options but what EVAL_OWNED names
    eval_sets: list[EvalSet]
    seeds: list[int]
    starts: list[Start] = dataclasses.field(default_factory=list)
    start_of: dict = dataclasses.field(default_factory=dict)  # variant label -> its Start

    def sets_of(self, start: Start | None) -> list[EvalSet]:
        """The eval sets a start's cells are scored on: the shared ones, then the start's own, if any."""
        own = getattr(start, "eval_set", None)
        return self.eval_sets + ([own] if own else [])


def _local(path: str) -> str:
    """A local path as the steps find it (`workflow.project_path`), a Hub id kept as given."""
    return project_path(path) if path and Path(path).exists() else path


def _overrides(cfg: SweepConfig, variants: list[Variant]) -> dict:
    by_stage = {"grpo": {}, "evaluate": {}}
    axes = {k for v in variants for k in v.settings}
    for key, value in cfg.overrides.items():
        stage, _, name = key.partition(".")
        cls = {"grpo": GRPOStageConfig, "evaluate": EvaluateConfig}.get(stage)
        if cls is None or name not in {f.name for f in configs.fields(cls)}:
            raise DataError("expected grpo.FIELD or evaluate.FIELD, naming a field of that stage", "--overrides",
                            field=key)
        owned = configs.SWEEP_OWNED if stage == "grpo" else {**{k: "the sweep" for k in EVAL_OWNED},
                                                              **{k: "the sweep" for k in STEP_OWNED}}
        if name in owned:
            raise DataError(f"set by {owned[name]}, not by --overrides", "--overrides", field=key)
        if stage == "grpo" and name in axes:
            raise DataError("also an axis of --grid: the grid's values would not be what ran", "--overrides",
                            field=key)
        by_stage[stage][name] = value
    return by_stage


def starts(cfg: SweepConfig) -> list[Start]:
    """--model (one or more) with its --base-adapter, --data and --start-names, one Start each."""
    n = len(cfg.model)
    if not n:
        raise DataError("give a starting policy", "command line", field="model")
    for field, values in (("base_adapter", cfg.base_adapter), ("start_names", cfg.start_names)):
        if values and len(values) != n:
            raise DataError(f"{len(values)} given for {n} --model: give one per --model", "command line", field=field)
    if len(cfg.data) not in (1, n):
        raise DataError(f"{len(cfg.data)} given for {n} --model: give one RL file for all, or one per --model",
                        "command line", field="data")
    names = cfg.start_names or [Path(m.rstrip("/")).name or m for m in cfg.model]
    if len(set(names)) != n:
        raise DataError(f"start names must differ, got {names}", "command line", field="start_names")
    if n > 1 and cfg.baseline_runs:
        raise DataError("one per eval set is for one start: with several, the sweep evaluates each start itself",
                        "command line", field="baseline_runs")
    return [Start(*x) for x in zip(names, cfg.model, cfg.base_adapter or [""] * n, cfg.data * n if len(cfg.data) == 1
                                   else cfg.data)]


def plan(cfg: SweepConfig) -> Plan:
    """Everything the sweep will run, checked before anything runs."""
    grid = configs.parse_grid(cfg.grid)
    by_stage = _overrides(cfg, grid)
    base = configs.load(GRPOStageConfig, cfg.grpo_recipe or None, by_stage["grpo"], require=False)
    grpo, seen, variants, start_of, all_starts = {}, {}, [], {}, starts(cfg)
    for st in all_starts:
        fixed = dict(model=_local(st.model), base_adapter=_local(st.base_adapter), data=_local(st.data),
                     db_root=_local(cfg.db_root), experiment=cfg.experiment)
        for g in grid:
            v = g if len(all_starts) == 1 else Variant(f"start={st.name} {g.label}", g.settings)
            settings = dict(v.settings)
            if "trainer_args" in settings:
                settings["trainer_args"] = {**base.trainer_args, **settings["trainer_args"]}
            vcfg = dataclasses.replace(base, **settings, **fixed)
            key = repr(sorted(configs.to_params(vcfg).items()))
            if key in seen:
                raise DataError(f"variants {seen[key]!r} and {v.label!r} are the same GRPO configuration", "--grid")
            seen[key] = v.label
            if st.base_adapter and vcfg.adapter_mode == "stack":
                raise SlmsqlError(f"variant {v.label!r}: adapter_mode=stack with --base-adapter trains an adapter on "
                                  "the merged start, which evaluate (one adapter on --model) cannot load; use continue")
            grpo[v.label], start_of[v.label] = vcfg, st
            variants.append(v)
    evaluate = configs.load(EvaluateConfig, cfg.evaluate_recipe or None, by_stage["evaluate"], require=False)

    n = len(cfg.eval_data)
    if not n:
        raise DataError("give at least one eval set", "command line", field="eval_data")
    names = cfg.eval_names or [Path(p).stem for p in cfg.eval_data]
    roots = cfg.eval_db_roots or [cfg.db_root] * n
    for field, values in (("eval_names", names), ("eval_db_roots", roots), ("baseline_runs", cfg.baseline_runs)):
        if values and len(values) != n:
            raise DataError(f"{len(values)} given for {n} eval files: give one per --eval-data file", "command line",
                            field=field)
    if len(set(names)) != n:
        raise DataError(f"eval set names must differ, got {names}", "command line", field="eval_names")
    for path, field in [*((p, "data") for p in cfg.data), *((p, "eval_data") for p in cfg.eval_data)]:
        if not Path(path).is_file():
            raise DataError("no such file", path, field=field)
    for path in {cfg.db_root, *roots}:
        if not Path(path).is_dir():
            raise DataError("no such database folder", path)
    for path in cfg.base_adapter:
        if not Path(path).exists():
            raise DataError("no such adapter folder", path, field="base_adapter")
    sets = [EvalSet(name, _local(data), _local(root)) for name, data, root in zip(names, cfg.eval_data, roots)]
    if cfg.start_eval_data:  # one file per start, scored under one name, each compared with its own start on it
        if len(cfg.start_eval_data) != len(all_starts):
            raise DataError(f"{len(cfg.start_eval_data)} given for {len(all_starts)} --model: give one per --model",
                            "command line", field="start_eval_data")
        if not cfg.start_eval_name or cfg.start_eval_name in names:
            raise DataError(f"needs a name that no --eval-names has, got {cfg.start_eval_name!r}", "command line",
                            field="start_eval_name")
        for path in cfg.start_eval_data:
            if not Path(path).is_file():
                raise DataError("no such file", path, field="start_eval_data")
        all_starts = [dataclasses.replace(st, eval_set=EvalSet(cfg.start_eval_name, _local(path), _local(cfg.db_root)))
                      for st, path in zip(all_starts, cfg.start_eval_data)]
        start_of = {label: all_starts[[s.name for s in all_starts].index(st.name)] for label, st in start_of.items()}
    return Plan(variants, grpo, evaluate, sets, [cfg.seed + i for i in range(cfg.seeds)], all_starts, start_of)


def slug(label: str) -> str:
    """A folder name for a variant."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_")[:100] or "variant"


def _params(cfg, skip=()) -> dict:
    return {k: param_text(v) for k, v in dataclasses.asdict(cfg).items() if k not in STEP_OWNED + tuple(skip)}


def _check_baselines(cfg: SweepConfig, sets: list[EvalSet]) -> dict:
    import mlflow

    from slmsql.tracking import runs as tracking

    client, runs = mlflow.MlflowClient(), {}
    for es, run_id in zip(sets, cfg.baseline_runs):
        run = tracking.stage_run_of(client, run_id, "evaluate", "baseline")
        if run.data.tags.get("slmsql.dataset") != es.name:
            raise SlmsqlError(f"baseline run {run_id} evaluated {run.data.tags.get('slmsql.dataset')!r}, not eval set "
                              f"{es.name!r}: give --baseline-runs in the order of --eval-data")
        runs[es.name] = run
    return runs


def _correct(steps, run) -> dict[str, bool]:
    return {str(r["id"]): bool(r["correct"]) for r in read_jsonl(steps.artifact(run, "results.jsonl"))}


def report(plan: Plan, cells: list[dict], correct: dict, alpha: float) -> dict:
    """The comparison table. `correct[run_id]` is an evaluate run's {question id: correct}; `cells` carry
    variant, seed and eval_runs {eval set: run id}; baselines are under the cells' `baseline_runs`. Its rows and
    Holm are a study report's too (studies/compare.py)."""
    rows = []
    for v in plan.variants:
        for es in plan.sets_of(plan.start_of.get(v.label)):
            mine = [c for c in cells if c["variant"] == v.label]
            base = correct[mine[0]["baseline_runs"][es.name]]
            ids = sorted(base)
            runs = []
            for c in mine:
                got = correct[c["eval_runs"][es.name]]
                if sorted(got) != ids:
                    raise SlmsqlError(f"evaluate run {c['eval_runs'][es.name]} scored other questions than its baseline")
                runs.append([got[i] for i in ids])
            start = getattr(plan.start_of.get(v.label), "name", "")
            rows.append({"variant": v.label, "start": start, "eval_set": es.name,
                         **compare.vs_start(runs, [base[i] for i in ids], alpha)})
    # the method's family: the same comparisons, where there are seeds to make a random unit of
    compare.adjust(rows, alpha, seed_family=[r for r in rows if r["seed_p"] is not None])
    for row in rows:
        compare.finite(row)
    return {
        "alpha": alpha, "seeds": plan.seeds, "method": inference.POOLED_METHOD, "seed_method": seedstats.METHOD,
        "comparisons": len(rows),
        "adjustment": f"Holm over all {len(rows)} comparisons (every variant x eval set)",
        "eval_sets": [_eval_set(name, rows, cells) for name in dict.fromkeys(
            es.name for st in (plan.starts or [None]) for es in plan.sets_of(st))],
        "variants": [{"label": v.label, "settings": {k: param_text(x) for k, x in v.settings.items()}}
                     for v in plan.variants],
        "starts": [{"name": st.name, "baseline_runs": next(c["baseline_runs"] for c in cells
                                                           if plan.start_of[c["variant"]] == st)}
                   for st in plan.starts],
        "rows": rows, "cells": cells,
    }


def _eval_set(name: str, rows: list[dict], cells: list[dict]) -> dict:
    """An eval set's heading: n and starting EX, which differ by start on a set of each start's own (then
    `n` reads 'weak 56, demo 86' and the starting EX is per row, as with any start axis)."""
    mine = [r for r in rows if r["eval_set"] == name]
    by_start = dict.fromkeys(f"{r['start']} {r['n']}" for r in mine)
    return {"name": name, "n": mine[0]["n"] if len({r["n"] for r in mine}) == 1 else ", ".join(by_start),
            "ex_b": mine[0]["ex_b"], "baseline_run": next(c["baseline_runs"][name] for c in cells
                                                          if name in c["baseline_runs"])}


def wide_table(rep: dict):
    """One row per variant, `<eval set>/<column>` columns: the table logged to MLflow."""
    import pandas as pd

    out = []
    for v in rep["variants"]:
        row = {"variant": v["label"], "seeds": len(rep["seeds"])}
        for r in (r for r in rep["rows"] if r["variant"] == v["label"]):
            row.update({f"{r['eval_set']}/{k}": r[k] for k in ROW_KEYS})
        out.append(row)
    return pd.DataFrame(out)


def markdown(rep: dict) -> str:
    level = f"{1 - rep['alpha']:.0%}"
    several = len(rep.get("starts", [])) > 1  # then each row has its own start: a column, not the heading
    lines = [f"{len(rep['variants'])} variant(s) x {len(rep['seeds'])} seed(s) {rep['seeds']}, each vs "
             f"{'its own' if several else 'the'} starting policy. Pooled test: {rep['method']}. p (Holm): "
             f"{rep['adjustment']}; the verdict compares it with alpha = {rep['alpha']}. EX sd / min-max: between "
             "seeds.", ""]
    with_seeds = sum(r["seed_p"] is not None for r in rep["rows"])  # the method's Holm family
    for es in rep["eval_sets"]:
        start = "" if several else f"; starting policy EX {pct(es['ex_b'])}, run {es['baseline_run']}"
        mine = [r for r in rep["rows"] if r["eval_set"] == es["name"]]
        lines += [f"**{es['name']}** (n = {es['n']}{start})", "",
                  *tables.pooled_table(mine, level, base_column="start EX" if several else ""), "",
                  *tables.method_table([r for r in mine if r["seed_p"] is not None], with_seeds, level)]
    return "\n".join(lines)


def main(cfg: SweepConfig) -> dict:
    import mlflow

    from slmsql.tracking import descriptions
    from slmsql.tracking import runs as tracking
    from slmsql.tracking.figures import forest_figure
    from slmsql.workflow.steps import Steps, use_this_cli

    p = plan(cfg)
    tracking.configure()
    given = _check_baselines(cfg, p.eval_sets) if cfg.baseline_runs else {}
    report_dir = Path(cfg.output_dir) / "report"
    use_this_cli()
    eval_params = _params(p.evaluate, EVAL_OWNED)
    with tracking.stage_run("sweep", cfg) as parent:
        s = Steps(parent.info.experiment_id, output_dir=cfg.output_dir, experiment=cfg.experiment, seed=cfg.seed,
                  reuse=cfg.reuse)
        out = s.out
        baseline_ids, correct, several = {}, {}, len(p.starts) > 1
        for st in p.starts:  # each start evaluated once per eval set; its cells are compared with it
            baselines = dict(given)
            for es in p.sets_of(st):
                if es.name not in baselines:
                    where = out / "baseline" / (slug(st.name) if several else "") / slug(es.name)
                    baselines[es.name] = s.run(
                        "evaluate", f"eval {es.name} starting policy" + (f" {st.name}" if several else ""),
                        tags={"slmsql.variant": "baseline", **({"slmsql.start": st.name} if several else {})},
                        output_dir=str(where), model=_local(st.model), adapter=_local(st.base_adapter), data=es.data,
                        db_root=es.db_root, dataset_name=es.name, alpha=str(cfg.alpha), **eval_params)
            baseline_ids[st.name] = {k: r.info.run_id for k, r in baselines.items()}
            correct.update({r.info.run_id: _correct(s, r) for r in baselines.values()})
        cells = []
        for v in p.variants:
            st = p.start_of[v.label]
            for seed in p.seeds:
                where = out / "cells" / slug(v.label) / f"seed-{seed}"
                tags = {"slmsql.variant": v.label, "slmsql.seed": seed, "slmsql.sweep": parent.info.run_id,
                        **({"slmsql.start": st.name} if several else {})}
                before = len(s.reused)
                grpo = s.run("grpo", f"grpo {v.label} seed={seed}", tags=tags, output_dir=str(where / "grpo"),
                             seed=seed, **_params(p.grpo[v.label]))
                adapter = s.uri(grpo, "adapter")  # the eval step fetches it; its params keep the run URI
                evals = {}
                for es in p.sets_of(st):
                    run = s.run("evaluate", f"eval {es.name} {v.label} seed={seed}", tags=tags,
                                output_dir=str(where / f"eval-{slug(es.name)}"), model=_local(st.model),
                                adapter=adapter, data=es.data, db_root=es.db_root, dataset_name=es.name,
                                baseline_run=baseline_ids[st.name][es.name], alpha=str(cfg.alpha), **eval_params)
                    evals[es.name] = run.info.run_id
                    correct[run.info.run_id] = _correct(s, run)
                cells.append({"variant": v.label, "seed": seed, "grpo_run": grpo.info.run_id, "eval_runs": evals,
                              "baseline_runs": baseline_ids[st.name], "reused": len(s.reused) - before == 1 + len(evals)})
        rep = report(p, cells, correct, cfg.alpha)
        text = markdown(rep)
        with Staged(report_dir, overwrite=True) as st:  # derived from the runs alone: replaced on every run
            write_json(st.work / "sweep.json", rep)
            (st.work / "sweep.md").write_text(text + "\n", encoding="utf-8")
        mlflow.log_artifacts(str(report_dir), "report")
        mlflow.log_table(wide_table(rep), "sweep_table.json")
        mlflow.log_figure(forest_figure(rep), "forest.png")
        mlflow.log_metrics({"variants": len(p.variants), "cells": len(cells),
                            "cells_reused": sum(c["reused"] for c in cells)})
        tracking.describe(descriptions.sweep_note(rep))
        print(f"\nslmsql sweep (parent run {parent.info.run_id})\n\n{text}\nreport: {report_dir}\n", flush=True)
    return rep
