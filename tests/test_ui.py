"""What a person sees in the MLflow UI: run and experiment descriptions, one metric vocabulary (documented in
the README), readable tables, dataset inputs, params without empty options or fetched-artifact paths, figures.

The evaluation runs here score the bundled example predictions (no model): seconds. The training and sampling
stages are checked where their tests already run them (test_grpo, test_filter, test_sft_evaluate, test_pipeline),
and `conftest._documented_metrics_only` fails any test whose stage logs an undocumented metric name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pytest

from slmsql import configs
from slmsql.tracking import descriptions, figures, tables, runs as tracking, vocabulary
from slmsql.errors import SlmsqlError
from slmsql.stages import evaluate

ROOT = Path(__file__).parents[1]
EXAMPLES = ROOT / "examples"
RUN_ID = "0123456789abcdef0123456789abcdef"
PRINTED: dict[str, str] = {}  # run name -> what `slmsql evaluate` printed


def _eval(tmp: Path, name: str, *args: str) -> object:
    """`slmsql evaluate` through the CLI (which fetches runs:/ options), with the examples' gold by default."""
    from click.testing import CliRunner

    from slmsql.cli import main

    if "--data" not in args:
        args += ("--data", str(EXAMPLES / "gold.jsonl"), "--db-root", str(EXAMPLES / "databases"))
    result = CliRunner().invoke(main, ["evaluate", "--workers", "1", "--output-dir", str(tmp / name),
                                       "--run-name", name, *args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    PRINTED[name] = result.output
    client = mlflow.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("slmsql").experiment_id],
                                f"attributes.run_name = '{name}'")
    return run


@pytest.fixture(scope="module")
def paired(tmp_path_factory):
    """The example predictions (4 of 10 right), then the gold SQL as predictions (10 of 10) against them as
    baseline. The gold file and databases are given as artifacts of a run (runs:/<id>/...), as the pipeline
    passes a step's inputs."""
    from policy import tracking_store

    tmp = tmp_path_factory.mktemp("ui")
    oracle = tmp / "oracle.jsonl"
    oracle.write_text("".join(json.dumps({"id": r["id"], "sql": r["sql"]}) + "\n"
                              for r in map(json.loads, (EXAMPLES / "gold.jsonl").read_text().splitlines())))
    with tracking_store(f"sqlite:///{tmp}/mlflow.db"):
        client = mlflow.MlflowClient()
        source = client.create_run(client.create_experiment("sources", artifact_location=str(tmp / "art"))).info.run_id
        client.log_artifact(source, str(EXAMPLES / "gold.jsonl"), "world")
        client.log_artifacts(source, str(EXAMPLES / "databases"), "world/databases")
        inputs = ("--data", f"runs:/{source}/world/gold.jsonl", "--db-root", f"runs:/{source}/world/databases")
        base = _eval(tmp / "out", "examples", "--predictions", str(EXAMPLES / "predictions.jsonl"), *inputs)
        best = _eval(tmp / "out", "oracle", "--predictions", str(oracle), "--baseline-run", base.info.run_id, *inputs)
        exp = client.get_experiment_by_name("slmsql")
        tables_ = {(r, t): json.loads(Path(client.download_artifacts(r.info.run_id, t, str(tmp / "dl" / r.info.run_id)))
                                      .read_text())
                   for r, t in ((base, "results_table.json"), (best, "results_table.json"),
                                (best, "disagreements_table.json"))}
    return SimpleNamespace(base=base, best=best, exp=exp, uri=f"sqlite:///{tmp}/mlflow.db", source=source,
                           fetched=tmp / "out" / tracking.FROM_RUNS / source / "world",
                           tables={(r.info.run_name, t): v for (r, t), v in tables_.items()})


def rows(table: dict) -> list[dict]:
    return [dict(zip(table["columns"], r)) for r in table["data"]]


# ---- descriptions -----------------------------------------------------------------------------------------

