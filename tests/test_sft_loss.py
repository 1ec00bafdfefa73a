"""training.sft_trainer: where TRL's fused LM head runs its torch fallback (a CPU), the loss comes from the model's
own forward. Same batch, same weights: the same loss, gradients and TRL metrics as TRL's own compute_loss."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from slmsql import training
from slmsql.models import build_tiny_model, load_model

QUESTIONS = [("How many items?", "SELECT count(*) FROM item"), ("Names of pens?", "SELECT name FROM item"),
             ("Most expensive item?", "SELECT name FROM item ORDER BY price DESC LIMIT 1"),
             ("Kinds?", "SELECT DISTINCT kind FROM item")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    texts = [t for pair in QUESTIONS for t in pair] * 4
    return build_tiny_model(tmp_path_factory.mktemp("sft-loss") / "m", texts, vocab_size=300, hidden=32, layers=1,
                            heads=4, ffn=64)


def trainer(cls_or_factory, tiny, tmp_path):
    torch.manual_seed(0)
    model, tok = load_model(tiny, None, trainable=True)
    tok.padding_side = "right"
    rows = [{"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": a}]}
            for q, a in QUESTIONS]
    args = SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, max_steps=1,
                     per_device_train_batch_size=4, save_strategy="no", shuffle_dataset=False)
    return cls_or_factory(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)


def loss_grads_metrics(t):
    t.model.train()
    batch = next(iter(t.get_train_dataloader()))
    n_items = (batch["labels"][:, 1:] != -100).sum()
    loss = t.compute_loss(t.model, dict(batch), num_items_in_batch=n_items)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
    return loss.item(), grads, {k: v[-1] for k, v in t._metrics["train"].items()}, batch


def test_model_loss_matches_trls_fused_head_on_cpu(tiny, tmp_path):
    assert training.fused_head_is_fallback(torch.device("cpu"))
    ours = trainer(training.sft_trainer, tiny, tmp_path / "ours")
    assert type(ours) is not SFTTrainer  # on a CPU: the model-loss trainer
    trl = trainer(SFTTrainer, tiny, tmp_path / "trl")
    loss_a, grads_a, metrics_a, batch = loss_grads_metrics(ours)
    loss_b, grads_b, metrics_b, _ = loss_grads_metrics(trl)
    assert (batch["labels"] == -100).any() and (batch["labels"] != -100).any()  # prompt masked, completion trained
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6)
    assert set(metrics_a) == set(metrics_b) == {"entropy", "mean_token_accuracy", "num_tokens"}
    for key in metrics_a:
        assert metrics_a[key] == pytest.approx(metrics_b[key], rel=1e-5), key
    assert metrics_a["num_tokens"] == batch["attention_mask"].sum().item()
