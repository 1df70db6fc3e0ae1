"""Operator reconcile benchmark: N TrainingJobs created at once against kmock; every one must be reconciled.

The operator runs as a separate process (`wanloom operator --all-namespaces`, what the chart deploys) against a
kmock API server in this process, so its memory is its own. For each run (default: 20 and 200 at once, and 200 at
20 per second; side by side, a fresh operator and API server each) the script

1. creates N TrainingJobs (8-GPU single-node spec) as fast as the fake API accepts them;
2. waits until every one has its JobSet, ConfigMap and condition Created=True (create -> Created latency, client
   side, from the TrainingJob's POST to the first status read that shows it);
3. plays the JobSet controller: marks every JobSet's Jobs ready, and waits for every phase to become Running;
4. reads the operator's own /metrics: handler-duration quantiles (Prometheus histogram_quantile interpolation over
   the contract's buckets, so a p99 is as fine as its bucket), error counts; and the operator's RSS and CPU time
   (psutil; CPU from the first TrainingJob until all are Running, per job).

Usage: PYTHONPATH=operator:trainer_images .venv/bin/python benchmarks/operator_reconcile.py [--runs 20:0 200:0 200:20]
(JOBS:RATE: RATE TrainingJobs created per second, 0 = all at once).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kmock as km
import psutil
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator" / "reconcile"))  # the kmock world the operator tests use
from kmock_world import CM, GPU_SPEC, JS, NS, TJ, VersionedEmulator, World, prepare  # noqa: E402

HANDLERS = ("create", "jobset_event", "track")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _until(check: Any, timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not done after {timeout:.0f}s")
        await asyncio.sleep(interval)


def _quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus histogram_quantile: linear interpolation inside the bucket holding the q-th observation."""
    total = buckets[-1][1]
    if not total:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def _handler_stats(text: str) -> dict[str, dict[str, float]]:
    buckets: dict[str, list[tuple[float, float]]] = {}
    errors: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "wanloom_operator_reconcile_duration_seconds_bucket":
                buckets.setdefault(s.labels["handler"], []).append((float(s.labels["le"]), s.value))
            elif s.name == "wanloom_operator_reconcile_errors_total":
                errors[s.labels["handler"]] = errors.get(s.labels["handler"], 0) + s.value
    return {
        h: {
            "calls": b[-1][1],
            "p50_ms": 1000 * _quantile(sorted(b), 0.50),
            "p99_ms": 1000 * _quantile(sorted(b), 0.99),
            "errors": errors.get(h, 0.0),
        }
        for h, b in buckets.items()
    }


def _statuses(world: World) -> dict[str, dict[str, Any]]:
    """Every TrainingJob's status, in one pass over kmock's objects (polling must not starve the fake API)."""
    return {name: obj.get("status") or {} for name, obj in world.objects(TJ).items()}


def _created(status: dict[str, Any]) -> bool:
    return any(c.get("type") == "Created" and c.get("status") == "True" for c in status.get("conditions") or [])


async def _start_operator(url: str, metrics_port: int, log: Path) -> tuple[Any, psutil.Process]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT / "trainer_images")]),
        "WANLOOM_KUBE_API_SERVER": url,
        "WANLOOM_PROGRESS_INTERVAL_SECONDS": "10",
        "WANLOOM_LOG_FORMAT": "plain",
    }
    command = [sys.executable, "-c", "from wanloom_cli import main; main()", "operator"]
    command += ["--all-namespaces", f"--metrics-port={metrics_port}", "--liveness-port=0"]
    with log.open("w") as sink:
        process = await asyncio.create_subprocess_exec(*command, env=env, stdout=sink, stderr=sink)
    return process, psutil.Process(process.pid)


@dataclass
class Clock:
    """When each TrainingJob was POSTed and when its status first showed Created=True."""

    created_at: dict[str, float] = field(default_factory=dict)
    done_at: dict[str, float] = field(default_factory=dict)
    rss_peak: int = 0


def _body(name: str) -> dict[str, Any]:
    metadata = {"name": name, "namespace": NS, "uid": str(uuid.uuid4()), "generation": 1}
    return {"apiVersion": "wanloom.dev/v1alpha1", "kind": "TrainingJob", "metadata": metadata, "spec": GPU_SPEC}


async def _create_all(kmock: Any, names: list[str], rate: float, clock: Clock) -> None:
    async def create(name: str) -> None:
        clock.created_at[name] = time.monotonic()
        response = await kmock.post(f"/apis/wanloom.dev/v1alpha1/namespaces/{NS}/trainingjobs", json=_body(name))
        assert response.status < 300, await response.text()

    if rate <= 0:  # all at once
        await asyncio.gather(*(create(n) for n in names))
        return
    for name in names:  # one every 1/rate seconds
        await create(name)
        await asyncio.sleep(1.0 / rate)


async def _watch(world: World, names: list[str], proc: psutil.Process, clock: Clock) -> None:
    """Runs alongside the creation: stamps each job's first Created=True, samples the operator's RSS."""
    while len(clock.done_at) < len(names):
        now, statuses = time.monotonic(), _statuses(world)
        for name in names:
            if name not in clock.done_at and _created(statuses.get(name, {})):
                clock.done_at[name] = now
        clock.rss_peak = max(clock.rss_peak, proc.memory_info().rss)
        await asyncio.sleep(0.05)


