"""Before any model loads: the prompts a stage is about to build are the ones its policy was trained on, and
they fit the model.

A policy trained on one prompt format and then sampled, trained further or evaluated on another is measured
on text it never saw, silently (a chat template, a system prompt or a schema style changed between stages).
So SFT and GRPO record the settings beside the policy they save (`slmsql_prompt.json`), every stage that
builds prompts logs its own as params (`prompt.*`, beside `prompt_style` and `example_values`), and filter,
GRPO, evaluate and a continued SFT compare theirs with the policy's record, refusing a difference unless
`--allow-prompt-change` (policy/resolve.py makes both checks). Then the prompts are counted (`token_budget`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from slmsql.errors import DataError, SlmsqlError
from slmsql.inputs.prompts import SYSTEM, answer_prefix, builder_for

log = logging.getLogger(__name__)
RECORD = "slmsql_prompt.json"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def settings(cfg, tokenizer) -> dict:
    """What decides the exact prompt text: style, example values, system prompt, schema source and the chat
    template (the long texts as short hashes)."""
    style = cfg.prompt_style
    values = {"prompt_style": style, "example_values": cfg.example_values if style == "omnisql" else 0,
              "system_prompt": _sha(SYSTEM) if style == "omnisql" else "none",
              "schema_source": "tables.json" if getattr(cfg, "tables_json", "") else "sqlite",
              "chat_template": _sha(tokenizer.chat_template or "")}
    if answer_prefix(cfg):  # evaluate's alone: a policy is trained on its whole answer, which a record says
        values["answer_prefix"] = answer_prefix(cfg)  # by having no answer_prefix
    return values


def params(values: dict) -> dict:
    """The settings that are not config fields already, as `prompt.<name>` params."""
    return {f"prompt.{k}": str(v) for k, v in values.items()
            if k not in ("prompt_style", "example_values", "answer_prefix")}


def record(folder, values: dict) -> None:
    from slmsql.inputs.data import write_json

    write_json(Path(folder) / RECORD, values)


def recorded(folder) -> dict | None:
    """The prompt settings recorded in a policy folder, None when it has none."""
    path = Path(str(folder)).expanduser() / RECORD
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise DataError(f"not valid JSON: {e}", path) from None


def check_trained_with(policy, mine: dict, allow: bool) -> None:
    """Refuse (unless `allow`) settings other than those recorded in policy folder `policy`, naming both."""
    trained = recorded(policy) if policy else None
    trained = trained and {"answer_prefix": "", **trained}
    differ = {k: (trained[k], v) for k, v in mine.items() if trained and k in trained and trained[k] != v}
    if not differ:
        return
    text = ", ".join(f"{k}: trained {a!r}, now {b!r}" for k, (a, b) in differ.items())
    if not allow:
        raise SlmsqlError(f"policy {policy} was trained on other prompts than this run would build ({text}). "
                          "Use the policy's prompt settings, or --allow-prompt-change to do this on purpose")
    log.warning("policy %s was trained on other prompts (%s): going on (--allow-prompt-change)", policy, text)


def token_budget(cfg, examples, tokenizer, *, new_tokens: int) -> dict:
    """The `tokens/*` metrics of the prompts a stage builds for `examples`; refuses any prompt that leaves fewer
    than `new_tokens` of the model's context (tokens.check_prompts)."""
    from slmsql.inputs import tokens
    from slmsql.inputs.data import db_path

    builder = builder_for(cfg)
    # a question whose database is missing is never prompted (the filter counts it as an error)
    prompted = [e for e in examples if db_path(cfg.db_root, e.db_id).is_file()]
    prompts = [builder.prompt(tokenizer, e) for e in prompted]
    return tokens.check_prompts(tokenizer, prompts, [e.id for e in prompted], model=cfg.model,
                                new_tokens=new_tokens, source=cfg.data)
