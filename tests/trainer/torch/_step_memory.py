"""Measures what one real CPU forward + backward of the tiny model adds to this process's peak memory (run as a
script; prints MiB). The check of ``wanloom compile``'s GPU estimate: the same model, AdamW state, accumulated
gradients and micro-batch, on real tensors.

Usage: MALLOC_MMAP_THRESHOLD_=65536 python _step_memory.py ROWS LATENT_T LATENT_H LATENT_W
(large tensors then come from mmap and go back to the system when freed, so the peak RSS follows live tensors).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from wanloom_api.trainingjob import OptimizerSpec
from wanloom_trainer.backends.torch.step import flow_matching_loss, make_adamw
from wanloom_trainer.config.variants import get_variant
from wanloom_trainer.model.wan_torch import build_expert


def _status(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) * 1024


def main() -> None:
    rows, latent = int(sys.argv[1]), tuple(int(v) for v in sys.argv[2:5])
    torch.set_num_threads(1)
    variant = get_variant("tiny")
    model = build_expert(variant, seed=0)
    make_adamw(model.parameters(), OptimizerSpec())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    channels = variant.latent_channels
    batch = {
        "latents": torch.randn(rows, channels, *latent),
        "noise": torch.randn(rows, channels, *latent),
        "text": torch.randn(rows, variant.text_len, variant.text_dim),
        "timesteps": torch.full((rows,), 500.0),
        "weights": torch.ones(rows),
    }
    loss, _ = flow_matching_loss(model, **{k: t[:1] for k, t in batch.items()})  # code paths and allocator warm
    loss.backward()
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
    before = _status("VmRSS")
    loss, _ = flow_matching_loss(model, **batch)
    loss.backward()
    print((_status("VmHWM") - before) / 2**20)


if __name__ == "__main__":
    main()
