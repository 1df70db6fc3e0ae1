"""The `wanloom` command line.

Each area registers its commands from its own module; heavy dependencies (jax, torch, kopf) are imported inside
the commands that need them, so `wanloom validate` starts fast on a machine without them.
"""

from __future__ import annotations

import typer

from wanloom_operator.cli import api_commands, data_commands, operator_commands, trainer_commands

app = typer.Typer(
    name="wanloom",
    help="Train Wan 2.2 video diffusion models on Kubernetes (TPU v7x / NVIDIA GPU) or locally on CPU.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
api_commands.register(app)
operator_commands.register(app)
trainer_commands.register(app)
data_commands.register(app)


def main() -> None:
    app()
