"""The operator against kmock, for what a fake API server shows best: every JobSet status the mapping must handle,
API errors injected on purpose, and the exact requests made. What the real control plane decides (suspend and
resume, deletion and garbage collection, restarts and adoption, TTLs, Kueue) is tested on it, in tests/e2e."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import kmock as km
from kmock_world import CM, GPU_SPEC, JS, World, eventually

from wanloom_api import keys
from wanloom_api.validation import parse_trainingjob
from wanloom_operator.reconcile.children import manifest
from wanloom_operator.render.jobset import render_trainingjob, trainer_container
from wanloom_operator.settings import OperatorSettings

Start = Callable[..., Any]


def _condition(world: World, name: str, type_: str) -> dict[str, Any]:
    return next((c for c in world.status(name).get("conditions") or [] if c["type"] == type_), {})


async def test_create_makes_the_rendered_jobset_and_configmap(world: World, start_operator: Start) -> None:
    await start_operator()
    await world.create_trainingjob("tj1")
    jobset = await eventually(lambda: world.objects(JS).get("tj1"), what="JobSet")
    configmap = await eventually(lambda: world.objects(CM).get("tj1-config"), what="ConfigMap")
    body = world.trainingjob("tj1")
    expected = render_trainingjob(parse_trainingjob(manifest(body)), OperatorSettings.from_env({}))
    for obj in (jobset, configmap):
        del obj["metadata"]["resourceVersion"]  # added by the (emulated) API server
    assert jobset == expected.jobset
    assert configmap == expected.configmap
    assert jobset["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]
    await eventually(lambda: world.status("tj1").get("phase") == "Pending", what="phase Pending")
    await eventually(lambda: _condition(world, "tj1", "Created").get("status") == "True", what="Created")
    assert _condition(world, "tj1", "Valid")["status"] == "True"
    await eventually(lambda: "JobSetCreated" in world.event_reasons("tj1"), what="JobSetCreated event")
    # kopf keeps its bookkeeping in annotations: the structural status schema would prune status.kopf.
    assert "kopf" not in world.status("tj1")


async def test_jobset_status_transitions_map_to_phases(world: World, start_operator: Start) -> None:
    await start_operator()
    await world.create_trainingjob("tj2")
    await eventually(lambda: world.objects(JS).get("tj2"), what="JobSet")
    steps: list[tuple[dict[str, Any], str]] = [
        ({"replicatedJobsStatus": [{"name": "node", "active": 1, "ready": 0}]}, "Starting"),
        ({"replicatedJobsStatus": [{"name": "node", "active": 1, "ready": 1}]}, "Running"),
        (
            {
                "restarts": 1,
                "conditions": [{"type": "RestartingJobSet", "status": "True", "reason": "FailurePolicy_x"}],
                "replicatedJobsStatus": [{"name": "node", "active": 0, "ready": 0, "failed": 1}],
            },
            "Restarting",
        ),
        (
            {
                "conditions": [{"type": "RestartingJobSet", "status": "False", "reason": "JobsReady"}],
                "replicatedJobsStatus": [{"name": "node", "active": 1, "ready": 1, "failed": 0}],
            },
            "Running",
        ),
        (
            {
                "conditions": [
                    {"type": "RestartingJobSet", "status": "False", "reason": "JobsReady"},
                    {"type": "Completed", "status": "True", "reason": "AllJobsCompleted", "message": "done"},
                ],
                "replicatedJobsStatus": [{"name": "node", "active": 0, "ready": 0, "succeeded": 1}],
            },
            "Succeeded",
        ),
    ]
    for status, phase in steps:
        await world.jobset_status("tj2", status)
        await eventually(lambda phase=phase: world.status("tj2").get("phase") == phase, what=f"phase {phase}")
    final = world.status("tj2")
    assert final["restarts"] == 1 and final["startTime"] and final["completionTime"]
    assert final["replicatedJobs"] == [
        {"name": "node", "ready": 0, "succeeded": 1, "failed": 0, "active": 0, "suspended": 0}
    ]
    assert _condition(world, "tj2", "Succeeded")["status"] == "True"
    assert _condition(world, "tj2", "Running")["status"] == "False"


async def test_failed_jobset_fails_the_trainingjob(world: World, start_operator: Start) -> None:
    await start_operator()
    await world.create_trainingjob("tj3")
    await eventually(lambda: world.objects(JS).get("tj3"), what="JobSet")
    failed = {"type": "Failed", "status": "True", "reason": "ReachedMaxRestarts", "message": "max restarts"}
    await world.jobset_status("tj3", {"restarts": 2, "conditions": [failed]})
    await eventually(lambda: world.status("tj3").get("phase") == "Failed", what="phase Failed")
    assert world.status("tj3")["message"] == "max restarts"
    assert _condition(world, "tj3", "Failed")["reason"] == "ReachedMaxRestarts"


async def test_spec_change_is_reported_while_running_and_applied_when_suspended(
    world: World, start_operator: Start
) -> None:
    await start_operator()
    await world.create_trainingjob("tj5")
    old = await eventually(lambda: world.objects(JS).get("tj5"), what="JobSet")
    old_hash = old["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH]
    await world.patch_spec("tj5", {"resources": {"gpu": {"type": "h100", "nodes": 4}}})
    pending = await eventually(
        lambda: _condition(world, "tj5", "SpecChangePending").get("status") == "True", what="SpecChangePending"
    )
    assert pending
    await eventually(lambda: "NotSuspended" in world.event_reasons("tj5"), what="NotSuspended event")
    assert world.objects(JS)["tj5"]["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH] == old_hash
    await world.patch_spec("tj5", {"suspend": True})
    new = await eventually(
        lambda: (
            (js := world.objects(JS).get("tj5"))
            and js["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH] != old_hash
            and js
        ),
        what="re-created JobSet",
    )
    assert new["spec"]["suspend"] is True
    assert new["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 4
    configmap = world.objects(CM)["tj5-config"]
    assert (
        configmap["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH]
        == new["metadata"]["annotations"][keys.ANNOTATION_SPEC_HASH]
    )
    assert "nodes: 4" in configmap["data"][keys.CONFIG_FILE_NAME]
    await eventually(lambda: _condition(world, "tj5", "SpecChangePending").get("status") == "False", what="applied")
    await eventually(lambda: "SpecApplied" in world.event_reasons("tj5"), what="SpecApplied event")


async def test_invalid_spec_gets_phase_condition_and_event_but_no_jobset(world: World, start_operator: Start) -> None:
    await start_operator()
    spec = copy.deepcopy(GPU_SPEC)
    spec["resources"] = {"gpu": {"type": "h100", "perNode": 32}}  # at most 16
    spec["training"]["globalBatch"] = 0
    await world.create_trainingjob("bad", spec)
    await eventually(lambda: world.status("bad").get("phase") == "Invalid", what="phase Invalid")
    valid = await eventually(lambda: _condition(world, "bad", "Valid"), what="Valid condition")
    assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
    assert "spec.training.globalBatch" in valid["message"] and "spec.resources.gpu.perNode" in valid["message"]
    await eventually(lambda: "InvalidSpec" in world.event_reasons("bad"), what="InvalidSpec event")
    event = next(e for e in world.events if e.get("reason") == "InvalidSpec")
    assert event["type"] == "Warning" and "spec.training.globalBatch" in event["message"]
    assert not world.objects(JS) and not world.objects(CM)
    # Fixing the spec creates the JobSet.
    await world.patch_spec("bad", {"training": {"globalBatch": 64}, "resources": {"gpu": {"perNode": 8}}})
    await eventually(lambda: world.objects(JS).get("bad"), what="JobSet after the fix")
    await eventually(lambda: world.status("bad").get("phase") == "Pending", what="phase Pending")


async def test_transient_api_errors_are_retried(world: World, start_operator: Start) -> None:
    kmock = world.kmock
    # The first JobSet create fails with 500 after the object was stored (a timeout-like partial failure), the
    # first ConfigMap create answers 409, the first JobSet read answers 503.
    kmock["post", km.resource(JS)][:1] << 500 << {"kind": "Status", "code": 500, "message": "etcd timeout"}
    kmock["post", km.resource(CM)][:1] << 409 << {"kind": "Status", "code": 409, "message": "exists"}
    kmock["get", km.resource(JS), km.name("tj7")][:1] << 503 << {"kind": "Status", "code": 503, "message": "busy"}
    op = await start_operator()
    await world.create_trainingjob("tj7")
    await eventually(lambda: _condition(world, "tj7", "Created").get("status") == "True", timeout=15, what="created")
    assert list(world.objects(JS)) == ["tj7"] and list(world.objects(CM)) == ["tj7-config"]
    errors = {
        tuple(s.labels.values()): s.value
        for s in op.runtime.metrics.reconcile_errors.collect()[0].samples
        if s.name.endswith("_total")
    }
    assert errors.get(("create", "ApiError"), 0) >= 1  # the 500; the 503 hits whichever handler reads first
    assert sum(v for (_, kind), v in errors.items() if kind == "ApiError") >= 2


async def test_a_jobset_gone_without_its_outcome_ends_the_job_instead_of_rerunning_it(
    world: World, start_operator: Start
) -> None:
    """Created for this spec and gone (its TTL, a manual delete): the run is over, it is not started again."""
    await start_operator()
    await world.create_trainingjob("tj9")
    await eventually(lambda: world.objects(JS).get("tj9"), what="JobSet")
    await eventually(lambda: world.status("tj9").get("createdSpecHash"), what="the created spec recorded")
    await world.delete_jobset("tj9")
    status = await eventually(lambda: (s := world.status("tj9")).get("phase") == "Failed" and s, what="Failed")
    assert "deleted before its outcome was recorded" in status["message"]
    assert len(world.requests("POST", "/jobsets")) == 1 and "tj9" not in world.objects(JS)


async def test_image_comes_from_the_operator_settings(world: World, start_operator: Start) -> None:
    await start_operator(trainer_image_torch="registry.local/trainer-gpu:dev")
    await world.create_trainingjob("tj11")
    jobset = await eventually(lambda: world.objects(JS).get("tj11"), what="JobSet")
    assert trainer_container(jobset)["image"] == "registry.local/trainer-gpu:dev"
