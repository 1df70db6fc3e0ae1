"""Live progress: a fake rank-0 trainer serves Prometheus text on 127.0.0.1; the operator finds it (pod IP from the
API, or a static address) and fills status.progress, and mirrors step time and imbalance into its own metrics."""

from __future__ import annotations

import copy
import threading
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kmock_world import GPU_SPEC, JS, NS, World, eventually, free_port
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from wanloom_api import keys
from wanloom_api.metrics import STEP_TIME_BUCKETS

Start = Callable[..., Any]


class FakeTrainer:
    """Rank 0's /metrics, produced by prometheus_client with the contract's names and labels."""

    def __init__(self, job: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"trainingjob": job}
        gauge = lambda name, extra=(): Gauge(name, name, ["trainingjob", *extra], registry=self.registry)
        self.step, self.total = gauge("wanloom_step").labels(**labels), gauge("wanloom_total_steps").labels(**labels)
        self.cv, self.tokens = (
            gauge("wanloom_load_imbalance_cv").labels(**labels),
            gauge("wanloom_tokens_per_second").labels(**labels),
        )
        self.loss = gauge("wanloom_loss", ("expert",))
        self.checkpoint = gauge("wanloom_last_checkpoint_step").labels(**labels)
        self.step_time = Histogram(
            "wanloom_step_time_seconds",
            "step",
            ["trainingjob", "rank"],
            buckets=STEP_TIME_BUCKETS,
            registry=self.registry,
        ).labels(trainingjob=job, rank="0")
        self.job = job

    def train(self, steps: int, seconds_per_step: float, loss: tuple[float, float]) -> None:
        for _ in range(steps):
            self.step_time.observe(seconds_per_step)
        self.step.inc(steps)
        self.loss.labels(trainingjob=self.job, expert="high_noise").set(loss[0])
        self.loss.labels(trainingjob=self.job, expert="low_noise").set(loss[1])


@pytest.fixture
def trainer() -> Iterator[tuple[FakeTrainer, int]]:
    fake = FakeTrainer("tjp")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(fake.registry)
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield fake, server.server_address[1]
    server.shutdown()
    server.server_close()


def _rank0_pod(jobset: str, ip: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{jobset}-node-0-0-abcde",
            "namespace": NS,
            "labels": {keys.JOBSET_NAME: jobset, keys.JOBSET_JOB_INDEX: "0"},
            "annotations": {keys.JOB_COMPLETION_INDEX: "0"},
        },
        "spec": {"containers": [{"name": "trainer", "image": "x"}]},
        "status": {"phase": "Running", "podIP": ip},
    }


@pytest.mark.parametrize("lookup", ["pod-ip", "static:127.0.0.1"])
async def test_progress_from_rank0_metrics(
    lookup: str, world: World, start_operator: Start, trainer: tuple[FakeTrainer, int]
) -> None:
    fake, port = trainer
    op = await start_operator(rank0_address=lookup, progress_interval_seconds=0.2)
    spec = copy.deepcopy(GPU_SPEC)
    spec["metricsPort"] = port
    await world.create_trainingjob("tjp", spec)
    await eventually(lambda: world.objects(JS).get("tjp"), what="JobSet")
    if lookup == "pod-ip":
        # A decoy from another JobSet first: the operator filters pods itself (kmock ignores label selectors).
        await world.kmock.post(f"/api/v1/namespaces/{NS}/pods", json=_rank0_pod("other", "10.0.0.9"))
        await world.kmock.post(f"/api/v1/namespaces/{NS}/pods", json=_rank0_pod("tjp", "127.0.0.1"))
    fake.total.set(100)
    fake.cv.set(0.07)
    fake.tokens.set(12345.0)
    fake.train(10, 1.5, (0.5, 0.3))
    await world.jobset_status("tjp", {"replicatedJobsStatus": [{"name": "node", "active": 1, "ready": 1}]})
    first = await eventually(lambda: (world.status("tjp").get("progress") or {}).get("step") == 10, what="step 10")
    assert first
    progress = world.status("tjp")["progress"]
    assert progress["totalSteps"] == 100 and progress["loadImbalanceCV"] == pytest.approx(0.07)
    assert progress["tokensPerSecond"] == pytest.approx(12345.0) and progress["loss"] == pytest.approx(0.4)
    assert progress["stepTimeSeconds"] == pytest.approx(1.5) and progress["updatedAt"]
    # Next interval: step time is measured over the new steps only (histogram _sum/_count deltas).
    fake.train(10, 0.5, (0.4, 0.2))
    fake.checkpoint.set(20)
    await eventually(lambda: world.status("tjp")["progress"].get("step") == 20, what="step 20")
    progress = world.status("tjp")["progress"]
    assert progress["stepTimeSeconds"] == pytest.approx(0.5) and progress["lastCheckpointStep"] == 20
    # The operator mirrors step time and imbalance into its own metrics.
    step_time = op.runtime.metrics.job_step_time.labels(namespace=NS, trainingjob="tjp")
    await eventually(lambda: step_time._value.get() == pytest.approx(0.5), what="mirrored step time")


async def test_no_progress_reads_until_running(world: World, start_operator: Start, trainer: Any) -> None:
    fake, port = trainer
    await start_operator(rank0_address="static:127.0.0.1", progress_interval_seconds=0.1)
    spec = copy.deepcopy(GPU_SPEC)
    spec["metricsPort"] = port
    await world.create_trainingjob("tjp", spec)
    await eventually(lambda: world.status("tjp").get("phase") == "Pending", what="Pending")
    fake.train(3, 1.0, (0.1, 0.1))
    for _ in range(20):  # ~several tracker intervals
        await eventually(lambda: True)
    assert "progress" not in world.status("tjp")


async def test_operator_serves_its_metrics(world: World, start_operator: Start) -> None:
    port = free_port()
    await start_operator(metrics_port=port)
    await world.create_trainingjob("tjm")
    await eventually(lambda: world.status("tjm").get("phase") == "Pending", what="Pending")

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return response.read().decode()

    text = await eventually(
        lambda: (t := scrape()) and 'wanloom_operator_trainingjobs{phase="Pending"} 1.0' in t and t,
        what="jobs by phase",
    )
    assert 'wanloom_operator_reconcile_duration_seconds_count{handler="create"}' in text
    assert "wanloom_operator_reconcile_errors_total" in text
