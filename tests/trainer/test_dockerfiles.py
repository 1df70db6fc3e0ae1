"""The three images pin what they install, run as a non-root user and start the right entry point.

The Dockerfiles are parsed here (`make images` builds them): base image tags, the constraints file that
PIP_CONSTRAINT points at (copied from trainer_images/constraints/), the packages each `pip install` names, USER
and ENTRYPOINT.
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
IMAGES = {
    "tpu": ("jax", ["python", "-m", "wanloom_trainer"]),
    "gpu": ("torch", ["python", "-m", "wanloom_trainer"]),
    "operator": ("operator", ["wanloom", "operator"]),
}


@dataclass(frozen=True)
class Dockerfile:
    instructions: list[tuple[str, str]]  # (KEYWORD, arguments), continuation lines joined
    copied: dict[str, str]  # target path -> source path in the build context (single-file COPYs)

    def args(self, keyword: str) -> list[str]:
        return [a for k, a in self.instructions if k == keyword]


def parse(path: Path) -> Dockerfile:
    lines = path.read_text().splitlines()
    instructions: list[tuple[str, str]] = []
    copied: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        while line.endswith("\\"):
            line = line[:-1] + " " + lines[i].strip()
            i += 1
        keyword, _, rest = line.partition(" ")
        assert "<<" not in rest, f"{path.name}: heredocs need BuildKit or buildah >= 1.33; keep the file in the repo"
        instructions.append((keyword.upper(), rest.strip()))
        words = rest.split()
        if keyword.upper() == "COPY" and len(words) == 2 and not words[0].startswith("--"):
            copied[words[1]] = words[0]
    return Dockerfile(instructions, copied)


def _dockerfile(image: str) -> Dockerfile:
    return parse(ROOT / "trainer_images" / f"Dockerfile.{image}")


def _env(df: Dockerfile) -> dict[str, str]:
    env: dict[str, str] = {}
    for args in df.args("ENV"):
        env |= dict(re.findall(r"(\w+)=(\S+)", args))
    return env


def _constraints(df: Dockerfile) -> dict[str, str]:
    path = _env(df)["PIP_CONSTRAINT"]
    assert path in df.copied, f"PIP_CONSTRAINT={path} is not copied from a file of the repository"
    pins = {}
    lines = (ROOT / df.copied[path]).read_text().splitlines()
    for line in (x.strip() for x in lines if x.strip() and not x.startswith("#")):
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([0-9][0-9A-Za-z.+]*)", line)
        assert match, f"constraint {line!r} is not an exact name==version pin"
        pins[canonicalize_name(match.group(1))] = match.group(2)
    return pins


def _extra_requirements(extra: str) -> set[str]:
    """Names of everything `pip install .[extra]` asks for directly (nested wanloom[...] extras expanded)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pending = [*project["dependencies"], *project["optional-dependencies"][extra]]
    seen, names = {extra}, set()
    while pending:
        req = Requirement(pending.pop())
        if canonicalize_name(req.name) != "wanloom":
            names.add(canonicalize_name(req.name))
            continue
        for nested in req.extras - seen:
            seen.add(nested)
            pending += project["optional-dependencies"][nested]
    return names


@pytest.mark.parametrize("image", IMAGES)
def test_base_images_are_pinned_to_a_release(image: str) -> None:
    for base in _dockerfile(image).args("FROM"):
        ref = base.split()[0]
        assert ":" in ref and not ref.endswith(":latest"), f"{image}: unpinned base image {ref}"
        assert re.search(r":\d+\.\d+\.\d+", ref) or "@sha256:" in ref, f"{image}: {ref} is not a full release tag"


@pytest.mark.parametrize("image", IMAGES)
def test_every_installed_package_is_pinned(image: str) -> None:
    extra, _ = IMAGES[image]
    df = _dockerfile(image)
    pins = _constraints(df)
    missing = _extra_requirements(extra) - set(pins)
    assert not missing, f"{image}: wanloom[{extra}] needs {sorted(missing)} without a pin"
    installs = [a for a in df.args("RUN") if "pip install" in a]
    assert installs, f"{image}: no pip install"
    for run in installs:
        command = run.split("&&")[0]
        for arg in re.findall(r'"([^"]+)"|(\S+)', command.split("pip install", 1)[1]):
            spec = arg[0] or arg[1]
            if spec.startswith("-"):
                continue
            if spec.startswith("."):
                assert spec == f".[{extra}]", f"{image}: installs {spec}, expected .[{extra}]"
                continue
            assert canonicalize_name(Requirement(spec).name) in pins, f"{image}: {spec} has no pin"
        assert "pip check" in run, f"{image}: run `pip check` after installing"


