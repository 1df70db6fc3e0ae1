"""`wanloom compile` of GPU jobs: the torch step traced on fake tensors with PyTorch's FSDPMemTracker, checked
against a measured CPU step, and the report's fields, breakdown and verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
LATENT = (5, 16, 16)  # 17 x 128 x 128 pixels for the tiny model: 320 tokens


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'trainer_images'}"}


def _gpu_job(tmp_path: Path, name: str = "job.yaml", **spec: object) -> Path:
    doc = {
        "apiVersion": "wanloom.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "tiny-gpu"},
        "spec": {
            "model": {"variant": "tiny", "paramDtype": "float32", "computeDtype": "float32"},
            "data": {"uri": "gs://b/d"},
            "adaptiveLoad": {"memoryBudgetTokens": 64_000, "buckets": [{"frames": 17, "height": 128, "width": 128}]},
            "parallelism": {"fsdp": -1, "remat": "none"},
            "training": {"steps": 10, "globalBatch": 8},
            "resources": {"gpu": {"type": "h100", "perNode": 1, "nodes": 1}},
            **spec,
        },
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def _parameters(variant: str, layers: int) -> int:
    import dataclasses

    import torch
    from diffusers import WanTransformer3DModel

    from wanloom_trainer.config.variants import get_variant

    with torch.device("meta"):
        model = WanTransformer3DModel(**dataclasses.replace(get_variant(variant), num_layers=layers).diffusers_config())
    return sum(p.numel() for p in model.parameters())


def _compile(*args: str) -> subprocess.CompletedProcess[str]:
    code = "import sys; from wanloom_cli import main; sys.argv[0] = 'wanloom'; main()"
    return subprocess.run([sys.executable, "-c", code, "compile", *args], env=_env(), capture_output=True,
                          text=True, timeout=600)  # fmt: skip


def test_the_estimate_agrees_with_a_measured_cpu_step(tmp_path: Path) -> None:
    """200 rows of 320 tokens: what the tracker says one forward + backward adds is what a real step adds to the
    process's peak resident memory (large allocations mmapped, so freed tensors leave it)."""
    proc = _compile(str(_gpu_job(tmp_path)), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [micro] = json.loads(proc.stdout)["micro_batches"]
    assert micro["rows_per_rank"] == 200 and micro["tokens_per_row"] == 320
    measured = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_step_memory.py")), "200", *map(str, LATENT)],
        env={**_env(), "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    measured_mib = float(measured.stdout.split()[-1])
    estimated_mib = micro["activation_bytes"] / 2**20
    assert measured_mib > 200  # the activations dominate what is measured
    assert estimated_mib == pytest.approx(measured_mib, rel=0.10), (estimated_mib, measured_mib)


def test_the_report_has_the_tpu_fields_the_breakdown_and_a_verdict(tmp_path: Path) -> None:
    """The A14B H100 example job (context 4) at one layer: every field, both experts resident, FSDP over all 8."""
    proc = _compile(str(ROOT / "jobs" / "t2v-a14b-h100-1x8.yaml"), "--layers", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "returned a view tensor" not in proc.stderr  # the FSDP roots return tensors of their own
    report = json.loads(proc.stdout)
    assert report["compiled"] is True and report["fits"] is True
    assert report["capacity_bytes_per_device"] == 81_559 * 2**20
    assert report["mesh"] == {"data": 1, "fsdp": 2, "context": 4}
    assert set(report["breakdown"]) == {"parameters", "gradients", "optimizer", "activations"}
    # One A14B layer plus the embeddings (0.58 B parameters per expert), two experts, fp32, sharded over 8 GPUs.
    expected = 2 * _parameters("wan2.2-t2v-a14b", 1) * 4 / 8
    assert report["breakdown"]["parameters"] == pytest.approx(expected, rel=0.02)
    assert report["breakdown"]["optimizer"] == pytest.approx(2 * report["breakdown"]["parameters"], rel=0.01)
    assert [m["tokens_per_row"] for m in report["micro_batches"]] == [75_600, 32_760, 3_600]
    assert report["peak_bytes_per_device"] >= max(m["peak_bytes"] for m in report["micro_batches"])

    small = _compile(str(ROOT / "jobs" / "t2v-a14b-h100-1x8.yaml"), "--layers", "1", "--hbm-gib", "4")
    assert small.returncode == 1 and "does NOT fit" in small.stdout, small.stdout


def test_context_parallelism_splits_the_activations(tmp_path: Path) -> None:
    """Two GPUs as FSDP 2 or as context 2: the same micro-batch per data-parallel rank, half the tokens per GPU."""
    resources = {"gpu": {"type": "h100", "perNode": 2, "nodes": 1}}
    activations = {}
    for name, parallelism in {"fsdp": {"fsdp": 2}, "context": {"fsdp": 1, "context": 2}}.items():
        job = _gpu_job(tmp_path, f"{name}.yaml", parallelism={**parallelism, "remat": "none"}, resources=resources)
        proc = _compile(str(job), "--json")
        assert proc.returncode == 0, proc.stderr[-3000:]
        activations[name] = json.loads(proc.stdout)["micro_batches"][0]["activation_bytes"]
    assert 0.4 < activations["context"] / activations["fsdp"] < 0.65, activations


def test_a_lora_job_keeps_gradients_and_moments_for_the_adapters_alone(tmp_path: Path) -> None:
    """The A14B LoRA example job at one layer: a bfloat16 base resident, float32 gradients and AdamW moments only
    for the rank-32 adapters, so the update needs next to nothing beyond the resident state."""
    proc = _compile(str(ROOT / "jobs" / "t2v-a14b-lora-h100-1x8.yaml"), "--layers", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    breakdown = report["breakdown"]
    base = 2 * _parameters("wan2.2-t2v-a14b", 1) * 2 / 8  # bfloat16, both experts, 8 GPUs
    assert breakdown["parameters"] == pytest.approx(base, rel=0.05)
    assert breakdown["gradients"] < 0.02 * breakdown["parameters"]
    assert breakdown["optimizer"] == pytest.approx(2 * breakdown["gradients"], rel=0.01)
    assert report["fits"] is True
