"""distributed_torch: where a process sits, from torchrun's variables or the wanloom environment."""

from __future__ import annotations

import pytest
import torch

from wanloom_trainer.config.environment import DistributedConfig
from wanloom_trainer.distributed_torch import TorchProcess, resolve_process

PODS = DistributedConfig("10.0.0.1:8476", 1, 0, 4, 2, None)  # pod 2 of 4


def test_torchrun_variables_win_over_the_pod_index() -> None:
    proc = resolve_process(PODS, {"RANK": "13", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "MASTER_ADDR": "x"})
    if torch.cuda.is_available():
        pytest.skip("device placement differs with CUDA")
    assert proc == TorchProcess(13, 16, 5, torch.device("cpu"))
    assert proc.backend == "gloo"


def test_one_process_per_pod_without_torchrun() -> None:
    proc = resolve_process(PODS, {})
    assert (proc.rank, proc.world_size, proc.local_rank) == (2, 4, 0)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        pytest.param({"RANK": "1"}, "LOCAL_RANK, WORLD_SIZE unset", id="incomplete"),
        pytest.param({"RANK": "a", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK='a'", id="not-int"),
        pytest.param({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "must lie within WORLD_SIZE=2", id="range"),
    ],
)
def test_bad_torchrun_environment_is_named(env: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_process(PODS, env)
