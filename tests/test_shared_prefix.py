"""Shared-prefix GRPO (slmsql.generation.shared_prefix, slmsql.training.shared_prefix_trainer): each distinct
prompt of a micro-batch computed once, the same maths.

Fast, on a small random model: the packed layout of hand-built micro-batches (left-padded prompts of different
lengths, several prompts, groups cut by the micro-batch, completions that end early or are empty), per-token
log-probs, entropies and LoRA gradients equal to TRL's own plain computation (fp32), with gradient checkpointing on
and off and in chunks; group-keeping shuffles; prefill once in generation (the same scores and tokens); the
first step's self-check on one micro-batch, in float32 under bfloat16 compute (where a leaked segment hides in
bfloat16's rounding), and a fallback that is TRL's own path (its micro-batches, order and
generate calls, against GRPOTrainer itself).
Slow, on SmolLM2-135M-Instruct (the real model, from the cache `make smollm2` fills) and on the trained tiny policy:
the same equalities where a wrong mask or position id moves log-probs by whole units, so the break checks bite;
then whole `slmsql grpo` runs with the shared prefix on and off on scripted completions (tests/scripted.py), which
must end with the same adapter and log the same losses, across gradient accumulation, num_iterations 2, beta > 0,
gradient checkpointing, continue and stack adapters, the advantage gate and dynamic sampling; the run falls back to
the plain path when the first step's self-check fails; and the command line in a new process logs the check.
(`--backend vllm` and a two-rank launch: tests/test_vllm_grpo.py and tests/test_multiprocess.py run with it on.)
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pytest
import scripted
import torch
from ci_env import require
from learning import adapter_weights
from policy import policy_fixture, read, tracking_store, write  # noqa: F401  (the fixture)
import watched

from test_vllm import vllm_ready  # noqa: F401  (fixture: vLLM installed, or a CI failure)

from slmsql import configs
from slmsql.generation import shared_prefix
from slmsql.generation.shared_prefix import Packing
from slmsql.training import shared_prefix_trainer
from slmsql.training.shared_prefix_trainer import trainer_class as Shared

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
LOGP_TOL = 1e-4  # fp32; measured ~1e-5 on SmolLM2, 0 to 2e-6 on the tiny models
GRAD_TOL = 1e-4  # relative to the largest gradient entry of each tensor


# ---- a micro-batch in TRL's layout, built by hand ----------------------------------------------------------

def micro_batch(vocab: int, seed: int = 0, prompts=(10, 7, 12), rows=("A", "B", "A", "C", "A", "B"),
                lengths=(6, 3, 1, 5, 0, 6), width: int = 6):
    """TRL's (left-padded prompt | right-padded completion) rows: prompts A, B, C of the given lengths, rows in the
    given order (a group cut by the micro-batch: A 3 times, B twice, C once), completions of the given lengths
    (ending early; 0 = masked out entirely)."""
    g = torch.Generator().manual_seed(seed)
    tokens = {k: torch.randint(5, vocab, (n,), generator=g) for k, n in zip("ABC", prompts)}
    plen = max(prompts)
    ids = torch.zeros(len(rows), plen + width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (k, n) in enumerate(zip(rows, lengths)):
        p = tokens[k]
        ids[i, plen - len(p):plen], mask[i, plen - len(p):plen] = p, 1
        ids[i, plen:plen + n], mask[i, plen:plen + n] = torch.randint(5, vocab, (n,), generator=g), 1
    return ids, mask, width


def test_packing_lays_each_prompt_once_and_each_completion_after_it():
    ids, mask, width = micro_batch(50, prompts=(4, 2, 3), rows=("A", "B", "A", "C"), lengths=(2, 1, 0, 3), width=3)
    p = Packing.of(ids, mask, width)
    plen = ids.size(1) - width
    assert p.input_ids.size(0) == 3  # one packed row per distinct prompt
    a = ids[0, plen - 4:plen].tolist()
    # prompt A's row: its first 3 tokens, then row 0's segment (A's last token + 2 completion tokens); row 2 has none
    assert p.input_ids[0, :6].tolist() == a[:3] + [a[3]] + ids[0, plen:plen + 2].tolist()
    assert p.segment[0].tolist() == [0, 0, 0, 1, 1, 1]
    assert p.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5]  # the plain row's columns (no left padding on A)
    c = Packing.of(ids, mask, width)
    # prompt C (3 tokens, one pad column): positions continue from the plain row's columns
    assert c.position_ids[2, :6].tolist() == [1, 2, 3, 4, 5, 6]
    assert c.shift_labels[2, :6].tolist() == [-100, -100, *ids[3, plen:plen + 3].tolist(), -100]
    m = p.attention_mask()[1, 0]  # prompt B: 1 prefix token, one segment of 2 (last prompt token + 1), padding
    assert m[:3, :3].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert p.tokens < ids.numel()


def test_packing_refuses_layouts_it_does_not_read():
    ids, mask, width = micro_batch(50)
    holes = mask.clone()
    holes[0, -width + 1] = 0  # a hole inside a completion
    assert Packing.of(ids, holes, width) is None
    right_padded = mask.clone()
    right_padded[0, ids.size(1) - width - 1] = 0  # a prompt whose last column is padding
    assert Packing.of(ids, right_padded, width) is None


def tiny_lm(tmp_path, attn: str = "sdpa", dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    from slmsql.toy.tiny_model import build_tiny_model

    folder = build_tiny_model(tmp_path / "tiny", ["SELECT name FROM item WHERE price > 3 ORDER BY name"] * 8,
                              vocab_size=300, hidden=32, layers=2, heads=2, ffn=64)
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn, dtype=dtype), folder


def trainer_for(model, folder, tmp_path, lora: bool = True, checkpointing: bool = False):
    """A real GRPOTrainer with the shared-prefix methods (what `slmsql grpo` builds), LoRA on `model`."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none", bf16=False,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      gradient_checkpointing=checkpointing, temperature=0.8)
    trainer = shared_prefix_trainer.trainer_class(GRPOTrainer)(
        model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)], args=args,
        train_dataset=Dataset.from_list([{"prompt": "q"}] * 4), processing_class=AutoTokenizer.from_pretrained(folder),
        peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                               task_type="CAUSAL_LM") if lora else None)
    trainer._shared_prefix = "on"  # the self-check is tested on its own below
    return trainer


