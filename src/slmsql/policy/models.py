"""Load a causal LM (Hub id or local path, optional PEFT adapter), its tokenizer, and adapter stacks.

Adapter/base matching rule (`check_adapter_base`): the adapter's `adapter_config.json` records
`base_model_name_or_path`. Each side is expanded into the names it is known by, lower-cased, trailing `/`
dropped: the string itself (and, for a fetched run artifact, its run URI: `runs:/<id>/policy`, as adapters
record their base); for an existing local directory also its real path, the `_name_or_path` /
`name_or_path` in its `config.json` when present, and `org/name` when it is a Hub cache snapshot
(`.../models--org--name/snapshots/...`). The two match when those sets share a name. Otherwise, unless both
sides are existing local directories (two different local checkpoints), the last path component decides, so
`/models/Qwen2.5-Coder-1.5B-Instruct` matches `Qwen/Qwen2.5-Coder-1.5B-Instruct`. A missing
`base_model_name_or_path` cannot be checked and is let through with a warning.

Stacked adapters (`grpo --adapter-mode stack`): such a LoRA was trained on the base model with another adapter
merged in, yet records the plain base (PEFT's base_model_name_or_path), so loading it on that base alone would
silently drop the merged adapter. Its folder therefore holds `slmsql_stack.json` and a copy of the merged
adapter in `base_adapter/` (a stacked one itself, recursively, when it was stacked). `load_model` merges
`base_adapter/` into the base before applying the adapter, wherever the folder came from (the output folder, the
MLflow artifact, a Hub repo); `check_adapter_base` checks it against the model too, and refuses a stacked
adapter whose `base_adapter/` is missing.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path, PurePosixPath

import torch

from slmsql.checks.promptcheck import RECORD as PROMPT_RECORD
from slmsql.errors import SlmsqlError
from slmsql.inputs.data import write_json
from slmsql.inputs.sources import is_path, snapshot_id

log = logging.getLogger(__name__)



def _norm(name: str) -> str:
    return str(name).strip().rstrip("/").lower()


def _names(name: str) -> tuple[set[str], bool]:
    """The names a model is known by (see the module docstring) and whether it is a local directory."""
    from slmsql.tracking.runs import param_value

    path = Path(name).expanduser()
    names = {_norm(name), _norm(param_value(name))}  # a fetched run artifact is also its run URI (runs:/<id>/policy)
    local = path.is_dir()
    if local:
        names.add(_norm(path.resolve()))
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
        names |= {_norm(config[k]) for k in ("_name_or_path", "name_or_path") if config.get(k)}
    names |= {snap for n in names if (snap := snapshot_id(n))}
    return names, local


def _adapter_config(adapter: str) -> dict:
    path = Path(adapter).expanduser()
    if path.is_dir():
        file = path / "adapter_config.json"
        if not file.is_file():
            raise SlmsqlError(f"adapter '{adapter}': no adapter_config.json in that directory (not a PEFT adapter)")
        try:
            return json.loads(file.read_text())
        except ValueError as e:
            raise SlmsqlError(f"adapter '{adapter}': adapter_config.json is not valid JSON: {e}") from e
    if is_path(adapter):
        raise SlmsqlError(f"adapter '{adapter}': directory not found")
    from peft import PeftConfig

    try:
        return PeftConfig.from_pretrained(adapter).to_dict()
    except Exception as e:  # peft raises ValueError/OSError/HTTP errors depending on what went wrong
        raise SlmsqlError(f"adapter '{adapter}': not a local directory and not loadable from the Hub ({e})") from e


STACK_RECORD = "slmsql_stack.json"  # in a stacked adapter's folder: what it was trained on top of
STACK_BASE = "base_adapter"  # the subfolder holding that adapter, merged into the base before this one applies
# what a policy's adapter folder holds, downloaded from a Hub repo and copied into a stack: the PEFT files, the
# stack record and the prompt settings it was trained on (promptcheck)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", STACK_RECORD, PROMPT_RECORD)


def _hub_files(repo: str, patterns: list[str]) -> Path:
    """The files of Hub repo `repo` matching `patterns`, downloaded (a folder; empty when none match)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, allow_patterns=patterns))
    except Exception as e:  # HTTP, offline or not-found errors depending on what went wrong
        raise SlmsqlError(f"adapter '{repo}': cannot download its files from the Hub ({e})") from e


