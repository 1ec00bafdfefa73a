"""Filter: sample the policy K times per question, execute every SQL, bucket questions by pass rate.

args -> source data -> engine (local or Ray: K samples per question, scored) -> buckets -> data check -> MLflow.
Buckets are defined in `passrates`, the engines in `engines`. Resume: each finished question's row is appended
to `<out>.partial/passrates.jsonl` as soon as its batch is scored; a rerun (even after kill -9, on either
engine) with the same output folder and parameters skips them. Samples are seeded by question id, so a resumed
run gives the same result as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import os

from slmsql.configs import FilterConfig
from slmsql.errors import DataError, SlmsqlError
from slmsql.inputs.data import dumps, load_finished, questions, write_json, write_jsonl
from slmsql.runtime.outputs import Staged
from slmsql.sql.passrates import CHUNK, bucket_summary
from slmsql.tracking.figures import histogram_figure

log = logging.getLogger(__name__)
RESUME_KEYS = ("data", "db_ids", "limit", "db_root", "model", "adapter", "backend", "dtype", "k", "temperature",
               "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens", "seed", "prompt_style", "example_values",
               "tables_json", "match", "timeout_s")


def main(cfg: FilterConfig) -> dict:
    import mlflow
    from tqdm import tqdm

    from slmsql.checks import datachecks
    from slmsql.generation import engines
    from slmsql.policy.resolve import Policy
    from slmsql.stats import wording
    from slmsql.tracking import descriptions, lineage
    from slmsql.tracking import runs as tracking

    # args, the policy's prompt settings and the prompts' token budget: all before any model loads
    if not (0 <= cfg.low < cfg.high <= 1) or cfg.k < 1:
        raise DataError(f"need k >= 1 and 0 <= low < high <= 1, got k={cfg.k} low={cfg.low} high={cfg.high}")
    examples = questions(cfg.data, cfg.db_ids, cfg.limit)
    engines.check_settings(engines.Work("filter", cfg), generating=True)
    policy = Policy.resolve(cfg, cfg.adapter, local=cfg.engine != "ray")  # Ray's actors resolve the dtype there
    work = engines.Work("filter", cfg, policy)
    token_metrics = policy.check_prompts(cfg, examples, new_tokens=cfg.max_new_tokens)
    st = Staged(cfg.output_dir, cfg.overwrite, identity={k: getattr(cfg, k) for k in RESUME_KEYS})
    # A bad model path fails here, before a .partial folder and a run exist that a corrected rerun would
    # then refuse to resume ("unfinished run with other parameters").
    loaded = engines.check(work, generating=True, examples=examples)

    # sample and score on the engine; every finished row goes to disk at once (resume)
    with st, tracking.stage_run("filter", cfg, {**engines.run_params(work), **policy.params()}, tags=policy.tags(),
                                run_id=st.run_id, system_metrics=True) as run:
        st.bind(run.info.run_id)
        mlflow.log_metrics(token_metrics)
        lineage.log_model_input(run.info.run_id, lineage.policy_model(run.info.experiment_id, cfg.model, cfg.adapter))
        work_dir, out = st.work, st.out
        done = load_finished(work_dir / "passrates.jsonl", examples)
        todo = [e for e in examples if e.id not in done]
        bar = tqdm(total=len(examples), initial=len(done), desc=f"filter ({cfg.engine})", unit="q")
        with open(work_dir / "passrates.jsonl", "a", encoding="utf-8") as sink:
            def on_rows(items):
                sink.write("".join(dumps(row) + "\n" for _, _, row in items))
                sink.flush()
                os.fsync(sink.fileno())
                done.update((row["id"], row) for _, _, row in items)
                bar.update(len(items))

            engines.run(work, todo, on_rows, chunk=CHUNK, policy=loaded)
        bar.close()
        rows = [done[e.id] for e in examples]
        write_jsonl(work_dir / "passrates.jsonl", rows)  # source order, whatever order the engine finished in

        # buckets, band file, data check
        summary = bucket_summary(rows, cfg.k, cfg.low, cfg.high)
        band = [{**e.to_json(), "pass_rate": done[e.id]["pass_rate"], "k": cfg.k,
                 "n_correct": done[e.id]["n_correct"]} for e in examples if done[e.id]["bucket"] == "band"]
        write_jsonl(work_dir / "band.jsonl", band)
        write_json(work_dir / "summary.json", summary)
        b = summary["buckets"]
        mlflow.log_metrics({"n_source": len(rows), "band": b["band"], "all_fail": b["all_fail"],
                            "all_pass": b["all_pass"], "out_of_band": sum(b["out_of_band"].values()),
                            "errors": b["errors"], **{f"out_of_band_{k.replace('/', '_of_')}": v
                                                      for k, v in b["out_of_band"].items()}})
        mlflow.log_figure(histogram_figure(summary), "pass_rate_histogram.png")
        for name in ("band.jsonl", "passrates.jsonl", "summary.json"):
            mlflow.log_artifact(str(work_dir / name))
        if band:  # named as GRPO names its input: one name for one dataset
            tracking.log_dataset(band, "rl", out / "band.jsonl", context="output",
                                 uri=f"runs:/{run.info.run_id}/band.jsonl")
        tracking.describe(descriptions.filter_note(summary))
        mlflow.set_tag(tracking.RESULT, wording.band_result(summary))
        report = datachecks.run_rl_check(work_dir / "band.jsonl", cfg.db_root, work_dir / "summary.json", cfg.low,
                                         cfg.high, min_band=cfg.min_band)
        # the files it checked as this run and the database run name them (runs:/...), not as folders of this machine
        names = {str(work_dir): f"runs:/{run.info.run_id}", str(cfg.db_root): tracking.portable(cfg.db_root)}
        tracking.log_json(tracking.renamed(report.to_json(), names), "data_check/rl.json")
        mlflow.log_metric("data_check_success", float(report.success))
        if not report.success:
            raise SlmsqlError("the rl data check failed on the filter's own output:\n" + report.to_markdown())
    log.info("filter: %s", json.dumps(summary["buckets"]))
    return summary
