"""The original-Wan (ComfyUI) export of the mini variants is what ComfyUI's loader accepts; the tiny variants' is
not.

ComfyUI is not installable from a package registry, so these tests apply the rules its Wan detection applies to a
state dict (``comfy/model_detection.py`` at ComfyUI v0.26.1, read from a public copy on 2026-12-06): the width from
``head.modulation``, heads = width // 128, the output channels from ``head.head.weight`` over the 1x2x2 patch, the
FFN width and layer count from the blocks, the input channels from ``patch_embedding.weight``, and the frequency
(256) and text (4096) widths fixed. The model that config describes (diffusers' ``WanTransformer3DModel``) must load
the export strictly, after diffusers' own conversion of original-Wan keys, and give the trained model's forward.
A mini LoRA's ComfyUI files, applied with ComfyUI's LoRA arithmetic, give the weights ``--merge`` writes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")

from diffusers import WanTransformer3DModel  # noqa: E402
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from wanloom_trainer.config.variants import get_variant  # noqa: E402
from wanloom_trainer.model.wan_torch import build_expert  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
COMFYUI_HEAD_DIM, COMFYUI_FREQ_DIM, COMFYUI_TEXT_DIM = 128, 256, 4096


def comfyui_wan_config(state: dict[str, torch.Tensor]) -> dict[str, int | str]:
    """What ComfyUI reads off a Wan state dict in original keys (module docstring)."""
    dim = int(state["head.modulation"].shape[-1])
    layers = len({int(m.group(1)) for k in state if (m := re.match(r"blocks\.(\d+)\.", k))})
    return {
        "dim": dim,
        "num_heads": dim // COMFYUI_HEAD_DIM,
        "out_dim": int(state["head.head.weight"].shape[0]) // 4,
        "ffn_dim": int(state["blocks.0.ffn.0.weight"].shape[0]),
        "num_layers": layers,
        "in_dim": int(state["patch_embedding.weight"].shape[1]),
        "model_type": "i2v" if "img_emb.proj.0.bias" in state else "t2v",
    }


def comfyui_model(config: dict[str, int | str]) -> WanTransformer3DModel:
    """The model ComfyUI builds from ``config``, as diffusers' class (names differ, shapes and function do not)."""
    heads = int(config["num_heads"])
    if heads < 1:
        raise ValueError(f"ComfyUI derives {heads} attention heads from a width of {config['dim']}")
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=int(config["dim"]) // heads,
        in_channels=int(config["in_dim"]), out_channels=int(config["out_dim"]), text_dim=COMFYUI_TEXT_DIM,
        freq_dim=COMFYUI_FREQ_DIM, ffn_dim=int(config["ffn_dim"]), num_layers=int(config["num_layers"]),
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
    )  # fmt: skip


