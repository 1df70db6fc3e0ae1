"""derive_phase / derive_status: JobSet status -> TrainingJob phase, conditions and counts (pure, table-driven)."""

from __future__ import annotations

from typing import Any

import pytest

from wanloom_api.trainingjob import TrainingJobStatus
from wanloom_operator.reconcile.status import Intent, changed, derive_phase, derive_status, trainer_failure


def jobset(suspend: bool = False, replicas: int = 2, conditions: Any = (), **rjs: int) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": [{"type": t, "status": s, "reason": r} for t, s, r in conditions]}
    if rjs:
        status["replicatedJobsStatus"] = [{"name": "slice", **rjs}]
    return {"spec": {"suspend": suspend, "replicatedJobs": [{"name": "slice", "replicas": replicas}]}, "status": status}


CASES = [
    ("no status yet", jobset(), Intent(), "Pending"),
    ("one Job active", jobset(active=1), Intent(), "Starting"),
    ("one of two Jobs ready", jobset(active=2, ready=1), Intent(), "Starting"),
    ("all Jobs ready", jobset(active=2, ready=2), Intent(), "Running"),
    ("ready plus succeeded", jobset(ready=1, succeeded=1), Intent(), "Running"),
    (
        "restarting",
        jobset(conditions=[("RestartingJobSet", "True", "FailurePolicy_x")], ready=2),
        Intent(),
        "Restarting",
    ),
    ("restart over", jobset(conditions=[("RestartingJobSet", "False", "JobsReady")], ready=2), Intent(), "Running"),
    ("suspended on request", jobset(suspend=True, ready=2), Intent(suspend=True), "Suspended"),
    ("queued in Kueue", jobset(suspend=True), Intent(queue_name="q"), "Pending"),
    ("completed", jobset(conditions=[("Completed", "True", "AllJobsCompleted")]), Intent(), "Succeeded"),
    ("failed", jobset(conditions=[("Failed", "True", "ReachedMaxRestarts")]), Intent(), "Failed"),
    ("failed beats suspended", jobset(True, conditions=[("Failed", "True", "FailedJobs")]), Intent(True), "Failed"),
]


@pytest.mark.parametrize(("case", "js", "intent", "phase"), CASES, ids=[c[0] for c in CASES])
def test_derive_phase(case: str, js: dict[str, Any], intent: Intent, phase: str) -> None:
    assert derive_phase(js, intent).phase == phase


def test_derive_status_fields_fit_the_api() -> None:
    js = jobset(active=2, ready=2)
    js["status"]["restarts"] = 3
    patch = derive_status(js, Intent(), {}, now="2026-11-30T10:00:00Z")
    assert patch["phase"] == "Running" and patch["restarts"] == 3 and patch["startTime"] == "2026-11-30T10:00:00Z"
    assert patch["replicatedJobs"] == [
        {"name": "slice", "ready": 2, "succeeded": 0, "failed": 0, "active": 2, "suspended": 0}
    ]
    running = next(c for c in patch["conditions"] if c["type"] == "Running")
    assert (running["status"], running["reason"]) == ("True", "AllJobsReady")
    TrainingJobStatus.model_validate(patch)  # every field and condition is one the CRD schema keeps


def test_conditions_record_the_generation_they_reflect() -> None:
    first = derive_status(jobset(active=2, ready=2), Intent(), {}, now="T1", generation=1)
    assert {c["observedGeneration"] for c in first["conditions"]} == {1}
    later = derive_status(jobset(active=2, ready=2), Intent(), {**first}, now="T2", generation=2)
    assert {c["observedGeneration"] for c in later["conditions"]} == {2} and changed(later, first)
    assert {c["lastTransitionTime"] for c in later["conditions"]} == {"T1"}  # no status changed


def test_transition_times_move_only_on_change() -> None:
    first = derive_status(jobset(active=2, ready=2), Intent(), {}, now="T1")
    again = derive_status(jobset(active=2, ready=2), Intent(), {**first}, now="T2")
    assert not changed(again, first)  # nothing to write: no status churn on repeated events
    done = derive_status(jobset(conditions=[("Completed", "True", "x")]), Intent(), {**first}, now="T3")
    times = {c["type"]: c["lastTransitionTime"] for c in done["conditions"]}
    assert times["Running"] == "T3" and times["Succeeded"] == "T3" and times["Suspended"] == "T1"
    assert first["startTime"] == "T1" and "startTime" not in done  # set once, at the first Running
    assert done["completionTime"] == "T3" and done["message"]


