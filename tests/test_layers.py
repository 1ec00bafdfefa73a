"""The library's layering: packages in the order `slmsql.LAYERS` writes once, each importing only its own and those
below it, and no import cycle between modules (a function-level import is an edge too: deferring an import hides a
cycle or an upward arrow, it does not remove it)."""

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

from slmsql import LAYERS

ROOT = Path(__file__).parents[1]


def _imports(module: str, file: Path, known: set[str]) -> set[str]:
    """The slmsql modules and packages `file` imports anywhere in it."""
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


def import_graph(src: Path) -> dict[str, set[str]]:
    files = {".".join(f.relative_to(src).with_suffix("").parts).removesuffix(".__init__"): f
             for f in (src / "slmsql").rglob("*.py")}
    return {m: _imports(m, f, set(files)) for m, f in files.items()}


def layer(module: str) -> str:
    """slmsql.tracking.runs -> tracking; slmsql.errors -> errors"""
    return module.split(".")[1] if module != "slmsql" else "slmsql"


def upward(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every import of a package above the importer's own, as 'importer -> imported'."""
    rank = {name: i for i, name in enumerate(layers)}
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                  if rank[layer(t)] > rank[layer(m)])


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as e:
        return e.args[1]
    return None


@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT / "src")


def test_every_package_has_a_place_in_the_layers_and_says_its_job(graph):
    tops = {layer(m) for m in graph} - {"slmsql"}
    assert tops == set(LAYERS), f"packages not in slmsql.LAYERS: {tops - set(LAYERS)}; gone: {set(LAYERS) - tops}"
    for name in LAYERS:
        init = ROOT / "src" / "slmsql" / name / "__init__.py"
        if init.exists():
            assert ast.get_docstring(ast.parse(init.read_text())), f"{init}: no docstring saying the package's job"
    assert "slmsql.policy.models" in graph["slmsql.generation.sampling"]  # the edges are seen


def test_no_package_imports_one_above_it(graph):
    assert upward(graph) == []


def test_no_import_cycle(graph):
    assert cycle(graph) is None


def test_the_checks_catch_an_upward_import_and_a_cycle(graph):
    """Break check: the same functions on today's graph with one arrow added the wrong way."""
    bad = {m: set(t) for m, t in graph.items()}
    bad["slmsql.inputs.data"].add("slmsql.tracking.runs")  # inputs sits below tracking, which imports it
    assert upward(bad) == ["slmsql.inputs.data -> slmsql.tracking.runs"]
    assert cycle(bad) is not None
    assert upward(graph, layers=tuple(reversed(LAYERS)))  # the order matters: reversed, today's arrows run up


def test_the_development_guide_draws_the_same_map():
    """docs/development.md's table names every package once, in the order slmsql.LAYERS stacks them."""
    import re

    text = (ROOT / "docs" / "development.md").read_text()
    rows = re.findall(r"^\| `([a-z_]+)(?:/|\.py)` \|", text, flags=re.M)
    assert tuple(rows) == LAYERS
