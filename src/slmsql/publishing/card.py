"""The model card: facts gathered from the MLflow runs -> a context -> `model_card/README.md.j2` -> README.md.
A local base pushed beside the adapter (publish --base-repo) gets its own card: `model_card/base.md.j2`.

Every number on the card is read from a run (params, metrics, metrics.json, the filter's summary.json, the
adapter's adapter_config.json, a sweep's report/sweep.json); the wording of the conclusion is chosen from the
verdicts the runs computed (McNemar at the run's alpha; with a sweep of several seeds, the pooled test over the
adapter's variant, Holm-adjusted; with a study, its report.json's Holm verdicts: what transferred and what did not),
never written in advance. A card without one says it is a single seed. The card
depends only on the runs and the publish options, so publishing the same runs twice renders the same bytes (and the Hub makes no new commit).
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from slmsql import configs
from slmsql.errors import SlmsqlError
from slmsql.inputs.sources import hub_id, same_model
from slmsql.stats.wording import bound, duration, pct, points, pts, pval, training_time
from slmsql.tracking.runs import portable

TEMPLATE_DIR = Path(str(resources.files("slmsql") / "model_card"))  # model_card/, which the package carries
VERDICTS = ("improved", "regressed", "no significant difference")
TELEMETRY = [  # (summary metric, per-step metric, label, what it means)
    ("summary/frac_reward_zero_std", "frac_reward_zero_std", "frac_reward_zero_std",
     "share of prompt groups whose completions all got the same reward: zero advantage, no gradient"),
    ("summary/reward_std", "reward_std", "reward_std", "reward standard deviation within a group"),
    ("summary/exec/frac_groups_correctness_varies", "exec/frac_groups_correctness_varies",
     "groups with varying correctness",
     "share of groups holding both right and wrong SQL: the signal about correctness"),
    ("summary/exec/correct", "exec/correct", "sampled completions correct",
     "share of training samples whose SQL matched gold"),
    ("summary/reward", "reward", "reward", "mean total reward per completion"),
    ("summary/grad_norm", "grad_norm", "grad_norm", "gradient norm before clipping"),
    ("summary/completions/mean_length", "completions/mean_length", "completion length", "mean tokens per completion"),
    ("summary/dynamic_sampling/groups_dropped", "dynamic_sampling/groups_dropped", "groups dropped per step",
     "dynamic sampling: sampled groups without correctness variance, replaced by groups for further prompts"),
    ("summary/dynamic_sampling/extra_rounds", "dynamic_sampling/extra_rounds", "extra generation rounds per step",
     "dynamic sampling: what the refills cost, in generation calls beyond the first"),
]


@dataclass
class Runs:
    """What publish gathered: MLflow `Run` objects plus the artifacts the card reads."""

    grpo: object
    adapter_config: dict
    evals: list = field(default_factory=list)  # [(evaluate Run, its metrics.json)]
    baselines: dict = field(default_factory=dict)  # run id -> the baseline evaluate Run
    filter: object = None
    filter_summary: dict | None = None
    history: dict = field(default_factory=dict)  # per-step metric -> [values], for ranges
    sweep_run: object = None  # the sweep this GRPO run is a cell of, and its report (report/sweep.json)
    sweep: dict | None = None
    # the study this GRPO run is a cell of (publish --study): its folder, report.json, the cell's arm and seed, and
    # its diagnosis table as the report prints it (stages/publish.py reads them: a study is a layer above this one)
    study: dict | None = None
    base: Base | None = None  # a local base pushed with --base-repo
    settings: dict | None = None  # the evaluation runs' prompt and generation settings (text2sql)


@dataclass
class Base:
    """A local base model folder and the runs that made it (None where no run is known)."""

    path: str
    sft: object = None  # the SFT run that wrote the folder
    parent: object = None  # the tiny-model run that built the SFT run's starting model, if it was that


def _num(value):
    """MLflow params are strings; numbers back to numbers for formatting."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def command(stage: str, params: dict) -> str:
    """The `slmsql <stage>` command that reproduces a run: every logged param that differs from its default, but
    those that shape no result (where it wrote, a folder of the machine that ran it, is left to the reader)."""
    cls = configs.STAGES[stage]
    defaults = cls()
    lines = [f"slmsql {stage}"]
    for f in dataclasses.fields(cls):
        if f.name in configs.RUN_ONLY:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.name == "trainer_args":
            lines += [f"{flag} {shlex.quote(k.split('.', 1)[1] + '=' + v)}"
                      for k, v in sorted(params.items()) if k.startswith("trainer_args.")]
            continue
        value = params.get(f.name)
        if isinstance(getattr(defaults, f.name), bool) and value is not None:
            value = str(value).lower()  # a run of an older slmsql logged True/False
        # compared as parameter text: a logged 'false' or 'all-linear' is the default False or ['all-linear']
        if value is not None and str(value) != configs.param_text(getattr(defaults, f.name)):
            lines.append(f"{flag} {shlex.quote(str(value))}")
    return " \\\n    ".join(lines)


