"""A trained tiny policy for the stage tests: toy world -> tiny model -> the real `slmsql sft` stage, in seconds.

The toy defaults train 800 steps over 2,000 questions (minutes). Here the policy memorises ONE database
instead: 300 steps on the 47 sft questions of `hospital_031`, with a 2-layer, hidden-64 Qwen2 (as cheap per
step as the 1-layer, hidden-32 one: at this size a step is framework overhead). Measured on 2 cores with
K=4 at temperature 0.8: its pass rates on those questions spread over 0/4..4/4 (0, 3, 5, 18, 21 questions),
which is what filter (a band to keep) and GRPO (groups whose correctness varies) need; on questions it has
not seen it mostly writes well-formed ```sql blocks with wrong answers. A 1-layer hidden-32 model after
100 steps wrote ```sql blocks but never a correct answer, so the filter found no band and (rightly) failed.

Files (all gold format, under `Policy.root`):
    train.jsonl   the SFT data (hospital_031's 47 sft questions)
    source.jsonl  40 filter questions: 27 of the memorised ones (a pass-rate spread) + hospital_031's
                  13 rl_source questions (mostly all-fail)
    dev.jsonl     30 evaluation questions: 10 memorised, hospital_031's 2 dev questions, 18 other dev
                  questions, so that EX is neither 0 nor 1

Use the `policy` fixture (`from policy import policy_fixture` in a test module; session-scoped: built once
per test session, whichever module asks first).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

DB = "hospital_031"
SHAPE = dict(hidden=64, layers=2, heads=2, ffn=128)
SFT = dict(max_steps=300, per_device_train_batch_size=8, learning_rate=1e-2)


@dataclass(frozen=True)
class Policy:
    root: Path
    world: Path
    db_root: Path
    tiny: Path  # the untrained base model (tokenizer trained on the toy sft split)
    model: Path  # the SFT policy: a full model folder
    train: Path
    source: Path
    dev: Path
    tracking_uri: str  # the store holding the fixture's own tiny-model and sft runs
    sft_run_id: str


def read(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write(path, rows) -> Path:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Path(path)


def build(root: Path) -> Policy:
    import mlflow

    from slmsql import configs
    from slmsql.toy import world as toy
    from slmsql.stages import sft, tiny_model as tinymodel
    from slmsql.toy.tiny_model import build_tiny_model

    world, uri = root / "world", f"sqlite:///{root}/mlflow.db"
    toy.generate(world, seed=0, size="small")
    split = {s: read(world / f"{s}.jsonl") for s in ("sft", "rl_source", "dev")}
    train = [r for r in split["sft"] if r["db_id"] == DB]
    held_out = [r for r in split["rl_source"] if r["db_id"] == DB]
    dev_own = [r for r in split["dev"] if r["db_id"] == DB]
    dev_other = [r for r in split["dev"] if r["db_id"] != DB]
    paths = {"train": write(root / "train.jsonl", train),
             "source": write(root / "source.jsonl", train[:27] + held_out),
             "dev": write(root / "dev.jsonl", train[-10:] + dev_own + dev_other[:30 - 10 - len(dev_own)])}

    with tracking_store(uri):  # the fixture's runs never land in a test's (or the user's) store
        tcfg = configs.load(configs.TinyModelConfig, None, {"data": str(world)})
        build_tiny_model(root / "tiny", tinymodel.training_texts(tcfg), **SHAPE)
        cfg = configs.load(configs.SFTStageConfig, None, {
            "data": str(paths["train"]), "db_root": str(world / "databases"), "model": str(root / "tiny"),
            "output_dir": str(root / "policy"), "experiment": "fixture", **SFT})
        sft.main(cfg)
        run_id = mlflow.search_runs(experiment_names=["fixture"], output_format="list")[0].info.run_id
    return Policy(root, world, world / "databases", root / "tiny", root / "policy", tracking_uri=uri,
                  sft_run_id=run_id, **paths)


def foreign_adapter(root: Path) -> Path:
    """A LoRA adapter (untrained) on a different tiny base: the wrong adapter for every policy here."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from slmsql.toy.tiny_model import build_tiny_model

    base = build_tiny_model(root / "other-base", ["SELECT name FROM item WHERE price > 3"] * 8,
                            vocab_size=300, hidden=16, layers=1, heads=2, ffn=32)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=2, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.save_pretrained(root / "other-adapter")
    return root / "other-adapter"


_built: dict[str, Policy] = {}


@pytest.fixture(scope="session", name="policy")
def policy_fixture(tmp_path_factory) -> Policy:
    # Each test module imports this fixture, which pytest registers once per module: the module-level
    # cache makes the session share one build.
    if "policy" not in _built:
        _built["policy"] = build(tmp_path_factory.mktemp("policy"))
    return _built["policy"]


@contextlib.contextmanager
def tracking_store(uri: str):
    """Point MLflow (env and process-wide URI) at `uri` for a block: for fixtures wider than one test,
    which conftest's per-test store does not cover."""
    import mlflow

    old_uri, old_env = mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    mlflow.set_tracking_uri(uri)
    try:
        yield uri
    finally:
        if old_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old_env
        mlflow.set_tracking_uri(old_uri)
