"""Names of what the operator creates, kept within Kubernetes' 63-character limits.

JobSet derives names from its own: Job ``<js>-<rjob>-<jobIdx>``, pod hostname ``<js>-<rjob>-<jobIdx>-<podIdx>``
and pod name ``<hostname>-<5 random chars>``; its webhook rejects a JobSet whose longest generated pod name is not a
DNS-1035 label (<= 63 chars, ``[a-z]([-a-z0-9]*[a-z0-9])?``). TrainingJob names may be longer or contain dots, so
the JobSet name is the TrainingJob name when it fits and otherwise a truncated name plus a hash of the original:
deterministic (an operator restart finds the same JobSet) and unique per TrainingJob name.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

MAX_LABEL = 63  # DNS-1035/1123 labels and label values
POD_SUFFIX = len("-abcde")  # the random suffix of pod names, as JobSet's webhook counts it
_HASH_LEN = 8
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@dataclass(frozen=True)
class Names:
    """Every name derived from one TrainingJob."""

    jobset: str
    replicated_job: str
    configmap: str
    subdomain: str
    job_label: str  # value of keys.LABEL_JOB_NAME (label values are limited to 63 chars too)

    def pod_hostname(self, job_index: int, pod_index: int) -> str:
        return f"{self.jobset}-{self.replicated_job}-{job_index}-{pod_index}"

    def pod_fqdn(self, job_index: int = 0, pod_index: int = 0) -> str:
        """The stable DNS name of one pod (JobSet's headless Service is named after the subdomain)."""
        return f"{self.pod_hostname(job_index, pod_index)}.{self.subdomain}"


def job_names(trainingjob: str, replicated_job: str, replicas: int, pods_per_job: int) -> Names:
    """Names for a TrainingJob whose JobSet has ``replicas`` Jobs of ``pods_per_job`` pods each."""
    longest_tail = f"-{replicated_job}-{replicas - 1}-{pods_per_job - 1}"
    jobset = fit_dns1035(trainingjob, MAX_LABEL - len(longest_tail) - POD_SUFFIX)
    return Names(
        jobset=jobset,
        replicated_job=replicated_job,
        configmap=f"{jobset}-config",
        subdomain=jobset,
        job_label=fit_label_value(trainingjob),
    )


def fit_dns1035(name: str, budget: int) -> str:
    """``name`` itself if it is a DNS-1035 label of at most ``budget`` chars, else a sanitised prefix + hash."""
    if budget < _HASH_LEN + 2:
        raise ValueError(f"no room for a name: {budget} characters left for {name!r}")
    if len(name) <= budget and _DNS1035.match(name):
        return name
    clean = re.sub(r"[^a-z0-9-]", "-", name.lower())
    if not clean[:1].isalpha():
        clean = f"tj-{clean}"
    prefix = clean[: budget - _HASH_LEN - 1].rstrip("-")
    return f"{prefix}-{_digest(name)}"


def fit_label_value(value: str) -> str:
    """``value`` if it is a valid label value, else a truncated value + hash (still unique per input)."""
    if len(value) <= MAX_LABEL and _LABEL_VALUE.match(value):
        return value
    clean = re.sub(r"[^A-Za-z0-9_.-]", "-", value)
    prefix = clean[: MAX_LABEL - _HASH_LEN - 1].strip("-_.")
    return f"{prefix}-{_digest(value)}" if prefix else _digest(value)


def is_dns1035(name: str) -> bool:
    return len(name) <= MAX_LABEL and bool(_DNS1035.match(name))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:_HASH_LEN]