SINGLE_SEED = ("These numbers come from one training seed, and one seed cannot tell how much of a difference is the "
               "method and how much is that seed's luck (`slmsql sweep --seeds N` measures the between-seed spread).")


def headline(verdicts: dict[str, str], start: str, subject: str = "This adapter") -> str:
    """The conclusion from {dataset: verdict}, chosen by the verdicts (never written in advance)."""
    by = {v: [d for d, x in verdicts.items() if x == v] for v in VERDICTS}
    up, down, null = by["improved"], by["regressed"], by["no significant difference"]
    names, low = ", ".join, subject[0].lower() + subject[1:]
    if up and down:
        return f"Mixed result: {low} beats {start} on {names(up)} but is worse on {names(down)}."
    if up:
        return (f"{subject} beats {start} on every evaluated dataset." if not null else
                f"{subject} beats {start} on {names(up)}; on {names(null)} the difference is not significant.")
    if down:
        return (f"{subject} is worse than {start} on every evaluated dataset." if not null else
                f"{subject} does not beat {start}: it is worse on {names(down)} and not significantly "
                f"different on {names(null)}.")
    return f"{subject} does not beat {start}: a null result (no significant difference on any dataset)."


def _p_is(p: float) -> str:
    """"= 0.24", or "< 0.001" (never "= < 0.001")."""
    text = pval(p)
    return text if text.startswith("<") else f"= {text}"


def _facts(compared: list[dict]) -> str:
    return "; ".join(f"{r['dataset']}: {r['cmp']['ex_b']:.1%} → {r['cmp']['ex_a']:.1%} "
                     f"({pts(r['cmp']['diff'])} points, {1 - r['alpha']:.0%} CI [{pts(r['cmp']['diff_ci_low'])}, "
                     f"{pts(r['cmp']['diff_ci_high'])}], McNemar p {_p_is(r['cmp']['mcnemar_p'])})"
                     for r in compared)


def _signal(telemetry: dict) -> str:
    said = {"summary/frac_reward_zero_std": "{:.0%} of groups had zero reward variance",
            "summary/exec/frac_groups_correctness_varies": "correctness varied within {:.0%} of groups"}
    signal = [text.format(telemetry[k]["mean"]) for k, text in said.items() if k in telemetry]
    return " During training (means over steps), " + " and ".join(signal) + "." if signal else ""


def tldr(results: list[dict], start: str, telemetry: dict) -> str:
    """The conclusion, chosen from the verdicts (never written in advance), then the numbers behind it."""
    compared = [r for r in results if r["cmp"]]
    if not compared:
        return (f"No evaluation run compared this adapter with {start}, so this card claims no gain and no loss. "
                + "; ".join(f"{r['dataset']}: EX {r['ex']:.1%}" for r in results) + ".")
    text = f"{headline({r['dataset']: r['cmp']['verdict'] for r in compared}, start)} {_facts(compared)}."
    null = [r for r in compared if r["cmp"]["verdict"] == "no significant difference"]
    if null:
        mdds = [f"{r['dataset']} (n = {r['n']}): {mdd(r['cmp']['mdd'])}" for r in null]
        text += " Smallest differences these evaluations could reliably detect: " + "; ".join(mdds) + "."
    return text + _signal(telemetry)


