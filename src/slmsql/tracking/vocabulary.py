"""The metric vocabulary: every metric name a run logs, in one place.

(name, runs that log it, meaning). A `<placeholder>` stands for any of the values in PLACEHOLDERS. The docs'
metric vocabulary page (docs/vocabulary.md) is `vocabulary_markdown()`, filled in when the docs build
(docs/hooks.py); tests fail when a stage logs a name that is not here.
"""

from __future__ import annotations

import re

from slmsql.rewards.registry import REGISTRY as REWARDS
from slmsql.rewards.registry import describe as describe_reward
from slmsql.tracking.runs import STAT_DIGITS, numeric

OUTCOME_STATUSES = ("correct", "wrong_result", "error", "timeout", "truncated", "rejected", "no_sql", "missing",
                    "gold_error", "gold_too_large", "gold_empty")
TRL_NAMES = ("loss", "grad_norm", "learning_rate", "epoch", "entropy", "num_tokens", "mean_token_accuracy", "kl",
             "aux_loss", "policy_loss", "entropy_coef", "cispo_clip_ratio", "step_time", "train_runtime",
             "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss")
TRL_PREFIXES = ("completions", "rewards", "clip_ratio", "sampling", "tools", "profiling", "vespo")
SUMMARY_OF = ("reward", "reward_std", "frac_reward_zero_std", "grad_norm", "exec/correct",
              "exec/frac_groups_correctness_varies", "completions/mean_length", "entropy", "step_time",
              "dynamic_sampling/groups_dropped", "dynamic_sampling/extra_rounds")
