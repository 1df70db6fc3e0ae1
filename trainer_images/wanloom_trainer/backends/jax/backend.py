"""The JAX backend (``backends.interface.Backend``): both experts resident and FSDP-sharded on one mesh.

State: ``JaxState(params, opt)``, one entry per expert (0 = high noise, 1 = low noise), float32 master
parameters and AdamW moments sharded by ``parallel.mesh_jax.ShardingConfig.param``. With ``spec.lora`` the trained
``params`` are the experts' adapters (``model.lora_jax``) and the base is ``frozen``: sharded alike, in its parameter
dtype, never in the optimizer, the EMA or a checkpoint (it is ``model.weights``, loaded at every start). Both
experts carry adapters; with ``lora.experts`` naming one the other gets no samples, so its adapters stay zero (the
export writes only the trained expert's). Shapes come first from
``jax.eval_shape`` and everything is created by jitted functions with ``out_shardings``, so no process ever holds an
unsharded expert; a restore reads straight into that layout without initialising first.

Host → device: a slot's rows arrive per data-parallel rank; the global batch [R·b, ...] is assembled with
``jax.make_array_from_callback``, which asks each process only for the rows of the devices it owns (the same call
works for one process and for many). Rows are padded with zero-weight copies up to a power of two so the number
of compiled programs stays small (one per (rows, latent shape), shared by both experts). A packed slot
(``backends.packing.PackedRows``, one row per rank) is one program per row geometry (row tokens, segment slots,
longest segment), whatever shapes its samples have.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from wanloom_trainer.backends.ema import ema_decay
from wanloom_trainer.backends.interface import ExpertOutputs, RankRows, Restored, Slot, StepInputs, StepOutputs
from wanloom_trainer.backends.jax.step import StepFns, make_step_fns, moment_transform
from wanloom_trainer.backends.packing import PackedRows
from wanloom_trainer.config.train_config import BackendConfig
from wanloom_trainer.config.variants import EXPERT_SUBFOLDERS
from wanloom_trainer.distributed_jax import initialize_jax
from wanloom_trainer.parallel.context_attention import context_parallel_attention
from wanloom_trainer.parallel.mesh_jax import ShardingConfig, build_mesh, runs_mosaic
from wanloom_trainer.parallel.sharded_adaln import sharded_adaln

# TrainingJob remat names → the model's jax.checkpoint policies (model.wan_jax.REMAT_POLICIES).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class JaxState:
    """Per expert: parameters (the flat list of the ``nnx.State``'s leaves), optimizer state over that list, and
    with ``spec.optimizer.ema`` the float32 average of the parameters (same list, same shardings; else empty)."""

    params: tuple[Any, ...]
    opt: tuple[Any, ...]
    ema: tuple[Any, ...] = ()
    frozen: tuple[Any, ...] = ()  # LoRA: the base parameters' leaves per expert; full training: empty


def use_gspmd_for_sequence_sharding() -> None:
    """Partition with GSPMD instead of Shardy (process-wide) for context-parallel meshes.

    Shardy in jax 0.10.2 computes a wrong weight gradient for a convolution whose output is split along a spatial
    dimension, which is what the patch embedding becomes once the token sequence is sharded over ``context``
    (repro: tests/trainer/train/scripts/shardy_conv.py); GSPMD partitions it correctly.
    """
    if jax.config.jax_use_shardy_partitioner:
        log.warning("context parallelism: partitioning with GSPMD (Shardy mis-partitions the patch-embedding grad)")
        jax.config.update("jax_use_shardy_partitioner", False)


def _check_local_devices(config: BackendConfig, devices: Sequence[jax.Device] | None) -> None:
    """WANLOOM_DEVICES_PER_HOST (the operator's view of a pod) must be what JAX sees on this host."""
    expected = config.distributed.devices_per_host
    if expected is not None and devices is None and jax.local_device_count() != expected:
        raise ValueError(
            f"WANLOOM_DEVICES_PER_HOST={expected} but JAX sees {jax.local_device_count()} local devices "
            f"({jax.default_backend()}); check spec.resources and the pod's accelerator request"
        )


# Tracing, lowering and compiling (or loading from the persistent cache) all stall the step that needs a new
# program; their sum tells a compiling step from a measured one.
_COMPILE_EVENTS = frozenset(
    {
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    }
)


class CompileClock:
    """Seconds this process has spent making programs, from jax.monitoring's compile events (one listener per
    process: jax keeps listeners for good)."""

    seconds = 0.0
    _listening = False

    @classmethod
    def read(cls) -> float:
        if not cls._listening:
            jax.monitoring.register_event_duration_secs_listener(cls._record)
            cls._listening = True
        return cls.seconds

    @classmethod
    def _record(cls, event: str, duration: float, **_: Any) -> None:
        if event in _COMPILE_EVENTS:
            cls.seconds += duration


def pad_rows(n: int) -> int:
    """Rows per rank of a slot as compiled: the next power of two, so a run compiles few distinct shapes."""
    return 1 << max(0, n - 1).bit_length()


class JaxBackend:
    """See the module docstring; constructed once per process, after ``distributed.prepare_platform``."""

    name = "jax"

    def __init__(self, config: BackendConfig, *, devices: Sequence[jax.Device] | None = None) -> None:
        initialize_jax(config.distributed)
        if config.parallel.context > 1:
            use_gspmd_for_sequence_sharding()
        self.config = config
        _check_local_devices(config, devices)
        self.mesh = build_mesh(config.parallel, num_slices=config.distributed.num_slices, devices=devices)
        self.shardings = ShardingConfig(self.mesh)
        self.process_index, self.process_count = jax.process_index(), jax.process_count()
        self.num_devices = self.mesh.size
        self._tx = moment_transform(config.optimizer)
        self._graphdef, abstract_params, *abstract_frozen = nnx.split(self._abstract_model(), *self._filters)
        # In the hot loop parameters are flat lists of leaves (StepFns); nnx.State only at checkpoints.
        abstract_leaves, self._treedef = jax.tree.flatten(abstract_params)
        self._frozen_treedef = jax.tree.structure(abstract_frozen[0]) if abstract_frozen else None
        self._param_shardings = [a.sharding for a in abstract_leaves]
        self._opt_shardings = optax.tree_utils.tree_map_params(
            self._tx,
            lambda _, s: s,
            jax.eval_shape(self._tx.init, abstract_leaves),
            self._param_shardings,
            transform_non_params=lambda _: self.shardings.replicated,
        )
        self._opt_treedefs = (  # the optimizer state over lists (hot loop) and over nnx.State (checkpoints)
            jax.tree.structure(jax.eval_shape(self._tx.init, abstract_leaves)),
            jax.tree.structure(jax.eval_shape(self._tx.init, abstract_params)),
        )
        self.step_fns: StepFns = make_step_fns(
            self._graphdef,
            config.optimizer,
            treedef=self._treedef,
            frozen_treedef=self._frozen_treedef,
            param_shardings=self._param_shardings,
            opt_shardings=self._opt_shardings,
            replicated=self.shardings.replicated,
        )
        self._predict: Any = None  # jitted on first use (sampling)
        self._checkpointer = None
        if config.checkpoint.uri is not None:
            from wanloom_trainer.checkpoint.orbax_checkpoint import OrbaxCheckpointer

            self._checkpointer = OrbaxCheckpointer(config.checkpoint)

    # -- model ---------------------------------------------------------------------------------------------------

    @property
    def _filters(self) -> tuple[Any, ...]:
        """The model's state as (trained, frozen): all parameters, or LoRA's adapters and the base."""
        return (nnx.LoRAParam, nnx.Param) if self.config.lora is not None else (nnx.Param,)

    def _model_kwargs(self) -> dict[str, Any]:
        m = self.config.model
        return {
            "param_dtype": DTYPES[m.param_dtype],
            "compute_dtype": DTYPES[m.compute_dtype],
            "adaln_impl": m.adaln,
            "attention_impl": "xla",  # replaced below by the mesh-aware wrapper around the configured core
            "remat": m.remat,
        }

    def _on_mesh(self, model: nnx.Module) -> nnx.Module:
        """Single-device kernels (the attention core, the fused AdaLN) run per shard inside ``shard_map``; the
        scanned blocks keep their parameters' placement."""
        from wanloom_trainer.model.attention import get_attention_fn

        core = get_attention_fn(self.config.model.attention)
        if self.config.model.attention == "splash":  # the mesh, not the host, decides Mosaic vs interpreter
            core = functools.partial(core, interpret=not runs_mosaic(self.mesh))
        model.set_attention_fn(
            context_parallel_attention(core, self.shardings, cross=False),
            context_parallel_attention(core, self.shardings, cross=True),
        )
        if self.config.model.adaln == "fused":
            model.set_adaln_fn(sharded_adaln(self.shardings, eps=self.config.model.wan.eps))
        model.set_block_sharding(self.shardings.param)
        return model

    def _abstract_model(self) -> nnx.Module:
        """The model with ``ShapeDtypeStruct`` parameters that carry their target shardings."""
        from wanloom_trainer.model.wan_jax import abstract_model

        model = abstract_model(self.config.model.wan, lora=self.config.lora, **self._model_kwargs())
        graphdef, state = nnx.split(model)
        placed = nnx.from_flat_state(
            [(path, self._placed(path, var.get_value())) for path, var in nnx.to_flat_state(state)]
        )
        return self._on_mesh(nnx.merge(graphdef, placed))

    def _placed(self, path: tuple[Any, ...], abstract: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        from wanloom_trainer.model.params import param_name

        sharding = self.shardings.param(param_name(path), abstract)
        return jax.ShapeDtypeStruct(abstract.shape, abstract.dtype, sharding=sharding)

    def _expert_params(self, expert: int) -> tuple[Any, Any]:
        """Expert ``expert``'s (trained, frozen) parameters (frozen: None in full training), created (or loaded)
        directly into their shardings."""
        from wanloom_trainer.model.wan_jax import init_model, with_lora

        rule, lora = self.shardings.param, self.config.lora
        # Distinct, reproducible initialisations per expert (and per expert's adapters) from the one training seed.
        seed, lora_seed = (int(np.random.SeedSequence([self.config.seed, n]).generate_state(1)[0] >> 1)
                           for n in (expert, 100 + expert))  # fmt: skip
        if self.config.model.weights is None:
            model = init_model(self.config.model.wan, seed=seed, shardings=rule, lora=lora, lora_seed=lora_seed,
                               **self._model_kwargs())  # fmt: skip
        else:
            model = self._load_expert(expert, rule)
            if lora is not None:
                model = with_lora(model, lora, seed=lora_seed, shardings=rule)
        trained, *frozen = nnx.split(model, *self._filters)[1:]
        return trained, frozen[0] if frozen else None

    def _load_expert(self, expert: int, rule: Any) -> nnx.Module:
        from pathlib import Path

        from wanloom_trainer.model.load import load_diffusers_transformer

        weights = self.config.model.weights
        if weights.startswith("gs://"):
            from wanloom_trainer.checkpoint.gcs import stage_weights

            # Every host reads the slices of its own devices, so each stages the files on its local disk.
            subfolders = EXPERT_SUBFOLDERS[: self.config.model.num_experts]
            weights = str(stage_weights(weights, Path(self.config.run_dir) / "weights", subfolders))
        folder = Path(weights) / EXPERT_SUBFOLDERS[expert]
        return load_diffusers_transformer(folder, self.config.model.wan, shardings=rule, **self._model_kwargs())

    # -- Backend protocol ------------------------------------------------------------------------------------------

    def local_ranks(self, num_ranks: int) -> list[int]:
        if num_ranks != self.config.parallel.batch_ranks:
            raise ValueError(f"the plan has {num_ranks} ranks but the mesh has {self.config.parallel.batch_ranks}")
        index_map = self.shardings.batch_b.addressable_devices_indices_map((num_ranks,))
        return sorted({r for index in index_map.values() for r in range(*index[0].indices(num_ranks))})

    def init_state(self) -> JaxState:
        experts = [self._expert_params(e) for e in range(self.config.model.num_experts)]
        params = tuple(jax.tree.leaves(trained) for trained, _ in experts)
        init_opt = jax.jit(self._tx.init, out_shardings=self._opt_shardings)
        ema = tuple(self.step_fns.ema_init(p) for p in params) if self.config.optimizer.ema else ()
        frozen = self._frozen_leaves(experts)
        return JaxState(params=params, opt=tuple(init_opt(p) for p in params), ema=ema, frozen=frozen)

    @staticmethod
    def _frozen_leaves(experts: Sequence[tuple[Any, Any]]) -> tuple[Any, ...]:
        return tuple(jax.tree.leaves(frozen) for _, frozen in experts) if experts[0][1] is not None else ()

    def _frozen(self, state: JaxState, expert: int) -> Any:
        return state.frozen[expert] if state.frozen else []

    def accumulate_gradients(
        self, state: JaxState, slots: Sequence[Slot]
    ) -> tuple[list[Any], list[float], tuple[float, ...], tuple[bool, ...]]:
        """Per expert: the gradient summed over its slots (None for an expert without a slot) and Σ weights·loss;
        each slot's seconds (waiting for its loss ends the slot: the device has run its program) and whether the
        slot compiled a new program."""
        experts = range(len(state.params))
        grads: list[Any] = [None for _ in experts]
        loss_sums: list[list[float]] = [[] for _ in experts]
        seconds, compiled = [], []
        for slot in slots:
            started, programs = time.perf_counter(), self._programs()
            e = slot.expert
            if grads[e] is None:
                grads[e] = self.step_fns.zeros(state.params[e])
            batch, max_segment = self._device_batch(slot)
            grads[e], loss = self.step_fns.accumulate(
                state.params[e], self._frozen(state, e), grads[e], batch, max_segment
            )
            loss_sums[e].append(float(loss))
            seconds.append(time.perf_counter() - started)
            compiled.append(self._programs() != programs)
        return grads, [float(sum(sums)) for sums in loss_sums], tuple(seconds), tuple(compiled)

    def _programs(self) -> int:
        """Programs the accumulate step has compiled so far. jit's cache size is not public API; without it every
        slot counts as a measurement, first calls included."""
        size = getattr(self.step_fns.accumulate, "_cache_size", None)
        return size() if callable(size) else 0

    def train_step(self, state: JaxState, inputs: StepInputs) -> tuple[JaxState, StepOutputs]:
        experts = range(len(state.params))
        compiling = CompileClock.read()
        grads, loss_sums, slot_seconds, slot_compiled = self.accumulate_gradients(state, inputs.slots)
        params, opt, norms = list(state.params), list(state.opt), [None for _ in experts]
        for e in experts:
            if inputs.expert_samples[e] == 0:
                continue  # no samples: parameters and moments stay exactly as they were
            if grads[e] is None:
                raise ValueError(f"step {inputs.step}: expert {e} has {inputs.expert_samples[e]} samples but no slot")
            lr = jnp.asarray(inputs.learning_rates[e], jnp.float32)
            params[e], opt[e], norms[e] = self.step_fns.update(params[e], opt[e], grads[e], lr)
        ema = state.ema
        if self.config.optimizer.ema is not None:
            decay = jnp.asarray(ema_decay(self.config.optimizer.ema, inputs.step), jnp.float32)
            ema = tuple(self.step_fns.ema_update(a, p, decay) for a, p in zip(ema, params, strict=True))
        outputs = StepOutputs(
            tuple(
                ExpertOutputs(
                    samples=inputs.expert_samples[e],
                    loss_sum=loss_sums[e],
                    grad_norm=None if norms[e] is None else float(norms[e]),
                    learning_rate=inputs.learning_rates[e],
                )
                for e in experts
            ),
            slot_seconds,
            slot_compiled,
            compile_seconds=CompileClock.read() - compiling,
        )
        return JaxState(tuple(params), tuple(opt), ema, state.frozen), outputs

    def evaluate(self, state: JaxState, slot: Slot) -> float:
        """Σ weights·loss of one slot through its expert, without gradients (same loss as training)."""
        batch, max_segment = self._device_batch(slot)
        return float(self.step_fns.evaluate(state.params[slot.expert], self._frozen(state, slot.expert), batch,
                                            max_segment))  # fmt: skip

    def predict(self, state: JaxState, expert: int, x: np.ndarray, t: np.ndarray, text: np.ndarray) -> np.ndarray:
        """Replicated inputs through the FSDP-sharded expert (XLA gathers the weights as in training)."""
        if self._predict is None:
            model_of = self.step_fns.model_of

            def forward(params: Any, frozen: Any, x: jax.Array, t: jax.Array, text: jax.Array) -> jax.Array:
                return model_of(params, frozen)(x, t, text).astype(jnp.float32)

            self._predict = jax.jit(forward, out_shardings=self.shardings.replicated)
        placed = [
            jax.make_array_from_callback(a.shape, self.shardings.replicated, lambda index, a=a: a[index])
            for a in (x.astype(np.float32), t.astype(np.float32), text.astype(np.float32))
        ]
        out = self._predict(state.params[expert], self._frozen(state, expert), *placed)
        return np.asarray(out.addressable_data(0))

    def save(self, state: JaxState, next_step: int, meta: Mapping[str, Any]) -> float:
        if self._checkpointer is None:
            raise ValueError("spec.training.checkpoint.uri is unset: checkpoints are disabled")
        return self._checkpointer.save(next_step, self._as_tree(state), meta)

    def checkpoint_pending(self) -> bool:
        return self._checkpointer is not None and self._checkpointer.saving()

    def wait_checkpoint(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.wait()

    def restore(self, state: JaxState | None = None) -> Restored | None:
        if self._checkpointer is None or self._checkpointer.latest_step() is None:
            return None
        step = self._checkpointer.latest_step()
        template = self._as_tree(state) if state is not None else self.abstract_state()
        tree, meta = self._checkpointer.restore(step, template)
        ema = tuple(jax.tree.leaves(a) for a in tree.get("ema", ()))
        frozen = ()
        if self.config.lora is not None:  # the base is not in the checkpoint: it is model.weights, loaded again
            frozen = (
                state.frozen
                if state is not None
                else self._frozen_leaves([self._expert_params(e) for e in range(self.config.model.num_experts)])
            )
        return Restored(JaxState(*self.flat_state(tree["params"], tree["opt"]), ema=ema, frozen=frozen), step, meta)

    def flat_state(self, params: Sequence[Any], opt: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Per expert ``nnx.State`` parameters and optimizer states (``abstract_state``, checkpoints) → what
        ``StepFns`` take: parameters as flat lists, optimizer states over those lists."""
        flat_opt = self._opt_treedefs[0]
        return (
            tuple(jax.tree.leaves(p) for p in params),
            tuple(jax.tree.unflatten(flat_opt, jax.tree.leaves(o)) for o in opt),
        )

    def _as_tree(self, state: JaxState) -> dict[str, Any]:
        """The checkpoint tree: ``nnx.State`` structure, so array keys name the parameters."""
        tree = {
            "params": [jax.tree.unflatten(self._treedef, p) for p in state.params],
            "opt": [jax.tree.unflatten(self._opt_treedefs[1], jax.tree.leaves(o)) for o in state.opt],
        }
        if state.ema:
            tree["ema"] = [jax.tree.unflatten(self._treedef, a) for a in state.ema]
        return tree

    def abstract_state(self) -> dict[str, Any]:
        """``{"params": [...], "opt": [...]}`` per expert as sharded ``ShapeDtypeStruct``s in ``nnx.State`` structure
        (restore templates; ``flat_state`` turns them into ``StepFns`` arguments for AOT compiles)."""
        params = nnx.split(self._abstract_model(), *self._filters)[1]
        shapes, shardings = jax.tree.leaves(jax.eval_shape(self._tx.init, params)), jax.tree.leaves(self._opt_shardings)
        opt = jax.tree.unflatten(
            self._opt_treedefs[1],
            [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(shapes, shardings, strict=True)],
        )
        n = self.config.model.num_experts
        tree = {"params": [params] * n, "opt": [opt] * n}
        if self.config.optimizer.ema is not None:
            ema = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32, sharding=a.sharding), params)
            tree["ema"] = [ema] * n
        return tree

    def abstract_frozen(self) -> list[Any]:
        """One expert's frozen parameters (LoRA's base) as sharded ``ShapeDtypeStruct`` leaves; [] in full
        training (AOT compiles)."""
        parts = nnx.split(self._abstract_model(), *self._filters)
        return jax.tree.leaves(parts[2]) if len(parts) > 2 else []

    def gather_floats(self, value: float) -> list[float]:
        return self.gather_rows([value])[:, 0].tolist()

    def gather_rows(self, values: Sequence[float]) -> np.ndarray:
        mine = np.asarray(values, dtype=np.float64)
        if self.process_count == 1:
            return mine[None]
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(mine), dtype=np.float64).reshape(self.process_count, -1)

    def broadcast_floats(self, values: Sequence[float]) -> list[float]:
        mine = np.asarray(values, dtype=np.float64)
        if self.process_count == 1:
            return mine.tolist()
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.broadcast_one_to_all(mine), dtype=np.float64).tolist()

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.close()

    # -- host → device ---------------------------------------------------------------------------------------------

    def _device_batch(self, slot: Slot) -> tuple[dict[str, jax.Array], int]:
        """The slot as global arrays [R·b', ...] sharded over (data, fsdp), rows padded to b' = 2^k ≥ b, and the
        static longest-segment bound of a packed slot (0 otherwise)."""
        geometry = {_geometry(rr) for rr in slot.ranks.values()}
        if len(geometry) != 1:
            raise ValueError(f"an spmd slot must give every rank the same rows and shapes, got {sorted(geometry)}")
        rows, max_segment = geometry.pop()[:2]
        b = pad_rows(rows)
        padded = {rank: _pad(_host_arrays(rr), b) for rank, rr in slot.ranks.items()}
        num_ranks = self.config.parallel.batch_ranks
        sharding = self.shardings.batch_b
        out = {}
        for key in next(iter(padded.values())):
            sample = next(iter(padded.values()))[key]
            shape = (num_ranks * b, *sample.shape[1:])
            out[key] = jax.make_array_from_callback(
                shape, sharding, lambda index, key=key: _rows_for(padded, key, index[0], b)
            )
        return out, max_segment


def _geometry(rows: RankRows | PackedRows) -> tuple[int, ...]:
    """(rows, longest segment, shapes...) that one compiled program fixes."""
    if isinstance(rows, PackedRows):
        return (rows.rows, rows.max_segment_tokens, *rows.segment_ids.shape[1:], *rows.timesteps.shape[1:])
    return (rows.rows, 0, *rows.latents.shape[1:])


_PACKED_KEYS = ("latents", "noise", "condition", "positions", "segment_ids", "text", "timesteps", "weights")


def _host_arrays(rows: RankRows | PackedRows) -> dict[str, np.ndarray]:
    if isinstance(rows, PackedRows):
        arrays = {k: getattr(rows, k) for k in _PACKED_KEYS if getattr(rows, k) is not None}
        if rows.clean_first_frame is not None:
            arrays["clean_first_frame"] = rows.clean_first_frame
        return arrays
    arrays = {
        "latents": rows.latents,
        "text": rows.text,
        "noise": rows.noise,
        "timesteps": rows.timesteps.astype(np.float32),
        "weights": rows.weights.astype(np.float32),
    }
    if rows.condition is not None:
        arrays["condition"] = rows.condition
    if rows.clean_first_frame is not None:
        arrays["clean_first_frame"] = rows.clean_first_frame.astype(np.float32)
    return arrays


def _pad(arrays: dict[str, np.ndarray], target: int) -> dict[str, np.ndarray]:
    n = arrays["weights"].shape[0]
    if n == target:
        return arrays
    out = {}
    for key, value in arrays.items():
        filler = np.zeros_like(value[:1]) if key == "weights" else value[:1]
        out[key] = np.concatenate([value, np.repeat(filler, target - n, axis=0)])
    return out


def _rows_for(padded: Mapping[int, dict[str, np.ndarray]], key: str, index: slice, b: int) -> np.ndarray:
    start, stop = index.start or 0, index.stop
    ranks = range(start // b, -(-stop // b)) if stop is not None else sorted(padded)
    missing = [r for r in ranks if r not in padded]
    if missing:
        raise ValueError(f"this process was not given rows for data-parallel ranks {missing}")
    block = np.concatenate([padded[r][key] for r in ranks])
    offset = start - ranks[0] * b
    return block[offset : offset + (stop - start if stop is not None else len(block))]
