"""Generate the TrainingJob CustomResourceDefinition from the pydantic models (pure; `wanloom crd` prints it).

Pydantic emits JSON Schema 2020-12; Kubernetes wants a *structural* OpenAPI v3 schema: no ``$ref``, no
``anyOf`` for optionals, boolean ``exclusiveMinimum``, and cross-field rules as ``x-kubernetes-validations``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from wanloom_api import latentdataset as lds
from wanloom_api import trainingjob as tj

_DROP_KEYS = {"title", "discriminator"}


def _model_index(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Map JSON-schema definition names to their model classes (for their CEL rules)."""
    index: dict[str, type[BaseModel]] = {}

    def visit(model: type[BaseModel]) -> None:
        if model.__name__ in index:
            return
        index[model.__name__] = model
        for field in model.model_fields.values():
            for arg in _type_args(field.annotation):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    visit(arg)

    visit(root)
    return index


def _type_args(annotation: Any) -> list[Any]:
    args = getattr(annotation, "__args__", None)
    if not args:
        return [annotation]
    return [a for arg in args for a in _type_args(arg)]


INTEGER_RULE = {"rule": "self == self", "message": "must be an integer (2, not 2.0)"}


def _validations(rules: Any) -> list[dict[str, str]]:
    keys = ("rule", "message", "fieldPath")
    return [dict(zip(keys, rule, strict=False)) for rule in rules]


def _convert(node: Any, defs: dict[str, Any], models: dict[str, type[BaseModel]]) -> Any:
    if isinstance(node, list):
        return [_convert(n, defs, models) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        out = _convert(defs[name], defs, models)
        rules = getattr(models.get(name), "cel_rules", ())
        if rules:
            out["x-kubernetes-validations"] = _validations(rules)
        extra = {k: v for k, v in node.items() if k != "$ref"}
        out.update(_convert(extra, defs, models))
        return out
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        if len(options) == 1:
            rest = {k: v for k, v in node.items() if k not in ("anyOf", "default")}
            merged = {**_convert(options[0], defs, models), **_convert(rest, defs, models)}
            if node.get("default") is not None:
                merged["default"] = node["default"]
            return merged
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP_KEYS or key == "$defs":
            continue
        if key == "additionalProperties" and value is False:
            continue  # structural schemas prune unknown fields; `false` beside `properties` is rejected
        if key in ("exclusiveMinimum", "exclusiveMaximum"):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "prefixItems":
            # Fixed-length tuples (betas): same item schema, bounded length.
            out["items"] = _convert(value[0], defs, models)
            out["minItems"] = out["maxItems"] = len(value)
        elif key == "const":
            out["enum"] = [value]
        elif key == "properties":
            out[key] = {k: _convert(v, defs, models) for k, v in value.items()}
        else:
            out[key] = _convert(value, defs, models)
    if out.get("type") == "array" and "items" not in out:
        out["items"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    if out.get("type") == "object" and "x-kubernetes-preserve-unknown-fields" in out:
        out.pop("additionalProperties", None)
    if out.get("format") == "date-time":
        out["type"] = "string"
    if out.get("type") == "integer":
        # The schema alone admits 2.0 for an integer; a CEL rule reading the field refuses it (the value is not an
        # int), so without this rule 2.0 passes or fails depending on which rules read the field. Validation
        # refuses it, so does every integer field here.
        out.setdefault("x-kubernetes-validations", []).append(INTEGER_RULE)
    return out


def _schema_of(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.get("$defs", {})
    models = _model_index(model)
    root = _convert({k: v for k, v in raw.items() if k != "$defs"}, defs, models)
    rules = getattr(model, "cel_rules", ())
    if rules:
        root["x-kubernetes-validations"] = _validations(rules)
    return root


def _default_objects(schema: dict[str, Any]) -> None:
    """Default optional object fields to their children's defaults so the API server fills them in and
    ``kubectl get -o yaml`` shows the effective configuration.

    The default is written out in full, not as ``{}``: the API server checks a default against the node's CEL
    rules as written, before nested defaults apply, so ``{}`` fails any rule that reads a child key. Required
    fields get no default (one would only hide a missing field).
    """
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if prop.get("type") == "object" and "properties" in prop:
            _default_objects(prop)
            optional = name not in required and prop.get("x-wanloom-optional") is None
            if optional and not prop.get("required") and "default" not in prop:
                prop["default"] = {k: c["default"] for k, c in prop["properties"].items() if "default" in c}
        elif prop.get("type") == "array" and isinstance(prop.get("items"), dict):
            _default_objects(prop["items"])


def _spec_schema(model: type[BaseModel], optional: tuple[tuple[str, ...], ...]) -> dict[str, Any]:
    """``model``'s schema with optional objects defaulted, except those at the ``optional`` paths: sub-objects
    whose mere presence means something must not be defaulted into existence."""
    spec = _schema_of(model)
    for path in optional:
        node = spec
        for part in path:
            node = node["properties"][part]
        node["x-wanloom-optional"] = True
    _default_objects(spec)
    _strip_markers(spec)
    return spec


def _strip_markers(node: Any) -> None:
    if isinstance(node, dict):
        node.pop("x-wanloom-optional", None)
        for value in node.values():
            _strip_markers(value)
    elif isinstance(node, list):
        for value in node:
            _strip_markers(value)


TRAININGJOB_OPTIONAL = (
    ("resources", "tpu"),
    ("resources", "gpu"),
    ("resources", "cpu"),
    ("data", "synthetic"),
    ("optimizer", "ema"),
    ("lora",),
    ("validation",),
    ("export",),
    ("tracking", "wandb"),
    ("resources", "podRequests"),
)
LATENTDATASET_OPTIONAL = (("resources", "cpu"), ("resources", "gpu"), ("resources", "tpu"))


def trainingjob_crd() -> dict[str, Any]:
    """The CustomResourceDefinition for TrainingJob (apiextensions.k8s.io/v1)."""
    return _crd(
        kind=tj.KIND,
        plural=tj.PLURAL,
        singular=tj.SINGULAR,
        short_names=tj.SHORT_NAMES,
        columns=tj.PRINTER_COLUMNS,
        description="A Wan 2.2 training run: model, data, routing, AdaptiveLoad, resources.",
        spec=_spec_schema(tj.TrainingJobSpec, TRAININGJOB_OPTIONAL),
        status=_schema_of(tj.TrainingJobStatus),
    )


def latentdataset_crd() -> dict[str, Any]:
    """The CustomResourceDefinition for LatentDataset (apiextensions.k8s.io/v1)."""
    return _crd(
        kind=lds.KIND,
        plural=lds.PLURAL,
        singular=lds.SINGULAR,
        short_names=lds.SHORT_NAMES,
        columns=lds.PRINTER_COLUMNS,
        description="Captioned media encoded into training latents by an Indexed Job: plan, encode, finalize.",
        spec=_spec_schema(lds.LatentDatasetSpec, LATENTDATASET_OPTIONAL),
        status=_schema_of(lds.LatentDatasetStatus),
    )


def all_crds() -> list[dict[str, Any]]:
    return [trainingjob_crd(), latentdataset_crd()]


def _crd(
    *,
    kind: str,
    plural: str,
    singular: str,
    short_names: tuple[str, ...],
    columns: tuple[dict[str, Any], ...],
    description: str,
    spec: dict[str, Any],
    status: dict[str, Any],
) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{tj.GROUP}"},
        "spec": {
            "group": tj.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": singular,
                "shortNames": list(short_names),
                "categories": ["all", "wanloom"],
            },
            "versions": [
                {
                    "name": tj.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [dict(c) for c in columns],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": description,
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }
