"""model.wan_torch: building/loading the diffusers experts and the fused-AdaLN patch (patched == unpatched)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanTransformerBlock

from wanloom_trainer.model.wan_torch import (
    FusedAdaLNWanTransformer3DModel,
    FusedAdaLNWanTransformerBlock,
    apply_adaln_impl,
    build_expert,
    build_experts,
    expert_names,
    load_expert,
    use_fused_adaln,
)

FWD_TOL, GRAD_TOL = 2e-5, 1e-4


def _inputs(variant, per_token: bool, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, variant.in_channels, 3, 6, 10, generator=g)  # 3 x 3 x 5 token grid, not powers of two
    text = torch.randn(2, 7, variant.text_dim, generator=g)
    t = torch.rand(2, 45, generator=g) * 1000 if per_token else torch.tensor([999.0, 37.25])
    return x, t, text


def _perturbed(variant, seed: int):
    """An expert with every parameter moved off its init, so a mis-wired modulation shows."""
    model = build_expert(variant, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample-t", "per-token-t"])
def test_fused_adaln_matches_diffusers_forward_and_every_gradient(tiny, per_token: bool) -> None:
    reference = _perturbed(tiny, seed=1)
    fused = _perturbed(tiny, seed=1)
    use_fused_adaln(fused)
    x, t, text = _inputs(tiny, per_token)
    want = reference(x, t, text, return_dict=False)[0]
    got = fused(x, t, text, return_dict=False)[0]
    assert _relative(got, want) < FWD_TOL
    weight = torch.randn_like(want)
    (want * weight).sum().backward()
    (got * weight).sum().backward()
    for (name, p), (_, q) in zip(reference.named_parameters(), fused.named_parameters(), strict=True):
        assert _relative(q.grad, p.grad) < GRAD_TOL, name


def test_the_installed_diffusers_is_the_release_the_fused_forwards_follow() -> None:
    import diffusers

    from wanloom_trainer.model.wan_torch import DIFFUSERS_FORWARDS

    assert diffusers.__version__.startswith(DIFFUSERS_FORWARDS + "."), diffusers.__version__


def test_fused_patch_runs_the_kernel_in_all_three_places(tiny, monkeypatch) -> None:
    from wanloom_trainer.model import wan_torch

    calls: list[tuple[int, ...]] = []
    original = wan_torch._adaln
    monkeypatch.setattr(wan_torch, "_adaln", lambda x, *a: calls.append(tuple(x.shape)) or original(x, *a))
    model = use_fused_adaln(build_expert(tiny, seed=0))
    model(*_inputs(tiny, per_token=False))
    assert len(calls) == 2 * tiny.num_layers + 1  # norm1 + norm3 per block, and norm_out


def test_fused_patch_keeps_parameters_and_state_dict_keys(tiny) -> None:
    plain = build_expert(tiny, seed=0)
    keys = list(plain.state_dict())
    fused = use_fused_adaln(build_expert(tiny, seed=0))
    assert isinstance(fused, FusedAdaLNWanTransformer3DModel)
    assert all(type(b) is FusedAdaLNWanTransformerBlock for b in fused.blocks)
    assert list(fused.state_dict()) == keys
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), fused.state_dict().values(), strict=True))


def test_fused_patch_refuses_wrapped_blocks(tiny) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = build_expert(tiny, seed=0)
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    with pytest.raises(TypeError, match="blocks\\[0\\]"):
        use_fused_adaln(model)


def test_reference_impl_leaves_diffusers_untouched_and_bad_impl_is_named(tiny) -> None:
    model = apply_adaln_impl(build_expert(tiny, seed=0), "reference")
    assert all(type(b) is WanTransformerBlock for b in model.blocks)
    with pytest.raises(ValueError, match=r"kernels\.adaln 'triton'"):
        apply_adaln_impl(model, "triton")


def test_load_expert_round_trips_save_pretrained_and_checks_the_architecture(tiny, tmp_path) -> None:
    source = _perturbed(tiny, seed=5)
    source.save_pretrained(tmp_path / "transformer")
    source.save_pretrained(tmp_path / "transformer_2")
    loaded = build_experts(tiny, weights=tmp_path, seed=0)
    assert len(loaded) == 2 == len(expert_names(tiny))
    want = source.state_dict()
    for model in loaded:
        assert all(torch.equal(want[k], v) for k, v in model.state_dict().items())
        assert all(p.dtype == torch.float32 for p in model.parameters())
    other = dataclasses.replace(tiny, ffn_dim=48)
    with pytest.raises(ValueError, match="ffn_dim=64 but model variant 'tiny' has ffn_dim=48"):
        load_expert(tmp_path / "transformer", other)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_expert(tmp_path / "missing", tiny)
    assert json.loads((tmp_path / "transformer" / "config.json").read_text())["_class_name"] == "WanTransformer3DModel"


def test_random_experts_differ_and_are_reproducible(tiny, tiny_ti2v) -> None:
    high, low = build_experts(tiny, weights=None, seed=0)
    again = build_experts(tiny, weights=None, seed=0)[0]
    w = "blocks.0.attn1.to_q.weight"
    assert not torch.equal(high.state_dict()[w], low.state_dict()[w])
    assert torch.equal(high.state_dict()[w], again.state_dict()[w])
    assert len(build_experts(tiny_ti2v, weights=None, seed=0)) == 1
