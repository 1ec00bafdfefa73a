"""Publish: a Hugging Face model card generated from the MLflow runs, pushed with the LoRA adapter in one commit.

args (repo ids, registry name, token) -> runs (exist, finished, right stage, one base model, one set of prompt
and generation settings) -> cards -> card checks -> OUT/ (exactly what is pushed: the adapter files + README.md;
with --base-repo also OUT/base/, the local base model + its own card) -> Hub: the base's commit to --base-repo
first (the adapter card names it as base_model), then one upload_folder commit of the adapter -> Hub URLs and
commits back on the GRPO run -> the `text2sql` MLflow model (slmsql.publishing.text2sql: adapter, base, prompt and
generation settings) logged to the GRPO run -> a Model Registry version of that model, with an alias.
--dry-run pushes nothing and takes nothing a push made: its model is a LoggedModel of its own made from the
written folder (a local registry needs no Hub), never the GRPO policy's, registered under the alias `dry-run`
(never --alias), without Hub tags, not loaded to check it, and holding no copy of a local base (`ship`); a later
real push fills the policy's LoggedModel and takes --alias.

Nothing is written, logged or sent before every check passes. The token lives in a local variable and the HfApi
client only: the config has no field for it, so it cannot reach params, tags, logs, artifacts or the card.
Re-publishing the same runs renders the same bytes; upload_folder then skips every unchanged file and makes no
commit (it returns the current head), the GRPO run's text2sql model of those commits is reused, and so is its
registry version.

With --study the GRPO run must be a cell of that study (its record names the run) and the study's report.json the one
its records give now; the card then states the study's comparisons, what transferred and what did not, and its
diagnosis per arm (`study_of`: a study is read here, a layer above the card). Its results table pairs each of the
cell's evaluations with the start's on that set, and its filter run is the start's, unless --filter-run says another;
where this tracking server lacks the start's runs (a study's cells run anywhere), the pairs come from the records alone.

A local base (a full fine-tune) is published only with --base-repo: its folder is pushed as it is (hard-linked
into OUT/base/, not copied) with a card saying what it is and where it came from (the SFT run that wrote it,
found from the folder: the pipeline's from-runs/<run id>/, else an SFT run whose --output-dir it is, else
--base-run), and the adapter's adapter_config.json and card name that repo as their base.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
from pathlib import Path

from slmsql.configs import PublishConfig
from slmsql.errors import DataError, SlmsqlError
from slmsql.inputs.data import write_json
from slmsql.inputs.sources import hub_id, same_model
from slmsql.publishing import card as cards
from slmsql.publishing.hub import check_repo_id, hub_token, push
from slmsql.publishing.registry import register, registry_name
from slmsql.runtime.outputs import Staged, link_or_copy
from slmsql.tracking import descriptions
from slmsql.tracking import runs as tracking
from slmsql.tracking.lineage import MODEL_TAG

log = logging.getLogger(__name__)
REQUIRED = ("base_model", "license", "tags", "model-index")


def _same_base(run, model: str, role: str) -> None:
    other = run.data.tags.get("slmsql.model", "")
    if not same_model(other, model):
        raise SlmsqlError(f"{role} run {run.info.run_id} evaluated base model {other!r}, but the GRPO run trained "
                          f"on {model!r}: the card would compare different models")


def gather(cfg: PublishConfig, tmp: Path) -> tuple[cards.Runs, Path]:
    """Every run the card cites, checked; returns them and the downloaded adapter folder."""
    import mlflow

    from slmsql.policy.models import check_adapter_base
    from slmsql.publishing.text2sql import settings_from_runs

    client = mlflow.MlflowClient()
    sweep_run, sweep, eval_runs = None, None, cfg.eval_runs
    study = study_of(cfg) if cfg.study else None  # refused here, before any run is read
    if study is not None:
        eval_runs = eval_runs or list(study["record"]["mlflow"]["eval_runs"].values())
    if cfg.sweep_run:
        sweep_run = tracking.stage_run_of(client, cfg.sweep_run, "sweep", "sweep")
        sweep = json.loads(tracking.download(cfg.sweep_run, "report/sweep.json", tmp / "sweep").read_text())
        cell = next((c for c in sweep["cells"] if c["grpo_run"] == cfg.grpo_run), None)
        if cell is None:
            raise SlmsqlError(f"GRPO run {cfg.grpo_run} is not a cell of sweep run {cfg.sweep_run}")
        eval_runs = eval_runs or list(cell["eval_runs"].values())
    if not eval_runs:
        raise SlmsqlError("give --eval-runs: the card's results (model-index) come from evaluation runs")
    grpo = tracking.stage_run_of(client, cfg.grpo_run, "grpo", "GRPO")
    model = grpo.data.tags.get("slmsql.model", "")
    base = None
    if hub_id(model) is not None:
        if cfg.base_repo:
            raise SlmsqlError(f"--base-repo {cfg.base_repo}: the GRPO run's base model {model!r} is on the Hub "
                              "already; --base-repo is for a local base (a full fine-tune)")
    elif cfg.base_repo:
        base = local_base(client, cfg, grpo, model, tmp)
    elif not cfg.dry_run:
        raise SlmsqlError(f"the GRPO run's base model {model!r} is a local checkpoint, not a Hub model id: give "
                          "--base-repo OWNER/NAME to push it too (the adapter's card then names that repo as its "
                          "base), or train on a Hub id; --dry-run writes the folder")
    else:
        log.warning("base model %r is a local checkpoint: this card could be written, not pushed", model)
    evals, baselines = [], {}
    for run_id in eval_runs:
        run = tracking.stage_run_of(client, run_id, "evaluate", "evaluation")
        _same_base(run, model, "evaluation")
        metrics = json.loads(tracking.download(run_id, "metrics.json", tmp / run_id).read_text())
        vs_start = (study or {}).get("vs_start", {}).get(run.data.tags.get("slmsql.dataset"))
        from_start = bool(vs_start) and not metrics.get("comparison")
        if from_start:  # a cell is evaluated alone: the report's baseline is the start
            metrics["comparison"] = vs_start
        baseline = (metrics.get("comparison") or {}).get("baseline_run")
        if baseline and (not from_start or _held(client, baseline, "evaluation", study)):
            baselines[baseline] = tracking.stage_run_of(client, baseline, "evaluate", "baseline evaluation")
            _same_base(baselines[baseline], model, "baseline evaluation")
        evals.append((run, metrics))
    datasets = [run.data.tags.get("slmsql.dataset") for run, _ in evals]
    if len(set(datasets)) != len(datasets):
        raise SlmsqlError(f"two evaluation runs on one dataset ({datasets}): give one per dataset")
    adapter = tracking.download(grpo.info.run_id, "adapter", tmp / "grpo")
    check_adapter_base(adapter, model)  # the artifact is an adapter for the model the run names
    # what the text2sql model generates with: refused now, before anything is written, if it is ambiguous
    settings = settings_from_runs(grpo, [run for run, _ in evals])
    runs = cards.Runs(grpo=grpo, adapter_config=json.loads((adapter / "adapter_config.json").read_text()),
                      evals=evals, baselines=baselines, sweep_run=sweep_run, sweep=sweep, base=base, study=study,
                      settings=settings,
                      history={k: [m.value for m in client.get_metric_history(grpo.info.run_id, k)]
                               for _, k, _, _ in cards.TELEMETRY})
    filter_run = cfg.filter_run or (study or {}).get("filter_run")  # a study's band is its start's filter's
    if filter_run and not cfg.filter_run and not _held(client, filter_run, "filter", study):
        filter_run = None
    if filter_run:
        runs.filter = tracking.stage_run_of(client, filter_run, "filter", "filter")
        runs.filter_summary = json.loads(tracking.download(filter_run, "summary.json", tmp / "filter").read_text())
        trained = _rl_rows(grpo)
        band = runs.filter_summary["buckets"]["band"]
        if trained is not None and trained != band:
            raise SlmsqlError(f"filter run {filter_run} kept {band} band questions, but GRPO run {cfg.grpo_run} "
                              f"trained on {trained}: not the same RL data")
    return runs, adapter


def _held(client, run_id: str, role: str, study: dict) -> bool:
    """Whether this tracking server holds the study's start run `run_id`. A study's cells run anywhere (its records
    are the data), so the machine publishing a cell may not hold the start's runs: the card's comparison with the
    start then comes from the records alone, without that run's reproduce command (and, for the filter, its table)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        client.get_run(run_id)
        return True
    except MlflowException:
        log.warning("the start's %s run %s (%s/records/start.json) is not in %s: the card compares with the start "
                    "from the study's records, without that run's %s", role, run_id, study["folder"],
                    mlflow.get_tracking_uri(), "table and command" if role == "filter" else "command")
        return False


