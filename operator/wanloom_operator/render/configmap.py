"""The trainer's configuration: the validated TrainingJob as YAML in a ConfigMap, and the hash that identifies it.

The trainer reads ``$WANLOOM_CONFIG`` (``keys.CONFIG_MOUNT_DIR/keys.CONFIG_FILE_NAME``) and validates it again with
``api.validation``, so the document carries every default explicitly and nothing the API would reject. ``suspend``
is left out: it is the operator's business, and toggling it must not change what the trainer sees.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml

from wanloom_api import keys
from wanloom_api.trainingjob import TrainingJob

_VOLATILE_SPEC_FIELDS = {"suspend"}


def config_document(job: TrainingJob) -> dict[str, Any]:
    """The TrainingJob as the trainer sees it: defaults filled in, no status, no cluster bookkeeping."""
    spec = job.spec.model_dump(by_alias=True, mode="json", exclude_none=True, exclude=_VOLATILE_SPEC_FIELDS)
    metadata = {"name": job.metadata.name}
    if job.metadata.namespace:
        metadata["namespace"] = job.metadata.namespace
    return {"apiVersion": job.api_version, "kind": job.kind, "metadata": metadata, "spec": spec}


def spec_hash(job: TrainingJob) -> str:
    """Identity of everything a running JobSet cannot change in place (all of the spec except ``suspend``)."""
    spec = config_document(job)["spec"]
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def config_yaml(job: TrainingJob) -> str:
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return yaml.dump(config_document(job), Dumper=dumper, sort_keys=False, width=120)


def configmap_data(job: TrainingJob) -> dict[str, str]:
    return {keys.CONFIG_FILE_NAME: config_yaml(job)}