async def _measure(world: World, kmock: Any, proc: psutil.Process, jobs: int, rate: float, timeout: float) -> dict:
    names, clock, me = [f"bench-{i:04d}" for i in range(jobs)], Clock(), psutil.Process()
    rss_idle, cpu0, api_cpu0 = proc.memory_info().rss, sum(proc.cpu_times()[:2]), sum(me.cpu_times()[:2])
    clock.rss_peak, start = rss_idle, time.monotonic()
    watcher = asyncio.create_task(_watch(world, names, proc, clock))
    await _create_all(kmock, names, rate, clock)
    await asyncio.wait_for(watcher, timeout)
    created_s = time.monotonic() - start
    for name in names:  # play the JobSet controller: every Job ready
        await world.jobset_status(name, {"replicatedJobsStatus": [{"name": "node", "active": 1, "ready": 1}]})
    await _until(lambda: all(s.get("phase") == "Running" for s in _statuses(world).values()), timeout, "Running")
    running_s = time.monotonic() - start
    jobsets, configmaps = world.objects(JS), world.objects(CM)
    latencies = sorted(1000 * (clock.done_at[n] - clock.created_at[n]) for n in names)
    return {
        "jobs": jobs,
        "rate": rate,
        "reconciled": sum(1 for n in names if n in jobsets and f"{n}-config" in configmaps and n in clock.done_at),
        "jobset_posts": kmock.creates["jobsets"],
        "all_created_s": round(created_s, 2),
        "all_running_s": round(running_s, 2),
        "create_to_created_ms": {"p50": statistics.median(latencies), "p99": latencies[int(0.99 * (jobs - 1))]},
        "operator_cpu_ms_per_job": round(1000 * (sum(proc.cpu_times()[:2]) - cpu0) / jobs, 1),
        "fake_api_cpu_busy": round((sum(me.cpu_times()[:2]) - api_cpu0) / running_s, 2),  # cores, on average
        "rss_idle_mib": round(rss_idle / 2**20, 1),
        "rss_peak_mib": round(clock.rss_peak / 2**20, 1),
    }


async def run(jobs: int, rate: float, timeout: float) -> dict[str, Any]:
    """One run: a fresh fake API server and operator process, N TrainingJobs, the measurements."""
    async with VersionedEmulator(keep_requests=8) as kmock, km.Server(kmock):
        world = prepare(kmock)
        port = _free_port()
        log = Path(tempfile.gettempdir()) / f"wanloom-operator-bench-{jobs}.log"
        process, proc = await _start_operator(str(kmock.url), port, log)
        try:
            await _until(lambda: len(world.watches()) >= 2, 60, "operator watching")
            await asyncio.sleep(1.0)
            result = await _measure(world, kmock, proc, jobs, rate, timeout)
            await asyncio.sleep(1.0)
            result["handlers"] = _handler_stats(await asyncio.to_thread(_scrape, port))
        finally:
            process.terminate()
            await process.wait()
    return {**result, "log": str(log)}


def _scrape(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


_COLUMNS = (
    "TrainingJobs", "created", "reconciled", "JobSet POSTs", "all Created", "all Running",
    "create→Created p50 / p99", "create handler p50 / p99", "jobset_event p99", "track p99", "handler errors",
    "operator CPU per job", "kmock CPU busy", "operator RSS idle → peak",
)  # fmt: skip


def _row(r: dict[str, Any]) -> list[str]:
    h = r["handlers"]

    def ms(name: str, key: str) -> str:
        return f"{h.get(name, {}).get(key, float('nan')):.0f} ms"

    latency = r["create_to_created_ms"]
    return [
        str(r["jobs"]),
        f"{r['rate']:g}/s" if r["rate"] else "at once",
        f"{r['reconciled']}/{r['jobs']}",
        str(r["jobset_posts"]),
        f"{r['all_created_s']} s",
        f"{r['all_running_s']} s",
        f"{latency['p50']:.0f} / {latency['p99']:.0f} ms",
        f"{ms('create', 'p50_ms')} / {ms('create', 'p99_ms')}",
        ms("jobset_event", "p99_ms"),
        ms("track", "p99_ms"),
        str(int(sum(v["errors"] for v in h.values()))),
        f"{r['operator_cpu_ms_per_job']:.0f} ms",
        f"{100 * r['fake_api_cpu_busy']:.0f}%",
        f"{r['rss_idle_mib']} → {r['rss_peak_mib']} MiB",
    ]


def _table(results: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(_row(r)) + " |" for r in results]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["20:0", "200:0", "200:20"],
        help="JOBS:RATE per run; RATE TrainingJobs per second, 0 = all at once.",
    )
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    args = parser.parse_args()
    runs = [(int(jobs), float(rate)) for jobs, rate in (r.split(":") for r in args.runs)]
    results = [asyncio.run(run(jobs, rate, args.timeout)) for jobs, rate in runs]
    print(_table(results))
    base = results[0]
    for r in results[1:]:
        ratio = r["handlers"]["create"]["p99_ms"] / max(base["handlers"]["create"]["p99_ms"], 1e-9)
        per_job = (r["rss_peak_mib"] - r["rss_idle_mib"]) / r["jobs"]
        print(
            f"{r['jobs']} jobs ({_row(r)[1]}) vs {base['jobs']} ({_row(base)[1]}): create-handler p99 x{ratio:.2f}, "
            f"peak RSS growth {per_job * 1024:.0f} KiB per TrainingJob"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if any(r["reconciled"] != r["jobs"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
