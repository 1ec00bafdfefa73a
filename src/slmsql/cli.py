"""`slmsql <stage>`: every MLproject entry point is one of these commands, with options generated from
the stage's config dataclass (configs.py)."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
import typing

import click

from slmsql import configs
from slmsql.errors import SlmsqlError
from slmsql.runtime import distributed
from slmsql.tracking import runs as tracking


def stage_module(stage: str) -> str:
    """`tiny-model` -> `slmsql.stages.tiny_model`: the one rule from a command to its module."""
    return f"slmsql.stages.{stage.replace('-', '_')}"


def _options(cls, skip=(), recipe=True):
    hints = typing.get_type_hints(cls)

    def decorate(fn):
        for f in reversed([f for f in dataclasses.fields(cls) if f.name not in skip]):
            flag = "--" + f.name.replace("_", "-")
            hint, help_ = hints[f.name], f.metadata.get("help", "")
            default = configs.default(f)
            if isinstance(default, list):
                default = ",".join(map(str, default))
            help_ += f"  [default: {default}]" if default not in ("", {}) else ""
            if hint is bool:
                # `--flag` alone means true; `--flag false` is how MLproject passes a value.
                fn = click.option(flag, f.name, type=click.BOOL, is_flag=False, flag_value=True,
                                  default=None, help=help_)(fn)
            elif hint is dict:
                fn = click.option(flag, f.name, multiple=True, metavar="KEY=VALUE", help=help_)(fn)
            else:
                ptype = click.Choice(f.metadata["choices"]) if "choices" in f.metadata else (
                    str if configs.list_type(hint) else hint)  # lists: comma-separated, split by configs
                fn = click.option(flag, f.name, type=ptype, default=None, help=help_)(fn)
        if not recipe:
            return fn
        return click.option("--recipe", type=click.Path(), default=None,
                            help="YAML recipe setting any of these options (recipes/); several, comma-separated, "
                                 "stack in order (a later one's keys win).")(fn)
    return decorate


def _command(stage: str, cls):
    @click.pass_context
    def run(ctx, recipe, **values):
        for name in ("trainer_args", "overrides"):  # KEY=VALUE options, repeatable
            if name in values:
                values[name] = " ".join(values[name]) or None
        # `mlflow run` (which sets MLFLOW_RUN_ID) passes every parameter, defaults included
        cfg = configs.load(cls, recipe, values, defaults_yield=bool(os.environ.get("MLFLOW_RUN_ID")))
        if distributed.world_size() > 1:  # started by torchrun / accelerate launch with several processes
            if not cls.multiprocess:
                distributed.refuse(stage)
            distributed.terminate_as_exit()
        cfg = tracking.fetch_inputs(cfg)  # options given as runs:/<id>/<path>: a local copy of that artifact
        # stages are imported only when run, so `--help` stays fast
        result = importlib.import_module(stage_module(stage)).main(cfg)
        ctx.obj = result

    return click.command(stage, help=cls.__doc__)(_options(cls)(run))


class Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except SlmsqlError as e:  # users' mistakes: a message and a non-zero exit, no traceback
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


@click.group(cls=Group)
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose):
    """slmsql: an MLflow-tracked RL lifecycle for small Text-to-SQL models."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "alembic", "mlflow.store", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


for _stage, _cls in configs.STAGES.items():
    main.add_command(_command(_stage, _cls))


@main.group("study")
def study_group():
    """A study declared in FOLDER/study.yaml, its cells kept as records in FOLDER/records/ (docs/stages/study.md)."""


def _study_command(action: str, cls):
    def run(folder, **values):
        cfg = configs.load(cls, None, {**values, "study": folder})
        return getattr(importlib.import_module(stage_module("study")), action)(cfg)

    command = click.argument("folder", type=click.Path(file_okay=False))(_options(cls, skip=("study",), recipe=False)(run))
    return click.command(action, help=cls.__doc__)(command)


for _action, _cls in configs.STUDY_COMMANDS.items():
    study_group.add_command(_study_command(_action, _cls))


@main.group("suite")
def suite_group():
    """Test suites built from Spider-format schemas and gold queries (docs/stages/suite.md)."""


def _suite_command(action: str, cls):
    def run(**values):
        cfg = tracking.fetch_inputs(configs.load(cls, None, values))  # runs:/<id>/<path> inputs, as the stages'
        return getattr(importlib.import_module(stage_module("suite")), action)(cfg)

    return click.command(action, help=cls.__doc__)(_options(cls, recipe=False)(run))


for _action, _cls in configs.SUITE_COMMANDS.items():
    suite_group.add_command(_suite_command(_action, _cls))


@main.command("mlproject")
def mlproject_cmd():
    """Print the MLproject file generated from the stage configs."""
    from slmsql.workflow.mlproject import render

    click.echo(render(), nl=False)


