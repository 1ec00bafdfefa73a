"""Merged rollouts (slmsql.generation.merged_rollouts): rollouts sampled with the LoRA merged, training unchanged.

Fast, on a small random model with a random LoRA (PEFT starts B at zero, where merged and unmerged are trivially
one model): every weight is the same bits after a merged rollout, an exception included; the merged forward is the
policy (log-prob gap < 1e-4 in float32) and a wrongly scaled merge is not; the trainer's rollouts run merged (with
the shared prefix's prefill too), log the first rollout's gap once, stop on a wrong merge, and leave the training
forward's loss and gradients identical to those after an unmerged rollout; refusals before a model loads and at
the trainer's start. Slow: a whole `slmsql grpo` run with merged rollouts ends with the same adapter, to the bit,
as one without (scripted completions).
"""

from __future__ import annotations

import functools
import hashlib

import mlflow
import pytest
import scripted
import torch
from learning import adapter_weights
from policy import policy_fixture, read, tracking_store, write  # noqa: F401  (the fixture)

from slmsql import configs
from slmsql.errors import SlmsqlError
from slmsql.generation import merged_rollouts
from slmsql.training import merged_rollouts_trainer
from slmsql.training import shared_prefix_trainer

GAP_TOL = 1e-4  # float32: measured 0 to ~1e-6 on these models


