"""OperatorSettings from the environment: defaults, parsing, and errors that name the variable."""

from __future__ import annotations

import pytest

from wanloom_operator.settings import OperatorSettings


def test_defaults_and_parsing() -> None:
    settings = OperatorSettings.from_env(
        {
            "WANLOOM_TRAINER_IMAGE_JAX": "r/j:1",
            "WANLOOM_NAMESPACES": "a, b,,",
            "WANLOOM_OPERATOR_METRICS_PORT": "9100",
            "WANLOOM_CPU_POD_REQUESTS": "cpu=2,memory=4Gi",
            "WANLOOM_RANK0_ADDRESS": "static:10.1.2.3",
        }
    )
    assert settings.trainer_image_jax == "r/j:1" and settings.trainer_image_torch.endswith(":0.1.0")
    assert settings.namespaces == ("a", "b") and settings.metrics_port == 9100
    assert settings.cpu_pod_requests == {"cpu": "2", "memory": "4Gi"}
    assert OperatorSettings.from_env({}, metrics_port=1).metrics_port == 1  # flags win over the environment


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"WANLOOM_OPERATOR_METRICS_PORT": "http"}, "WANLOOM_OPERATOR_METRICS_PORT"),
        ({"WANLOOM_RANK0_ADDRESS": "ip"}, "WANLOOM_RANK0_ADDRESS"),
        ({"WANLOOM_GPU_NCCL_PROFILE": "fast"}, "WANLOOM_GPU_NCCL_PROFILE"),
        ({"WANLOOM_CPU_POD_REQUESTS": "cpu"}, "WANLOOM_CPU_POD_REQUESTS"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        OperatorSettings.from_env(env)


def test_the_http_pool_has_a_connection_per_api_thread() -> None:
    from wanloom_operator.reconcile.cluster import API_THREADS, Cluster

    cluster = Cluster.connect(OperatorSettings.from_env({}, api_server="http://127.0.0.1:1"))
    pool = cluster._custom.api_client.rest_client.pool_manager
    assert pool.connection_pool_kw["maxsize"] == API_THREADS