def pooled_tldr(sweep: dict, results: list[dict], start: str, telemetry: dict) -> str:
    """The conclusion from the sweep's pooled test over this adapter's variant (all its seeds), then this
    adapter's own single-seed numbers."""
    mine = sweep["spread"]
    head = headline({r["eval_set"]: r["verdict"] for r in mine}, start, f"This variant (`{sweep['variant']}`)")
    level = f"{1 - sweep['alpha']:.0%}"
    facts = "; ".join(
        f"{r['eval_set']}: {r['ex_b']:.1%} → {r['ex_mean']:.1%} mean over seeds (between seeds: sd "
        f"{points(r['ex_sd'])} points, {pct(r['ex_min'])}–{pct(r['ex_max'])}; difference {pts(r['diff'])} points, "
        f"{level} CI [{pts(r['diff_ci_low'])}, {pts(r['diff_ci_high'])}], p {_p_is(r['p'])}, Holm-adjusted "
        f"p {_p_is(r['p_holm'])} over {sweep['comparisons']} comparisons)" for r in mine)
    text = f"Pooled over {len(sweep['seeds'])} training seeds, {head[0].lower()}{head[1:]} {facts}."
    compared = [r for r in results if r["cmp"]]
    if compared:
        text += f" This adapter (seed {sweep['seed']}) alone: {_facts(compared)}."
    return text + _signal(telemetry)


def transfer(row: dict) -> str:
    """A study comparison's word on the card, from its Holm verdict (pooled). Against the start: "transferred" only
    for a significant gain. Against another arm the question is another one (did it transfer *better*; whether
    either transferred is the start's rows' to say): "better than ARM" only for a significant gain."""
    if row["verdict"] is None:
        return "no verdict"
    gain = row["verdict"] == "improved"
    if row.get("against", "start") == "start":
        return "transferred" if gain else "not transferred"
    return f"better than {row['against']}" if gain else f"not better than {row['against']}"


def transfer_text(rows: list[dict], comparisons: int, level: str, numbers: bool = True) -> str:
    """What transferred and what did not, in plain words, chosen from the study's Holm verdicts (never written in
    advance); with `numbers`, each comparison's pooled difference and the verdict over seeds (for the method)."""
    def say(r, verdict: bool = False):
        what = f"`{r['label']}` on {r['eval_set']}" + (f": {r['verdict']}" if verdict and numbers else "")
        if not numbers:
            return f"{what} ({r['verdict']})" if verdict else what
        return (f"{what} ({pts(r['diff'])} points, {level} CI [{pts(r['diff_ci_low'])}, {pts(r['diff_ci_high'])}], "
                f"p (Holm) {_p_is(r['p_holm'])}; over seeds, for the method: "
                f"{r['seed_verdict'] or 'no verdict'})")

    by = {}
    for r in rows:  # each word's comparisons, the words in the rows' order
        by.setdefault(transfer(r), []).append(r)
    gain = (f"a significant gain after Holm's adjustment over the {comparisons} declared comparisons, for the seeds "
            "trained")
    parts = []
    if by.get("transferred"):
        parts.append(f"Transferred ({gain}): {'; '.join(say(r) for r in by['transferred'])}.")
    elif by.get("not transferred"):
        parts.append(f"Nothing transferred: no comparison with the start is a significant gain after Holm's "
                     f"adjustment over the {comparisons} declared comparisons.")
    if by.get("not transferred"):
        parts.append("Not transferred: " + "; ".join(say(r, verdict=True) for r in by["not transferred"]) + ".")
    for word in [w for w in by if w.startswith("better than ")]:
        arm = word.removeprefix("better than ")
        parts.append(f"Better than `{arm}` ({gain}): {'; '.join(say(r) for r in by[word])}.")
    for word in [w for w in by if w.startswith("not better than ")]:
        arm = word.removeprefix("not better than ")
        parts.append(f"Not better than `{arm}`: " + "; ".join(say(r, verdict=True) for r in by[word]) + ".")
    if by.get("no verdict"):
        parts.append("No verdict: " + "; ".join(f"{say(r)} ({r['reason']})" for r in by["no verdict"]) + ".")
    return " ".join(parts)


def study_tldr(study: dict, results: list[dict], telemetry: dict) -> str:
    """The conclusion from the study this adapter is a cell of (in words: the Results section has its numbers),
    then this adapter's own numbers."""
    rec = study["records"]
    text = (f"This adapter is seed {study['seed']} of arm `{study['arm']}` of the study `{study['name']}` "
            f"({rec['cells']} of {rec['declared']} cells recorded). "
            f"{transfer_text(study['rows'], study['comparisons'], study['level'], numbers=False)}")
    compared = [r for r in results if r["cmp"]]
    own = _facts(compared) if compared else "; ".join(f"{r['dataset']}: EX {r['ex']:.1%}" for r in results)
    return f"{text} This adapter alone: {own}." + _signal(telemetry)


# --- formatting, also used as Jinja filters (pct, pts, pval, points, duration: slmsql.stats.wording) -------------
def mdd(x) -> str:
    return "none at this n" if x is None or not math.isfinite(x) else f"{100 * x:.1f} points"


