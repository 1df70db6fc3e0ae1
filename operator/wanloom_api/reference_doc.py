"""Render docs/trainingjob.md, the field reference, from the same models the CRD comes from (`wanloom docs`)."""

from __future__ import annotations

import enum
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from wanloom_api import latentdataset as lds
from wanloom_api import trainingjob as tj

_INTRO = """# TrainingJob reference (`wanloom.dev/v1alpha1`)

Generated from `wanloom_api.trainingjob` by `wanloom docs > docs/trainingjob.md`; a test fails when it
drifts. `wanloom validate FILE` runs every rule below plus the cross-field rules listed at the end, and reports
each problem with its field path; `kubectl apply` refuses the same manifests (the CRD carries the rules as CEL, and
a test compares the two on generated broken manifests). The API server's semantics hold in both: camelCase keys
only, no type coercion (`"200"` is not an integer, `2.0` neither), integers within int64, finite numbers, `key:
null` the same as leaving the key out, Kubernetes name rules for `metadata`. Examples: `jobs/`.
"""

_CROSS_FIELD = """## Cross-field rules

- `resources`: exactly one of `tpu`, `gpu`, `cpu`; `tpu` runs `backend: jax` only.
- `resources.tpu.topology`: a tpu7x shape (1x1x1, 2x2x1, 2x2x2, 2x2x4, 2x4x4, or AxBxC with A, B, C multiples
  of 4, A <= B <= C, at most 144 4x4x4 cubes). Hosts (pods) per slice = chips / 4; JAX devices = 2 per chip.
- `resources.gpu.perNode` divides 8 for h100, h200 and b200; the torch backend on `cpu` takes `devicesPerNode: 1`.
- `parallelism`: data x fsdp x context x tensor equals the job's devices; one degree may be -1 to fill the rest.
- `training.globalBatch` >= data x fsdp (every data-parallel rank gets a sample).
- `routing.boundaryRatio` must be unset for the single-model `wan2.2-ti2v-5b`, `tiny-ti2v` and `mini-ti2v`;
  defaults: 0.875 T2V, tiny and mini-t2v, 0.900 I2V, tiny-i2v and mini-i2v.
- `training.imageToVideoFraction` only for the unified `wan2.2-ti2v-5b`, `tiny-ti2v` and `mini-ti2v` (default 0.5).
- `kernels.attention`: `splash` needs TPU; `sdpa`/`flash` need the torch backend; `xla` the jax backend.
- URIs (`model.weights`, `data.uri`, `data.index`, `training.checkpoint.uri`, `adaptiveLoad.benchFile`) are
  `gs://bucket/prefix` or paths.
- `optimizer.warmupSteps` <= `training.steps`; bucket frames are 4k+1 and sides multiples of 16.
"""


_DATASET_INTRO = """
# LatentDataset reference (`wanloom.dev/v1alpha1`, short name `lds`)

A corpus of captioned media encoded into the latent shards a TrainingJob reads (format: docs/data-format.md). The
operator runs it as three batch Jobs: plan (counts the inputs and work units), encode (an Indexed Job, one
completion per unit of `samplesPerShard` inputs, `workers` pods at a time), finalize (writes `index.json` and
`skipped.json`); `wanloom data build FILE` runs the same steps on one machine. A TrainingJob names it in
`spec.data.dataset`. Walk-through: docs/prepare-on-cluster.md. Example: `jobs/datasets/tiny-corpus.yaml`.

## Dataset fields
"""

_DATASET_RULES = """## Dataset rules

- `source`: exactly one of `manifest` and `prefix`; `resources`: exactly one of `cpu`, `gpu` and `tpu` (a TPU pod
  runs the JAX encoders).
- Bucket frames are 4k+1 and sides multiples of 16, each bucket listed once; URIs are `gs://bucket/prefix` or paths.
- Inputs that cannot be used (a malformed row, a missing or empty object, an undecodable file, no caption, a clip
  shorter than every bucket, a repeated id) are skipped and listed in `skipped.json` by kind; more than
  `maxBadSamples` of them fail the dataset (no `index.json` is written) with the count and the first reasons.
"""


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None))
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return "map"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return getattr(annotation, "__name__", str(annotation))


def _nested_models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _nested_models(a)]


def _default(field: Any) -> str:
    if field.default_factory is not None:
        return ""
    if field.default is PydanticUndefined:
        return "required"
    return "" if field.default is None else f"`{field.default}`"


def _section(model: type[BaseModel]) -> list[str]:
    lines = [f"### {model.__name__}", "", "| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        bounds = [f"{k} {v}" for m in field.metadata for k, v in _bounds(m)]
        desc = (field.description or "") + (f" ({', '.join(bounds)})" if bounds else "")
        lines.append(f"| `{field.alias or name}` | {_type_name(field.annotation)} | {_default(field)} | {desc} |")
    return [*lines, ""]


def _bounds(meta: Any) -> list[tuple[str, Any]]:
    symbols = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "pattern": "matches"}
    return [(sym, getattr(meta, key)) for key, sym in symbols.items() if getattr(meta, key, None) is not None]


def trainingjob_reference() -> str:
    """The markdown field reference of TrainingJob's spec and status, then LatentDataset's (models they share are
    listed once, under TrainingJob)."""
    seen: list[type[BaseModel]] = []
    jobs = _walk([tj.TrainingJobSpec, tj.TrainingJobStatus], seen)
    datasets = _walk([lds.LatentDatasetSpec, lds.LatentDatasetStatus], seen)
    body = [line for model in jobs for line in _section(model)]
    dataset_body = [line for model in datasets for line in _section(model)]
    return "\n".join([_INTRO, "## Fields", "", *body, _CROSS_FIELD, _DATASET_INTRO, *dataset_body, _DATASET_RULES])


def _walk(roots: list[type[BaseModel]], seen: list[type[BaseModel]]) -> list[type[BaseModel]]:
    """The models reachable from ``roots`` that are not in ``seen`` yet, breadth first (added to ``seen``)."""
    found: list[type[BaseModel]] = []
    queue = list(roots)
    while queue:
        model = queue.pop(0)
        if model in seen:
            continue
        seen.append(model)
        found.append(model)
        for field in model.model_fields.values():
            queue += _nested_models(field.annotation)
    return found
