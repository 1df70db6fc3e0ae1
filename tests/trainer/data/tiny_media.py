"""Tiny Wan encoders (diffusers-layout, random weights) and generated media: the data tests' fixtures build them,
and the real-node test of a LatentDataset uploads them to the GCS emulator (it loads this file by path)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

TOKENIZER_WORDS = (
    "a", "an", "the", "red", "blue", "green", "cat", "dog", "bird", "runs", "sits", "flies", "on", "in", "grass", "sky",
)  # fmt: skip


def write_tiny_encoders(root: Path) -> Path:
    """A diffusers-layout root (vae/, text_encoder/, tokenizer/) with random weights sized for the tiny variant."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from diffusers import AutoencoderKLWan
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, latents_mean=[0.1] * 4, latents_std=[0.5] * 4
    )
    vae.save_pretrained(root / "vae")
    words = ["<pad>", "</s>", "<unk>", *TOKENIZER_WORDS]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(root / "tokenizer")
    config = UMT5Config(vocab_size=len(words), d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2)
    UMT5EncoderModel(config).save_pretrained(root / "text_encoder")
    return root


def write_video(path: Path, frames: int, height: int, width: int, fps: int) -> None:
    import av

    with av.open(str(path), mode="w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        yy, xx = np.mgrid[0:height, 0:width]
        for i in range(frames):
            rgb = np.stack([(xx * 3 + i * 8) % 256, (yy * 3) % 256, np.full_like(xx, 40 * (i % 6))], -1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb.astype(np.uint8), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
