"""The whole lifecycle in one command, as MLflow's multistep-workflow pattern:

toy -> tiny-model -> sft -> filter -> grpo -> evaluate (SFT, GRPO vs SFT; dev and dev_cross) -> publish
(--dry-run unless --push: then the SFT model goes to --base-repo, the adapter to --repo-id, and the text2sql
model is registered)

Each step is its own `mlflow.run` (local env manager) under one parent run, reused when a finished run with
the same parameters and code version exists (`slmsql.workflow`).
"""

from __future__ import annotations

from pathlib import Path

from ..configs import PipelineConfig
from ..workflow import Steps, use_this_cli


def main(cfg: PipelineConfig) -> dict:
    import mlflow

    from .. import tracking

    use_this_cli()

    with tracking.stage_run("pipeline", cfg) as parent:
        s = Steps(parent.info.experiment_id, output_dir=cfg.output_dir, experiment=cfg.experiment, seed=cfg.seed,
                  reuse=cfg.reuse, overrides=cfg.overrides)
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
