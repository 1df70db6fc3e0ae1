"""Trainer entry point of the pods (``python -m wanloom_trainer``; torchrun runs the same module per GPU).

Reads the TrainingJob named by ``WANLOOM_CONFIG`` and the rest of the start-up contract from the environment
(docs/startup-contract.md), prepares the JAX platform before jax is imported, and runs the backend-agnostic
driver, which picks the JAX or PyTorch backend from ``spec.resources``. Exit status ``keys.EXIT_CONFIG_ERROR``
(3) with one clear line on a configuration error, which the JobSet does not retry; any other failure propagates
(JobSet's failure policy decides about restarts).
"""

from __future__ import annotations

import logging
import os
import sys


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every checkpoint file operation at INFO
    from wanloom_api.keys import EXIT_CONFIG_ERROR
    from wanloom_api.validation import InvalidTrainingJob
    from wanloom_trainer.config.train_config import load_train_config

    try:
        config = load_train_config(os.environ)
    except (InvalidTrainingJob, ValueError, FileNotFoundError) as exc:
        print(f"wanloom trainer: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    from wanloom_trainer.distributed_jax import prepare_platform

    prepare_platform(config)  # before jax is imported anywhere
    from wanloom_trainer.train.run import run

    result = run(config, progress=sys.stderr.isatty())
    if result.plot is not None:
        logging.getLogger("wanloom_trainer").info("loss curve: %s", result.plot)
    # Stopped by SIGTERM after a committed checkpoint: exit as the signal would (128 + 15), so the pod is not
    # counted as Succeeded and the JobSet restarts it from that checkpoint.
    return 143 if result.stopped_by else 0


if __name__ == "__main__":
    sys.exit(main())
