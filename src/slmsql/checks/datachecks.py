"""Data checks with Great Expectations: is an RL set really the band the experiment claims, is an eval set sound?

The suites are data, not code: `data_checks/<kind>.json` lists GX expectation types and kwargs, each with a
name and a description (see data_checks/README.md). This module only prepares the frames: it reads the file
as-is (so duplicates and missing fields reach GX instead of failing in a reader), adds the derived columns a
suite declares (db_exists, gold_ok, ...) with pandas and the sandbox, and lets GX do all the expecting.

GX imports slowly (~3 s), so it is imported inside `_run_gx`; each `validate` call gets its own ephemeral
context with uniquely named suites.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from slmsql.configs import DEFAULT_DRAW
from slmsql.errors import DataError, SlmsqlError
from slmsql.inputs.data import db_id_problem, db_path, native_record, read_jsonl, safe_text

log = logging.getLogger(__name__)
KINDS = ("rl", "eval", "suite")  # suite: a test suite's manifest.json (`validate_manifest`), not a data file
FRAMES = ("rows", "summary", "files")  # rows: the file itself (suite: its questions); summary: one row of the
# filter's summary totals; files: a suite's database files
N_EXAMPLES = 5


# ------------------------------------------------------------------------------------------------ suites
def suites_dir() -> Path:
    """The suites: data_checks/ as the package carries it (in a checkout, a link to the top-level folder);
    SLMSQL_DATA_CHECKS names another folder."""
    from importlib import resources

    env = os.environ.get("SLMSQL_DATA_CHECKS")
    return Path(env) if env else Path(str(resources.files("slmsql") / "data_checks"))


def load_suite(kind: str) -> dict:
    if kind not in KINDS:
        raise SlmsqlError(f"unknown suite {kind!r}; known: {list(KINDS)}")
    path = suites_dir() / f"{kind}.json"
    if not path.is_file():
        raise SlmsqlError(f"suite file {path} not found (set SLMSQL_DATA_CHECKS to a data_checks folder)")
    try:
        suite = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"malformed JSON: {e.msg}", path, e.lineno) from None
    specs = suite.get("expectations") if isinstance(suite, dict) else None
    if not isinstance(specs, list) or not specs:
        raise DataError("expected {columns, derived, expectations: [...]}", path)
    for i, spec in enumerate(specs):
        if not {"name", "description", "type", "kwargs"} <= set(spec) or spec.get("frame", "rows") not in FRAMES \
                or spec.get("needs") not in (None, *FRAMES, "eval_sets"):
            raise DataError("each expectation needs name, description, type, kwargs; frame rows|summary; "
                            "needs summary|eval_sets", path, field=f"expectations[{i}]")
    names = [spec["name"] for spec in specs]
    if len(set(names)) != len(names):
        raise DataError("expectation names must be unique", path, field="expectations")
    unknown = set(suite.get("derived", {})) - set(DERIVED)
    if unknown:
        raise DataError(f"no derivation for {sorted(unknown)}; known: {sorted(DERIVED)}", path, field="derived")
    suite["path"] = str(path)
    return suite


# ------------------------------------------------------------------------------------------------ frames
def _records(path) -> list[tuple[int, dict]]:
    """(line, record) pairs, untouched apart from BIRD/Spider key mapping. JSON arrays use the index as line."""
    path = Path(path)
    if path.suffix == ".json":
        if not path.is_file():
            raise DataError("no such file", path)
        try:
            records = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"malformed JSON: {e.msg}", path, e.lineno) from None
        if not isinstance(records, list):
            raise DataError("expected a JSON list of questions (BIRD/Spider dev.json)", path)
        pairs = list(enumerate(records))
        pairs = [(i, native_record(r, i) if isinstance(r, dict) else r) for i, r in pairs]
    else:
        rows = read_jsonl(path)  # raises DataError with the line of malformed JSON
        lines = [n for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if raw.strip()]
        pairs = list(zip(lines, rows))
    for line, rec in pairs:
        if not isinstance(rec, dict):
            raise DataError("expected a JSON object", path, line)
    return pairs


def rows_frame(path, columns: dict):
    import pandas as pd

    pairs = _records(path)
    df = pd.DataFrame([safe_text(rec) for _, rec in pairs])  # pandas' Arrow text refuses lone surrogates
    for name in [*columns.get("required", []), *columns.get("optional", [])]:
        # An empty file gets the required columns so only `not_empty` fails; optional ones may be absent.
        if name not in df.columns and (not pairs or name in columns.get("optional", [])):
            df[name] = None
    df.insert(0, "_line", [line for line, _ in pairs])
    if "id" in df.columns:  # ids compare as strings everywhere else (data.read_gold)
        df["id"] = [None if _missing(v) else str(v) for v in df["id"]]
    return df.astype({"_line": "int64"})


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def read_summary(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise DataError("no such file", path)
    try:
        s = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"malformed JSON: {e.msg}", path, e.lineno) from None
    if not isinstance(s, dict) or not isinstance(s.get("buckets"), dict) or not isinstance(s.get("histogram"), dict) \
            or not isinstance(s["buckets"].get("out_of_band", {}), dict):
        raise DataError("expected {n_source, k, low, high, buckets: {..., out_of_band: {...}}, histogram: {...}}",
                        path)
    return s


def summary_frame(s: dict, path, band_rows: int, low: float, high: float):
    """The filter's summary.json as one row of the totals the summary expectations compare."""
    import pandas as pd

    def count(d, key, where):
        value = d.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise DataError(f"expected an integer count, got {value!r}", path, field=where)
        return value

    b = s["buckets"]
    parts = [count(b, key, f"buckets.{key}") for key in ("band", "all_fail", "all_pass", "errors")]
    parts += [count(b["out_of_band"], key, f"buckets.out_of_band.{key}") for key in b.get("out_of_band", {})]
    histogram = sum(count(s["histogram"], key, f"histogram.{key}") for key in s["histogram"])
    return pd.DataFrame([{
        "n_source": count(s, "n_source", "n_source"), "buckets_total": sum(parts), "band": b["band"],
        "band_rows": band_rows, "histogram_total": histogram + b["errors"],  # errors have no pass rate
        "summary_bounds": f"({s.get('low')}, {s.get('high')})", "checked_bounds": f"({low}, {high})"}])


