"""kopf handlers: module-level functions, a few lines each, over children.py (TrainingJob -> JobSet) and
observe.py (JobSet -> TrainingJob status). Shared state is ``memo.runtime``; everything else lives on the objects.

kopf's own bookkeeping goes into ``wanloom.dev/*`` annotations: the TrainingJob's status schema is structural, so
fields kopf would add under ``status`` are pruned by the API server. Status itself is written by
``cluster.update_trainingjob_status`` (read, merge by condition type, write with a resourceVersion precondition)
rather than kopf's ``patch``: handlers and the JobSet watch write it concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf

from wanloom_api import keys
from wanloom_api import latentdataset as lds
from wanloom_api import trainingjob as tj
from wanloom_api.conditions import TERMINAL_PHASES, Phase
from wanloom_operator.reconcile import children, datasets, observe
from wanloom_operator.reconcile.cluster import API_THREADS, JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION, ApiError
from wanloom_operator.reconcile.runtime import Runtime
from wanloom_operator.render.dataset import LABEL_DATASET
from wanloom_operator.settings import OperatorSettings

TRAININGJOBS = (tj.GROUP, tj.VERSION, tj.PLURAL)
LATENTDATASETS = (lds.GROUP, lds.VERSION, lds.PLURAL)
JOBSETS = (JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL)
MANAGED = {keys.LABEL_MANAGED_BY: keys.MANAGED_BY}
UNTRACKED_PHASES = TERMINAL_PHASES | {Phase.INVALID}
ANNOTATION_PREFIX = "wanloom.dev"
# kopf puts it on TrainingJobs whose tracker runs (not finished, not invalid), to stop the tracker before deletion.
FINALIZER = "wanloom.dev/operator"


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    if "runtime" not in memo:
        memo.runtime = Runtime.create(OperatorSettings.from_env())
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING  # our Events are explicit; kopf's INFO chatter stays in the log
    # Watching named namespaces needs no cluster-wide reads: without this kopf lists namespaces and watches CRDs,
    # which the chart's namespaced RBAC does not (and should not) grant.
    namespaces = memo.runtime.settings.namespaces
    settings.scanning.disabled = bool(namespaces) and not any(c in n for n in namespaces for c in "*?[]!")
    # API calls run in threads (the Kubernetes client is synchronous): enough of them that a burst of new
    # TrainingJobs waits on the API server, not on a free thread.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(API_THREADS, thread_name_prefix="k8s-api"))
    memo.runtime.start_metrics_server()


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    memo.runtime.stop_metrics_server()


@kopf.on.login()
def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """An explicit API server (kubectl proxy, tests), else the Kubernetes client's in-cluster/kubeconfig login."""
    server = memo.runtime.settings.api_server
    if server:
        return kopf.ConnectionInfo(server=server.rstrip("/"))
    return kopf.login_via_client(**kwargs)


@kopf.on.probe(id="trainingjobs")
def probe(memo: kopf.Memo, **_: Any) -> int:
    return memo.runtime.metrics.known_jobs()


@kopf.on.create(*TRAININGJOBS)
async def create(body: kopf.Body, memo: kopf.Memo, retry: int, **_: Any) -> None:
    await _reconcile("create", body, memo.runtime, retry)


@kopf.on.resume(*TRAININGJOBS)
async def resume(body: kopf.Body, memo: kopf.Memo, retry: int, **_: Any) -> None:
    await _reconcile("resume", body, memo.runtime, retry)


@kopf.on.update(*TRAININGJOBS, field="spec")
async def update(body: kopf.Body, memo: kopf.Memo, retry: int, **_: Any) -> None:
    await _reconcile("update", body, memo.runtime, retry)


