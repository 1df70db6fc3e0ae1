"""JobSet -> TrainingJob status: on every JobSet event, and periodically with rank 0's progress while Running.

The status written here (phase, conditions, restarts, per-replicated-job counts, progress) is derived by the pure
functions in status.py and progress.py; a write happens only when something changed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from wanloom_api import conditions as cond
from wanloom_api import keys
from wanloom_api.trainingjob import API_VERSION, KIND
from wanloom_api.validation import validate_trainingjob
from wanloom_operator.reconcile import progress
from wanloom_operator.reconcile.children import manifest, owned_by
from wanloom_operator.reconcile.runtime import Runtime
from wanloom_operator.reconcile.status import (
    Intent,
    changed,
    derive_phase,
    derive_status,
    run_deadline,
    trainer_failure,
)
from wanloom_operator.render.names import Names, job_names
from wanloom_operator.render.pods import CONTAINER_NAME, pod_shape


def owner_name(jobset: Mapping[str, Any]) -> str | None:
    """The name of the TrainingJob controlling ``jobset``, if any."""
    for ref in (jobset.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion") == API_VERSION and ref.get("controller"):
            return ref.get("name")
    return None


async def mirror_jobset(jobset: Mapping[str, Any], runtime: Runtime, now: str | None = None) -> dict[str, Any] | None:
    """Write the status derived from ``jobset`` into its TrainingJob; returns the patch written (None: nothing)."""
    meta, owner = jobset.get("metadata") or {}, owner_name(jobset)
    if owner is None:
        return None
    return await _write_status(meta["namespace"], owner, jobset, runtime, now or cond.now_rfc3339())


async def _write_status(
    namespace: str,
    name: str,
    jobset: Mapping[str, Any] | None,
    runtime: Runtime,
    now: str,
    progress_patch: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Derive the status from ``jobset`` (None: keep it) and write it with ``progress_patch``, if anything changed.

    A run past its deadline has its JobSet suspended *before* Failed is written: once the phase is terminal no
    handler looks at the JobSet again, so a suspension left for later would never happen.
    """
    trainingjob = await runtime.cluster.get_trainingjob(namespace, name)
    if trainingjob is None:
        return None
    if jobset is not None and not owned_by(jobset, trainingjob):
        jobset = None
    failure = None
    if jobset is not None:
        jobset = await _stop_past_deadline(jobset, trainingjob, runtime, now)
        failure = await _trainer_failure(jobset, trainingjob, runtime, now)

    def compute(current: dict[str, Any]) -> dict[str, Any]:
        status = current.get("status") or {}
        patch: dict[str, Any] = {}
        if jobset is not None:
            generation = (current.get("metadata") or {}).get("generation")
            derived = derive_status(dict(jobset), _intent(current), status, now, generation, failure)
            patch = derived if changed(derived, status) else {}
        if progress_patch:
            patch["progress"] = progress_patch
        return patch

    return await runtime.cluster.update_trainingjob_status(namespace, name, compute, current=trainingjob)


async def _stop_past_deadline(
    jobset: Mapping[str, Any], trainingjob: Mapping[str, Any], runtime: Runtime, now: str
) -> Mapping[str, Any]:
    """Suspend a running JobSet whose run is past spec.activeDeadlineSeconds; the JobSet as it is afterwards.

    Suspending deletes the pods and keeps the objects for inspection.
    """
    spec = jobset.get("spec") or {}
    if (
        spec.get("suspend")
        or derive_phase(dict(jobset), _intent(trainingjob), now).reason != cond.Reason.DEADLINE_EXCEEDED
    ):
        return jobset
    meta = jobset["metadata"]
    await runtime.cluster.patch_jobset(meta["namespace"], meta["name"], {"spec": {"suspend": True}})
    logging.getLogger(__name__).warning(
        f"{meta['namespace']}/{meta['name']}: spec.activeDeadlineSeconds ran out, JobSet suspended"
    )
    return {**jobset, "spec": {**spec, "suspend": True}}


