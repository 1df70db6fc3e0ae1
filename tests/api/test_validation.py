"""TrainingJob validation: the examples pass; each broken manifest fails with its field path, without a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from wanloom_api.validation import (
    device_count,
    load_trainingjob_file,
    resolve_parallelism,
    validate_file,
    validate_trainingjob,
)

ROOT = Path(__file__).resolve().parents[2]
JOBS = sorted((ROOT / "jobs").glob("*.yaml"))
INVALID = sorted((Path(__file__).parent / "invalid").glob("*.yaml"))


def _expected_paths(path: Path) -> list[str]:
    text = path.read_bytes().decode("utf-8", errors="replace")  # one fixture is deliberately not UTF-8
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("# expect:")]


def _wanloom(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from wanloom_cli import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_examples_are_valid(path: Path) -> None:
    [result] = validate_file(path)
    assert result.errors == ()
    assert result.job is not None


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_trainer_metrics_do_not_take_prometheus_port(path: Path) -> None:
    """A laptop running the local job beside a Prometheus on its default port must not lose the endpoint."""
    [result] = validate_file(path)
    assert result.job is not None and result.job.spec.metrics_port != 9090


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_manifest_names_field(path: Path) -> None:
    results = validate_file(path)
    errors = [str(e) for r in results for e in r.errors]
    for expected in _expected_paths(path):
        assert any(e.startswith(expected) for e in errors), f"no error at {expected}: {errors}"


def test_cli_validate_examples_exit_zero() -> None:
    proc = _wanloom("validate", *map(str, JOBS))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(": ok") == len(JOBS)


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_cli_validate_broken_exit_one_without_traceback(path: Path) -> None:
    proc = _wanloom("validate", str(path))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr + proc.stdout
    for expected in _expected_paths(path):
        assert expected in proc.stderr


def _tiny() -> dict:
    return yaml.safe_load((ROOT / "jobs" / "tiny-local.yaml").read_text())


def test_every_problem_reported_at_once() -> None:
    doc = _tiny()
    doc["spec"]["model"]["variant"] = "nope"
    doc["spec"]["training"]["steps"] = 0
    doc["spec"]["kernels"]["adaln"] = "magic"
    paths = {e.path for e in validate_trainingjob(doc).errors}
    assert {"spec.model.variant", "spec.training.steps", "spec.kernels.adaln"} <= paths


def test_error_message_shows_value_and_valid_choices() -> None:
    doc = _tiny()
    doc["spec"]["model"]["variant"] = "wan9"
    [error] = validate_trainingjob(doc).errors
    assert "'wan9'" in error.message and "wan2.2-t2v-a14b" in error.message


def test_topology_error_lists_valid_topologies() -> None:
    [result] = validate_file(Path(__file__).parent / "invalid" / "bad-topology.yaml")
    [error] = [e for e in result.errors if e.path == "spec.resources.tpu.topology"]
    assert "4x4x5" in error.message and "4x4x4" in error.message


@pytest.mark.parametrize(
    ("variant", "expected"),
    [("wan2.2-t2v-a14b", 0.875), ("wan2.2-i2v-a14b", 0.900), ("wan2.2-ti2v-5b", None)],
)
def test_boundary_ratio_defaults_per_variant(variant: str, expected: float | None) -> None:
    doc = _tiny()
    doc["spec"]["model"]["variant"] = variant
    job = validate_trainingjob(doc).job
    assert job is not None and job.spec.boundary_ratio == expected


def test_image_to_video_fraction_defaults_for_unified_models_only() -> None:
    jobs = {p.stem: load_trainingjob_file(p) for p in JOBS}
    assert jobs["ti2v-5b-h200-2x8"].spec.image_to_video_fraction == 0.5
    assert jobs["tiny-ti2v-local"].spec.image_to_video_fraction == 0.5
    assert jobs["tiny-i2v-local"].spec.image_to_video_fraction == 0.0  # I2V-A14B conditions by channels instead
    assert jobs["t2v-a14b-tpu7x-2x4x4x4"].spec.image_to_video_fraction == 0.0


def test_backend_defaults_from_accelerator() -> None:
    jobs = {p.stem: load_trainingjob_file(p) for p in JOBS}
    assert jobs["tiny-local"].spec.resources.resolved_backend == "jax"
    assert jobs["t2v-a14b-tpu7x-2x4x4x4"].spec.resources.resolved_backend == "jax"
    assert jobs["ti2v-5b-h200-2x8"].spec.resources.resolved_backend == "torch"


@pytest.mark.parametrize(
    ("name", "devices"),
    [("t2v-a14b-tpu7x-2x4x4x4", 256), ("i2v-a14b-tpu7x-4x8x8", 512), ("ti2v-5b-h200-2x8", 16), ("tiny-local", 1)],
)
def test_device_count(name: str, devices: int) -> None:
    assert device_count(load_trainingjob_file(ROOT / "jobs" / f"{name}.yaml").spec) == devices


def test_resolve_parallelism_fills_auto_degree() -> None:
    assert resolve_parallelism({"data": 2, "fsdp": -1, "context": 4, "tensor": 1}, 256)["fsdp"] == 32
    with pytest.raises(ValueError, match="does not divide 16 devices"):
        resolve_parallelism({"data": 3, "fsdp": -1, "context": 1, "tensor": 1}, 16)
    with pytest.raises(ValueError, match="must equal it"):
        resolve_parallelism({"data": 2, "fsdp": 2, "context": 1, "tensor": 1}, 8)


def test_load_file_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_text("apiVersion: wanloom.dev/v1alpha1\nkind: TrainingJob\nmetadata: {name: x}\nspec: {}\n")
    with pytest.raises(ValueError, match=r"job\.yaml is invalid") as info:
        load_trainingjob_file(bad)
    assert "spec.model" in str(info.value)
    with pytest.raises(ValueError, match="cannot read"):
        load_trainingjob_file(tmp_path / "missing.yaml")


VOLUME_CASES = yaml.safe_load((Path(__file__).parent / "volume_cases.yaml").read_text())


@pytest.mark.parametrize("case", VOLUME_CASES, ids=lambda c: str(c["error"]))
def test_volume_rules_name_the_item(case: dict[str, object]) -> None:
    doc = yaml.safe_load((ROOT / "jobs" / "tiny-local.yaml").read_text())
    doc["spec"]["resources"] |= {k: v for k, v in case.items() if k != "error"}
    errors = validate_trainingjob(doc).errors
    assert [e.path for e in errors] == ([case["error"]] if case["error"] else []), errors


def _sequence_job(variant: str, parallelism: dict, resources: dict, buckets: list[dict], **spec: object) -> dict:
    return {
        "apiVersion": "wanloom.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "split"},
        "spec": {
            "model": {"variant": variant},
            "data": {"uri": "gs://b/d"},
            "adaptiveLoad": {"buckets": buckets},
            "parallelism": parallelism,
            "training": {"steps": 10, "globalBatch": 8},
            "resources": resources,
            **spec,
        },
    }


def test_a_bucket_the_context_degree_does_not_divide_is_refused_with_a_size_that_works() -> None:
    """TI2V-5B with context 4: a 480x832 image is 15 x 26 = 390 tokens, which Ulysses cannot split four ways."""
    gpu = {"gpu": {"type": "h100", "perNode": 8, "nodes": 1}}
    buckets = [{"frames": 121, "height": 704, "width": 1280}, {"frames": 1, "height": 480, "width": 832}]
    result = validate_trainingjob(_sequence_job("wan2.2-ti2v-5b", {"fsdp": -1, "context": 4}, gpu, buckets))
    [error] = result.errors
    assert error.path == "spec.adaptiveLoad.buckets[1]"
    assert "390 tokens per sample" in error.message and "context x tensor = 4" in error.message
    assert "e.g. 1x448x832" in error.message  # 14 x 26 = 364 tokens
    # Context 2 divides 390; and the JAX trainer's packed rows are padded to the multiple whatever the buckets.
    assert validate_trainingjob(_sequence_job("wan2.2-ti2v-5b", {"fsdp": -1, "context": 2}, gpu, buckets)).ok
    tpu = {"tpu": {"type": "tpu7x", "topology": "2x2x1"}}
    assert validate_trainingjob(_sequence_job("wan2.2-ti2v-5b", {"fsdp": -1, "context": 4}, tpu, buckets)).ok
    unpacked = {"buckets": buckets, "scheduler": "equal-tokens"}
    result = validate_trainingjob(
        _sequence_job("wan2.2-ti2v-5b", {"fsdp": -1, "context": 4}, tpu, buckets, adaptiveLoad=unpacked)
    )
    assert [e.path for e in result.errors] == ["spec.adaptiveLoad.buckets[1]"]


def test_a_context_degree_that_does_not_divide_the_heads_is_refused() -> None:
    cpu = {"cpu": {"nodes": 4}, "backend": "torch"}
    result = validate_trainingjob(
        _sequence_job("tiny", {"fsdp": 1, "context": 4}, cpu, [{"frames": 1, "height": 64, "width": 64}])
    )
    [error] = result.errors
    assert error.path == "spec.parallelism.context"
    assert "the 2 attention heads of tiny" in error.message and "use one of 2" in error.message


@pytest.mark.parametrize(
    ("variant", "spec", "path", "message"),
    [
        ("wan2.2-t2v-a14b", {"lora": {}}, "spec.lora", "set model.weights"),
        ("wan2.2-ti2v-5b", {"lora": {"experts": "high_noise"}, "model": {"weights": "gs://b/w"}},
         "spec.lora.experts", "single-model variant has one model"),
        ("tiny", {"lora": {"dropout": 0.1}}, "spec.lora.dropout", "jax backend trains adapters without dropout"),
        ("tiny", {"lora": {"targets": ["attn1.to_q", "attn1.to_q"]}}, "spec.lora.targets", "must be unique"),
        ("tiny", {"export": {"uri": "/x", "merge": True}, "training": {"steps": 10, "globalBatch": 8,
                                                                       "checkpoint": {"uri": "/c"}}},
         "spec.export.merge", "needs spec.lora and model.weights"),
    ],
)  # fmt: skip
def test_lora_rules_name_the_field(variant: str, spec: dict, path: str, message: str) -> None:
    cpu = {"cpu": {"nodes": 1}}
    doc = _sequence_job(variant, {"fsdp": -1}, cpu, [{"frames": 1, "height": 64, "width": 64}])
    model = spec.pop("model", {})
    doc["spec"].update(spec)
    doc["spec"]["model"].update(model)
    errors = validate_trainingjob(doc).errors
    assert any(e.path == path and message in e.message for e in errors), errors
