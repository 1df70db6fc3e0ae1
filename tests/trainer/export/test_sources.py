"""Checkpoint discovery of the exporter on hand-written checkpoints of each format: steps, commits, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from wanloom_trainer.export.sources import open_checkpoint

torch = pytest.importorskip("torch")


def _dcp(root: Path, step: int, *, commit: bool = True) -> None:
    import torch.distributed.checkpoint as dcp

    folder = root / f"step_{step:08d}"
    state = {"experts": {"high_noise": {"proj_out.weight": torch.full((2, 3), float(step))}}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    if commit:
        (folder / "meta.json").write_text(json.dumps({"next_step": step, "meta": {}}))


def _orbax(root: Path, step: int) -> None:
    import orbax.checkpoint as ocp

    ocp.PyTreeCheckpointer().save(
        (root / str(step) / "state").resolve(), {"params.0.proj_out.kernel.value": np.ones((3, 2))}
    )


def test_dcp_latest_committed_step_and_one_tensor_reads(tmp_path: Path) -> None:
    for step in (2, 4):
        _dcp(tmp_path, step)
    _dcp(tmp_path, 6, commit=False)  # a save that died before meta.json: not a checkpoint
    with open_checkpoint(str(tmp_path)) as source:
        assert (source.step, source.experts) == (4, 1)
        assert [(e.key, e.shape) for e in source.entries(0)] == [("proj_out.weight", (2, 3))]
        np.testing.assert_array_equal(source.read(0, "proj_out.weight"), np.full((2, 3), 4.0, np.float32))
    with pytest.raises(ValueError, match=r"--step 6: no checkpoint at that step under .*; there are: \[2, 4\]"):
        open_checkpoint(str(tmp_path), step=6).__enter__()
    with pytest.raises(ValueError, match=r"--ema: checkpoint 4 under .* holds no EMA weights \(spec.optimizer.ema"):
        open_checkpoint(str(tmp_path), ema=True).__enter__()


def test_orbax_names_and_layout_become_diffusers(tmp_path: Path) -> None:
    _orbax(tmp_path, 3)
    with open_checkpoint(str(tmp_path)) as source:
        assert [(e.key, e.shape) for e in source.entries(0)] == [("proj_out.weight", (2, 3))]  # [in, out] -> [out, in]
        assert source.read(0, "proj_out.weight").shape == (2, 3)
    with pytest.raises(ValueError, match=r"--ema: checkpoint 3 under .* holds no EMA weights"):
        open_checkpoint(str(tmp_path), ema=True).__enter__()


def test_nothing_to_export_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"spec.training.checkpoint.uri: no committed checkpoint under"):
        open_checkpoint(str(tmp_path / "missing")).__enter__()
