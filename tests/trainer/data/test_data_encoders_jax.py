"""`wanloom data prepare --encoders jax` against the PyTorch encoders on the same media (images, a clip, the I2V
condition): the same samples, shapes and tensors within float error; with PyTorch not importable at all, "auto"
picks JAX and prepares the dataset (the TPU image's case)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wanloom_trainer.data.bucketing import parse_bucket
from wanloom_trainer.data.prepare.pipeline import PrepareConfig, prepare
from wanloom_trainer.data.reader import open_dataset

BUCKETS = tuple(parse_bucket(b) for b in ("1x64x64", "1x64x96", "1x96x64", "9x64x64"))
ROOT = Path(__file__).resolve().parents[3]


def _config(media: Path, output: Path, model: Path, encoders: str) -> PrepareConfig:
    return PrepareConfig(inputs=media, output=str(output), model=model, variant="tiny", buckets=BUCKETS,
                         batch_size=2, samples_per_shard=3, dtype="float32", encoders=encoders)  # fmt: skip


def test_jax_encoders_write_the_dataset_the_torch_encoders_write(tmp_path: Path, media_set, tiny_model_root: Path):
    torch_ds = prepare(_config(media_set.folder, tmp_path / "torch", tiny_model_root, "torch"), progress=False).index
    jax_ds = prepare(_config(media_set.folder, tmp_path / "jax", tiny_model_root, "jax"), progress=False).index
    assert list(jax_ds.sources) == list(torch_ds.sources)
    np.testing.assert_array_equal(jax_ds.latent_shapes, torch_ds.latent_shapes)
    np.testing.assert_array_equal(jax_ds.text_tokens, torch_ds.text_tokens)
    with (
        open_dataset(str(tmp_path / "jax"), max_bad_samples=0) as a,
        open_dataset(str(tmp_path / "torch"), max_bad_samples=0) as b,
    ):
        for i, shape in enumerate(torch_ds.latent_shapes.tolist()):
            x, y = a.load([i], tuple(shape)), b.load([i], tuple(shape))
            np.testing.assert_allclose(x.latents, y.latents, rtol=1e-4, atol=1e-4 * np.abs(y.latents).max())
            np.testing.assert_allclose(x.text_embeds, y.text_embeds, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(a.empty_prompt(), b.empty_prompt(), rtol=1e-4, atol=1e-5)


def test_the_i2v_condition_matches(tiny_model_root: Path) -> None:
    from wanloom_trainer.data.prepare.encoders import WanEncoders
    from wanloom_trainer.data.prepare.encoders_jax import JaxEncoders

    clips = np.random.default_rng(0).integers(0, 255, (2, 9, 48, 80, 3), dtype=np.uint8)
    want = WanEncoders(tiny_model_root).encode_condition(clips)
    got = JaxEncoders(tiny_model_root).encode_condition(clips)
    assert got.shape == want.shape and (got[:, :4, 0] == 1).all() and not got[:, :4, 1:].any()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_a_batch_split_over_two_devices_encodes_as_on_one(tiny_model_root: Path, tmp_path: Path) -> None:
    """A TPU host's chips, as two CPU devices: the weights replicated, the batch split, the same numbers."""
    code = f"""
import sys, numpy as np
from wanloom_trainer.data.prepare.encoders_jax import JaxEncoders
enc = JaxEncoders({str(tiny_model_root)!r})
assert enc._mesh is not None and enc._mesh.size == 2
clips = np.random.default_rng(0).integers(0, 255, (2, 5, 32, 48, 3), dtype=np.uint8)
np.save(sys.argv[1], enc.encode_pixels(clips))
np.save(sys.argv[2], np.stack(enc.encode_text(["a red cat", "the dog runs"], 16)[:1]))
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = [tmp_path / "latents.npy", tmp_path / "text.npy"]
    proc = subprocess.run([sys.executable, "-c", code, *map(str, out)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    from wanloom_trainer.data.prepare.encoders_jax import JaxEncoders

    one = JaxEncoders(tiny_model_root)
    clips = np.random.default_rng(0).integers(0, 255, (2, 5, 32, 48, 3), dtype=np.uint8)
    np.testing.assert_allclose(np.load(out[0]), one.encode_pixels(clips), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.load(out[1])[0], one.encode_text(["a red cat"], 16)[0], rtol=1e-5, atol=1e-6)


def test_the_tokenizer_adds_the_end_token_and_truncates_like_transformers(tiny_model_root: Path) -> None:
    from transformers import AutoTokenizer

    from wanloom_trainer.model.encoders.umt5_jax import Tokenizer

    texts = ["a red cat sits on the grass", "", "the dog runs in the sky " * 4]
    ids, mask = Tokenizer(tiny_model_root / "tokenizer")(texts, max_length=8)
    want = AutoTokenizer.from_pretrained(tiny_model_root / "tokenizer")(
        texts, padding="max_length", max_length=8, truncation=True, return_tensors="np"
    )
    width = ids.shape[1]
    np.testing.assert_array_equal(mask, want.attention_mask[:, :width])
    np.testing.assert_array_equal(ids * mask, (want.input_ids * want.attention_mask)[:, :width])


def test_without_pytorch_auto_prepares_with_jax(tmp_path: Path, media_set, tiny_model_root: Path) -> None:
    # torch, diffusers and transformers made unimportable, as in the TPU image.
    code = (
        "import sys; sys.modules.update(torch=None, diffusers=None, transformers=None); "
        "from wanloom_cli import main; sys.argv = ['wanloom', *sys.argv[1:]]; main()"
    )
    out = tmp_path / "ds"
    args = ["data", "prepare", str(media_set.folder), str(out), "--model", str(tiny_model_root), "--variant", "tiny",
            "--dtype", "float32", "--no-progress", *(a for b in BUCKETS for a in ("--bucket", str(b)))]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote {len(media_set.good)} samples" in proc.stdout
    assert json.loads((out / "index.json").read_text())["num_samples"] == len(media_set.good)
    with pytest.raises(ValueError, match="encoders 'onnx' is not one of auto, jax, torch"):
        _config(media_set.folder, out, tiny_model_root, "onnx")


def test_a_batch_the_device_cannot_hold_is_encoded_in_the_largest_calls_that_fit(tiny_model_root: Path) -> None:
    """The per-call batch comes from the compiled VAE's own memory figure: with a device between what 2 and 4 clips
    need, 4 clips are encoded 2 at a time, to the same latents; a device too small for one clip is named."""
    from wanloom_trainer.data.prepare.encoders_jax import MEMORY_SHARE, JaxEncoders, program_bytes

    clips = np.random.default_rng(0).integers(0, 255, (4, 9, 48, 80, 3), dtype=np.uint8)
    whole = JaxEncoders(tiny_model_root)
    want = whole.encode_pixels(clips)
    pixels = {b: np.zeros((b, 9, 48, 80, 3), np.float32) for b in (1, 2, 4)}
    need = {b: program_bytes(whole._program(whole._encode_vae, whole.vae, [x])) for b, x in pixels.items()}
    assert need[1] < need[2] < need[4]

    limited = JaxEncoders(tiny_model_root, memory_bytes=int((need[2] + need[4]) / 2 / MEMORY_SHARE))
    got = limited.encode_pixels(clips)
    assert limited._per_call[("VAE", (4, 9, 48, 80, 3))] == 2
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())

    tiny = JaxEncoders(tiny_model_root, memory_bytes=int(need[1] / 2 / MEMORY_SHARE))
    with pytest.raises(ValueError, match=r"cannot encode a 9x48x80 clip: one item needs .* GiB"):
        tiny.encode_pixels(clips)


def test_captions_the_device_cannot_hold_at_once_are_encoded_in_smaller_calls(tiny_model_root: Path) -> None:
    from wanloom_trainer.data.prepare.encoders import clean_caption
    from wanloom_trainer.data.prepare.encoders_jax import MEMORY_SHARE, JaxEncoders, program_bytes

    captions = ["a cat", "a dog on a red boat at dawn", "rain", "two birds"]
    whole = JaxEncoders(tiny_model_root)
    want = whole.encode_text(captions, 32)
    ids, mask = whole.tokenizer([clean_caption(c) for c in captions], 32)
    need = {b: program_bytes(whole._program(whole._encode_text, whole.text, [ids[:b], mask[:b]])) for b in (2, 4)}
    limited = JaxEncoders(tiny_model_root, memory_bytes=int((need[2] + need[4]) / 2 / MEMORY_SHARE))
    got = limited.encode_text(captions, 32)
    assert [k for k, v in limited._per_call.items() if k[0] == "text encoder" and v == 2]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
