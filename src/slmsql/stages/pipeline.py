"""The whole lifecycle in one command, as MLflow's multistep-workflow pattern:

toy -> tiny-model -> sft -> filter -> grpo -> evaluate (SFT, GRPO vs SFT; dev and dev_cross) -> publish --dry-run

Each step is its own `mlflow.run` (local env manager) under one parent run. Steps hand each other their
outputs by run URI (artifacts downloaded from the tracking store, so a remote server works the same), and a
finished step whose parameters and code version match is reused instead of re-run.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from ..configs import PipelineConfig
from ..tracking import param_value

log = logging.getLogger(__name__)
PACKAGE = Path(__file__).resolve().parents[1]  # src/slmsql
ROOT = PACKAGE.parents[1]  # the MLproject folder


def code_version() -> str:
    """Hash of everything that shapes a step's result: the whole package, the data-check suites and the card
    template. A reused step must have been produced by this code."""
    h = hashlib.sha256()
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "data_checks").glob("*.json"), *(ROOT / "model_card").glob("*")]
    for f in sorted(f for f in files if f.is_file() and "__pycache__" not in f.parts):
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


class Steps:
    def __init__(self, cfg: PipelineConfig, experiment_id: str):
        import mlflow

        self.cfg, self.experiment_id, self.version = cfg, experiment_id, code_version()
        self.client = mlflow.MlflowClient()
        self.out = Path(cfg.output_dir).resolve()

    def params(self, stage: str, name: str, given: dict) -> dict:
        extra = {k.split(".", 1)[1]: v for k, v in self.cfg.overrides.items() if k.split(".", 1)[0] == stage}
        return {"output_dir": str(self.out / name), "experiment": self.cfg.experiment, "run_name": name,
                "seed": self.cfg.seed, **given, **extra}

    def _reusable(self, stage: str, params: dict):
        runs = self.client.search_runs(
            [self.experiment_id], f"tags.`slmsql.stage` = '{stage}' and tags.`slmsql.code_version` = "
            f"'{self.version}' and attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"])
        for run in runs:
            # as stage_run logged them: empty options absent, fetched artifacts as run URIs
            if all(run.data.params.get(k, "") == param_value(v) for k, v in params.items() if k != "overwrite"):
                return run
        return None

    def run(self, stage: str, name: str, **given):
        """Run (or reuse) one step; returns its finished MLflow run."""
        import mlflow

        params = self.params(stage, name, given)
        if self.cfg.reuse and (found := self._reusable(stage, params)):
            log.info("step %-14s reused run %s", name, found.info.run_id)
            return found
        log.info("step %-14s running ...", name)
        sub = mlflow.run(str(ROOT), entry_point=stage.replace("-", "_"), env_manager="local",
                         experiment_id=self.experiment_id, run_name=name,
                         parameters={**params, "overwrite": "true"}, synchronous=True)
        self.client.set_tag(sub.run_id, "slmsql.code_version", self.version)
        return self.client.get_run(sub.run_id)

    def artifact(self, run, path: str) -> str:
        """A step's output as its run URI: the next step's params say where its input came from, and each
        step fetches a local copy (`tracking.fetch_inputs`, under <output_dir>/from-runs/<id>/)."""
        return f"runs:/{run.info.run_id}/{path}"


def main(cfg: PipelineConfig) -> dict:
    import os
    import sys

    import mlflow

    from .. import tracking

    # `mlflow run` starts each step as `slmsql <stage>`: make this environment's CLI the one it finds.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

    with tracking.stage_run("pipeline", cfg) as parent:
        s = Steps(cfg, parent.info.experiment_id)
        toy = s.run("toy", "toy", size=cfg.size)
        world = s.artifact(toy, "toy")
        dbs = f"{world}/databases"
        tiny = s.run("tiny-model", "tiny-model", data=world)
        sft = s.run("sft", "sft", model=s.artifact(tiny, "model"), data=f"{world}/sft.jsonl", db_root=dbs)
        policy = s.artifact(sft, "policy")
        filt = s.run("filter", "filter", model=policy, data=f"{world}/rl_source.jsonl", db_root=dbs)
        grpo = s.run("grpo", "grpo", model=policy, data=s.artifact(filt, "band.jsonl"), db_root=dbs)
        adapter = s.artifact(grpo, "adapter")
        evals = {}
        for split in SPLITS:
            data = f"{world}/{split}.jsonl"
            base = s.run("evaluate", f"eval-sft-{split}", model=policy, data=data, db_root=dbs,
                         dataset_name=f"toy-{split}")
            evals[split] = s.run("evaluate", f"eval-grpo-{split}", model=policy, adapter=adapter, data=data,
                                 db_root=dbs, dataset_name=f"toy-{split}", baseline_run=base.info.run_id)
            evals[f"sft-{split}"] = base
        s.run("publish", "publish", grpo_run=grpo.info.run_id, filter_run=filt.info.run_id,
                     eval_runs=",".join(evals[x].info.run_id for x in SPLITS),
                     repo_id=cfg.repo_id, dry_run="true")
        headline = headline_numbers(filt, grpo, evals)
        verdicts = {split: evals[split].data.tags.get("slmsql.verdict") for split in SPLITS}
        tracking.log_headline(headline, verdicts)
        print_headline(headline, verdicts, s.out / "publish" / "README.md", tracking.ui_link(s.experiment_id))
    return {**headline, **{f"verdict/{k}": v for k, v in verdicts.items()}}


SPLITS = ("dev", "dev_cross")
HEADLINE = {  # step -> the metrics of it the parent run carries, as `<step>/<metric>` (tracking.VOCABULARY)
    "filter": ("n_source", "band", "all_fail", "all_pass", "out_of_band", "errors"),
    "grpo": ("summary/frac_reward_zero_std", "summary/reward_std", "summary/exec/frac_groups_correctness_varies"),
    "eval-sft": ("ex",),
    "eval-grpo": ("ex", "ex_ci_low", "ex_ci_high", "vs_baseline/diff", "vs_baseline/diff_ci_low",
                  "vs_baseline/diff_ci_high", "vs_baseline/p"),
}


def headline_numbers(filt, grpo, evals) -> dict:
    steps = {"filter": filt, "grpo": grpo}
    for split in SPLITS:
        steps[f"eval-sft-{split}"], steps[f"eval-grpo-{split}"] = evals[f"sft-{split}"], evals[split]
    return {f"{name}/{k}": run.data.metrics[k] for name, run in steps.items()
            for k in HEADLINE[name.rsplit("-", 1)[0] if name.startswith("eval-") else name]
            if k in run.data.metrics}


def print_headline(h: dict, verdicts: dict, card: Path, link: str) -> None:
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    f = lambda k: h.get(k, float("nan"))  # noqa: E731
    lines = ["", "slmsql lifecycle (embedded toy default) finished", "",
             f"  filter buckets : band {f('filter/band'):.0f}, all-fail {f('filter/all_fail'):.0f}, all-pass "
             f"{f('filter/all_pass'):.0f}, out-of-band {f('filter/out_of_band'):.0f}, errors {f('filter/errors'):.0f}",
             f"  GRPO telemetry : frac_reward_zero_std {f('grpo/summary/frac_reward_zero_std'):.2f}, reward_std "
             f"{f('grpo/summary/reward_std'):.2f}, groups with varying correctness "
             f"{f('grpo/summary/exec/frac_groups_correctness_varies'):.2f}"]
    for split in SPLITS:
        lines.append(f"  EX {split:<10}: SFT {pct(h.get(f'eval-sft-{split}/ex'))} -> GRPO "
                     f"{pct(h.get(f'eval-grpo-{split}/ex'))}  (McNemar p={f(f'eval-grpo-{split}/vs_baseline/p'):.3g}: "
                     f"{verdicts[split]})")
    lines += ["", f"  model card     : {card}",
              "  MLflow UI      : .venv/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db  (or your server),",
              f"                   then open {link}", ""]
    print("\n".join(lines), flush=True)
