"""PURE: a JobSet (as the API returns it) -> the TrainingJob status patch (phase, conditions, restarts, counts).

JobSet reports ``Completed``, ``Failed``, ``Suspended`` and ``RestartingJobSet`` conditions and per-replicated-job
counts of Jobs, but no Running condition; the phase is derived in this order (first match wins):

| JobSet                                              | phase      |
|-----------------------------------------------------|------------|
| condition Completed=True                            | Succeeded  |
| condition Failed=True                               | Failed     |
| spec.activeDeadlineSeconds passed since startTime   | Failed     |
| spec.suspend, and the TrainingJob asks to suspend   | Suspended  |
| spec.suspend otherwise (Kueue has not admitted it)  | Pending    |
| condition RestartingJobSet=True                     | Restarting |
| every Job ready (ready + succeeded = replicas)      | Running    |
| some Job active or ready                            | Starting   |
| otherwise                                           | Pending    |

A Job is "ready" in JobSet's count when all its pods are ready or done. A job that was Running and loses ready
pods without a restart (the node controller marks the pods of a node that stopped answering not ready) stays
Running, with the condition Degraded=True saying so: its containers run on, and a restart would show as one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from wanloom_api import conditions as cond
from wanloom_api import keys
from wanloom_api.conditions import TERMINAL_PHASES, Phase, Reason

# The phases that have a condition of their own (True while the job is in that phase).
_PHASE_CONDITIONS = {
    Phase.RUNNING: cond.ConditionType.RUNNING,
    Phase.RESTARTING: cond.ConditionType.RESTARTING,
    Phase.SUSPENDED: cond.ConditionType.SUSPENDED,
    Phase.SUCCEEDED: cond.ConditionType.SUCCEEDED,
    Phase.FAILED: cond.ConditionType.FAILED,
}


@dataclass(frozen=True)
class Intent:
    """What the TrainingJob asks for, as far as the phase depends on it."""

    suspend: bool = False
    queue_name: str | None = None
    # When the whole run's spec.activeDeadlineSeconds runs out (status.startTime + it; RFC 3339), restarts
    # included: a Job's own deadline starts again with every restart.
    deadline: datetime | None = None
    # spec.export.uri: the trainer exports before it exits, so a succeeded run has written it.
    export_uri: str | None = None


@dataclass(frozen=True)
class PhaseInfo:
    phase: Phase
    reason: str  # a Reason, or a failed JobSet's own
    message: str = ""


def derive_phase(jobset: dict[str, Any], intent: Intent, now: str | None = None) -> PhaseInfo:
    """The TrainingJob phase for ``jobset`` at ``now`` (see the module table)."""
    status = jobset.get("status") or {}
    true_conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    if "Completed" in true_conditions:
        return PhaseInfo(Phase.SUCCEEDED, Reason.JOBSET_COMPLETED, true_conditions["Completed"].get("message", ""))
    if "Failed" in true_conditions:
        failed = true_conditions["Failed"]
        return PhaseInfo(Phase.FAILED, failed.get("reason") or Reason.JOBSET_FAILED, failed.get("message", ""))
    if intent.deadline is not None and now is not None and parse_time(now) >= intent.deadline:
        message = (
            f"spec.activeDeadlineSeconds ran out at {intent.deadline.isoformat()} (the whole run, restarts included)"
        )
        return PhaseInfo(Phase.FAILED, Reason.DEADLINE_EXCEEDED, message)
    if (jobset.get("spec") or {}).get("suspend"):
        if intent.suspend:
            return PhaseInfo(Phase.SUSPENDED, Reason.SUSPENDED, "spec.suspend is true")
        if intent.queue_name:
            return PhaseInfo(
                Phase.PENDING, Reason.WAITING_FOR_ADMISSION, f"queued in Kueue LocalQueue {intent.queue_name!r}"
            )
        return PhaseInfo(Phase.PENDING, Reason.RESUMING, "the JobSet is being resumed")
    if "RestartingJobSet" in true_conditions:
        restarting = true_conditions["RestartingJobSet"]
        return PhaseInfo(Phase.RESTARTING, restarting.get("reason") or Reason.RESTARTING, restarting.get("message", ""))
    expected, ready, started = _job_counts(jobset)
    if expected and ready >= expected:
        return PhaseInfo(Phase.RUNNING, Reason.ALL_JOBS_READY, f"{ready}/{expected} Jobs ready")
    if started:
        return PhaseInfo(Phase.STARTING, Reason.JOBS_STARTING, f"{ready}/{expected} Jobs ready")
    return PhaseInfo(Phase.PENDING, Reason.WAITING_FOR_PODS, "no Job has started yet")


def derive_status(
    jobset: dict[str, Any],
    intent: Intent,
    previous: dict[str, Any],
    now: str,
    generation: int | None = None,
    failure: str | None = None,
) -> dict[str, Any]:
    """The status patch for the TrainingJob owning ``jobset``; ``previous`` is its current status, ``generation``
    the TrainingJob's metadata.generation (recorded on each condition), ``failure`` what the failed trainer said
    (``trainer_failure``): the message of a Failed phase, in place of the JobSet's generic one."""
    info = derive_phase(jobset, intent, now)
    if failure and info.phase == Phase.FAILED:
        info = PhaseInfo(info.phase, info.reason, failure)
    js_status = jobset.get("status") or {}
    restarts = int(js_status.get("restarts") or 0)
    degraded = (
        info.phase == Phase.STARTING
        and previous.get("phase") == Phase.RUNNING
        and restarts == int(previous.get("restarts") or 0)
    )
    if degraded:
        info = PhaseInfo(
            Phase.RUNNING,
            Reason.PODS_NOT_READY,
            f"{info.message}: pods stopped reporting ready (their node may have stopped answering); the job runs on",
        )
    conditions = list(previous.get("conditions") or [])
    for phase, type_ in _PHASE_CONDITIONS.items():
        active = info.phase == phase
        reason = info.reason if active else f"Not{phase}"
        conditions = cond.set_condition(
            conditions,
            type_,
            "True" if active else "False",
            reason,
            info.message if active else "",
            now=now,
            generation=generation,
        )
    queued = info.reason == Reason.WAITING_FOR_ADMISSION
    conditions = cond.set_condition(
        conditions,
        cond.ConditionType.QUEUED,
        "True" if queued else "False",
        info.reason if queued else Reason.NOT_QUEUED,
        info.message if queued else "",
        now=now,
        generation=generation,
    )
    if degraded or any(c.get("type") == cond.ConditionType.DEGRADED for c in conditions):
        conditions = cond.set_condition(
            conditions,
            cond.ConditionType.DEGRADED,
            "True" if degraded else "False",
            Reason.PODS_NOT_READY if degraded else Reason.ALL_PODS_READY,
            info.message if degraded else "",
            now=now,
            generation=generation,
        )
    patch: dict[str, Any] = {
        "phase": info.phase,
        "conditions": conditions,
        "restarts": restarts,
        "replicatedJobs": [_replicated_job(r) for r in js_status.get("replicatedJobsStatus") or []],
    }
    if info.phase in (Phase.STARTING, Phase.RUNNING) and not previous.get("startTime"):
        patch["startTime"] = now
    if info.phase in TERMINAL_PHASES:
        patch["completionTime"] = previous.get("completionTime") or now
        patch["message"] = info.message or info.reason
    if info.phase == Phase.SUCCEEDED and intent.export_uri:
        patch["exportUri"] = intent.export_uri
    return patch


