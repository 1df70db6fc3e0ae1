"""The only module that calls the Kubernetes API (besides kopf itself): JobSets, ConfigMaps, pods, TrainingJob status.

Calls run the synchronous ``kubernetes`` client in a worker thread and return plain dicts (the API's JSON). Every
failure becomes an :class:`ApiError`; ``transient`` ones (429, 5xx, connection trouble) are retried by the caller
through kopf, everything else is reported.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from typing import Any

import kubernetes
import urllib3

from wanloom_api import latentdataset as lds
from wanloom_api import trainingjob as tj
from wanloom_operator.settings import OperatorSettings

JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
KUEUE_GROUP, KUEUE_VERSION, WORKLOADS = "kueue.x-k8s.io", "v1beta2", "workloads"
MERGE_PATCH = "application/merge-patch+json"
TRANSIENT_STATUSES = frozenset({0, 429, 500, 502, 503, 504})
_TIMEOUT = (5.0, 30.0)  # connect, read
# Client calls run in a pool of this many threads (reconcile/handlers.py); the HTTP pool has one connection per
# thread, or threads beyond it open and drop a connection per call (urllib3's "pool is full" warning).
API_THREADS = 32


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str = "") -> None:
        self.status, self.reason, self.message = status, reason, message
        super().__init__(f"{status} {reason}: {message}" if message else f"{status} {reason}")

    @property
    def transient(self) -> bool:
        return self.status in TRANSIENT_STATUSES

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409


class Cluster:
    """Typed access to the objects the operator reads and writes."""

    def __init__(self, api_client: kubernetes.client.ApiClient) -> None:
        self._custom = kubernetes.client.CustomObjectsApi(api_client)
        self._core = kubernetes.client.CoreV1Api(api_client)
        self._batch = kubernetes.client.BatchV1Api(api_client)

    @classmethod
    def connect(cls, settings: OperatorSettings) -> Cluster:
        """An explicit API server URL (no credentials), else in-cluster credentials, else the kubeconfig."""
        if settings.api_server:
            config = kubernetes.client.Configuration(host=settings.api_server.rstrip("/"))
        else:
            config = kubernetes.client.Configuration()
            try:
                kubernetes.config.load_incluster_config(client_configuration=config)
            except kubernetes.config.ConfigException:
                kubernetes.config.load_kube_config(client_configuration=config)
        config.connection_pool_maxsize = API_THREADS
        return cls(kubernetes.client.ApiClient(config))

    # JobSets
    async def get_jobset(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await _maybe(self._custom_call("get_namespaced_custom_object", namespace, name=name))

    async def create_jobset(self, body: dict[str, Any]) -> None:
        await self._custom_call("create_namespaced_custom_object", body["metadata"]["namespace"], body=body)

    async def patch_jobset(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await self._custom_call("patch_namespaced_custom_object", namespace, name=name, body=patch)

    async def delete_jobset(self, namespace: str, name: str) -> None:
        """Foreground deletion: the name stays taken until the Jobs and pods are gone (no clash on re-create)."""
        await self._custom_call(
            "delete_namespaced_custom_object", namespace, name=name, propagation_policy="Foreground"
        )

    # ConfigMaps
    async def get_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await _maybe(_call(self._core.read_namespaced_config_map, name, namespace))

    async def create_configmap(self, body: dict[str, Any]) -> None:
        await _call(self._core.create_namespaced_config_map, body["metadata"]["namespace"], body)

    async def patch_configmap(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await _call(self._core.patch_namespaced_config_map, name, namespace, patch, _content_type=MERGE_PATCH)

    # Kueue Workloads (spec.active is how a queued job is stopped and resumed)
    async def list_workloads(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        fn = self._custom.list_namespaced_custom_object
        result = await _call(fn, KUEUE_GROUP, KUEUE_VERSION, namespace, WORKLOADS, label_selector=label_selector)
        return list(result.get("items") or [])

    async def patch_workload(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        fn = self._custom.patch_namespaced_custom_object
        await _call(fn, KUEUE_GROUP, KUEUE_VERSION, namespace, WORKLOADS, name, patch)

    # Pods (read-only: rank 0's address)
    async def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        result = await _call(self._core.list_namespaced_pod, namespace, label_selector=label_selector)
        return list(result.get("items") or [])

    # TrainingJobs
    async def get_trainingjob(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await _maybe(
            _call(self._custom.get_namespaced_custom_object, tj.GROUP, tj.VERSION, namespace, tj.PLURAL, name)
        )

    async def list_trainingjobs(self, namespace: str) -> list[dict[str, Any]]:
        fn = self._custom.list_namespaced_custom_object
        return list((await _call(fn, tj.GROUP, tj.VERSION, namespace, tj.PLURAL)).get("items") or [])

    async def update_trainingjob_status(
        self,
        namespace: str,
        name: str,
        compute: Callable[[dict[str, Any]], dict[str, Any] | None],
        current: Mapping[str, Any] | None = None,
        attempts: int = 5,
    ) -> dict[str, Any] | None:
        """Read-compute-write of a TrainingJob's status, guarded by its resourceVersion (a 409 re-reads).

        ``compute`` gets the TrainingJob and returns the status merge patch (empty or None: no write). ``current``,
        when the caller has the object already (a kopf handler's body), saves the first read.
        Returns what was written, None if nothing was (or the TrainingJob is gone).
        """
        return await self._update_status(tj.PLURAL, namespace, name, compute, current, attempts)

    # LatentDatasets
    async def get_latentdataset(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await _maybe(
            _call(self._custom.get_namespaced_custom_object, lds.GROUP, lds.VERSION, namespace, lds.PLURAL, name)
        )

    async def update_latentdataset_status(
        self,
        namespace: str,
        name: str,
        compute: Callable[[dict[str, Any]], dict[str, Any] | None],
        current: Mapping[str, Any] | None = None,
        attempts: int = 5,
    ) -> dict[str, Any] | None:
        """As :meth:`update_trainingjob_status`, for a LatentDataset."""
        return await self._update_status(lds.PLURAL, namespace, name, compute, current, attempts)

    # Jobs (a LatentDataset's plan, encode and finalize steps)
    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await _maybe(_call(self._batch.read_namespaced_job, name, namespace))

    async def create_job(self, body: dict[str, Any]) -> None:
        await _call(self._batch.create_namespaced_job, body["metadata"]["namespace"], body)

    async def patch_job(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await _call(self._batch.patch_namespaced_job, name, namespace, patch, _content_type=MERGE_PATCH)

    async def _update_status(
        self,
        plural: str,
        namespace: str,
        name: str,
        compute: Callable[[dict[str, Any]], dict[str, Any] | None],
        current: Mapping[str, Any] | None,
        attempts: int,
    ) -> dict[str, Any] | None:
        obj = dict(current) if current is not None else None
        get = self.get_trainingjob if plural == tj.PLURAL else self.get_latentdataset
        for _ in range(attempts):
            if obj is None:
                obj = await get(namespace, name)
            patch = compute(obj) if obj is not None else None
            if not patch:
                return None
            body: dict[str, Any] = {"status": patch}
            version = (obj.get("metadata") or {}).get("resourceVersion")
            if version:
                body["metadata"] = {"resourceVersion": version}  # optimistic lock: merge-patch precondition
            fn = self._custom.patch_namespaced_custom_object_status
            try:
                await _call(fn, tj.GROUP, tj.VERSION, namespace, plural, name, body)
                return patch
            except ApiError as exc:
                if not exc.conflict:
                    raise
                obj = None  # someone wrote in between: read again
        raise ApiError(409, "Conflict", f"the status of {namespace}/{name} kept changing; {attempts} attempts")

    def _custom_call(self, method: str, namespace: str, **kwargs: Any) -> Any:
        fn = getattr(self._custom, method)
        args = [JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL]
        if "name" in kwargs:
            args.append(kwargs.pop("name"))
        if "body" in kwargs:
            args.append(kwargs.pop("body"))
        return _call(fn, *args, **kwargs)


async def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run one client call in a thread; the raw JSON answer, or :class:`ApiError`."""

    def run() -> dict[str, Any]:
        response = fn(*args, _preload_content=False, _request_timeout=_TIMEOUT, **kwargs)
        body = response.data
        return json.loads(body) if body else {}

    try:
        return await asyncio.to_thread(run)
    except kubernetes.client.ApiException as exc:
        raise _api_error(exc) from None
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise ApiError(0, type(exc).__name__, str(exc)) from None


async def _maybe(call: Any) -> dict[str, Any] | None:
    """The object, or None when it does not exist."""
    try:
        return await call
    except ApiError as exc:
        if exc.not_found:
            return None
        raise


def _api_error(exc: kubernetes.client.ApiException) -> ApiError:
    message = ""
    try:
        message = json.loads(exc.body or "{}").get("message", "")
    except (ValueError, AttributeError):
        message = str(exc.body or "")[:200]
    return ApiError(int(exc.status or 0), str(exc.reason or ""), message)
