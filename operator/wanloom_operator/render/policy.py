"""Failure and success policies: fail fast inside a Job, restart the whole JobSet, forgive disruptions.

A synchronous data-parallel job cannot lose one rank and go on, so a Job fails on its first pod failure
(``backoffLimit: 0``) and the JobSet restarts every Job from the last checkpoint, at most ``spec.maxRestarts`` times.
Preemption and maintenance are not the job's fault: the pod failure policy turns a ``DisruptionTarget`` pod condition
into a Job failure with reason ``PodFailurePolicy``, and the JobSet rule below restarts on that reason without
counting it against ``maxRestarts`` (kubernetes-sigs/jobset, "failure policy" docs).
"""

from __future__ import annotations

from typing import Any

from wanloom_operator.api.trainingjob import TrainingJobSpec

DISRUPTION_RULE = "RestartOnPreemptionOrMaintenance"
POD_FAILURE_POLICY_REASON = "PodFailurePolicy"  # the Job failure reason when a FailJob pod rule matched


def pod_failure_policy() -> dict[str, Any]:
    """Job-level: a disrupted pod (preempted, evicted, node drained) fails its Job with reason PodFailurePolicy."""
    return {"rules": [{"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]}


def failure_policy(spec: TrainingJobSpec) -> dict[str, Any]:
    """JobSet-level: restart everything; disruptions restart without using up ``maxRestarts``."""
    return {
        "maxRestarts": spec.max_restarts,
        "restartStrategy": "Recreate",
        "rules": [
            {
                "name": DISRUPTION_RULE,
                "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": [POD_FAILURE_POLICY_REASON],
            }
        ],
    }


def success_policy() -> dict[str, Any]:
    """Every Job (every slice / node group) has to finish: ranks exit together after the last step."""
    return {"operator": "All"}
