"""`wanloom run` / `wanloom plan` argument and file errors: one clear message and exit status 1, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from wanloom_cli import app

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


def test_plan_of_a_synthetic_job_needs_no_data(tmp_path: Path, monkeypatch) -> None:
    """tiny-local generates its data when it runs; planning it first plans the samples it will generate."""
    monkeypatch.chdir(tmp_path)  # tiny-local's relative data path does not exist here
    result = CliRunner().invoke(app, ["plan", str(ROOT / "jobs" / "tiny-local.yaml")])
    assert result.exit_code == 0, result.output
    assert "tiny-local: tiny, 32 samples, 1 data-parallel ranks, mode spmd" in result.output
    assert not (tmp_path / "runs").exists()  # nothing written


def test_plan_without_a_dataset_says_how_to_make_one(tmp_path: Path) -> None:
    job = _job(tmp_path, str(tmp_path / "nothing"))
    result = CliRunner().invoke(app, ["plan", str(job)])
    assert result.exit_code == 1
    assert "no dataset index at" in result.output and "--shapes" in result.output


def _job(tmp_path: Path, data_uri: str, *, synthetic: bool = False, max_bad: int | None = None) -> Path:
    """tiny-local with its data somewhere else (and without generating it unless ``synthetic``)."""
    text = (ROOT / "jobs" / "tiny-local.yaml").read_text()
    text = text.replace("uri: runs/tiny-local/data", f"uri: {data_uri}")
    text = text.replace("uri: runs/tiny-local/checkpoints", f"uri: {tmp_path / 'checkpoints'}")
    if not synthetic:
        text = text.replace("    synthetic:\n      samples: 32\n      seed: 0\n", "")
    if max_bad is not None:
        text = text.replace("  data:\n", f"  data:\n    maxBadSamples: {max_bad}\n")
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def _run(job: Path, tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    code = "import sys; from wanloom_cli import main; sys.argv[0] = 'wanloom'; main()"
    args = ["run", str(job), "--steps", "2", "--metrics-port", "0", "--no-progress", "--run-dir", str(tmp_path / "r")]
    return subprocess.run(
        [sys.executable, "-c", code, *args, *extra],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, **(env or {})},
    )  # fmt: skip


def _one_line_error(run: subprocess.CompletedProcess, *needles: str) -> None:
    assert run.returncode == 1, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    line = next(line for line in run.stderr.splitlines() if line.startswith("wanloom run: "))
    for needle in needles:
        assert needle in line, line


def test_run_without_a_dataset_names_the_file_and_the_fix(tmp_path: Path) -> None:
    run = _run(_job(tmp_path, str(tmp_path / "nothing")), tmp_path)
    _one_line_error(run, f"{tmp_path / 'nothing' / 'index.json'}", "wanloom data prepare", "spec.data.synthetic")
    assert "Traceback" in _run(_job(tmp_path, str(tmp_path / "nothing")), tmp_path, "--debug").stderr


def test_run_with_a_corrupt_index_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "index.json").write_text("{not json")
    _one_line_error(_run(_job(tmp_path, str(tmp_path / "data")), tmp_path), "index.json: not valid JSON")


def test_run_without_gcs_credentials_says_how_to_provide_them(tmp_path: Path) -> None:
    env = {"GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "missing-key.json")}
    env |= {"STORAGE_EMULATOR_HOST": "", "GOOGLE_CLOUD_PROJECT": "wanloom-test"}
    run = _run(_job(tmp_path, "gs://wanloom-no-bucket/data"), tmp_path, env=env)
    _one_line_error(run, "no Google Cloud credentials", "GOOGLE_APPLICATION_CREDENTIALS", "missing-key.json")


@pytest.mark.slow
def test_run_with_too_many_bad_samples_says_which_and_what_to_do(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = _run(_job(tmp_path, str(data), synthetic=True), tmp_path)  # writes the synthetic dataset, trains
    assert first.returncode == 0, first.stderr[-3000:]
    shards = sorted(data.rglob("*.tar"))
    assert shards
    for shard in shards:  # overwrite every shard's payload: each sample fails its CRC
        raw = bytearray(shard.read_bytes())
        raw[1024:-1024] = bytes(len(raw) - 2048)
        shard.write_bytes(bytes(raw))
    again = tmp_path / "again"  # fresh checkpoints: the run must read the data again
    again.mkdir()
    _one_line_error(_run(_job(again, str(data), max_bad=0), again), "spec.data.maxBadSamples")


@pytest.mark.slow
def test_steps_whose_samples_were_all_skipped_do_not_train_or_log(tmp_path: Path) -> None:
    """Every shard broken and a generous budget: no step may update the experts or report a loss (the old loop
    logged loss 0.0 and planned tokens for such steps and still ran AdamW)."""
    data = tmp_path / "data"
    first = _run(_job(tmp_path, str(data), synthetic=True), tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    for shard in sorted(data.rglob("*.tar")):
        raw = bytearray(shard.read_bytes())
        raw[1024:-1024] = bytes(len(raw) - 2048)
        shard.write_bytes(bytes(raw))
    again = tmp_path / "again"
    again.mkdir()
    run = _run(_job(again, str(data), max_bad=10_000), again)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "planned samples were skipped; the experts are not updated" in run.stderr
    log = again / "r" / "steps.jsonl"
    assert not log.exists() or not log.read_text().strip()  # no step trained, so none was logged


def test_skipped_rows_leave_the_loss_normaliser() -> None:
    import numpy as np

    from wanloom_trainer.backends.interface import RankRows, Slot
    from wanloom_trainer.feed.inputs import renormalised

    planned, valid = 8, 6  # weights were 1/8; two rows lost their samples (weight 0)
    w = np.array([1 / planned] * 3 + [0.0], np.float32)
    rows = RankRows(np.arange(4), np.zeros((4, 1)), np.zeros((4, 1)), np.zeros((4, 1)), np.zeros(4), w)
    (slot,) = renormalised([Slot(0, {0: rows})], planned / valid)
    np.testing.assert_allclose(slot.ranks[0].weights, [1 / valid] * 3 + [0.0], rtol=1e-6)
    assert renormalised([Slot(0, {0: rows})], 1.0)[0].ranks[0] is rows


def test_an_accelerator_job_run_here_fails_at_once_with_what_to_do() -> None:
    import time

    for job, expected in (
        ("ti2v-5b-h100-1x8.yaml", "asks for 8 h100 GPUs (spec.resources.gpu.perNode) and this machine has 0 CUDA"),
        ("ti2v-5b-h200-2x8.yaml", "asks for 2 GPU nodes (spec.resources.gpu.nodes)"),
        ("t2v-a14b-tpu7x-2x4x4x4.yaml", "asks for a tpu7x 4x4x4 slice (spec.resources.tpu) and this machine has no"),
    ):
        started = time.monotonic()
        result = CliRunner().invoke(app, ["run", str(ROOT / "jobs" / job)])
        assert result.exit_code == 1 and expected in result.output, result.output
        assert time.monotonic() - started < 20  # before any data, planning or model


def test_the_cpu_cost_model_states_an_fp32_rate() -> None:
    from wanloom_trainer.adaptiveload.cost.cost_source import analytic_cost
    from wanloom_trainer.config.variants import get_variant

    assert "(96 GFLOP/s fp32)" in analytic_cost(get_variant("tiny"), "cpu").description
    assert "(989 TFLOP/s bf16)" in analytic_cost(get_variant("wan2.2-ti2v-5b"), "h100").description


def test_plan_json_has_the_bucket_table(monkeypatch, tmp_path: Path) -> None:
    import json

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["plan", str(ROOT / "jobs" / "tiny-local.yaml"), "--json"])
    assert result.exit_code == 0, result.output
    buckets = json.loads(result.output)["buckets"]
    assert [b["latent_shape"] for b in buckets] == [[1, 8, 8], [3, 8, 8]] and sum(b["samples"] for b in buckets) == 32