def test_evaluation_descriptions_state_the_result(paired):
    base, best = paired.base, paired.best
    # 4 of 10 right: the Wilson 95% interval of 0.4 at n = 10 is [0.1682, 0.6873]
    assert base.data.tags[tracking.NOTE] == \
        "EX 40.0% (95% Wilson interval 16.8% to 68.7%) on 10 questions of gold, bird match."
    # the run page prints a metric's double in full: statistics are logged to 6 significant digits
    assert (base.data.metrics["ex_ci_low"], base.data.metrics["ex_ci_high"]) == (0.16818, 0.687326)
    assert base.data.tags["mlflow.source.name"] == "slmsql evaluate"  # not the script's path on this machine
    note = best.data.tags[tracking.NOTE]
    assert note.startswith("EX 100.0% (95% Wilson interval 72.2% to 100.0%)")  # 10 of 10: [0.7225, 1]
    # 6 questions only the oracle got right, none only the baseline: exact McNemar p = 2 / 2**6 = 0.03125
    # the baseline named by a link to its run page, the one Markdown link in the text
    link = f"[examples](#/experiments/{base.info.experiment_id}/runs/{base.info.run_id})"
    assert f"\nvs {link}: 40.0% → 100.0%, +60.0 points (95% interval " in note
    assert "McNemar p = 0.03: improved at α = 0.05. 6 questions only this run got right, 0 only the baseline." in note
    assert not re.search(r"\]\s*\(", note.replace(link, ""))  # Markdown would render "[a, b] (c)" as a link


