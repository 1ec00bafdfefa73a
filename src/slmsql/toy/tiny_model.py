"""The embedded default's model: a tiny Qwen2 with a BPE tokenizer trained on the toy world's texts, built offline
in seconds (`slmsql tiny-model`; the tests build their own)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

# ChatML as Qwen renders it, minus Qwen's injected default system prompt and tool-calling branches.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_bpe(texts: Iterable[str], vocab_size: int = 2000):
    """Train a byte-level BPE (`tokenizers.Tokenizer`) whose ids survive a reload as `Qwen2Tokenizer`.

    It uses exactly the normalizer (NFC) and pre-tokenizer (Qwen's split regex, which puts each digit in a
    pre-token of its own, then byte-level) that `Qwen2Tokenizer` rebuilds on load: AutoTokenizer always loads
    that class for model_type=qwen2, so any other pre-tokenization would change the ids after a reload.
    """
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    return bpe


def build_tiny_model(
    output_dir: str | os.PathLike,
    texts: Iterable[str],
    *,
    vocab_size: int = 2000,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    ffn: int = 512,
    seed: int = 0,
) -> Path:
    """Save a randomly initialised Qwen2ForCausalLM (tied embeddings) and a BPE tokenizer trained on `texts`.

    Pass the texts as the model will see them (chat-rendered prompts and SQL). eos is <|im_end|>, pad is
    <|endoftext|>, the chat template is ChatML. Offline, seconds, deterministic for a given seed.
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    output_dir = Path(output_dir)
    trained = json.loads(train_bpe(texts, vocab_size).to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=trained["vocab"], merges=merges, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=None,
        model_max_length=2048, extra_special_tokens=[IM_START, IM_END],
    )
    tokenizer.chat_template = CHATML_TEMPLATE

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=ffn,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir
