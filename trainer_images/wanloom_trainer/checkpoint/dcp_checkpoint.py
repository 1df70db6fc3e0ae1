"""PyTorch checkpoints with ``torch.distributed.checkpoint`` (DCP): both experts, their optimizers, RNG and the
driver's bookkeeping (next step, data position), to a path or to ``gs://``.

Layout under the checkpoint root (``spec.training.checkpoint.uri``)::

    step_00000050/            one checkpoint: resume runs step 50 next
      .metadata, __*.distcp   DCP files (every rank writes its own FSDP shards)
      meta.json               {"next_step": 50, "meta": {...}}: written last, so it marks the checkpoint complete

Atomicity: on a path, ranks write into ``.step_<n>.tmp`` which rank 0 renames once ``meta.json`` is in it; on
``gs://`` (no rename), each rank writes into its own local staging folder, uploads what it wrote, and rank 0
uploads ``meta.json`` once every rank's upload succeeded. A checkpoint without ``meta.json`` is ignored by
``latest_step`` and overwritten by the next save. Restoring from ``gs://`` downloads the checkpoint into each rank's
staging folder.

Storage outages: an upload that storage does not accept within ``UPLOAD_RETRY_S`` fails the save on every rank
together (ranks tell each other where a barrier stood), so none is left waiting in a collective the failed rank
never reaches; the trainer then drops the save and makes it again (``train.saves``). Pruning old checkpoints is
best effort: a failure is logged and the next save prunes again.

Optimizer states are created eagerly by ``backends.torch.step.make_adamw``: DCP's ``get_optimizer_state_dict`` would
otherwise step an empty optimizer to create its state.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from wanloom_trainer.checkpoint.gcs import GcsLocation, bucket_of, download_prefix, upload_dir, upload_retry

META_FILE = "meta.json"
# How long one file's upload retries before the save fails (google-cloud-storage's default is 120 s): about what
# gcsfs allows orbax's writes, so both backends hand a longer outage to the trainer's own retry (train.saves).
UPLOAD_RETRY_S = 30.0
log = logging.getLogger(__name__)
_TRAINED = StateDictOptions(ignore_frozen_params=True)
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(next_step: int) -> str:
    return f"step_{next_step:08d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _gcs_committed_steps(location: GcsLocation) -> list[int]:
    steps = set()
    for blob in bucket_of(location).client.list_blobs(location.bucket, prefix=location.key("step_")):
        parts = blob.name[len(location.key()) :].strip("/").split("/")
        if len(parts) == 2 and parts[1] == META_FILE and (m := _STEP_DIR.match(parts[0])):
            steps.add(int(m.group(1)))
    return sorted(steps)


class CheckpointStore:
    """Save, find and restore checkpoints under one root (a local path or ``gs://``).

    Args:
        uri: the checkpoint root.
        keep: committed checkpoints retained; older ones are deleted after each save.
        staging_dir: local scratch for ``gs://`` (per-rank subfolders are created inside).
    """

    def __init__(self, uri: str, *, keep: int, staging_dir: str | Path) -> None:
        if keep < 1:
            raise ValueError(f"spec.training.checkpoint.keep must be >= 1, got {keep}")
        self.uri, self.keep = uri, keep
        self.gcs = GcsLocation.parse(uri) if uri.startswith("gs://") else None
        self.root = None if self.gcs else Path(uri)
        self.staging = Path(staging_dir)

    # -- listing ------------------------------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        """Steps of complete checkpoints (with ``meta.json``), ascending."""
        if self.gcs is not None:
            return _gcs_committed_steps(self.gcs)
        if not self.root.is_dir():
            return []
        return sorted(
            int(m.group(1)) for d in self.root.iterdir() if (m := _STEP_DIR.match(d.name)) and (d / META_FILE).is_file()
        )

    def latest_step(self) -> int | None:
        """The newest committed step, decided on rank 0 and shared, so every rank restores the same one."""
        steps = self.committed_steps() if _rank() == 0 else []
        found = [steps[-1] if steps else None]
        if dist.is_initialized():
            dist.broadcast_object_list(found, src=0)
        return found[0]

    # -- saving -------------------------------------------------------------------------------------------------
    def save(self, state: dict[str, Any], next_step: int, meta: Mapping[str, Any]) -> None:
        """Write ``state`` (a DCP state dict) and ``meta`` as the checkpoint that resumes at ``next_step``."""
        record = json.dumps({"next_step": next_step, "meta": dict(meta)}, indent=1, sort_keys=True)
        if self.gcs is not None:
            self._save_gcs(state, next_step, record)
        else:
            self._save_local(state, next_step, record)
        self._prune()
        _barrier()

    def _save_local(self, state: dict[str, Any], next_step: int, record: str) -> None:
        final = self.root / step_dir_name(next_step)
        tmp = self.root / f".{final.name}.tmp"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a save that died half-way
            tmp.mkdir(parents=True)
        _barrier()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))
        _barrier()
        if _rank() == 0:
            (tmp / META_FILE).write_text(record)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)

    def _save_gcs(self, state: dict[str, Any], next_step: int, record: str) -> None:
        name = step_dir_name(next_step)
        local = self.staging / f"save-rank{_rank()}" / name
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True)
        # Each rank writes into its own folder (nodes need not share a disk) and uploads exactly what it wrote.
        dcp.save(state, storage_writer=dcp.FileSystemWriter(local))
        error = None
        try:
            upload_dir(local, self.gcs, name, retry_s=UPLOAD_RETRY_S)
        except Exception as exc:  # decided below, with the other ranks
            error = exc
        shutil.rmtree(local, ignore_errors=True)
        _all_ranks_succeeded(error, f"{self.uri}/{name}")
        if _rank() == 0:
            try:
                blob = bucket_of(self.gcs).blob(self.gcs.key(name, META_FILE))
                blob.upload_from_string(record, retry=upload_retry(UPLOAD_RETRY_S))
            except Exception as exc:
                error = exc
        _all_ranks_succeeded(error, f"{self.uri}/{name}/{META_FILE}")

    def _prune(self) -> None:
        if _rank() != 0:
            return
        try:
            for step in self.committed_steps()[: -self.keep]:
                if self.gcs is not None:
                    bucket = bucket_of(self.gcs)
                    prefix = self.gcs.key(step_dir_name(step)) + "/"
                    for blob in list(bucket.client.list_blobs(self.gcs.bucket, prefix=prefix)):
                        blob.delete()
                else:
                    shutil.rmtree(self.root / step_dir_name(step))
        except Exception as exc:  # the checkpoint is committed; an old one left over is pruned by the next save
            log.warning("could not prune old checkpoints in %s (the next save tries again): %s", self.uri, exc)

    # -- restoring ----------------------------------------------------------------------------------------------
    def load(self, state: dict[str, Any], step: int) -> dict[str, Any]:
        """Load checkpoint ``step`` into ``state`` in place (DCP reshards to the current layout); returns its
        ``meta.json`` record."""
        name = step_dir_name(step)
        if self.gcs is None:
            folder = self.root / name
        else:
            folder = self.staging / f"restore-rank{_rank()}" / name
            shutil.rmtree(folder, ignore_errors=True)
            if download_prefix(self.gcs, folder, name) == 0:
                raise FileNotFoundError(f"checkpoint {self.uri}/{name} is empty")
        reader = dcp.FileSystemReader(folder)
        saved = reader.read_metadata().state_dict_metadata
        if "rng" in state and not any(key.startswith(f"rng.{_rng_key()}.") for key in saved):
            state.pop("rng")  # a rank the saving run did not have (world size changed): keep its fresh RNG
        dcp.load(state, storage_reader=reader)
        record = json.loads((folder / META_FILE).read_text())
        if self.gcs is not None:
            shutil.rmtree(folder, ignore_errors=True)
        return record


def _all_ranks_succeeded(error: BaseException | None, what: str) -> None:
    """A barrier that also says whether every rank's part of writing ``what`` succeeded; if one failed, every rank
    raises: the failed one its own error, the others a ``ConnectionError`` naming that rank (the trainer counts
    either as storage lost, ``train.saves``)."""
    failed = [error is not None]
    if dist.is_initialized():
        failed = [False] * dist.get_world_size()
        dist.all_gather_object(failed, error is not None)
    if error is not None:
        raise error
    if any(failed):
        raise ConnectionError(f"rank {failed.index(True)} could not write {what}")


def _rng_key() -> str:
    return f"rank{_rank()}"


def training_state(
    experts: Mapping[str, nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    *,
    ema: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
) -> dict:
    """The DCP state dict: sharded model and optimizer states per expert, the experts' EMA weights when kept
    (``ema.<expert>.<parameter>``, loaded in place), and this rank's RNG states.

    Only trained parameters are saved: all of them in full training, the adapters of a LoRA job (its frozen base
    is the job's ``model.weights``, loaded at every start). RNG states are stored per rank (``rng/rank<r>``): each
    rank restores its own.
    """
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    state = {
        "experts": {name: get_model_state_dict(model, options=_TRAINED) for name, model in experts.items()},
        "optimizers": {name: get_optimizer_state_dict(experts[name], opt) for name, opt in optimizers.items()},
        "rng": {_rng_key(): rng},
    }
    if ema:
        state["ema"] = {name: dict(tensors) for name, tensors in ema.items()}
    return state


def apply_training_state(
    state: dict, experts: Mapping[str, nn.Module], optimizers: Mapping[str, torch.optim.Optimizer]
) -> None:
    """Put a loaded ``training_state`` back into the models, optimizers and RNGs."""
    for name, model in experts.items():
        # A LoRA job's state dict leaves the frozen base out: only then may keys be missing.
        strict = all(p.requires_grad for p in model.parameters())
        set_model_state_dict(model, state["experts"][name], options=StateDictOptions(strict=strict))
        set_optimizer_state_dict(model, optimizers[name], state["optimizers"][name])
    if "rng" not in state:
        return
    rng = state["rng"][_rng_key()]
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
