"""backends.torch.step: the loss against the shared numpy reference, dummy rows, eager AdamW, clipping."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from wanloom_api.trainingjob import OptimizerSpec
from wanloom_trainer.backends.interface import RankRows
from wanloom_trainer.backends.objective import batch_noise, flow_matching_loss_np, noisy_latents_np
from wanloom_trainer.backends.torch.step import accumulate, flow_matching_loss, make_adamw, rows_to_tensors, update
from wanloom_trainer.model.wan_torch import build_expert

OPT = OptimizerSpec.model_validate({"learningRate": 1e-3, "weightDecay": 0.01})


def _rows(variant, ids: list[int], weights: list[float], condition: bool = False) -> RankRows:
    rng = np.random.default_rng(ids)
    shape = (variant.in_channels - (2 if condition else 0), 2, 4, 4)
    return RankRows(
        sample_ids=np.asarray(ids),
        latents=rng.standard_normal((len(ids), *shape), dtype=np.float32),
        text=rng.standard_normal((len(ids), 5, variant.text_dim), dtype=np.float32),
        noise=batch_noise(0, 1, ids, shape),
        timesteps=np.linspace(950.0, 3.5, len(ids)).astype(np.float32),
        weights=np.asarray(weights, np.float32),
        condition=rng.standard_normal((len(ids), 2, 2, 4, 4), dtype=np.float32) if condition else None,
    )


def test_loss_matches_the_shared_numpy_objective(tiny) -> None:
    model = build_expert(tiny, seed=0)
    rows = _rows(tiny, [4, 9, 2], [0.5, 0.0, 0.25])
    got, per_sample = flow_matching_loss(model, **rows_to_tensors(rows, torch.device("cpu")))
    x_t = noisy_latents_np(rows.latents, rows.noise, rows.timesteps)
    with torch.no_grad():
        prediction = model(torch.from_numpy(x_t), torch.from_numpy(rows.timesteps), torch.from_numpy(rows.text))
    want = flow_matching_loss_np(prediction.sample.numpy(), rows.latents, rows.noise, rows.weights, num_samples=1)
    assert float(got.detach()) == pytest.approx(want, rel=1e-6)
    assert per_sample.shape == (3,)


def test_condition_channels_are_appended_to_the_noisy_latents(tiny) -> None:
    i2v = dataclasses.replace(tiny, in_channels=6, out_channels=4, condition_channels=2)
    model = build_expert(i2v, seed=0)
    rows = _rows(i2v, [1, 2], [0.5, 0.5], condition=True)
    seen = {}
    model.patch_embedding.register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))
    flow_matching_loss(model, **rows_to_tensors(rows, torch.device("cpu")))
    assert seen["x"].shape == (2, 6, 2, 4, 4)
    torch.testing.assert_close(seen["x"][:, 4:], torch.from_numpy(rows.condition))


def test_dummy_micro_batch_runs_one_zero_weight_row_and_adds_nothing(tiny) -> None:
    model = build_expert(tiny, seed=0)
    empty = dataclasses.replace(
        _rows(tiny, [1], [0.5]),
        sample_ids=np.zeros(0, np.int64),
        **{k: np.zeros((0, *a.shape[1:]), np.float32) for k, a in [("latents", np.zeros((1, 4, 2, 4, 4))),
                                                                   ("noise", np.zeros((1, 4, 2, 4, 4))),
                                                                   ("text", np.zeros((1, 5, 32)))]},
        timesteps=np.zeros(0, np.float32),
        weights=np.zeros(0, np.float32),
    )  # fmt: skip
    batch = rows_to_tensors(empty, torch.device("cpu"))
    assert batch["latents"].shape == (1, 4, 2, 4, 4) and float(batch["weights"].sum()) == 0.0
    loss = accumulate(model, empty, torch.device("cpu"), torch.float32)
    assert float(loss) == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())  # ran, contributed zero


def test_eager_adamw_state_steps_exactly_like_torch_lazy_adamw(tiny) -> None:
    eager_model, lazy_model = build_expert(tiny, seed=0), build_expert(tiny, seed=0)
    eager = make_adamw(eager_model.parameters(), OPT)
    assert all(float(s["step"]) == 0.0 and not s["exp_avg"].any() for s in eager.state.values())
    lazy = torch.optim.AdamW(lazy_model.parameters(), lr=OPT.learning_rate, betas=OPT.betas, eps=OPT.eps,
                             weight_decay=OPT.weight_decay)  # fmt: skip
    for step in range(2):
        for model in (eager_model, lazy_model):
            accumulate(model, _rows(tiny, [step, 5], [0.5, 0.5]), torch.device("cpu"), torch.float32)
        update(eager_model, eager, 1e-3, None)
        lazy.step()
        lazy.zero_grad()
    for a, b in zip(eager_model.parameters(), lazy_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_clipping_scales_to_the_max_norm_and_reports_the_norm_before(tiny) -> None:
    model = build_expert(tiny, seed=0)
    optimizer = make_adamw(model.parameters(), OPT.model_copy(update={"weight_decay": 0.0}))
    accumulate(model, _rows(tiny, [3, 4], [1.0, 1.0]), torch.device("cpu"), torch.float32)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads.values()])))
    clip = norm / 4
    seen = {}
    capture = lambda *_: seen.update({n: p.grad.clone() for n, p in model.named_parameters()})
    optimizer.register_step_pre_hook(capture)
    reported = update(model, optimizer, 1e-3, clip)
    assert reported == pytest.approx(norm, rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(seen[name], grad * (clip / norm), rtol=1e-5, atol=1e-9)
    assert all(p.grad is None for p in model.parameters())


def test_image_to_video_rows_match_the_numpy_objective(tiny_ti2v) -> None:
    """TI2V: t per token (0 on the clean first frame of rows marked image-to-video), loss over the other frames."""
    from wanloom_trainer.backends.objective import frame_timesteps_np

    model = build_expert(tiny_ti2v, seed=0)
    rows = dataclasses.replace(
        _rows(tiny_ti2v, [4, 9, 2], [0.5, 0.25, 0.25]), clean_first_frame=np.array([1, 0, 1], np.float32)
    )
    seen = {}
    model.patch_embedding.register_forward_pre_hook(lambda m, args: seen.update(x=args[0].clone()))
    got, per_sample = flow_matching_loss(model, **rows_to_tensors(rows, torch.device("cpu")))

    t_frames = frame_timesteps_np(rows.timesteps, rows.clean_first_frame, rows.latents.shape[2])
    x_t = noisy_latents_np(rows.latents, rows.noise, t_frames)
    np.testing.assert_array_equal(seen["x"][[0, 2], :, 0].numpy(), rows.latents[[0, 2], :, 0])
    tokens = np.repeat(t_frames, (rows.latents.shape[3] // 2) * (rows.latents.shape[4] // 2), axis=1)
    with torch.no_grad():
        prediction = model(torch.from_numpy(x_t), torch.from_numpy(tokens), torch.from_numpy(rows.text)).sample
    want = flow_matching_loss_np(
        prediction.numpy(),
        rows.latents,
        rows.noise,
        rows.weights,
        num_samples=1,
        clean_first_frame=rows.clean_first_frame,
    )
    assert float(got.detach()) == pytest.approx(want, rel=1e-6)
    assert per_sample.shape == (3,)