def study_of(cfg: PublishConfig) -> dict:
    """The study whose cell --grpo-run is (publish --study): its cell record (strictly read, as `study report`
    reads them), its report.json, which must be the one its records give now (a stale report would put other
    verdicts on the card than the records hold), its diagnosis table as the report prints it, and per eval set the
    cell's paired comparison against the start's evaluation (evaluate's own, from the records' per-question results:
    a cell's evaluations run without a baseline) and the start's filter run."""
    from slmsql.inputs.data import dumps
    from slmsql.stats import inference
    from slmsql.studies import records, report, spec, tables

    if cfg.sweep_run:
        raise SlmsqlError("give --study or --sweep-run, not both: the card's seeds and verdicts come from one of them")
    study = spec.load(cfg.study)
    start, cells = records.read(study)
    rec = next((r for r in cells.values() if (r.get("mlflow") or {}).get("grpo_run") == cfg.grpo_run), None)
    if rec is None:
        raise DataError(f"GRPO run {cfg.grpo_run} is not a cell of study {study.name}: none of its {len(cells)} "
                        "cell records names it as its grpo_run", study.records)
    path = study.folder / "report.json"
    try:
        written = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"no report: run `slmsql study report {cfg.study}` first", path) from None
    except json.JSONDecodeError as e:
        raise DataError(f"malformed JSON: {e.msg}", path, e.lineno) from None
    now = report.build(study.as_dict(), start, [cells[c.id] for c in study.cells() if c.id in cells])
    if written != json.loads(dumps(now, allow_nan=False)):
        raise DataError(f"not the report the study's records give now: run `slmsql study report {cfg.study}` first",
                        path)
    made = (start or {}).get("mlflow") or {}
    vs_start = {es: {"baseline_run": made["eval_runs"][es],  # the cell against its start, question by question
                     **inference.compare([rec["results"][es][q][0] for q in qs],
                                         [start["results"][es][q][0] for q in qs], alpha=study.alpha)}
                for es, qs in rec["results"].items()
                if es in made.get("eval_runs", {}) and sorted(start["results"].get(es, {})) == sorted(qs)}
    return {"folder": cfg.study, "record": rec, "report": written, "cell": rec["cell"], "arm": rec["arm"],
            "seed": rec["seed"], "vs_start": vs_start, "filter_run": made.get("filter_run"),
            "diagnosis": tables.diagnosis_table(written["diagnosis"], [es["name"] for es in written["eval_sets"]])}


