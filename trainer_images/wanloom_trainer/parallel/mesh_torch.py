"""Parallelism for the PyTorch trainer: the device mesh and ``parallelize_wan`` (one function, one order).

Mesh (``build_torch_mesh``), outermost first: ``data`` (replicated: HSDP's replicate dimension), ``fsdp``
(parameters, gradients and optimizer state sharded), then ``ring`` × ``ulysses``, the two dimensions diffusers'
context parallelism names (wanloom's ``context`` degree becomes ``ulysses``; ``ring`` is 1). FSDP shards over
``dp_shard_cp`` = ``fsdp`` × ``context`` ranks (torchtitan's name): context-parallel peers hold the same samples, so
their parameter gradients are partial sums over tokens that the reduce-scatter adds up.

Tensor parallelism is not offered: diffusers 0.42 has no tensor-parallel plan for ``WanTransformer3DModel``.
Context parallelism uses diffusers' ``enable_parallelism`` with Wan's ``_cp_plan`` (Ulysses all-to-all over the
native SDPA backend): NCCL on GPUs, gloo on CPUs (the multi-process tests compare it with the unsharded step). The
context degree must divide the head count and every micro-batch's token count (T'·H'·W' / 4); the planner refuses
buckets it does not divide (``adaptiveload.planner``).

Gradients are *summed* over data-parallel ranks (divide factor 1): ``adaptiveload.plan`` gives every sample a weight
that holds the step's normaliser (1/globalBatch), so the sum is the step's gradient whatever the per-rank batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from wanloom_api.trainingjob import REMAT_POLICIES
from wanloom_trainer.config.train_config import ParallelConfig

TORCH_MESH_AXES = ("data", "fsdp", "ring", "ulysses")

_aten = torch.ops.aten
# Attention-core ops F.scaled_dot_product_attention dispatches to (GPU kernels, and the CPU flash kernel).
_ATTENTION_OPS = frozenset(
    op
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if (op := getattr(getattr(_aten, name, None), "default", None)) is not None
)
# Matmuls without a batch dimension (every nn.Linear flattens its tokens): JAX's dots_with_no_batch_dims_saveable.
_MATMUL_OPS = frozenset({_aten.mm.default, _aten.addmm.default})


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: master weights and optimizer state; ``compute_dtype``: forward/backward matmuls."""

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class TorchMeshes:
    """``world``: (data, fsdp, ring, ulysses) over all ranks; ``fsdp``: what FSDP shards over, 1-D ``dp_shard_cp``
    or, with ``data`` > 1, 2-D (``data``, ``dp_shard_cp``) HSDP. Both order ranks the same way (row-major)."""

    world: DeviceMesh
    fsdp: DeviceMesh

    @property
    def context(self) -> int:
        return self.world["ulysses"].size()

    def data_parallel_rank(self) -> tuple[int, int]:
        """(rank, size) of this process among the ranks that hold different samples (data × fsdp)."""
        data, fsdp = self.world["data"], self.world["fsdp"]
        return data.get_local_rank() * fsdp.size() + fsdp.get_local_rank(), data.size() * fsdp.size()


def build_torch_mesh(parallel: ParallelConfig, world_size: int, device_type: str) -> TorchMeshes:
    """The meshes over all ranks of the initialised process group.

    Raises:
        ValueError: tensor parallelism requested, or degrees whose product differs from the world size (the
            message prints both).
    """
    if parallel.tensor != 1:
        raise ValueError(
            f"spec.parallelism.tensor={parallel.tensor}: the torch backend has no tensor parallelism (diffusers 0.42 "
            "has no tensor-parallel plan for WanTransformer3DModel); use fsdp/context, or backend jax"
        )
    if parallel.num_devices != world_size:
        hint = "; the torch backend runs one process per device (resources.cpu.devicesPerNode: 1)"
        raise ValueError(
            f"spec.parallelism data={parallel.data} x fsdp={parallel.fsdp} x context={parallel.context} = "
            f"{parallel.num_devices} ranks, but the process group has world size {world_size}"
            f"{hint if device_type == 'cpu' else ''}"
        )
    world = init_device_mesh(
        device_type, (parallel.data, parallel.fsdp, 1, parallel.context), mesh_dim_names=TORCH_MESH_AXES
    )
    # A mesh of its own rather than a flattened slice of ``world`` (slicing flattened dims is deprecated).
    shard = parallel.fsdp * parallel.context
    fsdp = init_device_mesh(device_type, (parallel.data, shard), mesh_dim_names=("data", "dp_shard_cp"))
    return TorchMeshes(world, fsdp if parallel.data > 1 else fsdp["dp_shard_cp"])


