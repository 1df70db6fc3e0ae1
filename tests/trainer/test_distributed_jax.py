"""CPU platform set-up of the JAX trainer: device count, and XLA's fast-compile flags only where they pay."""

from __future__ import annotations

from pathlib import Path

import pytest

from wanloom_api.validation import load_trainingjob_file
from wanloom_trainer.config.train_config import from_trainingjob
from wanloom_trainer.distributed_jax import CPU_FAST_COMPILE_FLAGS, FAST_COMPILE_MAX_STEPS, prepare_platform
from wanloom_trainer.train.launch import with_overrides

JOB = Path(__file__).resolve().parents[2] / "jobs" / "tiny-local.yaml"


def _flags(steps: int, xla_flags: str | None = None) -> list[str]:
    config = from_trainingjob(with_overrides(load_trainingjob_file(JOB), steps=steps), {})
    environ = {} if xla_flags is None else {"XLA_FLAGS": xla_flags}
    prepare_platform(config, environ)
    assert environ["JAX_PLATFORMS"] == "cpu"
    return environ["XLA_FLAGS"].split()


@pytest.mark.parametrize(
    ("steps", "fast"), [(1, True), (FAST_COMPILE_MAX_STEPS - 1, True), (FAST_COMPILE_MAX_STEPS, False), (10_000, False)]
)
def test_fast_compile_flags_only_for_short_runs(steps: int, fast: bool) -> None:
    flags = _flags(steps)
    assert (set(CPU_FAST_COMPILE_FLAGS) <= set(flags)) is fast
    assert "--xla_force_host_platform_device_count=1" in flags


def test_a_flag_the_user_set_wins() -> None:
    flags = _flags(10, "--xla_backend_optimization_level=2 --xla_force_host_platform_device_count=7")
    assert "--xla_backend_optimization_level=2" in flags and "--xla_backend_optimization_level=0" not in flags
    assert "--xla_llvm_disable_expensive_passes=true" in flags
    assert [f for f in flags if f.startswith("--xla_force_host_platform_device_count")] == [
        "--xla_force_host_platform_device_count=1"
    ]