def both_ways(trainer, ids, mask, width, batch_size=None, entropy=True):
    """(plain, shared): TRL's own `_get_per_token_logps_and_entropies` and the shared-prefix override, on the
    trainer's model, each with the gradient of the same weighted sum of the log-probs w.r.t. the LoRA weights."""
    from trl import GRPOTrainer

    model = trainer.model
    weights = torch.randn(ids.size(0), width, generator=torch.Generator().manual_seed(1))
    out = []
    for compute in (lambda *a, **k: GRPOTrainer._get_per_token_logps_and_entropies(trainer, *a, **k),
                    trainer._get_per_token_logps_and_entropies):
        model.zero_grad()
        logps, entropies, _ = compute(model, ids, mask, width, batch_size=batch_size, compute_entropy=entropy)
        (logps * weights * mask[:, -width:]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
        out.append((logps.detach(), None if entropies is None else entropies.detach(), grads))
    return out


def assert_same(plain, shared, mask, width, logp_tol=LOGP_TOL):
    scored = mask[:, -width:].bool()
    assert torch.equal(shared[0][~scored], torch.zeros_like(shared[0][~scored]))  # nothing where nothing is scored
    diff = (plain[0] - shared[0]).abs()[scored].max().item()
    assert diff <= logp_tol, f"log-probs {diff:.3g} apart"
    if plain[1] is not None:
        assert (plain[1] - shared[1]).abs()[scored].max().item() <= logp_tol
    assert plain[2].keys() == shared[2].keys() and plain[2]
    for name, g in plain[2].items():
        rel = ((g - shared[2][name]).abs().max() / g.abs().max().clamp(min=1e-12)).item()
        assert rel <= GRAD_TOL, f"{name}: gradients {rel:.3g} apart (relative)"


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.slow
def test_logps_entropies_and_lora_gradients_equal_the_plain_path(tmp_path, checkpointing, attn):
    model, folder = tiny_lm(tmp_path, attn)
    trainer = trainer_for(model, folder, tmp_path, checkpointing=checkpointing)
    model = trainer.model
    model.train()
    ids, mask, width = micro_batch(model.config.vocab_size)
    plain, shared = both_ways(trainer, ids, mask, width)
    assert_same(plain, shared, mask, width)
    assert any("lora_A" in n for n in plain[2])  # LoRA gradients were compared, not none


def test_chunks_keep_prompts_together_and_the_result_in_row_order(tmp_path):
    model, folder = tiny_lm(tmp_path)
    trainer = trainer_for(model, folder, tmp_path)
    ids, mask, width = micro_batch(trainer.model.config.vocab_size)
    assert shared_prefix.chunks(ids, mask, width, 2) == [[0, 2], [4], [1, 5], [3]]
    assert shared_prefix.chunks(ids, mask, width, 4) == [[0, 2, 4], [1, 5, 3]]
    plain, shared = both_ways(trainer, ids, mask, width, batch_size=2)
    assert_same(plain, shared, mask, width)


def test_group_shuffle_keeps_groups_whole_and_falls_back_otherwise():
    ids = torch.tensor([[1, 2], [1, 2], [3, 4], [3, 4], [5, 6], [5, 6]])
    batch = {"prompt_ids": ids, "prompt_mask": torch.ones_like(ids), "advantages": torch.arange(6.0),
             "num_items_in_batch": torch.tensor(9), "texts": list("abcdef"), "old": None}
    torch.manual_seed(3)
    out = shared_prefix.shuffle_groups(batch, 2)
    assert sorted(out["advantages"].tolist()) == list(range(6))
    pairs = out["advantages"].view(-1, 2).tolist()
    assert all(b == a + 1 and a % 2 == 0 for a, b in pairs)  # each group's two rows together, in order
    assert out["texts"] == [batch["texts"][int(i)] for i in out["advantages"]]
    assert out["num_items_in_batch"] is batch["num_items_in_batch"] and out["old"] is None
    orders = {tuple(shared_prefix.shuffle_groups(batch, 2)["advantages"].tolist()) for _ in range(8)}
    assert len(orders) > 1  # shuffled, not merely kept
    mixed = {**batch, "prompt_ids": torch.tensor([[1, 2], [3, 4], [1, 2], [3, 4], [5, 6], [5, 6]])}
    assert shared_prefix.shuffle_groups(mixed, 2) is None  # not consecutive groups: TRL's row shuffle applies
    assert shared_prefix.shuffle_groups(batch, 4) is None


# ---- the first step: the self-check on one micro-batch, and a fallback that is TRL's own path ------------------

PROMPTS = ["SELECT name FROM item", "name FROM", "WHERE price > 3 ORDER BY", "ORDER BY name"]


def grpo_trainer(cls, model, folder, tmp_path, **over):
    """`cls` (GRPOTrainer, or a shared-prefix class of it) on `model` without LoRA (nothing drawn at random: two
    trainers on two loads of one folder hold the same weights), 2 generation steps of 4 rows (groups of 2): a
    generation batch of 8 rows, 4 prompts."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    args = GRPOConfig(**{**dict(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none", bf16=False,
                                per_device_train_batch_size=4, num_generations=2, steps_per_generation=2,
                                max_completion_length=8, temperature=0.8, seed=0), **over})
    return cls(model=model, reward_funcs=[lambda completions, **_: [float(len(c)) for c in completions]], args=args,
               train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
               processing_class=AutoTokenizer.from_pretrained(folder))


def generation_batch(trainer) -> list[dict]:
    """What TRL's sampler hands `_prepare_inputs`: each prompt num_generations times in a row."""
    return [{"prompt": p} for p in PROMPTS for _ in range(trainer.num_generations)]


def decoder_calls(model) -> list:
    """The (rows, width) of every forward of `model`'s decoder, in order, appended as they happen."""
    calls = []
    model.get_decoder().register_forward_pre_hook(
        lambda _, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    return calls


def prepare(trainer, generations: int = 2) -> list[dict]:
    """The micro-batches of `generations` generation batches as `_prepare_inputs` buffers them, each drawn after
    torch.manual_seed(g) (the sampling and TRL's shuffle read torch's generator)."""
    trainer.model.train()
    out = []
    for g in range(generations):
        trainer._step = g * trainer.args.steps_per_generation
        torch.manual_seed(g)
        trainer._prepare_inputs(generation_batch(trainer))
        out += trainer._buffered_inputs
    return out


def leaked(monkeypatch):
    """Packing.of with every completion seeing the others: a wrong layout the self-check must catch."""
    of = Packing.of

    def wrong(*a, **k):
        p = of(*a, **k)
        if p is not None:
            p.segment = p.segment.clamp(max=1)
        return p

    monkeypatch.setattr(Packing, "of", wrong)


def test_the_self_check_forwards_one_micro_batch_of_the_first_generation(tmp_path):
    """The check computes per_device_train_batch_size rows both ways (what one forward of the loss sees), not the
    generation batch (here 2 micro-batches); its rows are the batch's first ones, whole groups, so the packed
    forward holds their 2 prompts once each."""
    from trl import GRPOTrainer

    model, folder = tiny_lm(tmp_path)
    trainer = grpo_trainer(Shared(GRPOTrainer), model, folder, tmp_path)
    calls, checked = decoder_calls(trainer.model), []
    check = trainer._self_check

    def counted(batch):
        start = len(calls)
        check(batch)
        checked.extend(calls[start:])
        assert batch["prompt_ids"].size(0) == 8  # it was handed the whole generation batch

    trainer._self_check = counted
    prepare(trainer, generations=1)
    assert trainer._shared_prefix == "on"
    (plain_rows, width), (packed_rows, packed_width) = checked
    assert plain_rows == 4 and packed_rows == 2 and packed_width < 2 * width


@pytest.mark.parametrize("bf16", ["autocast", "weights"])
def test_the_self_check_catches_under_bf16_what_bf16_rounding_hides(tmp_path, monkeypatch, bf16):
    """Under bfloat16 compute (TRL's mixed precision on float32 weights, with the autocast accelerate wraps a
    prepared model's forward in; or bfloat16 weights) a leaked segment moves the tiny model's log-probs by ~0.04:
    far under the 0.24-0.44 that bfloat16's rounding alone moves a real model's, so a check in bfloat16 would have to
    take it. The check compares in float32, catches it, and the run falls back, its weights as they were."""
    from trl import GRPOTrainer

    model, folder = tiny_lm(tmp_path, dtype=torch.bfloat16 if bf16 == "weights" else torch.float32)
    states = []
    trainer = grpo_trainer(Shared(GRPOTrainer, on_state=states.append), model, folder, tmp_path,
                           bf16=bf16 == "autocast")
    if bf16 == "autocast":
        trainer.accelerator.prepare_model(trainer.model)  # as train() does: its forward runs under autocast now
        assert "_original_forward" in trainer.model.__dict__
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    leaked(monkeypatch)
    prepare(trainer, generations=1)
    (diff,) = trainer._metrics["train"]["shared_prefix/logp_max_abs_diff"]
    assert shared_prefix_trainer.TOLERANCE[torch.float32] < diff < 0.2, diff
    assert trainer._shared_prefix == "off" and states[0].startswith("plain path: the first step's self-check")
    assert "in float32" in states[0]
    for n, p in trainer.model.named_parameters():
        assert p.dtype == before[n].dtype and torch.equal(p, before[n]), n


def test_computing_in_float32_is_float32_and_puts_everything_back(tmp_path):
    """`computing_in`: a bfloat16 model prepared for bfloat16 mixed precision computes, inside the block and under
    accelerate's own `autocast()`, what a float32 copy of its weights computes; after it, its weights, forward,
    autocast and matmul precision are what they were."""
    import copy

    from trl import GRPOTrainer

    model, folder = tiny_lm(tmp_path, dtype=torch.bfloat16)
    reference = copy.deepcopy(model).float().eval()
    trainer = grpo_trainer(GRPOTrainer, model, folder, tmp_path, bf16=True)  # its accelerator: bf16 mixed precision
    accelerator = trainer.accelerator
    model = accelerator.prepare_model(trainer.model).eval()
    ids = torch.randint(5, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    forward, handler, precision = model.forward, accelerator.autocast_handler, torch.get_float32_matmul_precision()
    with torch.no_grad():
        mixed = model(input_ids=ids).logits
        with shared_prefix_trainer.computing_in(model, accelerator, torch.float32), accelerator.autocast():
            inside = model(input_ids=ids).logits
        expected = reference(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert inside.dtype == torch.float32 and (inside - expected).abs().max() <= 1e-6
    assert (mixed.float() - expected).abs().max() > 1e-4  # what the block changes: bfloat16 is that far off
    assert torch.equal(after, mixed)
    assert model.forward == forward and accelerator.autocast_handler is handler
    assert torch.get_float32_matmul_precision() == precision
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, weights[n]), n


@pytest.mark.slow
def test_the_cost_model_counts_the_weights_each_forward_multiplies(tmp_path):
    """The cost model's per-token term against torch's own count of the matmul FLOPs both forwards run (its
    FlopCounterMode; it does not count the CPU's fused attention kernel, so that term is left out of both): within
    3% (TRL's head skips each plain row's last position, which the model counts). In a new process: after an
    in-process GRPO run (tests/test_sampling.py) the counter saw ~25% fewer FLOPs of the same forward, state left
    by TRL or transformers that this count must not depend on."""
    out = watched.run([sys.executable, "-c", "import sys, pathlib, test_shared_prefix as t; "
                       "t.count_cost_model_flops(pathlib.Path(sys.argv[1]))", str(tmp_path)],
                      cwd=Path(__file__).parent)
    assert out.returncode == 0, out.stderr[-3000:]


def count_cost_model_flops(tmp_path):
    from accelerate import Accelerator
    from torch.utils.flop_counter import FlopCounterMode
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    model, _ = tiny_lm(tmp_path)
    add_fused_lm_head(model.eval(), temperature=0.8)
    ids, mask, width = micro_batch(model.config.vocab_size)
    packing = Packing.of(ids, mask, width)
    linear, _ = shared_prefix.cost_dims(model)
    trl = SimpleNamespace(accelerator=Accelerator(cpu=True))
    with torch.no_grad(), FlopCounterMode(display=False) as plain:
        GRPOTrainer._get_per_token_logps_and_entropies.__wrapped__(trl, model, ids, mask, width)
    with torch.no_grad(), FlopCounterMode(display=False) as packed:
        shared_prefix.packed_logps(model, packing)
    assert plain.get_total_flops() == pytest.approx(2 * linear * ids.numel(), rel=0.03)
    assert packed.get_total_flops() == pytest.approx(2 * linear * packing.tokens, rel=0.03)


def one_prompt_batch(vocab: int, prompt: int, group: int, completion: int) -> dict:
    """A generation batch of one prompt's group, every completion `completion` tokens long, as TRL's fields."""
    ids, mask, width = micro_batch(vocab, prompts=(prompt,), rows=("A",) * group, lengths=(completion,) * group,
                                   width=completion)
    plen = ids.size(1) - width
    return {"prompt_ids": ids[:, :plen], "prompt_mask": mask[:, :plen], "completion_ids": ids[:, plen:],
            "completion_mask": mask[:, plen:]}


@pytest.mark.parametrize("shape", ["long prompt", "long completions"])
def test_the_cost_model_falls_back_where_packing_costs_more(tmp_path, shape):
    """A long prompt and short completions: the packed forward costs less and, the check passed, the run goes on
    packed, its tag giving the cost. A 2-token prompt and 8 completions of 64: the packed row (521 tokens) pays
    more attention than the 6 prompt tokens it saves, so the run falls back to TRL's path, saying so, without
    computing the check's forwards."""
    from trl import GRPOTrainer

    model, folder = tiny_lm(tmp_path)
    states = []
    trainer = grpo_trainer(Shared(GRPOTrainer, on_state=states.append), model, folder, tmp_path,
                           per_device_train_batch_size=8, num_generations=8, max_completion_length=64)
    calls = decoder_calls(trainer.model)
    batch = (one_prompt_batch(model.config.vocab_size, 60, 2, 4) if shape == "long prompt"
             else one_prompt_batch(model.config.vocab_size, 2, 8, 64))
    trainer._self_check(batch)
    (ratio,) = trainer._metrics["train"]["shared_prefix/cost_ratio"]
    (state,) = states
    if shape == "long prompt":
        assert ratio > 1 and trainer._shared_prefix == "on" and len(calls) == 2
        assert state.startswith("on: ") and f"packed forward at {1 / ratio:.2f}x the plain path's FLOPs" in state
    else:
        assert ratio < 0.5 and trainer._shared_prefix == "off" and calls == []
        assert state.startswith(f"plain path: the cost model puts the packed forward at {1 / ratio:.2f}x"), state
        assert "8 rows of 66 tokens -> 1 packed rows of 521" in state


def windowed_lm(tmp_path, kind: str):
    """A tiny random model with sliding-window layers, saved and loaded from a folder of its own (so its config
    names it), the tiny model's tokenizer beside it: Qwen2 with `use_sliding_window` on its second layer, or
    Mistral, whose `sliding_window` windows every layer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, MistralConfig, Qwen2Config

    folder = tmp_path / f"tiny-{kind}"
    if not folder.exists():
        _, tiny = tiny_lm(tmp_path)
        dims = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, sliding_window=16)
        config = (Qwen2Config(use_sliding_window=True, max_window_layers=1, **dims) if kind == "qwen2"
                  else MistralConfig(**dims))
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        AutoTokenizer.from_pretrained(tiny).save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder), folder


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_sliding_window_models_fall_back_naming_the_model_and_why(tmp_path, kind):
    """A model with sliding-window layers runs TRL's own path from the start, its tag naming the model and the
    window; the tiny model (Qwen2, full attention everywhere) is not refused."""
    from trl import GRPOTrainer

    model, folder = windowed_lm(tmp_path, kind)
    states = []
    trainer = grpo_trainer(Shared(GRPOTrainer, on_state=states.append), model, folder, tmp_path)
    assert trainer._shared_prefix == "off"
    (state,) = states
    assert state.startswith(f"plain path: {folder} has sliding_attention layers (sliding_window 16)"), state
    full, tiny = tiny_lm(tmp_path / "full")
    assert shared_prefix.partial_attention(full) is None
    assert grpo_trainer(Shared(GRPOTrainer), full, tiny, tmp_path)._shared_prefix == "unchecked"


@pytest.mark.parametrize("reason", ["check fails", "sliding window"])
def test_a_fallback_is_trls_own_path(tmp_path, monkeypatch, reason):
    """After a fallback the run is TRL's: the same micro-batches in the same order (TRL's row shuffle, not the group
    shuffle), the same completions from the same generate calls (no shared prefill), at the first generation and
    after it, as GRPOTrainer itself on the same weights and seed. The fallback: a failed self-check (a leaked
    segment), or a model refused from the start (sliding-window layers)."""
    from trl import GRPOTrainer

    def load(where):
        return tiny_lm(where) if reason == "check fails" else windowed_lm(tmp_path, "qwen2")

    model, folder = load(tmp_path)
    plain = grpo_trainer(GRPOTrainer, model, folder, tmp_path)
    plain_calls = decoder_calls(plain.model)
    expected = prepare(plain)
    if reason == "check fails":
        leaked(monkeypatch)
    states = []
    model, folder = load(tmp_path / "again")
    trainer = grpo_trainer(Shared(GRPOTrainer, on_state=states.append), model, folder, tmp_path)
    calls, checked = decoder_calls(trainer.model), []
    check = trainer._self_check

    def spanned(batch):
        checked.append(len(calls))
        check(batch)
        checked.append(len(calls))

    trainer._self_check = spanned
    got = prepare(trainer)
    assert trainer._shared_prefix == "off" and len(states) == 1 and states[0].startswith("plain path: "), states
    assert ("self-check" in states[0]) == (reason == "check fails") and len(checked) == 2 * (reason == "check fails")
    assert len(got) == len(expected) == 4
    for a, b in zip(got, expected):
        assert a.keys() == b.keys()
        for key in b:
            same = torch.equal(a[key], b[key]) if isinstance(b[key], torch.Tensor) else a[key] == b[key]
            assert same, key
    # the forwards TRL made (generation: each row's whole prompt, then a token at a time), and the check's between
    start, end = checked or (len(calls), len(calls))
    assert end - start == len(checked) and calls[:start] + calls[end:] == plain_calls


# ---- generation: each prompt prefilled once -----------------------------------------------------------------

@pytest.mark.parametrize("sampling", [False, True])
def test_generation_prefills_each_prompt_once_with_the_same_scores(tmp_path, sampling):
    model, _ = tiny_lm(tmp_path)
    model.eval()
    ids, mask, _ = micro_batch(model.config.vocab_size, rows=("A", "B", "C"), lengths=(0, 0, 0))
    ids, mask = ids[:, :-6], mask[:, :-6]
    calls = []
    forward = model.forward

    @functools.wraps(forward)  # generate reads the forward's signature
    def counted(*a, **k):
        calls.append(tuple(k["input_ids"].shape))
        return forward(*a, **k)

    model.forward = counted
    kwargs = dict(do_sample=True, temperature=0.8) if sampling else dict(do_sample=False)
    torch.manual_seed(0)
    plain = model.generate(input_ids=ids.repeat_interleave(4, 0), attention_mask=mask.repeat_interleave(4, 0),
                           max_new_tokens=8, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                           **kwargs)
    prefill_plain = calls[0]
    calls.clear()
    torch.manual_seed(0)
    shared = shared_prefix.generate(model.generate, model, input_ids=ids.repeat_interleave(4, 0),
                                    attention_mask=mask.repeat_interleave(4, 0), max_new_tokens=8,
                                    output_scores=True, return_dict_in_generate=True, pad_token_id=0, **kwargs)
    assert prefill_plain == (12, ids.size(1))  # every row's whole prompt
    assert calls[0] == (3, ids.size(1) - 1) and calls[1] == (12, 1)  # distinct prompts once, then the last token
    assert torch.equal(plain.sequences, shared.sequences)
    for a, b in zip(plain.scores, shared.scores):
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b)) and (a - b)[finite].abs().max() < 1e-4


def test_filter_samples_are_the_same_with_prefill_shared(tmp_path):
    from transformers import AutoTokenizer

    from slmsql.generation.sampling import generate

    model, folder = tiny_lm(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = ["SELECT name FROM", "SELECT", "name FROM item WHERE price >"]
    kw = dict(num_return_sequences=4, temperature=0.8, max_new_tokens=8, batch_size=2, seed=5, progress=False,
              shared_schema=False)  # prefixes shared across prompts: tests/test_shared_schema.py
    assert generate(model, tokenizer, prompts, **kw) == generate(model, tokenizer, prompts, share_prefill=False, **kw)


# ---- the real model and the trained policy: the break checks bite -------------------------------------------

@pytest.fixture
def smollm2():  # loaded for each test (a few seconds): the trainer wraps it in a LoRA in place
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32)
    except OSError:
        require(False, "SmolLM2-135M-Instruct (the Hugging Face cache)", "make smollm2")
    return model, AutoTokenizer.from_pretrained(SMOLLM2)


def real_trainer(model, tokenizer, tmp_path, checkpointing=False):
    folder = tmp_path / "tok"
    tokenizer.save_pretrained(folder)
    return trainer_for(model, folder, tmp_path, checkpointing=checkpointing)


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_smollm2_logps_and_gradients_equal_the_plain_path(smollm2, tmp_path, checkpointing):
    trainer = real_trainer(*smollm2, tmp_path, checkpointing)
    trainer.model.train()
    ids, mask, width = micro_batch(smollm2[0].config.vocab_size, prompts=(40, 23, 31), width=12,
                                   lengths=(12, 5, 1, 9, 0, 12))
    plain, shared = both_ways(trainer, ids, mask, width)
    assert_same(plain, shared, mask, width)


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["mask", "positions"])
def test_a_wrong_mask_or_position_fails_the_comparison(smollm2, tmp_path, monkeypatch, broken):
    trainer = real_trainer(*smollm2, tmp_path)
    ids, mask, width = micro_batch(smollm2[0].config.vocab_size, prompts=(40, 23, 31), width=12,
                                   lengths=(12, 5, 1, 9, 0, 12))
    of = Packing.of

    def wrong(*a, **k):
        p = of(*a, **k)
        if broken == "mask":
            p.segment = p.segment.clamp(max=1)  # every completion sees the others
        else:
            p.position_ids = torch.arange(p.position_ids.size(1)).expand_as(p.position_ids).clone()
        return p

    monkeypatch.setattr(Packing, "of", wrong)
    plain, shared = both_ways(trainer, ids, mask, width, entropy=False)
    with pytest.raises(AssertionError, match="apart"):
        assert_same(plain, shared, mask, width)


# ---- whole runs: shared on and off end in the same place ----------------------------------------------------

STEPS = 2


@pytest.fixture(scope="module")
def runs(policy, tmp_path_factory):
    """A module store, the band, and an SFT LoRA on the policy (for continue and stack)."""
    from slmsql.stages import sft

    root = tmp_path_factory.mktemp("shared-prefix")
    uri = f"sqlite:///{root}/mlflow.db"
    band = write(root / "band.jsonl", [{**r, "pass_rate": 0.5, "k": 4, "n_correct": 2} for r in read(policy.train)[:8]])
    with tracking_store(uri):
        sft.main(configs.load(configs.SFTStageConfig, None, {
            "data": str(policy.train), "db_root": str(policy.db_root), "model": str(policy.model),
            "output_dir": str(root / "sft"), "use_lora": True, "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
            "max_steps": 2, "per_device_train_batch_size": 8, "learning_rate": 1e-2, "experiment": "sft"}))
    return {"root": root, "uri": uri, "band": band, "sft": root / "sft"}


def answer_for(policy):
    """Scripted completions: per group, two right answers of different lengths, a wrong one and a no-SQL one, so
    rewards vary, completions end at different lengths, and the groups' correctness varies."""
    find = scripted.question_of(read(policy.train))

    def answer(prompt, i):
        row = find(prompt)
        return [scripted.right(row), scripted.WRONG, f"```sql\n{row['sql']}\n```\n", scripted.NO_SQL][i]
    return answer


VARIANTS = {
    "plain": {},
    "accumulation": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
    "iterations": {"trainer_args": "num_iterations=2"},
    "beta": {"beta": 0.1},
    "checkpointing": {"trainer_args": "gradient_checkpointing=true"},
    "gate": {"advantage_gate": "correctness"},
    "dynamic": {"dynamic_sampling": True, "advantage_gate": "correctness"},
    "continue": {"base_adapter": "SFT", "adapter_mode": "continue"},
    "stack": {"base_adapter": "SFT", "adapter_mode": "stack"},
}


# The comparisons train with plain SGD: an update is then lr x the gradient, so two runs' adapters differ by what
# their gradients do (float noise: ~1e-6 relative). Adam's first update is lr x sign(g) entry by entry: any entry
# whose gradient is near zero flips with the float noise, a 2 x lr step, which no relative tolerance survives on
# every machine; and being blind to the gradient's scale, it would pass a wrongly scaled loss.
SGD = {"trainer_args": "optim=sgd", "learning_rate": 0.1}


def run_grpo(policy, runs, name, shared: bool, monkeypatch, **over):
    from slmsql.stages import grpo

    out = runs["root"] / f"{name}-{'shared' if shared else 'plain'}"
    over = {k: (str(runs["sft"]) if v == "SFT" else v) for k, v in over.items()}
    over = {**SGD, **over, "trainer_args": f"{SGD['trainer_args']} {over.get('trainer_args', '')}".strip()}
    cfg = configs.load(configs.GRPOStageConfig, None, {
        "data": str(runs["band"]), "db_root": str(policy.db_root), "model": str(policy.model),
        "output_dir": str(out), "run_name": out.name, "experiment": "shared-prefix", "num_generations": 4,
        "per_device_train_batch_size": 8, "max_completion_length": 40, "max_steps": STEPS, "save_steps": 100,
        "completions_every": 100, "workers": 1, "timeout_s": 5.0, "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
        "shared_prefix": shared, **over})
    with monkeypatch.context() as m, tracking_store(runs["uri"]):
        scripted.install(m, policy.model, answer_for(policy), group=4)
        torch.manual_seed(0)
        grpo.main(cfg)
        client = mlflow.MlflowClient()
        (run,) = client.search_runs([client.get_experiment_by_name("shared-prefix").experiment_id],
                                    f"attributes.run_name = '{out.name}'")
        history = {k: sorted((h.step, h.value) for h in client.get_metric_history(run.info.run_id, k))
                   for k in ("loss", "shared_prefix/logp_max_abs_diff", "shared_prefix/token_ratio",
                             "sampling/sampling_logp_difference/max")}
    return run, history, adapter_weights(out / "adapter")


def start_weights(runs, over):
    return adapter_weights(runs["sft"]) if over.get("adapter_mode") == "continue" else None


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_run_ends_where_the_plain_path_ends(policy, runs, monkeypatch, name):
    over = VARIANTS[name]
    run, history, shared = run_grpo(policy, runs, name, True, monkeypatch, **over)
    plain_run, plain_history, plain = run_grpo(policy, runs, name, False, monkeypatch, **over)
    assert run.data.params["shared_prefix"] == "true" and plain_run.data.params["shared_prefix"] == "false"
    assert run.data.tags[shared_prefix_trainer.TAG].startswith("on: "), run.data.tags.get(shared_prefix_trainer.TAG)
    (_, diff), = history["shared_prefix/logp_max_abs_diff"]
    assert diff <= shared_prefix_trainer.TOLERANCE[torch.float32]
    ratios = [v for _, v in history["shared_prefix/token_ratio"]]
    assert len(ratios) >= STEPS and min(ratios) > 1.5  # the training forward really computed less
    assert shared_prefix_trainer.TAG not in plain_run.data.tags and not plain_history["shared_prefix/token_ratio"]
    losses, plain_losses = [v for _, v in history["loss"]], [v for _, v in plain_history["loss"]]
    assert len(losses) == len(plain_losses) == STEPS
    assert losses == pytest.approx(plain_losses, rel=1e-3, abs=1e-5)
    moved, gap = update_gap(shared, plain, start_weights(runs, over))
    assert moved > 1e-3  # the runs trained: the comparison is not of two untouched adapters
    assert gap <= 1e-3, f"{name}: the adapters' updates are {gap:.3g} apart (relative)"


def update_gap(a: dict, b: dict, start: dict | None) -> tuple[float, float]:
    """(||b - start||, ||a - b|| / ||b - start||) over the adapter's tensors; for a fresh LoRA (start None) over its
    B matrices, which PEFT starts at zero (its A it draws at random, alike in both runs). The L2 norm, not the
    largest entry: Adam divides each gradient entry by its own scale, so an entry near its epsilon turns float
    noise into a visible step."""
    assert a.keys() == b.keys()
    keys = list(b) if start else [k for k in b if "lora_B" in k]
    start = start or {k: torch.zeros_like(b[k]) for k in keys}
    moved = sum(float(((b[k] - start[k]) ** 2).sum()) for k in keys) ** 0.5
    return moved, sum(float(((a[k] - b[k]) ** 2).sum()) for k in keys) ** 0.5 / moved


@pytest.mark.slow
def test_vllm_rollouts_are_scored_with_the_shared_prefix(policy, runs, monkeypatch, vllm_ready):
    """`--backend vllm`: TRL takes the old policy's log-probs of the engine's rollouts for its importance-sampling
    correction; with the shared prefix they agree with the engine's own to float error (a wrong computation would
    show as a gap), and the step ends where the plain path's ends (same seeded rollouts in both runs)."""
    # the rollouts are the policy's own (the engine's, not scripted): ngram beside the outcome rewards, so that
    # completions that differ get different rewards and the step has a gradient whatever the floats sample
    over = {"backend": "vllm", "max_steps": 1, "rewards": ["execution", "format", "ngram"]}
    run, history, shared = run_grpo(policy, runs, "vllm", True, monkeypatch, **over)
    plain_run, plain_history, plain = run_grpo(policy, runs, "vllm", False, monkeypatch, **over)
    assert run.data.tags[shared_prefix_trainer.TAG].startswith("on: ") and run.data.params["backend"] == "vllm"
    (_, gap), = history["sampling/sampling_logp_difference/max"]
    assert gap < 1e-3  # engine vs policy, both sides computing the same thing (tests/test_vllm_grpo.py's bound)
    assert [v for _, v in history["loss"]] == pytest.approx([v for _, v in plain_history["loss"]], rel=1e-3, abs=1e-5)
    moved, apart = update_gap(shared, plain, None)
    assert moved > 1e-3 and apart <= 1e-3


@pytest.mark.slow
def test_a_failed_self_check_falls_back_to_the_plain_path(policy, runs, monkeypatch):
    leaked(monkeypatch)
    run, history, shared = run_grpo(policy, runs, "fallback", True, monkeypatch)
    monkeypatch.undo()
    _, _, plain = run_grpo(policy, runs, "fallback", False, monkeypatch)
    tag = run.data.tags[shared_prefix_trainer.TAG]
    assert tag.startswith("plain path: the first step's self-check found log-probs"), tag
    (_, diff), = history["shared_prefix/logp_max_abs_diff"]
    assert diff > shared_prefix_trainer.TOLERANCE[torch.float32]
    assert not history["shared_prefix/token_ratio"]  # nothing was computed the shared way
    assert update_gap(shared, plain, None)[1] <= 1e-4, "after the fallback the run is the plain path's"


@pytest.mark.slow
def test_the_command_line_logs_the_self_check(policy, runs, tmp_path):
    """`slmsql grpo --shared-prefix true` in a new process (the policy samples: no scripting)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    base = [sys.executable, "-m", "slmsql.cli", "grpo", "--data", str(runs["band"]), "--db-root", str(policy.db_root),
            "--model", str(policy.model), "--num-generations", "4", "--per-device-train-batch-size", "8",
            "--max-completion-length", "24", "--max-steps", "1", "--workers", "1", "--lora-r", "4", "--lora-alpha", "8"]
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1"}
    for flag in ("true", "false"):
        done = watched.run([*base, "--shared-prefix", flag, "--output-dir", str(tmp_path / flag),
                            "--run-name", flag], env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
    with tracking_store(uri):
        runs_ = {r.info.run_name: r for r in mlflow.search_runs(search_all_experiments=True, output_format="list")}
    on, off = runs_["true"], runs_["false"]
    assert on.data.params["shared_prefix"] == "true" and off.data.params["shared_prefix"] == "false"
    assert on.data.metrics["shared_prefix/logp_max_abs_diff"] <= shared_prefix_trainer.TOLERANCE[torch.float32]
    assert on.data.tags[shared_prefix_trainer.TAG].startswith("on: ")
    assert "shared_prefix/logp_max_abs_diff" not in off.data.metrics and shared_prefix_trainer.TAG not in off.data.tags