@kopf.on.event(*JOBSETS, labels=MANAGED)
async def jobset_event(type: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    runtime: Runtime = memo.runtime
    with runtime.metrics.handler("jobset_event", expected=(children.RetryLater,)):
        if type == "DELETED":
            await _jobset_deleted(body, runtime)
        else:
            await observe.mirror_jobset(body, runtime)


@kopf.on.event(*TRAININGJOBS)
async def trainingjob_event(
    type: str | None, body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, **_: Any
) -> None:
    if type == "DELETED":
        memo.runtime.metrics.forget_job(namespace, name)  # its JobSet and ConfigMap go with it (owner references)
    else:
        memo.runtime.metrics.observe_job(namespace, name, dict(body.get("status") or {}))


def _tracked(status: kopf.Status, **_: Any) -> bool:
    return status.get("phase") not in UNTRACKED_PHASES


@kopf.daemon(*TRAININGJOBS, when=_tracked, cancellation_timeout=5.0)
async def track(stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Every interval: re-derive the status from the JobSet and, while Running, read rank 0's progress.

    It sleeps first (at creation the handlers already write the status), the first time for a random part of the
    interval: jobs created together must not all hit the API server and their trainers in the same second.
    """
    runtime: Runtime = memo.runtime
    tracked, interval = observe.Tracked(), runtime.settings.progress_interval_seconds
    try:
        await asyncio.sleep(random.uniform(0.0, interval))
        while not stopped:
            try:
                with runtime.metrics.handler("track"):
                    await observe.refresh(body, runtime, tracked, logger)
            except ApiError as exc:
                logger.warning(f"status refresh failed, retrying next interval: {exc}")
            await asyncio.sleep(interval)
    except asyncio.CancelledError:
        if not stopped:
            raise
        # kopf stops a daemon (job finished or deleted, operator exiting) by setting its flag, then cancelling
        # it: for the tracker, asleep between passes, that is the normal end, not an error to log.


@kopf.on.create(*LATENTDATASETS)
@kopf.on.resume(*LATENTDATASETS)
@kopf.on.update(*LATENTDATASETS, field="spec")
async def dataset_changed(body: kopf.Body, memo: kopf.Memo, retry: int, **_: Any) -> None:
    await _reconcile_dataset(body, memo.runtime, retry)


@kopf.on.event("batch", "v1", "jobs", labels={**MANAGED, LABEL_DATASET: kopf.PRESENT})
async def dataset_job_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A step's Job changed (an index finished, the Job ended): advance its dataset."""
    owner = next((r for r in body.metadata.get("ownerReferences") or [] if r.get("kind") == lds.KIND), None)
    if type == "DELETED" or owner is None:
        return
    dataset = await memo.runtime.cluster.get_latentdataset(body.metadata["namespace"], owner["name"])
    if dataset is not None:
        await _reconcile_dataset(dataset, memo.runtime, retry=0)


async def _reconcile_dataset(body: Mapping[str, Any], runtime: Runtime, retry: int) -> None:
    try:
        with runtime.metrics.handler("dataset", expected=(children.RetryLater,)):
            outcome = await datasets.reconcile_dataset(body, runtime)
    except children.RetryLater as exc:  # e.g. Kueue has not made a queued step's Workload yet
        raise kopf.TemporaryError(str(exc), delay=exc.delay) from None
    except ApiError as exc:
        if exc.transient or exc.conflict:
            raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=min(2.0**retry, 30.0)) from None
        raise kopf.PermanentError(f"Kubernetes API: {exc}") from None
    meta = body["metadata"]
    written = await runtime.cluster.update_latentdataset_status(
        meta["namespace"], meta["name"], lambda fresh: outcome.status_patch(fresh.get("status") or {}), current=body
    )
    for event in outcome.events:
        kopf.event(dict(body), type=event.type, reason=event.reason, message=event.message)
    if written and "phase" in written:
        await _wake_trainingjobs(meta["namespace"], meta["name"], runtime)


async def _wake_trainingjobs(namespace: str, dataset: str, runtime: Runtime) -> None:
    """The TrainingJobs waiting for ``dataset``, after its phase changed: their DataReady condition says so; Ready
    starts them, Failed fails them with its reason."""
    for trainingjob in await runtime.cluster.list_trainingjobs(namespace):
        waiting = ((trainingjob.get("spec") or {}).get("data") or {}).get("dataset") == dataset
        if waiting and (trainingjob.get("status") or {}).get("phase") not in UNTRACKED_PHASES:
            await _write(await children.reconcile_children(trainingjob, runtime), trainingjob, runtime)


async def _reconcile(handler: str, body: kopf.Body, runtime: Runtime, retry: int) -> None:
    try:
        with runtime.metrics.handler(handler, expected=(children.RetryLater,)):
            outcome = await children.reconcile_children(body, runtime)
    except children.RetryLater as exc:
        raise kopf.TemporaryError(str(exc), delay=exc.delay) from None
    except ApiError as exc:
        if exc.transient:
            raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=min(2.0**retry, 30.0)) from None
        raise kopf.PermanentError(f"Kubernetes API: {exc}") from None
    await _write(outcome, body, runtime)
    if outcome.retry_after is not None:
        raise kopf.TemporaryError("reconciling again shortly", delay=outcome.retry_after)


async def _jobset_deleted(jobset: Mapping[str, Any], runtime: Runtime) -> None:
    """A JobSet vanished: record its last status (a TTL deletes finished ones at once), then re-create it unless
    the TrainingJob is finished, deleted, or a replacement exists."""
    meta, owner = jobset.get("metadata") or {}, observe.owner_name(jobset)
    if owner is None:
        return
    await observe.mirror_jobset(jobset, runtime)
    if await runtime.cluster.get_jobset(meta["namespace"], meta["name"]) is not None:
        return
    trainingjob = await runtime.cluster.get_trainingjob(meta["namespace"], owner)
    if trainingjob is None or not children.owned_by(jobset, trainingjob):
        return  # the TrainingJob was deleted: this is the cascade
    await _write(await children.reconcile_children(trainingjob, runtime), trainingjob, runtime)


async def _write(outcome: children.Outcome, body: Mapping[str, Any], runtime: Runtime) -> None:
    """Status through a guarded read-modify-write (not kopf's patch: the JobSet watch writes the same status),
    then the Events."""
    meta = body["metadata"]
    await runtime.cluster.update_trainingjob_status(
        meta["namespace"], meta["name"], lambda fresh: outcome.status_patch(fresh.get("status") or {}), current=body
    )
    for event in outcome.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