@main.command("server")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface (loopback by default).")
@click.option("--port", default=5000, show_default=True, type=int)
@click.option("--store", default="mlflow-server.db", show_default=True, help="SQLite backend store file.")
@click.option("--backend-store-uri", default=None,
              help="Backend store URI instead of --store, e.g. postgresql+psycopg2://user:pw@host:5432/mlflow.")
@click.option("--artifacts", default="mlartifacts", show_default=True, help="Served artifact folder.")
def server_cmd(host, port, store, backend_store_uri, artifacts):
    """Start a real `mlflow server` (served artifacts, no job runner) and keep it in the foreground."""
    import signal

    from slmsql.tracking.runs import start_server

    proc, uri = start_server(host, port, backend_store_uri or store, artifacts)
    click.echo(f"MLflow server ready. In other shells:\n  export MLFLOW_TRACKING_URI={uri}\n"
               f"UI: {uri}   (Ctrl-C stops it)")
    # SIGTERM (a service manager, `kill`) stops the server like Ctrl-C: otherwise this process dies alone and
    # leaves `mlflow server` and its uvicorn worker running, still holding the port.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait(timeout=60)


@main.command("sync-tracking")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--resend-refused", is_flag=True,
              help="Also send again the records the server refused (set aside beside FOLDER), once the cause is "
                   "fixed; those it refuses again stay set aside.")
def sync_tracking_cmd(folder, resend_refused):
    """Send the tracking records a training stage kept in FOLDER (`<output-dir>.outbox`) while its MLflow server
    did not answer or turned its credentials away, in order; the run then ends as the stage ended it. FOLDER is
    deleted once all are sent. Then show the records the server refused (set aside in `FOLDER.refused.jsonl`,
    their files in `FOLDER.refused/`), with its reasons."""
    from slmsql.tracking.durable import refused, refused_file, sync
    from slmsql.tracking.durable import resend_refused as resend

    aside = refused(folder)
    if os.path.exists(folder) or not aside:  # an outbox all sent is gone; what it set aside is not
        n, uri = sync(folder)
        click.echo(f"sent {n} tracking record(s) to {uri}; removed {folder}")
    if resend_refused and refused(folder):
        n, left = resend(folder)
        click.echo(f"sent {n} set-aside tracking record(s) again; {left} refused again")
    aside = refused(folder)
    if aside:
        click.echo(f"{len(aside)} record(s) the tracking server refused, set aside in {refused_file(folder)}:\n  "
                   + "\n  ".join(aside) + f"\nOnce the cause is fixed, send them again with: slmsql sync-tracking "
                   f"{folder} --resend-refused (or delete that file and {folder}.refused/)")


@main.command("runs")
@click.option("--experiment", default="slmsql", show_default=True)
@click.option("--limit", default=20, show_default=True, type=int)
def runs_cmd(experiment, limit):
    """A compact table of the latest runs of each stage in the tracking store."""
    from slmsql.tracking.runs import runs_table

    click.echo(runs_table(experiment, limit))


def reference_markdown() -> str:
    """The docs' CLI reference (docs/cli.md, through docs/hooks.py): every stage's options as the commands above
    define them from configs.py: flag, type, default, help, and the key a recipe sets."""
    from slmsql.workflow.mlproject import entry_point

    def type_name(hint, f):
        if "choices" in f.metadata:
            return " \\| ".join(f.metadata["choices"])
        return getattr(hint, "__name__", str(hint)).replace("|", "or")

    out = []
    commands = [(stage, cls, f"MLproject entry point `{entry_point(stage)}`; `--recipe FILE` reads a YAML recipe that "
                 "sets any recipe key (default < recipe < command line); `--recipe A,B` stacks two (B's keys win).")
                for stage, cls in configs.STAGES.items()]
    commands += [(f"study {action} FOLDER", cls, "FOLDER holds the study's study.yaml, which declares everything "
                  "else ([Study](stages/study.md)); no MLproject entry point, no recipe.")
                 for action, cls in configs.STUDY_COMMANDS.items()]
    commands += [(f"suite {action}", cls, "[Test suites](stages/suite.md); no MLproject entry point, no recipe.")
                 for action, cls in configs.SUITE_COMMANDS.items()]
    for stage, cls, intro in commands:
        hints = typing.get_type_hints(cls)
        out += [f"## `slmsql {stage}`", "", " ".join((cls.__doc__ or "").split()), "", intro, "",
                "| option | recipe key | type | default | meaning |", "|---|---|---|---|---|"]
        for f in (f for f in dataclasses.fields(cls) if not stage.startswith("study") or f.name != "study"):
            default = configs.default(f)
            if isinstance(default, list):
                default = ",".join(map(str, default))
            shown = ("(required)" if f.metadata.get("required") else
                     f"`{default}`" if default not in ("", {}) else "(empty)")
            help_ = f.metadata.get("help", "").replace("|", "\\|")
            out.append(f"| `--{f.name.replace('_', '-')}` | `{f.name}` | {type_name(hints[f.name], f)} | {shown} "
                       f"| {help_} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    main()
