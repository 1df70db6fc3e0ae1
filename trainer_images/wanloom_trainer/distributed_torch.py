"""Start-up of the PyTorch trainer's process group: one process per device, NCCL on GPUs, gloo on CPUs.

Two launch shapes, checked in this order:

1. **torchrun** (the GPU pod command the operator renders): torchrun's own contract (``RANK``, ``WORLD_SIZE``,
   ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; it derives them from ``NNODES``, ``NPROC_PER_NODE``,
   ``NODE_RANK`` and the rendezvous address) is read here, and ``init_process_group("env://")`` reads the rest.
2. **one process per pod** (``wanloom run --processes N`` and CPU pods): the wanloom environment, already parsed
   into ``DistributedConfig`` (rank = global process id, world = processes, TCP rendezvous at the coordinator).

A single process still gets a (world-size-1) process group, so FSDP2 and DCP run the same code path everywhere.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from wanloom_trainer.config.environment import DistributedConfig

TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_TIMEOUT = datetime.timedelta(minutes=30)  # first collectives wait for every rank to load its weights


@dataclass(frozen=True)
class TorchProcess:
    """This process's place in the job: global rank, world size, rank within its node, and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"


def _torchrun_process(env: Mapping[str, str]) -> tuple[int, int, int] | None:
    present = [k for k in TORCHRUN_KEYS if env.get(k)]
    if not present:
        return None
    if len(present) != len(TORCHRUN_KEYS):
        missing = sorted(set(TORCHRUN_KEYS) - set(present))
        raise ValueError(f"torchrun environment is incomplete: {', '.join(missing)} unset (have {', '.join(present)})")
    try:
        rank, world, local = (int(env[k]) for k in TORCHRUN_KEYS)
    except ValueError:
        raise ValueError(f"torchrun environment: {', '.join(f'{k}={env[k]!r}' for k in TORCHRUN_KEYS)}") from None
    if not 0 <= rank < world or local < 0:
        raise ValueError(f"torchrun environment: RANK={rank}, LOCAL_RANK={local} must lie within WORLD_SIZE={world}")
    return rank, world, local


def resolve_process(distributed: DistributedConfig, env: Mapping[str, str]) -> TorchProcess:
    """Where this process sits, from torchrun's variables if set, else from the wanloom environment."""
    launched = _torchrun_process(env)
    rank, world, local = launched or (distributed.process_id, distributed.num_processes, 0)
    if torch.cuda.is_available():
        if local >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local} but this node has {torch.cuda.device_count()} CUDA devices")
        return TorchProcess(rank, world, local, torch.device("cuda", local))
    return TorchProcess(rank, world, local, torch.device("cpu"))


def init_process_group(distributed: DistributedConfig, env: Mapping[str, str] | None = None) -> TorchProcess:
    """Initialise ``torch.distributed`` (idempotent) and return this process's place.

    Args:
        distributed: the pod environment as parsed by ``config.from_trainingjob``.
        env: the process environment for torchrun's variables (default ``os.environ``).

    Raises:
        ValueError: an incomplete torchrun environment, or several processes without a coordinator address.
    """
    env = os.environ if env is None else env
    proc = resolve_process(distributed, env)
    if dist.is_initialized():
        return proc
    if proc.device.type == "cuda":
        torch.cuda.set_device(proc.device)
    if _torchrun_process(env) is not None:
        dist.init_process_group(proc.backend, init_method="env://", timeout=_TIMEOUT, device_id=_device_id(proc))
    elif proc.world_size == 1:
        store = dist.HashStore()  # in-process: a single rank needs no rendezvous
        dist.init_process_group(proc.backend, store=store, rank=0, world_size=1, timeout=_TIMEOUT)
    else:
        if distributed.coordinator_address is None:
            raise ValueError(f"{proc.world_size} processes need a coordinator address (WANLOOM_COORDINATOR_ADDRESS)")
        dist.init_process_group(
            proc.backend,
            init_method=f"tcp://{distributed.coordinator_address}",
            rank=proc.rank,
            world_size=proc.world_size,
            timeout=_TIMEOUT,
        )
    return proc


def _device_id(proc: TorchProcess) -> torch.device | None:
    # Binding the NCCL communicator to the device lets NCCL initialise eagerly; gloo takes no device.
    return proc.device if proc.device.type == "cuda" else None


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
