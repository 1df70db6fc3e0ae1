"""`prepare`: captioned media → tiny Wan VAE / umT5 encodings → shards + index, read back exactly; resumable."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from wanloom_trainer.adaptiveload.cost.cost_model import PowerCost
from wanloom_trainer.adaptiveload.planner import PlanConfig, Planner
from wanloom_trainer.config.variants import get_variant
from wanloom_trainer.data.bucketing import parse_bucket
from wanloom_trainer.data.format import from_bfloat16_bits, to_bfloat16_bits
from wanloom_trainer.data.prefetch import PlanPrefetcher
from wanloom_trainer.data.prepare.background_write import BackgroundWrite
from wanloom_trainer.data.prepare.loading import decode_workers
from wanloom_trainer.data.prepare.pipeline import PrepareConfig, prepare
from wanloom_trainer.data.prepare.sources import read_sources
from wanloom_trainer.data.prepare.stages import STAGES, PrepareProgress, StageClock
from wanloom_trainer.data.reader import open_dataset
from wanloom_trainer.routing import Router, TimestepSampler

BUCKETS = tuple(parse_bucket(b) for b in ("1x64x64", "1x64x96", "1x96x64", "9x64x64"))


class SpyEncoders:
    """Wraps WanEncoders, records every output per caption order, and can fail after ``fail_after`` batches."""

    def __init__(self, root: Path, fail_after: int | None = None) -> None:
        from wanloom_trainer.data.prepare.encoders import WanEncoders

        self.inner = WanEncoders(root)
        self.latent_channels, self.text_dim, self.vae_stride = (
            self.inner.latent_channels,
            self.inner.text_dim,
            self.inner.vae_stride,
        )
        self.fail_after, self.batches = fail_after, 0
        self.latents: list[np.ndarray] = []
        self.texts: list[np.ndarray] = []

    def encode_pixels(self, clips: np.ndarray) -> np.ndarray:
        if self.fail_after is not None and self.batches >= self.fail_after:
            raise KeyboardInterrupt("simulated interruption")
        self.batches += 1
        out = self.inner.encode_pixels(clips)
        self.latents += list(out)
        return out

    def encode_text(self, captions: list[str], text_len: int) -> list[np.ndarray]:
        out = self.inner.encode_text(captions, text_len)
        self.texts += out
        return out


def _config(media: Path, output: str, model: Path, **kw: object) -> PrepareConfig:
    base = {"variant": "tiny", "buckets": BUCKETS, "batch_size": 2, "samples_per_shard": 2, "dtype": "float32"}
    return PrepareConfig(inputs=media, output=output, model=model, **{**base, **kw})  # type: ignore[arg-type]


def _planner(dataset: object, seed: int = 0) -> Planner:
    variant = get_variant("tiny")
    router = Router(TimestepSampler("uniform"), boundary_ratio=0.875)
    config = PlanConfig(num_ranks=2, policy="balanced", global_batch=4, memory_budget_tokens=256, seed=seed)
    return Planner(dataset.sample_shapes(), variant, config, PowerCost(a=0.0, b=1.0, p=1.5), router)  # type: ignore[attr-defined]


@pytest.mark.parametrize("where", ["path", "emulator"])
def test_round_trip_prepare_plan_load_returns_the_written_tensors(
    where: str, tmp_path: Path, media_set, tiny_model_root: Path, request: pytest.FixtureRequest
) -> None:
    output = str(tmp_path / "ds") if where == "path" else request.getfixturevalue("gcs")
    spy = SpyEncoders(tiny_model_root)
    result = prepare(_config(media_set.folder, output, tiny_model_root), progress=False, encoders=spy)

    index = result.index
    assert sorted(index.sources) == sorted(media_set.good)
    assert [s["source"] for s in result.skipped] == list(media_set.bad)
    by_source = dict(zip(index.sources, index.latent_shapes.tolist(), strict=True))
    assert by_source == {"a.png": [1, 8, 12], "b.jpg": [1, 12, 8], "sub/c.png": [1, 8, 8], "clip.mp4": [3, 8, 8]}
    # The spy saw the empty prompt first (encoded once for caption dropout, by the first worker that loads the
    # encoders, so a finalize step needs none), then samples in write order: shard by shard, batch by batch.
    empty, *texts = spy.texts
    written = dict(zip(index.keys, zip(spy.latents, texts, strict=True), strict=True))
    np.testing.assert_array_equal(empty, spy.inner.encode_text([""], get_variant("tiny").text_len)[0])

    with open_dataset(output, max_bad_samples=0) as ds:
        planner = _planner(ds)
        seen = set()
        with PlanPrefetcher(ds, (planner.plan(s) for s in range(4)), rank=0, depth=3) as pf:
            for step in pf:
                for mb in step:
                    for row, sid in enumerate(mb.batch.sample_ids):
                        latents, text = written[index.keys[sid]]
                        np.testing.assert_array_equal(mb.batch.latents[row], latents)
                        n = len(text)
                        assert mb.batch.text_lens[row] == n
                        np.testing.assert_array_equal(mb.batch.text_embeds[row, :n], text)
                        assert not mb.batch.text_embeds[row, n:].any()
                        seen.add(int(sid))
        assert seen  # rank 0 got work
        padded = ds.empty_prompt()
        assert padded.shape == (ds.text_len, ds.text_dim) and not padded[len(empty) :].any()
        np.testing.assert_array_equal(padded[: len(empty)], empty)


def test_latents_are_the_vae_posterior_mean_normalised(tmp_path: Path, media_set, tiny_model_root: Path) -> None:
    """An independent check of the encoder path: re-encode one image alone and compare with the stored latent."""
    from wanloom_trainer.data.bucketing import resize_crop
    from wanloom_trainer.data.prepare.encoders import WanEncoders
    from wanloom_trainer.data.prepare.media import load_image

    result = prepare(_config(media_set.folder, str(tmp_path / "ds"), tiny_model_root), progress=False)
    enc = WanEncoders(tiny_model_root)
    pixels = resize_crop(load_image(media_set.folder / "sub/c.png").frames, 64, 64)
    import torch

    x = torch.from_numpy(pixels.astype(np.float32) / 127.5 - 1.0).permute(3, 0, 1, 2)[None]
    with torch.no_grad():
        mu = enc.vae.encode(x).latent_dist.mean[0].numpy()
    expected = (mu - 0.1) / 0.5  # the fixture VAE's latents_mean / latents_std
    sid = result.index.sources.index("sub/c.png")
    with open_dataset(str(tmp_path / "ds"), max_bad_samples=0) as ds:
        np.testing.assert_allclose(ds.load([sid]).latents[0], expected, rtol=1e-4, atol=1e-5)


def test_bfloat16_storage_rounds_once(tmp_path: Path, media_set, tiny_model_root: Path) -> None:
    spy = SpyEncoders(tiny_model_root)
    cfg = _config(media_set.folder, str(tmp_path / "ds"), tiny_model_root, dtype="bfloat16")
    index = prepare(cfg, progress=False, encoders=spy).index
    with open_dataset(str(tmp_path / "ds"), max_bad_samples=0) as ds:
        for sid, latents in enumerate(spy.latents):
            got = ds.load([sid]).latents[0]
            np.testing.assert_array_equal(got, from_bfloat16_bits(to_bfloat16_bits(latents)))
    assert index.header.dtype == "bfloat16"


def test_interrupted_prepare_resumes_where_it_stopped(tmp_path: Path, media_set, tiny_model_root: Path) -> None:
    clean = tmp_path / "clean"
    prepare(
        _config(media_set.folder, str(clean), tiny_model_root), progress=False, encoders=SpyEncoders(tiny_model_root)
    )

    out = tmp_path / "resumed"
    cfg = _config(media_set.folder, str(out), tiny_model_root)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, progress=False, encoders=SpyEncoders(tiny_model_root, fail_after=2))
    assert not (out / "index.json").exists()
    assert (out / "shards/shard-000000.json").exists()  # shard 0 (a.png, b.jpg) was finished before the stop
    assert not list((out / "shards").glob("shard-000001*"))  # the unit being written when it stopped: nothing

    second = SpyEncoders(tiny_model_root)
    prepare(cfg, progress=False, encoders=second)
    assert second.batches == 2  # shards 1 and 2 only (broken.png + clip.mp4, then sub/c.png)
    for shard in sorted((clean / "shards").glob("*.tar")):
        assert (out / "shards" / shard.name).read_bytes() == shard.read_bytes()
    assert (out / "index.json").read_text() == (clean / "index.json").read_text()
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    shards = [f"shards/shard-{k:06d}.{ext}" for k in range(3) for ext in ("json", "tar")]
    assert names == [
        "build.json",
        "empty_prompt.npy",
        "index.json",
        *shards,
        "skipped.json",
    ]  # the layout docs/data-format.md describes

    # Resuming with other settings would mix two datasets: refused before anything is encoded.
    with pytest.raises(ValueError, match=r"build\.json records a different build.*buckets"):
        prepare(_config(media_set.folder, str(out), tiny_model_root, buckets=BUCKETS[:2]), progress=False)


def test_a_pool_of_decoding_processes_writes_the_same_bytes_and_reports_every_stage(
    tmp_path: Path, media_set, tiny_model_root: Path
) -> None:
    """Read/decode/resize on a spawned process (it loads ahead, across units): the same shards as in one process,
    every unit's sources in it, and each unit's counts."""
    inline, pooled = tmp_path / "inline", tmp_path / "pooled"
    prepare(_config(media_set.folder, str(inline), tiny_model_root), progress=False, workers=0)
    reports: list[PrepareProgress] = []
    prepare(
        _config(media_set.folder, str(pooled), tiny_model_root), progress=False, workers=1, on_progress=reports.append
    )
    for shard in sorted((inline / "shards").glob("*")):
        assert (pooled / "shards" / shard.name).read_bytes() == shard.read_bytes()
    assert (pooled / "index.json").read_text() == (inline / "index.json").read_text()

    assert [r.units for r in reports] == [1, 1, 1]
    total = PrepareProgress()
    for r in reports:
        total.add(r)
    assert total.samples == len(media_set.good)
    assert dict(total.skipped) == {"undecodable": len(media_set.bad)}
    assert set(total.seconds) == set(STAGES)
    assert all(total.seconds[stage] > 0 for stage in STAGES), total.seconds


def test_decode_workers_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANLOOM_DECODE_WORKERS", "3")
    assert decode_workers() == 3
    monkeypatch.setenv("WANLOOM_DECODE_WORKERS", "two")
    with pytest.raises(ValueError, match=r"WANLOOM_DECODE_WORKERS='two': must be a whole number"):
        decode_workers()


def test_a_failing_write_stops_the_encoder_and_is_raised() -> None:
    class BrokenWriter:
        def write_shard(self, number: int, samples: Iterator[object], skipped: object) -> int:
            next(iter(samples))
            raise OSError("disk full")

    clock = StageClock()
    with pytest.raises(OSError, match="disk full"), BackgroundWrite(BrokenWriter(), 0, [], clock) as sink:  # type: ignore[arg-type]
        for _ in range(100):  # more than the queue holds: put must not block once the writer is gone
            sink.put(object())  # type: ignore[arg-type]


def test_missing_empty_and_non_utf8_captions_are_skipped_not_fatal(tmp_path: Path) -> None:
    from PIL import Image

    for name in ("x", "y", "z", "ok"):
        Image.new("RGB", (32, 32)).save(tmp_path / f"{name}.png")
    (tmp_path / "y.txt").write_text("   ")
    (tmp_path / "z.txt").write_bytes(b"\xff\xfe caption")
    (tmp_path / "ok.txt").write_text("a caption")
    items = read_sources(tmp_path)
    assert [i.source for i in items] == ["ok.png", "x.png", "y.png", "z.png"]  # ordinals fixed by the listing
    assert items[0].problem is None and items[0].caption == "a caption"
    for item, sidecar in zip(items[1:], ("x.txt", "y.txt", "z.txt"), strict=True):
        assert item.problem is not None and item.problem.startswith("no-caption: ") and sidecar in item.problem


def test_encoders_that_do_not_fit_the_variant_are_refused(tmp_path: Path, media_set, tiny_model_root: Path) -> None:
    cfg = _config(media_set.folder, str(tmp_path / "ds"), tiny_model_root, variant="wan2.2-t2v-a14b")
    cfg = PrepareConfig(**{**cfg.__dict__, "buckets": (parse_bucket("1x480x832"),)})
    with pytest.raises(ValueError, match=r"VAE makes 4 latent channels; wan2\.2-t2v-a14b needs 16"):
        prepare(cfg, progress=False)


def test_i2v_condition_is_mask_plus_first_frame_latents(tiny_model_root: Path) -> None:
    from wanloom_trainer.data.prepare.encoders import WanEncoders

    enc = WanEncoders(tiny_model_root)
    clips = np.random.default_rng(0).integers(0, 255, (1, 9, 32, 32, 3), dtype=np.uint8)
    cond = enc.encode_condition(clips)
    assert cond.shape == (1, 4 + 4, 3, 4, 4)
    assert (cond[:, :4, 0] == 1).all() and not cond[:, :4, 1:].any()
    # The VAE is causal in time: latent frame 0 of "first frame + grey frames" is the first frame's own latent.
    alone = enc.encode_pixels(clips[:, :1])
    np.testing.assert_allclose(cond[:, 4:, :1], alone, rtol=1e-5, atol=1e-5)


def test_replicas_split_each_batch_in_order_and_encode_what_one_encoder_does(tiny_model_root: Path) -> None:
    """A pod's GPUs as replicas (two CPU ones here): a batch of 3 split 2 + 1 gives the single encoder's results,
    in order, for pixels, I2V conditions and captions."""
    from wanloom_trainer.data.prepare.encoders import EncoderReplicas, WanEncoders

    one = WanEncoders(tiny_model_root)
    two = EncoderReplicas([WanEncoders(tiny_model_root), WanEncoders(tiny_model_root)])
    assert (two.latent_channels, two.text_dim, two.vae_stride) == (one.latent_channels, one.text_dim, one.vae_stride)
    clips = np.random.default_rng(1).integers(0, 255, (3, 9, 32, 32, 3), dtype=np.uint8)
    np.testing.assert_allclose(two.encode_pixels(clips), one.encode_pixels(clips), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(two.encode_condition(clips), one.encode_condition(clips), rtol=1e-5, atol=1e-6)
    captions = ["a red cat", "the dog runs on the grass", "a bird"]
    for got, want in zip(two.encode_text(captions, 16), one.encode_text(captions, 16), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert len(two.encode_pixels(clips[:1])) == 1  # fewer samples than replicas


def test_validation_prompts_are_encoded_with_the_dataset(tmp_path: Path, media_set, tiny_model_root: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox in the snow\n\n  waves at dusk  \n")
    spy = SpyEncoders(tiny_model_root)
    output = tmp_path / "ds"
    prepare(_config(media_set.folder, str(output), tiny_model_root, prompts=prompts), progress=False, encoders=spy)
    want = spy.inner.encode_text(["a red fox in the snow", "waves at dusk"], get_variant("tiny").text_len)
    with open_dataset(str(output), max_bad_samples=0) as ds:
        texts, strings = ds.validation_prompts()
    assert strings == ["a red fox in the snow", "waves at dusk"]
    for got, encoded in zip(texts, want, strict=True):
        np.testing.assert_array_equal(got[: len(encoded)], encoded)
        assert not got[len(encoded) :].any()
    with pytest.raises(FileNotFoundError, match=r"--prompts .*missing.txt: no such file"):
        prepare(_config(media_set.folder, str(output), tiny_model_root, prompts=tmp_path / "missing.txt"))


def test_a_negative_prompt_is_encoded_with_the_dataset(tmp_path: Path, media_set, tiny_model_root: Path) -> None:
    spy = SpyEncoders(tiny_model_root)
    output = tmp_path / "ds"
    prepare(_config(media_set.folder, str(output), tiny_model_root), progress=False, encoders=spy)
    with open_dataset(str(output), max_bad_samples=0) as ds, pytest.raises(ValueError, match="--negative-prompt"):
        ds.negative_prompt()
    negative = "blurry, static, watermark"
    prepare(_config(media_set.folder, str(output), tiny_model_root, negative_prompt=negative), encoders=spy)
    (want,) = spy.inner.encode_text([negative], get_variant("tiny").text_len)
    with open_dataset(str(output), max_bad_samples=0) as ds:
        got, empty = ds.negative_prompt(), ds.empty_prompt()
    np.testing.assert_array_equal(got[: len(want)], want)
    assert not got[len(want) :].any() and not np.array_equal(got, empty)
