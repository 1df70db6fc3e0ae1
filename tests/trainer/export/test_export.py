"""`wanloom export`: checkpoints of both trainers, written in the diffusers and original-Wan layouts, judged by
diffusers' own loaders (``from_pretrained``, ``from_single_file`` and its Wan key converter): no missing or
unexpected keys, the trained tensors exactly, and the trainer's forward."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from diffusers import WanTransformer3DModel  # noqa: E402
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers  # noqa: E402

from wanloom_trainer.config.variants import get_variant  # noqa: E402
from wanloom_trainer.export.safetensors_out import bfloat16_bits  # noqa: E402
from wanloom_trainer.export.wan_keys import wan_key  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
STEPS = 4
EMA_DECAY = 0.75
JOBS = {"jax": ROOT / "jobs/tiny-local.yaml", "torch": ROOT / "jobs/tiny-local-torch.yaml"}


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT / "trainer_images")]),
    }


def wanloom(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from wanloom_cli import main; main()", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _job(backend: str, workdir: Path) -> Path:
    doc = yaml.safe_load(JOBS[backend].read_text())
    doc["metadata"]["name"] = f"export-{backend}"
    doc["spec"]["data"]["uri"] = str(workdir / "data")
    doc["spec"]["optimizer"].update(warmupSteps=1, ema={"decay": EMA_DECAY, "startStep": 1})
    doc["spec"]["data"]["captionDropout"] = 0.25  # both trainers' runs with the dataset's empty prompt
    doc["spec"]["training"].update(steps=STEPS, checkpoint={"uri": str(workdir / "ckpt"), "interval": 1, "keep": STEPS})
    path = workdir / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module", params=["jax", "torch"])
def trained(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(backend, job file, workdir) after a 4-step tiny run with EMA, checkpointed after every step."""
    backend = request.param
    workdir = tmp_path_factory.mktemp(f"trained-{backend}")
    job = _job(backend, workdir)
    proc = wanloom(
        "run", str(job), "--no-progress", "--metrics-port", "0", "--run-dir", str(workdir / "run"), cwd=workdir
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return backend, job, workdir


def _checkpoint_weights(backend: str, workdir: Path, step: int) -> list[dict[str, np.ndarray]]:
    """Every expert's weights at ``step`` in diffusers names and torch layout, read without the exporter: the whole
    orbax tree restored by orbax, or the DCP checkpoint converted by torch's own ``dcp_to_torch_save``."""
    if backend == "torch":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        target = workdir / f"full-{step}.pt"
        dcp_to_torch_save(workdir / "ckpt" / f"step_{step:08d}", target)
        state = torch.load(target, weights_only=True)["experts"]
        return [{k: v.float().numpy() for k, v in state[label].items()} for label in ("high_noise", "low_noise")]
    import orbax.checkpoint as ocp

    from wanloom_trainer.model.load import diffusers_key, torch_axes

    flat = ocp.PyTreeCheckpointer().restore(str(workdir / "ckpt" / str(step) / "state"))
    experts: list[dict[str, np.ndarray]] = [{}, {}]
    for name, value in flat.items():
        parts = name.split(".")
        if parts[0] != "params":
            continue
        path = ".".join(parts[2:-1])
        value = np.asarray(value, np.float32)
        experts[int(parts[1])][diffusers_key(path, value.ndim)[0]] = np.transpose(value, torch_axes(path, value.ndim))
    return experts


def _inputs(variant) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(2, variant.in_channels, 3, 6, 10, generator=g)
    return latents, torch.tensor([912.0, 40.5]), torch.randn(2, 7, variant.text_dim, generator=g)


def _trainer_forward(backend: str, weights: dict[str, np.ndarray], variant) -> np.ndarray:
    """The trainer's own model with the checkpoint's weights: diffusers' module (PyTorch) or the NNX model (JAX)."""
    latents, timestep, text = _inputs(variant)
    if backend == "torch":
        from wanloom_trainer.model.wan_torch import build_expert

        model = build_expert(variant, seed=0)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
        with torch.no_grad():
            return model(latents, timestep, text, return_dict=False)[0].numpy()
    import jax.numpy as jnp
    from flax import nnx

    from wanloom_trainer.model.load import diffusers_key
    from wanloom_trainer.model.params import param_name
    from wanloom_trainer.model.wan_jax import abstract_model

    graphdef, abstract = nnx.split(abstract_model(variant))
    leaves = []
    for path, var in nnx.to_flat_state(abstract):
        key, to_nnx = diffusers_key(param_name(path), var.get_value().ndim)
        leaves.append((path, var.replace(jnp.asarray(to_nnx(weights[key])))))
    model = nnx.merge(graphdef, nnx.from_flat_state(leaves))
    return np.asarray(model(jnp.asarray(latents.numpy()), jnp.asarray(timestep.numpy()), jnp.asarray(text.numpy())))


def _forward(model: WanTransformer3DModel, variant) -> np.ndarray:
    with torch.no_grad():
        return model(*_inputs(variant), return_dict=False)[0].numpy()


@pytest.mark.slow
def test_diffusers_and_wan_exports_load_in_diffusers_with_the_trained_weights(trained, tmp_path: Path) -> None:
    backend, job, workdir = trained
    variant = get_variant("tiny")
    out = tmp_path / "diffusers"
    proc = wanloom("export", str(job), "--out", str(out), "--dtype", "float32", "--max-shard-size", "30KB", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert f"weights of step {STEPS}" in proc.stdout
    proc = wanloom(
        "export", str(job), "--out", str(tmp_path / "wan"), "--format", "wan", "--dtype", "float32", cwd=workdir
    )
    assert proc.returncode == 0, proc.stderr

    trained_weights = _checkpoint_weights(backend, workdir, STEPS)
    for expert, (folder, label) in enumerate((("transformer", "high_noise"), ("transformer_2", "low_noise"))):
        index = json.loads((out / folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1, "the 30KB shard size must split the tiny model"
        model, info = WanTransformer3DModel.from_pretrained(out / folder, output_loading_info=True)
        assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == []
        state = model.state_dict()
        assert set(state) == set(trained_weights[expert])
        for key, value in trained_weights[expert].items():
            np.testing.assert_array_equal(state[key].numpy(), value, err_msg=f"{folder}: {key}")

        wan_file = tmp_path / "wan" / f"export-{backend}_{label}.safetensors"
        from safetensors.torch import load_file

        converted = convert_wan_transformer_to_diffusers(load_file(wan_file))
        assert set(converted) == set(state), "diffusers' converter must map the wan keys onto the model exactly"
        single = WanTransformer3DModel.from_single_file(
            str(wan_file), config=str(out), subfolder=folder, local_files_only=True
        )
        for key, value in single.state_dict().items():
            torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)

        want = _trainer_forward(backend, trained_weights[expert], variant)
        got = _forward(model, variant)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{folder} forward")
        np.testing.assert_array_equal(_forward(single, variant), got)


@pytest.mark.slow
def test_bfloat16_export_rounds_like_torch_and_step_picks_the_checkpoint(trained, tmp_path: Path) -> None:
    backend, job, workdir = trained
    proc = wanloom("export", str(job), "--out", str(tmp_path / "bf16"), "--step", "2", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert "weights of step 2 (diffusers, bfloat16)" in proc.stdout
    folder = tmp_path / "bf16" / "transformer_2"
    assert not list(folder.glob("*.index.json")), "the default 5GB shard size keeps a tiny expert in one file"
    from safetensors.torch import load_file

    stored = load_file(folder / "diffusion_pytorch_model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    for key, value in _checkpoint_weights(backend, workdir, 2)[1].items():
        assert torch.equal(stored[key], torch.from_numpy(value).to(torch.bfloat16)), key
    model = WanTransformer3DModel.from_pretrained(folder, torch_dtype=torch.bfloat16)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in stored.items())


@pytest.mark.slow
def test_bad_requests_get_one_line_errors(trained, tmp_path: Path) -> None:
    _, job, workdir = trained
    cases = {
        ("--step", "7"): "--step 7: no checkpoint at that step under",
        ("--format", "onnx"): "--format 'onnx': valid: diffusers, wan",
        ("--dtype", "int8"): "--dtype 'int8': valid: float32, bfloat16, float16",
    }
    for args, message in cases.items():
        proc = wanloom("export", str(job), "--out", str(tmp_path / "x"), *args, cwd=workdir)
        assert proc.returncode == 1, (args, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, proc.stderr)
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").rglob("*.safetensors"))


@pytest.mark.slow
def test_ema_export_averages_the_checkpointed_weights(trained, tmp_path: Path) -> None:
    """startStep 1: after step 0 the average is the weights; after each later step d·ema + (1 − d)·weights."""
    from safetensors.numpy import load_file

    backend, job, workdir = trained

    def ema_at(step: int) -> dict[str, np.ndarray]:
        out = tmp_path / f"ema-{step}"
        proc = wanloom(
            "export", str(job), "--out", str(out), "--ema", "--step", str(step), "--dtype", "float32", cwd=workdir
        )
        assert proc.returncode == 0, proc.stderr
        assert f"EMA weights of step {step}" in proc.stdout
        return load_file(out / "transformer_2" / "diffusion_pytorch_model.safetensors")

    weights = {step: _checkpoint_weights(backend, workdir, step)[1] for step in (1, 2, 3)}
    averages = {step: ema_at(step) for step in (1, 2, 3)}
    for key in weights[1]:
        np.testing.assert_array_equal(averages[1][key], weights[1][key], err_msg=key)
        for step in (2, 3):
            want = EMA_DECAY * averages[step - 1][key] + (1 - EMA_DECAY) * weights[step][key]
            np.testing.assert_allclose(averages[step][key], want, rtol=1e-6, atol=1e-7, err_msg=f"{step}: {key}")
    assert any(not np.array_equal(averages[3][k], weights[3][k]) for k in weights[3]), "the average must lag"


@pytest.mark.slow
def test_export_to_gcs(trained, tmp_path: Path, gcs_server: str, monkeypatch) -> None:
    backend, job, workdir = trained
    bucket, prefix = "wanloom-test", f"export-{backend}-{os.getpid()}"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "wanloom-test")
    proc = wanloom("export", str(job), "--out", f"gs://{bucket}/{prefix}", "--format", "wan", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    from google.cloud import storage

    names = sorted(b.name for b in storage.Client().list_blobs(bucket, prefix=prefix))
    assert names == [f"{prefix}/export-{backend}_{label}.safetensors" for label in ("high_noise", "low_noise")]
    assert not list(Path(tempfile.gettempdir()).glob("wanloom-export-*")), "the staging folder is removed"


def _meta_model(variant) -> WanTransformer3DModel:
    with torch.device("meta"):
        return WanTransformer3DModel(**variant.diffusers_config())


@pytest.mark.parametrize(
    "name", ["tiny", "tiny-i2v", "tiny-ti2v", "wan2.2-t2v-a14b", "wan2.2-i2v-a14b", "wan2.2-ti2v-5b"]
)
def test_wan_names_are_what_diffusers_converts_back(name: str) -> None:
    variant = get_variant(name)
    keys = list(_meta_model(variant).state_dict())
    wan = {wan_key(k): k for k in keys}
    assert len(wan) == len(keys)
    assert convert_wan_transformer_to_diffusers(dict.fromkeys(wan, 0)) == dict.fromkeys(keys, 0)
    # Names of the original release (Wan2.2 high_noise_model/*.safetensors): spot checks.
    assert {"head.modulation", "head.head.weight", "time_projection.1.weight", "blocks.0.modulation"} <= set(wan)
    assert {"blocks.0.self_attn.q.weight", "blocks.0.cross_attn.o.bias", "blocks.0.norm3.weight"} <= set(wan)
    assert {"blocks.0.ffn.0.weight", "blocks.0.ffn.2.bias", "text_embedding.2.weight"} <= set(wan)


def test_bfloat16_bits_match_torch_rounding() -> None:
    x = np.concatenate(
        [
            np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
            * 10.0 ** np.arange(-20, 20, 0.004)[:10_000],
            np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1 + 2**-8, 1 + 3 * 2**-8], np.float32),
        ]
    )
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = bfloat16_bits(x)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.isnan(torch.from_numpy(got[~finite].view(np.int16)).view(torch.bfloat16).float().numpy()).all()


@pytest.mark.parametrize("name", ["wan2.2-t2v-a14b", "wan2.2-ti2v-5b"])
def test_official_shapes_shard_like_the_diffusers_repositories(name: str) -> None:
    """The A14B/5B path without their weights: the key set and shapes are diffusers' own model's at the variant's
    config, and the shard plan keeps every file under the limit (a tensor above it alone in its shard)."""
    from wanloom_trainer.export.layouts import DEFAULT_MAX_SHARD_BYTES, diffusers_config, shard_entries
    from wanloom_trainer.export.safetensors_out import TensorEntry

    variant = get_variant(name)
    config = {k: v for k, v in diffusers_config(variant).items() if not k.startswith("_")}
    with torch.device("meta"):
        model = WanTransformer3DModel(**config)
    entries = [TensorEntry(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    shards = shard_entries(entries, "bfloat16", DEFAULT_MAX_SHARD_BYTES)
    sizes = [sum(e.nbytes("bfloat16") for e in shard) for shard in shards]
    assert all(size <= DEFAULT_MAX_SHARD_BYTES or len(shard) == 1 for size, shard in zip(sizes, shards, strict=True))
    assert sum(sizes) == 2 * sum(v.numel() for v in model.state_dict().values())
    assert [e.key for shard in shards for e in shard] == list(model.state_dict())
    params = sum(v.numel() for v in model.state_dict().values()) / 1e9
    assert params == pytest.approx({"wan2.2-t2v-a14b": 14.3, "wan2.2-ti2v-5b": 5.0}[name], rel=0.03)
