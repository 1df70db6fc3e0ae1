"""User overrides (spec.resources) merge into the rendered pod by the documented rules; clashes name the field."""

from __future__ import annotations

from collections.abc import Callable

from wanloom_api import keys
from wanloom_api.trainingjob import TrainingJob
from wanloom_operator.render.jobset import pod_spec, render_trainingjob, trainer_container
from wanloom_operator.settings import OperatorSettings


def test_overrides_merge_predictably(
    make_job: Callable[..., TrainingJob], settings: OperatorSettings, check_jobset: Callable[..., None]
) -> None:
    resources = {
        "gpu": {"type": "h100", "nodes": 2},
        "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-mega-80gb", "pool": "train"},
        "tolerations": [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},  # duplicate: dropped
            {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"},
        ],
        "env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "EXTRA", "value": "1"}],
        "volumes": [{"name": "cache", "emptyDir": {}}],
        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
    }
    js = render_trainingjob(make_job(resources), settings).jobset
    check_jobset(js)
    spec, container = pod_spec(js), trainer_container(js)
    assert spec["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-mega-80gb", "pool": "train"}
    assert [t["key"] for t in spec["tolerations"]] == ["nvidia.com/gpu", "spot"]
    names = [v["name"] for v in container["env"]]
    assert names.count("NCCL_DEBUG") == 1 and names[-1] == "EXTRA"
    nccl = next(v for v in container["env"] if v["name"] == "NCCL_DEBUG")
    assert nccl == {"name": "NCCL_DEBUG", "value": "INFO"}
    # The replaced variable keeps its place: later $(VAR) references still resolve.
    assert names.index("NCCL_DEBUG") < names.index("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    assert spec["volumes"][-1] == {"name": "cache", "emptyDir": {}}
    assert container["volumeMounts"][-1] == {"name": "cache", "mountPath": "/cache"}


def test_user_env_can_override_contract_values(
    make_job: Callable[..., TrainingJob], settings: OperatorSettings
) -> None:
    job = make_job({"cpu": {}, "env": [{"name": keys.ENV_METRICS_PORT, "value": "9999"}]})
    env = trainer_container(render_trainingjob(job, settings).jobset)["env"]
    assert {"name": keys.ENV_METRICS_PORT, "value": "9999"} in env


def test_pod_metadata_pull_secrets_requests_and_chart_defaults_layer_under_the_job(
    make_job: Callable[..., TrainingJob], check_jobset: Callable[..., None]
) -> None:
    settings = OperatorSettings.from_env({
        "WANLOOM_TRAINER_POD_DEFAULTS": '{"imagePullSecrets": ["registry", "shared"], "labels": {"team": "ml"}, '
        '"annotations": {"owner": "platform"}, "env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}, '
        '{"name": "NCCL_DEBUG", "value": "WARN"}]}',
    })  # fmt: skip
    resources = {
        "gpu": {"type": "h100", "nodes": 2},
        "imagePullSecrets": ["shared", "mine"],
        "podLabels": {"team": "video", "cost-center": "42"},
        "podAnnotations": {"note": "ablation 3"},
        "podRequests": {"cpu": "100", "memory": "1024Gi"},
        "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
    }
    js = render_trainingjob(make_job(resources), settings).jobset
    check_jobset(js)
    template = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    spec, container = pod_spec(js), trainer_container(js)
    assert spec["imagePullSecrets"] == [{"name": "registry"}, {"name": "shared"}, {"name": "mine"}]
    labels = template["metadata"]["labels"]
    assert labels["team"] == "video" and labels["cost-center"] == "42"
    assert labels[keys.LABEL_MANAGED_BY] == keys.MANAGED_BY  # the PodMonitor still selects the pods
    assert template["metadata"]["annotations"] == {"owner": "platform", "note": "ablation 3"}
    assert container["resources"]["requests"] == {"nvidia.com/gpu": "8", "cpu": "100", "memory": "1024Gi"}
    assert next(v for v in spec["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] == "256Gi"
    env = {v["name"]: v.get("value") for v in container["env"]}
    assert env["HTTPS_PROXY"] == "http://proxy:3128" and env["NCCL_DEBUG"] == "INFO"


def test_reserved_pod_keys_and_contract_variables_are_refused(make_job: Callable[..., TrainingJob]) -> None:
    import pytest

    from wanloom_api.validation import InvalidTrainingJob

    with pytest.raises(InvalidTrainingJob, match=r"spec.resources.podLabels: .*'wanloom.dev/trainingjob'"):
        make_job({"cpu": {}, "podLabels": {"wanloom.dev/trainingjob": "other"}})
    with pytest.raises(ValueError, match=r"WANLOOM_TRAINER_POD_DEFAULTS: .*WANLOOM_CONFIG: WANLOOM_"):
        OperatorSettings.from_env({"WANLOOM_TRAINER_POD_DEFAULTS": '{"env": [{"name": "WANLOOM_CONFIG"}]}'})
