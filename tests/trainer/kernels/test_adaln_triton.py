"""Triton AdaLN vs the eager PyTorch chain: outputs and every gradient, on CPU in the Triton interpreter.

Error metric: ``max|got − want| / max(1, max|want|)`` for float32 x (≤ 1e-5: absolute for O(1) values, relative for
the column sums d_scale/d_shift that grow with N) and ``max|got − want| / max|want|`` for bfloat16 x (≤ 2e-2).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from wanloom_trainer.kernels import adaln_torch
from wanloom_trainer.kernels import adaln_triton as triton_mod
from wanloom_trainer.kernels.adaln_ref_torch import adaln_reference_torch
from wanloom_trainer.kernels.adaln_triton import AdaLNFunction, adaln_backward, adaln_forward, adaln_triton

DEVICE = "cpu" if triton_mod.interpreter_active() else "cuda"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

# Full grid of the issue: D x N x B x modulation x dtype. The interpreter costs ~2 ms per row, so the default run
# keeps every case with N <= 17, N = 300 rows per sample (per-sample segments that span several backward programs
# and end mid-program) and a few N = 4096 cases covering both modulations and dtypes; the rest of N = 4096 (up to a
# minute each) is marked exhaustive, deselected by default (`make test-exhaustive`).
GRID = list(itertools.product((64, 96, 3072, 5120), (1, 17, 4096), (1, 3), ("sample", "token"), ("f32", "bf16")))
EXTRA = [(96, 300, 3, "sample", "f32"), (64, 300, 3, "sample", "bf16")]
DEFAULT_4096 = [(5120, 4096, 1, "sample", "bf16"), (96, 4096, 1, "token", "f32")]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def _case_param(case: tuple) -> object:
    big = [pytest.mark.slow] if case in DEFAULT_4096 else [pytest.mark.exhaustive]  # a minute each, interpreted
    return pytest.param(*case, id="-".join(map(str, case)), marks=big if case[1] == 4096 else [])


def _close(got: torch.Tensor, want: torch.Tensor, x_dtype: torch.dtype) -> float:
    got, want = got.double(), want.double()
    floor = 1.0 if x_dtype == torch.float32 else 1e-30
    return ((got - want).abs().max() / want.abs().max().clamp(min=floor)).item()


def _inputs(b: int, n: int, d: int, mod: str, x_dtype: torch.dtype, mod_dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (b, n, d) if mod == "token" else (b, d)
    x = (2 * torch.randn(b, n, d, generator=gen) + 0.5).to(x_dtype)
    scale = (0.3 * torch.randn(shape, generator=gen)).to(mod_dtype)
    shift = torch.randn(shape, generator=gen).to(mod_dtype)
    dy = torch.randn(b, n, d, generator=gen).to(x_dtype)
    return [t.to(DEVICE) for t in (x, scale, shift, dy)]


def _run(fn, x, scale, shift, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, scale, shift)]
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize(("d", "n", "b", "mod", "dtype"), [_case_param(c) for c in GRID + EXTRA])
def test_matches_reference(d: int, n: int, b: int, mod: str, dtype: str) -> None:
    x_dtype = DTYPES[dtype]
    x, scale, shift, dy = _inputs(b, n, d, mod, x_dtype)
    got = _run(adaln_triton, x, scale, shift, dy)
    want = _run(adaln_reference_torch, x, scale, shift, dy)
    for name, g, w in zip(("y", "dx", "d_scale", "d_shift"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert _close(g, w, x_dtype) <= TOL[x_dtype], f"{name}: error {_close(g, w, x_dtype):.2e}"


@pytest.mark.parametrize(
    ("x_dtype", "scale_dtype", "shift_dtype"),
    [(torch.bfloat16, torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32, torch.bfloat16)],
)
def test_gradients_come_back_in_input_dtypes(x_dtype, scale_dtype, shift_dtype) -> None:
    x, scale, shift, dy = _inputs(3, 17, 96, "sample", x_dtype)
    scale, shift = scale.to(scale_dtype), shift.to(shift_dtype)
    got = _run(adaln_triton, x, scale, shift, dy)
    want = _run(adaln_reference_torch, x, scale, shift, dy)
    assert [t.dtype for t in got] == [x_dtype, x_dtype, scale_dtype, shift_dtype]
    for g, w in zip(got, want, strict=True):
        assert _close(g, w, x_dtype) <= 2e-2


# Packed rows: row 0 holds four segments (one of a single token), row 1 skips segment 1 (empty) and ends in padding.
SEGMENTS = [[0] * 5 + [1] * 10 + [2] + [3] * 13, [0] * 3 + [2] * 20 + [3] * 6]


def _packed(d: int, x_dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    b, n, s = len(SEGMENTS), len(SEGMENTS[0]), 4
    x = (2 * torch.randn(b, n, d, generator=gen) + 0.5).to(x_dtype)
    scale, shift = 0.3 * torch.randn(b, s, d, generator=gen), torch.randn(b, s, d, generator=gen)
    dy = torch.randn(b, n, d, generator=gen).to(x_dtype)
    ids = torch.tensor(SEGMENTS, dtype=torch.int32)
    return [t.to(DEVICE) for t in (x, scale, shift, dy, ids)]


@pytest.mark.parametrize(("d", "dtype"), [(96, "f32"), (1536, "f32"), (3072, "bf16")])
@pytest.mark.parametrize("programs", [1, 3, 58])
def test_packed_segments_match_reference(d: int, dtype: str, programs: int) -> None:
    """Per-segment modulation and per-segment d_scale/d_shift (an empty segment gets zeros) for any row split:
    1 range spans both rows, 3 split segments mid-way, 58 = one row each."""
    x_dtype = DTYPES[dtype]
    x, scale, shift, dy, ids = _packed(d, x_dtype)
    want = _run(lambda *a: adaln_reference_torch(*a, segment_ids=ids), x, scale, shift, dy)
    y, mean, rstd = adaln_forward(x, scale, shift, segment_ids=ids)
    got = [y, *adaln_backward(dy, x, scale, mean, rstd, num_programs=programs, segment_ids=ids)]
    for name, g, w in zip(("y", "dx", "d_scale", "d_shift"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert _close(g, w, x_dtype) <= TOL[x_dtype], f"{name}: error {_close(g, w, x_dtype):.2e}"
    assert torch.count_nonzero(got[2][1, 1]) == 0 and torch.count_nonzero(got[3][1, 1]) == 0  # the empty segment


def test_one_segment_per_row_equals_per_sample_modulation() -> None:
    x, scale, shift, dy = _inputs(3, 17, 96, "sample", torch.float32)
    ids = torch.zeros(3, 17, dtype=torch.int32, device=DEVICE)
    packed = _run(lambda x, s, h: adaln_triton(x, s[:, None], h[:, None], 1e-6, ids), x, scale, shift, dy)
    plain = _run(adaln_triton, x, scale, shift, dy)
    for a, b in zip(packed, plain, strict=True):
        torch.testing.assert_close(a.reshape(b.shape), b, rtol=0, atol=1e-6)


def test_segment_ids_with_wrong_shape_or_dtype_raise() -> None:
    x, scale, shift, _, ids = _packed(64, torch.float32)
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[B, N\] = \[2, 29\]"):
        adaln_triton(x, scale, shift, 1e-6, ids[:, :5])
    with pytest.raises(ValueError, match="segment_ids must be int32 or int64, got float32"):
        adaln_triton(x, scale, shift, 1e-6, ids.float())
    with pytest.raises(ValueError, match=r"per segment \[2, S, 64\]"):
        adaln_triton(x, scale[:, 0], shift[:, 0], 1e-6, ids)


@pytest.mark.parametrize("programs", [1, 2, 5, 16, 51])
def test_segmented_reduction_for_any_grid(programs: int) -> None:
    """1 program spans all samples; 51 = one row each; 2 and 5 split samples mid-sequence."""
    x, scale, shift, dy = _inputs(3, 17, 96, "sample", torch.float32)
    y, mean, rstd = adaln_forward(x, scale, shift)
    dx, d_scale, d_shift = adaln_backward(dy, x, scale, mean, rstd, num_programs=programs)
    want = _run(adaln_reference_torch, x, scale, shift, dy)
    for g, w in zip((y, dx, d_scale, d_shift), want, strict=True):
        assert _close(g, w, torch.float32) <= 1e-5


def test_backward_is_deterministic() -> None:
    x, scale, shift, dy = _inputs(3, 17, 3072, "sample", torch.float32)
    first = _run(adaln_triton, x, scale, shift, dy)
    second = _run(adaln_triton, x, scale, shift, dy)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("mod", ["sample", "token"])
def test_strided_modulation_views(mod: str) -> None:
    """The Wan model passes chunks of its modulation table: [B, 1, D] views of [B, 2, D] (output norm, per sample)
    and [B, N, D] views of [B, N, 6, D] (TI2V, per token); neither is contiguous."""
    x, _, _, dy = _inputs(2, 17, 96, mod, torch.float32)
    table = torch.randn((2, 17, 6, 96) if mod == "token" else (2, 2, 96)).to(DEVICE)
    shift, scale = (table[:, :, 0], table[:, :, 1]) if mod == "token" else table.chunk(2, dim=1)
    assert not scale.is_contiguous()
    got = _run(adaln_triton, x, scale, shift, dy)
    want = _run(adaln_reference_torch, x, scale, shift, dy)
    assert got[2].shape == scale.shape
    assert all(_close(g, w, torch.float32) <= 1e-5 for g, w in zip(got, want, strict=True))


def test_saves_only_x_mean_rstd_scale() -> None:
    x, scale, shift, _ = _inputs(3, 17, 96, "sample", torch.bfloat16)
    saved: list[torch.Tensor] = []
    leaves = [t.requires_grad_() for t in (x, scale, shift)]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        AdaLNFunction.apply(*leaves, 1e-6)
    assert [tuple(t.shape) for t in saved] == [(3, 17, 96), (3, 17), (3, 17), (3, 96)]
    assert saved[0] is x and saved[3] is scale and {saved[1].dtype, saved[2].dtype} == {torch.float32}


@pytest.mark.parametrize(
    ("x_shape", "mod_shape", "match"),
    [
        ((17, 96), (1, 96), r"x must have shape \[B, N, D\].*\[17, 96\]"),
        ((3, 17, 96), (2, 96), r"scale/shift shape \[2, 96\] does not fit x \[3, 17, 96\]"),
        ((3, 17, 96), (3, 16, 96), r"per token \[3, 17, 96\]"),
    ],
)
def test_bad_shapes_raise_naming_shapes(x_shape, mod_shape, match) -> None:
    with pytest.raises(ValueError, match=match):
        adaln_triton(
            torch.zeros(x_shape, device=DEVICE),
            torch.zeros(mod_shape, device=DEVICE),
            torch.zeros(mod_shape, device=DEVICE),
        )


def test_bad_dtypes_and_mismatched_shift_raise() -> None:
    x, scale, shift, _ = _inputs(1, 4, 64, "sample", torch.bfloat16)
    with pytest.raises(ValueError, match="scale dtype float16 is not supported with x in bfloat16"):
        adaln_triton(x, scale.half(), shift)
    with pytest.raises(ValueError, match="x dtype float64 is not supported"):
        adaln_triton(x.double(), scale, shift)
    with pytest.raises(ValueError, match=r"same shape, got \[1, 64\] and \[1, 1, 64\]"):
        adaln_triton(x, scale, shift[:, None])


def test_cpu_without_interpreter_raises_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_mod, "interpreter_active", lambda: False)
    x, scale, shift, _ = (t.cpu() for t in _inputs(1, 4, 64, "sample", torch.float32))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        adaln_torch(x, scale, shift, impl="fused")


def test_dispatch_selects_implementation() -> None:
    x, scale, shift, dy = _inputs(3, 17, 96, "token", torch.float32)
    fused = _run(lambda *a: adaln_torch(*a, impl="fused"), x, scale, shift, dy)
    ref = _run(lambda *a: adaln_torch(*a, impl="reference"), x, scale, shift, dy)
    direct = _run(adaln_triton, x, scale, shift, dy)
    assert all(torch.equal(a, b) for a, b in zip(fused, direct, strict=True))
    assert all(_close(a, b, torch.float32) <= 1e-5 for a, b in zip(fused, ref, strict=True))
    with pytest.raises(ValueError, match="unknown impl 'triton'; valid: fused, reference"):
        adaln_torch(x, scale, shift, impl="triton")
