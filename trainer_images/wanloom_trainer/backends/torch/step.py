"""The PyTorch step's pieces: one flow-matching loss for training and evaluation, accumulation, AdamW update.

The same math as ``backends.jax.step`` (and ``backends.objective``'s numpy reference):

    σ = t / 1000,  x_t = (1 − σ)·x0 + σ·ε,  v = ε − x0,  loss_i = mean (model(x_t, t) − v)²
    micro-batch loss = Σ_i weights_i · loss_i          (weights carry the plan's 1/globalBatch and the routing weight)

x_t and the loss are computed in fp32; the model receives x_t and the text in the compute dtype and the timesteps
in fp32 (bf16 cannot tell t = 999 from t = 1000). AdamW matches optax's ``scale_by_adam`` + decoupled weight
decay, and clipping uses the JAX step's factor ``max_norm / norm`` when ``norm > max_norm``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from wanloom_api.trainingjob import OptimizerSpec
from wanloom_trainer.backends.interface import RankRows


def flow_matching_loss(
    model: nn.Module,
    latents: torch.Tensor,
    text: torch.Tensor,
    noise: torch.Tensor,
    timesteps: torch.Tensor,
    weights: torch.Tensor,
    condition: torch.Tensor | None = None,
    clean_first_frame: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_i weights_i · loss_i, loss_i [b]) for one micro-batch.

    Args:
        model: a diffusers ``WanTransformer3DModel`` (plain, fused-AdaLN or FSDP-wrapped).
        latents, noise: [b, C, T', H', W'] fp32 clean latents x0 and noise ε.
        text: [b, L, D_text] text-encoder states.
        timesteps: [b] fp32 t in [0, 1000).
        weights: [b] fp32 loss weights.
        condition: [b, Cc, T', H', W'] image condition (I2V: mask + first-frame latents) appended to x_t's
            channels as the model input; None for text-to-video.
        clean_first_frame: [b] fp32, unified TI2V models only: 1 marks a row trained as image-to-video (frame 0
            clean at t = 0 and out of the loss); timesteps then go to the model per token. None: t per sample.
        compute_dtype: dtype of the model's inputs (its parameters' compute dtype).
    """
    x0, noise, t = latents.float(), noise.float(), timesteps.float()
    if clean_first_frame is None:
        sigma, model_t, keep = (t / 1000.0).reshape((-1,) + (1,) * (x0.ndim - 1)), t, None
    else:
        first = (torch.arange(x0.shape[2], device=x0.device) == 0).float()
        keep = 1.0 - clean_first_frame.float()[:, None] * first[None, :]
        t_frames = t[:, None] * keep  # [b, T']
        sigma = (t_frames / 1000.0)[:, None, :, None, None]
        model_t = _token_timesteps(t_frames, x0.shape, model.config.patch_size)
    x_t = (1.0 - sigma) * x0 + sigma * noise
    if condition is not None:
        x_t = torch.cat([x_t, condition.float()], dim=1)
    prediction = model(
        hidden_states=x_t.to(compute_dtype),
        timestep=model_t,
        encoder_hidden_states=text.to(compute_dtype),
        return_dict=False,
    )[0].float()
    squared = torch.square(prediction - (noise - x0))
    if keep is None:
        per_sample = torch.mean(squared, dim=tuple(range(1, x0.ndim)))
    else:
        per_frame = torch.mean(squared, dim=(1, 3, 4))
        per_sample = torch.sum(per_frame * keep, dim=1) / torch.clamp(torch.sum(keep, dim=1), min=1.0)
    return torch.sum(weights.float() * per_sample), per_sample


def _token_timesteps(t_frames: torch.Tensor, latent_shape: torch.Size, patch: tuple[int, int, int]) -> torch.Tensor:
    """[b, T'] per-frame timesteps → [b, S] per token, in diffusers' (frame, row, column) token order."""
    pt, ph, pw = patch
    per_frame_tokens = (latent_shape[3] // ph) * (latent_shape[4] // pw)
    return torch.repeat_interleave(t_frames[:, ::pt], per_frame_tokens, dim=1)


def rows_to_tensors(rows: RankRows, device: torch.device) -> dict[str, torch.Tensor]:
    """Host rows -> device tensors; an empty (dummy) micro-batch becomes one all-zero row of weight 0, so every
    rank still runs the slot's forward/backward and FSDP's collectives stay in lockstep."""
    keys = ("latents", "text", "noise", "timesteps", "weights", "condition", "clean_first_frame")
    arrays = {k: getattr(rows, k) for k in keys if getattr(rows, k) is not None}
    if rows.rows == 0:
        arrays = {k: np.zeros((1, *np.shape(a)[1:]), dtype=np.float32) for k, a in arrays.items()}
        arrays["timesteps"][:] = 500.0  # any valid t: the row's weight is 0
    return {k: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(device) for k, a in arrays.items()}


def accumulate(model: nn.Module, rows: RankRows, device: torch.device, compute_dtype: torch.dtype) -> torch.Tensor:
    """Forward + backward of one rank's rows through ``model``, adding to its ``.grad``.

    Returns:
        Σ weights·loss_i as a detached fp32 scalar on ``device`` (no host sync per micro-batch).
    """
    batch = rows_to_tensors(rows, device)
    loss_sum, _ = flow_matching_loss(model, **batch, compute_dtype=compute_dtype)
    loss_sum.backward()
    return loss_sum.detach()


def make_adamw(params: Iterable[nn.Parameter], opt: OptimizerSpec) -> torch.optim.AdamW:
    """AdamW with its moments created now (step 0, zeros) rather than on the first step.

    Eager state makes a checkpoint of a never-updated expert hold the same thing a fresh optimizer would: torch's
    ``get_optimizer_state_dict`` would otherwise "initialise" an empty state by stepping it with zero gradients,
    advancing its step count and changing the expert's next bias correction.
    """
    params = [p for p in params if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=opt.learning_rate, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay, foreach=True
    )
    for p in params:
        optimizer.state[p] = {
            "step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }
    return optimizer


def grad_norm(params: Iterable[nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of the gradients over all ranks (FSDP shards are DTensors: their norm is reduced)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def update(model: nn.Module, optimizer: torch.optim.AdamW, lr: float, clip: float | None) -> float:
    """Clip (optional), one AdamW step at ``lr``, clear the gradients; returns the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = grad_norm(params)
    if clip is not None and float(norm) > clip:
        factor = clip / float(norm)  # a Python float: DTensor gradients accept scalars, not plain tensors
        for p in params:
            p.grad.mul_(factor)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)