def trainer_failure(pods: list[dict[str, Any]], container: str) -> str | None:
    """What the trainer of a failed run said: the termination message of ``container`` in the first pod that ended
    with the configuration-error status, else in the first pod that failed; None when none left one.

    The trainer writes its one-line reason to the termination log (``wanloom_trainer.__main__``); the kubelet falls
    back to the log's last lines for a crash (``terminationMessagePolicy: FallbackToLogsOnError``)."""
    failed = []
    for pod in pods:
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            ended = (status.get("state") or {}).get("terminated") or (status.get("lastState") or {}).get("terminated")
            if status.get("name") != container or not ended or not ended.get("exitCode"):
                continue
            message = (ended.get("message") or "").strip()
            if message:
                name = (pod.get("metadata") or {}).get("name", "")
                config_error = ended["exitCode"] == keys.EXIT_CONFIG_ERROR
                failed.append((not config_error, ended.get("finishedAt") or "", f"pod {name}: {message}"))
    return min(failed)[2] if failed else None


def parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def run_deadline(start_time: str | None, seconds: int | None) -> datetime | None:
    """When a run that started at ``start_time`` (RFC 3339) passes ``seconds`` of wall clock; None without both."""
    if not start_time or not seconds:
        return None
    return parse_time(start_time) + timedelta(seconds=seconds)


def changed(patch: dict[str, Any], previous: dict[str, Any]) -> bool:
    """Whether applying ``patch`` would change ``previous`` (skips no-op status writes)."""
    return any(previous.get(key) != value for key, value in patch.items())


def _job_counts(jobset: dict[str, Any]) -> tuple[int, int, bool]:
    """(Jobs expected, Jobs ready or succeeded, whether any Job has started)."""
    expected = sum(int(r.get("replicas", 1)) for r in (jobset.get("spec") or {}).get("replicatedJobs") or [])
    statuses = (jobset.get("status") or {}).get("replicatedJobsStatus") or []
    ready = sum(int(s.get("ready", 0)) + int(s.get("succeeded", 0)) for s in statuses)
    started = any(int(s.get("active", 0)) or int(s.get("ready", 0)) for s in statuses)
    return expected, ready, started


def _replicated_job(status: dict[str, Any]) -> dict[str, Any]:
    fields = ("ready", "succeeded", "failed", "active", "suspended")
    return {"name": status.get("name", ""), **{f: int(status.get(f, 0)) for f in fields}}
