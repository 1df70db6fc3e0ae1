"""The built images start: each entry point run in a real container (podman, runc) from the images `make images`
builds from the repository's Dockerfiles.

Skipped where the images were not built (podman missing, or no image under the tag); under
``WANLOOM_REQUIRE_IMAGES=1`` a missing image fails instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
VERSION = "0.1.0"
OPERATOR = f"ghcr.io/wanloom/wanloom-operator:{VERSION}"
TRAINER_TPU = f"ghcr.io/wanloom/wanloom-trainer-tpu:{VERSION}"
ENV = {**os.environ, "CONTAINERS_CONF": str(ROOT / ".ci/images/containers.conf")}

pytestmark = [pytest.mark.images]


def require(image: str) -> None:
    present = shutil.which("podman") is not None and (
        subprocess.run(["podman", "image", "exists", image], env=ENV, check=False).returncode == 0
    )
    if present:
        return
    if os.environ.get("WANLOOM_REQUIRE_IMAGES"):
        pytest.fail(f"{image} is not built: run `make images`")
    pytest.skip(f"{image} is not built (`make images`)")


def run(image: str, options: list[str], arguments: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman", "run", "--rm", "--network", "none", *options, image, *arguments],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_pyproject_version_is_the_tag() -> None:
    assert f'version = "{VERSION}"' in (ROOT / "pyproject.toml").read_text()


def test_operator_image_entry_point_and_cli() -> None:
    require(OPERATOR)
    help_ = run(OPERATOR, [], ["--help"])
    assert help_.returncode == 0, help_.stderr
    assert "--all-namespaces" in help_.stdout
    # The contract is in the image: a job validated as the operator validates it, by an unprivileged user.
    job = run(
        OPERATOR, ["--entrypoint", "wanloom", "-v", f"{ROOT / 'jobs'}:/jobs:ro"], ["validate", "/jobs/tiny-local.yaml"]
    )
    assert job.returncode == 0, job.stderr
    who = run(OPERATOR, ["--entrypoint", "id"], ["-u"])
    assert who.stdout.strip() == "10001"


def test_trainer_image_refuses_a_missing_config_without_a_traceback() -> None:
    require(TRAINER_TPU)
    result = run(TRAINER_TPU, ["-e", "WANLOOM_CONFIG=/etc/wanloom/trainingjob.yaml"], [])
    assert result.returncode == 3, result.stderr
    assert result.stderr.startswith("wanloom trainer: /etc/wanloom/trainingjob.yaml"), result.stderr
    assert "No such file" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_trainer_image_trains_the_tiny_model(tmp_path: Path) -> None:
    """The pod's command and start-up contract in the JAX image: a few steps of the tiny job on CPU, checkpointed."""
    require(TRAINER_TPU)
    job = yaml.safe_load((ROOT / "jobs/tiny-local.yaml").read_text())
    job["spec"]["training"].update(steps=4, checkpoint={"uri": "/work/checkpoints", "interval": 2, "keep": 2})
    job["spec"]["optimizer"]["warmupSteps"] = 2
    job["spec"]["data"]["uri"] = "/work/data"
    config = tmp_path / "config"
    config.mkdir()
    (config / "trainingjob.yaml").write_text(yaml.safe_dump(job))
    work = tmp_path / "work"
    work.mkdir()
    work.chmod(0o777)  # the image runs as uid 10001
    env = {
        "WANLOOM_CONFIG": "/etc/wanloom/trainingjob.yaml",
        "WANLOOM_JOB_NAME": "tiny-local",
        "WANLOOM_RUN_DIR": "/work/run",
        "WANLOOM_METRICS_PORT": "9431",
        "WANLOOM_NUM_SLICES": "1",
        "WANLOOM_SLICE_INDEX": "0",
        "WANLOOM_HOSTS_PER_SLICE": "1",
        "WANLOOM_HOST_INDEX": "0",
        "WANLOOM_DEVICES_PER_HOST": "1",
        "JAX_PLATFORMS": "cpu",
    }
    options = ["-v", f"{config}:/etc/wanloom:ro", "-v", f"{work}:/work", "-w", "/work"]
    for name, value in env.items():
        options += ["-e", f"{name}={value}"]
    result = run(TRAINER_TPU, options, [], timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    steps = sorted(p.name for p in (work / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == ["2", "4"], sorted(p.name for p in (work / "checkpoints").iterdir())
