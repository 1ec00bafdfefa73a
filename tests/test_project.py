"""The project's own wiring: one source of truth for pins and parameters, CI calling the README's command."""

import re
import tomllib
from pathlib import Path

import yaml

from slmsql.mlproject import render

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


def _slmsql_imports(module: str, file: Path, known: set[str]) -> set[str]:
    """The slmsql modules `file` imports anywhere in it (a function-level import is an edge too: deferring an
    import hides a cycle, it does not remove it)."""
    import ast

    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(parts + ([node.module] if node.module else []))
            names = [target, *(f"{target}.{a.name}" for a in node.names)]
        else:
            continue
        out |= {n for n in names if n in known and n not in (module, "slmsql")}
    return out


def test_slmsql_modules_import_each_other_without_cycles():
    from graphlib import CycleError, TopologicalSorter

    files = {".".join(f.relative_to(ROOT / "src").with_suffix("").parts).removesuffix(".__init__"): f
             for f in (ROOT / "src" / "slmsql").rglob("*.py")}
    graph = {m: _slmsql_imports(m, f, set(files)) for m, f in files.items()}
    assert {"slmsql.models", "slmsql.promptcheck", "slmsql.generation", "slmsql.vllm_engine"} <= set(graph)
    assert "slmsql.models" in graph["slmsql.generation"]  # the edges are seen (a graph without any has no cycle)
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None
