"""The tensors of a training checkpoint, either backend's, read one at a time in diffusers' names and layout.

The JAX trainer writes orbax checkpoints (``<root>/<step>/state``, arrays named ``params.<expert>.<nnx path>.value``
and, with EMA, ``ema.<expert>...``); the PyTorch trainer writes DCP checkpoints (``<root>/step_<8 digits>/``,
tensors named ``experts.<expert name>.<diffusers key>`` and ``ema.<expert name>...``). Which one a root holds is read
from its step folders, so an export does not need to know the backend. Either way a checkpoint's step is the
first step a resumed run would execute, i.e. the number of steps trained.

Each read restores a single array (orbax partial restore, DCP load of one key), so host memory holds one tensor at a
time; a ``gs://`` DCP checkpoint is first copied to local disk (its ranks' files interleave tensors).
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import numpy as np

from wanloom_api.metrics import EXPERT_LABELS
from wanloom_trainer.checkpoint.gcs import GcsLocation, bucket_of, download_prefix
from wanloom_trainer.export.safetensors_out import TensorEntry

_DCP_STEP = re.compile(r"^step_(\d{8})$")
_ORBAX_STEP = re.compile(r"^(\d+)$")


class CheckpointTensors(Protocol):
    """One checkpoint's weights for export: ``experts`` of them, each a list of diffusers-named tensors, under their
    routing ids ``expert_ids`` (a LoRA job that adapted one expert saved only that one)."""

    uri: str
    step: int
    experts: int
    expert_ids: tuple[int, ...]

    def entries(self, expert: int) -> list[TensorEntry]: ...

    def read(self, expert: int, key: str) -> np.ndarray: ...


def _step_names(uri: str) -> list[str]:
    """Names of the folders directly under a checkpoint root (local or ``gs://``)."""
    if not uri.startswith("gs://"):
        root = Path(uri)
        return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    location = GcsLocation.parse(uri)
    prefix = location.key() + "/" if location.key() else ""
    blobs = bucket_of(location).client.list_blobs(location.bucket, prefix=prefix)
    return sorted({blob.name[len(prefix) :].split("/", 1)[0] for blob in blobs})


def _pick_step(uri: str, steps: list[int], step: int | None) -> int:
    if not steps:
        raise FileNotFoundError(f"spec.training.checkpoint.uri: no committed checkpoint under {uri}")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise ValueError(f"--step {step}: no checkpoint at that step under {uri}; there are: {steps}")
    return step


@contextmanager
def open_checkpoint(uri: str, *, step: int | None = None, ema: bool = False) -> Iterator[CheckpointTensors]:
    """The checkpoint at ``step`` (default: the latest) under ``uri``, orbax or DCP, as a ``CheckpointTensors``.

    Raises:
        FileNotFoundError: nothing committed under ``uri``.
        ValueError: no checkpoint at ``step``, or ``ema`` asked of a checkpoint saved without EMA weights.
    """
    names = _step_names(uri)
    dcp_steps = sorted(int(m.group(1)) for n in names if (m := _DCP_STEP.match(n)))
    if dcp_steps:
        with _DcpTensors.open(uri, _pick_step(uri, _dcp_committed(uri, dcp_steps), step), ema=ema) as source:
            yield source
        return
    orbax_steps = sorted(int(m.group(1)) for n in names if (m := _ORBAX_STEP.match(n)))
    yield _OrbaxTensors(uri, _pick_step(uri, _orbax_committed(uri, orbax_steps), step), ema=ema)


def _dcp_committed(uri: str, steps: list[int]) -> list[int]:
    from wanloom_trainer.checkpoint.dcp_checkpoint import META_FILE, step_dir_name

    if uri.startswith("gs://"):
        location = GcsLocation.parse(uri)
        bucket = bucket_of(location)
        return [s for s in steps if bucket.blob(location.key(step_dir_name(s), META_FILE)).exists()]
    return [s for s in steps if (Path(uri) / step_dir_name(s) / META_FILE).is_file()]


def _orbax_committed(uri: str, steps: list[int]) -> list[int]:
    # Orbax renames a finished local checkpoint into place and marks a finished gs:// one with this file.
    if not uri.startswith("gs://"):
        return steps
    location = GcsLocation.parse(uri)
    bucket = bucket_of(location)
    return [s for s in steps if bucket.blob(location.key(str(s), "commit_success.txt")).exists()]


def _missing_ema(uri: str, step: int) -> ValueError:
    return ValueError(
        f"--ema: checkpoint {step} under {uri} holds no EMA weights (spec.optimizer.ema was unset when it was saved)"
    )


class _OrbaxTensors:
    """An orbax checkpoint of the JAX trainer; NNX names and layouts are turned into diffusers' (``model.load``)."""

    def __init__(self, uri: str, step: int, *, ema: bool) -> None:
        import orbax.checkpoint as ocp

        from wanloom_trainer.model.load import diffusers_key, torch_axes

        self.uri, self.step = uri, step
        # orbax resolves a relative path against nothing useful: give it an absolute one
        root = uri.rstrip("/") if uri.startswith("gs://") else str(Path(uri).resolve())
        self._dir = f"{root}/{step}/state"
        self._checkpointer = ocp.PyTreeCheckpointer()
        absl = logging.getLogger("absl")
        level = absl.level
        absl.setLevel(logging.ERROR)  # "Metadata file does not exist": the trainer saves items, not a whole step
        try:
            metadata = self._checkpointer.metadata(self._dir).item_metadata
        finally:
            absl.setLevel(level)
        pattern = re.compile(rf"^{'ema' if ema else 'params'}\.(\d+)\.(.+)\.value$")
        self._arrays: dict[int, dict[str, tuple[str, tuple[int, ...]]]] = {}
        self._entries: dict[int, list[TensorEntry]] = {}
        for name, array in metadata.items():
            if not (m := pattern.match(name)):
                continue
            expert, path, shape = int(m.group(1)), m.group(2), tuple(array.shape)
            key = diffusers_key(path, len(shape))[0]
            axes = torch_axes(path, len(shape))
            self._arrays.setdefault(expert, {})[key] = (name, axes)
            self._entries.setdefault(expert, []).append(TensorEntry(key, tuple(shape[a] for a in axes)))
        if not self._arrays:
            if ema:
                raise _missing_ema(uri, step)
            raise ValueError(f"{self._dir}: no model parameters in this checkpoint (not a wanloom JAX checkpoint?)")
        self.experts, self.expert_ids = len(self._arrays), tuple(sorted(self._arrays))

    def entries(self, expert: int) -> list[TensorEntry]:
        return self._entries[expert]

    def read(self, expert: int, key: str) -> np.ndarray:
        import orbax.checkpoint as ocp

        name, axes = self._arrays[expert][key]
        restored = self._checkpointer.restore(
            self._dir,
            args=ocp.args.PyTreeRestore(
                item={name: 0}, restore_args={name: ocp.ArrayRestoreArgs(restore_type=np.ndarray)}, partial_restore=True
            ),
        )
        return np.transpose(np.asarray(restored[name], dtype=np.float32), axes)


class _DcpTensors:
    """A DCP checkpoint of the PyTorch trainer: already in diffusers' names and layout."""

    def __init__(self, uri: str, step: int, folder: Path, *, ema: bool) -> None:
        import torch.distributed.checkpoint as dcp

        self.uri, self.step, self._folder = uri, step, folder
        metadata = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
        group = "ema" if ema else "experts"
        self._tensors: dict[int, dict[str, tuple[str, object]]] = {}
        for index, label in enumerate(EXPERT_LABELS):
            prefix = f"{group}.{label}."
            found = {name[len(prefix) :]: (name, meta) for name, meta in metadata.items() if name.startswith(prefix)}
            if found:
                self._tensors[index] = found
        if not self._tensors:
            if ema:
                raise _missing_ema(uri, step)
            raise ValueError(f"{folder}: no model parameters in this checkpoint (not a wanloom PyTorch checkpoint?)")
        self.experts, self.expert_ids = len(self._tensors), tuple(sorted(self._tensors))

    @classmethod
    @contextmanager
    def open(cls, uri: str, step: int, *, ema: bool) -> Iterator[_DcpTensors]:
        from wanloom_trainer.checkpoint.dcp_checkpoint import step_dir_name

        if not uri.startswith("gs://"):
            yield cls(uri, step, Path(uri) / step_dir_name(step), ema=ema)
            return
        staging = Path(tempfile.mkdtemp(prefix="wanloom-export-"))
        try:
            download_prefix(GcsLocation.parse(uri), staging, step_dir_name(step))
            yield cls(uri, step, staging, ema=ema)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def entries(self, expert: int) -> list[TensorEntry]:
        return [TensorEntry(key, tuple(meta.size)) for key, (_, meta) in self._tensors[expert].items()]

    def read(self, expert: int, key: str) -> np.ndarray:
        import torch
        import torch.distributed.checkpoint as dcp

        name, meta = self._tensors[expert][key]
        state = {name: torch.empty(meta.size, dtype=meta.properties.dtype)}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=dcp.FileSystemReader(self._folder), no_dist=True)
        return state[name].float().numpy()
