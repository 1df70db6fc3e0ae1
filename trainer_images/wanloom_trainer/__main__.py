"""Trainer entry point of the pods (``python -m wanloom_trainer``; the torch launcher runs the same module per GPU).

Reads the TrainingJob named by ``WANLOOM_CONFIG`` and the rest of the start-up contract from the environment
(docs/startup-contract.md), prepares the JAX platform before jax is imported, and runs the backend-agnostic
driver, which picks the JAX or PyTorch backend from ``spec.resources``.

How it ends, and why:

- ``keys.EXIT_CONFIG_ERROR`` (3), one line on stderr and in the pod's termination message, when the job cannot run
  as written: a bad spec or file, or the data failing the plan or the checks (``input_errors``). These are pure
  functions of the spec and the dataset, so a restart would fail the same way: the pod failure policy fails the
  JobSet at once and the operator shows the line in the TrainingJob's status.
- 1 with the traceback for any other failure (the JobSet's failure policy decides about restarts).
- 143 after a SIGTERM that checkpointed (the JobSet restarts from that checkpoint).

A failing process exits at once, without ``jax.distributed``'s shutdown barrier: that barrier waits up to five
minutes for peers that are blocked in a collective with the failed process and will never reach it. The peers
notice the missing process through the coordination service's heartbeat (``distributed_jax.HEARTBEAT_TIMEOUT_S``)
or, on one machine, are stopped by the supervisor (``launcher.Supervisor``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import traceback
from pathlib import Path

# Kubernetes' default terminationMessagePath: what a failed container writes here is its status message.
TERMINATION_LOG = Path("/dev/termination-log")
FAILED = 1


def input_errors() -> tuple[type[BaseException], ...]:
    """Failures of the job's inputs, which a restart cannot fix (module docstring)."""
    from wanloom_api.validation import InvalidTrainingJob
    from wanloom_trainer.data.skips import TooManyBadSamples

    return InvalidTrainingJob, ValueError, FileNotFoundError, TooManyBadSamples


# XLA's status codes: a collective that failed because a peer went away surfaces (in jax's multihost helpers,
# sometimes as a ValueError) as "UNKNOWN: Gloo AllGather failed ...". That is the peer's failure, not this process's
# input: exiting with the configuration-error status too would make the operator report it instead of the cause.
_RUNTIME_STATUS = re.compile(
    r"^(UNKNOWN|UNAVAILABLE|INTERNAL|ABORTED|CANCELLED|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED|DATA_LOSS): "
)


def is_input_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure of the job's inputs (exit ``EXIT_CONFIG_ERROR``) rather than of the run."""
    return isinstance(exc, input_errors()) and not _RUNTIME_STATUS.match(str(exc).lstrip())


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every checkpoint file operation at INFO
    from wanloom_api.keys import EXIT_CONFIG_ERROR, EXIT_STOPPED
    from wanloom_trainer.config.train_config import load_train_config

    try:
        config = load_train_config(os.environ)
    except input_errors() as exc:
        return report(f"wanloom trainer: {exc}", EXIT_CONFIG_ERROR)
    from wanloom_trainer.distributed_jax import prepare_platform

    prepare_platform(config)  # before jax is imported anywhere
    from wanloom_trainer.train.run import run

    try:
        result = run(config, progress=sys.stderr.isatty())
    except Exception as exc:
        if is_input_error(exc):
            exit_now(report(f"wanloom trainer: {_first_line(exc)}", EXIT_CONFIG_ERROR))
        traceback.print_exc()
        exit_now(report(f"wanloom trainer: {type(exc).__name__}: {_first_line(exc)}", FAILED))
    if result.plot is not None:
        logging.getLogger("wanloom_trainer").info("loss curve: %s", result.plot)
    # Stopped by SIGTERM after a committed checkpoint: exit as the signal would (128 + 15), so the pod is not
    # counted as Succeeded and the JobSet restarts it from that checkpoint.
    return EXIT_STOPPED if result.stopped_by else 0


def report(message: str, code: int, termination_log: Path = TERMINATION_LOG) -> int:
    """``message`` on stderr and, in a pod, as the container's termination message; returns ``code``."""
    print(message, file=sys.stderr, flush=True)
    if termination_log.exists():  # the kubelet mounts it into every container; elsewhere there is none
        with contextlib.suppress(OSError):
            termination_log.write_text(message[:4000])  # the kubelet keeps at most 4 KiB
    return code


def exit_now(code: int) -> None:
    """Leave without atexit handlers (``jax.distributed``'s shutdown barrier; module docstring)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
