"""Evaluate resumes after a crash (stages/evaluate.py): each generation batch's answers go to
`<out>.partial/answers.jsonl` as soon as the batch is done; a rerun with the same parameters continues the same
MLflow run, generates only the batches not finished, and ends with what an uninterrupted run writes. The batches are
planned over all questions either way and only whole finished ones are skipped, so the batches that run are the
uninterrupted run's: the same computation, the same answers (one machine, one thread)."""

from __future__ import annotations

import signal
import sys

import mlflow
import pytest
import schemas
import torch
import watched
from driver_faults import killed_after
from schemas import QUESTIONS

from slmsql.configs import EvaluateConfig
from slmsql.errors import SlmsqlError
from slmsql.generation.sampling import generate
from slmsql.inputs.data import read_jsonl, write_jsonl
from slmsql.inputs.prompts import PromptBuilder, render_prompt
from slmsql.policy.models import load_model
from slmsql.stages import evaluate


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return schemas.build(tmp_path_factory.mktemp("schemas"))


@pytest.fixture
def one_thread(monkeypatch, request):
    """One thread here and in every process the test starts: thread counts are float paths."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(threads))


class Crash(Exception):
    pass


@pytest.mark.parametrize("shared", [True, False], ids=["shared-schema", "plain"])
def test_a_resumed_generation_runs_only_the_unfinished_batches_and_answers_the_same(world, shared, one_thread):
    root, folder = world
    model, tok = load_model(folder, device="cpu")
    builder = PromptBuilder(root / "dbs", example_values=0, style="compact")
    prompts = [render_prompt(tok, builder.chat(q, builder.schema(db))) for db, q in QUESTIONS]
    kw = dict(max_new_tokens=8, batch_size=2, shared_schema=shared, progress=False)
    whole = generate(model, tok, prompts, **kw)

    finished: list[dict] = []

    def crash_after_two(batch):
        finished.append(batch)
        if len(finished) == 2:
            raise Crash

    with pytest.raises(Crash):
        generate(model, tok, prompts, **kw, on_batch=crash_after_two)
    done = {i: texts for batch in finished for i, texts in batch.items()}
    assert len(done) == 4 and all(whole[i] == texts for i, texts in done.items())

    calls = []
    real = model.generate
    model.generate = lambda *a, **k: (calls.append(k.get("input_ids", a[0] if a else None).shape[0]), real(*a, **k))[1]
    try:
        resumed = generate(model, tok, prompts, **kw, done={i: ["kept " + t[0]] for i, t in done.items()})
    finally:
        del model.generate
    assert sum(calls) == len(prompts) - 4  # only the unfinished batches ran, each whole
    assert [r[0].removeprefix("kept ") for r in resumed] == [w[0] for w in whole]
    assert sum(r[0].startswith("kept ") for r in resumed) == 4


@pytest.mark.slow  # two new processes
def test_vllm_skips_only_whole_finished_batches(world, monkeypatch):
    """The vLLM path's batches (`batch_size` prompts in order) under a stand-in engine that answers each prompt with
    its own first tokens: a batch whose every prompt is done is not sent; a batch with one prompt done is sent whole
    (its requests are an uninterrupted run's); each batch sent is reported once."""
    from types import SimpleNamespace

    from slmsql.generation import vllm_engine

    _, folder = world
    _, tok = load_model(folder, device="cpu")
    sent: list[list[list[int]]] = []

    def llm_generate(requests, params, lora_request=None, use_tqdm=False):
        sent.append([r["prompt_token_ids"] for r in requests])
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=r["prompt_token_ids"][:3])]) for r in requests]

    monkeypatch.setattr(vllm_engine, "sampling_params", lambda **kw: kw)  # no vLLM needed to check the batches
    engine = SimpleNamespace(llm=SimpleNamespace(generate=llm_generate), stop_ids=[], lora=None)
    prompts = [f"{q} ({i})" for i, (_, q) in enumerate(QUESTIONS)]
    kw = dict(k=1, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, max_new_tokens=4,
              seed=0, batch_size=4, progress=False)
    whole = vllm_engine.generate(engine, tok, prompts, [str(i) for i in range(9)], **kw)
    assert [len(b) for b in sent] == [4, 4, 1]
    sent.clear()
    reported: list[dict] = []
    done = {i: ["kept"] for i in (0, 1, 2, 3, 5)}  # batch 0 whole, one prompt of batch 1
    resumed = vllm_engine.generate(engine, tok, prompts, [str(i) for i in range(9)], **kw, done=done,
                                   on_batch=reported.append)
    assert [len(b) for b in sent] == [4, 1] and [sorted(b) for b in reported] == [[4, 5, 6, 7], [8]]
    assert resumed == [["kept"]] * 4 + whole[4:]
    # a finished batch after a batch that was sent is skipped too (the answers of a sent batch once took the name
    # of `done`, so every later batch was sent again)
    sent.clear()
    done = {i: ["kept"] for i in (0, 4, 5, 6, 7)}
    resumed = vllm_engine.generate(engine, tok, prompts, [str(i) for i in range(9)], **kw, done=done)
    assert [len(b) for b in sent] == [4, 1] and resumed[4:8] == [["kept"]] * 4


