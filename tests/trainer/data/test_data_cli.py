"""`wanloom data synth` / `wanloom data prepare` through the real CLI."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from wanloom_cli import app
from wanloom_trainer.data.reader import read_index

runner = CliRunner()


def test_synth_writes_a_dataset(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    result = runner.invoke(
        app,
        [
            "data",
            "synth",
            str(out),
            "--samples",
            "12",
            "--seed",
            "2",
            "--mixture",
            "1x64x64:1,9x64x64:1",
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "wrote 12 samples in 1 shard(s)" in result.output and "latent 3x8x8" in result.output
    index = read_index(str(out))
    assert index.num_samples == 12 and index.header.build["seed"] == 2


def test_synth_errors_name_the_problem(tmp_path: Path) -> None:
    result = runner.invoke(app, ["data", "synth", str(tmp_path), "--variant", "huge", "--no-progress"])
    assert result.exit_code == 1 and "unknown model variant 'huge'" in result.output


def test_prepare_encodes_media(tmp_path: Path, media_set, tiny_model_root: Path) -> None:
    out = tmp_path / "ds"
    args = ["data", "prepare", str(media_set.folder), str(out), "--model", str(tiny_model_root), "--variant", "tiny"]
    args += ["--bucket", "1x64x64", "--bucket", "1x64x96", "--bucket", "1x96x64", "--bucket", "9x64x64"]
    result = runner.invoke(app, [*args, "--dtype", "float32", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "wrote 4 samples" in result.output and "skipped broken.png: undecodable" in result.output
    assert sorted(read_index(str(out)).sources) == sorted(media_set.good)


def test_prepare_rejects_bad_buckets(tmp_path: Path, media_set, tiny_model_root: Path) -> None:
    args = ["data", "prepare", str(media_set.folder), str(tmp_path), "--model", str(tiny_model_root)]
    result = runner.invoke(app, [*args, "--variant", "tiny", "--bucket", "8x64x64", "--no-progress"])
    assert result.exit_code == 1 and "bucket 8x64x64: frames must be 1 or 1 + a multiple of 4" in result.output
