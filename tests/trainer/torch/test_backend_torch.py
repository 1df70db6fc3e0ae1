"""TorchBackend on one rank: kernel, remat and precision choices change nothing they should not; idle experts
stay bit-for-bit; the evaluation loss is the training loss; bad settings are named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wanloom_trainer.backends.interface import RankRows, Slot, StepInputs
from wanloom_trainer.backends.objective import batch_noise
from wanloom_trainer.backends.torch.backend import TorchBackend


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: FSDP shards are DTensors; a one-rank, one-dtype job keeps plain tensors."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _slot(expert: int, ids: list[int], step: int = 0) -> Slot:
    rng = np.random.default_rng([step, *ids])
    rows = RankRows(
        sample_ids=np.asarray(ids),
        latents=rng.standard_normal((len(ids), 4, 2, 4, 6), dtype=np.float32),
        text=rng.standard_normal((len(ids), 16, 32), dtype=np.float32),
        noise=batch_noise(0, step, ids, (4, 2, 4, 6)),
        timesteps=np.asarray([950.0 - 10 * i if expert == 0 else 20.0 + 10 * i for i in ids], np.float32),
        weights=np.full(len(ids), 1 / 3, np.float32),
    )
    return Slot(expert, {0: rows})


INPUTS = StepInputs(0, [_slot(0, [0, 1]), _slot(1, [2])], 3, (2, 1), (1e-3, 1e-3))


def _losses(make_config, **spec) -> tuple[list[float], list[float]]:
    backend = TorchBackend(make_config(**spec).backend_config)
    state = backend.init_state()
    outs = []
    for step in range(2):
        state, out = backend.train_step(state, StepInputs(step, *list(vars(INPUTS).values())[1:]))
        outs.append(out)
    return [o.loss for o in outs], [e.grad_norm for o in outs for e in o.experts]


@pytest.mark.parametrize(
    ("spec", "tol"),
    [
        pytest.param({"kernels": {"adaln": "fused"}}, 1e-5, id="fused-adaln"),
        pytest.param({"parallelism": {"remat": "full"}}, 1e-6, id="remat-full"),
        pytest.param({"parallelism": {"remat": "save-attention"}}, 1e-6, id="remat-save-attention"),
        pytest.param({"model": {"computeDtype": "bfloat16"}}, 3e-2, id="bf16-compute"),
        pytest.param({"model": {"paramDtype": "bfloat16", "computeDtype": "bfloat16"}}, 3e-2, id="bf16-params"),
        pytest.param(
            {"kernels": {"adaln": "fused", "compile": "blocks"}, "parallelism": {"remat": "full"}},
            1e-5,
            id="compiled-blocks-fused-remat",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_settings_change_only_what_they_should(make_config, spec, tol) -> None:
    want_loss, want_norm = _losses(make_config)
    got_loss, got_norm = _losses(make_config, **spec)
    np.testing.assert_allclose(got_loss, want_loss, rtol=tol)
    np.testing.assert_allclose(got_norm, want_norm, rtol=10 * tol)


def test_compiled_blocks_are_compiled(make_config) -> None:
    """nn.Module.compile keeps each block's class and module path (checkpoint keys unchanged) and compiles its call."""
    backend = TorchBackend(make_config(kernels={"compile": "blocks"}).backend_config)
    state = backend.init_state()
    assert all(block._compiled_call_impl is not None for m in state.experts for block in m.blocks)
    plain = TorchBackend(make_config().backend_config).init_state()
    assert all(block._compiled_call_impl is None for m in plain.experts for block in m.blocks)


def test_bf16_params_are_stored_in_bf16_and_fp32_params_stay_fp32(make_config) -> None:
    for dtype, want in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        backend = TorchBackend(make_config(model={"paramDtype": dtype, "computeDtype": "bfloat16"}).backend_config)
        state = backend.init_state()
        assert {p.dtype for m in state.experts for p in m.parameters()} == {want}


