"""One table of accelerator facts (wanloom_api.topology.ACCELERATOR_TYPES): the API's types are exactly its rows."""

from __future__ import annotations

from typing import get_args

from wanloom_api.topology import ACCELERATOR_TYPES, GPU_TYPES, GPUS_PER_NODE
from wanloom_api.trainingjob import GPUSpec, TPUSpec


def test_the_spec_names_exactly_the_table_accelerators() -> None:
    assert get_args(GPUSpec.model_fields["type"].annotation) == (*GPU_TYPES, "other")
    tpus = tuple(name for name, a in ACCELERATOR_TYPES.items() if a.kind == "tpu")
    assert get_args(TPUSpec.model_fields["type"].annotation) == tpus


def test_gpu_nodes_are_the_machines_gke_provisions() -> None:
    assert GPUS_PER_NODE == {"h100": 8, "h200": 8, "b200": 8}
    assert {ACCELERATOR_TYPES[name].machine.name for name in GPU_TYPES} == {
        "a3-highgpu-8g",
        "a3-ultragpu-8g",
        "a4-highgpu-8g",
    }