async def _trainer_failure(
    jobset: Mapping[str, Any], trainingjob: Mapping[str, Any], runtime: Runtime, now: str
) -> str | None:
    """The failed trainer's own reason (``status.trainer_failure``), read from the JobSet's pods once: when the
    JobSet has just failed and the TrainingJob is not Failed yet."""
    if (trainingjob.get("status") or {}).get("phase") == cond.Phase.FAILED:
        return None
    if derive_phase(dict(jobset), _intent(trainingjob), now).phase != cond.Phase.FAILED:
        return None
    meta = jobset["metadata"]
    pods = await runtime.cluster.list_pods(meta["namespace"], f"{keys.JOBSET_NAME}={meta['name']}")
    return trainer_failure(pods, CONTAINER_NAME)


@dataclass
class Tracked:
    """What the tracker of one TrainingJob keeps between passes."""

    scrape: progress.Scrape | None = None  # the last metrics read (the next pass measures step time against it)
    # Rank 0's pod IP and the JobSet attempt (uid/restarts) it belongs to: pods are listed once per attempt, not
    # once per pass (the IP changes only when the pods are replaced, and a replacement is a JobSet restart).
    rank0: tuple[str, str] | None = None


async def refresh(body: Mapping[str, Any], runtime: Runtime, tracked: Tracked, logger: logging.Logger) -> None:
    """One periodic pass for a TrainingJob: re-derive its status from the JobSet, and read progress if Running."""
    names = _names(body, runtime)
    if names is None:
        return
    namespace, name, now = body["metadata"]["namespace"], body["metadata"]["name"], cond.now_rfc3339()
    jobset = await runtime.cluster.get_jobset(namespace, names.jobset)
    if jobset is not None and not owned_by(jobset, body):
        jobset = None
    progress_patch = None
    if jobset is not None and _phase(jobset, body) == cond.Phase.RUNNING:
        scrape = await _read_progress(body, jobset, names, runtime, tracked, logger)
        if scrape is not None:
            progress_patch = progress.progress_patch(scrape, tracked.scrape, now)
            tracked.scrape = scrape
    await _write_status(namespace, name, jobset, runtime, now, progress_patch)


def _phase(jobset: Mapping[str, Any], body: Mapping[str, Any]) -> str:
    return derive_phase(dict(jobset), _intent(body), cond.now_rfc3339()).phase


async def _read_progress(
    body: Mapping[str, Any],
    jobset: Mapping[str, Any],
    names: Names,
    runtime: Runtime,
    tracked: Tracked,
    logger: logging.Logger,
) -> progress.Scrape | None:
    settings, namespace = runtime.settings, body["metadata"]["namespace"]
    if settings.rank0_address == "pod-ip":
        attempt = f"{jobset['metadata'].get('uid')}/{(jobset.get('status') or {}).get('restarts') or 0}"
        if tracked.rank0 is None or tracked.rank0[0] != attempt:
            selector = f"{keys.JOBSET_NAME}={names.jobset},{keys.JOBSET_JOB_INDEX}=0"
            pods = await runtime.cluster.list_pods(namespace, selector)
            ip = progress.rank0_host("pod-ip", pods, names.jobset, names.pod_fqdn(), namespace)
            tracked.rank0 = (attempt, ip) if ip else None
        host = tracked.rank0[1] if tracked.rank0 else None
    else:
        host = progress.rank0_host(settings.rank0_address, [], names.jobset, names.pod_fqdn(), namespace)
    if host is None:
        logger.debug("rank 0 has no address yet")
        return None
    port = int((body.get("spec") or {}).get("metricsPort") or keys.DEFAULT_METRICS_PORT)
    try:
        text = await progress.fetch_metrics(host, port, settings.progress_timeout_seconds)
        return progress.parse_metrics(text)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        logger.info(f"cannot read rank 0's metrics at {host}:{port}: {exc!r}")
        return None


def _names(body: Mapping[str, Any], runtime: Runtime) -> Names | None:
    """The child names of a valid TrainingJob (None while its spec is invalid)."""
    result = validate_trainingjob(manifest(body))
    if result.job is None:
        return None
    shape = pod_shape(result.job.spec, runtime.settings)
    return job_names(result.job.metadata.name, shape.replicated_job, shape.replicas, shape.pods_per_job)


def _intent(trainingjob: Mapping[str, Any]) -> Intent:
    spec, status = trainingjob.get("spec") or {}, trainingjob.get("status") or {}
    return Intent(
        suspend=bool(spec.get("suspend")),
        queue_name=(spec.get("resources") or {}).get("queueName"),
        deadline=run_deadline(status.get("startTime"), spec.get("activeDeadlineSeconds")),
        export_uri=(spec.get("export") or {}).get("uri"),
    )
