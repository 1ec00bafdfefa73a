"""training.compact_fused_head: on a CPU, TRL's fused LM head projects only the positions that carry a label (as
it does on CUDA) instead of every position. Same batch, same weights: the same loss, gradients and TRL metrics
as TRL's every-position path, from exactly the labelled positions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from slmsql.training import hf_trainer as training
from slmsql.policy.models import load_model
from slmsql.toy.tiny_model import build_tiny_model

QUESTIONS = [("How many items?", "SELECT count(*) FROM item"), ("Names of pens?", "SELECT name FROM item"),
             ("Most expensive item?", "SELECT name FROM item ORDER BY price DESC LIMIT 1"),
             ("Kinds?", "SELECT DISTINCT kind FROM item")]


@pytest.fixture(scope="module")
def trl_parts():
    """TRL's SFT trainer and kernels, imported when a test of this module runs: imported at collection they cost
    every pytest-xdist worker 3-4 s, in whichever tier, whether or not it runs these tests."""
    from trl import SFTConfig, SFTTrainer
    from trl.kernels import chunked_logprob
    from trl.trainer import utils as trl_utils

    # HEAD: TRL's fused-head projection, counted in one_step
    return SimpleNamespace(SFTConfig=SFTConfig, SFTTrainer=SFTTrainer, chunked_logprob=chunked_logprob,
                           utils=trl_utils, HEAD=trl_utils._ChunkedLogProbFunction.apply)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    texts = [t for pair in QUESTIONS for t in pair] * 4
    return build_tiny_model(tmp_path_factory.mktemp("sft-loss") / "m", texts, vocab_size=300, hidden=32, layers=1,
                            heads=4, ffn=64)


def one_step(parts, tiny, tmp_path, monkeypatch):
    """SFTTrainer's compute_loss and backward on one batch; also the row count the fused head projected."""
    torch.manual_seed(0)
    model, tok = load_model(tiny, None, trainable=True)
    tok.padding_side = "right"
    rows = [{"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": a}]}
            for q, a in QUESTIONS]
    args = parts.SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, max_steps=1,
                           per_device_train_batch_size=4, save_strategy="no", shuffle_dataset=False)
    t = parts.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    projected = []
    monkeypatch.setattr(parts.utils._ChunkedLogProbFunction, "apply",
                        lambda hidden, *a: projected.append(hidden.shape[0]) or parts.HEAD(hidden, *a))
    t.model.train()
    batch = next(iter(t.get_train_dataloader()))
    loss = t.compute_loss(t.model, dict(batch), num_items_in_batch=(batch["labels"][:, 1:] != -100).sum())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
    return loss.item(), grads, {k: v[-1] for k, v in t._metrics["train"].items()}, batch, projected


def test_compact_head_on_cpu_gives_trls_every_position_results(trl_parts, tiny, tmp_path, monkeypatch):
    # TRL's own decision, even where an earlier test's stage run in this process already switched it
    monkeypatch.setattr(trl_parts.utils, "_use_triton", trl_parts.chunked_logprob._use_triton)
    every = one_step(trl_parts, tiny, tmp_path / "every", monkeypatch)
    training.compact_fused_head()
    training.compact_fused_head()  # a second call changes nothing
    compact = one_step(trl_parts, tiny, tmp_path / "compact", monkeypatch)
    (loss_a, grads_a, metrics_a, batch, projected_a), (loss_b, grads_b, metrics_b, _, projected_b) = every, compact

    labels = batch["labels"]
    assert (labels == -100).any() and (labels != -100).any()  # prompt masked, completion trained
    assert projected_a == [labels[:, 1:].numel()]  # TRL on a CPU: every position
    assert projected_b == [int((labels[:, 1:] != -100).sum())]  # now: the labelled ones only
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6)
    assert set(metrics_a) == {"entropy", "mean_token_accuracy", "num_tokens"}
    for key in metrics_a:
        assert metrics_b[key] == pytest.approx(metrics_a[key], rel=1e-5), key


@pytest.mark.parametrize("version, replaced", [("1.16.0", True), ("1.17.0", False), ("1.15.2", False)])
def test_compact_head_replaces_trls_private_name_only_in_the_releases_it_was_checked_on(version, replaced, trl_parts,
                                                                                        monkeypatch, caplog):
    import trl

    trl_utils = trl_parts.utils
    monkeypatch.setattr(trl_utils, "_use_triton", trl_parts.chunked_logprob._use_triton)
    monkeypatch.setattr(trl, "__version__", version)
    caplog.clear()
    training.compact_fused_head()
    assert (trl_utils._use_triton is not trl_parts.chunked_logprob._use_triton) == replaced
    assert trl_utils._use_triton(torch.device("cpu")) == replaced  # the compact path on a CPU, or TRL's own
    warned = [r.message for r in caplog.records if "compact fused LM head" in r.message]
    assert bool(warned) != replaced and (not warned or version in warned[0])


def test_compact_head_leaves_a_trl_without_the_name_alone_and_says_so(trl_parts, monkeypatch, caplog):
    monkeypatch.delattr(trl_parts.utils, "_use_triton")
    training.compact_fused_head()
    assert not hasattr(trl_parts.utils, "_use_triton")
    assert any("compact fused LM head" in r.message for r in caplog.records)
