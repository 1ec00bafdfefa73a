"""Evaluation and the filter with each schema computed once (generation/shared_schema.py, issue 57 item 3): the
questions of a call grouped by their prompts' common token prefix, the prefix's cache computed once per group, each
question generated from a copy of it. The same computation as the plain path in another float order, so greedy
answers and seeded samples agree but where the model was undecided (tests/neartie.py), and each group's prefix is
forwarded exactly once (prefill tokens counted). The tiny model here (fast); SmolLM2 and Qwen2.5-Coder-0.5B on the
toy world's schemas (slow, skipped when not in the cache but under CI); evaluate through the CLI once."""

from __future__ import annotations

import sys

import pytest
import schemas
import watched
from ci_env import in_ci
from neartie import DrawMargins, assert_greedy_same_but_near_ties, assert_samples_same_but_near_ties
from schemas import QUESTIONS

from slmsql.configs import EvaluateConfig
from slmsql.generation import shared_schema
from slmsql.generation.sampling import generate
from slmsql.inputs.data import read_jsonl
from slmsql.inputs.prompts import PromptBuilder, render_prompt
from slmsql.policy.models import load_model


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Three databases, questions on them as gold JSONL, and a tiny untrained model (tests/schemas.py)."""
    return schemas.build(tmp_path_factory.mktemp("schemas"))


@pytest.fixture(scope="module")
def prompts(world):
    root, folder = world
    model, tok = load_model(folder, device="cpu")
    builder = PromptBuilder(root / "dbs", example_values=0, style="compact")
    rendered = [render_prompt(tok, builder.chat(q, builder.schema(db))) for db, q in QUESTIONS]
    return model, tok, rendered


def test_groups_share_the_longest_common_prefix_and_batches_stay_full():
    a, b = [1, 2, 3, 4, 5, 9], [1, 2, 3, 4, 6]
    c, d = [7, 8, 9, 10, 11], [7, 8, 9, 10, 12, 13]
    alone = [1, 20, 21, 22]  # shares one token with a and b: joining them would share 1 token, not 4
    tokens = [a, c, alone, b, d]
    assert sorted(shared_schema.groups(tokens)) == [(0, [2]), (4, [0, 3]), (4, [1, 4])]
    # a prompt that is the other's prefix: the shared part stops one token short, so each row has a token to feed
    assert shared_schema.groups([[1, 2, 3], [1, 2, 3, 4]]) == [(2, [0, 1])]
    assert shared_schema.groups([[5, 6], [5, 6]]) == [(1, [0, 1])]
    batches = shared_schema.plan(tokens, 2)
    assert [len(x) for x in batches] == [2, 2, 1]  # cut across groups, as full as the plain path's
    assert batches[0][0] == (2, 0)  # the longest rest first: the prompt that shares nothing (4 tokens)
    assert {i for batch in batches for i, _ in batch} == set(range(5))


def test_greedy_answers_are_the_plain_paths_but_at_near_ties(prompts):
    model, tok, rendered = prompts
    kw = dict(max_new_tokens=12, batch_size=4, progress=False)
    plain = generate(model, tok, rendered, shared_schema=False, **kw)
    shared = generate(model, tok, rendered, **kw)
    assert_greedy_same_but_near_ties(model, tok, rendered, shared, plain, 12)
    assert all(len(x) == 1 and x[0] for x in shared)
    assert shared == generate(model, tok, rendered, **kw)  # the same path twice: the same answers


def _expected_tokens(tok, rendered, batch_size):
    tokens = tok(rendered, add_special_tokens=False)["input_ids"]
    groups = shared_schema.groups(tokens)
    return (sum(share for share, _ in groups) + sum(len(tokens[i]) - share for share, m in groups for i in m),
            sum(map(len, tokens)), groups)


def test_each_groups_prefix_is_computed_once(prompts):
    """Prefill tokens counted on the model's forwards: each group's prefix once (batch size 2 spreads a group over
    several batches, which copy its cache), each question's rest once; the plain path computes every prompt whole."""
    model, tok, rendered = prompts
    shared_total, plain_total, groups = _expected_tokens(tok, rendered, 2)
    assert sorted(len(m) for s, m in groups if s) == [3, 5] and [m for s, m in groups if not s] == [[8]]
    with shared_schema.counting_prefill(model) as shared:
        generate(model, tok, rendered, max_new_tokens=4, batch_size=2, progress=False)
    with shared_schema.counting_prefill(model) as plain:
        generate(model, tok, rendered, max_new_tokens=4, batch_size=2, progress=False, shared_schema=False)
    assert shared["tokens"] == shared_total and plain["tokens"] == plain_total
    assert shared_total < 0.7 * plain_total  # 6 of the 9 questions computed without their schema


