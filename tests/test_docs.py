"""The manual: README as a front page, the docs site built strict, and the pages generated from the code."""

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ci_env import in_ci
from slmsql import cli, configs
from slmsql.studies import readme as results_table
from slmsql.tracking import vocabulary

ROOT = Path(__file__).parents[1]


def hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_a_front_page_whose_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#\s]+)", readme)
    assert len(links) >= 15, "the front page links the manual"
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert missing == []


def test_vocabulary_page_is_generated_from_the_vocabulary():
    page = (ROOT / "docs" / "vocabulary.md").read_text()
    rendered = hooks().render("vocabulary.md", page)
    assert vocabulary.vocabulary_markdown() in rendered
    for name, _, _ in vocabulary.VOCABULARY:
        assert f"| `{name}` |" in rendered


def test_cli_page_lists_every_option_the_cli_accepts():
    """From the click commands themselves (what users type), not from the generator's own loop."""
    rendered = hooks().render("cli.md", (ROOT / "docs" / "cli.md").read_text())
    for stage in configs.STAGES:
        section = rendered.split(f"## `slmsql {stage}`")[1].split("\n## ")[0]
        command = cli.main.commands[stage]
        flags = {opt for p in command.params for opt in p.opts if opt != "--recipe"}
        shown = set(re.findall(r"^\| `(--[a-z0-9-]+)` \|", section, re.M))
        assert shown == flags, stage
        for p in command.params:
            field = next((f for f in configs.fields(configs.STAGES[stage]) if f.name == p.name), None)
            if field is not None and field.metadata.get("help"):
                assert field.metadata["help"].replace("|", "\\|") in section


def test_a_page_without_its_marker_fails_the_build():
    with pytest.raises(ValueError, match="docs/cli.md: the marker"):
        hooks().render("cli.md", "# CLI options\n")


def test_docs_build_strict(tmp_path):
    """`make docs` as CI runs it: mkdocs in strict mode (a broken link, a missing page fails); in a new process."""
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        if in_ci():
            pytest.fail("mkdocs missing under CI: `make docs` installs the docs extra")
        pytest.skip("mkdocs not installed (pip install -e '.[docs]')")
    proc = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    html = (tmp_path / "site" / "cli" / "index.html").read_text()
    assert "--max-completion-length" in html and "<!-- slmsql:cli -->" not in html


def test_the_docs_home_shows_the_readmes_result_table():
    """The result table is in the README and copied to the site's home: the two must not drift, and its study rows
    are the ones scripts/results_table.py writes from studies/*/report.json, each naming its study's folder."""
    def section(text):
        start = text.index("## The result it computes")
        return text[start:text.index("\n## ", start + 3)]
    readme = section((ROOT / "README.md").read_text()).replace("](docs/", "](")
    assert readme == section((ROOT / "docs" / "index.md").read_text())
    # the seed's two typed rows (its published counts), then every study's rows as the script writes them
    rows = [line for line in readme.splitlines() if line.startswith("| ")][1:]  # past the header
    typed = [line for line in rows if not line.startswith(results_table.MARK)]
    assert len(typed) == 2 and all(line.startswith("| seed") for line in typed)
    generated, waiting = results_table.generated(ROOT)
    assert [line for line in rows if line.startswith(results_table.MARK)] == generated
    assert all(line in readme for line in waiting)  # the studies with no numbers, named under the table
    named = {re.match(r"\| `studies/([^`/]+)`", line)[1] for line in rows if line not in typed}
    assert named and all((ROOT / "studies" / name / "study.yaml").is_file() for name in named)
    assert "make study-" not in readme  # the Makefile's study targets are gone: `make study STUDY=NAME`
