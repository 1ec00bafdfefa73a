"""GRPO changes the model, and the adapters it saves load as what was trained.

- a fresh LoRA: B matrices leave zero, grad_norm > 0, logits move (`learning.assert_learned`);
- `--base-adapter` on an SFT LoRA, both modes: continue trains the SFT adapter's own tensors; stack merges it and
  trains a new LoRA on top. Reloading either as evaluate and filter load it (`models.load_model`), from the
  output folder, the run's MLflow artifact (what publish pushes) or a Hub repo, gives the trained model's logits;
  nested stacks and a stack trained further load with everything beneath them;
- `filter --adapter` with the stacked adapter.
All runs share one MLflow store (creating a store costs seconds) and train 2 steps.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlflow
import pytest
import scripted
import torch
from click.testing import CliRunner
from learning import adapter_weights, assert_learned, logits, prompt_for
from policy import policy_fixture, read, tracking_store, write  # noqa: F401  (the fixture)

from slmsql import configs
from slmsql.policy import models
from slmsql.cli import main as cli
from slmsql.errors import SlmsqlError
from slmsql.stages import grpo, sft

STEPS = 2


def test_a_stack_records_what_it_was_trained_on_and_refuses_to_load_without_it(tmp_path):
    """The fast part of this module, on adapter files alone (no model): stack mode copies the adapter beneath into
    base_adapter/, a stack trained further keeps it, and a stack whose copy went missing is refused."""
    sft_a, stack, again = (tmp_path / n for n in ("sft", "stack", "again"))
    for folder in (sft_a, stack, again):
        folder.mkdir()
    (sft_a / "adapter_config.json").write_text("{}")
    (sft_a / "adapter_model.safetensors").write_bytes(b"sft weights")
    models.record_stack(stack, sft_a, merged=True)
    assert models.stacked_on(stack) == stack / models.STACK_BASE
    assert (stack / models.STACK_BASE / "adapter_model.safetensors").read_bytes() == b"sft weights"
    models.record_stack(again, stack, merged=False)  # continue on a stack: still on top of the SFT adapter
    assert json.loads((again / models.STACK_RECORD).read_text())["base_adapter"] == str(sft_a)
    assert (again / models.STACK_BASE / "adapter_model.safetensors").read_bytes() == b"sft weights"
    assert models.stacked_on(sft_a) is None  # a plain adapter
    shutil.rmtree(stack / models.STACK_BASE)
    with pytest.raises(SlmsqlError, match=r"trained on top of adapter '.*sft'.*base_adapter/ is missing"):
        models.stacked_on(stack)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("learns")
    return root, f"sqlite:///{root}/mlflow.db"


def grpo_cfg(policy, out, **over):
    data = write(Path(out).with_name("band.jsonl"),
                 [{**r, "pass_rate": 0.5, "k": 4, "n_correct": 2} for r in read(policy.train)[:8]])
    return configs.load(configs.GRPOStageConfig, None, {
        "data": str(data), "db_root": str(policy.db_root), "model": str(policy.model), "output_dir": str(out),
        "run_name": Path(out).name, "num_generations": 4, "per_device_train_batch_size": 8,
        "max_completion_length": 40, "max_steps": STEPS, "save_steps": 100, "completions_every": 100,
        "workers": 1, "timeout_s": 2.0, "lora_r": 4, "lora_alpha": 8, **over})


def trained(store, cfg):
    """Run grpo.main in the module's store; returns (run id, the trained model's logits on the fixed prompt).
    The logits come from the trainer's own model object, before anything is saved or reloaded."""
    import trl

    uri = store[1]
    seen = []

    class Recorded(trl.GRPOTrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen.append(self)

    # every group holds one right completion and three wrong ones (scripted, not hoped for from the sampler):
    # the rewards vary in every group, so the advantages, and the gradient, are non-zero
    find = scripted.question_of(read(cfg.data))
    with tracking_store(uri), pytest.MonkeyPatch.context() as m:
        m.setattr(trl, "GRPOTrainer", Recorded)
        scripted.install(m, cfg.model, lambda p, i: scripted.right(find(p)) if i == 0 else scripted.WRONG, group=4)
        grpo.main(cfg)
    (trainer,) = seen
    model = trainer.model.eval()
    tokenizer = trainer.processing_class
    prompt = prompt_for(cfg)
    with torch.no_grad():
        out = model(**tokenizer(prompt, return_tensors="pt")).logits[0, -1]
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(cfg.experiment).experiment_id],
                                f"attributes.run_name = '{cfg.run_name}'")
    return run.info.run_id, out


