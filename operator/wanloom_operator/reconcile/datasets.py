"""A LatentDataset's children (its ConfigMap and plan -> encode -> finalize Jobs) and its status.

Idempotent, like ``children.reconcile_children``: the dataset handlers and the Job watch all call
:func:`reconcile_dataset`, which looks at the Jobs that exist and creates the next one. The counts come from the
pods' termination messages (each step prints a JSON summary): the operator never reads the bucket. A Ready or Failed
dataset is left alone, so re-applying a Ready dataset does nothing. A TrainingJob that names a dataset in
``spec.data.dataset`` waits for it (``children.dataset_gate``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from wanloom_api import conditions as cond
from wanloom_api.latentdataset import DATASET_TERMINAL_PHASES, DatasetPhase, LatentDataset
from wanloom_api.validation import validate_latentdataset
from wanloom_operator.reconcile.children import Outcome, ensure_configmap, manifest, sync_workload_active
from wanloom_operator.reconcile.runtime import Runtime
from wanloom_operator.render.dataset import LABEL_DATASET, LABEL_STEP, RenderedDataset, Step, render_dataset
from wanloom_operator.render.names import fit_label_value


async def reconcile_dataset(body: Mapping[str, Any], runtime: Runtime, now: str | None = None) -> Outcome:
    """Create the next step's Job of one LatentDataset and derive its status from the Jobs that exist."""
    status = body.get("status") or {}
    out = Outcome.start(status, now or cond.now_rfc3339(), (body.get("metadata") or {}).get("generation"))
    out.phase_from = None
    result = validate_latentdataset(manifest(body))
    if not isinstance(result.job, LatentDataset):
        message = "; ".join(str(e) for e in result.errors)
        if cond.condition_status(out.conditions, cond.ConditionType.VALID) != "False":
            out.event("Warning", cond.Reason.INVALID_SPEC, message)
        out.set(cond.ConditionType.VALID, "False", cond.Reason.INVALID_SPEC, message)
        out.fields["message"], out.phase = message, DatasetPhase.INVALID
        return out
    out.set(cond.ConditionType.VALID, "True", cond.Reason.VALID)
    if status.get("phase") in DATASET_TERMINAL_PHASES:
        return out
    rendered = render_dataset(result.job, runtime.settings, owner_uid=(body.get("metadata") or {}).get("uid"))
    # A changed spec rewrites the pods' file: a pod that then meets an output built with other settings refuses it,
    # naming the difference, and the dataset fails with that message.
    await ensure_configmap(rendered.configmap, rendered.spec_hash, runtime)
    steps = _Steps(rendered, runtime, out)
    total = status.get("shardsTotal")
    if total is None:  # read once from the plan pod, then kept in the status
        plan = await steps.advance("plan")
        if plan is None:
            return out
        total = int(plan["units"])
        out.fields |= {"inputs": plan["inputs"], "shardsTotal": total, "shardsDone": 0, "startTime": out.now}
    if await steps.advance("encode", units=int(total)) is None:
        return out
    out.fields["shardsDone"] = total
    summary = await steps.advance("finalize")
    if summary is None:
        return out
    _ready(out, result.job, summary)
    return out


