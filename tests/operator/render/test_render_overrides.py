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
