"""The CRD is generated from the models, committed into the chart, structural, and enforces the CEL rules."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from wanloom_api.crd import trainingjob_crd
from wanloom_cli.api_commands import CHART_CRD_PATH, chart_crd_text

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "wanloom"


def _schema() -> dict[str, Any]:
    return trainingjob_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_committed_crd_matches_models() -> None:
    committed = (CHART / CHART_CRD_PATH).read_text()
    assert committed == chart_crd_text(), "helm CRD drifted from the models: run `make generate` and commit"


@pytest.mark.parametrize("k8s", ["1.30.0", "1.33.0"])
def test_crd_validates_strict(k8s: str) -> None:
    kubernetes_validate.validate(trainingjob_crd(), k8s, strict=True)


def _walk(node: Any, path: str = "") -> list[tuple[str, dict]]:
    found = []
    if isinstance(node, dict):
        found.append((path, node))
        for key, value in node.items():
            found += _walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _walk(value, f"{path}[{i}]")
    return found


def test_schema_is_structural() -> None:
    for path, node in _walk(_schema()):
        assert "$ref" not in node and "anyOf" not in node, path
        if "properties" in node:
            assert node.get("type") == "object", path
            assert "additionalProperties" not in node, path
        if node.get("type") == "array":
            assert "items" in node, path


def test_names_columns_and_status() -> None:
    spec = trainingjob_crd()["spec"]
    assert spec["names"]["shortNames"] == ["tj"] and spec["scope"] == "Namespaced"
    version = spec["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Phase",
        "Step",
        "Steps",
        "Loss",
        "Step time",
        "Load CV",
        "Restarts",
        "Age",
    ]


def test_cel_rules_present_where_cross_field() -> None:
    spec = _schema()["properties"]["spec"]
    rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
    assert any("ti2v-5b" in r for r in rules)
    resource_rules = [r["rule"] for r in spec["properties"]["resources"]["x-kubernetes-validations"]]
    assert any("has(self.tpu)" in r for r in resource_rules)


def test_defaults_and_bounds_in_schema() -> None:
    props = _schema()["properties"]["spec"]["properties"]
    assert props["routing"]["properties"]["mode"]["default"] == "per-sample"
    ratio = props["routing"]["properties"]["boundaryRatio"]
    assert ratio["minimum"] == 0 and ratio["exclusiveMinimum"] is True and ratio["exclusiveMaximum"] is True
    assert props["resources"]["properties"]["gpu"]["properties"]["type"]["enum"] == ["h100", "h200", "b200", "other"]
    assert "default" not in props["resources"]["properties"]["tpu"]


def _as_jsonschema(node: Any) -> Any:
    """OpenAPI v3 (boolean exclusive bounds) -> JSON Schema draft 4, which has the same semantics."""
    node = copy.deepcopy(node)
    for _, sub in _walk(node):
        for key in [k for k in sub if k.startswith("x-kubernetes")]:
            del sub[key]
    return node


@pytest.mark.parametrize("path", sorted((ROOT / "jobs").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate_against_crd_schema(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    jsonschema.Draft4Validator(_as_jsonschema(_schema())).validate(doc)


def test_crd_schema_rejects_bad_enum() -> None:
    doc = yaml.safe_load((ROOT / "jobs" / "tiny-local.yaml").read_text())
    doc["spec"]["model"]["variant"] = "wan9"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(_as_jsonschema(_schema())).validate(doc)


def test_reference_doc_matches_models() -> None:
    from wanloom_api.reference_doc import trainingjob_reference

    committed = (ROOT / "docs" / "trainingjob.md").read_text()
    assert committed == trainingjob_reference(), "docs/trainingjob.md drifted: run `wanloom docs > docs/trainingjob.md`"


def _object_nodes(node: dict, path: str = "spec"):
    for name, child in node.get("properties", {}).items():
        if child.get("type") == "object":
            yield f"{path}.{name}", node, name, child
            yield from _object_nodes(child, f"{path}.{name}")


def test_object_defaults_are_written_out_for_their_cel_rules() -> None:
    """The API server checks a default against its node's CEL rules before nested defaults apply: a `{}` default
    under a rule that reads a child key makes it refuse the whole CRD. Each defaulted object therefore carries
    every child default, and a required field carries none (it would only hide the missing field)."""
    spec = trainingjob_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    defaulted = 0
    for path, parent, name, node in _object_nodes(spec):
        if "default" not in node:
            continue
        defaulted += 1
        assert name not in parent.get("required", ()), f"{path} is required but has a default"
        children = {k: c["default"] for k, c in node.get("properties", {}).items() if "default" in c}
        assert node["default"] == children, path
    assert defaulted >= 5


def _optional_objects(model: type, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Paths of the spec's ``X | None = None`` sub-objects: their presence turns something on."""
    import types
    import typing

    from pydantic import BaseModel

    out = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        args = typing.get_args(field.annotation)
        inner = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if (
            isinstance(field.annotation, types.UnionType | typing._UnionGenericAlias)
            and inner
            and field.default is None
        ):
            out.append((*path, key))
        nested = field.annotation if isinstance(field.annotation, type) else None
        if nested is not None and issubclass(nested, BaseModel):
            out.extend(_optional_objects(nested, (*path, key)))
    return out


def test_optional_objects_are_never_defaulted_into_existence() -> None:
    """An API-server default for e.g. spec.optimizer.ema would turn EMA on for every job sent through kubectl."""
    from wanloom_api.trainingjob import TrainingJobSpec

    spec = _schema()["properties"]["spec"]
    paths = _optional_objects(TrainingJobSpec)
    assert {("optimizer", "ema"), ("validation",), ("export",), ("tracking", "wandb")} <= set(paths)
    for path in paths:
        parent, node = spec, spec
        for key in path:
            parent, node = node, node["properties"][key]
        assert "default" not in node, f"spec.{'.'.join(path)} gets a default"
        assert path[-1] not in parent.get("default", {}), f"the default of spec.{'.'.join(path[:-1])} sets it"