def num(x, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}g}"


def training_length(p: dict, metrics: dict) -> str:
    """The card's Steps line: the steps taken, of `max_steps` or in passes over the RL data (`max_steps` -1: TRL's
    epochs), and the training time as the run measured it (a resumed run's: the steps after its checkpoint)."""
    steps, max_steps = metrics.get("steps"), int(float(p.get("max_steps", -1)))
    passes = float(p.get("num_train_epochs", 1))
    planned = (f" of {max_steps} planned" if max_steps > 0
               else f" ({num(passes)} pass{'' if passes == 1 else 'es'} over the RL data)")
    time = training_time(steps, metrics.get("train_seconds"), metrics.get("resumed_at_step"))
    return f"{num(steps, 6)}{planned}; training time {time}"


def md(text) -> str:
    """Safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


# --- context --------------------------------------------------------------------------------------------------
def _results(runs: Runs) -> list[dict]:
    rows = []
    for run, m in runs.evals:
        tags, cmp = run.data.tags, m.get("comparison")
        if cmp and cmp.get("verdict") not in VERDICTS:
            raise SlmsqlError(f"evaluation run {run.info.run_id}: unknown verdict {cmp.get('verdict')!r}")
        alpha = _num(run.data.params.get("alpha")) or 0.05
        # with a comparison, both runs' intervals come from it: one confidence level (1 - alpha) per row
        lo, hi = (cmp["ex_a_ci_low"], cmp["ex_a_ci_high"]) if cmp else (m["ex_ci_low"], m["ex_ci_high"])
        rows.append({"dataset": tags["slmsql.dataset"], "match": tags.get("slmsql.match", ""),
                     "run_id": run.info.run_id, "n": m["n"], "ex": m["ex"], "ex_lo": lo, "ex_hi": hi,
                     "n_correct": m["n_correct"], "alpha": alpha, "level": 1 - alpha if cmp else 0.95, "cmp": cmp,
                     "difficulty": {k[3:]: (v, m.get("n_" + k[3:])) for k, v in sorted(m.items())
                                    if k.startswith("ex_") and k[3:] not in ("ci_low", "ci_high")}})
    return rows


def _buckets(summary: dict | None) -> dict | None:
    if summary is None:
        return None
    b, k = summary["buckets"], summary["k"]
    rows = [("band", f"{summary['low']} < p < {summary['high']}", b["band"]),
            ("all fail", f"0/{k}", b["all_fail"]), ("all pass", f"{k}/{k}", b["all_pass"])]
    rows += [("out of band", rate, n) for rate, n in b["out_of_band"].items()]
    rows.append(("errors (no database, or gold SQL fails)", "—", b["errors"]))
    total = sum(n for _, _, n in rows)
    if total != summary["n_source"]:
        raise SlmsqlError(f"filter summary.json: buckets add up to {total}, not n_source={summary['n_source']}")
    return {"rows": rows, "total": total, "n_source": summary["n_source"], "k": k}


def _telemetry(runs: Runs) -> dict:
    metrics, out = runs.grpo.data.metrics, {}
    for key, step_key, label, meaning in TELEMETRY:
        if key in metrics:
            hist = runs.history.get(step_key) or []
            out[key] = {"label": label, "meaning": meaning, "mean": metrics[key],
                        "min": min(hist) if hist else None, "max": max(hist) if hist else None}
    return out


def _targets(adapter_config: dict) -> str:
    """PEFT saves 'all-linear' resolved to module paths; the layer-independent names say the same, shorter."""
    targets = adapter_config.get("target_modules") or []
    if isinstance(targets, str):
        return targets
    return ", ".join(sorted({t.rsplit(".", 1)[-1] for t in targets}))


def _start_label(runs: Runs) -> str:
    """How the card names the comparison point: only call it the SFT start when the baseline evaluated it."""
    if runs.study is not None and not runs.baselines:  # a study's start, its runs elsewhere: known by its record
        return "the study's start"
    base_adapter = runs.grpo.data.tags.get("slmsql.base_adapter", "")
    adapters = {run.data.tags.get("slmsql.adapter", "") for run in runs.baselines.values()}
    if base_adapter and adapters and all(same_model(a, base_adapter) for a in adapters):
        return "its SFT starting point"
    if not base_adapter and adapters == {""}:
        return "its starting model"
    return "its baseline"


def diff_ci_method(results: list[dict]) -> str:
    """How the runs computed the interval of the difference: evaluations from before the exact interval carry
    no `diff_ci_method` and used a paired percentile bootstrap."""
    from slmsql.stats.inference import DIFF_CI_METHOD

    methods = sorted({r["cmp"].get("diff_ci_method", "paired bootstrap") for r in results if r["cmp"]})
    return "; ".join(methods) or DIFF_CI_METHOD


def _sweep(runs: Runs) -> dict | None:
    """The sweep's table for the card: every variant per eval set, this adapter's variant marked."""
    if runs.sweep is None:
        return None
    rep, grpo_id = runs.sweep, runs.grpo.info.run_id
    cell = next((c for c in rep["cells"] if c["grpo_run"] == grpo_id), None)
    if cell is None:
        raise SlmsqlError(f"GRPO run {grpo_id} is not a cell of sweep run {runs.sweep_run.info.run_id}")
    sets = [{**es, "rows": [{**r, "mine": r["variant"] == cell["variant"]} for r in rep["rows"]
                             if r["eval_set"] == es["name"]]} for es in rep["eval_sets"]]
    return {"run": runs.sweep_run.info.run_id, "variant": cell["variant"], "seed": cell["seed"],
            "seeds": rep["seeds"], "n_variants": len(rep["variants"]), "comparisons": rep["comparisons"],
            "method": rep["method"], "adjustment": rep["adjustment"], "alpha": rep["alpha"],
            "level": f"{1 - rep['alpha']:.0%}", "sets": sets, "starts": [s["name"] for s in rep.get("starts", [])],
            "spread": [r for r in rep["rows"] if r["variant"] == cell["variant"]]}


def _study(runs: Runs) -> dict | None:
    """The study's comparisons for the card, each marked transferred or not, from its report.json."""
    if runs.study is None:
        return None
    rep = runs.study["report"]
    level = f"{1 - rep['alpha']:.0%}"
    rows = [{**r, "transfer": transfer(r)} for r in rep["rows"]]
    return {**{k: runs.study[k] for k in ("folder", "cell", "arm", "seed", "diagnosis")}, "name": rep["study"],
            **{k: rep[k] for k in ("title", "question", "records", "comparisons", "alpha", "method", "seed_method",
                                   "seeds")},
            "level": level, "rows": rows, "transfer": transfer_text(rows, rep["comparisons"], level)}