def _lock() -> dict[str, str]:
    """.ci/constraints.txt: the versions `make install` installs and CI tests."""
    pins = {}
    for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.strip().partition("==")
            assert version, f".ci/constraints.txt: {line!r} is not an exact name==version pin"
            pins[canonicalize_name(name)] = version
    return pins


@pytest.mark.parametrize("image", IMAGES)
def test_pins_match_the_tested_environment(image: str) -> None:
    lock = _lock()
    for name, version in _constraints(_dockerfile(image)).items():
        assert name in lock, f"{image}: {name} is pinned but .ci/constraints.txt does not install it for the tests"
        assert lock[name] == version, f"{image}: {name}=={version}, .ci/constraints.txt has {lock[name]}"


def test_the_environment_is_the_locked_one() -> None:
    """A stale or hand-grown .venv tests something else than CI and the images: `make install` rebuilds it."""
    drift = {}
    for name, version in _lock().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = "missing"
        if installed != version:
            drift[name] = f"{installed} (locked {version})"
    assert not drift, f"installed versions differ from .ci/constraints.txt: {drift}"


def test_gpu_image_uses_the_house_torch() -> None:
    assert _constraints(_dockerfile("gpu"))["torch"] == "2.13.0"
    assert "triton" in _constraints(_dockerfile("gpu"))
    assert "libtpu" in _constraints(_dockerfile("tpu"))
    assert not {"torch", "jax"} & set(_constraints(_dockerfile("operator")))


# Each image ships the contract, the CLI and its own side only (tests/test_imports.py keeps the sides apart).
SIDES = {"tpu": "wanloom_trainer", "gpu": "wanloom_trainer", "operator": "wanloom_operator"}


@pytest.mark.parametrize("image", IMAGES)
def test_each_image_ships_only_its_side(image: str) -> None:
    sources = [a.split()[0] for a in _dockerfile(image).args("COPY")]
    packages = {Path(src).name for src in sources if src.startswith(("operator/", "cli/", "trainer_images/wanloom_"))}
    assert packages == {"wanloom_api", "wanloom_cli", SIDES[image]}, f"{image}: copies {sorted(packages)}"


@pytest.mark.parametrize("image", IMAGES)
def test_runs_as_a_non_root_user(image: str) -> None:
    df = _dockerfile(image)
    users = df.args("USER")
    assert users, f"{image}: no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) > 0, f"{image}: USER {users[-1]} must be a numeric non-root uid"
    assert not gid or (gid.isdigit() and int(gid) > 0)
    keywords = [k for k, _ in df.instructions]
    last_user = len(keywords) - 1 - keywords[::-1].index("USER")
    assert "RUN" not in keywords[last_user:], f"{image}: RUN after the final USER runs as non-root by accident"


@pytest.mark.parametrize("image", IMAGES)
def test_entrypoint(image: str) -> None:
    _, entrypoint = IMAGES[image]
    assert [json.loads(a) for a in _dockerfile(image).args("ENTRYPOINT")] == [entrypoint]


def test_parser_sees_a_broken_pin_and_a_heredoc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "c.txt").write_text("# pins\ntorch>=2\n")
    bad = tmp_path / "Dockerfile.bad"
    bad.write_text('FROM python:3.11\nENV PIP_CONSTRAINT=/c.txt\nCOPY c.txt /c.txt\nUSER root\nENTRYPOINT ["python"]\n')
    df = parse(bad)
    with pytest.raises(AssertionError, match="not an exact name==version pin"):
        _constraints(df)
    assert df.args("USER") == ["root"]
    bad.write_text("FROM python:3.11\nCOPY <<C /c.txt\ntorch==2\nC\n")
    with pytest.raises(AssertionError, match="heredocs need BuildKit or buildah"):
        parse(bad)