def _export(job_name: str, workdir: Path) -> list[Path]:
    """Train the shipped mini job for 3 steps; its spec.export writes the original-Wan files."""
    doc = yaml.safe_load((ROOT / "jobs" / f"{job_name}.yaml").read_text())
    spec = doc["spec"]
    spec["data"]["uri"] = str(workdir / "data")
    spec["optimizer"]["warmupSteps"] = 1
    spec["training"].update(steps=3, checkpoint={"uri": str(workdir / "ckpt"), "interval": 3})
    spec["export"] = {"uri": str(workdir / "export"), "format": "wan", "dtype": "float32"}
    job = workdir / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT / "trainer_images")])}
    args = ["run", str(job), "--no-progress", "--metrics-port", "0", "--run-dir", str(workdir / "run")]
    proc = subprocess.run([sys.executable, "-c", "from wanloom_cli import main; main()", *args], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return sorted((workdir / "export").glob("*.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("job_name", ["mini-t2v-local", "mini-i2v-local", "mini-ti2v-local"])
def test_mini_exports_load_as_comfyui_reads_them(job_name: str, tmp_path: Path) -> None:
    variant_name = yaml.safe_load((ROOT / "jobs" / f"{job_name}.yaml").read_text())["spec"]["model"]["variant"]
    variant = get_variant(variant_name)
    files = _export(job_name, tmp_path)
    assert len(files) == (2 if variant.two_experts else 1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, variant.in_channels, 3, 4, 6, generator=g)
    t, text = torch.tensor([700.0]), torch.randn(1, 9, variant.text_dim, generator=g)
    for path in files:
        state = load_file(path)
        config = comfyui_wan_config(state)
        want = {"dim": variant.dim, "num_heads": variant.num_heads, "out_dim": variant.out_channels,
                "ffn_dim": variant.ffn_dim, "num_layers": variant.num_layers, "in_dim": variant.in_channels,
                "model_type": "t2v"}  # fmt: skip
        assert config == want, path.name  # Wan 2.2's I2V has no CLIP image embedding: ComfyUI sees in_dim 36
        model = comfyui_model(config)
        model.load_state_dict(convert_wan_transformer_to_diffusers(dict(state)), strict=True)
        trained = WanTransformer3DModel(**variant.diffusers_config())
        trained.load_state_dict(convert_wan_transformer_to_diffusers(dict(state)), strict=True)
        with torch.no_grad():
            got = model(x, t, text, return_dict=False)[0]
            expected = trained(x, t, text, return_dict=False)[0]
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["tiny", "tiny-i2v", "tiny-ti2v"])
def test_tiny_exports_are_too_narrow_for_comfyui(name: str) -> None:
    """Why the mini variants exist: ComfyUI would derive no attention head from a tiny model's width."""
    from wanloom_trainer.export.wan_keys import wan_key

    variant = get_variant(name)
    state = {wan_key(k): v for k, v in build_expert(variant, seed=0).state_dict().items()}
    config = comfyui_wan_config(state)
    assert config["num_heads"] == 0
    with pytest.raises(ValueError, match="0 attention heads"):
        comfyui_model(config)


def _wanloom(*args: str, cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT / "trainer_images")])}
    proc = subprocess.run([sys.executable, "-c", "from wanloom_cli import main; main()", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow
def test_a_mini_lora_applied_as_comfyui_applies_it_is_the_merged_model(tmp_path: Path) -> None:
    """LoRA on mini-t2v (rank 4, alpha 8: a scale of 2, so a scale mistake shows): ComfyUI's LoRA arithmetic on the
    exported ComfyUI files, W + (alpha / rank)·up·down with up = lora_B and down = lora_A, gives the weights
    ``--merge`` writes, and the merged files pass ComfyUI's Wan detection as the variant."""
    variant = get_variant("mini-t2v")
    for expert, folder in enumerate(("transformer", "transformer_2")):
        build_expert(variant, seed=90 + expert).save_pretrained(tmp_path / "base" / folder)
    doc = yaml.safe_load((ROOT / "jobs" / "tiny-lora-local.yaml").read_text())
    spec = doc["spec"]
    spec["model"].update(variant="mini-t2v", weights=str(tmp_path / "base"))
    spec["data"]["uri"] = str(tmp_path / "data")
    spec["lora"] = {"rank": 4, "alpha": 8.0}
    spec["optimizer"]["warmupSteps"] = 1
    spec["training"].update(steps=3, checkpoint={"uri": str(tmp_path / "ckpt"), "interval": 3})
    job = tmp_path / "lora.yaml"
    job.write_text(yaml.safe_dump(doc))
    _wanloom("run", str(job), "--no-progress", "--metrics-port", "0", "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    _wanloom("export", str(job), "--format", "wan", "--dtype", "float32", "--out", str(tmp_path / "lora"), cwd=tmp_path)
    merge = ["--format", "wan", "--merge", "--dtype", "float32", "--out", str(tmp_path / "merged")]
    _wanloom("export", str(job), *merge, cwd=tmp_path)
    for stem in ("high_noise", "low_noise"):
        [lora_file] = (tmp_path / "lora").glob(f"*_{stem}.safetensors")
        [merged_file] = (tmp_path / "merged").glob(f"*_{stem}.safetensors")
        adapters, merged = load_file(lora_file), load_file(merged_file)
        base = convert_to_wan(tmp_path / "base" / ("transformer" if stem == "high_noise" else "transformer_2"))
        modules = {k.removesuffix(".lora_A.weight") for k in adapters if k.endswith(".lora_A.weight")}
        assert modules, lora_file.name
        for module in modules:
            down, up = adapters[f"{module}.lora_A.weight"], adapters[f"{module}.lora_B.weight"]
            alpha = float(adapters[f"{module}.alpha"])
            key = module.removeprefix("diffusion_model.") + ".weight"
            applied = base[key] + (alpha / down.shape[0]) * (up @ down)
            torch.testing.assert_close(applied, merged[key], rtol=1e-5, atol=1e-6)
        assert comfyui_wan_config(merged)["num_heads"] == variant.num_heads


def convert_to_wan(folder: Path) -> dict[str, torch.Tensor]:
    """A diffusers expert folder's weights in original Wan names (the exporter's own key map)."""
    from wanloom_trainer.export.wan_keys import wan_key

    model = WanTransformer3DModel.from_pretrained(folder)
    return {wan_key(k): v.detach() for k, v in model.state_dict().items()}
