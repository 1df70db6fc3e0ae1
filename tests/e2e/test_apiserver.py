"""The TrainingJob CRD against a real kube-apiserver (v1.36, built from k8s.io/kubernetes by `make cluster`).

What the API server, not our own code, decides: that the generated CRD (the chart's) is accepted and becomes
Established, that every shipped job is admitted and comes back with its defaults filled in as our validation
reads them, that every broken manifest `wanloom validate` refuses is refused by `kubectl apply` too (with the
field path), and that the CEL copies of the device-count rules (the tpu7x shape table, the parallelism product)
decide as `wanloom validate` does on shapes at and around their edges.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from wanloom_api.trainingjob import GROUP, PLURAL, VERSION
from wanloom_api.validation import validate_document, validate_file, validate_trainingjob

ROOT = Path(__file__).resolve().parents[2]
JOBS = sorted((ROOT / "jobs").glob("*.yaml"))
DATASET_FILES = sorted((ROOT / "jobs" / "datasets").glob("*.yaml"))
DATASETS = "latentdatasets"
INVALID = Path(__file__).resolve().parents[1] / "api" / "invalid"


def _create(cluster: Any, namespace: str, doc: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
    from kubernetes import client

    doc = {**doc, "metadata": {**doc.get("metadata", {}), "namespace": namespace}}
    plural = DATASETS if doc.get("kind") == "LatentDataset" else PLURAL
    return client.CustomObjectsApi(cluster.api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, plural, doc, field_validation="Strict", dry_run="All" if dry_run else None
    )


@pytest.mark.parametrize("path", DATASET_FILES, ids=lambda p: p.stem)
def test_every_shipped_dataset_is_admitted_with_its_defaults(
    cluster: Any, crd: Any, namespace: str, path: Path
) -> None:
    doc = yaml.safe_load(path.read_text())
    stored = _create(cluster, namespace, doc)
    assert stored["spec"]["dtype"] == "bfloat16" and stored["spec"]["backoffLimitPerIndex"] == 3
    assert validate_document(stored).errors == ()


def test_the_generated_crd_is_accepted_and_established(crd: dict[str, Any]) -> None:
    assert crd["spec"]["names"]["kind"] == "TrainingJob"


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.stem)
def test_every_shipped_job_is_admitted_with_its_defaults(cluster: Any, crd: Any, namespace: str, path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    stored = _create(cluster, namespace, doc)
    spec = stored["spec"]
    # Object defaults are filled in by the API server, as `kubectl get -o yaml` shows them.
    assert spec["parallelism"]["remat"] in ("none", "full", "save-matmuls", "save-attention")
    assert "costModel" in spec["adaptiveLoad"] and "learningRate" in spec["optimizer"]
    assert spec["maxRestarts"] == doc["spec"].get("maxRestarts", 3)
    # What the API server stored is what the operator will read: our validation accepts it unchanged.
    assert validate_trainingjob(stored).errors == ()


def _invalid_docs() -> list[tuple[str, dict[str, Any]]]:
    """The broken manifests that reach an API server: not those refused as files (not UTF-8, not YAML, a key twice),
    which kubectl refuses before sending anything."""
    out = []
    for path in sorted(INVALID.glob("*.yaml")):
        if any(e.path == "<file>" for result in validate_file(path) for e in result.errors):
            continue
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        if isinstance(doc, dict) and doc.get("kind") in ("TrainingJob", "LatentDataset"):
            out.append((path.stem, doc))
    return out


@pytest.mark.parametrize(("name", "doc"), _invalid_docs(), ids=lambda v: v if isinstance(v, str) else "")
def test_broken_manifests_are_refused_with_the_field_path(
    cluster: Any, crd: Any, namespace: str, name: str, doc: dict[str, Any]
) -> None:
    from kubernetes import client

    assert validate_document(doc).errors, f"{name}: wanloom validate must refuse it"
    expected = [
        line.split(":", 1)[1].strip()
        for line in (INVALID / f"{name}.yaml").read_bytes().decode("utf-8", errors="replace").splitlines()
        if line.startswith("# expect:")
    ]
    try:
        _create(cluster, namespace, doc, dry_run=True)
    except client.ApiException as exc:
        assert exc.status in (400, 422), exc.body
        if _non_finite(doc):  # JSON has no infinity or NaN: refused as unparseable, before any field is read
            assert exc.status == 400 and "json parse error" in exc.body, exc.body
            return
        assert all(path in exc.body for path in expected), (expected, exc.body)
        return
    pytest.fail(f"the API server admits {name}, which wanloom validate refuses")


def _non_finite(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_non_finite(v) for v in value)
    return isinstance(value, float) and not math.isfinite(value)


# At and around the edges of the tpu7x table: small shapes, the cube rule (multiples of 4, sorted, <= 144 cubes).
TOPOLOGIES = [
    *("1x1x1", "2x2x1", "2x2x2", "2x2x4", "2x4x4", "1x2x2", "2x2x3", "2x4x2", "4x4x4", "4x4x8", "4x8x8", "8x4x4"),
    *("4x4x5", "12x12x12", "16x16x16", "20x20x20", "4x4x576", "4x4x580", "8x8x144", "4x12x192"),
]
# (resources, parallelism degrees): products that match, miss, divide with -1, would overflow, have a zero.
PARALLELISM = [
    ({"tpu": {"topology": "4x4x4", "slices": 2}}, {"data": 2, "fsdp": 32, "context": 4}),
    ({"tpu": {"topology": "4x4x4", "slices": 2}}, {"data": 2, "fsdp": 32, "context": 2}),
    ({"tpu": {"topology": "4x4x4", "slices": 2}}, {"data": 3, "fsdp": -1}),
    ({"tpu": {"topology": "2x2x1"}}, {"data": 2, "fsdp": -1, "context": 2}),
    ({"tpu": {"topology": "2x2x1"}}, {"data": 1 << 20, "fsdp": 1 << 20, "context": 1 << 20, "tensor": 1 << 20}),
    ({"tpu": {"topology": "2x2x1"}}, {"fsdp": 0}),
    ({"tpu": {"topology": "4x4x5"}}, {"data": 7}),
    ({"gpu": {"type": "h200", "perNode": 8, "nodes": 4}}, {"data": 4, "fsdp": 8}),
    ({"gpu": {"type": "h200", "perNode": 8, "nodes": 4}}, {"data": 4, "fsdp": 4}),
    ({"gpu": {"type": "other", "perNode": 3, "nodes": 5}}, {"data": 5, "fsdp": -1}),
    ({"cpu": {"nodes": 2, "devicesPerNode": 4}}, {"fsdp": -1, "context": 3}),
    ({"cpu": {"nodes": 2, "devicesPerNode": 4}}, {"fsdp": -1, "context": 4}),
]
# (resources, parallelism degrees, globalBatch): data x fsdp ranks at, just above and just below the batch.
GLOBAL_BATCH = [
    ({"tpu": {"topology": "4x4x4", "slices": 2}}, {"data": 2, "fsdp": -1, "context": 4}, 64),
    ({"tpu": {"topology": "4x4x4", "slices": 2}}, {"data": 2, "fsdp": -1, "context": 4}, 63),
    ({"gpu": {"type": "h200", "perNode": 8, "nodes": 2}}, {"data": -1, "fsdp": 8}, 16),
    ({"gpu": {"type": "h200", "perNode": 8, "nodes": 2}}, {"data": -1, "fsdp": 8}, 15),
    ({"cpu": {"nodes": 2, "devicesPerNode": 4}}, {"data": 1, "fsdp": 2, "context": 2, "tensor": 2}, 2),
    ({"cpu": {"nodes": 2, "devicesPerNode": 4}}, {"data": 1, "fsdp": 2, "context": 2, "tensor": 2}, 1),
]


def _job(resources: dict[str, Any], parallelism: dict[str, int] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"variant": "wan2.2-t2v-a14b"},
        "data": {"uri": "gs://b/d"},
        "training": {"steps": 10, "globalBatch": 1 << 20},
        "resources": resources,
    }
    if parallelism is not None:
        spec["parallelism"] = parallelism
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob", "metadata": {"name": "edge"}, "spec": spec}


def _admitted(cluster: Any, namespace: str, doc: dict[str, Any]) -> bool:
    from kubernetes import client

    try:
        _create(cluster, namespace, doc, dry_run=True)
    except client.ApiException as exc:
        assert exc.status in (400, 422), exc.body
        return False
    return True


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_the_crd_decides_tpu_topologies_as_validate_does(cluster: Any, crd: Any, namespace: str, topology: str) -> None:
    doc = _job({"tpu": {"topology": topology}})
    assert _admitted(cluster, namespace, doc) == validate_trainingjob(doc).ok, validate_trainingjob(doc).errors


@pytest.mark.parametrize(("resources", "parallelism"), PARALLELISM, ids=lambda v: json.dumps(v, separators=(",", ":")))
def test_the_crd_decides_the_parallelism_product_as_validate_does(
    cluster: Any, crd: Any, namespace: str, resources: dict[str, Any], parallelism: dict[str, int]
) -> None:
    doc = _job(resources, parallelism)
    assert _admitted(cluster, namespace, doc) == validate_trainingjob(doc).ok, validate_trainingjob(doc).errors


VOLUME_CASES = yaml.safe_load((INVALID.parent / "volume_cases.yaml").read_text())


@pytest.mark.parametrize("case", VOLUME_CASES, ids=lambda c: str(c["error"]))
def test_the_crd_decides_volumes_as_validate_does(cluster: Any, crd: Any, namespace: str, case: dict[str, Any]) -> None:
    doc = _job({"cpu": {}, **{k: v for k, v in case.items() if k != "error"}})
    assert _admitted(cluster, namespace, doc) == validate_trainingjob(doc).ok, validate_trainingjob(doc).errors


@pytest.mark.parametrize(
    ("resources", "parallelism", "batch"), GLOBAL_BATCH, ids=lambda v: json.dumps(v, separators=(",", ":"))
)
def test_the_crd_decides_global_batch_per_rank_as_validate_does(
    cluster: Any, crd: Any, namespace: str, resources: dict[str, Any], parallelism: dict[str, int], batch: int
) -> None:
    doc = _job(resources, parallelism)
    doc["spec"]["training"]["globalBatch"] = batch
    assert _admitted(cluster, namespace, doc) == validate_trainingjob(doc).ok, validate_trainingjob(doc).errors


# Property: on manifests made by breaking a shipped job at one random place, the API server and `wanloom validate`
# agree (admit both or refuse both). A fixed seed keeps a run reproducible; the cases differ per seed.
SEEDS = (0, 1, 2)
CASES_PER_SEED = 120
_REPLACEMENTS = ("200", 200, -1, 0, 1.5, 2.0, True, False, None, [], {}, "x", 1 << 63, -(1 << 63) - 1, 1 << 40,
                 "gs:/b", "s3://b/x", "Upper", 1e-9, "4x4x5", "h100", "-1")  # fmt: skip


def _leaves(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _leaves(value, (*path, i))
    yield path


def _broken(rng: random.Random, jobs: list[dict[str, Any]], namespace: str) -> tuple[str, dict[str, Any]]:
    doc = copy.deepcopy(rng.choice(jobs))
    doc["metadata"] = {"name": "edge", "namespace": namespace}
    path = rng.choice([p for p in _leaves(doc["spec"], ("spec",)) if len(p) > 1])
    parent = functools.reduce(lambda node, key: node[key], path[:-1], doc)
    how = rng.choice(("replace", "replace", "replace", "delete", "rename"))
    if how == "delete" or isinstance(parent, list):
        del parent[path[-1]]
    elif how == "rename":  # an unknown or snake_case key
        key = path[-1]
        renamed = re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), key)
        parent[renamed if renamed != key else key + "X"] = parent.pop(key)
    else:
        parent[path[-1]] = copy.deepcopy(rng.choice(_REPLACEMENTS))
    return f"{how} {'.'.join(map(str, path))}", doc


@pytest.mark.parametrize("seed", SEEDS)
def test_validate_and_the_api_server_agree_on_broken_manifests(
    cluster: Any, crd: Any, namespace: str, seed: int
) -> None:
    rng = random.Random(seed)
    jobs = [yaml.safe_load(p.read_text()) for p in JOBS]
    disagreements = []
    for _ in range(CASES_PER_SEED):
        what, doc = _broken(rng, jobs, namespace)
        admitted, result = _admitted(cluster, namespace, doc), validate_trainingjob(doc)
        if admitted != result.ok:
            disagreements.append((what, "API server admits" if admitted else "validate admits", result.errors[:2]))
    assert not disagreements, disagreements
