"""The `wanloom` command line: a thin layer over the contract (`wanloom_api`), the operator and the trainer.

Each area registers its commands from its own module. The operator and trainer packages, and heavy dependencies
(jax, torch, kopf), are imported inside the commands that need them: `wanloom validate` starts fast anywhere, and
each image ships only the side it runs.
"""

from __future__ import annotations

import sys

import typer

from wanloom_cli import (
    api_commands,
    data_commands,
    export_commands,
    operator_commands,
    sample_commands,
    trainer_commands,
)

app = typer.Typer(
    name="wanloom",
    help="Train Wan 2.2 video diffusion models on Kubernetes (TPU v7x / NVIDIA GPU) or locally on CPU.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Click's plain help: one line per option, "--debug / --no-debug" without a "<bool>" value to type.
    rich_markup_mode=None,
)
api_commands.register(app)
operator_commands.register(app)
trainer_commands.register(app)
data_commands.register(app)
export_commands.register(app)
sample_commands.register(app)


# What a command needs that an image may leave out, and where it is.
_SIDES = {
    "wanloom_operator": "the operator image or a full `pip install wanloom`",
    "wanloom_trainer": "a trainer image or a full `pip install wanloom`",
}


def main() -> None:
    try:
        app()
    except ModuleNotFoundError as exc:
        side = (exc.name or "").partition(".")[0]
        if side not in _SIDES:
            raise
        command = " ".join(sys.argv[1:2])
        typer.echo(
            f"wanloom {command}: needs {side}, which this installation leaves out; run it from {_SIDES[side]}", err=True
        )
        raise SystemExit(1) from None