def local_base(client, cfg: PublishConfig, grpo, model: str, tmp: Path) -> cards.Base:
    """The local base to push: a full model folder (a run artifact `runs:/<id>/<path>`, as the pipeline's GRPO
    runs name it, fetched under `tmp`), and the runs that made it (for its card)."""
    path = Path(tracking.fetch(model, tmp) if tracking.RUN_URI.fullmatch(model) else model).expanduser()
    weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    if not (path / "config.json").is_file() or not weights:
        raise SlmsqlError(f"--base-repo: the GRPO run's base {model!r} is not a model folder here (config.json and "
                          "weights): publish where it was trained, or copy it to that path")
    if (path / "adapter_config.json").is_file():
        raise SlmsqlError(f"--base-repo: {model!r} is a PEFT adapter, not a full model")
    if cfg.base_run:
        sft = tracking.stage_run_of(client, cfg.base_run, "sft", "base (--base-run)")
    else:
        sft = producer(client, model, "sft", grpo.info.experiment_id)
        if sft is None:
            log.warning("no MLflow SFT run is known to have written %s: its card will say so (give --base-run)",
                        model)
    parent = producer(client, sft.data.params.get("model", ""), "tiny-model", sft.info.experiment_id) if sft else None
    return cards.Base(path=str(path), sft=sft, parent=parent)


def producer(client, path: str, stage: str, experiment_id: str):
    """The finished `stage` run that wrote the local folder `path`, or None: the pipeline hands a step's
    outputs on as runs:/<run id>/<path>, fetched to from-runs/<run id>/; a stage run records its --output-dir."""
    from mlflow.exceptions import MlflowException

    path = tracking.param_value(path)  # a fetched copy, as its run URI
    parts = ("from-runs", m[1]) if (m := tracking.RUN_URI.fullmatch(path)) else Path(path).parts
    if "from-runs" in parts[:-1]:
        try:
            run = client.get_run(parts[parts.index("from-runs") + 1])
        except MlflowException:
            run = None
        if run is not None and run.data.tags.get("slmsql.stage") == stage and run.info.status == "FINISHED":
            return run
    if not path or "'" in path:
        return None
    found = client.search_runs([experiment_id], f"tags.`slmsql.stage` = '{stage}' and params.output_dir = '{path}' "
                               "and attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"])
    return found[0] if found else None


