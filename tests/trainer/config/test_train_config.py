"""TrainConfig from a TrainingJob and the pod environment: the only reader of spec and env."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

from wanloom_api.validation import load_trainingjob_file
from wanloom_trainer.config.train_config import from_trainingjob, load_train_config
from wanloom_trainer.routing import HIGH_NOISE

ROOT = Path(__file__).resolve().parents[3]
JOBS = ROOT / "jobs"


def test_tiny_local_resolves_degrees_paths_routing_and_attention(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = from_trainingjob(load_trainingjob_file(JOBS / "tiny-local.yaml"), {})
    assert (config.backend, config.accelerator, config.accelerator_type) == ("jax", "cpu", "cpu")
    assert config.parallel.shape == (1, 1, 1, 1) and config.parallel.batch_ranks == 1
    assert config.model.attention == "xla" and config.model.num_experts == 2
    assert config.routing.boundary_ratio == 0.875  # the tiny variant's default, from the API
    assert config.data.uri == str(tmp_path / "runs" / "tiny-local" / "data")  # relative to the cwd
    assert config.checkpoint.uri == str(tmp_path / "runs" / "tiny-local" / "checkpoints")
    assert config.run_dir == str(tmp_path / "runs" / "tiny-local")
    assert config.data.synthetic is not None and config.data.synthetic.samples >= 8
    assert config.distributed.num_processes == 1 and config.distributed.coordinator_address is None


def test_environment_overrides_and_global_process_id(tmp_path: Path) -> None:
    env = {
        "WANLOOM_COORDINATOR_ADDRESS": "trainer-0.svc:8476",
        "WANLOOM_NUM_SLICES": "2",
        "WANLOOM_SLICE_INDEX": "1",
        "WANLOOM_HOSTS_PER_SLICE": "8",
        "WANLOOM_HOST_INDEX": "3",
        "WANLOOM_METRICS_PORT": "9400",
        "WANLOOM_RUN_DIR": str(tmp_path / "scratch"),
        "WANLOOM_JOB_NAME": "from-env",
    }
    config = from_trainingjob(load_trainingjob_file(JOBS / "t2v-a14b-tpu7x-2x4x4x4.yaml"), env)
    d = config.distributed
    assert (d.num_processes, d.process_id, d.coordinator_address) == (16, 11, "trainer-0.svc:8476")
    assert (config.metrics_port, config.run_dir, config.job_name) == (9400, str(tmp_path / "scratch"), "from-env")
    assert config.model.attention == "splash" and config.accelerator_type == "tpu7x-tensorcore"
    assert config.parallel.num_devices % d.num_processes == 0


def test_gpu_jobs_default_to_torch_and_sdpa() -> None:
    config = from_trainingjob(load_trainingjob_file(JOBS / "ti2v-5b-h100-1x8.yaml"), {})
    assert (config.backend, config.model.attention, config.accelerator_type) == ("torch", "sdpa", "h100")
    assert config.model.num_experts == 1 and config.routing.boundary_ratio is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"WANLOOM_HOSTS_PER_SLICE": "2"}, "WANLOOM_COORDINATOR_ADDRESS must be set"),
        ({"WANLOOM_HOSTS_PER_SLICE": "two"}, "WANLOOM_HOSTS_PER_SLICE='two' is not an integer"),
        ({"WANLOOM_HOSTS_PER_SLICE": "2", "WANLOOM_HOST_INDEX": "2"}, "WANLOOM_HOST_INDEX=2 must be below"),
        ({"WANLOOM_COORDINATOR_ADDRESS": "no-port"}, "is not host:port"),
        ({"WANLOOM_METRICS_PORT": "-1"}, "WANLOOM_METRICS_PORT=-1 must be >= 0"),
    ],
    ids=["no-coordinator", "not-int", "index-range", "bad-address", "negative-port"],
)
def test_bad_environment_names_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_trainingjob(load_trainingjob_file(JOBS / "tiny-local.yaml"), env)


def test_load_train_config_needs_wanloom_config() -> None:
    with pytest.raises(ValueError, match="WANLOOM_CONFIG is not set"):
        load_train_config({})
    config = load_train_config({"WANLOOM_CONFIG": os.fspath(JOBS / "tiny-local.yaml")})
    assert config.job_name == "tiny-local"


@pytest.mark.parametrize(
    ("job", "high_share", "old_share"),
    [("t2v-a14b-tpu7x-2x4x4x4.yaml", 1 - 0.875 / 1.5, 0.0258), ("i2v-a14b-tpu7x-4x8x8.yaml", 1 - 0.9 / 1.4, 0.0140)],
)
def test_unset_routing_follows_the_recipe_and_feeds_the_high_noise_expert(
    job: str, high_share: float, old_share: float
) -> None:
    """DiffSynth-Studio's Wan 2.2 recipe (uniform, shift 5): u >= b/(5 - 4b) reaches t >= 1000·b, i.e. 41.7% of
    T2V samples and 35.7% of I2V ones; the old default (logit-normal, shift 1) sent 2.6% and 1.4%."""
    spec = load_trainingjob_file(JOBS / job)
    assert spec.spec.routing.sampling is None and spec.spec.routing.shift is None  # the example jobs use the recipe
    routing = from_trainingjob(spec, {}).routing
    assert (routing.sampling, routing.shift) == ("uniform", 5.0)
    assert routing.expected_shares() == pytest.approx((high_share, 1 - high_share), abs=1e-9)
    draw = routing.router().draw(seed=0, step=0, n=20_000)
    observed = float(np.mean(draw.experts == HIGH_NOISE))
    assert abs(observed - high_share) < 4 * np.sqrt(high_share * (1 - high_share) / 20_000)
    old = dataclasses.replace(routing, sampling="logit-normal", shift=1.0)
    assert old.expected_shares()[0] == pytest.approx(old_share, abs=5e-4)
