"""parallel.mesh_torch: mesh validation, activation checkpointing policies, FSDP2 mixed precision (1 rank)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from wanloom_trainer.backends.torch.step import flow_matching_loss
from wanloom_trainer.config.environment import DistributedConfig
from wanloom_trainer.config.train_config import ParallelConfig
from wanloom_trainer.distributed_torch import init_process_group
from wanloom_trainer.model.wan_torch import build_expert
from wanloom_trainer.parallel.mesh_torch import (
    _ATTENTION_OPS,
    _MATMUL_OPS,
    MixedPrecision,
    apply_activation_checkpointing,
    build_torch_mesh,
    parallelize_wan,
)

SINGLE = DistributedConfig(None, 1, 0, 1, 0, None)


@pytest.fixture(scope="module")
def mesh():
    proc = init_process_group(SINGLE, env={})
    return build_torch_mesh(ParallelConfig(1, 1, 1, 1), proc.world_size, "cpu")


def _batch(variant, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "latents": torch.randn(2, variant.in_channels, 2, 4, 6, generator=g),
        "text": torch.randn(2, 5, variant.text_dim, generator=g),
        "noise": torch.randn(2, variant.in_channels, 2, 4, 6, generator=g),
        "timesteps": torch.tensor([999.0, 12.5]),
        "weights": torch.tensor([0.5, 0.25]),
    }


class _OpCounter(TorchDispatchMode):
    def __init__(self, ops: frozenset) -> None:
        super().__init__()
        self.ops, self.count = ops, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.ops
        return func(*args, **(kwargs or {}))


def _backward_op_counts(variant, remat: str) -> tuple[int, int, list[torch.Tensor]]:
    """(attention ops, matmuls) executed during backward, and the gradients."""
    model = build_expert(variant, seed=0)
    apply_activation_checkpointing(model, remat)
    loss, _ = flow_matching_loss(model, **_batch(variant))
    with _OpCounter(_ATTENTION_OPS) as attention, _OpCounter(_MATMUL_OPS) as matmuls:
        loss.backward()
    return attention.count, matmuls.count, [p.grad for p in model.parameters()]


def test_remat_policies_recompute_what_they_say_and_keep_gradients(tiny) -> None:
    attn_none, mm_none, grads_none = _backward_op_counts(tiny, "none")
    assert attn_none == 0
    blocks = tiny.num_layers
    expected_attention = {"full": 2 * blocks, "save-attention": 0, "save-matmuls": 2 * blocks}
    for remat, attn in expected_attention.items():
        got_attn, got_mm, grads = _backward_op_counts(tiny, remat)
        assert got_attn == attn, remat  # self- and cross-attention per block, recomputed or saved
        if remat == "save-matmuls":
            assert got_mm == mm_none  # no Linear re-run: every mm/addmm output was saved
        else:
            assert got_mm > mm_none  # the block's projections ran again
        for a, b in zip(grads, grads_none, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_remat_and_checkpoint_wrapper_keep_state_dict_keys(tiny) -> None:
    model = build_expert(tiny, seed=0)
    keys = list(model.state_dict())
    apply_activation_checkpointing(model, "full")
    assert list(model.state_dict()) == keys
    with pytest.raises(ValueError, match="remat 'dots' is not one of none, full, save-matmuls, save-attention"):
        apply_activation_checkpointing(model, "dots")


@pytest.mark.parametrize(
    ("parallel", "device", "message"),
    [
        pytest.param(ParallelConfig(1, 1, 1, 2), "cpu", "tensor=2: the torch backend has no tensor", id="tensor"),
        pytest.param(ParallelConfig(1, 4, 1, 1), "cpu", "= 4 ranks, but the process group has world size 1", id="size"),
    ],
)
def test_mesh_degrees_are_validated(parallel, device, message) -> None:
    with pytest.raises(ValueError, match=message):
        build_torch_mesh(parallel, 1, device)


def test_fsdp_bf16_compute_keeps_fp32_masters_timesteps_and_rope(tiny, mesh) -> None:
    reference = build_expert(tiny, seed=0)
    want, _ = flow_matching_loss(reference, **_batch(tiny))
    model = build_expert(tiny, seed=0)
    bf16 = MixedPrecision(compute_dtype=torch.bfloat16)
    parallelize_wan(model, mesh=mesh, remat="save-attention", mixed_precision=bf16)
    seen: dict[str, torch.dtype] = {}
    model.condition_embedder.time_embedder.linear_1.register_forward_pre_hook(
        lambda m, args: seen.update(time_weight=m.weight.dtype, time_input=args[0].dtype)
    )
    model.blocks[0].register_forward_pre_hook(
        lambda m, args: seen.update(hidden=args[0].dtype, temb=args[2].dtype, rope=args[3][0].dtype)
    )
    model.blocks[0].attn1.to_q.register_forward_pre_hook(lambda m, args: seen.update(q_weight=m.weight.dtype))
    got, _ = flow_matching_loss(model, **_batch(tiny), compute_dtype=torch.bfloat16)
    got.backward()
    assert seen == {
        "time_weight": torch.float32,  # the timestep MLP runs in fp32, as diffusers keeps it
        "time_input": torch.float32,
        "hidden": torch.bfloat16,
        "temb": torch.bfloat16,
        "rope": torch.float32,  # FSDP does not round the RoPE tables
        "q_weight": torch.bfloat16,
    }
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert abs(float(got.detach()) - float(want.detach())) < 2e-2 * float(want.detach())