def tiny_lora(tmp_path, dropout: float = 0.0):
    """A small random model with a LoRA whose A and B are random (not PEFT's zero B), and its tokenizer folder."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from slmsql.toy.tiny_model import build_tiny_model

    folder = build_tiny_model(tmp_path / "tiny", ["SELECT name FROM item WHERE price > 3 ORDER BY name"] * 8,
                              vocab_size=300, hidden=32, layers=2, heads=2, ffn=64)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), lora(dropout))
    randomize(model)
    return model, folder


def lora(dropout: float = 0.0):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear", task_type="CAUSAL_LM")


def randomize(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))


def digest(model) -> str:
    h = hashlib.sha256()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def rows(vocab: int, prompts=(9, 5, 12), completions=(6, 3, 0, 8)):
    g = torch.Generator().manual_seed(2)
    p = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in prompts]
    c = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in completions]
    return [p[i % len(p)] for i in range(len(c))], c


def broken_scaling(monkeypatch, factor: float = 2.0):
    from peft.tuners.lora import Linear

    delta = Linear.get_delta_weight
    monkeypatch.setattr(Linear, "get_delta_weight", lambda self, adapter: factor * delta(self, adapter))


# ---- the merge itself ----------------------------------------------------------------------------------------

def test_a_merged_block_restores_every_weight_to_the_bit(tmp_path):
    model, _ = tiny_lora(tmp_path)
    model.eval()
    ids = torch.tensor([rows(model.config.vocab_size)[0][0]])
    before, params = digest(model), list(model.parameters())
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        layers = merged_rollouts.lora_layers(model)
        weight = layers[0].get_base_layer().weight
        base, storage = weight.detach().clone(), weight.data_ptr()
        with merged_rollouts.merged(model):
            assert all(layer.merged for layer in layers)
            assert weight.data_ptr() != storage and not torch.equal(weight, base)  # the merge is in new tensors
            assert (model(input_ids=ids).logits - logits).abs().max() < 1e-4  # and it is the same model
        assert digest(model) == before and list(model.parameters()) == params
        assert weight.data_ptr() == storage and not any(layer.merged for layer in layers)
        assert torch.equal(model(input_ids=ids).logits, logits)  # the LoRA path is back
        with pytest.raises(RuntimeError, match="in the rollout"), merged_rollouts.merged(model):
            raise RuntimeError("in the rollout")
        assert digest(model) == before and not any(layer.merged for layer in layers)


def test_the_merged_policy_is_the_training_policy_and_a_wrong_merge_is_not(tmp_path, monkeypatch):
    model, _ = tiny_lora(tmp_path)
    prompts, completions = rows(model.config.vocab_size)
    gap = merged_rollouts.gap(model, prompts, completions, temperature=0.8)
    assert gap < GAP_TOL
    broken_scaling(monkeypatch)
    wrong = merged_rollouts.gap(model, prompts, completions, temperature=0.8)
    assert wrong > merged_rollouts.TOLERANCE[torch.float32], wrong


def test_a_lora_dropout_on_in_training_is_refused(tmp_path):
    model, _ = tiny_lora(tmp_path, dropout=0.05)
    model.train()
    with pytest.raises(SlmsqlError, match="dropout is on"), merged_rollouts.merged(model):
        pass
    model.eval()  # eval mode: no dropout drawn, nothing to refuse
    with merged_rollouts.merged(model):
        pass


def test_what_cannot_merge_exactly_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    model, folder = tiny_lora(tmp_path)
    with pytest.raises(SlmsqlError, match="merged_rollouts: the model has no LoRA layer"):
        merged_rollouts.lora_layers(AutoModelForCausalLM.from_pretrained(folder))
    with pytest.raises(SlmsqlError, match="merged_rollouts: .* of torch.bfloat16 cannot be merged exactly"):
        merged_rollouts.lora_layers(model.to(torch.bfloat16))


@pytest.mark.parametrize("over, why", [
    ({"use_lora": False}, "trains without a LoRA"),
    ({"backend": "vllm"}, "vLLM generates"),
    ({"trainer_args": "use_vllm=true"}, "vLLM generates"),
    ({"trainer_args": "use_transformers_continuous_batching=true"}, "continuous batching"),
    ({"dtype": "bfloat16"}, "bfloat16 weights"),
])
def test_the_stage_refuses_merged_rollouts_where_they_cannot_apply(over, why):
    from slmsql.stages import grpo

    cfg = configs.load(configs.GRPOStageConfig, None, {"merged_rollouts": True, **over})
    with pytest.raises(SlmsqlError, match=f"merged_rollouts: .*{why}.*set merged_rollouts false"):
        grpo.check_args(cfg, [])  # refused before the examples or a model are read
    merged_rollouts.check(configs.load(configs.GRPOStageConfig, None, over))  # off: nothing refused


def test_a_continued_adapter_is_a_lora_to_merge():
    merged_rollouts.check(configs.load(configs.GRPOStageConfig, None, {
        "merged_rollouts": True, "use_lora": False, "base_adapter": "outputs/sft", "adapter_mode": "continue"}))


# ---- in the trainer ------------------------------------------------------------------------------------------

def trainer_for(tmp_path, shared: bool = True, on_state=None, fresh: bool = False):
    """What `slmsql grpo --merged-rollouts true` builds on the tiny model (disable_dropout as the stage sets it; the
    LoRA's dropout 0.05, so TRL's zeroing of it is what keeps the rollouts exact)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    _, folder = tiny_lora(tmp_path)
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none", bf16=False,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=8, temperature=0.8,
                      disable_dropout=True)
    cls = shared_prefix_trainer.trainer_class(GRPOTrainer) if shared else GRPOTrainer
    torch.manual_seed(0)
    trainer = merged_rollouts_trainer.trainer_class(cls, on_state)(
        model=AutoModelForCausalLM.from_pretrained(folder), reward_funcs=[lambda completions, **_: [0.0] * 4],
        args=args, train_dataset=Dataset.from_list([{"prompt": "q"}] * 4),
        processing_class=AutoTokenizer.from_pretrained(folder), peft_config=lora(0.05))
    if not fresh:  # as after a step: PEFT's zero B would make merged and unmerged one model trivially
        randomize(trainer.model)
    if shared:  # as after the first step's self-check (tests/test_shared_prefix.py): the shared prefill is on
        trainer._shared_prefix = "on"
    return trainer