def test_idle_expert_keeps_parameters_and_moments_bit_for_bit(make_config) -> None:
    backend = TorchBackend(make_config().backend_config)
    state = backend.init_state()
    before = [_full(p.detach()).clone() for p in state.experts[1].parameters()]
    moments = [_full(s["exp_avg_sq"]).clone() for s in state.optimizers[1].state.values()]
    state, out = backend.train_step(state, StepInputs(0, [_slot(0, [0, 1])], 2, (2, 0), (1e-3, 1e-3)))
    assert out.experts[1].grad_norm is None and out.experts[1].loss_sum == 0.0
    after = [_full(p.detach()) for p in state.experts[1].parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    after = [_full(s["exp_avg_sq"]) for s in state.optimizers[1].state.values()]
    assert all(torch.equal(a, b) for a, b in zip(moments, after, strict=True))
    assert all(float(s["step"]) == 0 for s in state.optimizers[1].state.values())


def test_evaluate_is_the_training_loss(make_config) -> None:
    backend = TorchBackend(make_config().backend_config)
    state = backend.init_state()
    slot = _slot(1, [5, 6])
    evaluated = backend.evaluate(state, slot)
    _, out = backend.train_step(state, StepInputs(0, [slot], 2, (0, 2), (0.0, 0.0)))
    assert evaluated == pytest.approx(out.experts[1].loss_sum, rel=1e-6)


def test_bad_settings_are_named(make_config) -> None:
    backend = TorchBackend(make_config().backend_config)
    with pytest.raises(ValueError, match="the plan has 2 ranks but the torch mesh has 1"):
        backend.local_ranks(2)
    with pytest.raises(ValueError, match="'flash' needs CUDA devices and computeDtype bfloat16"):
        TorchBackend(make_config(kernels={"attention": "flash"}).backend_config).init_state()
    with pytest.raises(ValueError, match=r"checkpoint\.uri is unset"):
        TorchBackend(make_config(training={"checkpoint": {"uri": None}}).backend_config).save(None, 1, {})


def test_weights_are_staged_from_gcs_on_rank_zero_and_loaded(make_config, gcs, tmp_path) -> None:
    from wanloom_trainer.checkpoint.gcs import GcsLocation, upload_dir
    from wanloom_trainer.model.wan_torch import build_expert

    config = make_config()
    sources = [build_expert(config.model.wan, seed=40 + i) for i in range(2)]
    for model, folder in zip(sources, ("transformer", "transformer_2"), strict=True):
        model.save_pretrained(tmp_path / "w" / folder)
    upload_dir(tmp_path / "w", GcsLocation.parse(gcs), "weights")
    state = TorchBackend(make_config(model={"weights": f"{gcs}/weights"}).backend_config).init_state()
    for source, expert in zip(sources, state.experts, strict=True):
        want = source.state_dict()
        assert all(torch.equal(want[k], _full(v)) for k, v in expert.state_dict().items())
    with pytest.raises(FileNotFoundError, match="nothing under"):
        TorchBackend(make_config(model={"weights": f"{gcs}/missing"}).backend_config).init_state()


def _first_moments(make_config, **spec) -> tuple[list[torch.Tensor], list[float | None]]:
    backend = TorchBackend(make_config(**spec).backend_config)
    state, out = backend.train_step(backend.init_state(), INPUTS)
    moments = [_full(s["exp_avg"]).clone() for s in state.optimizers[0].state.values()]
    return moments, [e.grad_norm for e in out.experts]


def test_clipping_on_sharded_gradients_scales_them_and_reports_the_norm_before(make_config) -> None:
    plain, plain_norms = _first_moments(make_config)
    clip = 1e-3
    clipped, clipped_norms = _first_moments(make_config, optimizer={"clipGradNorm": clip})
    assert clipped_norms == pytest.approx(plain_norms, rel=1e-6)  # reported before clipping
    factor = clip / plain_norms[0]
    for a, b in zip(clipped, plain, strict=True):  # AdamW's first moment after one step is (1 - b1) * gradient
        torch.testing.assert_close(a, b * factor, rtol=1e-5, atol=1e-12)
