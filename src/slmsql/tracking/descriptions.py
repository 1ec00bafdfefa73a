"""Run descriptions: what each run found, in words and numbers, for its overview page in the MLflow UI
(`tracking.describe` sets them). The same figures the run logs as metrics; the wording is slmsql.stats.wording's."""

from __future__ import annotations

from pathlib import Path

from slmsql.stats.wording import duration, pct, pts, pval, training_time
from slmsql.tracking.runs import NOTE, describe, numeric, param_value


def run_link(run) -> str:
    """A Markdown link to a run's page, relative, as the MLflow UI resolves it in a description."""
    return f"[{run.info.run_name or run.info.run_id}](#/experiments/{run.info.experiment_id}/runs/{run.info.run_id})"


LINKS = "\n\nRelated runs: "  # a description's last paragraph, written by `link_runs` (replaced, not appended)


def link_runs(run, related: dict[str, list]) -> str:
    """Set `run`'s description to its own text and a paragraph linking `related` runs ({label: [runs]}), e.g. a
    training run's evaluations, an evaluation's siblings on the other eval sets. Idempotent: a rerun replaces it."""
    own = run.data.tags.get(NOTE, "").split(LINKS)[0]
    parts = [f"{label} " + ", ".join(run_link(r) for r in runs) for label, runs in related.items() if runs]
    return describe(own + (LINKS + "; ".join(parts) + "." if parts else ""), run.info.run_id)


def evaluation_note(metrics: dict, dataset: str, match: str, comparison: dict | None = None,
                    baseline_name: str = "", alpha: float = 0.05) -> str:
    """`baseline_name`: how the baseline run is named (`run_link`: a link to it)."""
    # no "[a, b] (" anywhere: the UI renders descriptions as Markdown, where that reads as a link
    text = (f"EX {pct(metrics['ex'])} (95% Wilson interval {pct(metrics['ex_ci_low'])} to "
            f"{pct(metrics['ex_ci_high'])}) on {metrics['n']} questions of {dataset}, {match} match.")
    if comparison:
        c = comparison
        text += (f"\nvs {baseline_name or 'the baseline'}: {pct(c['ex_b'])} → {pct(c['ex_a'])}, "
                 f"{pts(c['diff'])} points ({1 - alpha:.0%} interval {pts(c['diff_ci_low'])} to "
                 f"{pts(c['diff_ci_high'])}), McNemar p = {pval(c['mcnemar_p'])}: {c['verdict']} at α = {alpha:g}. "
                 f"{c['only_a']} questions only this run got right, {c['only_b']} only the baseline.")
    return text


def filter_note(summary: dict) -> str:
    b, k = summary["buckets"], summary["k"]
    oob = sum(b["out_of_band"].values())
    rates = ", ".join(f"{r}: {n}" for r, n in b["out_of_band"].items())
    return (f"Pass rates of {summary['n_source']} questions from K = {k} samples each: band "
            f"({summary['low']} < p < {summary['high']}) {b['band']}, all fail (0/{k}) {b['all_fail']}, "
            f"all pass ({k}/{k}) {b['all_pass']}, out of band {oob}{f' ({rates})' if rates else ''}, "
            f"errors {b['errors']}.\nGRPO trains on the {b['band']} band questions.")


def grpo_note(summary: dict) -> str:
    """Whether there was a learning signal: zero-variance groups give no gradient, and only groups with both
    right and wrong SQL say anything about correctness."""
    s = lambda k: summary.get(f"summary/{k}")  # noqa: E731
    varies, zero = s("exec/frac_groups_correctness_varies"), s("frac_reward_zero_std")
    if varies is None:
        verdict = "Signal unknown: the run logged no execution telemetry."
    elif varies == 0:
        verdict = "No correctness signal: no group held both right and wrong SQL."
    else:
        verdict = f"Correctness signal in {varies:.0%} of prompt groups (mean over steps)."
    facts = [f"{zero:.0%} of groups had zero reward variance (no gradient)" if zero is not None else None,
             f"reward {s('reward'):.3g}, reward std {s('reward_std'):.3g}" if s("reward") is not None
             and s("reward_std") is not None else None,
             f"{s('exec/correct'):.0%} of sampled completions correct" if s("exec/correct") is not None else None]
    time = training_time(summary.get("steps", 0), summary.get("train_seconds", 0), summary.get("resumed_at_step"))
    return (f"GRPO, {summary.get('steps', 0):.0f} steps in {time}. {verdict}\n"
            + "; ".join(f for f in facts if f) + ".")


def sft_note(summary: dict, model: str) -> str:
    kind = "LoRA adapter" if summary["kind"] == "adapter" else "full fine-tune"
    return (f"SFT ({kind}) of {param_value(model)}: {summary['steps']} steps on {summary['examples']} "
            f"examples in {duration(summary['train_seconds'])}; train loss {summary['train_loss']:.3g}.")


def toy_note(summary: dict) -> str:
    counts = ", ".join(f"{c['total']} {split}" for split, c in summary["counts"].items())
    dbs = {db for names in summary.get("databases", {}).values() for db in names}  # split -> its databases
    return f"Toy world ({summary['size']}, seed {summary['seed']}): {counts} questions over {len(dbs)} databases."