def test_the_whole_run_deadline_fails_the_job_whatever_the_jobset_says() -> None:
    """spec.activeDeadlineSeconds counts from the first start, through restarts: a restarting or running JobSet
    past it is Failed (DeadlineExceeded); before it, the JobSet decides."""
    from wanloom_operator.reconcile.status import run_deadline

    deadline = run_deadline("2026-12-01T10:00:00Z", 3600)
    restarting = jobset(conditions=[("RestartingJobSet", "True", "restart 2")])
    assert derive_phase(restarting, Intent(deadline=deadline), "2026-12-01T10:59:59Z").phase == "Restarting"
    info = derive_phase(restarting, Intent(deadline=deadline), "2026-12-01T11:00:00Z")
    assert (info.phase, info.reason) == ("Failed", "DeadlineExceeded")
    done = jobset(conditions=[("Completed", "True", "x")])
    assert derive_phase(done, Intent(deadline=deadline), "2026-12-01T12:00:00Z").phase == "Succeeded"
    assert run_deadline(None, 3600) is None and run_deadline("2026-12-01T10:00:00Z", None) is None


def test_a_succeeded_run_names_its_export_and_a_running_one_does_not() -> None:
    intent = Intent(export_uri="gs://models/tiny/export")
    completed = jobset(conditions=[("Completed", "True", "AllJobsCompleted")])
    done = derive_status(completed, intent, {}, now="2026-12-03T10:00:00Z")
    assert done["exportUri"] == "gs://models/tiny/export"
    TrainingJobStatus.model_validate(done)
    for js in (jobset(active=2, ready=2), jobset(conditions=[("Failed", "True", "ReachedMaxRestarts")])):
        assert "exportUri" not in derive_status(js, intent, {}, now="T1")


def _pod(name: str, code: int, message: str, finished: str, container: str = "trainer") -> dict[str, Any]:
    ended = {"exitCode": code, "message": message, "finishedAt": finished}
    statuses = [{"name": container, "state": {"terminated": ended}}]
    return {"metadata": {"name": name}, "status": {"containerStatuses": statuses}}


def test_a_failed_run_says_what_the_trainer_said() -> None:
    """The configuration error of pod 1 is the reason, not the SIGKILLed peer that ended earlier or later."""
    pods = [
        _pod("js-slice-0-0", 137, "killed", "2026-12-06T10:00:01Z"),
        _pod("js-slice-0-1", 3, "wanloom trainer: more than spec.data.maxBadSamples=0", "2026-12-06T10:00:05Z"),
        _pod("js-slice-0-2", 3, "", "2026-12-06T10:00:00Z"),  # no message: nothing to say
        _pod("js-slice-0-3", 3, "not the trainer", "2026-12-06T09:00:00Z", container="sidecar"),
    ]
    reason = trainer_failure(pods, "trainer")
    assert reason == "pod js-slice-0-1: wanloom trainer: more than spec.data.maxBadSamples=0"
    assert trainer_failure(pods[:1], "trainer") == "pod js-slice-0-0: killed"
    assert trainer_failure([_pod("p", 0, "done", "T")], "trainer") is None
    failed = jobset(conditions=[("Failed", "True", "FailedJobs")])
    patch = derive_status(failed, Intent(), {}, now="T", failure=reason)
    assert patch["message"] == reason
    assert next(c for c in patch["conditions"] if c["type"] == "Failed")["message"] == reason
    running = derive_status(jobset(active=2, ready=2), Intent(), {}, now="T", failure=reason)
    assert "message" not in running  # only a failed phase takes it


def test_a_running_job_whose_pods_stop_reporting_ready_stays_running_and_says_so() -> None:
    """The node controller marks the pods of a node that stopped answering not ready: JobSet's ready count drops.
    The job is not starting again (no restart): it stays Running with Degraded=True, which clears once they are
    ready again. A job that had not been Running, or that restarted, is Starting as before."""
    running = derive_status(jobset(active=2, ready=2), Intent(), {}, now="T1")
    assert not any(c["type"] == "Degraded" for c in running["conditions"])  # set only once it happens
    lost = derive_status(jobset(active=2, ready=1), Intent(), {**running}, now="T2")
    degraded = {c["type"]: c for c in lost["conditions"]}["Degraded"]
    assert lost["phase"] == "Running" and degraded["status"] == "True" and degraded["reason"] == "PodsNotReady"
    assert "1/2 Jobs ready" in degraded["message"]
    back = derive_status(jobset(active=2, ready=2), Intent(), {**running, **lost}, now="T3")
    degraded = {c["type"]: c for c in back["conditions"]}["Degraded"]
    assert back["phase"] == "Running" and degraded["status"] == "False" and degraded["reason"] == "AllPodsReady"
    js = jobset(active=2, ready=1)
    js["status"]["restarts"] = 1
    assert derive_status(js, Intent(), {**running}, now="T2")["phase"] == "Starting"
    assert derive_status(jobset(active=2, ready=1), Intent(), {}, now="T1")["phase"] == "Starting"
