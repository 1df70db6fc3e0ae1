"""Names stay within Kubernetes' 63-character limits, deterministically and uniquely."""

from __future__ import annotations

import pytest

from wanloom_operator.render.names import fit_label_value, is_dns1035, job_names


@pytest.mark.parametrize(
    ("name", "rjob", "replicas", "pods"),
    [
        ("short", "slice", 1, 1),
        ("a" * 63, "slice", 4, 128),
        ("wan22.t2v.a14b-with-a-rather-long-experiment-name-v2", "slice", 1024, 1024),
        ("9starts-with-a-digit", "node", 1, 16),
        ("x" * 253, "node", 1, 4096),
    ],
)
def test_generated_names_fit(name: str, rjob: str, replicas: int, pods: int) -> None:
    names = job_names(name, rjob, replicas, pods)
    longest_pod = f"{names.pod_hostname(replicas - 1, pods - 1)}-abcde"
    assert is_dns1035(longest_pod), longest_pod
    assert is_dns1035(names.subdomain) and len(names.configmap) <= 253
    assert len(names.job_label) <= 63
    assert job_names(name, rjob, replicas, pods) == names  # deterministic: a restarted operator finds it again


def test_names_that_fit_are_kept() -> None:
    names = job_names("wan22-t2v", "slice", 2, 16)
    assert (names.jobset, names.configmap, names.job_label) == ("wan22-t2v", "wan22-t2v-config", "wan22-t2v")
    assert names.pod_fqdn() == "wan22-t2v-slice-0-0.wan22-t2v"


def test_shortened_names_stay_unique() -> None:
    base = "experiment-" + "z" * 60
    a, b = job_names(base + "-a", "node", 1, 2), job_names(base + "-b", "node", 1, 2)
    assert a.jobset != b.jobset and a.job_label != b.job_label
    # Sanitising '.' must not merge two different TrainingJobs into one JobSet.
    assert job_names("a.b", "node", 1, 1).jobset != job_names("a-b", "node", 1, 1).jobset


def test_label_values() -> None:
    assert fit_label_value("ok.name-1") == "ok.name-1"
    long = fit_label_value("v" * 100)
    assert len(long) <= 63 and long[0].isalnum() and long[-1].isalnum()