# the learning signal, logged again per step as `0_signal/<name>` (training.StepMetrics: its charts come first)
SIGNAL = ("reward", "reward_std", "frac_reward_zero_std", "exec/frac_groups_correctness_varies")
SIGNAL_PREFIX = "0_signal"
PLACEHOLDERS = {
    "<difficulty>": "simple|moderate|challenging",
    "<status>": "|".join(OUTCOME_STATUSES),
    "<i>": r"\d+", "<k>": r"\d+",
    "<split>": "sft|rl_source|dev|dev_cross",
    "<count>": "total|simple|moderate|challenging",
    "<metric>": "|".join(map(re.escape, SUMMARY_OF)),
    "<trl metric>": "|".join(TRL_NAMES) + "|(?:" + "|".join(TRL_PREFIXES) + r")/[\w./-]+",
    "<system metric>": r"[\w./-]+",
    "<step>": r"[\w-]+",
    "<step metric>": r"[\w./-]+",
    "<signal>": "|".join(map(re.escape, SIGNAL)),
    "<ds metric>": "groups_sampled|groups_kept|groups_dropped|groups_filled|extra_rounds",
    "<is stat>": "min|mean|max",
    "<reward>": "|".join(REWARDS),
}
VOCABULARY = [
    ("ex", ("evaluate",), "execution accuracy: share of questions whose predicted SQL returns the gold result"),
    ("ex_ci_low", ("evaluate",), "lower bound of the 95% Wilson interval of `ex`"),
    ("ex_ci_high", ("evaluate",), "upper bound of the 95% Wilson interval of `ex`"),
    ("n", ("evaluate",), "questions scored"),
    ("n_correct", ("evaluate",), "questions answered right"),
    ("ex_<difficulty>", ("evaluate",), "`ex` on the questions of one difficulty (simple, moderate, challenging)"),
    ("n_<difficulty>", ("evaluate",), "questions of that difficulty"),
    ("exec/<status>", ("evaluate", "grpo"),
     "share of answers with this outcome: correct, wrong_result (ran, other rows), error, timeout, truncated "
     "(stopped: more rows than can match the gold), rejected (by the sandbox), no_sql, missing (no prediction), "
     "gold_error, gold_too_large (gold over the digest budget), gold_empty (test-suite: gold returns no rows on "
     "any database of its suite); per question (evaluate), per sampled "
     "completion at each step (grpo). Tables name outcomes the same way (`status`)"),
    ("ex_single_db", ("evaluate",), "test-suite: `ex` on each suite's first database alone (today's one-database "
     "EX), on the same questions"),
    ("suite_single_disagree", ("evaluate",), "test-suite: share of questions where the one-database verdict and the "
     "suite's verdict differ"),
    ("n_gold_unscored", ("evaluate",), "test-suite: questions left out of `n` because their gold fails or returns "
     "nothing on their suite (ids in metrics.json's gold_unscored_ids)"),
    ("exec/suite_single_disagree", ("grpo",), "test-suite: share of sampled completions at each step that the "
     "first database alone would have paid otherwise than the whole suite"),
    ("baseline/ex", ("evaluate",), "`ex` of the baseline run (`--baseline-run`) on the same questions"),
    ("baseline/ex_ci_low", ("evaluate",), "lower bound of the baseline's Wilson interval at confidence 1 − α"),
    ("baseline/ex_ci_high", ("evaluate",), "upper bound of the baseline's Wilson interval at confidence 1 − α"),
    ("vs_baseline/diff", ("evaluate",), "`ex` minus `baseline/ex` (this run minus the baseline)"),
    ("vs_baseline/diff_ci_low", ("evaluate",),
     "lower bound of the difference's exact interval at 1 − α (excludes 0 exactly when `vs_baseline/p` < α)"),
    ("vs_baseline/diff_ci_high", ("evaluate",), "upper bound of that interval"),
    ("vs_baseline/p", ("evaluate",), "McNemar's exact two-sided p on the questions the two runs disagree on"),
    ("vs_baseline/mdd", ("evaluate",), "smallest difference the test detects with 80% power at this n"),
    ("vs_baseline/only_this_right", ("evaluate",), "questions this run got right and the baseline wrong"),
    ("vs_baseline/only_baseline_right", ("evaluate",), "questions the baseline got right and this run wrong"),
    ("vs_baseline/both_right", ("evaluate",), "questions both runs got right"),
    ("vs_baseline/both_wrong", ("evaluate",), "questions both runs got wrong"),
    ("n_source", ("filter",), "source questions sampled"),
    ("band", ("filter",), "questions with low < pass rate < high: the RL data"),
    ("all_fail", ("filter",), "questions no sample answered right (0/K)"),
    ("all_pass", ("filter",), "questions every sample answered right (K/K)"),
    ("out_of_band", ("filter",), "questions with another pass rate (neither band, 0/K nor K/K)"),
    ("out_of_band_<i>_of_<k>", ("filter",), "questions with pass rate exactly i/K outside the band"),
    ("errors", ("filter",), "questions that could not be sampled: missing database, or gold SQL that fails"),
    ("data_check_success", ("filter",), "1 when the rl data check passed on the filter's own output"),
    ("reward", ("grpo",), "mean total reward per sampled completion (TRL)"),
    ("reward_std", ("grpo",), "reward standard deviation within a prompt's group (TRL)"),
    ("0_signal/<signal>", ("grpo",), "`reward`, `reward_std`, `frac_reward_zero_std` and "
     "`exec/frac_groups_correctness_varies` again, per step, named so that the MLflow UI draws their charts first "
     "(it orders chart sections by name); `clip_ratio/*` are logged only once they leave their first value"),
    ("rewards/<reward>/mean", ("grpo",),
     "per step, the mean over the sampled completions of one reward of `--rewards`, unweighted (TRL; `/std` its "
     "standard deviation). " + " ".join(f"`{n}`: {describe_reward(n)}" for n in REWARDS)),
    ("rewards/<reward>/std", ("grpo",), "per step, the standard deviation of that reward over the completions (TRL)"),
    ("frac_reward_zero_std", ("grpo",), "share of groups whose completions all got one reward: no gradient (TRL)"),
    ("exec/frac_groups_correctness_varies", ("grpo",),
     "share of groups holding both right and wrong SQL: the signal about correctness"),
    ("dynamic_sampling/<ds metric>", ("grpo",),
     "`--dynamic-sampling`, per step: groups sampled, kept (correctness varies), dropped, filled back in, and "
     "the extra generation rounds it took"),
    ("advantage_gate/frac_groups_zeroed", ("grpo",),
     "`--advantage-gate correctness`: share of groups whose advantages were zeroed (no correctness variance)"),
    ("rollout/policy_step", ("grpo",),
     "`--backend vllm`: the trainer step whose LoRA the engine sampled this step's rollouts with, read from the "
     "adapter vLLM's outputs name; the run stops if it is not the policy's current step and weights"),
    ("rollout/merged_logprob_gap", ("grpo",),
     "`--merged-rollouts`, at the first rollout with a non-zero LoRA (a fresh one's: the second step's): the "
     "largest |log-prob, LoRA merged - the training forward's| over the sampled completions' tokens, dropout off; "
     "over the tolerance (1e-3 in float32) the run stops (tag `slmsql.merged_rollouts`)"),
    ("sampling/sampling_logp_difference/mean", ("grpo",),
     "`--backend vllm`, per step: mean over the sampled tokens of |log-prob under the policy being trained - "
     "log-prob the vLLM engine sampled it with| (TRL's; 0 up to float error when the engine serves that policy)"),
    ("sampling/sampling_logp_difference/max", ("grpo",), "the largest such gap over the step's sampled tokens"),
    ("sampling/importance_sampling_ratio/<is stat>", ("grpo",),
     "`--backend vllm`, per step: min, mean and max of TRL's importance-sampling correction "
     "(exp of the gap, per sequence by default; `vllm_importance_sampling_*` trainer args)"),
    ("shared_prefix/logp_max_abs_diff", ("grpo",),
     "`--shared-prefix` (on by default), at the first step: the largest |log-prob, shared-prefix computation - the "
     "plain path's| over one micro-batch's completion tokens, in float32 whatever the run computes in, dropout off; "
     "over its tolerance (1e-3) the run falls back to TRL's own path (tag `slmsql.shared_prefix` says which)"),
    ("shared_prefix/cost_ratio", ("grpo",),
     "`--shared-prefix`, at the first step: the cost model's forward FLOPs of the plain path over the packed one's on "
     "the self-check's micro-batch (weights per token plus attention per query-key pair, padding included); at 1 or "
     "under the run falls back to TRL's own path (tag `slmsql.shared_prefix` says so)"),
    ("shared_prefix/token_ratio", ("grpo",),
     "`--shared-prefix`, per step: tokens the plain path's training forward would compute (rows x width, padding "
     "included) over the tokens the shared-prefix forward computed"),
    ("summary/<metric>", ("grpo",), "mean over the run's logged steps of `<metric>` (e.g. `summary/reward_std`, "
                                    "`summary/exec/frac_groups_correctness_varies`)"),
    ("<trl metric>", ("sft", "grpo"),
     "TRL's and transformers' own training metrics under their names: loss, grad_norm, learning_rate, epoch, "
     "entropy, num_tokens, mean_token_accuracy (sft), kl (beta > 0), train_runtime, train_loss, ...; and "
     "`completions/*`, `rewards/<reward>/mean` and `/std`, `clip_ratio/*`, `sampling/*`"),
    ("steps", ("sft", "grpo"), "optimizer steps taken"),
    ("train_seconds", ("sft", "grpo"), "wall-clock training time (of a resumed run: its last attempt's, for the "
                                        "steps after `resumed_at_step`)"),
    ("resumed_at_step", ("grpo",), "`--resume`: the step of the checkpoint the run went on from (absent if it "
                                   "never resumed)"),
    ("train_loss", ("sft",), "mean training loss over the run"),
    ("examples", ("sft",), "training examples"),
    ("tokens/prompt_max", ("sft", "filter", "grpo", "evaluate"),
     "longest prompt in the model's tokens (chat template applied), counted before any model loads"),
    ("tokens/prompt_mean", ("sft", "filter", "grpo", "evaluate"), "mean prompt length in tokens"),
    ("tokens/context", ("filter", "grpo", "evaluate"),
     "the model's context in tokens: a prompt plus the generation budget must fit it"),
    ("tokens/answer_max", ("evaluate",), "longest generated answer in tokens (its text encoded again)"),
    ("tokens/answer_mean", ("evaluate",), "mean generated answer length in tokens"),
    ("tokens/answer_at_budget", ("evaluate",),
     "share of answers that reached `max_new_tokens` (within a token), most of them cut before they ended; at 0.1 "
     "or more the run warns that its figures measure the budget"),
    ("tokens/example_max", ("sft",), "longest training example (prompt + answer) in tokens; at most `max_length`"),
    ("tokens/example_mean", ("sft",), "mean training example length in tokens"),
    ("tokens/dropped_long", ("sft",), "examples left out as longer than `max_length` (`--drop-long`; else refused)"),
    ("system/<system metric>", ("sft", "grpo", "filter"),
     "MLflow's system metrics, every 10 s: CPU, memory, disk, network, and GPU where pynvml is installed"),
    ("<split>_<count>", ("toy",), "questions per split (sft, rl_source, dev, dev_cross), total and per difficulty"),
    ("generate_seconds", ("toy",), "time to generate the toy world"),
    ("parameters", ("tiny-model",), "model parameters"),
    ("vocab_size", ("tiny-model",), "tokenizer vocabulary size"),
    ("texts", ("tiny-model",), "texts the tokenizer was trained on"),
    ("build_seconds", ("tiny-model",), "time to build the model"),
    ("n_expectations", ("validate",), "expectations checked"),
    ("n_failed", ("validate",), "expectations that failed"),
    ("success", ("validate",), "1 when every expectation passed"),
    ("n_rows", ("validate",), "rows validated"),
    ("gx_seconds", ("validate",), "Great Expectations validation time"),
    ("n_dbs", ("suite build",), "db_ids a suite was built for"),
    ("n_files", ("suite build",), "databases kept over all suites"),
    ("n_questions", ("suite build",), "questions of those db_ids"),
    ("n_empty", ("suite build",), "questions whose gold returns no rows on any database of its suite (listed by id "
     "in the manifest)"),
    ("n_gold_failed", ("suite build",), "questions whose gold does not run on its schema (listed by id in the "
     "manifest)"),
    ("n_neighbours", ("suite build",), "the golds' executable neighbours (near-miss queries), all questions"),
    ("n_told_apart", ("suite build",), "neighbours whose result differs from their gold's on some database of the "
     "suite"),
    ("told_apart_share", ("suite build",), "`n_told_apart` / `n_neighbours`"),
    ("coverage_mean", ("suite build",), "mean over questions with neighbours of the share of its neighbours the suite "
     "tells apart"),
    ("coverage_min", ("suite build",), "the lowest question's coverage"),
    ("coverage_p10", ("suite build",), "10th percentile of the questions' coverage"),
    ("coverage_p25", ("suite build",), "25th percentile of the questions' coverage"),
    ("coverage_median", ("suite build",), "median of the questions' coverage"),
    ("coverage_full_share", ("suite build",), "share of questions whose suite tells every neighbour apart"),
    ("candidates_looked_at", ("suite build",), "databases generated (a db_id stops early once every pair is told "
                                               "apart and every gold has rows)"),
    ("build_seconds", ("suite build",), "wall time of the build, every db_id (not in the manifest, which a seed "
                                        "fixes byte for byte)"),
    ("candidates_skipped", ("suite build",), "generated databases set aside because a gold failed on them"),
    ("hub_new_commit", ("publish",), "1 when the push made a new Hub commit (0: the same files were there)"),
    ("variants", ("sweep",), "GRPO variants in the grid"),
    ("cells", ("sweep",), "variant x seed cells run or reused"),
    ("cells_reused", ("sweep",), "cells whose runs were reused (same parameters and code version)"),
    ("comparisons", ("plan",), "comparisons the plan sizes (the pilot's rows planned, or 1 from --discordance)"),
    ("<step>/<step metric>", ("pipeline",),
     "a step's metric, under the step's run name: `filter/band`, `grpo/summary/reward_std`, `eval-sft-dev/ex`, "
     "`eval-grpo-dev/ex`, `eval-grpo-dev/vs_baseline/diff`, `eval-grpo-dev/vs_baseline/p`, ..."),
]
PIPELINE_STEPS = {"toy": "toy", "tiny-model": "tiny-model", "sft": "sft", "filter": "filter", "grpo": "grpo",
                  "publish": "publish", "eval-": "evaluate"}  # step run name (or its prefix) -> stage


