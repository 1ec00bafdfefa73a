"""The whole lifecycle in one command, as MLflow's multistep-workflow pattern:

toy -> tiny-model -> sft -> filter -> grpo -> evaluate (SFT, GRPO vs SFT; dev and dev_cross) -> publish
(--dry-run unless --push: then the SFT model goes to --base-repo, the adapter to --repo-id, and the text2sql
model is registered)

With `--model` (a pretrained chat model, Hub id or path) the tiny model is not built: the model is evaluated
zero-shot first (`eval-zeroshot-<split>`, the SFT evaluations' baselines), and trained as `--recipes` says; an
SFT adapter then rides on that model through filter, GRPO (which trains it further) and evaluation.

Each step is its own `mlflow.run` (local env manager) under one parent run, reused when a finished run with
the same parameters and code version exists (`slmsql.workflow.steps`).
"""

from __future__ import annotations

from pathlib import Path

from slmsql.configs import PipelineConfig
from slmsql.workflow.steps import Steps, use_this_cli


def main(cfg: PipelineConfig) -> dict:
    import mlflow

    from slmsql.tracking import descriptions
    from slmsql.tracking import runs as tracking

    use_this_cli()
    with tracking.stage_run("pipeline", cfg) as parent:
        s = Steps(parent.info.experiment_id, output_dir=cfg.output_dir, experiment=cfg.experiment, seed=cfg.seed,
                  reuse=cfg.reuse, overrides=cfg.overrides, recipes=cfg.recipes)
        # each step's inputs are run URIs (runs:/<id>/<path>): its params say which run they came from
        toy = s.run("toy", "toy", size=cfg.size)
        world = s.uri(toy, "toy")
        dbs = f"{world}/databases"
        evals = {}
        if cfg.model:
            base = cfg.model
            for split in SPLITS:
                evals[f"zeroshot-{split}"] = s.run("evaluate", f"eval-zeroshot-{split}", model=base,
                                                   data=f"{world}/{split}.jsonl", db_root=dbs,
                                                   dataset_name=eval_set(split))
        else:
            base = s.uri(s.run("tiny-model", "tiny-model", data=world), "model")
        sft = s.run("sft", "sft", model=base, data=f"{world}/sft.jsonl", db_root=dbs)
        # the SFT policy: a LoRA adapter on the base, or a full model of its own
        if sft.data.tags.get("slmsql.policy_kind") == "adapter":
            policy = {"model": base, "adapter": s.uri(sft, "policy")}
            start = {"model": base, "base_adapter": policy["adapter"], "adapter_mode": "continue"}
        else:
            policy = start = {"model": s.uri(sft, "policy")}
        # the filter's data check refuses a band smaller than one optimizer step of the GRPO step below draws (a
        # GRPO run on it would train nothing); the GRPO step refuses it too, should an override lower min_band
        draw = s.config("grpo", "grpo", **start).questions_per_step()
        filt = s.run("filter", "filter", **policy, data=f"{world}/rl_source.jsonl", db_root=dbs,
                     min_band=draw.questions)
        grpo = s.run("grpo", "grpo", **start, data=s.uri(filt, "band.jsonl"), db_root=dbs)
        adapter = s.uri(grpo, "adapter")
        for split in SPLITS:
            data = f"{world}/{split}.jsonl"
            zeroshot = evals.get(f"zeroshot-{split}")
            base_eval = s.run("evaluate", f"eval-sft-{split}", **policy, data=data, db_root=dbs,
                              dataset_name=eval_set(split), baseline_run=zeroshot.info.run_id if zeroshot else "")
            evals[split] = s.run("evaluate", f"eval-grpo-{split}", model=policy["model"], adapter=adapter,
                                 data=data, db_root=dbs, dataset_name=eval_set(split),
                                 baseline_run=base_eval.info.run_id)
            evals[f"sft-{split}"] = base_eval
        push = {"dry_run": "false", "endpoint": cfg.hub_endpoint} if cfg.push else {"dry_run": "true"}
        local_base = "adapter" not in policy  # a full SFT model is pushed to --base-repo with the adapter
        s.run("publish", "publish", grpo_run=grpo.info.run_id, filter_run=filt.info.run_id,
              eval_runs=",".join(evals[x].info.run_id for x in SPLITS),
              repo_id=cfg.repo_id, base_repo=cfg.base_repo if local_base else "", **push)
        headline = headline_numbers(filt, grpo, evals)
        verdicts = {split: evals[split].data.tags.get("slmsql.verdict") for split in SPLITS}
        descriptions.log_headline(headline, verdicts)
        # the headline in the runs table: each eval set's GRPO-vs-SFT result, on this run, grouped by those eval
        # sets (a group of its own, first in slmsql's view: this run started before its steps)
        mlflow.set_tags({tracking.RESULT: "; ".join(f"{split} GRPO vs SFT: {evals[split].data.tags.get(tracking.RESULT)}"
                                                    for split in SPLITS),
                         tracking.GROUP_BY: ", ".join(eval_set(split) for split in SPLITS)})
        tracking.save_view(s.experiment_id)
        by_policy = {name: {split: evals[f"{name}-{split}"] for split in SPLITS if f"{name}-{split}" in evals}
                     for name in ("zeroshot", "sft")} | {"grpo": {split: evals[split] for split in SPLITS}}
        descriptions.link_pipeline(mlflow.get_run(parent.info.run_id), {"sft": sft, "grpo": grpo},
                                   {k: v for k, v in by_policy.items() if v})
        print_headline(headline, verdicts, s.out / "publish" / "README.md", tracking.ui_link(s.experiment_id),
                       cfg.model or "embedded toy default")
    return {**headline, **{f"verdict/{k}": v for k, v in verdicts.items()}}