def _rl_rows(grpo) -> int | None:
    """Rows of the RL data the GRPO run logged as its training input (None when it logged none)."""
    for item in grpo.inputs.dataset_inputs if grpo.inputs else []:
        if item.dataset.name == "rl" and item.dataset.profile:
            return json.loads(item.dataset.profile).get("num_rows")
    return None


def check_card(text: str, data, required=REQUIRED, library: str = "peft") -> None:
    """What the Hub reads: the front matter parses, holds the required fields, and round-trips exactly."""
    from huggingface_hub import ModelCard

    try:
        parsed = ModelCard(text).data.to_dict()
    except Exception as e:  # yaml errors, or ModelCardData refusing the metadata
        raise SlmsqlError(f"rendered card: the front matter does not parse ({e})") from None
    missing = [k for k in required if not parsed.get(k)] + ([] if parsed.get("library_name") == library
                                                           else [f"library_name: {library}"])
    if missing or ("model-index" in required and not parsed["model-index"][0].get("results")):
        raise SlmsqlError(f"rendered card: missing {missing or ['model-index results']}")
    if parsed != data.to_dict():
        raise SlmsqlError("rendered card: the front matter does not round-trip through huggingface_hub.ModelCard")


def write_folder(work: Path, cfg: PublishConfig, runs: cards.Runs, adapter: Path, card: str, base_card: str | None):
    """OUT/: the adapter files and their card; with a local base, OUT/base/: its files and its own card."""
    shutil.copytree(adapter, work, dirs_exist_ok=True)
    (work / "README.md").write_text(card, encoding="utf-8")  # replaces PEFT's placeholder card
    if runs.base is not None:
        # the adapter and, for a stacked one, the adapters in base_adapter/ beneath it: all on the pushed base
        for file in sorted(work.rglob("adapter_config.json")):
            config = json.loads(file.read_text())
            write_json(file, {**config, "base_model_name_or_path": cfg.base_repo})
        shutil.copytree(runs.base.path, work / "base", copy_function=link_or_copy)
        (work / "base" / "README.md").unlink(missing_ok=True)  # a link: writing through it would edit the source
        (work / "base" / "README.md").write_text(base_card, encoding="utf-8")


def push_all(cfg: PublishConfig, token: str, out: Path, runs: cards.Runs) -> dict:
    """The pushes (base first) and the Hub facts on the GRPO run and this one."""
    import mlflow

    result, tags = {}, {}
    if runs.base is not None:
        base = push(cfg, token, out / "base", repo_id=cfg.base_repo,
                    message=f"Base model of the GRPO adapter {cfg.repo_id} (slmsql publish)",
                    description=f"The base {tracking.portable(runs.base.path)} the adapter of MLflow run "
                                f"{cfg.grpo_run} was trained on")
        result.update({f"base_{k}": v for k, v in base.items()})
        tags.update({"slmsql.base_hub_url": base["hub_url"], "slmsql.base_hub_commit": base["hub_commit"]})
    hub = push(cfg, token, out, ignore=("base/*",))
    result.update(hub)
    tags.update({"slmsql.hub_url": hub["hub_url"], "slmsql.hub_commit": hub["hub_commit"]})
    for key, value in tags.items():
        mlflow.MlflowClient().set_tag(cfg.grpo_run, key, value)
    mlflow.set_tags(tags)
    return result


