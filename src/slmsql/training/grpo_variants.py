"""Correctness-aware GRPO: an advantage gate and DAPO-style dynamic sampling, on top of TRL's GRPOTrainer.

Why: the execution reward is shaped (1.0 correct, 0.1 runs but wrong, 0 fails; +0.2 format), so a group whose
completions are *all wrong* still has reward std > 0, and GRPO pushes on advantages that carry no correctness
signal. A group "has correctness variance" when it holds at least one correct and one wrong completion, by
execution outcome (`scoring.Outcome.correct`), not by reward.

- gate (`--advantage-gate correctness`): a group without correctness variance gets advantage 0, whatever its
  shaped rewards; other groups keep TRL's advantages unchanged.
- dynamic sampling (`--dynamic-sampling`, DAPO): groups without correctness variance are dropped from the
  generation batch and replaced by groups for further prompts, drawn from the training set, in up to
  `max_resample_rounds` extra generation rounds. Still short after that, the batch is topped up with dropped
  groups (the first sampled first), so every step trains on a full batch; those carry advantage 0 under the
  gate and TRL's advantages without it (so the two options compose: 4 distinct variants).
  Each refill round generates only the missing groups: a step costs up to 1 + max_resample_rounds generation
  calls. Metrics per step: dynamic_sampling/{groups_sampled, groups_kept, groups_dropped, groups_filled,
  extra_rounds}, with kept + dropped == sampled and kept + filled == the batch's groups.

The selection and gating rules are pure functions (no torch, no TRL) below; the TRL glue follows them:
a GRPOTrainer subclass overriding one method, `_generate_and_score_completions` (TRL 1.16 computes the
advantages inline there, and `_prepare_inputs` buffers its output across gradient-accumulation steps, so
changing its output changes what every accumulation step trains on).
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field

from slmsql.errors import SlmsqlError

# ---- pure rules -----------------------------------------------------------------------------------------

def groups_varying(correct, group_size: int) -> list[bool]:
    """Per group of `group_size` consecutive completions: does its correctness vary (some right, some wrong)?"""
    correct = [bool(c) for c in correct]
    if group_size < 1 or len(correct) % group_size:
        raise ValueError(f"{len(correct)} completions do not split into groups of {group_size}")
    return [len(set(correct[i:i + group_size])) == 2 for i in range(0, len(correct), group_size)]


def gate_mask(correct, group_size: int) -> list[float]:
    """Per completion: 1.0 where its group's correctness varies, else 0.0 (the advantage multiplier)."""
    return [float(v) for v in groups_varying(correct, group_size) for _ in range(group_size)]


def gate(advantages, correct, group_size: int):
    """Advantages with every group lacking correctness variance set to 0; the others returned as they were.
    Takes and returns a list or a torch tensor."""
    mask = gate_mask(correct, group_size)
    if len(mask) != len(advantages):
        raise ValueError(f"{len(advantages)} advantages for {len(mask)} completions")
    if hasattr(advantages, "new_tensor"):
        return advantages * advantages.new_tensor(mask)
    return [a * m for a, m in zip(advantages, mask)]


def shortfall(rounds: list[list[bool]], needed: int) -> int:
    """Groups with correctness variance still missing for a batch of `needed` groups, after `rounds`
    (per round, per group: does it vary)."""
    return max(0, needed - sum(sum(r) for r in rounds))


@dataclass(frozen=True)
class Selection:
    """The groups a dynamic-sampling step trains on, as (round, group index within the round)."""

    kept: list[tuple[int, int]]  # groups with correctness variance, in sampling order
    filled: list[tuple[int, int]]  # groups without it, put back because the rounds ran out
    sampled: int

    @property
    def dropped(self) -> int:
        return self.sampled - len(self.kept)

    @property
    def batch(self) -> list[tuple[int, int]]:
        return self.kept + self.filled

    def advantage_mask(self, gated: bool, group_size: int) -> list[float]:
        """Per row of the batch: 1.0 keeps TRL's advantage; the top-up groups get 0.0 under the gate."""
        return [1.0] * (len(self.kept) * group_size) + [0.0 if gated else 1.0] * (len(self.filled) * group_size)


