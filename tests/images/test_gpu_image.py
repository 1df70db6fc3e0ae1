"""The GPU trainer image's dependencies resolve as its Dockerfile installs them, without building the image (6 GB;
`make images IMAGES="operator tpu gpu"` builds it where the disk allows).

pip resolves ``.[torch]`` under the image's constraints file (PIP_CONSTRAINT in Dockerfile.gpu) for Linux x86_64
and CPython 3.11, the image's platform, reading only the index's metadata: a constraint that conflicts with a
dependency, or a pin the index no longer serves, fails here rather than in a user's `docker build`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "trainer_images" / "Dockerfile.gpu"
CONSTRAINTS = ROOT / "trainer_images" / "constraints" / "gpu.txt"

pytestmark = [pytest.mark.images]


def _pins() -> dict[str, str]:
    lines = (line.split("#")[0].strip() for line in CONSTRAINTS.read_text().splitlines())
    return {name.lower(): version for name, version in (line.split("==") for line in lines if line)}


@pytest.mark.slow
def test_the_gpu_images_dependencies_resolve_with_cuda_wheels(tmp_path: Path) -> None:
    # The Dockerfile's own install line and constraints, so this checks what it builds.
    dockerfile = DOCKERFILE.read_text()
    assert 'pip install ".[torch]"' in dockerfile and "constraints/gpu.txt" in dockerfile
    report = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed", "--report", str(report),
         "--constraint", str(CONSTRAINTS), ".[torch]"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PIP_CONSTRAINT": ""},
    )  # fmt: skip
    if result.returncode and not os.environ.get("WANLOOM_REQUIRE_IMAGES") and "NewConnectionError" in result.stderr:
        pytest.skip("the package index cannot be reached")
    assert result.returncode == 0, result.stderr[-3000:]
    installed = {
        re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    pins = _pins()
    for name in ("torch", "triton", "diffusers"):
        assert installed[name] == pins[name], (name, installed[name], pins[name])
    # torch from PyPI brings the CUDA 13 user-space libraries as wheels, as the Dockerfile says: NCCL and cuDNN.
    assert any(name.startswith("nvidia-nccl") for name in installed), sorted(installed)
    assert any(name.startswith("nvidia-cudnn") for name in installed), sorted(installed)
    # The trainer image leaves the operator's dependencies out.
    assert "kopf" not in installed
