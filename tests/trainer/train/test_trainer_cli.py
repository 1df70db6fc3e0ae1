"""`wanloom run` / `wanloom plan` argument and file errors: one clear message and exit status 1, no traceback."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from wanloom_operator.cli import app

ROOT = Path(__file__).resolve().parents[3]


def test_run_reports_an_invalid_file_with_its_field_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "jobs" / "tiny-local.yaml").read_text().replace("globalBatch: 8", "globalBatch: zero"))
    result = CliRunner().invoke(app, ["run", str(bad)])
    assert result.exit_code == 1
    assert "spec.training.globalBatch" in result.output


def test_run_processes_needs_a_cpu_job() -> None:
    result = CliRunner().invoke(app, ["run", str(ROOT / "jobs" / "t2v-a14b-tpu7x-2x4x4x4.yaml"), "--processes", "2"])
    assert result.exit_code == 1
    assert "--processes runs CPU jobs only" in result.output


def test_plan_without_a_dataset_says_how_to_make_one(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # tiny-local's relative data path does not exist here
    result = CliRunner().invoke(app, ["plan", str(ROOT / "jobs" / "tiny-local.yaml")])
    assert result.exit_code == 1
    assert "index" in result.output
