"""User overrides from ``spec.resources`` merged into the rendered pod, by fixed rules (docs/startup-contract.md):

- nodeSelector: the user's keys are added; on the same key the user's value wins.
- tolerations: the user's are appended; exact duplicates are dropped.
- env: a user variable with a rendered name replaces it in place (keeping the order ``$(VAR)`` relies on); new
  names are appended.
- volumes / volumeMounts: appended. The operator's own volumes and mount paths are reserved: reusing one, or
  mounting a volume that does not exist, is an error naming the field (the Job would be rejected later, out of
  sight).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from wanloom_operator.api.trainingjob import ResourcesSpec
from wanloom_operator.api.validation import FieldError


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
    """(volumes, volumeMounts) with the user's appended; :func:`volume_errors` checks them first."""
    return [*rendered, *res.volumes], [*rendered_mounts, *res.volume_mounts]


def volume_errors(
    rendered: Sequence[dict[str, Any]], rendered_mounts: Sequence[dict[str, Any]], res: ResourcesSpec
) -> list[FieldError]:
    """Every problem with the user's volumes and mounts, each naming its field path."""
    return list(_volume_errors(rendered, rendered_mounts, res))


def _volume_errors(
    rendered: Sequence[dict[str, Any]], rendered_mounts: Sequence[dict[str, Any]], res: ResourcesSpec
) -> Iterator[FieldError]:
    reserved_names = {v["name"] for v in rendered}
    reserved_paths = {m["mountPath"] for m in rendered_mounts}
    known = set(reserved_names)
    for i, volume in enumerate(res.volumes):
        name = volume.get("name")
        path = f"spec.resources.volumes[{i}].name"
        if not isinstance(name, str) or not name:
            yield FieldError(path, "every volume needs a name")
        elif name in reserved_names:
            yield FieldError(
                path, f"{name!r} is reserved by the operator (reserved: {', '.join(sorted(reserved_names))})"
            )
        elif name in known:
            yield FieldError(path, f"duplicate volume name {name!r}")
        else:
            known.add(name)
    for i, mount in enumerate(res.volume_mounts):
        path = f"spec.resources.volumeMounts[{i}]"
        name, mount_path = mount.get("name"), mount.get("mountPath")
        if not isinstance(name, str) or not isinstance(mount_path, str):
            yield FieldError(path, "a volumeMount needs name and mountPath")
        elif name not in known - reserved_names:
            yield FieldError(f"{path}.name", f"no volume named {name!r} in spec.resources.volumes")
        elif mount_path.rstrip("/") in reserved_paths:
            yield FieldError(
                f"{path}.mountPath", f"{mount_path!r} is used by the operator ({', '.join(sorted(reserved_paths))})"
            )
