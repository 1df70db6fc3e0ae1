"""User overrides from ``spec.resources`` merged into the rendered pod, by fixed rules (docs/startup-contract.md):

- nodeSelector: the user's keys are added; on the same key the user's value wins.
- tolerations: the user's are appended; exact duplicates are dropped.
- env: a user variable with a rendered name replaces it in place (keeping the order ``$(VAR)`` relies on); new
  names are appended.
- volumes / volumeMounts: appended. The operator's own volume names and mount paths (``keys.OPERATOR_VOLUMES``)
  are reserved, and a mount must name a declared volume: validation (and the CRD) refuse the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from wanloom_api.trainingjob import ResourcesSpec


def merge_node_selector(rendered: dict[str, str], user: dict[str, str]) -> dict[str, str]:
    return {**rendered, **user}


def merge_tolerations(rendered: Sequence[dict[str, Any]], res: ResourcesSpec) -> list[dict[str, Any]]:
    merged = [dict(t) for t in rendered]
    for tol in res.tolerations:
        item = tol.model_dump(by_alias=True, exclude_none=True)
        if item not in merged:
            merged.append(item)
    return merged


def merge_env(rendered: Sequence[dict[str, Any]], res: ResourcesSpec) -> list[dict[str, Any]]:
    merged = [dict(v) for v in rendered]
    index = {v["name"]: i for i, v in enumerate(merged)}
    for var in res.env:
        item = {"name": var.name, "value": var.value}
        if var.name in index:
            merged[index[var.name]] = item
        else:
            index[var.name] = len(merged)
            merged.append(item)
    return merged


def merge_volumes(
    rendered: Sequence[dict[str, Any]], rendered_mounts: Sequence[dict[str, Any]], res: ResourcesSpec
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) with the user's appended (validation has checked names and paths)."""
    return [*rendered, *res.volumes], [*rendered_mounts, *res.volume_mounts]