class _Steps:
    """Walks plan -> encode -> finalize: each step's Job is created, watched, and read when it has succeeded."""

    def __init__(self, rendered: RenderedDataset, runtime: Runtime, out: Outcome) -> None:
        self.rendered, self.runtime, self.out = rendered, runtime, out
        self.namespace = rendered.configmap["metadata"]["namespace"]

    async def advance(self, step: Step, units: int = 1) -> dict[str, Any] | None:
        """The summary of ``step`` once its Job has succeeded; None while it runs, fails or is being created."""
        name, cluster = self.rendered.job_name(step), self.runtime.cluster
        job = await cluster.get_job(self.namespace, name)
        if job is None:
            await cluster.create_job(self.rendered.job(step, units))
            self.out.event("Normal", "JobCreated", f"created Job {self.namespace}/{name} ({step})")
            self._running(step, None)
            return None
        state = _job_state(job)
        if state == "failed":
            await self._failed(step, job)
            return None
        if state == "running":
            await self._sync_suspend(job)
            self._running(step, job)
            return None
        if step == "encode":
            return {}
        summary = await self._summary(step)
        if summary is None:
            self._fail(f"the {step} pod's summary is gone (its pod was deleted); delete Job {name} to run it again")
        return summary

    def _running(self, step: Step, job: Mapping[str, Any] | None) -> None:
        phase = {"plan": DatasetPhase.PLANNING, "encode": DatasetPhase.ENCODING, "finalize": DatasetPhase.FINALIZING}
        suspended = bool(((job or {}).get("spec") or {}).get("suspend"))
        self.out.phase = DatasetPhase.SUSPENDED if suspended and self.rendered.dataset.spec.suspend else phase[step]
        message = f"{step}: Job {self.rendered.job_name(step)}"
        if step == "encode" and job is not None:
            done = _units_done(job)
            self.out.fields["shardsDone"] = done
            rate = _rate(job, done * self.rendered.dataset.spec.samples_per_shard)
            if rate is not None:
                self.out.fields["inputsPerSecond"] = rate
            message = f"encoding: {done} of {job['spec'].get('completions')} shards written"
        self.out.set(cond.ConditionType.READY, "False", self.out.phase, message)
        self.out.fields["message"] = message

    async def _failed(self, step: Step, job: Mapping[str, Any]) -> None:
        # FailureTarget comes first (Kubernetes >= 1.31 adds Failed once the pods are gone): either one's message
        # says why (for a FailJob rule, the container and its exit code).
        reason = next(
            (
                c.get("message")
                for c in _conditions(job)
                if c.get("type") in ("Failed", "FailureTarget") and c.get("message")
            ),
            "",
        )
        messages = [m for m in await self._messages(step, "Failed") if m]
        # A one-line error from `wanloom data build`, or the log's tail (a traceback): its last line says what.
        detail = messages[0].splitlines()[-1] if messages else reason or f"Job {self.rendered.job_name(step)} failed"
        self._fail(f"{step} failed: {detail}")

    def _fail(self, message: str) -> None:
        out = self.out
        out.phase, out.fields["message"] = DatasetPhase.FAILED, message[:2000]
        out.fields["completionTime"] = out.now
        out.event("Warning", cond.Reason.DATASET_FAILED, message)  # once: a Failed dataset is not reconciled again
        out.set(cond.ConditionType.READY, "False", cond.Reason.DATASET_FAILED, message[:2000])

    async def _summary(self, step: Step) -> dict[str, Any] | None:
        for message in await self._messages(step, "Succeeded"):
            try:
                summary = json.loads(message)
            except (TypeError, ValueError):
                continue
            if isinstance(summary, dict):
                return summary
        return None

    async def _messages(self, step: Step, pod_phase: str) -> list[str]:
        """Termination messages of the step's pods in ``pod_phase``, newest first."""
        selector = f"{LABEL_DATASET}={fit_label_value(self.rendered.dataset.metadata.name)},{LABEL_STEP}={step}"
        pods = await self.runtime.cluster.list_pods(self.namespace, selector)
        pods = [p for p in pods if (p.get("status") or {}).get("phase") == pod_phase]
        pods.sort(key=lambda p: (p.get("metadata") or {}).get("creationTimestamp") or "", reverse=True)
        out = []
        for pod in pods:
            for container in (pod.get("status") or {}).get("containerStatuses") or []:
                terminated = (container.get("state") or {}).get("terminated") or {}
                out.append((terminated.get("message") or "").strip())
        return out

    async def _sync_suspend(self, job: Mapping[str, Any]) -> None:
        """spec.suspend reaches the running step's Job, or with a Kueue queue its Workload (Kueue owns a queued
        Job's flag)."""
        want = self.rendered.dataset.spec.suspend
        if self.rendered.dataset.spec.resources.queue_name:
            await sync_workload_active(self.out, {"kind": "Job", **job}, want, self.runtime)
            return
        if bool((job.get("spec") or {}).get("suspend")) == want:
            return
        await self.runtime.cluster.patch_job(self.namespace, job["metadata"]["name"], {"spec": {"suspend": want}})
        self.out.event("Normal", "Suspended" if want else "Resumed", f"Job {job['metadata']['name']} suspend={want}")


def _ready(out: Outcome, dataset: LatentDataset, summary: Mapping[str, Any]) -> None:
    samples = int(summary.get("samples") or 0)
    skipped = {str(k): int(v) for k, v in (summary.get("skipped") or {}).items()}
    message = f"{samples} samples in {summary.get('shards')} shards at {dataset.spec.output}" + (
        f"; skipped {sum(skipped.values())} inputs ({', '.join(f'{k}: {v}' for k, v in skipped.items())})"
        if skipped
        else ""
    )
    out.phase = DatasetPhase.READY
    out.fields |= {
        "samplesEncoded": samples,
        "skipped": skipped,
        "outputUri": dataset.spec.output,
        "completionTime": out.now,
        "message": message,
    }
    out.set(cond.ConditionType.READY, "True", cond.Reason.DATASET_READY, message)
    out.event("Normal", cond.Reason.DATASET_READY, message)


def _conditions(job: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list((job.get("status") or {}).get("conditions") or [])


def _job_state(job: Mapping[str, Any]) -> str:
    for condition in _conditions(job):
        if condition.get("status") != "True":
            continue
        if condition.get("type") in ("Complete", "SuccessCriteriaMet"):
            return "succeeded"
        if condition.get("type") in ("Failed", "FailureTarget"):
            return "failed"
    return "running"


def _units_done(job: Mapping[str, Any]) -> int:
    """Completed indexes of an Indexed Job ("0-3,5" in status.completedIndexes)."""
    done = 0
    for part in ((job.get("status") or {}).get("completedIndexes") or "").split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        done += int(high or low) - int(low) + 1
    return done


def _rate(job: Mapping[str, Any], inputs: int) -> float | None:
    started = (job.get("status") or {}).get("startTime")
    if not started or not inputs:
        return None
    elapsed = (datetime.now(UTC) - datetime.fromisoformat(started.replace("Z", "+00:00"))).total_seconds()
    return round(inputs / elapsed, 3) if elapsed > 0 else None
