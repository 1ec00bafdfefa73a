"""Evaluate: execution accuracy (EX) of a predictions file or a model, with intervals and a paired test.

args -> gold data -> engine (local or Ray: predictions from a file or greedy generation, sandboxed scoring)
-> statistics -> MLflow.
Resume: each generation batch's answers are appended to `<out>.partial/answers.jsonl` as soon as the batch is done;
a rerun (even after kill -9) with the same output folder and the parameters that decide the answers (RESUME_KEYS)
continues the same MLflow run and generates only the rest. The batches are planned over all questions as before and
only whole finished batches are skipped (generation.sampling.generate), so a resumed run computes the answers an
uninterrupted one does; every answer is scored again (cheap, deterministic).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from slmsql.configs import EvaluateConfig
from slmsql.errors import DataError, SlmsqlError
from slmsql.inputs.data import (check_databases, dumps, load_finished, questions, read_jsonl, read_predictions,
                                write_json, write_jsonl)
from slmsql.runtime.outputs import Staged
from slmsql.sql.scoring import ex_summary, result_row, split_scored
from slmsql.stats import inference
from slmsql.tracking import tables
from slmsql.tracking.figures import ex_figure

log = logging.getLogger(__name__)
# what decides a question's greedy answer (the batch plan included); not the engine, the match or the timeout
RESUME_KEYS = ("data", "db_ids", "limit", "db_root", "predictions", "model", "adapter", "backend", "dtype",
               "batch_size", "shared_schema", "max_new_tokens", "prompt_style", "example_values", "tables_json",
               "answer_prefix")


def fetch_baseline(run_id: str, dataset: str, match: str, gold_ids: list[str]) -> tuple[object, dict[str, dict]]:
    """The baseline run and its results.jsonl rows by id, refused unless it scored the same questions the same
    way."""
    import mlflow

    from slmsql.tracking import runs as tracking

    run = tracking.stage_run_of(mlflow.MlflowClient(), run_id, "evaluate", "baseline")
    tags = run.data.tags
    for key, want in (("slmsql.dataset", dataset), ("slmsql.match", match)):
        if tags.get(key) != want:
            raise SlmsqlError(f"baseline run {run_id} has {key}={tags.get(key)!r}, this run {want!r}: "
                              "paired comparison needs the same dataset and match mode")
    with tempfile.TemporaryDirectory() as d:
        rows = read_jsonl(tracking.download(run_id, "results.jsonl", d))
    by_id = {str(r["id"]): result_row(r) for r in rows}  # a run of an older slmsql: read in today's names
    if sorted(by_id) != sorted(gold_ids):
        raise SlmsqlError(f"baseline run {run_id} scored a different set of questions "
                          f"({len(by_id)} vs {len(gold_ids)} ids)")
    return run, by_id


def answer_all(work, examples, answers: Path, payloads: dict | None, loaded) -> dict[str, tuple]:
    """id -> (prediction, results row) of every question, on the stage's engine: the answers of a killed run read
    back from `answers` (not generated again), each new batch's appended to it and synced as soon as it exists."""
    from slmsql.generation import engines

    got: dict[str, tuple] = {}
    known = {q: row["answer"] for q, row in load_finished(answers, examples).items()}
    if known:
        log.info("resuming: %d of %d questions answered before, not generated again", len(known), len(examples))
    with open(answers, "a", encoding="utf-8") as sink:
        def on_answers(batch: dict) -> None:
            sink.write("".join(dumps({"id": q, "answer": a}) + "\n" for q, a in batch.items()))
            sink.flush()
            os.fsync(sink.fileno())

        engines.run(work, examples, lambda items: got.update((e.id, (p, r)) for e, p, r in items),
                    payloads=payloads, policy=loaded, known=known or None,
                    on_answers=None if payloads is not None else on_answers)
    return got


