"""Where this trainer process sits in the job, read from the pod environment the operator writes.

Environment (names in ``wanloom_api.keys``; docs/startup-contract.md):

    WANLOOM_COORDINATOR_ADDRESS  host:port of process 0; unset = one process
    WANLOOM_NUM_SLICES           slices (TPU multi-slice replicas); default 1
    WANLOOM_SLICE_INDEX          this pod's slice; default 0
    WANLOOM_HOSTS_PER_SLICE      pods per slice; default 1
    WANLOOM_HOST_INDEX           this pod's index within its slice; default 0
    WANLOOM_DEVICES_PER_HOST     accelerator devices per pod (informational; checked against jax)
    LOCAL_RANK                   torchrun's process index within a GPU pod; default 0

``config.train_config`` reads the rest (WANLOOM_CONFIG, WANLOOM_METRICS_PORT, WANLOOM_RUN_DIR, WANLOOM_JOB_NAME,
WANLOOM_NAMESPACE).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from wanloom_api import keys


@dataclass(frozen=True)
class DistributedConfig:
    """Where this process sits in the job (the operator's pod environment)."""

    coordinator_address: str | None
    num_slices: int
    slice_index: int
    hosts_per_slice: int
    host_index: int
    devices_per_host: int | None
    # torchrun's LOCAL_RANK: several trainer processes share a GPU pod (and its metrics port); 0 elsewhere.
    local_rank: int = 0

    @property
    def num_processes(self) -> int:
        return self.num_slices * self.hosts_per_slice

    @property
    def process_id(self) -> int:
        return keys.global_process_id(self.slice_index, self.hosts_per_slice, self.host_index)

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1


def distributed_from_env(env: Mapping[str, str]) -> DistributedConfig:
    num_slices = env_int(env, keys.ENV_NUM_SLICES, 1, minimum=1)
    hosts = env_int(env, keys.ENV_HOSTS_PER_SLICE, 1, minimum=1)
    slice_index = env_int(env, keys.ENV_SLICE_INDEX, 0, minimum=0)
    host_index = env_int(env, keys.ENV_HOST_INDEX, 0, minimum=0)
    if slice_index >= num_slices:
        raise ValueError(f"{keys.ENV_SLICE_INDEX}={slice_index} must be below {keys.ENV_NUM_SLICES}={num_slices}")
    if host_index >= hosts:
        raise ValueError(f"{keys.ENV_HOST_INDEX}={host_index} must be below {keys.ENV_HOSTS_PER_SLICE}={hosts}")
    coordinator = env.get(keys.ENV_COORDINATOR_ADDRESS) or None
    if num_slices * hosts > 1 and coordinator is None:
        raise ValueError(f"{keys.ENV_COORDINATOR_ADDRESS} must be set (host:port) when the job has several processes")
    if coordinator is not None and not _is_host_port(coordinator):
        raise ValueError(f"{keys.ENV_COORDINATOR_ADDRESS}={coordinator!r} is not host:port")
    devices = env.get(keys.ENV_DEVICES_PER_HOST)
    return DistributedConfig(
        coordinator_address=coordinator,
        num_slices=num_slices,
        slice_index=slice_index,
        hosts_per_slice=hosts,
        host_index=host_index,
        devices_per_host=None if not devices else env_int(env, keys.ENV_DEVICES_PER_HOST, 1, minimum=1),
        local_rank=env_int(env, "LOCAL_RANK", 0, minimum=0),
    )


def _is_host_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def env_int(env: Mapping[str, str], name: str, default: int, *, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value
