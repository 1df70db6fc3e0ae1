"""The control-plane script CI runs on a fresh machine (.ci/cluster/up.py), checked where no cluster is needed.

A machine that already has a cluster up never reaches the node-pool code (up.py returns early), so a broken import
there only shows on a fresh clone: these tests call it directly.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest

from wanloom_api.topology import ACCELERATOR_TYPES, tpu7x_slice
from wanloom_api.validation import load_trainingjob_file

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def up() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ci_cluster_up", ROOT / ".ci" / "cluster" / "up.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fake_node_pools_are_sized_and_labelled_from_the_accelerator_table(up: ModuleType) -> None:
    pools = {name: (count, labels, capacity, taint) for name, count, labels, capacity, taint in up._node_pools()}
    for kind in ("h100", "h200"):
        _, labels, capacity, taint = pools[kind]
        accel = ACCELERATOR_TYPES[kind]
        assert labels == {"cloud.google.com/gke-accelerator": accel.gke_label}
        assert capacity["nvidia.com/gpu"] == str(accel.machine.accelerators)
        assert taint == "nvidia.com/gpu"
    tpu = [p for name, p in pools.items() if name.startswith("tpu7x-")]
    assert tpu and all(
        c["google.com/tpu"] == str(ACCELERATOR_TYPES["tpu7x"].machine.accelerators) for _, _, c, _ in tpu
    )


def test_every_shipped_job_has_enough_fake_nodes(up: ModuleType) -> None:
    """The end-to-end test that schedules every shipped job needs a pool of each job's shape with enough nodes."""
    pools = up._node_pools()
    for path in sorted((ROOT / "jobs").glob("*.yaml")):
        job = load_trainingjob_file(path)
        res = job.spec.resources
        if res.tpu is not None:
            topology = res.tpu.topology
            hosts = tpu7x_slice(topology).hosts
            matching = [p for p in pools if p[2].get("cloud.google.com/gke-tpu-topology") == topology]
            assert len(matching) >= res.tpu.slices, f"{path.name}: {res.tpu.slices} slices of {topology}"
            assert all(p[1] >= hosts for p in matching), f"{path.name}: {hosts} hosts per {topology} slice"
        elif res.gpu is not None:
            label = ACCELERATOR_TYPES[res.gpu.type].gke_label
            nodes = sum(p[1] for p in pools if p[2].get("cloud.google.com/gke-accelerator") == label)
            assert nodes >= res.gpu.nodes, f"{path.name}: {res.gpu.nodes} {res.gpu.type} nodes, {nodes} fake"


def _collected_files(marker: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", marker,
         "tests/e2e", "tests/images"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return {line.split("::")[0] for line in out.splitlines() if "::" in line}


def test_make_test_runs_every_cluster_and_image_test_after_the_builds_and_nothing_else() -> None:
    """.ci/test.sh runs ``not (cluster or images)`` while the cluster and images build: a test that uses the
    ``cluster`` fixture must be marked (the e2e conftest does it), or it would fail before the cluster is up."""
    after = _collected_files("cluster or images")
    assert after == {
        "tests/e2e/test_apiserver.py",
        "tests/e2e/test_chart_install.py",
        "tests/e2e/test_dataset_cluster.py",
        "tests/e2e/test_operator_cluster.py",
        "tests/e2e/test_real_node.py",
        "tests/images/test_gpu_image.py",
        "tests/images/test_images.py",
    }, after
    assert _collected_files("not (cluster or images)") == {"tests/e2e/test_prometheus.py"}


def test_the_gcs_emulator_has_every_bucket_a_job_names_and_honours_generations() -> None:
    """What the GCS emulator `make cluster` runs (.ci/cluster/gcs.py) adds to gcp-storage-emulator: a job may name
    any bucket, and tensorstore's conditional writes see GCS's generations."""
    spec = importlib.util.spec_from_file_location("ci_cluster_gcs", ROOT / ".ci" / "cluster" / "gcs.py")
    assert spec and spec.loader
    gcs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gcs)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    server = gcs.start("127.0.0.1", port)

    def upload(if_generation_match: str) -> int:
        """A media upload with a precondition, as tensorstore writes an OCDBT manifest."""
        query = f"uploadType=media&name=data%2Findex.json&ifGenerationMatch={if_generation_match}"
        request = urllib.request.Request(f"{base}/upload/storage/v1/b/named-by-a-job/o?{query}", b"{}", method="POST")
        try:
            with urllib.request.urlopen(request) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        with urllib.request.urlopen(f"{base}/storage/v1/b/named-by-a-job") as response:  # as gcsfs checks
            assert json.load(response)["name"] == "named-by-a-job"
        assert upload("0") == 200
        assert upload("0") == 412  # the object does now
        with urllib.request.urlopen(f"{base}/download/storage/v1/b/named-by-a-job/o/data%2Findex.json?alt=media") as r:
            generation = r.headers["x-goog-generation"]
        assert generation and upload(generation) == 200
        assert upload(generation) == 412  # that write made a new generation
    finally:
        server.stop()
