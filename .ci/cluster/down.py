"""Stop what ``up.py`` started, by the PIDs it recorded (`make cluster-down`), and remove the cluster's state.

Usage: python .ci/cluster/down.py [--keep-state]
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("WANLOOM_CLUSTER_DIR", ROOT / ".cluster"))
# Clients first, etcd last, so nothing writes to a store that is going away; the real node's pods are stopped
# between the kubelet and containerd.
ORDER = ("kubelet", "kube-proxy", "coredns", "containerd", "kwok", "jobset-controller", "kube-scheduler",
         "kube-controller-manager", "kube-apiserver", "etcd")  # fmt: skip


def stop(pid: int, grace_s: float = 10.0) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(pid, signal.SIGKILL)


def _running(ctr: list[str]) -> list[str]:
    lines = subprocess.run([*ctr, "tasks", "ls"], capture_output=True, text=True).stdout.splitlines()[1:]
    return [line.split()[0] for line in lines if "RUNNING" in line]


def stop_pods(node: dict[str, str]) -> None:
    """Kill every container of the real node (its kubelet is gone; they would otherwise run on)."""
    ctr = [node["ctr"], "--address", node["socket"], "-n", "k8s.io"]
    for task in _running(ctr):
        subprocess.run([*ctr, "tasks", "kill", "-s", "SIGKILL", task], capture_output=True)
    deadline = time.monotonic() + 10
    while _running(ctr) and time.monotonic() < deadline:
        time.sleep(0.2)
    for task in subprocess.run([*ctr, "tasks", "ls", "-q"], capture_output=True, text=True).stdout.split():
        subprocess.run([*ctr, "tasks", "delete", task], capture_output=True)


def main() -> None:
    pids = STATE / "pids"
    node = None
    with contextlib.suppress(OSError, ValueError, KeyError):
        node = json.loads((STATE / "env").read_text())["node"]
    if pids.is_dir():
        names = [n for n in ORDER if (pids / f"{n}.pid").exists()]
        names += sorted(p.stem for p in pids.glob("*.pid") if p.stem not in ORDER)
        for name in names:
            if name == "containerd" and node:
                stop_pods(node)
            with contextlib.suppress(ValueError):
                stop(int((pids / f"{name}.pid").read_text()))
            (pids / f"{name}.pid").unlink()
    if "--keep-state" not in sys.argv:
        for sub in ("etcd", "env"):
            path = STATE / sub
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
