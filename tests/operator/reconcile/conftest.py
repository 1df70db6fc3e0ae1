"""Fixtures of the kmock operator tests: the fake API server with wanloom's resources (``world``) and the real
operator running against it in a background thread (``start_operator``). Helpers live in kmock_world.py.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

sys.path.insert(0, str(Path(__file__).parent))  # the helpers module beside this file (test dirs are not packages)
from kmock_world import Operator, VersionedEmulator, World, eventually, prepare, stop_operator

from wanloom_operator.reconcile.runner import start_in_thread
from wanloom_operator.reconcile.runtime import Runtime
from wanloom_operator.settings import OperatorSettings


@pytest.fixture
def kmock_options(kmock_options: dict[str, Any]) -> dict[str, Any]:
    return {**kmock_options, "cls": VersionedEmulator}


@pytest.fixture
def world(kmock: Any) -> World:
    return prepare(kmock)


@pytest_asyncio.fixture
async def start_operator(world: World) -> AsyncIterator[Callable[..., Any]]:
    """start_operator(**settings) -> a running operator (stopped at teardown, or by ``await stop(op)``)."""
    running: list[Operator] = []

    async def start(**overrides: Any) -> Operator:
        values = {
            "api_server": str(world.kmock.url),
            "metrics_port": 0,
            "liveness_port": 0,
            "progress_interval_seconds": 0.3,
            "progress_timeout_seconds": 1.0,
            **overrides,
        }
        settings = OperatorSettings.from_env({}, **values)
        runtime = Runtime.create(settings)
        thread, stop, ready = start_in_thread(settings, runtime)
        op = Operator(runtime, stop, thread)
        running.append(op)
        watches_before = len(world.watches())
        await eventually(ready.is_set, timeout=10, what="operator ready")
        # kmock replays existing objects on every watch (it ignores resourceVersion): act only once both watch
        # streams are open, or kopf sees a stale copy of an object it just patched.
        await eventually(lambda: len(world.watches()) >= watches_before + 2, what="watch streams")
        return op

    yield start
    for op in running:
        await stop_operator(op)
