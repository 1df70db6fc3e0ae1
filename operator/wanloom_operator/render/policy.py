"""Failure and success policies: fail fast inside a Job, restart the whole JobSet, forgive disruptions.

A synchronous data-parallel job cannot lose one rank and go on, so a Job fails on its first pod failure
(``backoffLimit: 0``) and the JobSet restarts every Job from the last checkpoint, at most ``spec.maxRestarts`` times.
Preemption and maintenance are not the job's fault: the pod failure policy turns a ``DisruptionTarget`` pod condition
into a Job failure with reason ``PodFailurePolicy``, and the JobSet rule below restarts on that reason without
counting it against ``maxRestarts`` (kubernetes-sigs/jobset, "failure policy" docs). So does a trainer that stopped
after a checkpoint because it was asked to (``keys.EXIT_STOPPED``): when one pod is evicted, its peers stop at the
same step boundary and exit that way too, and whichever pod the Job controller counts first must not decide whether
the preemption uses up a restart. A configuration error
(the trainer's exit status ``keys.EXIT_CONFIG_ERROR``) would fail the same way on every restart: its pod rule
fails the Job with a message naming the exit code, and the first JobSet rule fails the JobSet on it.
"""

from __future__ import annotations

from typing import Any

from wanloom_api.keys import EXIT_CONFIG_ERROR, EXIT_STOPPED
from wanloom_api.trainingjob import TrainingJobSpec
from wanloom_operator.render.pods import CONTAINER_NAME

DISRUPTION_RULE = "RestartOnPreemptionOrMaintenance"
CONFIG_ERROR_RULE = "FailOnConfigurationError"
DEADLINE_RULE = "FailOnDeadline"
POD_FAILURE_POLICY_REASON = "PodFailurePolicy"  # the Job failure reason when a FailJob pod rule matched


def pod_failure_policy() -> dict[str, Any]:
    """Job-level: a configuration error fails the Job (its message names the exit code); a disrupted pod
    (preempted, evicted, node drained) and a trainer that stopped after a checkpoint fail it too, all with reason
    PodFailurePolicy."""
    return {
        "rules": [
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": CONTAINER_NAME, "operator": "In", "values": [EXIT_CONFIG_ERROR]},
            },
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": CONTAINER_NAME, "operator": "In", "values": [EXIT_STOPPED]},
            },
        ]
    }


def failure_policy(spec: TrainingJobSpec) -> dict[str, Any]:
    """JobSet-level: fail on a configuration error; restart everything otherwise, disruptions without using up
    ``maxRestarts``. The Job's message for an exit-code rule reads "... failed with exit code 3 matching FailJob
    rule at index 0" (kube-controller-manager); rules apply in order, first match wins."""
    return {
        "maxRestarts": spec.max_restarts,
        "restartStrategy": "Recreate",
        "rules": [
            {
                "name": CONFIG_ERROR_RULE,
                "action": "FailJobSet",
                "onJobFailureReasons": [POD_FAILURE_POLICY_REASON],
                "onJobFailureMessagePatterns": [f"exit code {EXIT_CONFIG_ERROR} matching FailJob rule"],
            },
            # A Job out of activeDeadlineSeconds ends the run; a restart would only start its clock again.
            {"name": DEADLINE_RULE, "action": "FailJobSet", "onJobFailureReasons": ["DeadlineExceeded"]},
            {
                "name": DISRUPTION_RULE,
                "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": [POD_FAILURE_POLICY_REASON],
            },
        ],
    }


def success_policy() -> dict[str, Any]:
    """Every Job (every slice / node group) has to finish: ranks exit together after the last step."""
    return {"operator": "All"}