def loss_and_grads(trainer, ids, mask, width):
    """The training forward (the trainer's own log-probs, the model in training mode) and LoRA gradients."""
    model = trainer.model
    model.train()
    model.zero_grad()
    logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, width)
    loss = (logps * mask[:, -width:]).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_rollouts_run_merged_and_training_after_them_is_unchanged(tmp_path):
    heard = []
    trainer = trainer_for(tmp_path, on_state=heard.append)
    model = trainer.model
    layers = merged_rollouts.lora_layers(model)
    assert all(d.p == 0 for layer in layers for d in layer.lora_dropout.values())  # TRL's disable_dropout
    vocab = model.config.vocab_size
    prompts = [p for p in rows(vocab, prompts=(9, 5), completions=(0, 0))[0] for _ in range(4)]  # TRL's groups
    ids = torch.tensor([p + c for p, c in zip(*rows(vocab, prompts=(9,), completions=(4, 4, 4, 4)))])
    mask, width = torch.ones_like(ids), 4
    start = loss_and_grads(trainer, ids, mask, width)
    before = digest(model)

    calls, forward = [], model.get_base_model().forward

    @functools.wraps(forward)  # generate reads the forward's signature
    def recording(*a, **k):  # the gap check's forwards are the ones without a cache
        calls.append((k.get("use_cache") is False, all(layer.merged for layer in layers), k["input_ids"].shape))
        return forward(*a, **k)

    model.get_base_model().forward = recording
    completions, _ = trainer._generate_single_turn(prompts, None, {}, 4)
    model.get_base_model().forward = forward  # TRL's own (its fused LM head), not the class's
    rollout = [(m, shape) for check, m, shape in calls if not check]
    assert len(completions) == 8 and rollout and all(m for m, _ in rollout)  # every decode step merged
    assert tuple(rollout[0][1]) == (2, 8)  # the shared prefix's prefill: each distinct prompt once, merged
    assert {m for check, m, _ in calls if check} == {True, False}  # the gap: merged vs the training forward
    assert digest(model) == before
    (gap,) = trainer._metrics["train"][merged_rollouts.METRIC]
    assert gap < GAP_TOL and len(heard) == 2 and heard[1].startswith("on: rollouts sampled with the LoRA merged, "
                                                                     "log-probs within")

    after_merged = loss_and_grads(trainer, ids, mask, width)
    type(trainer).__mro__[1]._generate_single_turn(trainer, prompts, None, {}, 4)  # an unmerged rollout
    after_plain = loss_and_grads(trainer, ids, mask, width)
    for other in (after_merged, after_plain):
        assert torch.equal(other[0], start[0]) and other[1].keys() == start[1].keys()
        assert all(torch.equal(other[1][n], g) for n, g in start[1].items())
    assert any("lora_B" in n for n in start[1])

    trainer._generate_single_turn(prompts, None, {}, 4)
    assert len(trainer._metrics["train"][merged_rollouts.METRIC]) == 1 and len(heard) == 2  # measured once


def test_a_wrong_merge_stops_the_run_at_the_first_rollout(tmp_path, monkeypatch):
    heard = []
    trainer = trainer_for(tmp_path, shared=False, on_state=heard.append)
    before = digest(trainer.model)
    broken_scaling(monkeypatch)
    vocab = trainer.model.config.vocab_size
    prompts = [p for p in rows(vocab, prompts=(9, 5), completions=(0, 0))[0] for _ in range(4)]
    with pytest.raises(SlmsqlError, match="merged_rollouts: the merged policy's log-probs are .* from the training"):
        trainer._generate_single_turn(prompts, None, {}, 4)
    assert heard[-1].startswith("stopped: ") and digest(trainer.model) == before


def test_a_fresh_lora_is_measured_at_its_first_rollout_after_it_moved(tmp_path):
    heard = []
    trainer = trainer_for(tmp_path, shared=False, on_state=heard.append, fresh=True)
    vocab = trainer.model.config.vocab_size
    prompts = [p for p in rows(vocab, prompts=(9, 5), completions=(0, 0))[0] for _ in range(4)]
    trainer._generate_single_turn(prompts, None, {}, 4)
    assert not trainer._metrics["train"][merged_rollouts.METRIC] and heard == [
        "on: rollouts sampled with the LoRA merged (log-prob gap measured at the first rollout with a non-zero LoRA)"]
    randomize(trainer.model)  # what the first optimizer step does to B
    trainer._generate_single_turn(prompts, None, {}, 4)
    (gap,) = trainer._metrics["train"][merged_rollouts.METRIC]
    assert gap < GAP_TOL and heard[-1].startswith("on: rollouts sampled with the LoRA merged, log-probs within")