# How close "the same model" is, loaded another way: merging an adapter into the base's weights (stack mode, a
# stacked load) rounds each merged weight once, which moves the logits by about 3e-6 here, by more on other
# float paths and thread counts. 1e-4 holds that noise with a wide margin and stays 10x below what these tests
# show a missing layer moves (each check below pairs with a `not allclose(..., atol=1e-3)`), so it still fails.
SAME = 1e-4


def reloads_as_trained(cfg, trained_logits, adapter=None):
    """The saved adapter (default: the output folder's), loaded as evaluate loads it, computes what was trained."""
    again = logits(cfg.model, adapter or Path(cfg.output_dir) / "adapter", prompt_for(cfg))
    return torch.allclose(again, trained_logits, atol=SAME), float((again - trained_logits).abs().max())


# ---- a fresh LoRA ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fresh(policy, store):
    cfg = grpo_cfg(policy, store[0] / "fresh")
    return (cfg, *trained(store, cfg))


def test_grpo_learns(fresh, store):
    cfg, run_id, trained_logits = fresh
    figures = assert_learned(cfg.output_dir, run_id, cfg.model, prompt_for(cfg), client=mlflow.MlflowClient(store[1]))
    assert len(figures["grad_norms"]) == STEPS
    ok, diff = reloads_as_trained(cfg, trained_logits)
    assert ok, f"the reloaded adapter's logits differ from the trained model's by {diff}"


def test_the_check_fails_on_an_adapter_that_did_not_move(fresh, store, tmp_path):
    """What a run whose optimizer never moved the weights leaves: B still zero, logits those of the base."""
    from safetensors.torch import save_file

    cfg, run_id, _ = fresh
    still = tmp_path / "still"
    shutil.copytree(Path(cfg.output_dir) / "adapter", still / "adapter")
    weights = adapter_weights(still / "adapter")
    save_file({k: torch.zeros_like(v) if "lora_B" in k else v for k, v in weights.items()},
              still / "adapter" / "adapter_model.safetensors")
    with pytest.raises(AssertionError, match="the adapter did not change"):
        assert_learned(still, run_id, cfg.model, prompt_for(cfg), client=mlflow.MlflowClient(store[1]))


# ---- --base-adapter, both modes -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sft_lora(policy, store):
    """An SFT LoRA on the fixture policy: 2 steps of `slmsql sft --use-lora true`."""
    root, uri = store
    cfg = configs.load(configs.SFTStageConfig, None, {
        "data": str(policy.train), "db_root": str(policy.db_root), "model": str(policy.model),
        "output_dir": str(root / "sft-lora"), "run_name": "sft-lora", "use_lora": True, "lora_r": 4,
        "lora_alpha": 8, "max_steps": 2, "per_device_train_batch_size": 8, "learning_rate": 1e-2})
    with tracking_store(uri):
        sft.main(cfg)
    return root / "sft-lora"


@pytest.fixture(scope="module")
def continued(policy, store, sft_lora):
    cfg = grpo_cfg(policy, store[0] / "continued", base_adapter=str(sft_lora), adapter_mode="continue")
    return (cfg, *trained(store, cfg))


@pytest.fixture(scope="module")
def stacked(policy, store, sft_lora):
    cfg = grpo_cfg(policy, store[0] / "stacked", base_adapter=str(sft_lora), adapter_mode="stack")
    return (cfg, *trained(store, cfg))


