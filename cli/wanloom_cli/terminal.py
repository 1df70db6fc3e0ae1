"""What the CLI's commands share about the terminal."""

from __future__ import annotations

import logging


def log_to_terminal() -> None:
    """The trainer package's own messages (resuming, checkpoints committed, units written) on stderr, once."""
    logger = logging.getLogger("wanloom_trainer")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