def test_a_trainer_without_lora_is_refused(tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    _, folder = tiny_lora(tmp_path)
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none", bf16=False,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=8)
    with pytest.raises(SlmsqlError, match="no LoRA layer"):
        merged_rollouts_trainer.trainer_class(GRPOTrainer)(
            model=AutoModelForCausalLM.from_pretrained(folder), reward_funcs=[lambda completions, **_: [0.0] * 4],
            args=args, train_dataset=Dataset.from_list([{"prompt": "q"}] * 4),
            processing_class=AutoTokenizer.from_pretrained(folder))


# ---- a whole run ---------------------------------------------------------------------------------------------

def run_grpo(policy, root, merged: bool, monkeypatch):
    from slmsql.stages import grpo

    band = root / "band.jsonl"
    if not band.exists():
        write(band, [{**r, "pass_rate": 0.5, "k": 4, "n_correct": 2} for r in read(policy.train)[:8]])
    out = root / ("merged" if merged else "plain")
    cfg = configs.load(configs.GRPOStageConfig, None, {
        "data": str(band), "db_root": str(policy.db_root), "model": str(policy.model), "output_dir": str(out),
        "run_name": out.name, "experiment": "merged", "num_generations": 4, "per_device_train_batch_size": 8,
        "max_completion_length": 40, "max_steps": 2, "save_steps": 100, "completions_every": 100, "workers": 1,
        "lora_r": 4, "lora_alpha": 8, "use_lora": True, "merged_rollouts": merged, "learning_rate": 0.05})
    find = scripted.question_of(read(policy.train))
    answer = lambda prompt, i: [scripted.right(find(prompt)), scripted.WRONG, f"```sql\n{find(prompt)['sql']}\n```\n",
                                scripted.NO_SQL][i]  # noqa: E731
    with monkeypatch.context() as m, tracking_store(f"sqlite:///{root}/mlflow.db"):
        scripted.install(m, policy.model, answer, group=4)
        torch.manual_seed(0)
        grpo.main(cfg)
        client = mlflow.MlflowClient()
        (run,) = client.search_runs([client.get_experiment_by_name("merged").experiment_id],
                                    f"attributes.run_name = '{out.name}'")
        losses = [h.value for h in sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda h: h.step)]
    return run, losses, adapter_weights(out / "adapter")


@pytest.mark.slow
def test_a_run_with_merged_rollouts_ends_with_the_same_adapter_to_the_bit(policy, tmp_path, monkeypatch):
    """Scripted completions (tests/scripted.py), sampled inside the merge as the policy's would be: the losses and
    the adapter are the plain run's to the bit."""
    run, losses, weights = run_grpo(policy, tmp_path, True, monkeypatch)
    plain_run, plain_losses, plain = run_grpo(policy, tmp_path, False, monkeypatch)
    assert run.data.params["merged_rollouts"] == "true" and plain_run.data.params["merged_rollouts"] == "false"
    tag = run.data.tags[merged_rollouts.TAG]  # measured at step 1's rollout: the fresh LoRA moved at step 0
    assert tag.startswith("on: rollouts sampled with the LoRA merged, log-probs within"), tag
    assert run.data.metrics[merged_rollouts.METRIC] < GAP_TOL
    assert merged_rollouts.TAG not in plain_run.data.tags and merged_rollouts.METRIC not in plain_run.data.metrics
    assert len(losses) == 2 and losses == plain_losses
    assert weights.keys() == plain.keys() and all(torch.equal(weights[k], plain[k]) for k in plain)
    assert any(float(v.abs().max()) > 0 for k, v in weights.items() if "lora_B" in k)  # it trained
