"""The project's own wiring: one source of truth for pins and parameters, CI calling the README's command."""

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from slmsql.workflow.mlproject import render

ROOT = Path(__file__).parents[1]


def test_conda_yaml_pins_equal_pyproject():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    conda = yaml.safe_load((ROOT / "conda.yaml").read_text())
    pip = next(d["pip"] for d in conda["dependencies"] if isinstance(d, dict))
    assert [d for d in pip if d != "-e ."] == deps
    assert all("==" in d for d in deps), "every dependency is pinned"


def test_mlproject_is_generated_from_configs():
    assert (ROOT / "MLproject").read_text() == render(), "regenerate: slmsql mlproject > MLproject"


def test_mlproject_declares_the_lifecycle_entry_points():
    doc = yaml.safe_load((ROOT / "MLproject").read_text())
    assert {"filter", "grpo", "evaluate", "publish"} <= set(doc["entry_points"])
    for name, ep in doc["entry_points"].items():
        for p, spec in ep["parameters"].items():
            assert spec["type"] in ("string", "float", "path", "uri")
            assert "{" + p + "}" in ep["command"], f"{name}.{p} is declared but not passed"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.DOTALL).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert len(commands) == 2, "the quick start is exactly two commands"
    test_cmd = next(c for c in commands if "test" in c)
    assert test_cmd in (ROOT / ".ci" / "run").read_text()


def test_every_test_module_has_a_test_outside_the_slow_tier(fast_modules):
    """`make test-fast` (-m "not slow") runs at least one test of every module: a module whose tests all train a
    model or start a server keeps a fast test of its cheap parts (argument and input checks). Collected the way
    `make test-fast` collects, conftest's marks included: by this session when it collected every module (conftest's
    `fast_modules`), else again in a new process."""
    import subprocess
    import sys

    modules = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    if set(fast_modules) == modules:
        fast = {m for m, has_fast in fast_modules.items() if has_fast}
    else:  # this session collected part of the suite
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               "-m", "not slow", str(ROOT / "tests")], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        fast = {line.split("::")[0].rsplit("/", 1)[-1] for line in proc.stdout.splitlines() if "::" in line}
    assert modules - fast == set(), "modules without a test outside the slow tier"


def test_every_stage_main_reads_top_to_bottom_in_under_100_lines():
    """A stage is thin: its `main` hands the work to the library (docs/development.md, "Layout")."""
    import ast

    lengths = {}
    for f in sorted((ROOT / "src" / "slmsql" / "stages").glob("*.py")):
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name == "main":
                lengths[f.stem] = node.end_lineno - node.lineno + 1
    assert set(lengths) >= {"sft", "filter", "grpo", "evaluate", "publish"}
    assert {k: v for k, v in lengths.items() if v > 100} == {}


def test_each_pytest_run_has_a_temp_folder_of_its_own(request, tmp_path_factory):
    # conftest.py: not pytest's shared `pytest-of-<user>` series, which runs at the same time would share and
    # clean up under each other
    if any(a.startswith("--basetemp") for a in request.config.invocation_params.args):
        return  # given on the command line: kept as given
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's: its own folder in the run's (`make test`: -n 2)
        assert base.name == os.environ["PYTEST_XDIST_WORKER"].replace("gw", "popen-gw")
        base = base.parent
    assert base.name.startswith("slmsql-pytest-") and base.parent.name != f"pytest-of-{base.owner()}"


@pytest.mark.parametrize("model, hub_id, setup, out", [
    (None, "HuggingFaceTB/SmolLM2-135M-Instruct", "scripts/smollm2.py", "outputs/smollm2"),
    ("qwen2.5-coder-0.5b", "Qwen/Qwen2.5-Coder-0.5B-Instruct", "recipes/qwen2.5-coder-0.5b/gguf.json",
     "outputs/qwen2.5-coder-0.5b"),
    ("qwen2.5-coder-1.5b", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "recipes/qwen2.5-coder-1.5b/gguf.json",
     "outputs/qwen2.5-coder-1.5b"),
])
def test_demo_real_takes_the_model_its_recipes_name_and_lays_it_in_first(model, hub_id, setup, out):
    """`make demo-real MODEL=...` (make's dry run: the commands it would run, in order): the model is laid into the
    cache by its own target, then the lifecycle runs on the Hub id the recipes' sft.yaml names, with those recipes."""
    r = subprocess.run(["make", "-n", "demo-real", *([f"MODEL={model}"] if model else [])], cwd=ROOT,
                       capture_output=True, text=True, check=True, env={**os.environ, "MAKEFLAGS": ""})
    lines = r.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if "slmsql pipeline" in line)
    assert any(setup in line for line in lines[:at])
    tail = " ".join(lines[at:])
    assert f"--model {hub_id} " in tail and f"--recipes recipes/{model or 'smollm2-135m'} " in tail
    assert f"--output-dir {out} " in tail
    bad = subprocess.run(["make", "demo-real", "MODEL=nothing-here"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "MAKEFLAGS": ""}, timeout=60)  # refused before anything installs
    assert bad.returncode != 0 and "MODEL=nothing-here: no recipes/nothing-here/sft.yaml" in bad.stderr
    assert "pip" not in bad.stdout
