"""Deterministic tiny checkpoints for stop-token tests: a Qwen2 whose next token is a function of the current
token alone, so greedy output is exact on any backend (transformers, vLLM).

`eot_not_eos(root)`: eos (tokenizer and generation config) is <|endoftext|>, while the chat template closes
turns with <|im_end|>; after the prompt the model answers `SELECT 1`, closes its turn, then rambles `DROP`
until eos. A generator that stops only at eos returns the rambling too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from slmsql.toy.tiny_model import ENDOFTEXT, IM_END, build_tiny_model
from slmsql.inputs.prompts import build_messages, render_prompt

TEXTS = ["SELECT name FROM item WHERE price > 3", "DROP everything", "How many items cost more than 3?"] * 8
HEAD = 64  # a head size every attention kernel serves (vLLM's CPU backend: 32, 64, 80, ... 256, 512)


def edit_json(path: Path, **values) -> None:
    doc = json.loads(path.read_text())
    doc.update(values)
    path.write_text(json.dumps(doc))


def prompt(tokenizer, question: str) -> str:
    return render_prompt(tokenizer, build_messages(question, "CREATE TABLE item (name TEXT, price INTEGER);"))


def bigram_model(folder: Path, chain: dict[int, int], vocab: int, fallback: int) -> None:
    """A Qwen2 whose next token depends on the current token only, by `chain` (else `fallback`): one-hot
    embeddings (padded to whole heads), the decoder layer's outputs zeroed, the LM head a transition matrix.
    Greedy output is exact."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden = -(-vocab // HEAD) * HEAD
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=hidden // HEAD,
                         num_key_value_heads=hidden // HEAD, intermediate_size=4, tie_word_embeddings=False,
                         max_position_embeddings=512)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight[:, :vocab].copy_(torch.eye(vocab))
        model.model.norm.weight.fill_(1.0)
        model.model.layers[0].input_layernorm.weight.fill_(1.0)
        model.model.layers[0].post_attention_layernorm.weight.fill_(1.0)
        head = torch.zeros(vocab, hidden)
        for current in range(vocab):
            head[chain.get(current, fallback), current] = 1.0
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)


def eot_not_eos(root: Path) -> Path:
    from transformers import AutoTokenizer, GenerationConfig

    base = build_tiny_model(root / "base", TEXTS, vocab_size=300, hidden=16, layers=1, heads=2, ffn=32)
    folder = root / "m"
    shutil.copytree(base, folder)
    edit_json(folder / "tokenizer_config.json", eos_token=ENDOFTEXT, pad_token=ENDOFTEXT)
    tok = AutoTokenizer.from_pretrained(folder)
    start = tok(prompt(tok, "q"), add_special_tokens=False)["input_ids"][-1]  # the turn opener's last token
    seq = [*tok("SELECT 1", add_special_tokens=False)["input_ids"], tok.convert_tokens_to_ids(IM_END),
           *tok("DROP", add_special_tokens=False)["input_ids"]]
    assert len(set(seq)) == len(seq) and start not in seq, "the chain needs distinct tokens"
    chain = {start: seq[0], **dict(zip(seq, seq[1:]))}
    bigram_model(folder, chain, len(tok), fallback=tok.eos_token_id)
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(folder)
    return folder