def context(runs: Runs, cfg) -> dict:
    grpo = runs.grpo
    p, tags, metrics = grpo.data.params, grpo.data.tags, grpo.data.metrics
    model = tags.get("slmsql.model", "")
    results = _results(runs)
    telemetry = _telemetry(runs)
    start = _start_label(runs)
    cmds = []
    if runs.filter is not None:
        cmds.append(("pass-rate filter: sample the start policy K times per question, keep the band",
                     command("filter", runs.filter.data.params)))
    if runs.sweep_run is not None:
        cmds.append(("the sweep this adapter is a cell of (it trains and evaluates every variant x seed)",
                     command("sweep", runs.sweep_run.data.params)))
    if runs.study is not None:
        cmds.append(("the study this adapter is a cell of (its start, every arm x seed, its report)",
                     f"slmsql study run {shlex.quote(runs.study['folder'])}"))
    cmds.append(("GRPO on the band" if runs.filter is not None else "GRPO", command("grpo", p)))
    for r in results:
        if r["cmp"] and r["cmp"]["baseline_run"] in runs.baselines:
            cmds.append((f"evaluate the starting point on {r['dataset']}",
                         command("evaluate", runs.baselines[r["cmp"]["baseline_run"]].data.params)))
        run = next(run for run, _ in runs.evals if run.info.run_id == r["run_id"])
        note = " (--baseline-run: the id of the run above, new in your store)" if r["cmp"] else ""
        cmds.append((f"evaluate the GRPO adapter on {r['dataset']}{note}", command("evaluate", run.data.params)))
    # only what shapes the pushed files: the output folder or a registry alias must not change the card
    shaping = {k: v for k, v in configs.to_params(cfg).items()
               if k in ("grpo_run", "eval_runs", "filter_run", "sweep_run", "study", "repo_id", "base_repo", "private",
                        "license")}
    cmds.append(("this card (run ids: those of the runs above)", command("publish", shaping)))
    sweep, study = _sweep(runs), _study(runs)
    if study and len(study["seeds"]) > 1:
        summary = study_tldr(study, results, telemetry)
    elif study:
        summary = f"{study_tldr(study, results, telemetry)} {SINGLE_SEED}"
    elif sweep and len(sweep["seeds"]) > 1:
        summary = pooled_tldr(sweep, results, start, telemetry)
    else:  # one seed, with or without a sweep
        summary = f"{tldr(results, start, telemetry)} {SINGLE_SEED}"
    return {
        "model_name": cfg.repo_id.split("/")[1], "repo_id": cfg.repo_id,
        "base_model": cfg.base_repo if runs.base else hub_id(model) or model,
        "base_on_hub": runs.base is not None or hub_id(model) is not None,
        "base_pushed": runs.base is not None, "model_tag": model,
        "provenance": runs.grpo.data.tags.get("slmsql.model_provenance", ""),
        "base_adapter": tags.get("slmsql.base_adapter", ""), "adapter_mode": tags.get("slmsql.adapter_mode", "none"),
        "start": start, "tldr": summary, "results": results, "sweep": sweep, "study": study,
        "ci": "95% CI" if all(abs(r["level"] - 0.95) < 1e-9 for r in results) else "CI at 1 − α",
        "diff_ci_method": diff_ci_method(results),
        "buckets": _buckets(runs.filter_summary), "filter_params": runs.filter.data.params if runs.filter else {},
        "telemetry": telemetry, "p": p, "lora": runs.adapter_config, "lora_targets": _targets(runs.adapter_config),
        "steps": metrics.get("steps"), "training_length": training_length(p, metrics),
        "rewards": [x.strip() for x in p.get("rewards", "").split(",") if x.strip()],
        "commands": cmds, "grpo_run": grpo.info.run_id,
        "filter_run": runs.filter.info.run_id if runs.filter else "",
    }


