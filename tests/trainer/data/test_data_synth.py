"""Synthetic datasets: shapes from the mixture, deterministic, learnable, and generated for the local run."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from wanloom_api.trainingjob import DataSpec, TrainingJob
from wanloom_trainer.config.variants import get_variant
from wanloom_trainer.data.reader import open_dataset
from wanloom_trainer.data.synthetic import (
    DEFAULT_MIXTURES,
    ShapeMix,
    ensure_synthetic,
    parse_mixture,
    validate_mixture,
    write_synthetic,
)

TINY = get_variant("tiny")
ROOT = Path(__file__).resolve().parents[3]


def test_shapes_follow_the_mixture(tmp_path: Path) -> None:
    mixture = parse_mixture("1x64x64:3, 9x32x48:1")
    index = write_synthetic(str(tmp_path), TINY, 400, seed=0, mixture=mixture, samples_per_shard=100)
    counts = Counter(map(tuple, index.latent_shapes.tolist()))
    assert set(counts) == {(1, 8, 8), (3, 4, 6)}
    assert 0.68 < counts[(1, 8, 8)] / 400 < 0.82  # 3:1 weights; binomial sd ≈ 0.02
    assert (index.pixels[index.latent_shapes[:, 0] == 3] == [9, 32, 48]).all()
    assert index.header.build == {"samples": 400, "seed": 0, "mixture": ["1x64x64:3", "9x32x48:1"]}


def test_same_seed_same_bytes_other_seed_other_data(tmp_path: Path) -> None:
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        write_synthetic(str(tmp_path / name), TINY, 10, seed=seed, samples_per_shard=4)
    shard = "shards/shard-000001.tar"
    assert (tmp_path / "a" / shard).read_bytes() == (tmp_path / "b" / shard).read_bytes()
    assert (tmp_path / "a" / shard).read_bytes() != (tmp_path / "c" / shard).read_bytes()


@pytest.mark.parametrize("variant", ["wan2.2-t2v-a14b", "wan2.2-i2v-a14b", "wan2.2-ti2v-5b", "tiny"])
def test_default_mixtures_fit_their_variant(variant: str) -> None:
    validate_mixture(DEFAULT_MIXTURES[variant], get_variant(variant))


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (ShapeMix(8, 64, 64), "frames must be 1 or 1 \\+ a multiple of 4"),
        (ShapeMix(1, 72, 64), "multiples of 16 and 16"),
        (ShapeMix(1, 64, 64, 0.0), "weight must be > 0"),
    ],
    ids=["frames", "size", "weight"],
)
def test_bad_mixture_entries_are_named(entry: ShapeMix, match: str) -> None:
    with pytest.raises(ValueError, match=f"mixture entry {entry.frames}x{entry.height}x{entry.width}.*{match}"):
        validate_mixture((entry,), TINY)


def test_unparseable_mixture() -> None:
    with pytest.raises(ValueError, match="is not FRAMESxHEIGHTxWIDTH"):
        parse_mixture("1x64:2")


def test_the_caption_determines_the_pattern(tmp_path: Path) -> None:
    """Learnable structure: samples that share a caption share their latents up to the small noise."""
    mixture = (ShapeMix(9, 64, 64),)
    index = write_synthetic(str(tmp_path), TINY, 40, seed=0, mixture=mixture)
    with open_dataset(str(tmp_path), max_bad_samples=0) as ds:
        batch = ds.load(range(40))
    proto = np.array([int(s.rsplit("prototype", 1)[1]) for s in index.sources])
    x = batch.latents.reshape(40, -1)
    same = [(i, j) for i in range(40) for j in range(i) if proto[i] == proto[j]]
    other = [(i, j) for i in range(40) for j in range(i) if proto[i] != proto[j]]
    gap = lambda pairs: np.mean([np.mean((x[i] - x[j]) ** 2) for i, j in pairs])
    assert gap(same) < 0.01 < 1.0 < gap(other)
    t = batch.text_embeds.reshape(40, -1)
    assert all(np.abs(t[i] - t[j]).max() < 0.5 for i, j in same)  # same caption embedding (plus noise)
    assert abs(x.std() - 1.0) < 0.4


def test_tiny_model_learns_the_synthetic_data(tmp_path: Path) -> None:
    """The local run's promise: the tiny Wan transformer drives the flow-matching loss below half its start."""
    import torch
    from diffusers import WanTransformer3DModel

    write_synthetic(str(tmp_path), TINY, 32, seed=0)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic and fast for a model this small
    try:
        cfg = {**TINY.diffusers_config(), "patch_size": tuple(TINY.patch_size)}
        model = WanTransformer3DModel(**cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = _train(model, opt, str(tmp_path), steps=150)
    finally:
        torch.set_num_threads(threads)
    assert np.mean(losses[-30:]) < 0.5 * np.mean(losses[:10])


def _train(model, opt, uri: str, steps: int) -> list[float]:  # type: ignore[no-untyped-def]
    import torch

    rng = np.random.default_rng(0)
    losses = []
    with open_dataset(uri, max_bad_samples=0) as ds:
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(map(tuple, ds.latent_shapes.tolist())):
            groups.setdefault(s, []).append(i)
        keys = sorted(groups)
        for _ in range(steps):
            ids = groups[keys[rng.integers(len(keys))]]
            batch = ds.load(rng.choice(ids, size=min(8, len(ids)), replace=False))
            x0, text = torch.from_numpy(batch.latents), torch.from_numpy(batch.text_embeds)
            sigma = torch.rand(len(x0)).view(-1, 1, 1, 1, 1)
            noise = torch.randn_like(x0)
            x_t = (1 - sigma) * x0 + sigma * noise
            pred = model(hidden_states=x_t, timestep=sigma.flatten() * 1000, encoder_hidden_states=text).sample
            loss = ((pred - (noise - x0)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def _tiny_local_data() -> DataSpec:
    doc = yaml.safe_load((ROOT / "jobs" / "tiny-local.yaml").read_text())
    return TrainingJob.model_validate(doc).spec.data


def test_ensure_synthetic_builds_the_local_run_dataset_once(tmp_path: Path) -> None:
    data = _tiny_local_data().model_copy(update={"uri": str(tmp_path / "data")})
    where = ensure_synthetic(data, TINY)
    assert where == f"{tmp_path}/data/index.json"
    with open_dataset(data.uri, max_bad_samples=0) as ds:
        assert ds.num_samples == data.synthetic.samples
        assert len(np.unique(ds.latent_shapes, axis=0)) >= 3  # images and clips at several sizes
    stamp = (tmp_path / "data/index.json").stat().st_mtime_ns
    assert ensure_synthetic(data, TINY) == where
    assert (tmp_path / "data/index.json").stat().st_mtime_ns == stamp  # existing data is reused, not rewritten


def test_ensure_synthetic_refuses_mismatches(tmp_path: Path) -> None:
    data = _tiny_local_data().model_copy(update={"uri": str(tmp_path / "data")})
    ensure_synthetic(data, TINY)
    other = data.model_copy(update={"synthetic": data.synthetic.model_copy(update={"seed": 9})})
    with pytest.raises(ValueError, match=r"synthetic dataset with \{'samples': 32, 'seed': 0\}.*'seed': 9"):
        ensure_synthetic(other, TINY)
    with pytest.raises(ValueError, match=r"built for tiny, not wan2\.2-t2v-a14b: latent_channels 4 \(model needs 16\)"):
        ensure_synthetic(data, get_variant("wan2.2-t2v-a14b"))
    missing = data.model_copy(update={"uri": str(tmp_path / "none"), "synthetic": None})
    with pytest.raises(FileNotFoundError, match=r"no dataset at .*none/index\.json"):
        ensure_synthetic(missing, TINY)
