"""The JAX step as pure jitted functions of (parameters, optimizer state, batch).

One flow-matching loss (``flow_matching_loss``) serves training and evaluation. A step is three kinds of calls:

- ``accumulate(params_e, grads_e, batch, max_segment_tokens)``: forward + backward of one micro-batch slot through
  expert e, adding its gradient to e's accumulator (donated). One compiled program per (rows, latent shape), or per
  packed row geometry (``max_segment_tokens`` is static: it sizes the attention kernel's grid); the two experts
  share it, since they have the same structure.
- ``update(params_e, opt_e, grads_e, lr)``: optional global-norm clipping, AdamW moments, decoupled weight decay,
  ``params -= lr · update``; donates everything it replaces. Called only for experts that received samples, so
  an idle expert's parameters and moments are not touched at all.
- ``evaluate(params_e, batch, max_segment_tokens)``: the same loss without gradients.

``batch`` is a dict of arrays (``BATCH_KEYS``): latents/noise [b, C, T', H', W'], text [b, L, D], timesteps [b]
(float32), weights [b]; for I2V-A14B a ``condition`` [b, Cc, T', H', W'] appended to x_t's channels, and for a
unified TI2V model ``clean_first_frame`` [b] (1: trained as image-to-video, its first latent frame kept clean).
A packed batch (``backends.packing.PackedRows``: rows of several samples, ``segment_ids`` among its keys) holds the
same quantities per token patch and per segment; ``packed_flow_matching_loss`` computes the identical loss.
Parameters are float32 masters whatever the compute dtype; the model casts its matmul inputs to
``compute_dtype``; the loss is computed in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from wanloom_api.trainingjob import OptimizerSpec

BATCH_KEYS = ("latents", "text", "noise", "timesteps", "weights")
Batch = dict[str, jax.Array]
FP32 = jnp.float32


def flow_matching_loss(model: nnx.Module, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """(Σ_i weights_i · loss_i, loss_i [b]) with loss_i the mean squared error to the velocity ε − x0.

    x_t = (1 − σ)·x0 + σ·ε with σ = t / 1000; the model sees t itself (float32). With ``clean_first_frame`` [b]
    in the batch (unified TI2V models) t is per latent frame, 0 on frame 0 of the marked rows, the model gets it
    per token, and those rows' loss leaves frame 0 out (``backends.objective``).
    """
    x0, noise = batch["latents"].astype(FP32), batch["noise"].astype(FP32)
    t = batch["timesteps"].astype(FP32)
    clean = batch.get("clean_first_frame")
    if clean is None:
        sigma, model_t, keep = (t / 1000.0).reshape((-1,) + (1,) * (x0.ndim - 1)), t, None
    else:
        keep = 1.0 - clean.astype(FP32)[:, None] * (jnp.arange(x0.shape[2]) == 0).astype(FP32)[None, :]
        t_frames = t[:, None] * keep  # [b, T']
        sigma = (t_frames / 1000.0)[:, None, :, None, None]
        model_t = _token_timesteps(t_frames, x0.shape, model.variant.patch_size)
    x_t = (1.0 - sigma) * x0 + sigma * noise
    if "condition" in batch:
        x_t = jnp.concatenate([x_t, batch["condition"].astype(FP32)], axis=1)
    prediction = model(x_t, model_t, batch["text"]).astype(FP32)
    squared = jnp.square(prediction - (noise - x0))
    if keep is None:
        per_sample = jnp.mean(squared, axis=tuple(range(1, x0.ndim)))
    else:
        per_frame = jnp.mean(squared, axis=(1, 3, 4))
        per_sample = jnp.sum(per_frame * keep, axis=1) / jnp.maximum(jnp.sum(keep, axis=1), 1.0)
    return jnp.sum(batch["weights"].astype(FP32) * per_sample), per_sample


def packed_flow_matching_loss(
    model: nnx.Module, batch: Batch, max_segment_tokens: int = 0
) -> tuple[jax.Array, jax.Array]:
    """``flow_matching_loss`` of packed rows: (Σ_segments weights · loss_s, loss_s [b, g]).

    Each segment's loss is the mean squared velocity error over its own tokens' patch elements (TI2V: over the
    tokens not kept clean), exactly the per-sample loss of the unpacked batch; padding has weight 0.
    """
    x0, noise = batch["latents"].astype(FP32), batch["noise"].astype(FP32)  # [b, n, Q, C]
    ids, t_seg = batch["segment_ids"], batch["timesteps"].astype(FP32)  # [b, n], [b, g]
    b, n = ids.shape
    groups = t_seg.shape[1]
    t = jnp.take_along_axis(t_seg, ids, axis=1)  # [b, n]
    clean = batch.get("clean_first_frame")
    keep = jnp.ones((b, n), FP32) if clean is None else 1.0 - clean.astype(FP32)
    t = t * keep
    sigma = (t / 1000.0)[..., None, None]
    x_t = (1.0 - sigma) * x0 + sigma * noise
    if "condition" in batch:
        x_t = jnp.concatenate([x_t, batch["condition"].astype(FP32)], axis=-1)
    prediction = model.forward_packed(
        x_t,
        batch["positions"],
        ids,
        t_seg if clean is None else t,
        batch["text"],
        per_token=clean is not None,
        max_segment_tokens=max_segment_tokens,
    ).astype(FP32)
    per_token = jnp.mean(jnp.square(prediction - (noise - x0)), axis=(2, 3)) * keep
    flat = (ids + groups * jnp.arange(b, dtype=ids.dtype)[:, None]).reshape(-1)
    sums = jax.ops.segment_sum(per_token.reshape(-1), flat, num_segments=b * groups).reshape(b, groups)
    counts = jax.ops.segment_sum(keep.reshape(-1), flat, num_segments=b * groups).reshape(b, groups)
    per_segment = sums / jnp.maximum(counts, 1.0)
    return jnp.sum(batch["weights"].astype(FP32) * per_segment), per_segment


def _token_timesteps(t_frames: jax.Array, latent_shape: tuple[int, ...], patch: tuple[int, int, int]) -> jax.Array:
    """[b, T'] per-frame timesteps → [b, S] per token, in the model's (frame, row, column) token order."""
    pt, ph, pw = patch
    per_frame_tokens = (latent_shape[3] // ph) * (latent_shape[4] // pw)
    return jnp.repeat(t_frames[:, ::pt], per_frame_tokens, axis=1)


def moment_transform(opt: OptimizerSpec) -> optax.GradientTransformation:
    """AdamW without its learning rate (applied by ``update`` so the schedule can follow the global step)."""
    return optax.chain(
        optax.scale_by_adam(b1=opt.betas[0], b2=opt.betas[1], eps=opt.eps),
        optax.add_decayed_weights(opt.weight_decay),
    )


def clip_by_global_norm(grads: Any, max_norm: float | None) -> tuple[Any, jax.Array]:
    """(clipped grads, the norm before clipping); ``max_norm`` None only measures."""
    norm = optax.tree.norm(grads)
    if max_norm is None:
        return grads, norm
    factor = jnp.where(norm > max_norm, max_norm / norm, 1.0)
    return jax.tree.map(lambda g: g * factor.astype(g.dtype), grads), norm


@dataclass(frozen=True)
class StepFns:
    """The compiled pieces of a step for one model structure (shared by both experts)."""

    zeros: Callable[[Any], Any]
    accumulate: Callable[[Any, Any, Any, Batch], tuple[Any, jax.Array]]
    update: Callable[[Any, Any, Any, jax.Array], tuple[Any, Any, jax.Array]]
    evaluate: Callable[[Any, Any, Batch], jax.Array]
    ema_update: Callable[[Any, Any, jax.Array], Any]
    ema_init: Callable[[Any], Any]
    model_of: Callable[[Any, Any], nnx.Module]  # (trained, frozen) parameters → the model (inside a jit)


def make_step_fns(
    graphdef: nnx.GraphDef,
    opt: OptimizerSpec,
    *,
    treedef: Any = None,
    frozen_treedef: Any = None,
    param_shardings: Any = None,
    opt_shardings: Any = None,
    replicated: jax.sharding.Sharding | None = None,
) -> StepFns:
    """Jit the step's pieces. ``treedef``: when given, parameters cross the jit boundary as the flat list of
    leaves of that ``nnx.State`` structure (flattening and rebuilding an ``nnx.State`` at every call costs more host
    time than a small step); None: as an ``nnx.State``. ``frozen_treedef``: the structure of the parameters that are
    not trained (LoRA's base), passed beside the trained ones and never differentiated; None: every parameter
    trains (the ``frozen`` arguments are then empty). ``param_shardings`` / ``opt_shardings``: pytrees of shardings
    mirroring the trained parameters (FSDP; gradients use theirs; frozen ones keep the shardings they arrive with)
    and the optimizer state; None lets XLA propagate."""
    tx = moment_transform(opt)

    def model_of(params: Any, frozen: Any) -> nnx.Module:
        trained = params if treedef is None else jax.tree.unflatten(treedef, params)
        if frozen_treedef is None:
            return nnx.merge(graphdef, trained)
        return nnx.merge(graphdef, trained, jax.tree.unflatten(frozen_treedef, frozen))

    def loss_of(params: Any, frozen: Any, batch: Batch, max_segment_tokens: int) -> tuple[jax.Array, jax.Array]:
        model = model_of(params, frozen)
        if "segment_ids" in batch:
            return packed_flow_matching_loss(model, batch, max_segment_tokens)
        return flow_matching_loss(model, batch)

    def accumulate(
        params: Any, frozen: Any, grads: Any, batch: Batch, max_segment_tokens: int = 0
    ) -> tuple[Any, jax.Array]:
        (loss_sum, _), g = jax.value_and_grad(loss_of, has_aux=True)(params, frozen, batch, max_segment_tokens)
        return jax.tree.map(jnp.add, grads, g), loss_sum

    def update(params: Any, opt_state: Any, grads: Any, lr: jax.Array) -> tuple[Any, Any, jax.Array]:
        grads, norm = clip_by_global_norm(grads, opt.clip_grad_norm)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), params, updates)
        return params, opt_state, norm

    def zeros(params: Any) -> Any:
        return jax.tree.map(jnp.zeros_like, params)

    def evaluate(params: Any, frozen: Any, batch: Batch, max_segment_tokens: int = 0) -> jax.Array:
        return loss_of(params, frozen, batch, max_segment_tokens)[0]

    def ema_update(ema: Any, params: Any, decay: jax.Array) -> Any:
        return jax.tree.map(lambda e, p: e + (1.0 - decay) * (p.astype(jnp.float32) - e), ema, params)

    def ema_init(params: Any) -> Any:
        return jax.tree.map(lambda p: p.astype(jnp.float32), params)

    sharded = param_shardings is not None
    return StepFns(
        zeros=jax.jit(zeros, out_shardings=param_shardings),
        accumulate=jax.jit(
            accumulate,
            donate_argnums=(2,),
            static_argnums=(4,),
            out_shardings=(param_shardings, replicated) if sharded else None,
        ),
        update=jax.jit(
            update,
            donate_argnums=(0, 1),
            out_shardings=(param_shardings, opt_shardings, replicated) if sharded else None,
        ),
        evaluate=jax.jit(evaluate, static_argnums=(3,)),
        ema_update=jax.jit(ema_update, donate_argnums=(0,), out_shardings=param_shardings),
        ema_init=jax.jit(ema_init, out_shardings=param_shardings),
        model_of=model_of,
    )


def init_optimizer(opt: OptimizerSpec, params: Any) -> Any:
    """Fresh AdamW moments (float32 like the master parameters), placed like the parameters by propagation."""
    return jax.jit(moment_transform(opt).init)(params)