@pytest.mark.slow  # two new processes
def test_evaluate_killed_mid_run_goes_on_in_the_same_run(world, tmp_path, one_thread):
    """`slmsql evaluate` SIGKILLed right after its 4th answer (tests/driver_faults.py: at an answer count, never at
    a time); the rerun, a new process, keeps those answers (marked here: a rerun that generated them again would
    drop the mark), continues the killed MLflow run, and writes an uninterrupted run's predictions and results."""
    root, folder = world
    out = tmp_path / "out"
    args = ["evaluate", "--model", str(folder), "--data", str(root / "gold.jsonl"), "--db-root", str(root / "dbs"),
            "--max-new-tokens", "8", "--batch-size", "2", "--workers", "1", "--output-dir", str(out)]
    killed = killed_after(4, args, what="answers")
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    partial = tmp_path / "out.partial" / "answers.jsonl"
    rows = read_jsonl(partial)  # written and synced before the kill: no torn line
    assert len(rows) == 4 and not out.exists()
    write_jsonl(partial, [{**r, "answer": {**r["answer"], "mark": True}} for r in rows])

    resumed = watched.run([sys.executable, "-m", "slmsql.cli", *args])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming: 4 of 9 questions answered before" in resumed.stderr
    preds = read_jsonl(out / "predictions.jsonl")
    assert sorted(p["id"] for p in preds if p.get("mark")) == sorted(r["id"] for r in rows)
    assert not (out / "answers.jsonl").exists() and not partial.parent.exists()
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert len(runs) == 1, "the rerun must continue the killed run, not start a second one"
    assert runs[0].info.status == "FINISHED" and runs[0].data.metrics["n"] == len(QUESTIONS)

    evaluate.main(EvaluateConfig(model=str(folder), data=str(root / "gold.jsonl"), db_root=str(root / "dbs"),
                                 max_new_tokens=8, batch_size=2, workers=1, output_dir=str(tmp_path / "ref")))
    assert [{k: v for k, v in p.items() if k != "mark"} for p in preds] == read_jsonl(
        tmp_path / "ref" / "predictions.jsonl")
    assert read_jsonl(out / "results.jsonl") == read_jsonl(tmp_path / "ref" / "results.jsonl")


@pytest.mark.slow  # a new process
def test_a_rerun_with_other_answer_settings_is_refused_by_name(world, tmp_path, one_thread):
    """A killed run's answers are kept only for the settings that made them: a rerun with another batch size (another
    batch plan) is refused before any model loads, naming the parameter; the same rerun with --overwrite too."""
    root, folder = world
    out = tmp_path / "out"
    args = ["evaluate", "--model", str(folder), "--data", str(root / "gold.jsonl"), "--db-root", str(root / "dbs"),
            "--max-new-tokens", "8", "--workers", "1", "--output-dir", str(out)]
    killed = killed_after(2, [*args, "--batch-size", "2"], what="answers")
    assert killed.returncode == -signal.SIGKILL
    cfg = EvaluateConfig(model=str(folder), data=str(root / "gold.jsonl"), db_root=str(root / "dbs"),
                         max_new_tokens=8, batch_size=4, workers=1, output_dir=str(out))
    with pytest.raises(SlmsqlError, match=r"unfinished run with other parameters \(batch_size: 2 then, 4 now\)"):
        evaluate.main(cfg)
    assert len(read_jsonl(tmp_path / "out.partial" / "answers.jsonl")) == 2  # nothing lost
