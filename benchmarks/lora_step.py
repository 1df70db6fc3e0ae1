"""LoRA against full training, same model and micro-batch: step time (forward, backward, AdamW) measured side by
side on this machine, beside the FLOP model's ratio (``flops.py``: a frozen base skips its weight gradients).

The model is a mid-size Wan (diffusers ``WanTransformer3DModel``, 4 blocks of width 1,024, 8 heads, FFN 4,096;
the tiny variant's text and VAE sizes) on one latent clip (--latent, default 5 × 64 × 64: 5,120 tokens), float32 on
CPU; LoRA is ``model.lora_torch`` at rank 32 on the ten default targets, AdamW over the adapters only. Rounds
alternate full and LoRA steps and the ratio is the median of paired rounds.

    PYTHONPATH=operator:trainer_images python benchmarks/lora_step.py [--rounds 10] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from wanloom_api.trainingjob import LoraSpec, OptimizerSpec
from wanloom_trainer.backends.torch.step import flow_matching_loss, make_adamw
from wanloom_trainer.config.variants import get_variant
from wanloom_trainer.flops import flop_breakdown
from wanloom_trainer.model.lora_torch import add_lora
from wanloom_trainer.model.wan_torch import build_expert

VARIANT = dataclasses.replace(get_variant("tiny"), name="bench", dim=1024, ffn_dim=4096, num_heads=8, num_layers=4)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    start = time.perf_counter()
    loss, _ = flow_matching_loss(model, **batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--latent", default="5x64x64", help="latent T'xH'xW' of the one clip (patch 1x2x2)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    latent = tuple(int(v) for v in args.latent.split("x"))
    tokens = VARIANT.tokens(*latent)
    full = build_expert(VARIANT, seed=0)
    lora = add_lora(build_expert(VARIANT, seed=0), LoraSpec(rank=32), seed=1)
    opt = OptimizerSpec(learningRate=1e-4)
    optimizers = {"full": make_adamw(full.parameters(), opt), "lora": make_adamw(lora.parameters(), opt)}
    g = torch.Generator().manual_seed(0)
    batch = {
        "latents": torch.randn(1, VARIANT.out_channels, *latent, generator=g),
        "noise": torch.randn(1, VARIANT.out_channels, *latent, generator=g),
        "text": torch.randn(1, VARIANT.text_len, VARIANT.text_dim, generator=g),
        "timesteps": torch.tensor([500.0]),
        "weights": torch.ones(1),
    }
    models = {"full": full, "lora": lora}
    for name in models:  # warm-up
        _step(models[name], optimizers[name], batch)
    times: dict[str, list[float]] = {"full": [], "lora": []}
    for _ in range(args.rounds):
        for name in models:
            times[name].append(_step(models[name], optimizers[name], batch))
    ratios = [f / lo for f, lo in zip(times["full"], times["lora"], strict=True)]
    breakdown = flop_breakdown(VARIANT, tokens)
    result = {
        "tokens": tokens,
        "threads": torch.get_num_threads(),
        "full_step_s": statistics.median(times["full"]),
        "lora_step_s": statistics.median(times["lora"]),
        "measured_speedup": statistics.median(ratios),
        "flop_model_speedup": breakdown.train / breakdown.train_lora,
        "trained_parameters": {k: sum(p.numel() for p in m.parameters() if p.requires_grad) for k, m in models.items()},
    }
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>20}: {value}")


if __name__ == "__main__":
    main()
