"""LoRA on the PyTorch experts: adapters in PEFT's layout and math, the base frozen and untouched, only adapters
in the optimizer and the checkpoint, exact resume (dropout included), and FSDP2 over two processes with a bfloat16
base and float32 adapters taking the one-process steps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from wanloom_api.trainingjob import LoraSpec
from wanloom_trainer.model.lora_torch import LoRALinear, add_lora
from wanloom_trainer.model.wan_torch import build_expert
from wanloom_trainer.train.run import run

LORA = {"rank": 4, "alpha": 8.0}


def _inputs(tiny) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(2, tiny.in_channels, 3, 8, 8, generator=g), torch.tensor([100.0, 900.0]),
            torch.randn(2, tiny.text_len, tiny.text_dim, generator=g))  # fmt: skip


def test_adapters_follow_peft_names_math_and_initialisation(tiny) -> None:
    base = build_expert(tiny, seed=0)
    model = add_lora(build_expert(tiny, seed=0), LoraSpec(**LORA, targets=["attn1.to_q", "ffn.net.2"]), seed=1)
    lora_keys = [k for k in model.state_dict() if ".lora_" in k]
    assert lora_keys == [f"blocks.{i}.{m}.lora_{p}.weight" for i in range(tiny.num_layers)
                         for m in ("attn1.to_q", "ffn.net.2") for p in "AB"]  # fmt: skip
    assert [k for k in model.state_dict() if ".lora_" not in k] == list(base.state_dict())  # base keys unchanged
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(lora_keys)
    with torch.no_grad():  # lora_B starts at zero: the adapted model is the base
        np.testing.assert_array_equal(
            model(*_inputs(tiny), return_dict=False)[0], base(*_inputs(tiny), return_dict=False)[0]
        )
    linear = model.blocks[0].attn1.to_q
    assert isinstance(linear, LoRALinear) and linear.lora_A.weight.dtype == torch.float32
    bound = 1 / np.sqrt(tiny.dim)  # Kaiming-uniform with a = sqrt(5), as PEFT and nn.Linear
    assert 0.5 * bound < float(linear.lora_A.weight.abs().max()) <= bound
    with torch.no_grad():
        linear.lora_B.weight.normal_()
        x = torch.randn(5, tiny.dim)
        want = x @ linear.weight.T + linear.bias + 2.0 * (x @ linear.lora_A.weight.T @ linear.lora_B.weight.T)
        np.testing.assert_allclose(linear(x), want, rtol=1e-5, atol=1e-5)


def test_a_bad_target_is_named(tiny) -> None:
    with pytest.raises(ValueError, match=r"spec\.lora\.targets: 'norm2' is not a linear layer of blocks\.0"):
        bad = LoraSpec.model_construct(rank=2, alpha=None, dropout=0.0, targets=["norm2"], experts="both")
        add_lora(build_expert(tiny, seed=0), bad, seed=0)


def test_only_adapters_train_and_the_base_stays_bit_for_bit(make_config) -> None:
    from wanloom_trainer.backends.interface import RankRows, Slot, StepInputs
    from wanloom_trainer.backends.objective import batch_noise
    from wanloom_trainer.backends.torch.backend import TorchBackend

    def slot(expert: int, ids: list[int]) -> Slot:
        rng = np.random.default_rng(ids)
        latents = rng.standard_normal((len(ids), 4, 2, 4, 6), dtype=np.float32)
        text = rng.standard_normal((len(ids), 16, 32), dtype=np.float32)
        t = np.full(len(ids), 950.0 if expert == 0 else 50.0, np.float32)
        rows = RankRows(np.asarray(ids), latents, text, batch_noise(0, 0, ids, (4, 2, 4, 6)), t,
                        np.full(len(ids), 1 / 3, np.float32))  # fmt: skip
        return Slot(expert, {0: rows})

    inputs = StepInputs(0, [slot(0, [0, 1]), slot(1, [2])], 3, (2, 1), (1e-2, 1e-2))
    backend = TorchBackend(
        make_config(lora=LORA, model={"paramDtype": "bfloat16", "computeDtype": "bfloat16"}).backend_config
    )
    state = backend.init_state()
    frozen = {n: p.detach().clone() for m in state.experts for n, p in m.named_parameters() if not p.requires_grad}
    assert all(p.dtype == torch.bfloat16 for p in frozen.values())
    assert all(p.dtype == torch.float32 for m in state.experts for p in m.parameters() if p.requires_grad)
    optimized = {id(p) for o in state.optimizers for g in o.param_groups for p in g["params"]}
    assert optimized == {id(p) for m in state.experts for p in m.parameters() if p.requires_grad}
    for _ in range(2):
        state, out = backend.train_step(state, inputs)
    assert all(e.grad_norm and e.grad_norm > 0 for e in out.experts)
    after = {n: p for m in state.experts for n, p in m.named_parameters() if not p.requires_grad}
    assert all(torch.equal(frozen[n], after[n]) for n in frozen)
    assert any(float(m.blocks[0].attn1.to_q.lora_B.weight.abs().max()) > 0 for m in state.experts)


def _crash_at(step: int):
    def hook(record) -> None:
        if record.step == step:
            raise RuntimeError(f"killed after step {step}")

    return hook


@pytest.mark.slow
def test_a_lora_run_with_dropout_resumes_exactly(make_config, tmp_path) -> None:
    spec = {"lora": {**LORA, "dropout": 0.25}, "optimizer": {"warmupSteps": 2, "ema": {"decay": 0.9}},
            "training": {"steps": 8, "checkpoint": {"uri": str(tmp_path / "ckpt"), "interval": 3}}}  # fmt: skip
    env = {"WANLOOM_METRICS_PORT": "0"}
    full = run(make_config(env={**env, "WANLOOM_RUN_DIR": str(tmp_path / "full")},
                           **{**spec, "training": {**spec["training"], "checkpoint": {"uri": str(tmp_path / "f")}}}),
               progress=False)  # fmt: skip
    config = make_config(env={**env, "WANLOOM_RUN_DIR": str(tmp_path / "killed")}, **spec)
    with pytest.raises(RuntimeError, match="killed after step 4"):
        run(config, progress=False, on_step=_crash_at(4))
    resumed = run(config, progress=False)
    assert resumed.start_step == 3
    want = {r.step: (r.loss, r.expert_loss, r.grad_norm) for r in full.records}
    assert {r.step: (r.loss, r.expert_loss, r.grad_norm) for r in resumed.records} == {s: want[s] for s in range(3, 8)}


@pytest.mark.slow
def test_two_process_fsdp_lora_with_a_bf16_base_takes_the_one_process_steps(write_job, run_workers, losses_of,
                                                                            tmp_path) -> None:  # fmt: skip
    spec = {"lora": LORA, "model": {"paramDtype": "bfloat16", "computeDtype": "bfloat16"}}
    one = write_job("one.yaml", **spec, resources={"cpu": {"nodes": 1}})
    two = write_job("two.yaml", **spec, resources={"cpu": {"nodes": 2}})
    run_workers(one, tmp_path / "one", 1, "--steps", "3")
    run_workers(two, tmp_path / "two", 2, "--steps", "3")
    single, double = losses_of(tmp_path / "one"), losses_of(tmp_path / "two")
    assert len(single) == 3
    for a, b in zip(double, single, strict=True):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=2e-2)  # bf16 compute, different reduction order
    layout = json.loads((tmp_path / "two" / "layout-rank0.json").read_text())
    assert layout["parameter_share"] == pytest.approx(0.5, rel=0.05)  # base and adapters both sharded