def _selective_policy(saved_ops: frozenset) -> Callable:
    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved_ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_activation_checkpointing(model: nn.Module, remat: str) -> None:
    """Wrap every transformer block in a checkpoint wrapper per ``spec.parallelism.remat``.

    ``full`` recomputes the whole block in backward; ``save-attention`` keeps the SDPA outputs (the costliest
    activations to recompute at long sequences) and recomputes the rest; ``save-matmuls`` keeps every Linear
    output. State-dict keys are unchanged (the wrapper strips its own prefix).
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"spec.parallelism.remat {remat!r} is not one of {', '.join(REMAT_POLICIES)}")
    if remat == "none":
        return
    kwargs: dict[str, object] = {"preserve_rng_state": False}  # Wan has no dropout: nothing random to replay
    if remat != "full":
        saved = _ATTENTION_OPS if remat == "save-attention" else _MATMUL_OPS
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _selective_policy(saved))
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block, **kwargs)


def _policies(mixed_precision: MixedPrecision) -> tuple[MixedPrecisionPolicy, MixedPrecisionPolicy]:
    """(main policy, fp32 policy). Inputs are never cast by FSDP (``cast_forward_inputs=False``): the step passes
    latents and text in the compute dtype and keeps timesteps and RoPE tables in fp32, which a blanket cast of
    every floating-point input would round to bf16."""
    compute = mixed_precision.compute_dtype
    param_dtype = None if compute == mixed_precision.param_dtype else compute
    main = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    fp32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return main, fp32


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, mixed_precision: MixedPrecision) -> None:
    """``fully_shard`` each block, the time embedder (kept fp32, as diffusers keeps it), then the root."""
    main, fp32 = _policies(mixed_precision)

    def shard(module: nn.Module, policy: MixedPrecisionPolicy, reshard_after_forward: bool) -> None:
        # Registered before fully_shard, so it runs before FSDP's own post-forward hook (registration order).
        module.register_forward_hook(_fresh_outputs)
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)

    for block in model.blocks:
        shard(block, main, True)
    if mixed_precision.param_dtype == torch.float32:
        shard(model.condition_embedder.time_embedder, fp32, True)
    # The root's parameters (patch/text embedders, output projection) are needed again at the start of backward:
    # keeping them gathered saves one all-gather per step.
    shard(model, main, False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum, not mean (module docstring). Forcing plain SUM collectives keeps the divide factor 1 off NCCL's
            # PreMulSum, which gloo lacks; with a factor of 1 FSDP then skips its post-division entirely.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _fresh_outputs(module: nn.Module, args: object, output: object) -> object:
    """diffusers' Wan forward returns its unpatchified prediction as a view (and the time embedder its embedding);
    FSDP2 hangs its pre-backward hook on a module's outputs, and an in-place op on a view would drop it. A copy of a
    view output (the prediction: a few MB) is the module's own tensor whatever the caller does with it."""
    return tree_map_only(torch.Tensor, lambda t: t.clone() if t._is_view() else t, output)


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    # mesh: the world mesh; diffusers takes its (ring, ulysses) dimensions.
    """diffusers' Ulysses context parallelism over the mesh's (ring, ulysses) dimensions, per Wan's ``_cp_plan``."""
    from diffusers.models._modeling_parallel import ContextParallelConfig

    heads = model.config.num_attention_heads
    degree = mesh["ulysses"].size()
    if heads % degree:
        raise ValueError(f"spec.parallelism.context={degree} must divide the model's {heads} attention heads")
    with _accelerator_count_at_least_one():
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree, mesh=mesh["ring", "ulysses"]))


@contextlib.contextmanager
def _accelerator_count_at_least_one() -> Iterator[None]:
    """diffusers 0.42 records a device as ``rank % torch.accelerator.device_count()``, which divides by zero on a
    CPU-only host (gloo). The recorded device is never read again (the mesh we pass decides where tensors live), so
    on such a host the count reads 1 for the duration of ``enable_parallelism``."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = count


def compile_blocks(model: nn.Module) -> None:
    """``torch.compile`` every transformer block in place (regional compilation, as torchtitan does): the blocks
    share one architecture, so one compiled graph serves all of them; the fused AdaLN kernels are PyTorch
    operators (``wanloom::adaln_*``) and stay single graph nodes."""
    for block in model.blocks:
        block.compile()


def parallelize_wan(
    model: nn.Module, *, mesh: TorchMeshes, remat: str, mixed_precision: MixedPrecision, compile: bool = False
) -> nn.Module:
    """Apply context parallelism, activation checkpointing, compilation, then FSDP2 to one Wan expert, in place.

    The order matters:
    1. Context parallelism first: diffusers registers its split/gather hooks by submodule name (``blocks.0``,
       ``proj_out``), which the checkpoint wrapper would rename.
    2. Activation checkpointing before FSDP, so that ``fully_shard`` wraps the checkpoint wrapper: the block's
       all-gather then happens once around the whole checkpointed region, and the backward recomputation runs
       while FSDP's pre-backward hook holds the parameters unsharded (no second gather, and the checkpoint never
       saves sharded parameters).
    3. Compilation (``compile``) of the checkpointed blocks, before FSDP: the graph holds the block's compute and
       recomputation, FSDP's all-gathers and reduce-scatters stay outside it (torchtitan's order).
    4. FSDP last, blocks before the root, so each block is its own all-gather/reduce-scatter unit and the root
       holds only what is left.

    Args:
        model: a diffusers ``WanTransformer3DModel`` with parameters in ``mixed_precision.param_dtype`` (fused AdaLN
            already applied if wanted).
        mesh: from ``build_torch_mesh``.
        remat: ``spec.parallelism.remat``: none, full, save-matmuls or save-attention.
        mixed_precision: master and compute dtypes; gradients are always reduced in fp32.
        compile: ``spec.kernels.compile: blocks``.

    Returns:
        The same module, now an ``FSDPModule`` — unless the job has one rank and one dtype: FSDP would shard over
        nothing and only add its hooks (they doubled a one-rank CPU step), so the module stays plain.
    """
    if mesh.context > 1:
        apply_context_parallel(model, mesh.world)
    apply_activation_checkpointing(model, remat)
    if compile:
        compile_blocks(model)
    if mesh.world.size() > 1 or mixed_precision.param_dtype != mixed_precision.compute_dtype:
        apply_fsdp(model, mesh.fsdp, mixed_precision)
    return model
