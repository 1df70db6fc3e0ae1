"""Stop what ``up.py`` started, by the PIDs it recorded (`make cluster-down`), and remove the cluster's state.

Usage: python .ci/cluster/down.py [--keep-state]
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("WANLOOM_CLUSTER_DIR", ROOT / ".cluster"))
# Clients first, etcd last, so nothing writes to a store that is going away.
ORDER = ("kwok", "jobset-controller", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd")


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


def main() -> None:
    pids = STATE / "pids"
    if pids.is_dir():
        names = [n for n in ORDER if (pids / f"{n}.pid").exists()]
        names += sorted(p.stem for p in pids.glob("*.pid") if p.stem not in ORDER)
        for name in names:
            with contextlib.suppress(ValueError):
                stop(int((pids / f"{name}.pid").read_text()))
            (pids / f"{name}.pid").unlink()
    if "--keep-state" not in sys.argv:
        for sub in ("etcd", "env"):
            path = STATE / sub
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
