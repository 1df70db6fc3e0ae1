"""User overrides from ``spec.resources`` merged into the rendered pod, by fixed rules (docs/startup-contract.md):

- nodeSelector: the user's keys are added; on the same key the user's value wins.
- tolerations: the user's are appended; exact duplicates are dropped.
- env: the chart's ``trainerPods.env``, then the TrainingJob's; a variable with a rendered name replaces it in place
  (keeping the order ``$(VAR)`` relies on); new names are appended.
- imagePullSecrets: the chart's, then the TrainingJob's (each once).
- pod labels and annotations: the chart's ``trainerPods``, then the TrainingJob's ``podLabels`` / ``podAnnotations``
  (the job's win on the same key); keys wanloom, JobSet, Kueue and GKE set are refused by validation.
- requests: ``podRequests`` replaces the CPU and memory requests derived from the machine; device requests stay.
- volumes / volumeMounts: appended. The operator's own volume names and mount paths (``keys.OPERATOR_VOLUMES``)
  are reserved, and a mount must name a declared volume: validation (and the CRD) refuse the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from wanloom_api.trainingjob import EnvVar, ResourcesSpec


def merge_node_selector(rendered: dict[str, str], user: dict[str, str]) -> dict[str, str]:
    return {**rendered, **user}


def merge_tolerations(rendered: Sequence[dict[str, Any]], res: ResourcesSpec) -> list[dict[str, Any]]:
    merged = [dict(t) for t in rendered]
    for tol in res.tolerations:
        item = tol.model_dump(by_alias=True, exclude_none=True)
        if item not in merged:
            merged.append(item)
    return merged


def merge_env(rendered: Sequence[dict[str, Any]], *layers: Sequence[EnvVar]) -> list[dict[str, Any]]:
    merged = [dict(v) for v in rendered]
    index = {v["name"]: i for i, v in enumerate(merged)}
    for var in (v for layer in layers for v in layer):
        item = {"name": var.name, "value": var.value}
        if var.name in index:
            merged[index[var.name]] = item
        else:
            index[var.name] = len(merged)
            merged.append(item)
    return merged


def merge_pull_secrets(*layers: Sequence[str]) -> list[dict[str, str]]:
    names = list(dict.fromkeys(name for layer in layers for name in layer))
    return [{"name": name} for name in names]


def merge_requests(rendered: dict[str, str], res: ResourcesSpec) -> dict[str, str]:
    wanted = res.pod_requests.model_dump(exclude_none=True) if res.pod_requests is not None else {}
    return {**rendered, **wanted}


def merge_volumes(
    rendered: Sequence[dict[str, Any]], rendered_mounts: Sequence[dict[str, Any]], res: ResourcesSpec
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) with the user's appended (validation has checked names and paths)."""
    return [*rendered, *res.volumes], [*rendered_mounts, *res.volume_mounts]
