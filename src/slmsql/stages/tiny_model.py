"""The embedded default model: a ~0.8M-parameter Qwen2 with a BPE tokenizer trained on the toy world.

Its tokenizer sees the sft split's rendered prompts and answers (never dev or dev_cross questions),
so identifiers of the shared lexicon become single tokens, which is what lets a tiny model copy them.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from slmsql.configs import TinyModelConfig
from slmsql.errors import SlmsqlError
from slmsql.inputs.data import read_gold, write_json
from slmsql.inputs.prompts import answer, builder_for
from slmsql.runtime.outputs import Staged

log = logging.getLogger(__name__)


def training_texts(cfg) -> list[str]:
    from jinja2 import Template

    from slmsql.toy.tiny_model import CHATML_TEMPLATE

    toy_dir = Path(cfg.data)
    if not (toy_dir / "sft.jsonl").is_file():
        raise SlmsqlError(f"{toy_dir} is not a toy world (no sft.jsonl); run `slmsql toy` first")
    builder = builder_for(cfg, toy_dir / "databases")
    template = Template(CHATML_TEMPLATE)
    texts = []
    for ex in read_gold(toy_dir / "sft.jsonl"):
        messages = builder.messages(ex) + [{"role": "assistant", "content": answer(ex.sql)}]
        texts.append(template.render(messages=messages, add_generation_prompt=False))
    return texts


def main(cfg: TinyModelConfig) -> dict:
    import mlflow

    from slmsql.toy.tiny_model import build_tiny_model
    from slmsql.tracking import descriptions
    from slmsql.tracking import runs as tracking

    texts = training_texts(cfg)
    with Staged(cfg.output_dir, cfg.overwrite) as st, tracking.stage_run("tiny-model", cfg):
        work = st.work
        t0 = time.time()
        build_tiny_model(work, texts, vocab_size=cfg.vocab_size, hidden=cfg.hidden, layers=cfg.layers,
                         heads=cfg.heads, ffn=cfg.ffn, seed=cfg.seed)
        config = json.loads((work / "config.json").read_text())
        from transformers import AutoModelForCausalLM

        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(work).parameters())
        info = {"parameters": n_params, "vocab_size": config["vocab_size"], "texts": len(texts),
                "build_seconds": time.time() - t0}
        mlflow.log_metrics(info)
        write_json(work / "tiny_model.json", info)
        mlflow.log_artifacts(str(work), "model")
        tracking.describe(descriptions.tiny_model_note(info, cfg))
    log.info("tiny model: %d parameters, vocab %d -> %s", n_params, info["vocab_size"], cfg.output_dir)
    return info
