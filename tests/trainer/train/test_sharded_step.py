"""A sharded step on 8 CPU devices equals the single-device step (fresh process: the device count is fixed when
jax is imported, and other tests may already have imported it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.mark.slow
def test_sharded_steps_equal_the_single_device_step(run_script: Callable[..., dict[str, Any]]) -> None:
    report = run_script("sharded_step", devices=8)
    assert report["reference_loss"][0] > 0
    for mesh in ("fsdp2-context2-tensor2", "data2-fsdp4", "fused-data2-fsdp4", "fused-fsdp2-context2-tensor2"):
        r = report[mesh]
        assert r["loss"] < 1e-5, (mesh, r)
        assert r["grad_norm"] < 1e-4, (mesh, r)
        assert r["params"] < 1e-5, (mesh, r)  # after two AdamW steps at lr 1e-2
        assert r["opt"] < 1e-5, (mesh, r)
        assert r["split_leaves"] > 50, (mesh, r)  # parameters and moments really are sharded
        assert r["local_ranks"] == list(range(8 if mesh.endswith("data2-fsdp4") else 2))


def test_the_partitioner_bug_behind_the_gspmd_fallback(run_script: Callable[..., dict[str, Any]]) -> None:
    """The JAX backend partitions context-parallel meshes with GSPMD because Shardy (jax 0.10.2) gets a conv's
    weight gradient wrong on a spatially split output. When this starts failing, Shardy is fixed: remove
    ``backend_jax.use_gspmd_for_sequence_sharding``."""
    report = run_script("shardy_conv", devices=4)
    assert report["gspmd"] < 1e-3 * report["scale"], report
    assert report["shardy"] > 0.1 * report["scale"], report


def test_context_parallel_attention_is_exact_with_xla_and_splash(run_script: Callable[..., dict[str, Any]]) -> None:
    """K/V all-gathered over context inside shard_map; splash (the TPU kernel) runs in the Pallas interpreter."""
    report = run_script("splash_context", devices=4)
    for case, (out_err, grad_err) in report.items():
        assert out_err < 1e-5 and grad_err < 1e-5, (case, out_err, grad_err)
    assert set(report) == {"xla-self", "xla-cross", "splash-self", "splash-cross"}


@pytest.mark.slow
def test_the_sharded_step_compiles_for_tpu7x_with_mosaic_kernels(run_script: Callable[..., dict[str, Any]]) -> None:
    """AOT compilation for tpu7x:2x2x1 (8 TensorCores) and 2 such slices with libtpu on this CPU host: fused AdaLN
    and splash attention lower with Mosaic inside shard_map on data x fsdp x context x tensor meshes, where a bare
    Mosaic kernel cannot be partitioned."""
    pytest.importorskip("libtpu", reason="libtpu (jax[tpu]) is part of the dev install")
    report = run_script("tpu_compile", timeout=900)
    assert "cannot be automatically partitioned" in report.pop("unwrapped_error")
    assert set(report) == {
        "2x2x1-data2-fsdp2-context2",
        "2x2x1-fsdp2-context2-tensor2",
        "2-slices-2x2x1-data2-fsdp4-context2",
    }
    for case, r in report.items():
        assert r["device_kind"] == "TPU7x" and r["devices"] == (16 if case.startswith("2-slices") else 8), (case, r)
        assert r["mosaic_calls"] >= 6, (case, r)  # AdaLN forward + backward at 3 sites, and splash
        assert 0 < r["peak_bytes"] < 2**30, (case, r)
