"""`slmsql <stage>`: every MLproject entry point is one of these commands, with options generated from
the stage's config dataclass (configs.py)."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
import typing

import click

from . import configs
from .errors import SlmsqlError

# stage -> "module:function" taking the resolved config; imported lazily so `--help` stays fast.
ENTRY = {
    "toy": "slmsql.toy:main",
    "tiny-model": "slmsql.tinymodel:main",
    "sft": "slmsql.sft:main",
    "filter": "slmsql.passrate:main",
    "grpo": "slmsql.grpo:main",
    "evaluate": "slmsql.evaluate:main",
    "publish": "slmsql.publish:main",
    "validate": "slmsql.checks:main",
}


def _options(cls):
    hints = typing.get_type_hints(cls)

    def decorate(fn):
        for f in reversed(dataclasses.fields(cls)):
            flag = "--" + f.name.replace("_", "-")
            hint, help_ = hints[f.name], f.metadata.get("help", "")
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            help_ += f"  [default: {default}]" if default not in ("", {}) else ""
            if hint is bool:
                # `--flag` alone means true; `--flag false` is how MLproject passes a value.
                fn = click.option(flag, f.name, type=click.BOOL, is_flag=False, flag_value=True,
                                  default=None, help=help_)(fn)
            elif hint is dict:
                fn = click.option(flag, f.name, multiple=True, metavar="KEY=VALUE", help=help_)(fn)
            else:
                ptype = click.Choice(f.metadata["choices"]) if "choices" in f.metadata else hint
                fn = click.option(flag, f.name, type=ptype, default=None, help=help_)(fn)
        return click.option("--recipe", type=click.Path(), default=None,
                            help="YAML recipe setting any of these options (recipes/).")(fn)
    return decorate


def _command(stage: str, cls):
    @click.pass_context
    def run(ctx, recipe, **values):
        if "trainer_args" in values:
            values["trainer_args"] = " ".join(values["trainer_args"]) or None
        cfg = configs.load(cls, recipe, values)
        module, fn = ENTRY[stage].split(":")
        try:
            entry = getattr(importlib.import_module(module), fn)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            raise SlmsqlError(f"`{stage}` is not implemented yet") from None
        result = entry(cfg)
        ctx.obj = result

    doc = (cls.__doc__ or "").split("\n")[0]
    return click.command(stage, help=f"Run the {stage} stage. {doc if not doc.startswith(cls.__name__) else ''}",
                         )(_options(cls)(run))


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


@main.command("mlproject")
def mlproject_cmd():
    """Print the MLproject file generated from the stage configs."""
    from .mlproject import render

    click.echo(render(), nl=False)


if __name__ == "__main__":
    main()
