"""The operator as the end-to-end tests run it: `wanloom operator` out of the cluster, as cluster admin."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

TRAINER_IMAGE = os.environ.get("WANLOOM_E2E_TRAINER_IMAGE")


def start_operator(
    cluster: Any,
    namespace: str,
    progress_interval: float = 5,
    settings: dict[str, str] | None = None,
    log: Any = subprocess.PIPE,
) -> subprocess.Popen[str]:
    """`wanloom operator --namespace=NAMESPACE` as cluster admin, out of the cluster (``settings``: more env; ``log``:
    where its output goes, a file where it logs more than a pipe holds)."""
    env = {**os.environ, "WANLOOM_PROGRESS_INTERVAL_SECONDS": str(progress_interval), "WANLOOM_LOG_FORMAT": "plain",
           "KUBECONFIG": cluster.kubeconfig, **(settings or {})}  # fmt: skip
    if TRAINER_IMAGE:
        env |= {"WANLOOM_TRAINER_IMAGE_JAX": TRAINER_IMAGE, "WANLOOM_TRAINER_IMAGE_TORCH": TRAINER_IMAGE}
    command = [sys.executable, "-c", "from wanloom_cli import main; main()", "operator"]
    command += [f"--namespace={namespace}", "--metrics-port=0", "--liveness-port=0"]
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
