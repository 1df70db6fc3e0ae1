"""gs:// weight staging against the GCS emulator: complete folders only, once, with a clear error when absent."""

from __future__ import annotations

from pathlib import Path

import pytest

from wanloom_trainer.checkpoint.gcs import GcsLocation, download_prefix, stage_weights, upload_dir


def _pipeline(root: Path) -> None:
    for folder, payload in (("transformer", b"high"), ("transformer_2", b"low")):
        (root / folder / "nested").mkdir(parents=True)
        (root / folder / "config.json").write_bytes(b"{}")
        (root / folder / "nested" / "weights.bin").write_bytes(payload)


def test_stage_weights_copies_each_expert_folder_once(gcs: str, tmp_path: Path) -> None:
    _pipeline(tmp_path / "src")
    upload_dir(tmp_path / "src", GcsLocation.parse(gcs), "model")
    local = stage_weights(f"{gcs}/model", tmp_path / "cache", ("transformer", "transformer_2"))
    assert (local / "transformer" / "nested" / "weights.bin").read_bytes() == b"high"
    assert (local / "transformer_2" / "nested" / "weights.bin").read_bytes() == b"low"
    assert not list(local.glob(".*.partial"))
    # A second call finds complete folders and downloads nothing, even if the bucket changed meanwhile.
    (tmp_path / "src" / "transformer" / "nested" / "weights.bin").write_bytes(b"changed")
    upload_dir(tmp_path / "src", GcsLocation.parse(gcs), "model")
    again = stage_weights(f"{gcs}/model", tmp_path / "cache", ("transformer", "transformer_2"))
    assert again == local and (again / "transformer" / "nested" / "weights.bin").read_bytes() == b"high"


def test_stage_weights_names_the_field_when_a_folder_is_missing(gcs: str, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"spec\.model\.weights: nothing under .*/transformer/"):
        stage_weights(f"{gcs}/empty", tmp_path / "cache", ("transformer",))


def test_download_prefix_counts_objects(gcs: str, tmp_path: Path) -> None:
    _pipeline(tmp_path / "src")
    upload_dir(tmp_path / "src", GcsLocation.parse(gcs))
    assert download_prefix(GcsLocation.parse(gcs), tmp_path / "out", "transformer_2") == 2
    assert GcsLocation.parse("gs://bucket/a/b/").key("c") == "a/b/c"
    with pytest.raises(ValueError, match="has no bucket"):
        GcsLocation.parse("gs:///x")
