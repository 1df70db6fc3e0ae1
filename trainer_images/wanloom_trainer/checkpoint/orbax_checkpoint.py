"""Orbax checkpoints of the JAX trainer: any pytree of (sharded) arrays plus a JSON record, atomically.

Layout under the checkpoint root (gs://bucket/prefix or a local path)::

    <root>/<step>/state/   the arrays, one entry per flattened pytree leaf ("experts.0.params.blocks.0...")
    <root>/<step>/meta/    JSON: the driver's bookkeeping (next step, seed, data position, routing)

``<step>`` is the first step a resumed run executes. Orbax writes each checkpoint into a temporary directory and
renames it (or, on GCS, writes a commit marker) only when every process has finished, so a run killed mid-save
leaves the previous checkpoint as the latest; ``keep`` bounds how many are retained (oldest deleted first).

The state is saved flattened by key path rather than as its own pytree type (nnx.State, optax named tuples), so
the on-disk form does not depend on flax/optax internals; restore needs a template of the same structure (the
freshly initialised state), whose shardings say where every restored shard goes: each process reads only its
own shards.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

from wanloom_api.trainingjob import CheckpointSpec


def _key_name(entry: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def flatten_state(state: Any) -> tuple[dict[str, Any], Any]:
    """({"a.b.0": leaf, ...}, treedef) of a pytree; names are the dotted key paths."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    flat = {".".join(_key_name(e) for e in path): leaf for path, leaf in leaves}
    if len(flat) != len(leaves):
        raise ValueError("two state leaves share a key path; cannot checkpoint this state by name")
    return flat, treedef


def _abstract(leaf: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)


class OrbaxCheckpointer:
    """Save/restore a state pytree and its JSON record with orbax's ``CheckpointManager``."""

    def __init__(self, config: CheckpointSpec, *, asynchronous: bool = True) -> None:
        if config.uri is None:
            raise ValueError("spec.training.checkpoint.uri is unset: checkpoints are disabled")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.keep, enable_async_checkpointing=asynchronous, create=True
        )
        self.uri = config.uri
        self._manager = ocp.CheckpointManager(config.uri, options=options, item_names=("state", "meta"))

    def save(self, step: int, state: Any, meta: Mapping[str, Any]) -> float:
        """Start saving ``state`` as checkpoint ``step``; returns the seconds the caller was blocked."""
        start = time.perf_counter()
        flat, _ = flatten_state(state)
        args = ocp.args.Composite(state=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(dict(meta)))
        self._manager.save(step, args=args, force=True)
        return time.perf_counter() - start

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def restore(self, step: int, template: Any) -> tuple[Any, dict[str, Any]]:
        """(state shaped and placed like ``template``, the JSON record) of checkpoint ``step``."""
        flat, treedef = flatten_state(template)
        abstract = {name: _abstract(leaf) for name, leaf in flat.items()}
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        restored = self._manager.restore(step, args=args)
        leaves = [restored["state"][name] for name in flat]
        return jax.tree_util.tree_unflatten(treedef, leaves), dict(restored["meta"])

    def saving(self) -> bool:
        """True while an asynchronous save has not committed."""
        return self._manager.is_saving_in_progress()

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
