"""LoRA jobs end to end, on both trainers: `wanloom run` trains adapters on saved base weights, `wanloom export`
writes them, and diffusers' own loaders are the judge: ``load_lora_adapter`` and ``WanPipeline.load_lora_weights``
(with ``load_into_transformer_2``) for the diffusers layout, diffusers' converter of original-Wan (ComfyUI) LoRA keys
for the wan layout, ``from_pretrained`` for ``--merge``: each gives the trainer's own forward (its ``predict``, the
path validation videos take) within float32 tolerance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("peft")  # diffusers loads LoRA adapters through PEFT

from diffusers import WanPipeline, WanTransformer3DModel  # noqa: E402
from diffusers.loaders.lora_pipeline import WanLoraLoaderMixin  # noqa: E402
from safetensors import safe_open  # noqa: E402

from wanloom_trainer.config.variants import get_variant  # noqa: E402
from wanloom_trainer.model.wan_torch import build_expert  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
TINY = get_variant("tiny")
STEPS, RANK, ALPHA = 6, 4, 8.0


def wanloom(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT / "trainer_images")])}
    return subprocess.run([sys.executable, "-c", "from wanloom_cli import main; main()", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def _job(workdir: Path, name: str, backend: str = "torch", **lora: object) -> Path:
    doc = yaml.safe_load((ROOT / "jobs" / "tiny-lora-local.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["resources"]["backend"] = backend
    doc["spec"]["model"]["weights"] = str(workdir / "base")
    doc["spec"]["data"]["uri"] = str(workdir / "data")
    doc["spec"]["lora"] = {"rank": RANK, "alpha": ALPHA, **lora}
    doc["spec"]["optimizer"].update(warmupSteps=1, ema={"decay": 0.5})
    doc["spec"]["training"].update(steps=STEPS, checkpoint={"uri": str(workdir / f"ckpt-{name}"), "interval": 3})
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """Saved base weights (the tiny model's two experts, as a diffusers pipeline root)."""
    workdir = tmp_path_factory.mktemp("lora")
    for expert, folder in enumerate(("transformer", "transformer_2")):
        build_expert(TINY, seed=70 + expert).save_pretrained(workdir / "base" / folder)
    return workdir


@pytest.fixture(scope="module", params=["torch", "jax"])
def trained(request, workdir: Path) -> Path:
    job = _job(workdir, f"both-{request.param}", request.param)
    run_dir = workdir / f"run-{request.param}"
    proc = wanloom("run", str(job), "--no-progress", "--metrics-port", "0", "--run-dir", str(run_dir), cwd=workdir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return job


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(2, 4, 3, 8, 8, generator=g), torch.tensor([950.0, 300.0]), torch.randn(2, 16, 32, generator=g)


def _forward(model: torch.nn.Module) -> np.ndarray:
    with torch.no_grad():
        return model(*_inputs(), return_dict=False)[0].numpy()


def _trainer_forwards(job: Path, ema: bool = False) -> list[np.ndarray]:
    """The trainer's own experts (base from model.weights, adapters from the last checkpoint, or their EMA) through
    its ``predict`` on fixed inputs."""
    import dataclasses

    from wanloom_api.validation import load_trainingjob_file
    from wanloom_trainer.config.train_config import from_trainingjob
    from wanloom_trainer.train.run import make_backend

    config = from_trainingjob(load_trainingjob_file(job), {"WANLOOM_RUN_DIR": str(job.parent / "forward")})
    backend = make_backend(config)
    try:
        state = backend.restore().state
        if ema and config.backend == "jax":
            state = dataclasses.replace(state, params=state.ema)
        elif ema:  # the EMA adapters in place of the trained ones
            for model, average in zip(state.experts, state.ema, strict=True):
                params = dict(model.named_parameters())
                for name, value in average.items():
                    params[name].data.copy_(value)
        x, t, text = (v.numpy() for v in _inputs())
        return [backend.predict(state, e, x, t, text) for e in range(config.model.num_experts)]
    finally:
        backend.close()


@pytest.mark.slow
def test_the_checkpoint_holds_only_the_adapters(trained: Path, workdir: Path) -> None:
    """Model entries of the last checkpoint: DCP (PyTorch) ``experts.<label>.<key>``, orbax (JAX)
    ``params.<expert>.<path>.value``; every one an adapter, with their EMA beside them."""
    root = workdir / f"ckpt-{trained.stem}"
    if (root / f"step_{STEPS:08d}").is_dir():
        import torch.distributed.checkpoint as dcp

        keys = list(dcp.FileSystemReader(root / f"step_{STEPS:08d}").read_metadata().state_dict_metadata)
        model = [k for k in keys if k.startswith("experts.")]
        adapter = [k for k in model if ".lora_A." in k or ".lora_B." in k]
        experts = {k.split(".")[1] for k in model}
    else:
        import orbax.checkpoint as ocp

        keys = list(ocp.PyTreeCheckpointer().metadata(str((root / str(STEPS) / "state").resolve())).item_metadata)
        model = [k for k in keys if k.startswith("params.")]
        adapter = [k for k in model if k.endswith((".lora_a.value", ".lora_b.value"))]
        experts = {k.split(".")[1] for k in model}
    assert model and adapter == model, sorted(set(model) - set(adapter))[:5]
    assert len(experts) == 2 and any(k.startswith("ema.") for k in keys)


@pytest.mark.slow
def test_diffusers_layout_loads_in_diffusers_with_the_trainers_forward(trained: Path, workdir: Path) -> None:
    out = workdir / f"export-diffusers-{trained.stem}"
    proc = wanloom("export", str(trained), "--out", str(out), "--dtype", "float32", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert f"exported the adapters of step {STEPS}" in proc.stdout
    want = _trainer_forwards(trained)
    for expert, folder in enumerate(("transformer", "transformer_2")):
        model = WanTransformer3DModel.from_pretrained(workdir / "base" / folder)
        plain = _forward(model)
        model.load_lora_adapter(str(out / folder / "pytorch_lora_weights.safetensors"), prefix="transformer")
        got = _forward(model)
        assert np.abs(plain - want[expert]).max() > 1e-2  # the adapters trained: they change the output
        np.testing.assert_allclose(got, want[expert], rtol=1e-5, atol=1e-5)
    # The pipeline's loader: the high-noise file into transformer, the low-noise one into transformer_2.
    experts = [WanTransformer3DModel.from_pretrained(workdir / "base" / f) for f in ("transformer", "transformer_2")]
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=None, boundary_ratio=0.875,
                       transformer=experts[0], transformer_2=experts[1])  # fmt: skip
    pipe.load_lora_weights(str(out / "transformer"), weight_name="pytorch_lora_weights.safetensors", adapter_name="hi")
    pipe.load_lora_weights(str(out / "transformer_2"), weight_name="pytorch_lora_weights.safetensors",
                           adapter_name="lo", load_into_transformer_2=True)  # fmt: skip
    for expert, model in enumerate((pipe.transformer, pipe.transformer_2)):
        np.testing.assert_allclose(_forward(model), want[expert], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_wan_layout_has_comfyui_names_and_converts_to_the_same_adapter(trained: Path, workdir: Path) -> None:
    out = workdir / f"export-wan-{trained.stem}"
    proc = wanloom("export", str(trained), "--out", str(out), "--format", "wan", "--dtype", "float32", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    want = _trainer_forwards(trained)
    for expert, label in enumerate(("high_noise", "low_noise")):
        path = out / f"{trained.stem}_{label}.safetensors"
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
        assert "diffusion_model.blocks.0.self_attn.q.lora_A.weight" in keys
        assert (
            "diffusion_model.blocks.1.ffn.2.lora_B.weight" in keys
            and "diffusion_model.blocks.0.cross_attn.o.alpha" in keys
        )
        converted = WanLoraLoaderMixin.lora_state_dict(str(path))  # diffusers' converter of original-Wan LoRA keys
        model = WanTransformer3DModel.from_pretrained(workdir / "base" / ("transformer", "transformer_2")[expert])
        model.load_lora_adapter(converted, prefix="transformer")
        np.testing.assert_allclose(_forward(model), want[expert], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_merge_writes_full_weights_and_ema_exports_the_averaged_adapters(trained: Path, workdir: Path) -> None:
    out = workdir / f"export-merged-{trained.stem}"
    proc = wanloom("export", str(trained), "--out", str(out), "--merge", "--dtype", "float32", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    want = _trainer_forwards(trained)
    for expert, folder in enumerate(("transformer", "transformer_2")):
        merged = WanTransformer3DModel.from_pretrained(out / folder)
        np.testing.assert_allclose(_forward(merged), want[expert], rtol=1e-4, atol=1e-5)
    ema_out = workdir / f"export-ema-{trained.stem}"
    proc = wanloom("export", str(trained), "--out", str(ema_out), "--ema", "--dtype", "float32", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    want_ema = _trainer_forwards(trained, ema=True)
    model = WanTransformer3DModel.from_pretrained(workdir / "base" / "transformer")
    model.load_lora_adapter(str(ema_out / "transformer" / "pytorch_lora_weights.safetensors"), prefix="transformer")
    np.testing.assert_allclose(_forward(model), want_ema[0], rtol=1e-5, atol=1e-5)
    assert np.abs(want_ema[0] - want[0]).max() > 1e-4  # the EMA is not the last step's adapters


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_one_expert_trains_alone_and_exports_alone(workdir: Path, backend: str) -> None:
    """lora.experts: low_noise: every sample goes to the low-noise expert; only its adapters export."""
    job = _job(workdir, f"low-{backend}", backend, experts="low_noise")
    run_dir = workdir / f"run-low-{backend}"
    proc = wanloom("run", str(job), "--no-progress", "--metrics-port", "0", "--run-dir", str(run_dir), cwd=workdir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert len(records) == STEPS and all(r["expert_samples"]["high_noise"] == 0 for r in records), records[0]
    out = workdir / f"export-low-{backend}"
    proc = wanloom("export", str(job), "--out", str(out), "--format", "wan", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [f"low-{backend}_low_noise.safetensors"]
    merged = workdir / f"merged-low-{backend}"
    merge = wanloom("export", str(job), "--out", str(merged), "--merge", "--dtype", "float32", cwd=workdir)
    assert merge.returncode == 0, merge.stderr
    high = WanTransformer3DModel.from_pretrained(merged / "transformer")  # the untouched expert: the base
    np.testing.assert_array_equal(
        _forward(high), _forward(WanTransformer3DModel.from_pretrained(workdir / "base" / "transformer"))
    )