# ------------------------------------------------------------------------------- derived columns (pandas)
# Each returns (values, details): details explain a False to the reader of the report (None when fine).
def _pass_rate_consistent(df, ctx):
    if not {"pass_rate", "k", "n_correct"} <= set(df.columns):
        return [False] * len(df), ["needs pass_rate, k and n_correct"] * len(df)
    values, details = [], []
    for p, k, n in zip(df["pass_rate"], df["k"], df["n_correct"]):
        try:
            if any(isinstance(v, bool) for v in (p, k, n)):
                raise TypeError
            ok = math.isclose(float(n) / float(k), float(p), rel_tol=0, abs_tol=1e-9)
        except (TypeError, ValueError, ZeroDivisionError):
            ok = False
        values.append(ok)
        details.append(None if ok else f"n_correct/k = {n}/{k}, pass_rate = {p}")
    return values, details


def _db_exists(df, ctx):
    cache: dict = {}
    ids = [d if isinstance(d, str) else None for d in df.get("db_id", [None] * len(df))]  # NaN != NaN
    for db_id in ids:
        if db_id not in cache:
            if db_id is None or not db_id.strip():
                cache[db_id] = (False, "no db_id")
                continue
            if why := db_id_problem(db_id):  # a path, not a name: reported here, never looked up
                cache[db_id] = (False, why)
                continue
            p = db_path(ctx["db_root"], db_id)
            if not p.is_file():
                cache[db_id] = (False, f"no database at {p}")
                continue
            with open(p, "rb") as f:
                is_sqlite = f.read(16) == b"SQLite format 3\x00"
            cache[db_id] = (is_sqlite, None if is_sqlite else f"{p} is not an SQLite file")
    pairs = [cache[d] for d in ids]
    return [v for v, _ in pairs], [d for _, d in pairs]