def tiny_model_note(info: dict, cfg) -> str:
    return (f"Tiny Qwen2 model: {info['parameters']:,} parameters ({cfg.layers} layers, hidden {cfg.hidden}), "
            f"BPE vocabulary {info['vocab_size']:,} trained on {info['texts']:,} toy texts.")


def validate_note(report) -> str:
    head = (f"{report.kind} data check PASSED: all {len(report.results)} expectations" if report.success else
            f"{report.kind} data check FAILED: {len(report.failed)} of {len(report.results)} expectations "
            f"({', '.join(r['expectation'] for r in report.failed[:3])}{', ...' if len(report.failed) > 3 else ''})")
    return f"{head} on {report.n_rows} rows of {Path(report.data).name}."


def publish_note(cfg, result: dict) -> str:
    where = (f"pushed to {result['hub_url']} (commit {result['hub_commit'][:10]}"
             f"{'' if result.get('new_commit') else ', no change'})" if "hub_url" in result
             else "written, not pushed (dry run)")
    reg = (f"; registered as {result['registered_model']} version {result['model_version']}"
           + (f" (@{result['alias']})" if result.get("alias") else "") if "model_version" in result else "")
    return (f"Model card for {cfg.repo_id} {where}{reg}. From GRPO run {cfg.grpo_run} and "
            f"{len(cfg.eval_runs)} evaluation run(s).")


def pipeline_note(headline: dict, verdicts: dict) -> str:
    """The lifecycle's headline from the pipeline's metrics (`<step>/<metric>`) and each eval set's verdict."""
    h = headline.get
    lines = [f"{split}: SFT {pct(h(f'eval-sft-{split}/ex'))} → GRPO {pct(h(f'eval-grpo-{split}/ex'))}, "
             f"{pts(h(f'eval-grpo-{split}/vs_baseline/diff'))} points "
             f"(interval {pts(h(f'eval-grpo-{split}/vs_baseline/diff_ci_low'))} to "
             f"{pts(h(f'eval-grpo-{split}/vs_baseline/diff_ci_high'))}, "
             f"McNemar p = {pval(h(f'eval-grpo-{split}/vs_baseline/p'))}): {verdict}."
             for split, verdict in verdicts.items()]
    varies, zero = h("grpo/summary/exec/frac_groups_correctness_varies"), h("grpo/summary/frac_reward_zero_std")
    tail = (f"Filter: {h('filter/band', 0):.0f} band questions of {h('filter/n_source', 0):.0f}"
            + (f"; GRPO: correctness varied in {varies:.0%} of groups" if varies is not None else "")
            + (f", {zero:.0%} had zero reward variance" if zero is not None else "") + ".")
    return "SFT → GRPO on the toy world. " + " ".join(lines) + "\n" + tail


def sweep_note(rep: dict) -> str:
    """The sweep's table in words: each variant on each eval set, pooled over its seeds, Holm-adjusted."""
    rows = "; ".join(f"{r['variant']} on {r['eval_set']}: {pct(r['ex_b'])} → {pct(r['ex_mean'])} (mean over "
                     f"seeds), {pts(r['diff'])} points (interval {pts(r['diff_ci_low'])} to "
                     f"{pts(r['diff_ci_high'])}), p (Holm) = {pval(r['p_holm'])}: {r['verdict']}" for r in rep["rows"])
    return (f"Sweep: {len(rep['variants'])} variant(s) x {len(rep['seeds'])} seed(s) vs the starting policy, "
            f"pooled per variant, Holm over {rep['comparisons']} comparisons.\n{rows}.")


def log_headline(headline: dict, verdicts: dict) -> None:
    """On the pipeline's parent run: the headline as metrics, each eval set's verdict as a tag
    (`slmsql.verdict.<set>`, and all of them in `slmsql.verdict`), and the description."""
    import mlflow

    mlflow.log_metrics(numeric(headline))
    mlflow.set_tags({"slmsql.verdict": ", ".join(f"{k}: {v}" for k, v in verdicts.items()),
                     **{f"slmsql.verdict.{k}": v for k, v in verdicts.items()}})
    describe(pipeline_note(headline, verdicts))


def link_pipeline(parent, trained: dict[str, object], evals: dict[str, dict[str, object]]) -> None:
    """Descriptions as links between a workflow's runs: each training run ({"sft": run, ...}) to its
    evaluations, each evaluation to the run that trained its policy and to its siblings on the other eval sets,
    the parent to every evaluation. `evals`: policy name -> eval set -> evaluation run."""
    for name, by_set in evals.items():
        if name in trained:
            link_runs(trained[name], {"Evaluations:": list(by_set.values())})
        for split, run in by_set.items():
            link_runs(run, {"Policy trained by": [trained[name]] if name in trained else [],
                            "Same policy on the other eval sets:": [r for s, r in by_set.items() if s != split]})
    link_runs(parent, {"Evaluations:": [r for by_set in evals.values() for r in by_set.values()]})
