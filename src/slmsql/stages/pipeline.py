"""The whole lifecycle in one command, as MLflow's multistep-workflow pattern:

toy -> tiny-model -> sft -> filter -> grpo -> evaluate (SFT, GRPO vs SFT; dev and dev_cross) -> publish
(--dry-run unless --push: then the SFT model goes to --base-repo, the adapter to --repo-id, and the text2sql
model is registered)

Each step is its own `mlflow.run` (local env manager) under one parent run. Steps hand each other their
outputs by run URI (artifacts downloaded from the tracking store, so a remote server works the same), and a
finished step whose parameters and code version match is reused instead of re-run.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from ..configs import PipelineConfig

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
            if all(run.data.params.get(k) == str(v) for k, v in params.items() if k != "overwrite"):
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
        """A step's output, fetched by run URI into a stable folder (a stable path keeps reuse matching)."""
        import mlflow

        dst = self.out / "from-runs" / run.info.run_id
        if (dst / path).exists():
            return str(dst / path)
        dst.mkdir(parents=True, exist_ok=True)
        return mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path=path, dst_path=str(dst))


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
        world = Path(s.artifact(toy, "toy"))
        dbs = str(world / "databases")
        tiny = s.run("tiny-model", "tiny-model", data=str(world))
        sft = s.run("sft", "sft", model=s.artifact(tiny, "model"), data=str(world / "sft.jsonl"), db_root=dbs)
        policy = s.artifact(sft, "policy")
        filt = s.run("filter", "filter", model=policy, data=str(world / "rl_source.jsonl"), db_root=dbs)
        grpo = s.run("grpo", "grpo", model=policy, data=s.artifact(filt, "band.jsonl"), db_root=dbs)
        adapter = s.artifact(grpo, "adapter")
        evals = {}
        for split in ("dev", "dev_cross"):
            data = str(world / f"{split}.jsonl")
            base = s.run("evaluate", f"eval-sft-{split}", model=policy, data=data, db_root=dbs,
                         dataset_name=f"toy-{split}")
            evals[split] = s.run("evaluate", f"eval-grpo-{split}", model=policy, adapter=adapter, data=data,
                                 db_root=dbs, dataset_name=f"toy-{split}", baseline_run=base.info.run_id)
            evals[f"sft-{split}"] = base
        push = {"dry_run": "false", "endpoint": cfg.hub_endpoint} if cfg.push else {"dry_run": "true"}
        s.run("publish", "publish", grpo_run=grpo.info.run_id, filter_run=filt.info.run_id,
              eval_runs=",".join(evals[x].info.run_id for x in ("dev", "dev_cross")),
              repo_id=cfg.repo_id, base_repo=cfg.base_repo, **push)
        headline = headline_numbers(filt, grpo, evals)
        mlflow.log_metrics(tracking.numeric(headline))
        print_headline(headline, s.out / "publish" / "README.md")
    return headline


def headline_numbers(filt, grpo, evals) -> dict:
    m = lambda run, k: run.data.metrics.get(k)  # noqa: E731
    out = {f"filter_{k}": m(filt, k) for k in ("band", "all_fail", "all_pass", "out_of_band", "errors")}
    out.update({k: m(grpo, f"summary/{k}") for k in ("frac_reward_zero_std", "reward_std",
                                                       "exec_frac_groups_correctness_varies")})
    for split in ("dev", "dev_cross"):
        out[f"sft_ex_{split}"] = m(evals[f"sft-{split}"], "ex")
        out[f"grpo_ex_{split}"] = m(evals[split], "ex")
        out[f"mcnemar_p_{split}"] = m(evals[split], "vs_baseline_mcnemar_p")
        out[f"verdict_{split}"] = evals[split].data.tags.get("slmsql.verdict")
    return out


def print_headline(h: dict, card: Path) -> None:
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    lines = ["", "slmsql lifecycle (embedded toy default) finished", "",
             f"  filter buckets : band {h['filter_band']:.0f}, all-fail {h['filter_all_fail']:.0f}, all-pass "
             f"{h['filter_all_pass']:.0f}, out-of-band {h['filter_out_of_band']:.0f}, errors {h['filter_errors']:.0f}",
             f"  GRPO telemetry : frac_reward_zero_std {h['frac_reward_zero_std']:.2f}, reward_std "
             f"{h['reward_std']:.2f}, groups with varying correctness {h['exec_frac_groups_correctness_varies']:.2f}"]
    for split in ("dev", "dev_cross"):
        lines.append(f"  EX {split:<10}: SFT {pct(h[f'sft_ex_{split}'])} -> GRPO {pct(h[f'grpo_ex_{split}'])}  "
                     f"(McNemar p={h[f'mcnemar_p_{split}']:.3g}: {h[f'verdict_{split}']})")
    lines += ["", f"  model card     : {card}",
              "  MLflow UI      : .venv/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db  (or your server)", ""]
    print("\n".join(lines), flush=True)