def test_continue_trains_the_sft_adapter_further(continued, sft_lora, store):
    cfg, run_id, trained_logits = continued
    figures = assert_learned(cfg.output_dir, run_id, cfg.model, prompt_for(cfg), start=sft_lora,
                             continued=True, client=mlflow.MlflowClient(store[1]))  # same keys, changed tensors
    assert figures["weight_change"] > 0
    ok, diff = reloads_as_trained(cfg, trained_logits)
    assert ok, f"the reloaded adapter's logits differ from the trained model's by {diff}"


def test_stack_trains_a_new_lora_on_the_merged_sft_adapter(stacked, sft_lora, store):
    cfg, run_id, _ = stacked
    # a new LoRA (B left zero), and a model other than the merged SFT policy it started from
    assert_learned(cfg.output_dir, run_id, cfg.model, prompt_for(cfg), start=sft_lora,
                   client=mlflow.MlflowClient(store[1]))


def test_stacked_adapter_reloads_with_the_sft_change(stacked, sft_lora, store, tmp_path):
    """The bug this guards: the stacked LoRA records the plain base model, so `evaluate --model BASE
    --adapter OUT/adapter` passed the base check and evaluated without the merged SFT adapter."""
    cfg, run_id, trained_logits = stacked
    adapter = Path(cfg.output_dir) / "adapter"
    # what PEFT records is the plain base, so the base check alone cannot tell: the stack record can
    recorded = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(recorded).resolve() == Path(cfg.model).resolve()
    assert json.loads((adapter / models.STACK_RECORD).read_text())["base_adapter"] == str(sft_lora)
    ok, diff = reloads_as_trained(cfg, trained_logits)
    assert ok, f"loading the stacked adapter does not give the trained model (max logit difference {diff})"
    # the same from the run's MLflow artifact: what publish downloads and pushes
    local = mlflow.MlflowClient(store[1]).download_artifacts(run_id, "adapter", str(tmp_path))
    assert reloads_as_trained(cfg, trained_logits, local)[0]
    # the SFT change matters: without it the logits are another model's (so the checks above can fail)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bare = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(cfg.model), local).eval()
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    with torch.no_grad():
        without = bare(**tokenizer(prompt_for(cfg), return_tensors="pt")).logits[0, -1]
    assert not torch.allclose(without, trained_logits, atol=1e-3)


def test_stacked_adapter_without_its_base_adapter_is_refused(stacked, tmp_path):
    cfg, _, _ = stacked
    moved = tmp_path / "moved"
    shutil.copytree(Path(cfg.output_dir) / "adapter", moved)
    shutil.rmtree(moved / models.STACK_BASE)
    with pytest.raises(SlmsqlError, match=r"trained on top of .*merged into the base.* missing"):
        models.check_adapter_base(moved, cfg.model)
    with pytest.raises(SlmsqlError, match=r"missing"):
        models.load_model(cfg.model, moved)


def test_filter_with_the_stacked_adapter(stacked, policy, store):
    cfg, _, _ = stacked
    root, uri = store
    data = write(root / "filter-source.jsonl", read(policy.train)[:4])
    out = root / "filtered"
    with tracking_store(uri), pytest.MonkeyPatch.context() as mp:
        # the stacked adapter samples the others; one question pinned to 1 of 2 right, so the band is not empty
        # (--min-band 1: it may be all the band holds)
        rows = read(data)
        scripted.pin(mp, completions={rows[0]["id"]: [scripted.right(rows[0]), scripted.WRONG]})
        result = CliRunner().invoke(cli, [
            "filter", "--data", str(data), "--db-root", str(policy.db_root), "--model", cfg.model,
            "--adapter", str(Path(cfg.output_dir) / "adapter"), "--output-dir", str(out), "--k", "2",
            "--max-new-tokens", "24", "--workers", "1", "--timeout-s", "2", "--run-name", "filter-stacked",
            "--min-band", "1"])
    assert result.exit_code == 0, result.output
    rates = read(out / "passrates.jsonl")
    assert [r["id"] for r in rates] == [r["id"] for r in rows] and all(len(r["statuses"]) == 2 for r in rates)
    assert rows[0]["id"] in {r["id"] for r in read(out / "band.jsonl")}
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id],
                                "attributes.run_name = 'filter-stacked'")
    assert run.info.status == "FINISHED"
    assert run.data.tags["slmsql.adapter"] == str(Path(cfg.output_dir) / "adapter")