def stacked_on(adapter: str | os.PathLike) -> Path | None:
    """The local folder of the adapter that `adapter` was stacked on (see the module docstring), or None."""
    path = Path(adapter).expanduser()
    if not path.is_dir():
        if is_path(str(adapter)):
            return None  # _adapter_config reports the missing folder
        path = _hub_files(str(adapter), [STACK_RECORD, f"{STACK_BASE}/*"])
    record = path / STACK_RECORD
    if not record.is_file():
        return None
    base = path / STACK_BASE
    if not (base / "adapter_config.json").is_file():
        on = json.loads(record.read_text()).get("base_adapter", "?")
        raise SlmsqlError(f"adapter '{adapter}' was trained on top of adapter '{on}' (merged into the base model), "
                          f"but its copy {STACK_BASE}/ is missing from the adapter folder: without it the adapter "
                          "would load without that change. Keep the whole folder together")
    return base


def record_stack(folder: str | os.PathLike, base_adapter: str | os.PathLike, merged: bool) -> None:
    """Make the adapter just saved in `folder` load as trained (see the module docstring). `merged`: it was trained
    on the base with `base_adapter` merged in (stack mode); else it is `base_adapter` trained further (continue),
    which stays on whatever `base_adapter` was stacked on."""
    import shutil

    if merged:
        beneath, on = adapter_folder(base_adapter), str(base_adapter)
    else:
        beneath = stacked_on(base_adapter)
        if beneath is None:
            return  # a plain adapter trained further: nothing lies beneath it
        on = json.loads((beneath.parent / STACK_RECORD).read_text())["base_adapter"]
    copy = Path(folder) / STACK_BASE
    copy.mkdir(parents=True, exist_ok=True)
    for name in ADAPTER_FILES:
        if (beneath / name).is_file():
            shutil.copy2(beneath / name, copy / name)
    if (beneath / STACK_BASE).is_dir():
        shutil.copytree(beneath / STACK_BASE, copy / STACK_BASE, dirs_exist_ok=True)
    if not (copy / "adapter_config.json").is_file():
        raise SlmsqlError(f"adapter '{base_adapter}': no adapter_config.json to copy into {copy}")
    from slmsql.tracking.runs import portable

    write_json(Path(folder) / STACK_RECORD, {
        "base_adapter": portable(on), "copy": STACK_BASE,
        "note": f"trained on the base model with {STACK_BASE}/ merged in: merge it before applying this adapter"})


def adapter_folder(adapter: str | os.PathLike) -> Path:
    """A local folder holding `adapter`'s files: the folder itself, or those files downloaded from the Hub."""
    path = Path(adapter).expanduser()
    if path.is_dir() or is_path(str(adapter)):
        return path
    return _hub_files(str(adapter), [*ADAPTER_FILES, f"{STACK_BASE}/*"])


def policy_folder(model: str, adapter: str | None = None) -> Path | None:
    """Where a policy's records lie: its adapter's folder (downloaded when a Hub id), else the model's folder
    when it is local (a Hub model is a base: nothing trained it here)."""
    if adapter:
        return adapter_folder(adapter)
    path = Path(str(model)).expanduser()
    return path if path.is_dir() else None


def check_adapter_base(adapter: str | os.PathLike, model: str | os.PathLike) -> None:
    """Raise SlmsqlError if `adapter` is missing, was trained on a base other than `model`, or was stacked on an
    adapter it no longer carries (see the module docstring). Loads no weights."""
    adapter, model = str(adapter), str(model)
    _check_one_base(adapter, model)
    if beneath := stacked_on(adapter):
        check_adapter_base(beneath, model)


def _check_one_base(adapter: str, model: str) -> None:
    base = _adapter_config(adapter).get("base_model_name_or_path")
    if not base:
        log.warning("adapter %s records no base_model_name_or_path; cannot check it matches %s", adapter, model)
        return
    (a_names, a_local), (m_names, m_local) = _names(base), _names(model)
    if a_names & m_names:
        return
    basenames = [{PurePosixPath(n).name for n in names} for names in (a_names, m_names)]
    if not (a_local and m_local) and basenames[0] & basenames[1]:
        return
    raise SlmsqlError(
        f"adapter '{adapter}' was trained on base model '{base}', not on '{model}'; "
        f"load it with model '{base}' (names are compared case-insensitively, by last path component "
        "unless both are local directories)"
    )


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # bf16 halves memory and is what the GPU kernels are fast at; CPU bf16 matmuls are slow and lossy, and a
        # GPU without bf16 would emulate it: fp16 (which can overflow) only when asked for.
        cuda = device.type == "cuda"
        return torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32
    value = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, str(dtype)), None)
    if not isinstance(value, torch.dtype):
        raise SlmsqlError(f"unknown dtype '{dtype}' (use auto, bfloat16, float16 or float32)")
    if value == torch.float16 and device.type == "cpu":
        raise SlmsqlError("dtype float16 needs a GPU (mixed-precision fp16 does not run on a CPU): use auto, "
                          "float32 or bfloat16")
    return value


