"""TrainingJob condition types and reasons (Kubernetes ``metav1.Condition`` style, keyed by ``type``).

Part of the API contract: the operator writes them, `kubectl` users and dashboards read them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal


class Phase(StrEnum):
    """status.phase (the table in wanloom_operator.reconcile.status says which JobSet state gives which)."""

    PENDING = "Pending"
    STARTING = "Starting"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    INVALID = "Invalid"


TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})


class ConditionType(StrEnum):
    VALID = "Valid"  # False: the latest spec was rejected (message: every field error)
    CREATED = "Created"  # the JobSet exists (created, or adopted after an operator restart)
    RUNNING = "Running"  # every pod of every Job is ready
    RESTARTING = "Restarting"  # the JobSet is recreating its Jobs after a failure or a disruption
    SUSPENDED = "Suspended"
    QUEUED = "Queued"  # True: the JobSet waits for Kueue to admit it (reason WaitingForAdmission, message: the queue)
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SPEC_CHANGE_PENDING = "SpecChangePending"  # True: a spec change waits for the job to be suspended
    DATA_READY = "DataReady"  # spec.data.dataset: False while the LatentDataset is not Ready (message: its phase)
    READY = "Ready"  # a LatentDataset: True once index.json is written
    # True: a job that was Running has pods that stopped reporting ready (their node stopped answering, its
    # kubelet stopped); it still runs. Set only once it first happens.
    DEGRADED = "Degraded"


class Reason(StrEnum):
    """Condition reasons the operator writes (a failed JobSet's own reason is passed through as it is)."""

    VALID = "Valid"
    INVALID_SPEC = "InvalidSpec"
    JOBSET_CREATED = "JobSetCreated"
    JOBSET_ADOPTED = "JobSetAdopted"
    JOBSET_NAME_CONFLICT = "JobSetNameConflict"
    JOBSET_DELETED = "JobSetDeleted"
    SPEC_APPLIED = "SpecApplied"
    NOT_SUSPENDED = "NotSuspended"
    WAITING_FOR_ADMISSION = "WaitingForAdmission"
    NOT_QUEUED = "NotQueued"
    JOBSET_COMPLETED = "JobSetCompleted"
    JOBSET_FAILED = "JobSetFailed"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    SUSPENDED = "Suspended"
    RESUMING = "Resuming"
    RESTARTING = "Restarting"
    ALL_JOBS_READY = "AllJobsReady"
    JOBS_STARTING = "JobsStarting"
    WAITING_FOR_PODS = "WaitingForPods"
    PODS_NOT_READY = "PodsNotReady"
    ALL_PODS_READY = "AllPodsReady"
    WAITING_FOR_DATASET = "WaitingForDataset"
    DATASET_NOT_FOUND = "DatasetNotFound"
    DATASET_READY = "DatasetReady"
    DATASET_FAILED = "DatasetFailed"


Status = Literal["True", "False", "Unknown"]


def now_rfc3339(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: list[dict[str, Any]],
    type_: str,
    status: Status,
    reason: str,
    message: str = "",
    *,
    now: str,
    generation: int | None = None,
) -> list[dict[str, Any]]:
    """A copy of ``conditions`` with ``type_`` set; its lastTransitionTime moves only when the status changes."""
    old = next((c for c in conditions if c.get("type") == type_), None)
    changed_at = (
        old["lastTransitionTime"] if old and old.get("status") == status and "lastTransitionTime" in old else now
    )
    new: dict[str, Any] = {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": changed_at,
    }
    if generation is not None:
        new["observedGeneration"] = generation
    if old is None:
        return [*conditions, new]
    return [new if c is old else c for c in conditions]  # in place: no reordering, no spurious diffs


def condition_status(conditions: list[dict[str, Any]], type_: str) -> str | None:
    return next((c.get("status") for c in conditions if c.get("type") == type_), None)
