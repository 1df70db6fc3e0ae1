"""A TrainingJob's children, the ConfigMap and the JobSet: compare what exists with what the spec asks for.

Idempotent, so create, resume, update and the JobSet watch can all call :func:`reconcile_children`:

1. validate (invalid: condition Valid=False, a Warning Event with every field path, phase Invalid if no JobSet);
2. render (pure);
3. no JobSet: create the ConfigMap and the JobSet; a 409 means it already exists (a retried request, a second
   caller, an operator restart): adopt it if it is ours, never create a second one. A finished TrainingJob is never
   given a new JobSet (its JobSet may be gone after ttlSecondsAfterFinished);
4. a JobSet from an older spec (its spec-hash annotation differs): while suspended, replace it (a JobSet's pod
   template is immutable); while running, report it (condition SpecChangePending and an Event), never ignore it;
5. propagate ``spec.suspend``: to the JobSet, or with a Kueue queue to its Workload's ``spec.active`` (Kueue owns
   the JobSet's suspend flag and would undo ours).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from wanloom_api import conditions as cond
from wanloom_api import keys
from wanloom_api.latentdataset import DatasetPhase
from wanloom_api.trainingjob import API_VERSION, KIND, TrainingJob
from wanloom_api.validation import FieldError, InvalidTrainingJob, validate_trainingjob, with_spec
from wanloom_operator.reconcile.cluster import ApiError
from wanloom_operator.reconcile.runtime import Runtime
from wanloom_operator.reconcile.status import Intent, derive_phase
from wanloom_operator.render.jobset import Rendered, render_trainingjob

MAX_EVENT_MESSAGE = 1000  # Kubernetes caps Event messages at 1 kB


class RetryLater(Exception):
    """Not an error: something is still in progress (an old JobSet being deleted); try again after ``delay``."""

    def __init__(self, message: str, delay: float) -> None:
        super().__init__(message)
        self.delay = delay


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass
class Outcome:
    """What one reconciliation wants written back: status changes, Events, and whether to try again.

    Conditions and the phase are applied to the *fresh* status at write time (:meth:`status_patch`): the JobSet
    watch writes the same status concurrently, and a list in a merge patch replaces the whole list.
    """

    conditions: list[dict[str, Any]]
    now: str
    generation: int | None = None  # metadata.generation of the spec read: each condition set records it
    fields: dict[str, Any] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    retry_after: float | None = None
    phase: str | None = None
    phase_unless_created: bool = False  # set the phase only while no JobSet was ever created
    phase_from: frozenset[str | None] | None = None  # set the phase only over these (None: any)
    previous: dict[str, Any] = field(default_factory=dict)  # the status this outcome started from
    _touched: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def start(cls, status: Mapping[str, Any], now: str, generation: int | None = None) -> Outcome:
        conditions = [dict(c) for c in status.get("conditions") or []]
        return cls(conditions=conditions, now=now, generation=generation, previous=dict(status))

    def set(self, type_: str, status: cond.Status, reason: str, message: str = "") -> None:
        before = next((c for c in self.conditions if c.get("type") == type_), None)
        self.conditions = cond.set_condition(
            self.conditions, type_, status, reason, message, now=self.now, generation=self.generation
        )
        after = next(c for c in self.conditions if c.get("type") == type_)
        if after != before:
            self._touched[type_] = after

    def event(self, type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.events.append(Event(type_, reason, message[:MAX_EVENT_MESSAGE]))

    def status_patch(self, fresh: Mapping[str, Any]) -> dict[str, Any]:
        """The merge patch for a TrainingJob whose current status is ``fresh`` (empty: nothing to write)."""
        patch = {k: v for k, v in self.fields.items() if fresh.get(k) != v}
        current = [dict(c) for c in fresh.get("conditions") or []]
        merged = current
        for type_, condition in self._touched.items():
            index = next((i for i, c in enumerate(merged) if c.get("type") == type_), None)
            merged = [*merged, condition] if index is None else [*merged[:index], condition, *merged[index + 1 :]]
        if merged != current:
            patch["conditions"] = merged
        if self.phase and self._phase_allowed(fresh, merged) and fresh.get("phase") != self.phase:
            patch["phase"] = self.phase
        return patch

    def _phase_allowed(self, fresh: Mapping[str, Any], conditions: list[dict[str, Any]]) -> bool:
        if self.phase_unless_created and cond.condition_status(conditions, cond.ConditionType.CREATED) == "True":
            return False
        return self.phase_from is None or fresh.get("phase") in self.phase_from


async def reconcile_children(body: Mapping[str, Any], runtime: Runtime, now: str | None = None) -> Outcome:
    """Bring the children of one TrainingJob (``body``: the object as the API returns it) in line with its spec."""
    status = body.get("status") or {}
    out = Outcome.start(status, now or cond.now_rfc3339(), (body.get("metadata") or {}).get("generation"))
    result = validate_trainingjob(manifest(body))
    if result.job is None:
        return _invalid(out, result.errors, status)
    try:
        rendered = render_trainingjob(result.job, runtime.settings, owner_uid=_uid(body))
    except InvalidTrainingJob as exc:
        return _invalid(out, exc.errors, status)
    _valid(out, status, body)
    if status.get("phase") in cond.TERMINAL_PHASES:
        return out  # finished: leave the JobSet (or its absence after its TTL) alone
    job, names = result.job, rendered.names
    if job.spec.data.dataset is not None:
        resolved = await _with_dataset(out, job, runtime)
        if resolved is None:
            return out
        job, rendered = resolved, render_trainingjob(resolved, runtime.settings, owner_uid=_uid(body))
    current = await runtime.cluster.get_jobset(rendered.jobset["metadata"]["namespace"], names.jobset)
    if current is None and status.get("createdSpecHash") == rendered.spec_hash:
        _gone(out, status, names.jobset)
    elif current is None:
        await _create(out, rendered, job, runtime)
    elif not owned_by(current, body):
        _name_conflict(out, names.jobset)
    else:
        await _sync_existing(out, current, rendered, job, runtime)
    return out


async def _with_dataset(out: Outcome, job: TrainingJob, runtime: Runtime) -> TrainingJob | None:
    """The job reading its LatentDataset's output, once that is Ready; None while it waits (phase Pending) or after
    the dataset failed (phase Failed, with the dataset's message). The dataset's status changes reconcile the jobs
    that name it (dataset handlers), so nothing polls."""
    name = job.spec.data.dataset
    assert name is not None
    found = await runtime.cluster.get_latentdataset(job.metadata.namespace or "default", name)
    verdict, message, uri = dataset_gate(found, name)
    if verdict == "ready" and uri:
        out.set(cond.ConditionType.DATA_READY, "True", cond.Reason.DATASET_READY, message)
        return with_spec(job, data={"uri": uri, "dataset": None})
    if verdict == "fail":
        out.set(cond.ConditionType.DATA_READY, "False", cond.Reason.DATASET_FAILED, message)
        out.set(cond.ConditionType.FAILED, "True", cond.Reason.DATASET_FAILED, message)
        out.phase, out.phase_unless_created = cond.Phase.FAILED, True
        out.event("Warning", cond.Reason.DATASET_FAILED, message)
    else:
        reason = cond.Reason.DATASET_NOT_FOUND if found is None else cond.Reason.WAITING_FOR_DATASET
        out.set(cond.ConditionType.DATA_READY, "False", reason, message)
        out.phase, out.phase_unless_created = cond.Phase.PENDING, True
    out.fields["message"] = message
    return None


def dataset_gate(dataset: Mapping[str, Any] | None, name: str) -> tuple[str, str, str | None]:
    """Whether a TrainingJob naming LatentDataset ``name`` may start: ("ready" | "wait" | "fail", message, uri)."""
    if dataset is None:
        return "wait", f"waiting for LatentDataset {name}, which does not exist (yet)", None
    status = dataset.get("status") or {}
    phase = status.get("phase")
    if phase == DatasetPhase.READY:
        return "ready", f"LatentDataset {name} is Ready", status.get("outputUri")
    if phase in (DatasetPhase.FAILED, DatasetPhase.INVALID):
        return "fail", f"LatentDataset {name} {str(phase).lower()}: {status.get('message') or ''}".strip(), None
    progress = status.get("message") or "not started"
    return "wait", f"waiting for LatentDataset {name} ({phase or 'Pending'}: {progress})", None


def manifest(body: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a live object the API validates (status and server bookkeeping left out)."""
    meta = body.get("metadata") or {}
    kept = {k: meta[k] for k in ("name", "namespace", "uid", "labels", "annotations") if meta.get(k) is not None}
    return {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"), "metadata": kept, "spec": body.get("spec")}


def owned_by(child: Mapping[str, Any], owner: Mapping[str, Any]) -> bool:
    """Whether ``child`` has a controller reference to the TrainingJob ``owner`` (by uid when both have one)."""
    uid, name = _uid(owner), (owner.get("metadata") or {}).get("name")
    for ref in (child.get("metadata") or {}).get("ownerReferences") or []:
        same_owner = ref.get("kind") == KIND and ref.get("apiVersion") == API_VERSION and ref.get("name") == name
        if same_owner and (not uid or not ref.get("uid") or ref.get("uid") == uid):
            return True
    return False


def _uid(body: Mapping[str, Any]) -> str | None:
    return (body.get("metadata") or {}).get("uid")


def _invalid(out: Outcome, errors: tuple[FieldError, ...], status: Mapping[str, Any]) -> Outcome:
    message = "; ".join(str(e) for e in errors)
    already = any(
        c.get("type") == cond.ConditionType.VALID and c.get("status") == "False" and c.get("message") == message
        for c in out.conditions
    )
    out.set(cond.ConditionType.VALID, "False", cond.Reason.INVALID_SPEC, message)
    out.fields["message"] = message
    out.phase, out.phase_unless_created = cond.Phase.INVALID, True  # with a JobSet, the phase keeps following it
    if not already:
        out.event("Warning", cond.Reason.INVALID_SPEC, message)
    return out


def _valid(out: Outcome, status: Mapping[str, Any], body: Mapping[str, Any]) -> None:
    if cond.condition_status(out.conditions, cond.ConditionType.VALID) == "False":
        out.fields["message"] = None  # the problem is fixed
    out.set(cond.ConditionType.VALID, "True", cond.Reason.VALID)
    generation = (body.get("metadata") or {}).get("generation")
    if generation is not None and status.get("observedGeneration") != generation:
        out.fields["observedGeneration"] = generation


async def _create(out: Outcome, rendered: Rendered, job: TrainingJob, runtime: Runtime) -> None:
    await ensure_configmap(rendered.configmap, rendered.spec_hash, runtime)
    namespace, name = rendered.jobset["metadata"]["namespace"], rendered.names.jobset
    try:
        await runtime.cluster.create_jobset(rendered.jobset)
    except ApiError as exc:
        if exc.transient:
            raise  # retried by the caller; a create that did happen is found (409) and adopted next time
        if not exc.conflict:
            _rejected(out, exc)
            return
        current = await runtime.cluster.get_jobset(namespace, name)
        if current is None:
            raise RetryLater(f"JobSet {name} is still being deleted", delay=2) from None
        owner = {"metadata": {"name": job.metadata.name, "uid": (job.metadata.model_extra or {}).get("uid")}}
        if not owned_by(current, owner):
            _name_conflict(out, name)
            return
        await _sync_existing(out, current, rendered, job, runtime)
        return
    out.set(cond.ConditionType.CREATED, "True", cond.Reason.JOBSET_CREATED, f"JobSet {name}")
    out.fields["createdSpecHash"] = rendered.spec_hash
    out.event("Normal", cond.Reason.JOBSET_CREATED, f"created JobSet {namespace}/{name}")
    if cond.condition_status(out.conditions, cond.ConditionType.SPEC_CHANGE_PENDING) == "True":
        out.set(cond.ConditionType.SPEC_CHANGE_PENDING, "False", cond.Reason.SPEC_APPLIED)
    out.phase = derive_phase(rendered.jobset, _intent(job)).phase  # a new JobSet has no status yet
    out.phase_from = frozenset({None, cond.Phase.INVALID})
    if job.spec.suspend and job.spec.resources.queue_name:
        out.retry_after = 2.0  # Kueue creates the Workload next: come back to deactivate it before it is admitted


async def _sync_existing(
    out: Outcome, current: dict[str, Any], rendered: Rendered, job: TrainingJob, runtime: Runtime
) -> None:
    name = rendered.names.jobset
    if (current.get("metadata") or {}).get("deletionTimestamp"):
        raise RetryLater(f"JobSet {name} is being deleted", delay=2)
    if cond.condition_status(out.conditions, cond.ConditionType.CREATED) != "True":
        out.set(cond.ConditionType.CREATED, "True", cond.Reason.JOBSET_ADOPTED, f"JobSet {name}")
    adopted = _annotations(current).get(keys.ANNOTATION_SPEC_HASH)
    if adopted and out.previous.get("createdSpecHash") != adopted:
        out.fields["createdSpecHash"] = adopted
    if _annotations(current).get(keys.ANNOTATION_SPEC_HASH) != rendered.spec_hash:
        await _spec_changed(out, current, rendered, job, runtime)
        return
    if cond.condition_status(out.conditions, cond.ConditionType.SPEC_CHANGE_PENDING) == "True":
        out.set(cond.ConditionType.SPEC_CHANGE_PENDING, "False", "SpecMatches")
    await _sync_suspend(out, current, job, runtime)


async def _spec_changed(
    out: Outcome, current: dict[str, Any], rendered: Rendered, job: TrainingJob, runtime: Runtime
) -> None:
    namespace, name = rendered.jobset["metadata"]["namespace"], rendered.names.jobset
    if not (_suspended(current) or job.spec.suspend):
        message = (
            f"the spec changed (now {rendered.spec_hash}) while JobSet {name} runs "
            f"({_annotations(current).get(keys.ANNOTATION_SPEC_HASH)}); set spec.suspend: true to apply it "
            "(the job then resumes from its last checkpoint)"
        )
        if not any(
            c.get("type") == cond.ConditionType.SPEC_CHANGE_PENDING and c.get("message") == message
            for c in out.conditions
        ):
            out.event("Warning", cond.Reason.NOT_SUSPENDED, message)
        out.set(cond.ConditionType.SPEC_CHANGE_PENDING, "True", cond.Reason.NOT_SUSPENDED, message)
        return
    # The pod template of a JobSet is immutable: replace it. Suspended, it runs no pods.
    await ensure_configmap(rendered.configmap, rendered.spec_hash, runtime)
    await runtime.cluster.delete_jobset(namespace, name)
    try:
        await runtime.cluster.create_jobset(rendered.jobset)
    except ApiError as exc:
        if exc.conflict:
            raise RetryLater(f"re-creating JobSet {name} once the old one is gone", delay=2) from None
        raise
    out.set(cond.ConditionType.SPEC_CHANGE_PENDING, "False", cond.Reason.SPEC_APPLIED)
    out.fields["createdSpecHash"] = rendered.spec_hash
    out.event(
        "Normal", cond.Reason.SPEC_APPLIED, f"re-created JobSet {namespace}/{name} with spec {rendered.spec_hash}"
    )


async def _sync_suspend(out: Outcome, current: dict[str, Any], job: TrainingJob, runtime: Runtime) -> None:
    if job.spec.resources.queue_name:
        await sync_workload_active(out, current, job.spec.suspend, runtime)
        return
    want = job.spec.suspend
    if want == _suspended(current):
        return
    meta = current["metadata"]
    await runtime.cluster.patch_jobset(meta["namespace"], meta["name"], {"spec": {"suspend": want}})
    out.event("Normal", "Suspended" if want else "Resumed", f"JobSet {meta['name']} suspend={str(want).lower()}")


async def sync_workload_active(out: Outcome, current: dict[str, Any], suspend: bool, runtime: Runtime) -> None:
    """Under Kueue a queued object's suspend flag (a JobSet's, a dataset step's Job) is Kueue's: one we suspend while
    its Workload is admitted, Kueue starts again. What Kueue offers instead is the Workload's spec.active: false
    evicts and suspends it and keeps it out of the queue, true queues it again."""
    meta = current["metadata"]
    workloads = await runtime.cluster.list_workloads(meta["namespace"], f"{keys.KUEUE_JOB_UID}={meta['uid']}")
    if not workloads:
        if suspend:
            raise RetryLater(f"waiting for Kueue to create the Workload of {current.get('kind')} {meta['name']}", 2)
        return  # created active: nothing to change
    want = not suspend
    for workload in workloads:
        if (workload.get("spec") or {}).get("active", True) == want:
            continue
        name = workload["metadata"]["name"]
        await runtime.cluster.patch_workload(meta["namespace"], name, {"spec": {"active": want}})
        verb = "Resumed" if want else "Suspended"
        out.event(
            "Normal", verb, f"Kueue Workload {name} active={str(want).lower()} ({current.get('kind')} {meta['name']})"
        )


async def ensure_configmap(cm: dict[str, Any], spec_hash: str, runtime: Runtime) -> None:
    """Create a ConfigMap (a trainer's or a dataset's pods'), or bring an existing one of ours to the rendered
    content (its spec-hash annotation differs)."""
    namespace, name = cm["metadata"]["namespace"], cm["metadata"]["name"]
    try:
        await runtime.cluster.create_configmap(cm)  # the common case; an existing one answers 409
        return
    except ApiError as exc:
        if not exc.conflict:
            raise
    current = await runtime.cluster.get_configmap(namespace, name)
    if current is None or _annotations(current).get(keys.ANNOTATION_SPEC_HASH) == spec_hash:
        return
    patch = {"metadata": {"annotations": cm["metadata"]["annotations"]}, "data": cm["data"]}
    await runtime.cluster.patch_configmap(namespace, name, patch)


def _gone(out: Outcome, status: Mapping[str, Any], name: str) -> None:
    """The JobSet created for this very spec is gone without its outcome recorded (its TTL deleted it while the
    operator was down, or someone deleted it): the run is over. It succeeded if rank 0 last reported the final
    step; otherwise the outcome is unknown and the job is Failed, saying why. Never started again."""
    progress = status.get("progress") or {}
    step, total = progress.get("step"), progress.get("totalSteps")
    done = step is not None and total is not None and step + 1 >= total
    phase = cond.Phase.SUCCEEDED if done else cond.Phase.FAILED
    message = (
        f"JobSet {name} was deleted before its outcome was recorded (ttlSecondsAfterFinished while the operator "
        f"was down, or a manual delete); "
        + ("rank 0 had reported the final step" if done else f"last reported step: {step}; outcome unknown")
    )
    out.set(
        cond.ConditionType.SUCCEEDED if done else cond.ConditionType.FAILED, "True", cond.Reason.JOBSET_DELETED, message
    )
    out.fields["message"] = message
    out.phase, out.phase_from = phase, None
    out.event("Normal" if done else "Warning", cond.Reason.JOBSET_DELETED, message)


def _rejected(out: Outcome, exc: ApiError) -> None:
    """The API refused the JobSet: say so; retry where the cause may go away (RBAC, CRD not installed yet)."""
    message = f"the API server rejected the JobSet: {exc}"
    out.set(cond.ConditionType.CREATED, "False", "JobSetRejected", message)
    out.fields["message"] = message
    out.event("Warning", "JobSetRejected", message)
    out.retry_after = 60.0 if exc.status in (403, 404) else None


def _name_conflict(out: Outcome, name: str) -> None:
    message = f"a JobSet named {name} exists and is not owned by this TrainingJob; rename one of them"
    if cond.condition_status(out.conditions, cond.ConditionType.CREATED) != "False":
        out.event("Warning", cond.Reason.JOBSET_NAME_CONFLICT, message)
    out.set(cond.ConditionType.CREATED, "False", cond.Reason.JOBSET_NAME_CONFLICT, message)
    out.fields["message"] = message


def _intent(job: TrainingJob) -> Intent:
    export_uri = job.spec.export.uri if job.spec.export is not None else None
    return Intent(suspend=job.spec.suspend, queue_name=job.spec.resources.queue_name, export_uri=export_uri)


def _suspended(jobset: Mapping[str, Any]) -> bool:
    return bool((jobset.get("spec") or {}).get("suspend"))


def _annotations(obj: Mapping[str, Any]) -> dict[str, str]:
    return (obj.get("metadata") or {}).get("annotations") or {}