def select(rounds: list[list[bool]], needed: int) -> Selection:
    """Keep the first `needed` groups with correctness variance; top a short batch up with the first groups
    without it, so the batch always holds `needed` groups (TRL splits it into equal accumulation slices)."""
    if needed < 1 or not rounds or len(rounds[0]) != needed:
        raise ValueError(f"the first round must hold the batch's {needed} groups, got {[len(r) for r in rounds]}")
    varying = [(r, g) for r, flags in enumerate(rounds) for g, v in enumerate(flags) if v]
    flat = [(r, g) for r, flags in enumerate(rounds) for g, v in enumerate(flags) if not v]
    kept = varying[:needed]
    return Selection(kept=kept, filled=flat[:needed - len(kept)], sampled=sum(map(len, rounds)))


@dataclass
class RefillDraw:
    """Dataset indices for the refill rounds of one step: a permutation seeded by (seed, step), walked in
    order (a fresh permutation when it runs out), so a resumed run draws what the uninterrupted one drew."""

    size: int
    seed: int
    step: int
    _order: list[int] = field(default_factory=list)
    _round: int = 0

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if not self._order:
                rng = random.Random(f"{self.seed}-{self.step}-{self._round}")
                self._order, self._round = rng.sample(range(self.size), self.size), self._round + 1
            out.append(self._order.pop(0))
        return out


@dataclass(frozen=True)
class Variant:
    gate: bool = False
    dynamic_sampling: bool = False
    max_resample_rounds: int = 3

    @classmethod
    def of(cls, cfg) -> Variant:
        return cls(cfg.advantage_gate == "correctness", cfg.dynamic_sampling, cfg.max_resample_rounds)

    @property
    def plain(self) -> bool:
        return not (self.gate or self.dynamic_sampling)


def check(cfg, world_size: int = 1) -> None:
    """Refuse option sets no run could use, before a model loads."""
    v = Variant.of(cfg)
    if v.plain:
        return
    what = "--advantage-gate correctness" if v.gate else "--dynamic-sampling"
    if "execution" not in cfg.rewards:
        raise SlmsqlError(f"{what} needs the execution reward (correctness is its outcome); rewards: {cfg.rewards}")
    if cfg.max_resample_rounds < 0:
        raise SlmsqlError(f"max_resample_rounds must be >= 0, got {cfg.max_resample_rounds}")
    if v.dynamic_sampling and world_size > 1:
        raise SlmsqlError("--dynamic-sampling runs in one process only (refill rounds would have to be "
                          f"synchronised across processes); this launch has {world_size}")


class Correctness:
    """The execution reward's `on_outcomes` hook: the correctness of each completion TRL just scored."""

    def __init__(self):
        self._calls: list[list[bool]] = []

    def __call__(self, outs) -> None:
        self._calls.append([o.correct for o in outs])

    def take(self, n: int) -> list[bool]:
        calls, self._calls = self._calls, []
        if len(calls) != 1 or len(calls[0]) != n:
            raise RuntimeError(f"expected one execution scoring of {n} completions, got {[len(c) for c in calls]}")
        return calls[0]


# ---- TRL glue -------------------------------------------------------------------------------------------

# How each tensor of TRL's generation output lines up when rounds of different widths are merged.
LEFT_PADDED = {"prompt_ids": "pad", "prompt_mask": 0}
RIGHT_PADDED = {"completion_ids": "pad", "completion_mask": 0, "tool_mask": 1, "old_per_token_logps": 0.0,
                "ref_per_token_logps": 0.0, "sampling_per_token_logps": 0.0, "importance_sampling_ratio": 0.0}
PER_ROW = {"advantages"}