def _gold_ok(df, ctx):
    from slmsql.sql.sandbox import SandboxPool

    exists = df["db_exists"] if "db_exists" in df.columns else _db_exists(df, ctx)[0]
    sqls = df["sql"] if "sql" in df.columns else [None] * len(df)
    todo = [i for i, (ok, sql) in enumerate(zip(exists, sqls)) if ok and isinstance(sql, str)]
    values, details = [False] * len(df), ["not run: no database or no sql"] * len(df)
    if todo:
        jobs = [(str(db_path(ctx["db_root"], df["db_id"].iat[i])), sqls.iat[i]) for i in todo]
        with SandboxPool(min(os.cpu_count() or 1, 1 + len(jobs) // 32)) as pool:
            for i, r in zip(todo, pool.run_gold(jobs)):
                # "truncated": a result over the digest budget cannot be compared (scoring's gold_too_large).
                values[i] = r.status == "ok"
                details[i] = None if values[i] else f"{r.status}: {r.error}"
    return values, details


def _question_key(db_id, question):
    return (db_id, " ".join(str(question).split()).casefold())


def _in_eval_set(df, ctx):
    seen = {}
    for path in ctx["eval_sets"]:
        for line, rec in _records(path):
            if isinstance(rec.get("question"), str):
                seen.setdefault(_question_key(rec.get("db_id"), rec["question"]), f"{path} id={rec.get('id')}")
    cols = [df[c] if c in df.columns else [None] * len(df) for c in ("db_id", "question")]
    hits = [seen.get(_question_key(d, q)) if isinstance(q, str) else None for d, q in zip(*cols)]
    return [h is not None for h in hits], [f"also in {h}" if h else None for h in hits]


def _hash_ok(files, ctx):
    """A suite's files frame: the file is in the suite's folder and its sha256 is the manifest's."""
    import hashlib

    values, details = [], []
    for name, digest in zip(files["name"], files["sha256"]):
        p = Path(ctx["folder"]) / str(name)
        got = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        values.append(got == digest)
        details.append(None if got == digest else f"{p}: " + ("missing" if got is None else f"sha256 {got}"))
    return values, details


DERIVED = {"pass_rate_consistent": _pass_rate_consistent, "db_exists": _db_exists, "gold_ok": _gold_ok,
           "in_eval_set": _in_eval_set, "hash_ok": _hash_ok}


# -------------------------------------------------------------------------------------------- GX + report
@dataclass
class Report:
    kind: str
    data: str
    success: bool
    results: list[dict]          # {expectation, description, success, unexpected_count, examples, error?}
    n_rows: int
    parameters: dict
    skipped: list[dict] = field(default_factory=list)   # {expectation, reason}
    gx_seconds: float = 0.0

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.results if not r["success"]]

    def to_json(self) -> dict:
        return asdict(self)

    def to_markdown(self) -> str:
        verdict = "PASSED" if self.success else f"FAILED ({len(self.failed)} of {len(self.results)} expectations)"
        out = [f"# Data check: {self.kind} suite {verdict}", "",
               f"- file: `{self.data}` ({self.n_rows} rows)",
               *[f"- {k}: {v}" for k, v in self.parameters.items()],
               f"- GX validation: {self.gx_seconds:.2f} s", "",
               "| result | expectation | what it checks | unexpected |", "|---|---|---|---|"]
        for r in self.results:
            n = r["unexpected_count"]
            out.append(f"| {'pass' if r['success'] else '**FAIL**'} | {r['expectation']} | {r['description']} | "
                       f"{'' if n is None else n} |")
        out += [f"| skipped | {s['expectation']} | {s['reason']} | |" for s in self.skipped]
        if self.failed:
            out += ["", "## Failures"]
            for r in self.failed:
                out += ["", f"### {r['expectation']}", r["description"]]
                out += [f"- error: {r['error']}"] if r.get("error") else []
                out += [f"- {_fmt(e)}" for e in r["examples"]]
        return "\n".join(out) + "\n"

    def failure_message(self, where=None) -> str:
        head = (f"data check failed: {self.kind} suite on {self.data}: {len(self.failed)} of "
                f"{len(self.results)} expectations failed" + (f" (report: {where})" if where else ""))
        lines = [head]
        for r in self.failed:
            n = r["unexpected_count"]
            lines.append(f"  {r['expectation']} ({r['description']})" + (f": {n} unexpected" if n else ""))
            lines += [f"      {r['error']}"] if r.get("error") else []
            lines += [f"      e.g. {_fmt(e)}" for e in r["examples"][:3]]
        return "\n".join(lines)


class _Keep(dict):
    def __missing__(self, key):  # a brace in a description that is not a parameter stays as written
        return "{" + key + "}"


def _fmt(example: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in example.items())


def _py(v):
    """numpy scalars and tuples -> JSON-friendly Python values."""
    if hasattr(v, "item") and not isinstance(v, (list, dict, str)):
        v = v.item()
    if isinstance(v, float) and math.isnan(v):
        return None
    return [_py(x) for x in v] if isinstance(v, (tuple, list)) else v


def _examples(result: dict, df, kwargs: dict) -> list[dict]:
    if "partial_unexpected_index_list" not in result:  # table-level: say what was observed
        details = (result.get("details") or {}).get("mismatched") or {}
        if details.get("missing"):
            return [{"missing_columns": details["missing"]}]
        return [{"observed": _py(result["observed_value"])}] if "observed_value" in result else []
    if "_line" not in df.columns:  # the summary frame: GX gives plain row positions; show the compared values
        cols = [kwargs[k] for k in ("column", "column_A", "column_B") if k in kwargs]
        return [{c: _py(df[c].iat[i]) for c in cols} for i in result["partial_unexpected_index_list"][:N_EXAMPLES]]
    rows = df.set_index("_line")
    out = []
    for item in result["partial_unexpected_index_list"][:N_EXAMPLES]:
        item = {k: _py(v) for k, v in item.items()}
        line = item.pop("_line", None)
        ex = {"line": line}
        if "id" in rows.columns:
            ex["id"] = _py(rows.at[line, "id"])
        ex.update(item)
        for col in item:
            if f"{col}_detail" in rows.columns and rows.at[line, f"{col}_detail"]:
                ex["detail"] = rows.at[line, f"{col}_detail"]
        out.append(ex)
    return out


def _error(exception_info: dict) -> str | None:
    """GX reports a raised exception either directly or per metric; either way, its message."""
    infos = [exception_info] if "raised_exception" in exception_info else list(exception_info.values())
    msgs = [i.get("exception_message") for i in infos if isinstance(i, dict) and i.get("raised_exception")]
    return "; ".join(dict.fromkeys(m for m in msgs if m)) or None


def _run_gx(kind: str, frames: dict, specs: list[dict], params: dict, suite_path) -> tuple[dict, float]:
    """Validate each frame against its expectations in one ephemeral context -> ({name: result}, seconds)."""
    # GX logs hundreds of INFO lines while importing, and some modules pin their own logger to INFO
    # (one line per context): quiet the package before the import and every GX logger after it.
    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

    for name in [n for n in logging.root.manager.loggerDict if n.split(".")[0] == "great_expectations"]:
        logging.getLogger(name).setLevel(logging.ERROR)

    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    source = ctx.data_sources.add_pandas("slmsql")
    tag, out, seconds = uuid.uuid4().hex[:8], {}, 0.0
    for frame_name, df in frames.items():
        mine = [s for s in specs if s.get("frame", "rows") == frame_name]
        if not mine:
            continue
        try:
            expectations = [ExpectationConfiguration(type=s["type"], kwargs=s["kwargs"],
                                                      meta={"name": s["name"]}).to_domain_obj() for s in mine]
        except Exception as e:  # a typo in the suite file: name it rather than show GX's traceback
            raise DataError(f"invalid expectation: {e}", suite_path, field="expectations") from None
        batch = source.add_dataframe_asset(frame_name).add_batch_definition_whole_dataframe("all")
        suite = ctx.suites.add(gx.ExpectationSuite(name=f"slmsql-{kind}-{frame_name}-{tag}", expectations=expectations))
        vd = ctx.validation_definitions.add(gx.ValidationDefinition(
            name=f"slmsql-{kind}-{frame_name}-{tag}", data=batch, suite=suite))
        fmt = {"result_format": "SUMMARY", "partial_unexpected_count": N_EXAMPLES}
        if "_line" in df.columns:
            fmt["unexpected_index_column_names"] = ["_line"]
        t0 = time.perf_counter()
        res = vd.run(batch_parameters={"dataframe": df}, expectation_parameters=params, result_format=fmt)
        seconds += time.perf_counter() - t0
        for r in res.results:
            out[r.expectation_config.meta["name"]] = (r, df)
    return out, seconds


def _expect(kind: str, frames: dict, specs: list[dict], params: dict, suite_path) -> tuple[list[dict], float]:
    """GX on the frames -> (one result row per expectation, in the suite's order; seconds)."""
    results, seconds = _run_gx(kind, frames, specs, params, suite_path)
    rows = []
    for s in specs:  # suite order, not GX's
        r, frame = results[s["name"]]
        rows.append({"expectation": s["name"], "description": s["description"].format_map(_Keep(params)),
                     "success": bool(r.success), "unexpected_count": _py(r.result.get("unexpected_count")),
                     "examples": [] if r.success else _examples(r.result, frame, s["kwargs"]),
                     **({"error": _error(r.exception_info)} if _error(r.exception_info) else {})})
    return rows, seconds


def validate_manifest(folder, shown=None) -> Report:
    """The `suite` checks (data_checks/suite.json) on a test suite's folder: its manifest.json's questions
    (coverage a share, told apart within the neighbours, ...) and files (every one hashed, the hash the file's).
    `shown`: the manifest's name in the report (a stage checks its staging folder before it becomes the output)."""
    import pandas as pd

    suite = load_suite("suite")
    path = Path(folder) / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read the manifest: {e}", path) from None
    cols = suite.get("columns", {})
    rows = pd.DataFrame(manifest.get("questions") or [], columns=cols.get("questions"))
    rows.insert(0, "_line", range(len(rows)))
    files = pd.DataFrame(manifest.get("files") or [], columns=cols.get("files"))
    for name in suite.get("derived", {}):  # all on the files frame
        files[name], files[f"{name}_detail"] = DERIVED[name](files, {"folder": folder})
    rows_, seconds = _expect("suite", {"rows": rows, "files": files}, suite["expectations"], {}, suite["path"])
    report = Report("suite", str(shown or path), all(r["success"] for r in rows_), rows_, len(rows),
                    {"files": len(files)}, [], seconds)
    log.info("data check suite on %s: %s", path, "passed" if report.success else "FAILED")
    return report


def validate(kind: str, data, db_root, *, summary=None, eval_sets=(), low: float = 0.2,
             high: float = 0.8, min_band: int = DEFAULT_DRAW.questions) -> Report:
    """Run the `kind` suite (data_checks/<kind>.json) on `data`. Bad files raise DataError; failed
    expectations do not raise: they are in the report. `min_band` (rl): the fewest rows the band may hold, what
    one GRPO optimizer step draws (configs.step_draw)."""
    if kind == "suite":
        raise SlmsqlError("the suite checks read a suite's folder: validate_manifest(folder)")
    suite = load_suite(kind)
    if kind == "rl" and not 0 <= low < high <= 1:
        raise SlmsqlError(f"need 0 <= low < high <= 1, got low={low} high={high}")
    eval_sets = [str(p) for p in eval_sets if str(p).strip()]
    df = rows_frame(data, suite.get("columns", {}))
    summary_doc = read_summary(summary) if summary else None  # before the slow part: fail fast
    ctx = {"db_root": db_root, "eval_sets": eval_sets}
    for name in suite.get("derived", {}):
        if name == "in_eval_set" and not eval_sets:
            continue
        df[name], df[f"{name}_detail"] = DERIVED[name](df, ctx)

    k_values = []  # the one allowed k: the summary's, else the file's most common
    if summary_doc and isinstance(summary_doc.get("k"), int) and not isinstance(summary_doc["k"], bool):
        k_values = [summary_doc["k"]]
    elif "k" in df.columns and df["k"].notna().any():
        k_values = [_py(Counter(df["k"].dropna()).most_common(1)[0][0])]
    params = {"low": low, "high": high, "min_band": min_band, "k_values": k_values,
              "required_columns": suite.get("columns", {}).get("required", [])}
    frames = {"rows": df}
    if summary:
        frames["summary"] = summary_frame(summary_doc, summary, len(df), low, high)
    given = {"summary": bool(summary), "eval_sets": bool(eval_sets)}
    specs = [s for s in suite["expectations"] if given.get(s.get("needs"), True)]
    skipped = [{"expectation": s["name"], "reason": f"no {s['needs']} given"}
               for s in suite["expectations"] if not given.get(s.get("needs"), True)]

    rows, seconds = _expect(kind, frames, specs, params, suite["path"])
    shown = {"low": low, "high": high, "min_band": min_band, "k": k_values} if kind == "rl" else {}
    shown.update({"db_root": str(db_root), "summary": str(summary) if summary else None,
                  "eval_sets": eval_sets})
    report = Report(kind, str(data), all(r["success"] for r in rows), rows, len(df), shown, skipped, seconds)
    log.info("data check %s on %s: %s (%d expectations, %d failed)", kind, data,
             "passed" if report.success else "FAILED", len(rows), len(report.failed))
    return report


def run_rl_check(band_file, db_root, summary_file, low, high, eval_sets=(),
                 min_band: int = DEFAULT_DRAW.questions) -> Report:
    """The filter stage's guard on its own output."""
    return validate("rl", band_file, db_root, summary=summary_file, eval_sets=eval_sets, low=low, high=high,
                    min_band=min_band)
