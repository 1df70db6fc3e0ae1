"""`wanloom operator` as a process: liveness endpoint, metrics, JSON logs, clean exit on SIGTERM;
and the mapping of settings to kopf's run options (peering = leader election between replicas)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import urllib.request
from pathlib import Path

from kmock_world import JS, World, eventually, free_port

from wanloom_operator.reconcile.runner import operator_kwargs
from wanloom_operator.reconcile.runtime import Runtime
from wanloom_operator.settings import OperatorSettings

ROOT = Path(__file__).resolve().parents[3]


def _kwargs(**settings: object) -> dict[str, object]:
    values = OperatorSettings.from_env({}, api_server="http://127.0.0.1:1", **settings)
    kwargs = operator_kwargs(values, Runtime.create(values))
    kwargs.pop("memo")
    return kwargs


def test_operator_kwargs() -> None:
    assert _kwargs() == {
        "clusterwide": True,
        "standalone": True,
        "liveness_endpoint": "http://0.0.0.0:8080/healthz",
    }
    peered = _kwargs(namespaces=("a", "b"), peering_name="wanloom", peering_priority=7, liveness_port=0)
    assert peered == {"namespaces": ["a", "b"], "peering_name": "wanloom", "priority": 7}
    assert 1 <= _kwargs(peering_name="wanloom")["priority"] <= 1_000_000  # one replica wins the election


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=2) as response:
        return response.status, response.read().decode()


async def test_wanloom_operator_process(world: World) -> None:
    liveness, metrics = free_port(), free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT / "cli"), str(ROOT / "trainer_images")]),
        "WANLOOM_KUBE_API_SERVER": str(world.kmock.url),
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "from wanloom_cli import main; main()",
        "operator",
        "--all-namespaces",  # kmock cannot list namespaces (its path parser); --namespace is tested on kind
        f"--liveness-port={liveness}",
        f"--metrics-port={metrics}",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        await eventually(lambda: len(world.watches()) >= 2, timeout=30, what="the operator watching")
        await world.create_trainingjob("proc")
        await eventually(lambda: world.objects(JS).get("proc"), timeout=20, what="JobSet")
        status, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{liveness}/healthz")
        assert status == 200 and json.loads(body)["trainingjobs"] >= 1
        _, text = await asyncio.to_thread(_get, f"http://127.0.0.1:{metrics}/metrics")
        assert 'wanloom_operator_reconcile_duration_seconds_count{handler="create"} 1.0' in text
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode == 0, output.decode()[-2000:]
    records = [json.loads(line) for line in output.decode().splitlines() if line.startswith("{")]
    assert records and all("message" in r and "severity" in r for r in records)  # structured (JSON) logs
    assert any(r.get("object", {}).get("name") == "proc" for r in records if isinstance(r.get("object"), dict))
    # The kubelet probes /healthz every 10 s: no access line for each.
    assert "/healthz" not in output.decode()