def _pattern(name: str) -> str:
    out = re.escape(name)
    for ph, rx in PLACEHOLDERS.items():
        out = out.replace(re.escape(ph), f"(?:{rx})")
    return out


def documented(name: str, stage: str | None = None) -> bool:
    """Whether metric `name` is in the vocabulary (for `stage`, when given). A pipeline metric
    `<step>/<metric>` must be a documented metric of that step's stage."""
    for entry, stages, _ in VOCABULARY:
        if stage is not None and stage not in stages:
            continue
        if entry == "<step>/<step metric>":
            step, _, rest = name.partition("/")
            kind = next((k for p, k in PIPELINE_STEPS.items() if step == p or (p.endswith("-") and
                                                                               step.startswith(p))), None)
            if kind and rest and documented(rest, kind):
                return True
        elif re.fullmatch(_pattern(entry), name):
            return True
    return False


def vocabulary_markdown() -> str:
    """The docs' metric table (docs/vocabulary.md), generated from VOCABULARY."""
    lines = ["| metric | meaning | runs |", "|---|---|---|"]
    for name, stages, meaning in VOCABULARY:
        lines.append(f"| `{name}` | {meaning.replace('|', '/')} | {', '.join(stages)} |")
    return "\n".join(lines) + "\n"


def comparison_metrics(comparison: dict) -> dict:
    """An evaluation's paired comparison (`stats.compare`: side a is this run, b the baseline) as metrics
    named for the sides. This run's own EX and interval are `ex`, `ex_ci_*`: not logged twice."""
    names = {"ex_b": "baseline/ex", "ex_b_ci_low": "baseline/ex_ci_low", "ex_b_ci_high": "baseline/ex_ci_high",
             "diff": "vs_baseline/diff", "diff_ci_low": "vs_baseline/diff_ci_low",
             "diff_ci_high": "vs_baseline/diff_ci_high", "mcnemar_p": "vs_baseline/p", "mdd": "vs_baseline/mdd",
             "only_a": "vs_baseline/only_this_right", "only_b": "vs_baseline/only_baseline_right",
             "both_right": "vs_baseline/both_right", "both_wrong": "vs_baseline/both_wrong"}
    return numeric({new: comparison[old] for old, new in names.items() if old in comparison}, digits=STAT_DIGITS)