def test_each_evaluation_states_its_result_in_one_cell_and_prints_the_view(paired):
    """The runs table's view groups by eval set and shows each evaluation's result tag, formatted as
    wording.result says; `slmsql evaluate` prints it and the link that opens the view."""
    from slmsql.stats import wording

    metrics = json.loads(Path(mlflow.MlflowClient(paired.uri).download_artifacts(
        paired.best.info.run_id, "metrics.json", str(Path(paired.fetched).parent.parent / "m"))).read_text())
    result = paired.best.data.tags[tracking.RESULT]
    assert result == wording.result(metrics["comparison"]) and result.startswith("100.0% vs 40.0%, +60.0 pts [")
    assert paired.base.data.tags[tracking.RESULT] == "40.0% [16.8%, 68.7%]"
    link = tracking.ui_link(paired.exp.experiment_id)
    assert PRINTED["oracle"].endswith(f"oracle: {result}\nMLflow UI: {link}\n")
    saved = json.loads(paired.exp.tags[f"mlflow.sharedViewState.{tracking.VIEW_KEY}"])
    view = json.loads(saved["state"])  # in the envelope that lists it in the views menu by name
    assert saved["name"] == "slmsql"
    assert view["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "slmsql.dataset"}]
    assert f"tags.`{tracking.RESULT}`" in view["selectedColumns"]
    # no metric column: a group row would show its aggregate ("- (max)" where the group lacks the metric)
    assert not [c for c in view["selectedColumns"] if c.startswith("metrics.")]
    # group labels fit their column; charts draw runs, not groups (whose label for runs without an eval set is
    # "Unassigned" there, "Additional runs" in the table)
    assert view["columnWidths"][tracking.RUN_NAME_COLUMN] >= 260 and view["columnOrder"][0] == tracking.RUN_NAME_COLUMN
    assert view["useGroupedValuesInCharts"] is False


def test_experiment_has_a_description(paired):
    assert "docs/vocabulary.md" in paired.exp.tags[tracking.NOTE]


# ---- metric vocabulary --------------------------------------------------------------------------------------

def test_vocabulary_names_what_runs_log(paired):
    base, best = paired.base, paired.best
    assert not [k for k in best.data.metrics if not vocabulary.documented(k, "evaluate")]
    # the comparison names its sides, and this run's own EX is not logged twice
    assert best.data.metrics["vs_baseline/only_this_right"] == 6
    assert best.data.metrics["vs_baseline/only_baseline_right"] == 0
    assert best.data.metrics["vs_baseline/p"] == pytest.approx(2 / 2 ** 6)
    assert best.data.metrics["baseline/ex"] == base.data.metrics["ex"] == 0.4
    assert best.data.metrics["vs_baseline/diff"] == pytest.approx(0.6)
    assert not [k for k in best.data.metrics if "ex_a" in k or k.startswith("vs_baseline_")]
    # outcomes named as tables name them: a query that ran and returned other rows is `wrong_result`
    assert base.data.metrics["exec/wrong_result"] == pytest.approx(0.1)  # q3: ran, other rows
    assert base.data.metrics["exec/missing"] == pytest.approx(0.1)  # q10


@pytest.mark.parametrize("name, stage, ok", [
    ("ex", "evaluate", True), ("ex", "grpo", False), ("ex_moderate", "evaluate", True),
    ("exec/wrong_result", "grpo", True), ("exec/ok", "grpo", False), ("summary/exec/correct", "grpo", True),
    ("summary/exec_correct", "grpo", False), ("rewards/execution/mean", "grpo", True), ("clip_ratio/low_mean", "grpo", True),
    ("mean_token_accuracy", "sft", True), ("system/cpu_utilization_percentage", "filter", True),
    ("out_of_band_1_of_8", "filter", True), ("eval-grpo-dev/vs_baseline/p", "pipeline", True),
    ("eval-sft-dev_cross/ex", "pipeline", True), ("grpo/summary/exec/frac_groups_correctness_varies", "pipeline", True),
    ("filter/band", "pipeline", True), ("sft_ex_dev", "pipeline", False), ("eval-grpo-dev/vs_baseline_ex_a", "pipeline", False),
    ("vs_baseline_only_a", None, False), ("rate_error", None, False), ("vs_baseline/only_a", None, False),
])
def test_documented(name, stage, ok):
    assert vocabulary.documented(name, stage) is ok


def test_a_stage_logging_an_undocumented_metric_fails(paired, tmp_path, monkeypatch):
    from policy import tracking_store

    from slmsql.sql import scoring

    summary = scoring.ex_summary
    monkeypatch.setattr(evaluate, "ex_summary", lambda results: {**summary(results), "ex_a": 0.5})
    with tracking_store(paired.uri), \
            pytest.raises(AssertionError, match=r"evaluate logged metric\(s\) \['ex_a'\] that are not in"):
        _eval(tmp_path, "undocumented", "--predictions", str(EXAMPLES / "predictions.jsonl"))


# ---- tables ---------------------------------------------------------------------------------------------

def test_evaluation_table_reads_as_questions_and_sql(paired):
    table = paired.tables[("examples", "results_table.json")]
    assert table["columns"] == ["id", "db_id", "difficulty", "question", "gold_sql", "predicted_sql", "completion",
                                "status", "correct", "error"]
    by_id = {r["id"]: r for r in rows(table)}
    assert by_id["q1"]["question"] == "How many customers are there?" and by_id["q1"]["correct"] is True
    assert by_id["q3"]["status"] == "wrong_result" and "'home'" in by_id["q3"]["predicted_sql"]
    assert (by_id["q5"]["status"], by_id["q6"]["status"], by_id["q10"]["status"]) == ("error", "no_sql", "missing")
    assert by_id["q2"]["predicted_sql"] == "SELECT name FROM customer WHERE city = 'Berlin'"  # extracted from prose
    assert by_id["q2"]["completion"] == (  # beside it, the raw text it came from
        "The customers in Berlin:\n```sql\nSELECT name FROM customer WHERE city = 'Berlin';\n```")
    assert "ok" not in {r["status"] for r in by_id.values()}


def test_disagreements_table_lists_the_discordant_questions(paired):
    base = {r["id"]: r for r in rows(paired.tables[("examples", "results_table.json")])}
    table = paired.tables[("oracle", "disagreements_table.json")]
    assert table["columns"] == ["id", "question", "right", "gold_sql", "predicted_sql", "status", "baseline_sql",
                                "baseline_status"]
    got = rows(table)
    assert {r["id"] for r in got} == {i for i, r in base.items() if not r["correct"]}  # the oracle is never wrong
    assert {r["right"] for r in got} == {"oracle"}  # named by run name
    assert {r["id"]: r["baseline_status"] for r in got} == {i: base[i]["status"] for i in base if not base[i]["correct"]}


def test_sql_report_puts_the_disagreements_first_with_every_sql_in_a_code_block(paired):
    base = {r["id"]: r for r in rows(paired.tables[("examples", "results_table.json")])}
    best = {r["id"]: r for r in rows(paired.tables[("oracle", "results_table.json")])}
    path = mlflow.MlflowClient(paired.uri).download_artifacts(paired.best.info.run_id, "sql_side_by_side.md",
                                                                str(Path(paired.fetched).parent.parent / "md"))
    text = Path(path).read_text()
    sections = text.split("\n## ")[1:]
    wrong = [i for i in base if not base[i]["correct"]]
    assert sections[0].startswith(f"Only one run right ({len(wrong)})") and sections[1].startswith("Both right (")
    first = sections[0].split("\n### ")[1:]
    assert [q.split(" ")[0] for q in first] == [i for i in best if i in wrong]  # in the eval set's order
    q = first[0]
    i = q.split(" ")[0]
    assert q.startswith(f"{i} — right: oracle\n") and best[i]["question"] in q
    assert q.count("```sql\n") == 2 + bool(base[i]["predicted_sql"])  # gold, this run's, the baseline's
    assert f"```sql\n{best[i]['gold_sql'].strip()}\n```" in q and "examples (" in q


def test_completions_table_is_readable():
    """TRL's completions frame (chat turns as arrays, float32 rewards) -> question, SQL, outcome, rounded numbers."""
    import numpy as np
    import pandas as pd

    from slmsql.inputs.data import Example

    ex = Example("q1", "shop", "How many customers?", "SELECT COUNT(*) FROM customer")
    prompt = [{"role": "system", "content": "You write SQL."}, {"role": "user", "content": "schema\nHow many customers?"}]
    df = pd.DataFrame({"step": [2, 2], "prompt": [np.array(prompt, dtype=object)] * 2,
                       "completion": [np.array([{"role": "assistant", "content": "```sql\nSELECT 1\n```"}], dtype=object),
                                      np.array([{"role": "assistant", "content": "no idea"}], dtype=object)],
                       "execution": np.array([0.1, 0.0], dtype=np.float32),
                       "format": np.array([0.2, 0.0], dtype=np.float32), "status": ["wrong_result", "no_sql"],
                       "advantage": np.array([0.7071068, -0.7071068], dtype=np.float32)})
    table = tables.completions_table(df, {tables.prompt_key(prompt): ex}, ["execution", "format"])
    assert list(table.columns) == ["step", "id", "question", "sql", "completion", "gold_sql", "status", "execution",
                                   "format", "advantage"]
    first, second = table.to_dict("records")
    assert (first["question"], first["gold_sql"], first["sql"]) == (ex.question, ex.sql, "SELECT 1")
    assert first["completion"] == "```sql\nSELECT 1\n```" and pd.isna(second["sql"])
    assert (first["format"], first["execution"], first["advantage"]) == (0.2, 0.1, 0.7071)  # not 0.200000003


# ---- lineage: dataset inputs and params -----------------------------------------------------------------------

def test_evaluation_logs_its_dataset_input(paired):
    inputs = [r.inputs.dataset_inputs for r in (paired.base, paired.best)]
    for (inp,) in inputs:
        assert inp.dataset.name == "gold" and [t.value for t in inp.tags if t.key == "mlflow.data.context"] == \
            ["evaluation"]
        assert json.loads(inp.dataset.profile)["num_rows"] == 10
    assert inputs[0][0].dataset.digest == inputs[1][0].dataset.digest  # the same file: one name, one digest
    # taken from a run: the source is that run's artifact, not this machine's copy
    assert json.loads(inputs[0][0].dataset.source)["uri"] == f"runs:/{paired.source}/world/gold.jsonl"


def test_params_hold_run_uris_and_no_empty_options(paired):
    # the run URIs given, fetched once next to the output folders; the local copy is what the stage read
    assert (paired.fetched / "gold.jsonl").read_bytes() == (EXAMPLES / "gold.jsonl").read_bytes()
    assert (paired.fetched / "databases" / "shop" / "shop.sqlite").is_file()
    for run in (paired.base, paired.best):
        assert run.data.params["data"] == f"runs:/{paired.source}/world/gold.jsonl"
        assert run.data.params["db_root"] == f"runs:/{paired.source}/world/databases"
        assert "" not in run.data.params.values()
        assert not {"adapter", "model", "dataset_name"} & set(run.data.params)  # empty: not logged


def test_param_value_and_to_params():
    assert tracking.param_value(f"/x/outputs/{tracking.FROM_RUNS}/{RUN_ID}/policy") == f"runs:/{RUN_ID}/policy"
    assert tracking.param_value(f"/x/{tracking.FROM_RUNS}/{RUN_ID}") == f"runs:/{RUN_ID}"
    assert tracking.param_value("/x/outputs/sft") == "/x/outputs/sft"
    assert tracking.param_value(f"/x/{tracking.FROM_RUNS}/not-a-run-id/policy") == f"/x/{tracking.FROM_RUNS}/not-a-run-id/policy"
    with pytest.raises(SlmsqlError, match="is not a run artifact URI"):
        tracking.fetch("runs:/policy", "/tmp")
    params = configs.to_params(configs.GRPOStageConfig())
    assert "adapter_mode" not in params and "base_adapter" not in params and "reward_weights" not in params
    params = configs.to_params(configs.GRPOStageConfig(base_adapter="a", adapter_mode="stack"))
    assert params["adapter_mode"] == "stack"
    # booleans spelled as the command line, MLproject and every workflow step spell them
    assert (params["use_lora"], params["dynamic_sampling"]) == ("true", "false") == (
        configs.param_text(True), configs.param_text(False))


def test_files_a_run_keeps_name_runs_and_project_paths(tmp_path, monkeypatch):
    """The adapter's config (pushed to the Hub with it) and the filter's data check name what they read as the
    runs that hold it, or relative to the project; a config leaves out where and how the stage ran."""
    monkeypatch.chdir(tmp_path)
    fetched = tmp_path / "outputs" / tracking.FROM_RUNS / RUN_ID
    cfg = configs.GRPOStageConfig(data=str(fetched / "band.jsonl"), db_root=str(tmp_path / "dbs"), model="org/m",
                                  output_dir=str(tmp_path / "outputs" / "grpo"), rewards=["execution"])
    kept = tracking.portable_config(cfg)
    assert (kept["data"], kept["db_root"], kept["model"]) == (f"runs:/{RUN_ID}/band.jsonl", "dbs", "org/m")
    assert not set(configs.RUN_ONLY) & set(kept) and kept["rewards"] == ["execution"] and kept["use_lora"] is True
    report = {"data": "/m/out/filter/band.jsonl", "parameters": {"db_root": "/m/dbs"},
              "examples": [["no database at /m/dbs/shop/shop.sqlite"]]}
    assert tracking.renamed(report, {"/m/out/filter": f"runs:/{RUN_ID}", "/m/dbs": "runs:/x/databases"}) == {
        "data": f"runs:/{RUN_ID}/band.jsonl", "parameters": {"db_root": "runs:/x/databases"},
        "examples": [["no database at runs:/x/databases/shop/shop.sqlite"]]}


def test_results_rows_of_an_older_slmsql_read_in_todays_names():
    """results.jsonl names an answer's outcome and SQL as the tables do (`status`: correct, wrong_result, error...;
    `predicted_sql`); a baseline run written before (`status` ok for SQL that ran, `pred_sql`) reads the same."""
    from slmsql.sql.scoring import result_row

    old = [{"id": "a", "correct": True, "status": "ok", "pred_sql": "SELECT 1"},
           {"id": "b", "correct": False, "status": "ok", "pred_sql": "SELECT 2"},
           {"id": "c", "correct": False, "status": "no_sql", "pred_sql": None}]
    new = [result_row(r) for r in old]
    assert [(r["status"], r["predicted_sql"]) for r in new] == [
        ("correct", "SELECT 1"), ("wrong_result", "SELECT 2"), ("no_sql", None)]
    assert [result_row(r) for r in new] == new and not any("pred_sql" in r for r in new)


# ---- figures --------------------------------------------------------------------------------------------

def test_ex_figure_fits_the_axis_and_names_both_runs():
    metrics = {"ex": 0.40, "ex_ci_low": 0.36, "ex_ci_high": 0.44}
    comparison = {"ex_a": 0.40, "ex_a_ci_low": 0.36, "ex_a_ci_high": 0.44, "ex_b": 0.37, "ex_b_ci_low": 0.33,
                  "ex_b_ci_high": 0.41, "diff": 0.03, "diff_ci_low": -0.01, "diff_ci_high": 0.07, "mcnemar_p": 0.2,
                  "verdict": "no significant difference"}
    fig = figures.ex_figure(metrics, comparison, "eval-grpo-dev", "eval-sft-dev")
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    assert 25 < lo < 33 and 44 < hi < 55  # fitted to [33, 44], not 0-100
    assert [t.get_text() for t in ax.get_yticklabels()] == ["eval-sft-dev\n37.0% [33.0, 41.0]",
                                                            "eval-grpo-dev\n40.0% [36.0, 44.0]"]
    assert "+3.0 points" in ax.get_title() and "no significant difference" in ax.get_title()


def test_histogram_legend_names_every_colour():
    summary = {"k": 8, "low": 0.2, "high": 0.8, "histogram": {f"{i}/8": 10 - i for i in range(9)}}
    ax = figures.histogram_figure(summary).axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["band 0.2 < p < 0.8 (RL data)", "all fail 0/8, all pass 8/8", "out of band"]
    bars = [tuple(p.get_facecolor()) for p in ax.patches]
    legend = [tuple(h.get_facecolor()) for h in ax.get_legend().legend_handles]
    # 0/8 and 8/8 share the ends' colour, 1/8 and 7/8 the out-of-band colour, 2/8..6/8 the band's
    assert bars == [legend[1], legend[2], *[legend[0]] * 5, legend[2], legend[1]]


def test_training_curves_smooth_over_steps():
    assert figures.smooth([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    history = [{"step": s, "reward": 0.1 * s, "reward_std": 0.2, "exec/frac_groups_correctness_varies": 0.5}
               for s in range(1, 21)] + [{"step": 20, "train_loss": 0.1}]
    fig = figures.training_curves(history)
    assert [re.search(r"\(([^()]+)\)$", ax.get_title(loc="left"))[1] for ax in fig.axes] == \
        ["reward", "reward_std", "exec/frac_groups_correctness_varies"]
    raw, smoothed = fig.axes[0].get_lines()
    assert list(smoothed.get_ydata())[:3] == pytest.approx([0.1, 0.15, 0.25])  # window 20 // 10 = 2
    assert figures.training_curves([{"step": 1, "loss": 1.0}]) is None


def test_notes_of_the_other_stages():
    """Toy and tiny-model runs are checked end to end only by test_pipeline (slow): their one-line notes here."""
    from types import SimpleNamespace as NS

    toy = {"size": "small", "seed": 0, "counts": {"sft": {"total": 2000}, "dev": {"total": 200}},
           "databases": {"sft": ["a", "b"], "dev": ["b", "c"]}}  # dev asks new questions on the same databases
    assert descriptions.toy_note(toy) == "Toy world (small, seed 0): 2000 sft, 200 dev questions over 3 databases."
    info = {"parameters": 812345, "vocab_size": 2000, "texts": 2000}
    assert descriptions.tiny_model_note(info, NS(layers=2, hidden=128)) == (
        "Tiny Qwen2 model: 812,345 parameters (2 layers, hidden 128), BPE vocabulary 2,000 trained on 2,000 toy texts.")
    # GRPO: zero groups with varying correctness is said as such, not as a small signal
    grpo = {"summary/exec/frac_groups_correctness_varies": 0.0, "summary/frac_reward_zero_std": 1.0, "steps": 3,
            "train_seconds": 12.0}
    assert descriptions.grpo_note(grpo) == ("GRPO, 3 steps in 12 s. No correctness signal: no group held both right "
                                        "and wrong SQL.\n100% of groups had zero reward variance (no gradient).")
    assert descriptions.grpo_note({**grpo, "steps": 75, "train_seconds": 2670.0, "resumed_at_step": 20.0}).startswith(
        "GRPO, 75 steps in 44 min for steps 21-75 (resumed from its step-20 checkpoint; the time before it is not "
        "counted). No correctness signal")
