"""Run the operator: logging, peering (leader election between replicas), liveness endpoint, then kopf."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from typing import Any

import kopf

from wanloom_operator.reconcile import handlers  # noqa: F401 - registers the handlers with kopf
from wanloom_operator.reconcile.runtime import Runtime
from wanloom_operator.settings import OperatorSettings

_LOG_FORMATS = {"json": kopf.LogFormat.JSON, "plain": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL}


def operator_kwargs(settings: OperatorSettings, runtime: Runtime) -> dict[str, Any]:
    """kopf.operator() arguments for these settings.

    With a peering name, replicas share a kopf peering object and only the one with the highest priority works;
    the others pause until its heartbeat stops (kopf "peering"). Each replica draws a random priority unless one
    is given, so exactly one is active.
    """
    kwargs: dict[str, Any] = {"memo": kopf.Memo(runtime=runtime)}
    if settings.namespaces:
        kwargs["namespaces"] = list(settings.namespaces)
    else:
        kwargs["clusterwide"] = True
    if settings.peering_name:
        kwargs["peering_name"] = settings.peering_name
        kwargs["priority"] = (
            settings.peering_priority if settings.peering_priority is not None else random.randint(1, 1_000_000)
        )
    else:
        kwargs["standalone"] = True
    if settings.liveness_port:
        kwargs["liveness_endpoint"] = f"http://0.0.0.0:{settings.liveness_port}/healthz"
    return kwargs


def configure_logging(settings: OperatorSettings, *, verbose: bool = False) -> None:
    """kopf's log format; the liveness endpoint's access lines only when verbose (the kubelet's probes hit it every
    10 s, and a line for each drowns the reconcile log)."""
    kopf.configure(verbose=verbose, log_format=_LOG_FORMATS[settings.log_format])
    logging.getLogger("aiohttp.access").setLevel(logging.DEBUG if verbose else logging.WARNING)


def run_operator(settings: OperatorSettings, *, verbose: bool = False) -> None:
    """Block running the operator until SIGINT/SIGTERM."""
    configure_logging(settings, verbose=verbose)
    runtime = Runtime.create(settings)
    asyncio.run(kopf.operator(**operator_kwargs(settings, runtime)))


def start_in_thread(
    settings: OperatorSettings, runtime: Runtime | None = None
) -> tuple[threading.Thread, threading.Event, threading.Event]:
    """Run the operator in a background thread with its own event loop (tests, benchmarks).

    Returns (thread, stop_flag, ready_flag): set ``stop_flag`` and join the thread to stop it.
    """
    runtime = runtime or Runtime.create(settings)
    stop, ready = threading.Event(), threading.Event()
    kwargs = operator_kwargs(settings, runtime)

    def run() -> None:
        asyncio.run(kopf.operator(stop_flag=stop, ready_flag=ready, **kwargs))

    thread = threading.Thread(target=run, name="wanloom-operator", daemon=True)
    thread.start()
    return thread, stop, ready
