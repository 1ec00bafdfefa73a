"""`slmsql suite build`: test suites (Zhong, Yu and Klein, EMNLP 2020) for each db_id of a Spider-format dataset,
written to OUT/<db_id>/<db_id>*.sqlite with OUT/manifest.json, in an MLflow run of its own (docs/stages/suite.md).

inputs (tables.json, the questions; every problem refused naming file, line and field, before any run) -> the run
-> one suite per db_id (suites.build) -> the manifest, checked by Great Expectations (data_checks/suite.json) ->
the folder renamed into place (complete or absent) -> params, metrics and the manifest logged.
"""

from __future__ import annotations

from slmsql.configs import SuiteBuildConfig
from slmsql.errors import SlmsqlError
from slmsql.inputs.data import safe_text, write_json
from slmsql.runtime.outputs import Staged
from slmsql.suites import build as suites


def build(cfg: SuiteBuildConfig) -> dict:
    import mlflow
    from tqdm import tqdm

    from slmsql.checks.datachecks import validate_manifest
    from slmsql.sql.sandbox import Limits, SandboxPool
    from slmsql.tracking import runs as tracking

    st = Staged(cfg.output_dir, cfg.overwrite)  # refused before the slow part if the folder is in the way
    entries, questions = suites.read_inputs(cfg.tables, cfg.data, cfg.db_ids)
    params = suites.Params(seed=cfg.seed, cap=cfg.cap, candidates=cfg.candidates, sizes=tuple(cfg.sizes))
    with tracking.stage_run("suite build", cfg, tags={"slmsql.suite.db_ids": ",".join(sorted(entries))[:5000]}):
        with st, SandboxPool(cfg.workers or None, Limits(timeout_s=cfg.timeout_s)) as pool:
            built = []
            bar = tqdm(total=len(entries), desc="suite build", unit="db")
            for db_id in sorted(entries):
                bar.set_postfix_str(db_id)
                built.append(suites.build_suite(entries[db_id], questions[db_id], st.work / db_id,
                                                st.work / ".candidates" / db_id, params, pool, source=cfg.tables))
                bar.update()
            bar.close()
            (st.work / ".candidates").rmdir()
            man = suites.manifest(params, built, {"tables": cfg.tables, "data": cfg.data})
            write_json(st.work / "manifest.json", man)
            report = validate_manifest(st.work, shown=st.out / "manifest.json")
            write_json(st.work / "validation.json", report.to_json(), default=str)
            (st.work / "validation.md").write_text(safe_text(report.to_markdown()), encoding="utf-8")
            if not report.success:  # a manifest that fails its checks is a bug here: no output, a failed run
                raise SlmsqlError(report.failure_message())
        for name in ("manifest.json", "validation.json", "validation.md"):
            mlflow.log_artifact(str(st.out / name))
        mlflow.log_metrics({k: float(v) for k, v in man["summary"].items() if v is not None}
                           | {"build_seconds": sum(b.seconds for b in built)})
        s = man["summary"]
        print(f"suite build: {s['n_files']} databases for {s['n_dbs']} db_id(s), {s['n_questions']} questions; "
              f"neighbours told apart {s['n_told_apart']} of {s['n_neighbours']}; {s['n_empty']} gold(s) empty on "
              f"every kept database, {s['n_gold_failed']} failed -> {st.out}", flush=True)
    return man