def dtype_name(dtype: str | torch.dtype = "auto", device: str | torch.device = "auto") -> str:
    """The precision `dtype` resolves to on `device`, by name (float32, bfloat16, float16); refused as in
    resolve_dtype. Cheap: what stages check before loading a model and log as the slmsql.dtype tag."""
    return str(resolve_dtype(dtype, resolve_device(device))).removeprefix("torch.")


def load_tokenizer(model: str | os.PathLike):
    """The model's tokenizer, after the cheap checks that fail fast on a bad path or id before any weights are
    read (also what a Ray driver checks before its actors load the weights)."""
    from transformers import AutoConfig, AutoTokenizer

    model = str(model)
    if not Path(model).expanduser().is_dir() and is_path(model):
        raise SlmsqlError(f"model '{model}': directory not found")
    try:
        AutoConfig.from_pretrained(model)
        tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise SlmsqlError(
            f"model '{model}': not a local model directory and not loadable from the Hugging Face Hub ({e})"
        ) from e
    if tokenizer.chat_template is None:
        raise SlmsqlError(f"model '{model}': its tokenizer has no chat template (an instruct/chat model is needed)")
    return tokenizer


def end_of_turn_id(tokenizer) -> int | None:
    """The special token the chat template closes an assistant turn with (<|im_end|>, <|eot_id|>,
    <end_of_turn>...), found by rendering one: a model may end its answer with it although neither its eos nor
    its generation config names it. None when the turn ends in ordinary text or the template will not render."""
    mark = "\u2063slmsql\u2063"  # a string no template adds
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": mark}],
                                             tokenize=False)
    except Exception:  # templates raise their own errors on conversations they do not accept (jinja, ValueError)
        return None
    after = text.split(mark, 1)[1] if mark in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    if not ids:
        return None
    added = tokenizer.added_tokens_decoder.get(ids[0])  # special tokens a template uses are often only "added"
    return ids[0] if ids[0] in tokenizer.all_special_ids or getattr(added, "special", False) else None


def stop_ids(generation_config, tokenizer) -> list[int]:
    """Every token that ends an answer: the generation config's eos ids, the tokenizer's eos and the chat
    template's end-of-turn token. Generation (generation/sampling.py) and TRL's rollouts both read the generation
    config."""
    ids = generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    for extra in (tokenizer.eos_token_id, end_of_turn_id(tokenizer)):
        if extra is not None and extra not in ids:
            ids.append(extra)
    return ids


def load_model(
    model: str | os.PathLike,
    adapter: str | os.PathLike | None = None,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    trainable: bool = False,
    merge_adapter: bool = False,
):
    """Return (model, tokenizer) for a Hub id or local path, with an optional PEFT adapter on top.

    The tokenizer pads on the left (generation) and falls back to eos as pad token; it must carry a chat
    template. The generation config stops at every id of `stop_ids`. `trainable=False` gives an eval-mode model with
    frozen weights; `merge_adapter` folds the adapter into the base weights (inference only).
    """
    from transformers import AutoModelForCausalLM

    model = str(model)
    if merge_adapter and trainable:
        raise SlmsqlError("merge_adapter=True and trainable=True contradict: a merged adapter cannot be trained")
    if merge_adapter and adapter is None:
        raise SlmsqlError("merge_adapter=True needs an adapter")
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    tag_dtype(dtype)
    if adapter is not None:
        check_adapter_base(adapter, model)
    tokenizer = load_tokenizer(model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    try:
        lm = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, device_map=str(device))
    except (OSError, ValueError) as e:
        raise SlmsqlError(f"model '{model}': cannot load weights ({e})") from e
    if lm.generation_config.pad_token_id is None:
        lm.generation_config.pad_token_id = tokenizer.pad_token_id
    lm.generation_config.eos_token_id = stop_ids(lm.generation_config, tokenizer)
    if adapter is not None:
        from peft import PeftModel

        lm = _merge_stack(lm, adapter)
        lm = PeftModel.from_pretrained(lm, str(adapter), is_trainable=trainable)
        if merge_adapter:
            lm = lm.merge_and_unload()
    if trainable:
        lm.train()
    else:
        lm.eval()
        lm.requires_grad_(False)
    return lm, tokenizer


def tag_dtype(dtype: torch.dtype | str) -> None:
    """The resolved precision as the active MLflow run's slmsql.dtype tag (the stage's param says only 'auto')."""
    import mlflow

    if mlflow.active_run() is not None:
        mlflow.set_tag("slmsql.dtype", str(dtype).removeprefix("torch."))


def _merge_stack(lm, adapter):
    """`lm` with the adapter(s) `adapter` was stacked on merged in, innermost first (see the module docstring)."""
    from peft import PeftModel

    beneath = stacked_on(adapter)
    if beneath is None:
        return lm
    return PeftModel.from_pretrained(_merge_stack(lm, beneath), str(beneath)).merge_and_unload()