def ship(cfg: PublishConfig, token: str | None, out: Path, runs: cards.Runs, name: str | None) -> dict:
    """The pushes unless --dry-run; then, either way, the text2sql model and its registry version.

    A dry run's model is a LoggedModel of its own (never the GRPO policy's, which a later push fills, so the line
    run -> policy model (with its EX) -> registered version holds), registered under the alias `dry-run` (never
    --alias: a pushed version keeps it), not checked by loading it (the base may be minutes of Hub retries away
    offline), and it copies no local base into MLflow: a base that is a run's artifact already (the pipeline's
    SFT model) is named by its URI and fetched when the model loads; another local base gets no model."""
    import mlflow

    from slmsql.publishing.text2sql import describe_text2sql, log_text2sql, stage_base

    result = {} if cfg.dry_run else push_all(cfg, token, out, runs)
    model = runs.grpo.data.tags.get("slmsql.model", "")
    base_uri = tracking.param_value(model) if cfg.dry_run and runs.base is not None else None
    if base_uri is not None and not tracking.RUN_URI.fullmatch(base_uri):
        log.warning("no text2sql model and no registry version in a dry run: its base %r is a local folder, which "
                    "the model would have to copy into MLflow (the push holds it, from --base-repo)", model)
        return result
    if hub_id(model) is None and runs.base is None:  # a dry run only: gather refuses to push such a base
        log.warning("no text2sql model and no registry version: its base %r is a local checkpoint (give "
                    "--base-repo to name it; the model then holds its weights)", model)
        return result
    model_config = {"base_model": hub_id(model), "base_repo": cfg.base_repo or None, **runs.settings,
                    "decoding": "greedy", "grpo_run": cfg.grpo_run, "hub_repo": cfg.repo_id,
                    **({"base_uri": base_uri} if base_uri else {})}
    commits = {"adapter": result.get("hub_commit"), "base": result.get("base_hub_commit")}  # None: not pushed
    with tempfile.TemporaryDirectory() as tmp:
        adapter = Path(tmp) / "adapter"  # exactly the written adapter folder (its card included)
        shutil.copytree(out, adapter, ignore=shutil.ignore_patterns("base"))
        base_dir = stage_base(out / "base", cfg.base_repo.split("/")[1], Path(tmp)) if runs.base and not base_uri \
            else None
        model_uri, _ = log_text2sql(cfg.grpo_run, adapter, model_config, commits, base_dir,
                                    into=None if cfg.dry_run else runs.grpo.data.tags.get(MODEL_TAG),
                                    dry_run=cfg.dry_run)
    result.update(text2sql_model=model_uri)
    if not cfg.dry_run:
        # The push's metric is this run's, not the model's: logged after the model (Model.log copies the run's
        # metrics of its step into the model) and by the client (mlflow.log_metric files it under the run's
        # output models).
        mlflow.MlflowClient().log_metric(mlflow.active_run().info.run_id, "hub_new_commit",
                                         float(result["new_commit"]))
    mlflow.set_tag("slmsql.text2sql_model", model_uri)
    if name:
        result.update(register(name, cfg, result, model_uri))
    # its page in the UI: what it serves, what it wraps, its runs, pushed or not (a policy's model has its own)
    describe_text2sql(model_uri.removeprefix("models:/"), model_config, commits, cfg.eval_runs, cfg.filter_run,
                      result if name else None)
    return result


def main(cfg: PublishConfig) -> dict:
    import mlflow

    check_repo_id(cfg.repo_id)
    if cfg.base_repo:
        check_repo_id(cfg.base_repo)
        if cfg.base_repo.lower() == cfg.repo_id.lower():
            raise SlmsqlError("--base-repo must differ from --repo-id: the base and the adapter are two repos")
    name = registry_name(cfg)
    token = hub_token(cfg.dry_run)
    tracking.configure()
    st = Staged(cfg.output_dir, cfg.overwrite)  # refused before any download if the folder is in the way
    with tempfile.TemporaryDirectory() as tmp:
        runs, adapter = gather(cfg, Path(tmp))
        # eval runs taken from the sweep's cell are named as if given: in the card's command and the registry
        cfg = dataclasses.replace(cfg, eval_runs=[run.info.run_id for run, _ in runs.evals])
        ctx = cards.context(runs, cfg)
        data = cards.card_data(ctx, cfg.license)
        text = cards.render(ctx, data)
        check_card(text, data)
        base_card = None
        if runs.base is not None:
            base_ctx = cards.base_context(runs, cfg)
            base_data = cards.base_card_data(base_ctx, cfg.license)
            base_card = cards.render(base_ctx, base_data, "base.md.j2")
            check_card(base_card, base_data, required=("license", "tags"), library="transformers")
        with st:
            write_folder(st.work, cfg, runs, adapter, text, base_card)
    out = Path(cfg.output_dir)
    result = {"output_dir": str(out), "files": sorted(p.name for p in out.iterdir())}
    with tracking.stage_run("publish", cfg, tags={"slmsql.grpo_run": cfg.grpo_run, "slmsql.repo_id": cfg.repo_id}):
        mlflow.log_artifact(str(out / "README.md"), "card")
        if base_card is not None:
            mlflow.log_artifact(str(out / "base" / "README.md"), "base_card")
        result.update(ship(cfg, token, out, runs, name))
        tracking.log_json({k: v for k, v in result.items() if k != "output_dir"}, "publish.json")  # the param
        tracking.describe(descriptions.publish_note(cfg, result))
    log.info("publish: %s", json.dumps(result))
    return result