def merge_rows(outputs: list[dict], picks: list[tuple[int, list[int]]], pad_token_id: int) -> dict:
    """One generation output from rows of several: `picks` = (output index, row indices) in batch order.
    Prompts are left-padded, completions right-padded to the widest; padding is masked out of the loss.
    `num_items_in_batch` (the loss normaliser: unmasked completion tokens) is recounted."""
    import torch
    import torch.nn.functional as F

    keys = set(outputs[0])
    unknown = keys - set(LEFT_PADDED) - set(RIGHT_PADDED) - PER_ROW - {"num_items_in_batch"}
    if unknown:
        raise SlmsqlError(f"dynamic sampling cannot merge generation outputs holding {sorted(unknown)} "
                          "(multimodal or tool inputs)")
    merged = {}
    for key in keys - {"num_items_in_batch"}:
        parts = [outputs[i][key][rows] for i, rows in picks if rows]
        if key in PER_ROW:
            merged[key] = torch.cat(parts)
            continue
        left = key in LEFT_PADDED
        value = (LEFT_PADDED if left else RIGHT_PADDED)[key]
        value = pad_token_id if value == "pad" else value
        width = max(p.shape[1] for p in parts)
        merged[key] = torch.cat([F.pad(p, (width - p.shape[1], 0) if left else (0, width - p.shape[1]),
                                       value=value) for p in parts])
    loss_mask = merged["completion_mask"] * merged.get("tool_mask", 1)
    merged["num_items_in_batch"] = loss_mask.sum()
    return merged


def trainer_class(cfg):
    """The trainer the grpo stage builds, and the hooks to bind into its reward functions: TRL's own
    GRPOTrainer and none when no option is on, else the subclass and the correctness hook it reads."""
    from trl import GRPOTrainer

    variant = Variant.of(cfg)
    if variant.plain:
        return GRPOTrainer, {}
    correctness = Correctness()
    return (functools.partial(_variant_trainer(), variant=variant, correctness=correctness),
            {"on_outcomes": correctness})