def test_the_filters_samples_are_the_plain_paths_and_each_prompt_is_computed_once(prompts, monkeypatch):
    """K samples a question under a seed: the same completions (but where a draw fell at a near-tie), and the K rows
    of a question computed once: the prefill tokens are greedy's (but each row's last prompt token), not K times its
    rest."""
    model, tok, rendered = prompts
    keys = [f"q{i}" for i in range(len(rendered))]
    kw = dict(num_return_sequences=3, temperature=1.0, max_new_tokens=8, batch_size=4, seed=11, keys=keys,
              progress=False)
    draws = DrawMargins(monkeypatch)
    with shared_schema.counting_prefill(model) as counted:
        shared = generate(model, tok, rendered, **kw)
    plain = generate(model, tok, rendered, shared_schema=False, **kw)
    assert_samples_same_but_near_ties(draws, 11, keys, shared, plain)
    # greedy's tokens, and the last prompt token once more for each further sample (each row's first decode input)
    assert counted["tokens"] == _expected_tokens(tok, rendered, 4)[0] + len(rendered) * 2
    assert any(len(set(x)) > 1 for x in shared)  # it does sample


def test_a_model_that_numbers_columns_takes_the_plain_path(prompts, monkeypatch):
    """The layout needs position ids (padding sits between prefix and rest): a model whose forward takes none, or
    with windowed layers, is never given it."""
    model, _, _ = prompts
    assert shared_schema.supported(model)
    monkeypatch.setattr(shared_schema.shared_prefix, "partial_attention", lambda m: "sliding window")
    assert not shared_schema.supported(model)


@pytest.mark.slow  # seconds of new processes or whole builds: outside the fast tier (issue 55)
def test_evaluate_through_the_cli_with_and_without_it(world, tmp_path):
    """`slmsql evaluate --shared-schema false` in a new process, and the default in this one: the same predictions
    but at near-ties, and the option is the run's parameter."""
    import mlflow

    from slmsql.stages import evaluate

    root, folder = world
    common = ["--model", str(folder), "--data", str(root / "gold.jsonl"), "--db-root", str(root / "dbs"),
              "--max-new-tokens", "8", "--batch-size", "4", "--workers", "1"]
    proc = watched.run([sys.executable, "-m", "slmsql.cli", "evaluate", *common, "--shared-schema", "false",
                        "--output-dir", str(tmp_path / "plain")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    evaluate.main(EvaluateConfig(model=str(folder), data=str(root / "gold.jsonl"), db_root=str(root / "dbs"),
                                 max_new_tokens=8, batch_size=4, workers=1, output_dir=str(tmp_path / "shared")))
    plain, shared = (read_jsonl(tmp_path / d / "predictions.jsonl") for d in ("plain", "shared"))
    model, tok = load_model(folder, device="cpu")
    builder = PromptBuilder(root / "dbs", example_values=0, style="compact")
    rendered = [render_prompt(tok, builder.chat(q, builder.schema(db))) for db, q in QUESTIONS]
    assert [p["id"] for p in plain] == [p["id"] for p in shared]
    assert_greedy_same_but_near_ties(model, tok, rendered, [p["completion"] for p in shared],
                                     [p["completion"] for p in plain], 8)
    runs = mlflow.search_runs(search_all_experiments=True)
    assert sorted(runs["params.shared_schema"]) == ["false", "true"]


# ---- real models, on the toy world's schemas (slow) ---------------------------------------------------------

def _in_cache(model: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(model, "config.json"), str)


@pytest.mark.slow
@pytest.mark.parametrize("model_id, make", [("HuggingFaceTB/SmolLM2-135M-Instruct", "make smollm2"),
                                            ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "make qwen-coder")])
def test_real_models_answer_the_same_with_each_schema_computed_once(model_id, make, tmp_path):
    """OmniSQL prompts (example values) on two toy databases, 3 questions each, greedy: the plain path's answers but
    at near-ties, with each schema computed once."""
    from slmsql.inputs.data import read_gold
    from slmsql.toy.world import generate as make_toy

    if not _in_cache(model_id):
        if in_ci():
            pytest.fail(f"{model_id} is not in the Hugging Face cache; under CI this test must run (`{make}`)")
        pytest.skip(f"{model_id} is not in the Hugging Face cache: run `{make}`")
    make_toy(tmp_path / "toy", seed=0, size="small")
    dev = read_gold(tmp_path / "toy" / "dev.jsonl")
    dbs = list(dict.fromkeys(e.db_id for e in dev))[:2]
    examples = [e for db in dbs for e in [x for x in dev if x.db_id == db][:3]]
    model, tok = load_model(model_id, device="cpu")
    builder = PromptBuilder(tmp_path / "toy" / "databases", example_values=3, style="omnisql")
    rendered = [render_prompt(tok, builder.messages(e)) for e in examples]
    kw = dict(max_new_tokens=24, batch_size=6, progress=False)
    with shared_schema.counting_prefill(model) as counted:
        shared = generate(model, tok, rendered, **kw)
    plain = generate(model, tok, rendered, shared_schema=False, **kw)
    assert_greedy_same_but_near_ties(model, tok, rendered, shared, plain, 24)
    assert counted["tokens"] == _expected_tokens(tok, rendered, 6)[0]
    assert len([s for s, _ in shared_schema.groups(tok(rendered, add_special_tokens=False)["input_ids"]) if s]) == 2
