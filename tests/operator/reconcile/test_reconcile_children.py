"""Outcome.status_patch merges by condition type into the fresh status; ownership checks."""

from __future__ import annotations

from wanloom_api import conditions as cond
from wanloom_operator.reconcile.children import Outcome, owned_by


def test_status_patch_keeps_conditions_written_concurrently() -> None:
    seen = {"conditions": [{"type": "Valid", "status": "True", "reason": "Valid", "lastTransitionTime": "T0"}]}
    out = Outcome.start(seen, now="T1")
    out.set(cond.ConditionType.CREATED, "True", cond.Reason.JOBSET_CREATED)
    out.set(cond.ConditionType.VALID, "True", cond.Reason.VALID)  # unchanged: not written back
    out.phase, out.phase_from = "Pending", frozenset({None, "Invalid"})
    fresh = {  # meanwhile the JobSet watch wrote Running
        "phase": "Running",
        "conditions": [
            {"type": "Valid", "status": "True", "reason": "Valid", "lastTransitionTime": "T0"},
            {"type": "Running", "status": "True", "reason": "AllJobsReady", "lastTransitionTime": "T0"},
        ],
    }
    patch = out.status_patch(fresh)
    assert [c["type"] for c in patch["conditions"]] == ["Valid", "Running", "Created"]
    assert "phase" not in patch  # a newer phase is not overwritten with Pending
    assert out.status_patch({"conditions": patch["conditions"], "phase": "Running"}) == {}


def test_invalid_phase_only_without_a_jobset() -> None:
    out = Outcome.start({}, now="T")
    out.set(cond.ConditionType.VALID, "False", cond.Reason.INVALID_SPEC, "spec.x: bad")
    out.phase, out.phase_unless_created = "Invalid", True
    assert out.status_patch({})["phase"] == "Invalid"
    created = {"conditions": [{"type": "Created", "status": "True", "reason": "JobSetCreated"}], "phase": "Running"}
    assert "phase" not in out.status_patch(created)


def test_owned_by() -> None:
    owner = {"metadata": {"name": "a", "uid": "u1"}}
    ref = {"apiVersion": "wanloom.dev/v1alpha1", "kind": "TrainingJob", "name": "a", "uid": "u1", "controller": True}
    assert owned_by({"metadata": {"ownerReferences": [ref]}}, owner)
    assert not owned_by({"metadata": {"ownerReferences": [{**ref, "uid": "u2"}]}}, owner)  # a previous "a"
    assert not owned_by({"metadata": {"ownerReferences": [{**ref, "kind": "Other"}]}}, owner)
    assert not owned_by({"metadata": {}}, owner)