@functools.cache
def _variant_trainer():
    import torch
    from trl import GRPOTrainer

    class VariantGRPOTrainer(GRPOTrainer):
        """GRPOTrainer whose generation batches get the correctness gate and/or dynamic sampling."""

        def __init__(self, *args, variant: Variant, correctness: Correctness, **kwargs):
            super().__init__(*args, **kwargs)
            self.variant, self.correctness = variant, correctness
            if variant.dynamic_sampling and self.accelerator.num_processes > 1:
                raise SlmsqlError("--dynamic-sampling runs in one process only")

        def _generate_and_score_completions(self, inputs):
            if not self.model.training:  # evaluation: TRL's own behaviour
                out = super()._generate_and_score_completions(inputs)
                self.correctness.take(len(inputs))
                return out
            self._check_groups(inputs)
            if self.variant.dynamic_sampling:
                return self._dynamic_batch(inputs)
            out = super()._generate_and_score_completions(inputs)
            self._gate(out, self.correctness.take(len(inputs)))
            return out

        def _check_groups(self, inputs):
            # TRL's RepeatSampler puts each prompt's num_generations copies next to each other, and its own
            # advantage code relies on it (view(-1, G)); so do we: a TRL change there must fail loudly.
            G = self.num_generations
            if len(inputs) % G or any(inputs[i]["prompt"] != inputs[i - i % G]["prompt"] for i in range(len(inputs))):
                raise SlmsqlError(f"TRL's generation batch is not made of consecutive groups of {G}")

        def _gate(self, out, correct):
            """Zero the advantages of groups without correctness variance, on this process's rows and on
            the completions table's copy (which TRL gathered over all processes)."""
            n, G = len(correct), self.num_generations
            local = torch.tensor(correct, dtype=torch.long, device=out["advantages"].device)
            everyone = self.accelerator.gather(local).tolist()
            mask = gate_mask(everyone, G)
            me = self.accelerator.process_index
            out["advantages"] = out["advantages"] * out["advantages"].new_tensor(mask[me * n:(me + 1) * n])
            self._rewrite_logged_advantages(gate(list(self._logs["advantages"])[-len(everyone):], everyone, G))
            zeroed = groups_varying(everyone, G)
            self._metrics["train"]["advantage_gate/frac_groups_zeroed"].append(1 - sum(zeroed) / len(zeroed))

        def _rewrite_logged_advantages(self, values):
            logged = self._logs["advantages"]
            for i, v in enumerate(values, start=len(logged) - len(values)):
                logged[i] = v

        def _dynamic_batch(self, inputs):
            G, needed = self.num_generations, len(inputs) // self.num_generations
            draw = RefillDraw(len(self.train_dataset), self.args.seed, self.state.global_step)
            before = {k: len(v) for k, v in self._metrics["train"].items()}
            outputs, rounds, logged, sizes = [], [], [], []
            batch = inputs
            while True:
                outputs.append(super()._generate_and_score_completions(batch))
                correct = self.correctness.take(len(batch))
                rounds.append(groups_varying(correct, G))
                logged.append(self._logged_rows(len(batch)))
                sizes.append(len(batch))
                missing = shortfall(rounds, needed)
                if not missing or len(rounds) > self.variant.max_resample_rounds:
                    break
                batch = [self._row(i, inputs[0]) for i in draw.take(missing) for _ in range(G)]

            sel = select(rounds, needed)
            picks = [(r, list(range(g * G, (g + 1) * G))) for r, g in sel.batch]
            merged = merge_rows(outputs, picks, self._tokenizer.pad_token_id)
            merged["advantages"] *= merged["advantages"].new_tensor(sel.advantage_mask(self.variant.gate, G))
            self._relog(logged, picks, merged["advantages"].tolist())
            self._pool_round_metrics(before, sizes)
            m = self._metrics["train"]
            for name, value in (("groups_sampled", sel.sampled), ("groups_kept", len(sel.kept)),
                                ("groups_dropped", sel.dropped), ("groups_filled", len(sel.filled)),
                                ("extra_rounds", len(rounds) - 1)):
                m[f"dynamic_sampling/{name}"].append(float(value))
            return merged

        def _row(self, index, like):
            row = self.train_dataset[index]
            return {k: row[k] for k in like}

        def _logged_rows(self, n):
            """This round's rows of TRL's completions-table buffers (the last n of each)."""
            tail = lambda d: list(d)[-n:]
            logs = self._logs
            return {"prompt": tail(logs["prompt"]), "completion": tail(logs["completion"]),
                    "rewards": {k: tail(v) for k, v in logs["rewards"].items()},
                    "extra": {k: tail(v) for k, v in logs["extra"].items()}}

        def _relog(self, logged, picks, advantages):
            """The completions table shows the batch trained on, with the advantages it trained with, rather
            than the last rows sampled (TRL's buffers hold one generation batch, refill rounds included)."""
            def pick(get):
                return [get(logged[r])[i] for r, rows in picks for i in rows]

            logs = self._logs
            for key in ("prompt", "completion"):
                logs[key].clear()
                logs[key].extend(pick(lambda d, key=key: d[key]))
            for group in ("rewards", "extra"):
                for name, buf in logs[group].items():
                    buf.clear()
                    buf.extend(pick(lambda d, group=group, name=name: d[group][name]))
            logs["advantages"].clear()
            logs["advantages"].extend(advantages)

        def _pool_round_metrics(self, before, sizes):
            """TRL appends one value per generation call to each metric and averages them at log time; a
            refill round of 1 group would weigh as much as the full batch. Pool the rounds' values, weighted
            by completions (exact for means and fractions; for the *_std metrics, a weighted mean of stds)."""
            for key, values in self._metrics["train"].items():
                new = values[before.get(key, 0):]
                if len(new) == len(sizes) > 1:
                    scored = [(v, n) for v, n in zip(new, sizes) if not math.isnan(v)]  # TRL skips NaN too
                    del values[before.get(key, 0):]
                    values.append(sum(v * n for v, n in scored) / sum(n for _, n in scored) if scored else math.nan)

    return VariantGRPOTrainer
