"""Sample encoding, tar shards with recorded byte ranges, and the index file."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from wanloom_trainer.data.format import (
    MEMBERS,
    CorruptSample,
    EncodedSample,
    SampleMeta,
    decode_tensor,
    encode_sample,
    encode_tensor,
    from_bfloat16_bits,
    to_bfloat16_bits,
)
from wanloom_trainer.data.index import DatasetHeader, ShapeIndex
from wanloom_trainer.data.prepare.writer import build_index
from wanloom_trainer.data.shards import ShardWriter, payload_crc, stream_shard


def _sample(
    key: str, shape: tuple[int, int, int] = (2, 3, 5), text_tokens: int = 3, cond: bool = False
) -> EncodedSample:
    rng = np.random.default_rng(abs(hash(key)) % 2**32)
    latents = rng.standard_normal((4, *shape), dtype=np.float32)
    return EncodedSample(
        key=key,
        latents=latents,
        text=rng.standard_normal((text_tokens, 8), dtype=np.float32),
        condition=rng.standard_normal((6, *shape), dtype=np.float32) if cond else None,
        source=f"src/{key}.mp4",
        frames=5,
        height=24,
        width=40,
        fps=16.0,
        caption="a caption",
    )


@pytest.mark.parametrize(
    ("value", "bits"),
    [
        (1.0, 0x3F80),
        (-2.0, 0xC000),
        (1.0 + 2**-8, 0x3F80),  # exactly halfway, rounds to even (down)
        (1.0 + 3 * 2**-8, 0x3F82),  # halfway, rounds to even (up)
        (1.0 + 2**-7 + 2**-9, 0x3F81),  # below halfway above 0x3F81: stays
        (np.inf, 0x7F80),
    ],
    ids=["one", "minus-two", "tie-down", "tie-up", "near", "inf"],
)
def test_bfloat16_rounds_to_nearest_even(value: float, bits: int) -> None:
    assert int(to_bfloat16_bits(np.array([value], dtype=np.float32))[0]) == bits


def test_bfloat16_nan_stays_nan_and_widening_is_exact() -> None:
    x = np.array([np.nan, 3.140625, -0.0], dtype=np.float32)  # 3.140625 is exactly representable in bf16
    back = from_bfloat16_bits(to_bfloat16_bits(x))
    assert np.isnan(back[0]) and back[1] == np.float32(3.140625) and np.signbit(back[2])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_tensor_round_trip(dtype: str) -> None:
    x = np.random.default_rng(0).standard_normal((3, 1, 7, 9)).astype(np.float32)
    got = decode_tensor(encode_tensor(x, dtype), dtype)
    assert got.dtype == np.float32 and got.shape == x.shape
    tol = {"float32": 0.0, "float16": 1e-3, "bfloat16": 1e-2}[dtype]
    np.testing.assert_allclose(got, x, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "data",
    [b"", b"\x93NUMPY\x01\x00garbage", encode_tensor(np.ones((4, 4), np.float32), "float32")[:-7]],
    ids=["empty", "bad-header", "truncated"],
)
def test_bad_npy_is_a_corrupt_sample(data: bytes) -> None:
    with pytest.raises(CorruptSample):
        decode_tensor(data, "float32")


def test_bad_keys_and_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="key"):
        encode_sample(_sample("a.b"), "float32")
    bad = _sample("k")
    with pytest.raises(ValueError, match="condition shape"):
        encode_sample(EncodedSample(**{**bad.__dict__, "condition": np.zeros((6, 1, 1, 1), np.float32)}), "float32")


def test_shard_ranges_point_at_the_member_payloads(tmp_path: Path) -> None:
    samples = [_sample("s0"), _sample("s1", (1, 4, 4), cond=True), _sample("s2", text_tokens=1)]
    encoded = [encode_sample(s, "float32") for s in samples]
    with ShardWriter(tmp_path / "x.tar") as tar:
        locs = [tar.add(s.key, m) for s, m in zip(samples, encoded, strict=True)]
    blob = (tmp_path / "x.tar").read_bytes()
    for members, loc in zip(encoded, locs, strict=True):
        start, length = loc.span
        span = blob[start : start + length]
        for name, (off, size) in zip(MEMBERS, loc.members, strict=True):
            if name in members:
                assert span[off : off + size] == members[name]
            else:
                assert (off, size) == (-1, 0)
        assert loc.crc32 == payload_crc([members[n] for n in MEMBERS if n in members])
    meta = SampleMeta.from_bytes(encoded[1]["json"])
    assert meta.latent_shape == (1, 4, 4) and meta.text_tokens == 3 and meta.dtypes["condition"] == "float32"


def test_shards_are_plain_webdataset_tars(tmp_path: Path) -> None:
    import webdataset as wds

    samples = [_sample(f"k{i}") for i in range(3)]
    with ShardWriter(tmp_path / "x.tar") as tar:
        for s in samples:
            tar.add(s.key, encode_sample(s, "float32"))
    got = list(wds.WebDataset(str(tmp_path / "x.tar"), shardshuffle=False))
    assert [g["__key__"] for g in got] == ["k0", "k1", "k2"]
    np.testing.assert_array_equal(np.load(io.BytesIO(got[2]["latents.npy"])), samples[2].latents)
    streamed = list(stream_shard(io.BytesIO((tmp_path / "x.tar").read_bytes())))
    assert [k for k, _ in streamed] == ["k0", "k1", "k2"] and set(streamed[0][1]) == {"latents.npy", "text.npy", "json"}


def test_same_samples_give_the_same_bytes(tmp_path: Path) -> None:
    for name in ("a.tar", "b.tar"):
        with ShardWriter(tmp_path / name) as tar:
            tar.add("k", encode_sample(_sample("k"), "bfloat16"))
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()


def _header() -> DatasetHeader:
    return DatasetHeader("tiny", 4, 0, 8, 16, "float32", "synthetic", {"samples": 3})


def _manifest(shard: str, keys: list[str], shapes: list[list[int]]) -> dict:
    rows = [
        {
            "key": k,
            "source": f"src/{k}",
            "position": i,
            "latent_shape": s,
            "text_tokens": 3,
            "pixels": [1, 8, 8],
            "fps": 0.0,
            "span": [512 * i, 100],
            "member_ranges": [[0, 10], [522, 20], [-1, 0], [1054, 5]],
            "crc32": 7,
        }
        for i, (k, s) in enumerate(zip(keys, shapes, strict=True))
    ]
    return {"shard": shard, "samples": rows, "skipped": []}


def test_index_round_trips_through_json_and_feeds_the_planner() -> None:
    manifests = [
        _manifest("shards/a.tar", ["x", "y"], [[1, 8, 8], [3, 8, 8]]),
        _manifest("shards/b.tar", ["z"], [[1, 4, 6]]),
    ]
    index = build_index(_header(), manifests)
    back = ShapeIndex.from_json(index.to_json())
    assert back.keys == ("x", "y", "z") and back.shards == ("shards/a.tar", "shards/b.tar")
    np.testing.assert_array_equal(back.shard, [0, 0, 1])
    np.testing.assert_array_equal(back.member_ranges, index.member_ranges)
    shapes = back.sample_shapes()
    np.testing.assert_array_equal(shapes.ids, [0, 1, 2])
    np.testing.assert_array_equal(shapes.latent_shapes, [[1, 8, 8], [3, 8, 8], [1, 4, 6]])
    assert back.header == _header() and not back.has_member(0, "condition.npy") and back.has_member(0, "text.npy")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{", "not valid JSON"),
        ('{"format": "other"}', "not a wanloom-latents index"),
        ('{"format": "wanloom-latents", "version": 99}', "version 99"),
    ],
    ids=["json", "format", "version"],
)
def test_bad_index_files_name_the_problem(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=f"my/index.json: .*{match}"):
        ShapeIndex.from_json(text, where="my/index.json")


def test_a_corrupt_index_column_is_named_with_what_it_should_hold() -> None:
    import json

    index = build_index(_header(), [_manifest("shards/a.tar", ["x", "y"], [[1, 8, 8], [3, 8, 8]])])
    doc = json.loads(index.to_json())
    good = json.loads(index.to_json())
    doc["samples"]["latent_shape"] = [1, 8, 8, 3, 8]
    with pytest.raises(ValueError, match=r"^my/index.json: samples.latent_shape must hold 6 numbers \(3 per sample, "
                       r"for the 2 samples of samples.key\); it holds 5$"):  # fmt: skip
        ShapeIndex.from_json(json.dumps(doc), where="my/index.json")
    del good["samples"]["crc32"]
    with pytest.raises(ValueError, match=r"my/index\.json: field 'crc32' is missing"):
        ShapeIndex.from_json(json.dumps(good), where="my/index.json")


def test_duplicate_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="keys repeat"):
        build_index(_header(), [_manifest("a", ["x"], [[1, 1, 1]]), _manifest("b", ["x"], [[1, 1, 1]])])


def test_decoding_does_not_parse_python_literals(monkeypatch) -> None:
    """The loader decodes in threads; numpy's .npy header parser uses ast.literal_eval, which CPython 3.11 can fail
    with a spurious "AST constructor recursion depth mismatch" under threads (python/cpython#106905; it failed a
    training run here). Headers are matched without it, for every .npy version and both orders."""
    import ast

    def refuse(*_args, **_kwargs):
        raise AssertionError("ast.literal_eval called while decoding")

    monkeypatch.setattr(ast, "literal_eval", refuse)
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    np.testing.assert_array_equal(decode_tensor(encode_tensor(x, "float32"), "float32"), x)
    for version in ((1, 0), (2, 0), (3, 0)):
        for array in (x, np.asfortranarray(x)):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, array, version=version)
            np.testing.assert_array_equal(decode_tensor(buf.getvalue(), "float32"), x)
    with pytest.raises(CorruptSample, match=r"bad \.npy member: unexpected header"):
        decode_tensor(encode_tensor(x, "float32").replace(b"'descr'", b"'descX'"), "float32")
