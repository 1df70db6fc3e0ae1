"""Process start-up of the JAX trainer from the operator's pod environment (docs/startup-contract.md).

Two phases, in this order:

1. ``prepare_platform(config)`` before jax is imported: CPU jobs run on the host platform with as many host
   devices per process as the job's ``resources.cpu.devicesPerNode`` (``XLA_FLAGS`` is read once, at import).
2. ``initialize_jax(config.distributed)``: ``jax.distributed.initialize`` with the coordinator (process 0's
   ``host:port``), the process count (slices × hosts per slice) and the *global* process id
   (``slice_index · hosts_per_slice + host_index``; the per-Job completion index alone repeats across slices).
   A single-process job skips it. CPU processes exchange collectives over gloo. A process that stops answering
   (killed, or its node lost) is noticed by the coordination service after ``HEARTBEAT_TIMEOUT_S``, and every
   other process then ends (jax aborts it) instead of waiting in its next collective until the JobSet restarts.

The values come from ``TrainConfig.distributed`` (``config.train_config`` is the only reader of the environment).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import MutableMapping

from wanloom_trainer.config.environment import DistributedConfig
from wanloom_trainer.config.train_config import TrainConfig

log = logging.getLogger(__name__)
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# CPU jobs are local runs and smoke tests of small models. These flags cut XLA's compile time of the step programs
# and make every step slower, so they pay only for short runs: below FAST_COMPILE_MAX_STEPS steps (the tiny job's
# crossover, measured by benchmarks/step_overhead.py --compile; docs/benchmarks.md). Longer runs keep XLA's
# defaults, and local runs keep compiled programs in a persistent cache (train.launch.local_env), so a rerun
# compiles nothing either way. A flag already in XLA_FLAGS wins.
CPU_FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
FAST_COMPILE_MAX_STEPS = 400
# jax's default is 100 s. Heartbeats come from a thread of their own, so compiling or a long step does not delay
# them; a dead peer is noticed within about this long (the service checks a few times per timeout).
HEARTBEAT_TIMEOUT_S = 30


def devices_per_process(config: TrainConfig) -> int:
    return config.parallel.num_devices // config.distributed.num_processes


def prepare_platform(config: TrainConfig, environ: MutableMapping[str, str] | None = None) -> None:
    """Set the JAX platform variables a CPU job needs; must run before the first ``import jax``.

    Raises:
        RuntimeError: if jax is already imported with a different CPU device count than the job needs.
    """
    if config.accelerator != "cpu" or config.backend != "jax":
        return
    environ = os.environ if environ is None else environ
    count = devices_per_process(config)
    environ["JAX_PLATFORMS"] = "cpu"
    flags = re.sub(rf"{_DEVICE_COUNT_FLAG}=\d+", "", environ.get("XLA_FLAGS", "")).split()
    if config.steps < FAST_COMPILE_MAX_STEPS:
        flags += [f for f in CPU_FAST_COMPILE_FLAGS if f.split("=")[0] not in {g.split("=")[0] for g in flags}]
    environ["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={count}"])
    if "jax" in sys.modules and environ is os.environ:
        _check_already_imported(count)


def _check_already_imported(count: int) -> None:
    import jax

    if jax.local_device_count() != count:
        raise RuntimeError(
            f"jax was imported before the trainer set {_DEVICE_COUNT_FLAG}={count}; it sees "
            f"{jax.local_device_count()} local devices. Start the trainer in a fresh process (wanloom run does)."
        )


def initialize_jax(dist: DistributedConfig) -> None:
    """Join the job's processes (no-op for a single process or when already initialised)."""
    if not dist.multi_process:
        return
    import jax

    if jax.distributed.is_initialized():
        return
    log.info(
        "jax.distributed.initialize(coordinator=%s, num_processes=%d, process_id=%d)",
        dist.coordinator_address,
        dist.num_processes,
        dist.process_id,
    )
    jax.distributed.initialize(
        coordinator_address=dist.coordinator_address,
        num_processes=dist.num_processes,
        process_id=dist.process_id,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
    )