def main(cfg: EvaluateConfig) -> dict:
    import mlflow

    from slmsql.stats import wording
    from slmsql.tracking import descriptions, lineage, vocabulary
    from slmsql.tracking import runs as tracking

    examples = questions(cfg.data, cfg.db_ids, cfg.limit)
    check_databases(examples, cfg.db_root, cfg.data)
    st = Staged(cfg.output_dir, cfg.overwrite, identity={k: getattr(cfg, k) for k in RESUME_KEYS})
    if cfg.predictions:
        preds = read_predictions(cfg.predictions, {e.id for e in examples})
    elif not cfg.model:
        raise DataError("give --predictions FILE or --model M")
    dataset = cfg.dataset_name or Path(cfg.data).stem
    baseline = baseline_run = None
    if cfg.baseline_run:  # checked before any model loads
        tracking.configure()
        baseline_run, baseline = fetch_baseline(cfg.baseline_run, dataset, cfg.match, [e.id for e in examples])
    from slmsql.generation import engines
    from slmsql.policy.resolve import Policy

    engines.check_settings(engines.Work("evaluate", cfg), generating=not cfg.predictions)
    policy, token_metrics = None, {}
    if not cfg.predictions:  # the policy's prompt settings and the prompts' token budget, before the model loads
        policy = Policy.resolve(cfg, cfg.adapter, local=cfg.engine != "ray")  # Ray's actors resolve the dtype there
        token_metrics = policy.check_prompts(cfg, examples, new_tokens=cfg.max_new_tokens)
    work = engines.Work("evaluate", cfg, policy)
    loaded = engines.check(work, generating=not cfg.predictions, examples=examples)  # a bad model: no output, no run
    tags = {"slmsql.dataset": dataset, "slmsql.match": cfg.match,
            **(policy.tags() if policy else {"slmsql.model": tracking.portable(cfg.model) or "predictions-file"})}
    with st, tracking.stage_run("evaluate", cfg, {**engines.run_params(work), **(policy.params() if policy else {})},
                                tags=tags, run_id=st.run_id) as run:
        st.bind(run.info.run_id)
        work_dir = st.work
        mlflow.log_metrics(token_metrics)
        data = tracking.log_dataset([e.to_json() for e in examples], dataset, cfg.data, context="evaluation")
        answers = work_dir / "answers.jsonl"  # every finished batch's answers at once (resume)
        got = answer_all(work, examples, answers, preds if cfg.predictions else None, loaded)
        results = [got[e.id][1] for e in examples]
        if not cfg.predictions:
            preds = {e.id: got[e.id][0] for e in examples}
            write_jsonl(work_dir / "predictions.jsonl", [{"id": k, **v} for k, v in preds.items()])
            mlflow.log_metrics(policy.check_answers([p["completion"] for p in preds.values()],
                                                    new_tokens=cfg.max_new_tokens, source=cfg.data))
        scored, unscored = split_scored(results, cfg.match)
        if not scored:
            raise DataError(f"no question of {cfg.data} can be scored under --match {cfg.match}: every gold fails "
                            f"or returns nothing on its suite ({', '.join(unscored[:10])})")
        metrics = ex_summary(scored)
        if cfg.match == "test-suite":
            metrics["n_gold_unscored"] = len(unscored)
            metrics["gold_unscored_ids"] = unscored
            if unscored:
                log.warning("%d questions not scored: their gold fails or returns nothing on their suite: %s",
                            len(unscored), ", ".join(unscored))
        comparison = None
        if baseline is not None:
            comparison = inference.compare([r["correct"] for r in scored],
                                       [bool(baseline[r["id"]]["correct"]) for r in scored], alpha=cfg.alpha)
            metrics["comparison"] = {"baseline_run": cfg.baseline_run, **comparison}
            mlflow.log_metrics(vocabulary.comparison_metrics(comparison))
            mlflow.set_tags({"slmsql.baseline_run": cfg.baseline_run, "slmsql.verdict": comparison["verdict"]})
            log.info("vs baseline: %+.1f points, McNemar p=%.3g -> %s", 100 * comparison["diff"],
                     comparison["mcnemar_p"], comparison["verdict"])
        missing = sum(r["status"] == "missing" for r in results)
        if missing:
            log.warning("%d gold examples have no prediction; scored wrong", missing)
        write_jsonl(work_dir / "results.jsonl", results)
        write_json(work_dir / "metrics.json", metrics)
        # EX is a metric of the evaluated policy's LoggedModel on this eval set (the experiment's Models tab)
        numeric = tracking.numeric(metrics, digits=tracking.STAT_DIGITS)
        model_id = None if cfg.predictions else lineage.policy_model(run.info.experiment_id, cfg.model, cfg.adapter)
        lineage.log_model_input(run.info.run_id, model_id)
        mlflow.log_metrics({k: v for k, v in numeric.items() if k in lineage.MODEL_METRICS}, model_id=model_id,
                           dataset=data)
        if model_id:  # its description states its EX per eval set
            lineage.describe_model(model_id)
        mlflow.log_metrics({k: v for k, v in numeric.items() if k not in lineage.MODEL_METRICS})
        names = (run.info.run_name, baseline_run.info.run_name if baseline_run else "")
        result = wording.result(comparison) if comparison else wording.ex_result(metrics)
        mlflow.set_tag(tracking.RESULT, result)
        mlflow.log_figure(ex_figure(metrics, comparison, *names), "ex_intervals.png")
        tracking.describe(descriptions.evaluation_note(metrics, dataset, cfg.match, comparison,
                                                       descriptions.run_link(baseline_run) if baseline_run else "",
                                                       cfg.alpha))
        log.info("EX %.1f%% [%.1f, %.1f] on %d examples of %s (%s)", 100 * metrics["ex"],
                 100 * metrics["ex_ci_low"], 100 * metrics["ex_ci_high"], metrics["n"], dataset, cfg.match)
        for name in ("results.jsonl", "metrics.json", "predictions.jsonl"):
            if (work_dir / name).exists():
                mlflow.log_artifact(str(work_dir / name))
        mlflow.log_table(tables.evaluation_table(examples, results, preds), "results_table.json")
        if baseline is not None:  # the questions behind McNemar's test: only one side got them right
            mlflow.log_table(tables.disagreements_table(examples, results, baseline, *names),
                             "disagreements_table.json")
            mlflow.log_text(tables.sql_report(examples, results, baseline, *names), "sql_side_by_side.md")
        answers.unlink()  # predictions.jsonl holds them, in the data's order
    print(f"{run.info.run_name}: {result}\nMLflow UI: {tracking.ui_link(run.info.experiment_id)}", flush=True)
    return metrics
