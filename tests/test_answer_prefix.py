"""evaluate's `answer_prefix` (issue 57: a model whose answers explain before they query, measured with its answers
started as a query): the prompt ends with the answer's start, the completion scored is that start plus what the
model generated, a resumed run keeps the start once, a policy trained on its whole answer refuses it unless allowed,
publish refuses such a run, and the CLI logs it. The tiny model of tests/schemas.py (seconds)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import schemas
import watched

from slmsql.configs import EvaluateConfig
from slmsql.errors import SlmsqlError
from slmsql.generation.sampling import complete_prompts, generate, predict, prompts_for
from slmsql.inputs.data import read_gold, read_jsonl
from slmsql.inputs.prompts import PromptBuilder, render_prompt
from slmsql.policy.models import load_model

PREFIX = "```sql\nSELECT"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root, folder = schemas.build(tmp_path_factory.mktemp("prefix"))
    return SimpleNamespace(root=root, folder=folder, examples=read_gold(root / "gold.jsonl"),
                           policy=load_model(folder, device="cpu"))


def _cfg(world, **over) -> EvaluateConfig:
    return EvaluateConfig(model=str(world.folder), data=str(world.root / "gold.jsonl"),
                          db_root=str(world.root / "dbs"), max_new_tokens=6, batch_size=4, workers=1,
                          **{"answer_prefix": PREFIX, **over})


def test_the_model_continues_the_answers_start(world):
    model, tok = world.policy
    builder = PromptBuilder(world.root / "dbs", example_values=0, style="compact")
    rendered = [render_prompt(tok, builder.messages(e)) for e in world.examples]
    assert prompts_for(_cfg(world, answer_prefix=""), world.examples, tok) == rendered
    assert prompts_for(_cfg(world), world.examples, tok) == [r + PREFIX for r in rendered]
    got = predict(_cfg(world), world.examples, world.policy, progress=False)
    continued = generate(model, tok, [r + PREFIX for r in rendered], max_new_tokens=6, batch_size=4, progress=False)
    assert [got[e.id]["completion"] for e in world.examples] == [PREFIX + c for (c,) in continued]
    assert all(a["completion"].count(PREFIX) == 1 for a in got.values())


@pytest.mark.parametrize("finished", ["all", "one"])
def test_a_resumed_run_keeps_the_start_once(world, finished):
    """A killed run's answers (which carry the start) given back: every batch they finish is skipped, a batch
    they finish in part runs again; either way the answers are the uninterrupted run's, each start once."""
    cfg = _cfg(world)
    whole = predict(cfg, world.examples, world.policy, progress=False)
    known = {q: a for q, a in whole.items() if finished == "all" or q == world.examples[0].id}
    reported = {}
    resumed = predict(cfg, world.examples, world.policy, progress=False, known=known, on_answers=reported.update)
    assert resumed == whole
    assert set(reported) == (set() if finished == "all" else set(whole))  # a batch run again reports all its own
    assert all(a["completion"].startswith(PREFIX) and a["completion"].count(PREFIX) == 1
               for a in [*resumed.values(), *reported.values()])
    # the completions themselves, as the filter's and the served model's calls get them
    prompts, ids = prompts_for(cfg, world.examples, world.policy[1]), [e.id for e in world.examples]
    done = {i: [known[q]["completion"]] for i, q in enumerate(ids) if q in known}
    again = complete_prompts(cfg, prompts, world.policy, keys=ids, progress=False, done=done)
    assert again == [[whole[q]["completion"]] for q in ids]


def test_publish_refuses_an_evaluation_that_started_the_answers():
    from slmsql.publishing.text2sql import settings_from_runs

    def run(rid, **params):
        base = {"prompt_style": "compact", "example_values": "0", "max_new_tokens": "6", "batch_size": "4"}
        return SimpleNamespace(info=SimpleNamespace(run_id=rid), data=SimpleNamespace(params={**base, **params}))

    grpo = run("grpo")
    assert settings_from_runs(grpo, [run("e1"), run("e2", answer_prefix="")])["max_new_tokens"] == 6
    with pytest.raises(SlmsqlError, match=r"evaluation run e2 gave the model the start of its answer"):
        settings_from_runs(grpo, [run("e1"), run("e2", answer_prefix=PREFIX)])


@pytest.mark.slow  # a CLI path in a new process: 13 s of the fast tier on the AMD (docs/development.md)
def test_evaluate_through_the_cli_logs_the_start_and_scores_the_whole_answer(world, tmp_path):
    import mlflow

    root = world.root
    proc = watched.run([sys.executable, "-m", "slmsql.cli", "evaluate", "--model", str(world.folder),
                        "--data", str(root / "gold.jsonl"), "--db-root", str(root / "dbs"), "--max-new-tokens", "6",
                        "--batch-size", "4", "--workers", "1", "--answer-prefix", PREFIX,
                        "--output-dir", str(tmp_path / "primed")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    predictions = read_jsonl(tmp_path / "primed" / "predictions.jsonl")
    assert len(predictions) == len(world.examples)
    assert all(p["completion"].startswith(PREFIX) for p in predictions)
    # the query extracted from the whole answer: its start is part of it (a closed block or an unclosed one)
    assert all(p["sql"] is None or p["sql"].startswith("SELECT") for p in predictions)
    (params,) = [r.data.params for r in mlflow.MlflowClient().search_runs(
        [e.experiment_id for e in mlflow.search_experiments()])]
    assert params["answer_prefix"] == PREFIX and "prompt.answer_prefix" not in params
