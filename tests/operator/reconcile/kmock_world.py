"""Helpers of the kmock operator tests: a fake API server with the resources wanloom uses, and the real operator
running against it in a background thread (its own event loop; kmock serves from pytest's loop, so tests are async
and wait with ``eventually``, never with time.sleep).

kmock gaps handled here (found against kmock 0.8): custom resources are declared by hand; Events
(all named None, kopf uses generateName) are collected and not stored, else the second one would conflict; watches
replay existing objects (tests act once the operator's watches are open); there is no uid (TrainingJobs get one) and
no resourceVersion (VersionedEmulator adds them, with the preconditions kopf's finalizer patches and the
operator's status writes rely on); no garbage collector and no JobSet controller: tests play their part by
patching JobSet status.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import itertools
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import attrs
import kmock as km

from wanloom_operator.reconcile.runtime import Runtime

NS = "team-a"
TJ = "wanloom.dev/v1alpha1/trainingjobs"
JS = "jobset.x-k8s.io/v1alpha2/jobsets"
CM = "v1/configmaps"
PODS = "v1/pods"
RW = {"list", "watch", "get", "create", "patch", "update", "delete"}

GPU_SPEC: dict[str, Any] = {
    "model": {"variant": "wan2.2-ti2v-5b"},
    "data": {"uri": "gs://bucket/data"},
    "training": {"steps": 100, "globalBatch": 64},
    "resources": {"gpu": {"type": "h100", "nodes": 2}},
    "maxRestarts": 2,
}


_VERSIONS = itertools.count(1)


@attrs.define(kw_only=True)
class VersionedEmulator(km.KubernetesEmulator):
    """kmock's emulator plus resource versions: bumped on every write, checked as a merge-patch precondition (409)
    and by JSON-patch ``test`` ops (422), as a real API server does.

    ``keep_requests`` bounds kmock's request history (benchmarks): kmock matches every request against its whole
    history, so without a bound each request costs more than the last. ``creates`` counts POSTs per resource.
    """

    keep_requests: int | None = None
    creates: collections.Counter[str] = attrs.field(factory=collections.Counter, init=False)

    async def _handle(self, request: Any) -> Any:
        if self.keep_requests is not None and len(self._requests) > self.keep_requests:
            del self._requests[: -self.keep_requests]
        if request.resource is not None and request.action in (km.action.CREATE, km.action.UPDATE):
            if request.action == km.action.CREATE:
                self.creates[request.resource.plural] += 1
            error = self._version(request)
            if error is not None:
                return await self._render_error(error)
        return await super()._handle(request)

    def _version(self, request: Any) -> km.KubernetesError | None:
        data, new = request.data, str(next(_VERSIONS))
        if request.action == km.action.CREATE:
            data.setdefault("metadata", {})["resourceVersion"] = new
            return None
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return None  # kmock answers 404
        current = (self.objects[key].raw.get("metadata") or {}).get("resourceVersion")
        if isinstance(data, dict):
            wanted = (data.get("metadata") or {}).get("resourceVersion")
            if wanted is not None and wanted != current:
                return km.KubernetesError(409, "Conflict", f"resourceVersion {wanted} is not {current}")
            data.setdefault("metadata", {})["resourceVersion"] = new
        elif isinstance(data, list):
            for op in data:
                if op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion" and op["value"] != current:
                    return km.KubernetesError(422, "Invalid", f"resourceVersion {op['value']} is not {current}")
            data.append({"op": "add", "path": "/metadata/resourceVersion", "value": new})
        return None


@dataclass
class World:
    """The fake cluster and helpers to act on it like users and controllers would."""

    kmock: Any
    events: list[dict[str, Any]] = field(default_factory=list)

    def objects(self, resource: str) -> dict[str, dict[str, Any]]:
        """Live objects of one resource by name (deleted ones left out)."""
        return {
            key[2]: dict(obj.raw)
            for key, obj in list(self.kmock.objects.items())
            if f"{key[0].group}/{key[0].version}/{key[0].plural}".lstrip("/") == resource and not obj.deleted
        }

    def trainingjob(self, name: str) -> dict[str, Any]:
        return self.objects(TJ).get(name, {})

    def status(self, name: str) -> dict[str, Any]:
        return self.trainingjob(name).get("status") or {}

    def requests(self, method: str, path_part: str) -> list[Any]:
        return [r for r in list(self.kmock) if r.method.value == method and path_part in r.url.path]

    def creates_of(self, plural: str) -> int:
        """POSTs of one resource so far (kept even when the request history is bounded)."""
        return int(self.kmock.creates[plural])

    def watches(self) -> list[Any]:
        """WATCH requests for TrainingJobs and JobSets seen so far."""
        return [
            r
            for r in list(self.kmock)
            if r.params.get("watch") == "true" and r.url.path.endswith(("/trainingjobs", "/jobsets"))
        ]

    def event_reasons(self, name: str) -> list[str]:
        return [e.get("reason", "") for e in self.events if (e.get("involvedObject") or {}).get("name") == name]

    async def create_trainingjob(self, name: str, spec: dict[str, Any] | None = None, **extra: Any) -> None:
        body = {
            "apiVersion": "wanloom.dev/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": name, "namespace": NS, "uid": str(uuid.uuid4()), "generation": 1},
            "spec": {**copy.deepcopy(spec or GPU_SPEC), **extra},
        }
        await self._send("post", f"/apis/wanloom.dev/v1alpha1/namespaces/{NS}/trainingjobs", body)

    async def patch_spec(self, name: str, spec_patch: dict[str, Any]) -> None:
        path = f"/apis/wanloom.dev/v1alpha1/namespaces/{NS}/trainingjobs/{name}"
        await self._send("patch", path, {"spec": spec_patch})

    async def delete_trainingjob(self, name: str) -> None:
        await self._send("delete", f"/apis/wanloom.dev/v1alpha1/namespaces/{NS}/trainingjobs/{name}")

    async def jobset_status(self, name: str, status: dict[str, Any]) -> None:
        """Play the JobSet controller: write the JobSet's status (merge patch)."""
        path = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets/{name}/status"
        await self._send("patch", path, {"status": status})

    async def patch_jobset(self, name: str, patch: dict[str, Any]) -> None:
        await self._send("patch", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets/{name}", patch)

    async def delete_jobset(self, name: str) -> None:
        await self._send("delete", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets/{name}")

    async def _send(self, method: str, path: str, body: dict[str, Any] | None = None) -> None:
        response = (
            await getattr(self.kmock, method)(path, json=body)
            if body is not None
            else await getattr(self.kmock, method)(path)
        )
        assert response.status < 300, f"{method} {path}: {response.status} {await response.text()}"


def prepare(kmock: Any) -> World:
    """Declare wanloom's resources on a kmock emulator and collect (not store) the Events posted to it."""
    for resource, kind, namespaced, subresources in [
        (TJ, "TrainingJob", True, {"status"}),
        (JS, "JobSet", True, {"status"}),
        (CM, "ConfigMap", True, set()),
        (PODS, "Pod", True, {"status"}),
        ("v1/events", "Event", True, set()),
        ("v1/namespaces", "Namespace", False, set()),
    ]:
        kmock.resources[resource] = km.ResourceInfo(
            kind=kind, namespaced=namespaced, verbs=RW, subresources=subresources
        )
    world = World(kmock)

    def take_event(request: Any) -> Any:
        world.events.append(request.data)
        for key in [k for k in list(kmock.objects) if k[0].plural == "events"]:
            del kmock.objects[key]
        return request.data

    kmock["post", km.resource("v1/events")] << 201 << take_event
    return world


@dataclass
class Operator:
    runtime: Runtime
    stop: Any
    thread: Any


async def stop_operator(op: Operator) -> None:
    op.stop.set()
    await asyncio.to_thread(op.thread.join, 10)
    assert not op.thread.is_alive(), "the operator did not stop"
    op.runtime.stop_metrics_server()


async def eventually(predicate: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    """Poll ``predicate`` (yielding to the loop kmock serves from) until it is truthy; its value."""
    deadline = time.monotonic() + timeout
    for attempt in itertools.count():
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(min(0.02 * (attempt + 1), 0.1))
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
