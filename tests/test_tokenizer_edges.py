"""Tokenizer edge cases of real checkpoints, each on a tiny model built for it:
- no pad token: `load_model` pads with eos, on the left for generation (a batch answers as each prompt alone),
  and SFT's labels still hold the answer's closing eos while padding carries no loss;
- an end-of-turn token that is neither the tokenizer's eos nor in the generation config: generation stops at
  it (the generation config TRL's rollouts read names it too), so extraction sees the answer alone.
"""

from __future__ import annotations

from pathlib import Path

import bigram
import pytest
from bigram import TEXTS, edit_json, prompt

from slmsql.generation import sampling as generation
from slmsql.policy import models
from slmsql.sql.extract import extract_sql
from slmsql.toy.tiny_model import ENDOFTEXT, IM_END, build_tiny_model


@pytest.fixture(scope="module")
def no_pad(tmp_path_factory) -> Path:
    """A checkpoint with no pad token anywhere (tokenizer, config, generation config), as many base models ship."""
    folder = build_tiny_model(tmp_path_factory.mktemp("no-pad") / "m", TEXTS, vocab_size=300, hidden=16, layers=1,
                              heads=2, ffn=32)
    edit_json(folder / "tokenizer_config.json", pad_token=None)
    for name in ("config.json", "generation_config.json"):
        edit_json(folder / name, pad_token_id=None)
    return folder


def test_no_pad_token_pads_left_with_eos_and_batches_answer_as_single_prompts(no_pad):
    lm, tok = models.load_model(no_pad)
    assert tok.pad_token == tok.eos_token == IM_END and tok.padding_side == "left"
    assert lm.generation_config.pad_token_id == tok.eos_token_id
    prompts = [prompt(tok, "How many items?"), prompt(tok, "Which items cost more than 3 and what are their names?")]
    assert len({len(tok(p)["input_ids"]) for p in prompts}) == 2  # one of them is padded in a batch
    batched = generation.generate(lm, tok, prompts, max_new_tokens=8, batch_size=2, progress=False)
    alone = [generation.generate(lm, tok, [p], max_new_tokens=8, progress=False)[0] for p in prompts]
    assert batched == alone


@pytest.mark.slow
def test_sft_with_pad_equal_to_eos_keeps_the_answers_eos_as_a_label(no_pad, tmp_path):
    """TRL pads labels with -100 by position, not by token id: with pad == eos the eos that closes the answer
    must still be learnt (else the model never learns to stop)."""
    import trl

    from slmsql import configs
    from slmsql.toy import world as toyworld
    from slmsql.stages import sft

    toyworld.generate(tmp_path / "world", seed=0, size="small")
    rows = (tmp_path / "world" / "sft.jsonl").read_text().splitlines()[:8]
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    cfg = configs.load(configs.SFTStageConfig, None, {
        "data": str(tmp_path / "train.jsonl"), "db_root": str(tmp_path / "world" / "databases"), "model": str(no_pad),
        "output_dir": str(tmp_path / "sft"), "max_steps": 1, "per_device_train_batch_size": 8,
        "max_length": 2048})  # this tokenizer, trained on a few texts, spells the schema out nearly byte by byte
    seen = []

    class Recorded(trl.SFTTrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen.append(self)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(trl, "SFTTrainer", Recorded)
        sft.main(cfg)
    (trainer,) = seen
    eos = trainer.processing_class.eos_token_id
    assert trainer.processing_class.pad_token_id == eos
    batch = next(iter(trainer.get_train_dataloader()))
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert (mask == 0).any(), "no row was padded: the test shows nothing"
    assert (labels[mask == 0] == -100).all()  # padding (eos ids) carries no loss
    for row_ids, row_labels, row_mask in zip(ids, labels, mask):
        real = row_ids[row_mask.bool()]
        closing = int((real == eos).nonzero().max())  # the answer's <|im_end|>: the last eos before the padding
        assert row_labels[row_mask.bool()][closing] == eos


# ---- an end-of-turn token that is not eos (bigram.eot_not_eos; test_vllm stops vLLM at it too) ---------------

@pytest.fixture(scope="module")
def eot_not_eos(tmp_path_factory) -> Path:
    return bigram.eot_not_eos(tmp_path_factory.mktemp("eot"))


def test_end_of_turn_token_is_found_from_the_chat_template(eot_not_eos):
    lm, tok = models.load_model(eot_not_eos)
    im_end = tok.convert_tokens_to_ids(IM_END)
    assert tok.eos_token == ENDOFTEXT and models.end_of_turn_id(tok) == im_end
    assert im_end in lm.generation_config.eos_token_id  # generation/sampling.py and TRL's rollouts both stop on these


def test_generation_stops_at_the_end_of_turn_token(eot_not_eos):
    lm, tok = models.load_model(eot_not_eos)
    (completion,) = generation.generate(lm, tok, [prompt(tok, "How many items?")], max_new_tokens=12,
                                        progress=False)[0]
    assert completion.strip() == "SELECT 1"
    assert extract_sql(completion)[0] == "SELECT 1"


def test_a_template_that_closes_turns_with_plain_text_adds_no_stop_token(no_pad):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(no_pad)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert models.end_of_turn_id(tok) is None  # "\n" must never stop generation
