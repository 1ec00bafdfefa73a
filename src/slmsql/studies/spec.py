"""A study's declaration, `studies/<name>/study.yaml`: read through the stages' own config classes and checked
before anything runs. The commit that adds the file is the study's pre-registration.

    question: Does GRPO raise greedy EX on the band it trains on?
    experiment: slmsql-control             # MLflow experiment of its runs
    start:                                 # how the start is made: SFT of `model` (omit `sft` and give
      model: outputs/tiny-model            #   `adapter` for a given start, neither for `model` itself
      sft: {max_steps: 700}                #   zero-shot, or `from: studies/OTHER` for another study's
      pin: true                            #   pinned start); `pin` copies the made start (policy and
                                           #   band; a zero-shot start's band alone) into the folder, so
                                           #   another machine continues without remaking it
    band: {limit: 0, low: 0.1, high: 0.9}  # the filter's options
    db_root: outputs/toy/databases
    grpo: {max_steps: 600, learning_rate: 3e-4}     # every cell's GRPO options
    evaluate: {limit: 0}                            # every evaluation's options
    arms: {outcome: {}, dense: {recipe: recipes/rewards/dense.yaml}}   # arm -> its GRPO options, and
                                           #   `train_on: sample` for an arm that trains on as many of the
                                           #   filter's questions, drawn unfiltered (default: the band)
    seeds: [0, 1, 2]
    eval_sets: [{name: toy-band-seen, data: band}]  # `band`: the start's own band; `db_ids: [..]` keeps
                                           #   only a file's questions on those databases (a split)
    comparisons: [{arm: dense, against: outcome}]   # the Holm family (default: each arm vs the start)
    secondary: [{arm: dense, eval_sets: [toy-band-seen]}]   # reported beside it, each p unadjusted: outside
                                           #   the family (not bound to the records, as references are not)
    references: {zero-shot: {model: HuggingFaceTB/SmolLM2-135M-Instruct}}   # evaluated beside the start on every
                                           #   eval set (a model, `adapter` optional), outside the Holm family
    plan: {...}    # the figures `slmsql plan` gave, copied into the report
    budget: {cell_minutes: 4, cpus_per_cell: 2, gpus_per_cell: 0}
    continue_with: [{code_version: abc123456789, reason: ...}]   # code accepted beside the start's
    amendments: [{declaration: 0f1e2d3c4b5a, reason: ..., date: 2026-12-05}]   # a declaration changed after
                                           #   the start's record, accepted by its hash (studies/binding.py)

Each section's keys are the fields of its stage (`slmsql sft|filter|grpo|evaluate --help`), `recipe` stacks
recipe files as `--recipe` does, and the fields the study sets itself (model, data, seed, output folders) are
refused. Every error names the file, the line and the key.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from slmsql import configs
from slmsql.configs import EvaluateConfig, FilterConfig, GRPOStageConfig, SFTStageConfig
from slmsql.errors import DataError

FILE = "study.yaml"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
STEP = ("output_dir", "overwrite", "experiment", "run_name", "resume")  # where a step writes: the study's
# per section: its stage config and the fields the study sets itself (refused in the file)
SECTIONS = {
    "sft": (SFTStageConfig, STEP + ("model", "base_adapter", "seed", "db_root")),  # the study's one db_root
    "band": (FilterConfig, STEP + ("model", "adapter", "db_root")),
    "grpo": (GRPOStageConfig, tuple(configs.SWEEP_OWNED)),
    "evaluate": (EvaluateConfig, STEP + ("model", "adapter", "data", "db_ids", "db_root", "dataset_name",
                                         "baseline_run", "predictions", "alpha", "seed")),
}
TOP = {"question", "title", "experiment", "start", "band", "db_root", "grpo", "evaluate", "arms", "seeds",
       "eval_sets", "comparisons", "secondary", "references", "alpha", "plan", "budget", "continue_with", "amendments"}
REFERENCE = "ref-"  # a reference's record is records/ref-<name>.json
BUDGET = {"cell_minutes": 0.0, "cpus_per_cell": 1.0, "gpus_per_cell": 0.0}
BAND = "band"  # an eval set whose data is the start's band
TRAIN_ON = ("band", "sample")  # what an arm's GRPO trains on: the band, or as many source questions unfiltered


@dataclass(frozen=True)
class EvalSet:
    name: str
    data: str  # a gold file, or BAND
    db_root: str
    db_ids: tuple[str, ...] = ()  # only the file's questions on these databases (empty: all)


@dataclass(frozen=True)
class Cell:
    arm: str
    seed: int

    @property
    def id(self) -> str:
        return f"{self.arm}-seed{self.seed}"


@dataclass
class Study:
    folder: Path
    name: str
    question: str
    title: str
    experiment: str
    model: str  # the start's base model: a Hub id or a path
    sft: dict | None  # the SFT step's options, or None for a given start
    adapter: str  # a given start: a PEFT adapter on `model`, or a whole model folder
    pin: bool
    start_from: str  # another study's folder: its pinned start (policy and band) is this one's
    band: dict
    db_root: str
    grpo: dict
    evaluate: dict
    arms: dict[str, dict]
    seeds: list[int]
    eval_sets: list[EvalSet]
    comparisons: list[dict]  # {arm, against: "start" or an arm, eval_set}: the Holm family, in order
    references: dict[str, dict] = field(default_factory=dict)  # name -> {model, adapter}: evaluated, not trained
    secondary: list[dict] = field(default_factory=list)  # comparisons outside the Holm family, as `comparisons`
    alpha: float = 0.05
    plan: dict = field(default_factory=dict)
    budget: dict = field(default_factory=lambda: dict(BUDGET))
    continue_with: list[dict] = field(default_factory=list)
    amendments: list[dict] = field(default_factory=list)  # {declaration: hash, reason, date}, in declared order
    train_on: dict[str, str] = field(default_factory=dict)  # arm -> "sample" where it is not the band

    @property
    def zero_shot(self) -> bool:
        """The start is the base model itself: no SFT, no adapter (its policy is `model`, by Hub id or path)."""
        return not self.start_from and self.sft is None and not self.adapter

    @property
    def path(self) -> Path:
        return self.folder / FILE

    @property
    def records(self) -> Path:
        return self.folder / "records"

    @property
    def pinned(self) -> Path:
        return self.folder / "start"

    def cells(self) -> list[Cell]:
        """Every declared cell, in declaration order (arms as written, then seeds): what --shard K/N splits."""
        return [Cell(arm, seed) for arm in self.arms for seed in self.seeds]

    def grpo_config(self, arm: str) -> GRPOStageConfig:
        """The GRPO config every cell of `arm` trains with (paths and seed set per cell)."""
        recipes = self.grpo.get("recipe", []) + self.arms[arm].get("recipe", [])  # stacked: the arm's win
        return _resolve(GRPOStageConfig, {**self.grpo, **self.arms[arm], "recipe": recipes})

    def evaluate_config(self) -> EvaluateConfig:
        return _resolve(EvaluateConfig, self.evaluate)

    def filter_config(self) -> FilterConfig:
        """The filter's options as the start's filter step ran them (recipes stacked; this study's own `band`)."""
        return _resolve(FilterConfig, self.band)

    def cell_config(self, cell: Cell) -> dict:
        """What a cell's record must carry: the results it holds were computed under exactly this."""
        return {"arm": cell.arm, "seed": cell.seed, "grpo": _kept(self.grpo_config(cell.arm), "grpo"),
                "evaluate": _kept(self.evaluate_config(), "evaluate"), "eval_sets": [es.name for es in self.eval_sets],
                **({"train_on": self.train_on[cell.arm]} if cell.arm in self.train_on else {})}

    def reference_config(self, name: str) -> dict:
        """What a reference's record must carry: the policy it evaluated and how."""
        return {"reference": name, **self.references[name], "evaluate": _kept(self.evaluate_config(), "evaluate"),
                "eval_sets": [es.name for es in self.eval_sets]}

    def start_config(self) -> dict:
        """What the start record must carry: how the start was made and its band drawn."""
        if self.start_from:
            return {"from": Path(self.start_from).name, "eval_sets": [es.name for es in self.eval_sets]}
        return {"model": self.model, "adapter": self.adapter, "sft": self.sft, "band": self.band,
                "eval_sets": [es.name for es in self.eval_sets]}

    def accepted_code(self, start_code: str) -> set[str]:
        """The code versions whose cells pool: the start's, and those `continue_with` added (docs/stages/study.md)."""
        return {start_code, *(c["code_version"] for c in self.continue_with)}

    def as_dict(self) -> dict:
        """The declaration as the report reads it (plain data)."""
        return {"name": self.name, "question": self.question, "title": self.title, "alpha": self.alpha,
                "arms": list(self.arms), "seeds": self.seeds, "eval_sets": [es.name for es in self.eval_sets],
                "comparisons": self.comparisons, "plan": self.plan, "budget": self.budget,
                "amendments": self.amendments, "references": self.references,
                **({"train_on": self.train_on} if self.train_on else {}),
                **({"secondary": self.secondary} if self.secondary else {}),
                "cells": [{"cell": c.id, "arm": c.arm, "seed": c.seed} for c in self.cells()]}


def _kept(cfg, section: str) -> dict:
    """A section's options as a record carries them: not those the study sets, nor where evaluate ran (local, Ray)."""
    skip = set(SECTIONS[section][1]) | set(configs.RUN_ONLY) | {f.name for f in configs.fields(configs.Engine)}
    return {k: v for k, v in configs.to_params(cfg).items() if k not in skip}


def _resolve(cls, section: dict):
    values = {k: v for k, v in section.items() if k != "recipe"}
    return configs.load(cls, ",".join(section.get("recipe", [])) or None, values, require=False)


def _lines(node, prefix=()) -> dict:
    """key path -> line (1-based) of every mapping key and list item in a composed YAML node."""
    out = {}
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            path = (*prefix, str(k.value))
            out[path] = k.start_mark.line + 1
            out.update(_lines(v, path))
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out[(*prefix, i)] = v.start_mark.line + 1
            out.update(_lines(v, (*prefix, i)))
    return out


class _Reader:
    """Errors located by key path: `fail(("grpo", "max_steps"), ...)` names the file, that key's line and field."""

    def __init__(self, path: Path, lines: dict):
        self.path, self.lines = path, lines

    def fail(self, key: tuple, message: str):
        while key and key not in self.lines:
            key = key[:-1]
        name = ".".join(str(k) for k in key) or None
        raise DataError(message, self.path, self.lines.get(key), field=name)

    def mapping(self, value, key: tuple, allowed=None) -> dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.fail(key, "expected a mapping of key: value")
        for k in value:
            if allowed is not None and k not in allowed:
                self.fail((*key, str(k)), f"unknown key; known: {sorted(allowed)}")
        return value

    def section(self, value, key: tuple, name: str) -> dict:
        """A stage section: its keys coerced by the stage's own config class, recipes checked now."""
        cls, owned = SECTIONS[name]
        out = {}
        for k, v in self.mapping(value, key).items():
            if k == "recipe":
                paths = v if isinstance(v, list) else configs.recipe_paths(str(v))
                paths = [found(p) for p in paths]
                for p in paths:
                    if not p.is_file():
                        self.fail((*key, k), f"recipe not found: {p}")
                    configs.recipe_values(cls, p)  # its own errors name its file, line and field
                out[k] = [str(p) for p in paths]
                continue
            if k not in {f.name for f in configs.fields(cls)}:
                self.fail((*key, k), f"not an option of {cls.__name__}; known: "
                                     f"{sorted({f.name for f in configs.fields(cls)} - set(owned))}")
            if k in owned:
                self.fail((*key, k), "set by the study itself, not by its file")
            try:
                out[k] = configs.coerce(cls, k, v, self.path)
            except DataError as e:
                self.fail((*key, k), str(e).split("': ", 1)[-1])
        try:  # the values together (a cross-field rule such as max_steps with num_train_epochs)
            _resolve(cls, {**out, "recipe": []})
        except DataError as e:
            self.fail((*key, e.field) if e.field else key, str(e).split("': ", 1)[-1])
        return out


def spec_of_start(study: Study) -> Study:
    """The study whose declaration says how `study`'s start was made: itself, or the one start.from names."""
    return load(found(study.start_from)) if study.start_from else study


def found(path) -> Path:
    """A recipe or a study folder a declaration names, as this process finds it: relative to the folder it runs
    in, else to the project's (studies/ and recipes/ live there), so that a report is made from any folder."""
    from slmsql.workflow.steps import ROOT

    path = Path(path)
    return path if path.is_absolute() or path.exists() or not (ROOT / path).exists() else ROOT / path


def load(folder, _via: tuple = ()) -> Study:
    """The study in `folder`, every key checked; files are checked by `check_files` before a run. (`_via`: the
    studies whose start.from led here, so that a cycle is refused by name.)"""
    folder = Path(folder)
    path = folder / FILE
    if not path.is_file():
        raise DataError(f"no {FILE} in the study folder", folder)
    text = path.read_text(encoding="utf-8")
    try:
        node = yaml.compose(text, Loader=configs.RecipeLoader)
        doc = yaml.load(text, Loader=configs.RecipeLoader) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise DataError(f"malformed YAML: {e}", path, mark.line + 1 if mark else None) from None
    r = _Reader(path, _lines(node))
    doc = r.mapping(doc, (), TOP)
    for key in ("question", "start", "arms", "seeds", "eval_sets"):
        if key not in doc:
            r.fail((), f"missing key '{key}'")
    start = r.mapping(doc["start"], ("start",), {"model", "sft", "adapter", "pin", "from"})
    if "from" in start:  # another study's start: its declaration says how it was made
        if set(start) - {"from"}:
            r.fail(("start",), "start.from takes the other study's start as it is: give no other start key")
        other = found(str(start["from"]))
        if other.resolve() == folder.resolve() or not (other / FILE).is_file():
            r.fail(("start", "from"), f"expected another study's folder (holding {FILE}), got {other}")
        chain = (*_via, folder.resolve())
        if other.resolve() in chain:
            r.fail(("start", "from"), "a cycle of start.from: "
                                      + " -> ".join(str(f) for f in (*chain, other.resolve())))
        start = {"model": load(other, chain).model, "from": str(other)}
    elif not start.get("model"):
        r.fail(("start",), "give the start's base model: start.model (a Hub id or a path)")
    elif "sft" in start and start.get("adapter"):
        r.fail(("start",), "give start.sft (how the start is made), start.adapter (a given start), neither (the "
                           "model zero-shot) or start.from (another study's), not both sft and adapter")
    arms = r.mapping(doc["arms"], ("arms",))
    if not arms:
        r.fail(("arms",), "declare at least one arm")
    for i, name in enumerate(arms):
        if not NAME.match(str(name)):
            r.fail(("arms", str(name)), "an arm's name is letters, digits, '.', '_' or '-'")
        twin = next((a for a in list(arms)[:i] if str(a).casefold() == str(name).casefold()), None)
        if twin is not None:  # one record file for both on a case-insensitive file system (macOS, Windows)
            r.fail(("arms", str(name)), f"differs from arm {twin!r} only in case: their records would collide")
    seeds = doc["seeds"]
    whole = lambda s: isinstance(s, int) and not isinstance(s, bool)  # noqa: E731  (YAML's true is an int in Python)
    if not isinstance(seeds, list) or not seeds or not all(whole(s) for s in seeds):
        r.fail(("seeds",), "expected a list of whole numbers, e.g. [0, 1, 2]")
    for i, s in enumerate(seeds):
        if s in seeds[:i]:
            r.fail(("seeds", i), f"seed {s} is listed twice")
    train_on = {}
    for name, value in arms.items():  # `train_on` is the study's, not a GRPO option: taken out before those
        if isinstance(value, dict) and "train_on" in value:
            arms[name] = {k: v for k, v in value.items() if k != "train_on"}
            if value["train_on"] not in TRAIN_ON:
                r.fail(("arms", str(name), "train_on"), f"one of {list(TRAIN_ON)}")
            if value["train_on"] == "sample":
                train_on[str(name)] = "sample"
    db_root = str(doc.get("db_root", "outputs/toy/databases"))
    sets = _eval_sets(r, doc["eval_sets"], db_root)
    study = Study(
        folder=folder, name=folder.resolve().name, question=str(doc["question"]).strip(),
        title=str(doc.get("title", folder.resolve().name)).strip(), experiment=str(doc.get("experiment", "slmsql")),
        model=str(start["model"]), sft=r.section(start["sft"], ("start", "sft"), "sft") if "sft" in start else None,
        adapter=str(start.get("adapter") or ""), pin=bool(start.get("pin", False)),
        start_from=str(start.get("from", "")),
        band=r.section(doc.get("band"), ("band",), "band"), db_root=db_root,
        grpo=r.section(doc.get("grpo"), ("grpo",), "grpo"),
        evaluate=r.section(doc.get("evaluate"), ("evaluate",), "evaluate"),
        arms={str(k): r.section(v, ("arms", str(k)), "grpo") for k, v in arms.items()}, seeds=seeds, eval_sets=sets,
        comparisons=_comparisons(r, doc.get("comparisons"), list(arms), [es.name for es in sets]),
        references=_references(r, doc.get("references")),
        secondary=_comparisons(r, doc["secondary"], list(arms), [es.name for es in sets], "secondary")
        if doc.get("secondary") is not None else [],  # absent or null: none (not, as `comparisons`, every arm)
        alpha=float(doc.get("alpha", 0.05)), plan=r.mapping(doc.get("plan"), ("plan",)),
        budget={**BUDGET, **{k: float(v) for k, v in r.mapping(doc.get("budget"), ("budget",), set(BUDGET)).items()}},
        continue_with=_continue_with(r, doc.get("continue_with")),
        amendments=_amendments(r, doc.get("amendments")), train_on=train_on)
    for row in study.secondary:
        if row in study.comparisons:
            r.fail(("secondary",), f"{row} is in the Holm family (comparisons) already")
    if study.start_from and "band" in doc:
        r.fail(("band",), "a start taken from another study (start.from) comes with that study's band")
    if not 0 < study.alpha < 1:
        r.fail(("alpha",), f"must lie strictly between 0 and 1, got {study.alpha}")
    for arm in study.arms:  # each arm's GRPO config resolves (recipes stacked with the arm's own keys)
        try:
            study.grpo_config(arm)
        except DataError as e:
            r.fail(("arms", arm), str(e))
    return study


def _eval_sets(r: _Reader, value, db_root: str) -> list[EvalSet]:
    if not isinstance(value, list) or not value:
        r.fail(("eval_sets",), "expected a list of {name, data} (data: a gold file, or 'band')")
    out = []
    for i, item in enumerate(value):
        item = r.mapping(item, ("eval_sets", i), {"name", "data", "db_root", "db_ids"})
        if not item.get("name") or not item.get("data"):
            r.fail(("eval_sets", i), "give both name and data")
        if not NAME.match(str(item["name"])) or str(item["name"]) in [es.name for es in out]:
            r.fail(("eval_sets", i, "name"), f"a new name of letters, digits, '.', '_' or '-', got {item['name']!r}")
        ids = item.get("db_ids", [])
        if not isinstance(ids, list) or not all(isinstance(x, str) and x for x in ids) or len(set(ids)) < len(ids):
            r.fail(("eval_sets", i, "db_ids"), "expected a list of distinct database names (db_id)")
        if ids and item["data"] == BAND:
            r.fail(("eval_sets", i, "db_ids"), "the band is the start's own questions: no db_ids")
        out.append(EvalSet(str(item["name"]), str(item["data"]), str(item.get("db_root", db_root)), tuple(ids)))
    return out


def _comparisons(r: _Reader, value, arms: list[str], sets: list[str], key: str = "comparisons") -> list[dict]:
    """The Holm family (or, as `secondary`, the comparisons outside it), expanded over eval sets: each declared
    comparison on each of its sets."""
    if value is None:
        return [{"arm": a, "against": "start", "eval_set": s} for a in arms for s in sets]
    if not isinstance(value, list) or not value:
        r.fail((key,), "expected a list of {arm, against, eval_sets}")
    out = []
    for i, item in enumerate(value):
        item = r.mapping(item, (key, i), {"arm", "against", "eval_sets"})
        arm, against = item.get("arm"), item.get("against", "start")
        if arm not in arms:
            r.fail((key, i, "arm"), f"no such arm {arm!r}; declared: {arms}")
        if against != "start" and (against not in arms or against == arm):
            r.fail((key, i, "against"), f"'start' or another declared arm, got {against!r}")
        chosen = item.get("eval_sets", sets)
        for s in chosen:
            if s not in sets:
                r.fail((key, i, "eval_sets"), f"no such eval set {s!r}; declared: {sets}")
            row = {"arm": arm, "against": against, "eval_set": s}
            if row in out:
                r.fail((key, i), f"declared twice: {row}")
            out.append(row)
    return out


def _references(r: _Reader, value) -> dict[str, dict]:
    """Policies evaluated beside the start on every eval set, not trained (a base model zero-shot, a published
    adapter): name -> {model, adapter}."""
    out = {}
    for name, item in r.mapping(value, ("references",)).items():
        item = r.mapping(item, ("references", str(name)), {"model", "adapter"})
        if not NAME.match(str(name)):
            r.fail(("references", str(name)), "a reference's name is letters, digits, '.', '_' or '-'")
        if not str(item.get("model") or "").strip():
            r.fail(("references", str(name)), "give the reference's model (a Hub id or a path)")
        out[str(name)] = {"model": str(item["model"]), "adapter": str(item.get("adapter") or "")}
    return out


def _continue_with(r: _Reader, value) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        r.fail(("continue_with",), "expected a list of {code_version, reason}")
    for i, item in enumerate(value):
        item = r.mapping(item, ("continue_with", i), {"code_version", "reason"})
        if not item.get("code_version") or not str(item.get("reason", "")).strip():
            r.fail(("continue_with", i), "give both code_version and reason (why the new code may pool)")
    return [{"code_version": str(x["code_version"]), "reason": str(x["reason"]).strip()} for x in value]


def _amendments(r: _Reader, value) -> list[dict]:
    """Changes to the declaration made after its start was recorded, each accepted by the hash of the declaration
    it leads to (the refusal names it), with why and when: the report lists them."""
    if value is None:
        return []
    if not isinstance(value, list):
        r.fail(("amendments",), "expected a list of {declaration, reason, date}")
    out = []
    for i, item in enumerate(value):
        item = r.mapping(item, ("amendments", i), {"declaration", "reason", "date"})
        if not all(str(item.get(k) or "").strip() for k in ("declaration", "reason", "date")):
            r.fail(("amendments", i), "give declaration (the hash the refusal named), reason and date")
        if not re.fullmatch(r"[0-9a-f]{12,64}", str(item["declaration"])):
            r.fail(("amendments", i, "declaration"), f"expected a hex hash, got {item['declaration']!r}")
        out.append({"declaration": str(item["declaration"]), "reason": str(item["reason"]).strip(),
                    "date": str(item["date"])})
    return out


def check_files(study: Study) -> None:
    """Every input file the declaration names, checked before any step runs (a `runs:/` or Hub id aside)."""
    def need(path: str, key: tuple, folder=False):
        if path and not (Path(path).is_dir() if folder else Path(path).is_file()):
            raise DataError(f"no such {'folder' if folder else 'file'}: {path}", study.path, field=".".join(key))

    need(study.db_root, ("db_root",), folder=True)
    if not study.start_from:
        need(str(study.band.get("data", configs.default(_field(FilterConfig, "data")))), ("band", "data"))
    for i, es in enumerate(study.eval_sets):
        if es.data != BAND:
            need(es.data, ("eval_sets", str(i), "data"))
        need(es.db_root, ("eval_sets", str(i), "db_root"), folder=True)
    if study.adapter:
        need(study.adapter, ("start", "adapter"), folder=True)
    for name, ref in study.references.items():
        if ref["adapter"]:
            need(ref["adapter"], ("references", name, "adapter"), folder=True)
        if ref["model"].startswith(("outputs/", "./", "/")):
            need(ref["model"], ("references", name, "model"), folder=True)
    if study.sft is not None:
        need(str(study.sft.get("data", configs.default(_field(SFTStageConfig, "data")))), ("start", "sft", "data"))
    if Path(study.model).exists() or study.model.startswith(("outputs/", "./", "/")):
        need(study.model, ("start", "model"), folder=True)


def _field(cls, name: str) -> dataclasses.Field:
    return {f.name: f for f in configs.fields(cls)}[name]
