"""The PyTorch pods' launcher (``python -m wanloom_trainer.launcher``): one worker per device, preemption kept.

torchrun SIGKILLs its workers 30 s after it is signalled, whatever the pod's termination grace, and exits 1 for
every failure: an A14B checkpoint cannot commit in 30 s, and the JobSet rule that stops on configuration errors
(exit 3) never sees one. This launcher starts ``NPROC_PER_NODE`` workers (``python -m wanloom_trainer``) with
torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) from the pod's ``NNODES``, ``NPROC_PER_NODE``, ``NODE_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` (a static rendezvous, as the operator renders it), and then:

- forwards SIGTERM and SIGINT to every worker (they checkpoint after their current step and exit 143) and waits up
  to ``WANLOOM_SHUTDOWN_SECONDS`` (the operator sets it inside the pod's terminationGracePeriodSeconds) before it
  SIGKILLs the rest;
- when a worker fails, stops the others (SIGTERM, then SIGKILL after ``FAILURE_GRACE_S``: peers blocked in a
  collective with the failed rank cannot checkpoint);
- exits with the workers' status: 3 if any had a configuration error, else the first failure's, else 143 when
  stopped by a signal, else 0 (a worker killed by signal N counts as 128 + N).

Workers run in a process group of their own, so a terminal's Ctrl-C reaches them once, through the launcher, and
get SIGTERM if the launcher itself dies. ``wanloom run --processes N`` supervises its pods with the same
``Supervisor`` and starts torch jobs through this launcher, one per simulated pod.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from wanloom_api.keys import ENV_SHUTDOWN_SECONDS, EXIT_CONFIG_ERROR, EXIT_STOPPED

log = logging.getLogger("wanloom_trainer.launcher")
DEFAULT_SHUTDOWN_S = 270.0  # outside a pod (no WANLOOM_SHUTDOWN_SECONDS): the chart's default grace less a margin
# After a worker failed, the others get SIGTERM and this long before SIGKILL: a peer of a failed rank is blocked in
# a collective and can neither checkpoint nor see the signal, so waiting longer only delays the pod's exit.
FAILURE_GRACE_S = 5.0
_POLL_S = 0.1
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Node:
    """This pod's place in the static rendezvous."""

    nodes: int
    procs_per_node: int
    node_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Node:
        names = ("NNODES", "NPROC_PER_NODE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
        missing = [n for n in names if not env.get(n)]
        if missing:
            raise ValueError(f"the launcher needs {', '.join(missing)} (the operator renders them on torch pods)")
        try:
            nodes, procs, rank, port = (int(env[n]) for n in ("NNODES", "NPROC_PER_NODE", "NODE_RANK", "MASTER_PORT"))
        except ValueError:
            shown = ", ".join(f"{n}={env[n]!r}" for n in names)
            raise ValueError(f"the launcher's {shown}: all but MASTER_ADDR must be integers") from None
        if not (nodes >= 1 and procs >= 1 and 0 <= rank < nodes):
            raise ValueError(f"NODE_RANK={rank} must lie in 0..NNODES-1 (NNODES={nodes}), NPROC_PER_NODE={procs} >= 1")
        return cls(nodes, procs, rank, env["MASTER_ADDR"], port)

    def worker_env(self, local_rank: int) -> dict[str, str]:
        return {
            "RANK": str(self.node_rank * self.procs_per_node + local_rank),
            "WORLD_SIZE": str(self.nodes * self.procs_per_node),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(self.procs_per_node),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def status(returncode: int) -> int:
    """A Popen return code as a shell would report it: 128 + N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def exit_code(codes: Sequence[int], *, stopped: bool) -> int:
    """The pod's status from its workers' (in the order they ended; see the module docstring)."""
    if EXIT_CONFIG_ERROR in codes:
        return EXIT_CONFIG_ERROR
    failures = [c for c in codes if c not in (0, EXIT_STOPPED)]
    if failures:
        return failures[0]
    return EXIT_STOPPED if stopped or EXIT_STOPPED in codes else 0


def _die_with_parent() -> None:
    """In the worker, before exec: SIGTERM (checkpoint and stop) when the launcher dies, never an orphan."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Supervisor:
    """Children started together and stopped together (the launcher's workers; ``wanloom run --processes``'s pods):
    signals forwarded once each, the rest stopped when one fails, killed past a deadline; ``wait`` returns
    ``exit_code`` of their statuses."""

    def __init__(self, shutdown_s: float, failure_grace_s: float = FAILURE_GRACE_S) -> None:
        self.shutdown_s, self.failure_grace_s = shutdown_s, failure_grace_s
        self.children: list[subprocess.Popen] = []
        self.ended: list[int] = []  # statuses in the order the children ended
        self._signals: list[int] = []

    def start(self, command: Sequence[str], env: Mapping[str, str], **popen: object) -> subprocess.Popen:
        """Start a child in a process group of its own (a terminal's Ctrl-C reaches it once, forwarded) that gets
        SIGTERM if this process dies."""
        child = subprocess.Popen(list(command), env=dict(env), process_group=0, preexec_fn=_die_with_parent, **popen)
        self.children.append(child)
        return child

    def wait(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._supervise()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals.append(signum)

    def _supervise(self) -> int:
        forwarded, deadline = 0, None
        while self._alive():
            if len(self._signals) > forwarded:  # forward each signal once, in order (a second Ctrl-C too)
                for signum in self._signals[forwarded:]:
                    log.warning("%s: stopping the trainers (they checkpoint first)", signal.Signals(signum).name)
                    self._send(signum)
                forwarded = len(self._signals)
                deadline = deadline or time.monotonic() + self.shutdown_s
            failed = [c for c in self.ended if c not in (0, EXIT_STOPPED)]
            if failed and deadline is None:
                log.error("a trainer exited with %d: stopping the others", failed[0])
                self._send(signal.SIGTERM)
                deadline = time.monotonic() + min(self.failure_grace_s, self.shutdown_s)
            if deadline is not None and time.monotonic() > deadline:
                log.error("trainers still running after the shutdown deadline: killing them")
                self._send(signal.SIGKILL)
                deadline = float("inf")
            time.sleep(_POLL_S)
        return exit_code(self.ended, stopped=bool(self._signals))

    def _alive(self) -> bool:
        for child in self.children:
            if child.returncode is None and child.poll() is not None:
                self.ended.append(status(child.returncode))
        return any(c.returncode is None for c in self.children)

    def _send(self, signum: int) -> None:
        for child in self.children:
            if child.returncode is None:
                child.send_signal(signum)


def launch(node: Node, command: Sequence[str], shutdown_s: float, env: Mapping[str, str] | None = None) -> int:
    """Run ``node.procs_per_node`` workers of ``command`` with torchrun's variables; their combined status."""
    supervisor = Supervisor(shutdown_s)
    base = os.environ if env is None else env
    for local in range(node.procs_per_node):
        supervisor.start(command, {**base, **node.worker_env(local)})
    return supervisor.wait()


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        node = Node.from_env(os.environ)
        shutdown_s = shutdown_seconds(os.environ)
    except ValueError as exc:
        print(f"wanloom launcher: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return launch(node, list(argv) if argv else [sys.executable, "-m", "wanloom_trainer"], shutdown_s)


def shutdown_seconds(env: Mapping[str, str]) -> float:
    text = env.get(ENV_SHUTDOWN_SECONDS)
    if text is None:
        return DEFAULT_SHUTDOWN_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{ENV_SHUTDOWN_SECONDS}={text!r} must be a positive number of seconds")
    return value


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