def card_data(ctx: dict, license: str):
    from huggingface_hub import EvalResult, ModelCardData

    evals = [EvalResult(task_type="text-generation", task_name="Text-to-SQL", dataset_type=r["dataset"],
                        dataset_name=r["dataset"], metric_type="execution_accuracy",
                        metric_name=f"Execution accuracy ({r['match']} match, greedy, %)",
                        metric_value=round(100 * r["ex"], 1)) for r in ctx["results"]]
    return ModelCardData(base_model=ctx["base_model"], library_name="peft", license=license,
                         pipeline_tag="text-generation", tags=["text-to-sql", "sql", "grpo", "lora", "trl", "slmsql"],
                         model_name=ctx["model_name"], eval_results=evals or None)


def base_context(runs: Runs, cfg) -> dict:
    """The base's card: what it is (the SFT run that wrote it, from what) and what it is the base of."""
    base, sft = runs.base, runs.base.sft
    start = sft.data.params.get("model", "") if sft else ""
    return {"model_name": cfg.base_repo.split("/")[1], "repo_id": cfg.base_repo, "adapter_repo": cfg.repo_id,
            "path": portable(base.path), "grpo_run": runs.grpo.info.run_id, "sft": sft,
            "p": sft.data.params if sft else {},
            "kind": sft.data.tags.get("slmsql.policy_kind", "") if sft else "",
            "steps": sft.data.metrics.get("steps") if sft else None,
            "train_loss": sft.data.metrics.get("train_loss") if sft else None,
            "start": start, "start_hub": hub_id(start) if start else None, "parent": base.parent,
            "parent_parameters": base.parent.data.metrics.get("parameters") if base.parent else None,
            "command": command("sft", sft.data.params) if sft else ""}


def base_card_data(ctx: dict, license: str):
    from huggingface_hub import ModelCardData

    extra = {"base_model": ctx["start_hub"], "base_model_relation": "finetune"} if ctx["start_hub"] else {}
    return ModelCardData(library_name="transformers", license=license, pipeline_tag="text-generation",
                         tags=["text-to-sql", "sql", "sft", "slmsql"], model_name=ctx["model_name"], **extra)


def render(ctx: dict, data, template: str = "README.md.j2") -> str:
    import jinja2

    if not (TEMPLATE_DIR / template).is_file():
        raise SlmsqlError(f"model card template not found: {TEMPLATE_DIR / template}")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.filters.update(pct=pct, pts=pts, bound=bound, points=points, pval=pval, mdd=mdd, num=num, duration=duration, md=md)
    try:
        return env.get_template(template).render(front_matter=data.to_yaml(), **ctx)
    except jinja2.UndefinedError as e:  # a run that lacks a param or metric the card states
        raise SlmsqlError(f"model card: the runs lack a value the card needs ({e.message})") from None
