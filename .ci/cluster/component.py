"""Stop, start or restart one component of the cluster ``up.py`` started, with the arguments it was started with:
the fault tests take the API server or the real node's kubelet away under a running job and bring it back.

Usage: python .ci/cluster/component.py stop|start|restart NAME   (NAME: a file in .cluster/pids/, e.g. kubelet)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import down  # beside this script
import up


def stop(name: str) -> None:
    pid_file = up.STATE / "pids" / f"{name}.pid"
    if not pid_file.exists():
        raise SystemExit(f"component.py: {name} is not running (no {pid_file})")
    down.stop(int(pid_file.read_text()))
    pid_file.unlink()


def start(name: str) -> None:
    args_file = up.STATE / "args" / f"{name}.json"
    if not args_file.exists():
        raise SystemExit(f"component.py: up.py never started {name} (no {args_file})")
    if up.alive(name):
        raise SystemExit(f"component.py: {name} is already running")
    up.start(name, json.loads(args_file.read_text()))


def main(argv: list[str]) -> None:
    actions = {"stop": [stop], "start": [start], "restart": [stop, start]}
    if len(argv) != 2 or argv[0] not in actions:
        raise SystemExit("usage: component.py stop|start|restart NAME")
    for action in actions[argv[0]]:
        action(argv[1])


if __name__ == "__main__":
    main(sys.argv[1:])