def test_stacked_adapter_pushed_to_the_hub_loads_by_repo_id(stacked, monkeypatch):
    """What publish pushes is the artifact folder; `--adapter OWNER/NAME` then finds base_adapter/ on the Hub."""
    from hubstub import HubStub
    from huggingface_hub import HfApi, hf_api

    cfg, _, trained_logits = stacked
    with HubStub(lfs_threshold=1024) as stub:
        stub.configure_client(monkeypatch)
        # PEFT asks huggingface_hub's module-level client, made at import with the real endpoint
        monkeypatch.setattr(hf_api.api, "endpoint", stub.url)
        api = HfApi(token=stub.token)
        api.create_repo("stub-user/stacked")
        api.upload_folder(folder_path=str(Path(cfg.output_dir) / "adapter"), repo_id="stub-user/stacked")
        assert f"{models.STACK_BASE}/adapter_model.safetensors" in stub.files("stub-user/stacked")
        ok, diff = reloads_as_trained(cfg, trained_logits, "stub-user/stacked")
    assert ok, f"the stacked adapter loaded from the Hub is not the trained model (max logit difference {diff})"


def test_stacks_nest_and_a_continued_stack_keeps_its_base(policy, tmp_path):
    """No training: random LoRAs on the tiny base. A LoRA stacked on a stacked one loads with both merged beneath
    it, innermost first; a stacked adapter trained further (continue) keeps what it was stacked on."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    def base():
        return AutoModelForCausalLM.from_pretrained(policy.tiny)

    def lora(model, name, seed):  # B random, not zero: each adapter changes the logits
        torch.manual_seed(seed)
        config = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        get_peft_model(model, config).save_pretrained(tmp_path / name)
        return tmp_path / name

    def merged(model, *adapters):
        for a in adapters:
            model = PeftModel.from_pretrained(model, a).merge_and_unload()
        return model

    sft_a = lora(base(), "sft", 1)
    stack_s = lora(merged(base(), sft_a), "stack", 2)
    models.record_stack(stack_s, sft_a, merged=True)
    stack_s2 = lora(merged(base(), sft_a, stack_s), "stack2", 3)
    models.record_stack(stack_s2, stack_s, merged=True)
    shutil.copytree(stack_s, tmp_path / "continued", ignore=shutil.ignore_patterns(models.STACK_BASE, "*.json"))
    PeftModel.from_pretrained(merged(base(), sft_a), stack_s).save_pretrained(tmp_path / "continued")
    models.record_stack(tmp_path / "continued", stack_s, merged=False)

    tokens = {"input_ids": torch.tensor([[5, 17, 42, 7]])}
    with torch.no_grad():
        want_s2 = PeftModel.from_pretrained(merged(base(), sft_a, stack_s), stack_s2).eval()(**tokens).logits
        want_s = PeftModel.from_pretrained(merged(base(), sft_a), stack_s).eval()(**tokens).logits
        got = {name: models.load_model(policy.tiny, tmp_path / name, device="cpu", dtype="float32")[0](**tokens).logits
               for name in ("stack2", "continued")}
    assert torch.allclose(got["stack2"], want_s2, atol=SAME)
    assert torch.allclose(got["continued"], want_s, atol=SAME)
    assert not torch.allclose(want_s2, want_s, atol=1e-3)  # the layers differ, so the checks above can fail
    assert (tmp_path / "stack2" / models.STACK_BASE / models.STACK_BASE / "adapter_model.safetensors").is_file()