SPLITS = ("dev", "dev_cross")
HEADLINE = {  # step -> the metrics of it the parent run carries, as `<step>/<metric>` (vocabulary.VOCABULARY)
    "filter": ("n_source", "band", "all_fail", "all_pass", "out_of_band", "errors"),
    "grpo": ("summary/frac_reward_zero_std", "summary/reward_std", "summary/exec/frac_groups_correctness_varies"),
    "eval-zeroshot": ("ex",),
    "eval-sft": ("ex", "vs_baseline/diff", "vs_baseline/p"),
    "eval-grpo": ("ex", "ex_ci_low", "ex_ci_high", "vs_baseline/diff", "vs_baseline/diff_ci_low",
                  "vs_baseline/diff_ci_high", "vs_baseline/p"),
}


def headline_numbers(filt, grpo, evals) -> dict:
    steps = {"filter": filt, "grpo": grpo}
    for split in SPLITS:
        steps[f"eval-sft-{split}"], steps[f"eval-grpo-{split}"] = evals[f"sft-{split}"], evals[split]
        if f"zeroshot-{split}" in evals:
            steps[f"eval-zeroshot-{split}"] = evals[f"zeroshot-{split}"]
    return {f"{name}/{k}": run.data.metrics[k] for name, run in steps.items()
            for k in HEADLINE[name.rsplit("-", 1)[0] if name.startswith("eval-") else name]
            if k in run.data.metrics}


def print_headline(h: dict, verdicts: dict, card: Path, link: str, model: str) -> None:
    import mlflow

    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    f = lambda k: h.get(k, float("nan"))  # noqa: E731
    lines = ["", f"slmsql lifecycle ({model}) finished", "",
             f"  filter buckets : band {f('filter/band'):.0f}, all-fail {f('filter/all_fail'):.0f}, all-pass "
             f"{f('filter/all_pass'):.0f}, out-of-band {f('filter/out_of_band'):.0f}, errors {f('filter/errors'):.0f}",
             f"  GRPO telemetry : frac_reward_zero_std {f('grpo/summary/frac_reward_zero_std'):.2f}, reward_std "
             f"{f('grpo/summary/reward_std'):.2f}, groups with varying correctness "
             f"{f('grpo/summary/exec/frac_groups_correctness_varies'):.2f}"]
    for split in SPLITS:
        zeroshot = f"zero-shot {pct(h[f'eval-zeroshot-{split}/ex'])} -> " if f"eval-zeroshot-{split}/ex" in h else ""
        lines.append(f"  EX {split:<10}: {zeroshot}SFT {pct(h.get(f'eval-sft-{split}/ex'))} -> GRPO "
                     f"{pct(h.get(f'eval-grpo-{split}/ex'))}  (McNemar p={f(f'eval-grpo-{split}/vs_baseline/p'):.3g}: "
                     f"{verdicts[split]})")
    lines += ["", f"  model card     : {card}"]
    store = mlflow.get_tracking_uri()
    if store.startswith(("http://", "https://")):  # a tracking server: its UI is already up
        lines += [f"  MLflow UI      : open {link}", ""]
    else:
        lines += [f"  MLflow UI      : .venv/bin/mlflow ui --backend-store-uri {store}",
                  f"                   then open {link}", ""]
    print("\n".join(lines), flush=True)


def eval_set(split: str) -> str:
    """The name an evaluation of the toy world's `split` logs its dataset under (the runs view groups by it)."""
    return f"toy-{split}"
