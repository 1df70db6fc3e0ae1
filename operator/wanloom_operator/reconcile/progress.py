"""Live progress: read rank 0's Prometheus endpoint and turn it into ``status.progress``.

Parsing and the step-time arithmetic are pure; :func:`fetch_metrics` is the only I/O (one HTTP GET). Which address
rank 0 has is a setting (``OperatorSettings.rank0_address``): ``pod-ip`` reads it from the pod (works with host
networking too), ``dns`` uses the JobSet pod FQDN (operator inside the cluster), ``static:HOST`` pins a host
(port-forwards, tests).

Step time is the mean over the last interval, from the histogram's ``_sum``/``_count`` deltas between two reads
(the slowest rank if rank 0 exports several); the first read uses the totals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from wanloom_api import keys
from wanloom_api.metrics import Metric


@dataclass
class Scrape:
    """One read of rank 0's metrics: gauge values and the step-time histogram per rank."""

    gauges: dict[str, list[float]] = field(default_factory=dict)
    step_time: dict[str, tuple[float, float]] = field(default_factory=dict)  # rank -> (sum, count)


def parse_metrics(text: str) -> Scrape:
    """Prometheus text exposition -> the series progress needs (unknown series are ignored)."""
    scrape = Scrape()
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{Metric.STEP_TIME_SECONDS}_sum":
                sums[sample.labels.get("rank", "")] = sample.value
            elif sample.name == f"{Metric.STEP_TIME_SECONDS}_count":
                counts[sample.labels.get("rank", "")] = sample.value
            elif sample.name in (
                Metric.STEP,
                Metric.TOTAL_STEPS,
                Metric.LOAD_IMBALANCE_CV,
                Metric.TOKENS_PER_SECOND,
                Metric.LOSS,
                Metric.LAST_CHECKPOINT_STEP,
            ):
                scrape.gauges.setdefault(sample.name, []).append(sample.value)
    scrape.step_time = {rank: (sums[rank], counts[rank]) for rank in sums if rank in counts}
    return scrape


def progress_patch(scrape: Scrape, previous: Scrape | None, now: str) -> dict[str, Any]:
    """``status.progress`` from this read (and the previous one, for the step-time window)."""
    patch: dict[str, Any] = {
        "step": _int(_first(scrape, Metric.STEP)),
        "totalSteps": _int(_first(scrape, Metric.TOTAL_STEPS)),
        "stepTimeSeconds": step_time_seconds(scrape, previous),
        "loadImbalanceCV": _first(scrape, Metric.LOAD_IMBALANCE_CV),
        "tokensPerSecond": _first(scrape, Metric.TOKENS_PER_SECOND),
        "loss": _mean(scrape.gauges.get(Metric.LOSS, [])),
        "lastCheckpointStep": _int(_first(scrape, Metric.LAST_CHECKPOINT_STEP)),
        "updatedAt": now,
    }
    return {k: v for k, v in patch.items() if v is not None}


def step_time_seconds(scrape: Scrape, previous: Scrape | None) -> float | None:
    means = []
    for rank, (total, count) in scrape.step_time.items():
        old_total, old_count = previous.step_time.get(rank, (0.0, 0.0)) if previous else (0.0, 0.0)
        if count < old_count:  # the trainer restarted: its counters began again
            old_total, old_count = 0.0, 0.0
        if count - old_count > 0:
            means.append((total - old_total) / (count - old_count))
    return round(max(means), 6) if means else None


def rank0_host(rank0_address: str, pods: list[dict[str, Any]], jobset: str, fqdn: str, namespace: str) -> str | None:
    """Where rank 0 listens, or None while it has no address yet."""
    if rank0_address.startswith("static:"):
        return rank0_address.removeprefix("static:")
    if rank0_address == "dns":
        return f"{fqdn}.{namespace}.svc"
    pod = rank0_pod(pods, jobset)
    return ((pod or {}).get("status") or {}).get("podIP")


def rank0_pod(pods: list[dict[str, Any]], jobset: str) -> dict[str, Any] | None:
    """The running pod with job index 0 and completion index 0 of ``jobset`` (filtered here, not by a selector)."""
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
        if (
            labels.get(keys.JOBSET_NAME) == jobset
            and labels.get(keys.JOBSET_JOB_INDEX) == "0"
            and annotations.get(keys.JOB_COMPLETION_INDEX) == "0"
            and (pod.get("status") or {}).get("phase") == "Running"
        ):
            return pod
    return None


async def fetch_metrics(host: str, port: int, timeout: float) -> str:
    """GET http://host:port/metrics.

    Raises:
        aiohttp.ClientError, TimeoutError: when rank 0 cannot be read (the caller keeps the last progress).
    """
    url = f"http://{host}:{port}/metrics"
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
        session.get(url) as response,
    ):
        response.raise_for_status()
        return await response.text()


def _first(scrape: Scrape, name: str) -> float | None:
    values = [v for v in scrape.gauges.get(name, []) if math.isfinite(v)]
    return values[0] if values else None


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return round(sum(finite) / len(finite), 6) if finite else None


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)
