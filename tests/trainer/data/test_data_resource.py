"""A LatentDataset's steps as the operator's pods run them (``wanloom data build --step``), against the GCS
emulator: plan, encode units in any order and more than once, finalize; the result equals a single-process
``wanloom data prepare`` of the same manifest, and too many bad inputs fail the finalize with the reasons."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from wanloom_api.keys import EXIT_CONFIG_ERROR
from wanloom_cli import app
from wanloom_trainer.data.bucketing import parse_bucket
from wanloom_trainer.data.prepare.pipeline import PrepareConfig, prepare
from wanloom_trainer.data.reader import open_dataset
from wanloom_trainer.data.storage import open_storage

BUCKETS = ("1x64x64", "1x64x96", "1x96x64", "9x64x64")


def _dataset_file(tmp_path: Path, corpus: str, output: str, weights: str, max_bad: int) -> Path:
    buckets = [dict(zip(("frames", "height", "width"), map(int, b.split("x")), strict=True)) for b in BUCKETS]
    doc = {
        "apiVersion": "wanloom.dev/v1alpha1",
        "kind": "LatentDataset",
        "metadata": {"name": "corpus"},
        "spec": {
            "source": {"manifest": corpus},
            "output": output,
            "encoders": {"variant": "tiny", "weights": weights, "batchSize": 2},
            "buckets": buckets,
            "dtype": "float32",
            "samplesPerShard": 3,
            "workers": 2,
            "maxBadSamples": max_bad,
            "resources": {"cpu": {}},
        },
    }
    path = tmp_path / f"dataset-{max_bad}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _step(file: Path, *args: str) -> tuple[int, str]:
    """Exit code, and the summary line (stdout) or the error (the last line on stderr)."""
    result = CliRunner().invoke(app, ["data", "build", str(file), *args])
    text = (result.stdout if result.exit_code == 0 else result.stderr).strip()
    return result.exit_code, text.splitlines()[-1] if text else ""


def test_plan_encode_finalize_steps_give_the_single_process_dataset(
    corpus: str, gcs: str, tiny_model_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = f"{gcs}/weights"
    store = open_storage(weights)
    for path in sorted(p for p in tiny_model_root.rglob("*") if p.is_file()):
        store.upload(path.relative_to(tiny_model_root).as_posix(), path)
    monkeypatch.setenv("WANLOOM_WEIGHTS_CACHE", str(tmp_path / "cache"))
    file = _dataset_file(tmp_path, corpus, f"{gcs}/lds", weights, max_bad=5)

    code, out = _step(file, "--step", "plan")
    assert code == 0 and json.loads(out) == {"inputs": 8, "units": 3, "bad": {}}
    code, out = _step(file, "--step", "finalize")  # before the units: refused, nothing written
    assert code == EXIT_CONFIG_ERROR and "3 of 3 work units are not written yet" in out
    # Units out of order, unit 1 twice (a retried pod), each from the pod's completion index.
    for unit in ("2", "1", "0", "1"):
        monkeypatch.setenv("JOB_COMPLETION_INDEX", unit)
        code, out = _step(file, "--step", "encode")
        assert code == 0 and json.loads(out)["units"] == [int(unit)], out
    code, out = _step(file, "--step", "finalize")
    assert code == 0 and json.loads(out) == {"samples": 6, "shards": 3, "skipped": {"missing": 1, "undecodable": 1}}

    single = PrepareConfig(
        inputs=corpus, output=f"{gcs}/single", model=tiny_model_root, variant="tiny", dtype="float32",
        buckets=tuple(parse_bucket(b) for b in BUCKETS), batch_size=2, samples_per_shard=3,
    )  # fmt: skip
    reference = prepare(single, progress=False).index
    built = open_storage(f"{gcs}/lds")
    # The same samples in the same shards and places (the header records where the weights were read from).
    assert json.loads(built.read("index.json"))["samples"] == json.loads(reference.to_json())["samples"]
    with open_dataset(f"{gcs}/lds", max_bad_samples=0) as ds, open_dataset(f"{gcs}/single", max_bad_samples=0) as ref:
        for i, shape in enumerate(reference.latent_shapes.tolist()):
            a, b = ds.load([i], tuple(shape)), ref.load([i], tuple(shape))
            np.testing.assert_array_equal(a.latents, b.latents)
            np.testing.assert_array_equal(a.text_embeds, b.text_embeds)
    assert built.read("empty_prompt.npy") == open_storage(f"{gcs}/single").read("empty_prompt.npy")


def test_a_storage_outage_mid_encode_is_waited_out_and_skips_nothing(
    flaky_gcs: tuple[str, Any], media_set: Any, tiny_model_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After the first unit is written, every GCS request answers 503 for 15 s (longer than a request's retries):
    the unit being written is redone once storage is back; the dataset equals one built without the outage."""
    gcs, proxy = flaky_gcs
    store = open_storage(gcs)
    for name in ("a.png", "b.jpg", "sub/c.png", "clip.mp4", "broken.png"):
        store.upload(f"media/{name}", media_set.folder / name)
        store.upload(f"media/{Path(name).with_suffix('.txt')}", (media_set.folder / name).with_suffix(".txt"))

    def config(output: str) -> PrepareConfig:
        return PrepareConfig(
            inputs=f"{gcs}/media", output=f"{gcs}/{output}", model=tiny_model_root, variant="tiny", dtype="float32",
            buckets=tuple(parse_bucket(b) for b in BUCKETS), batch_size=2, samples_per_shard=2, storage_outage_s=60,
        )  # fmt: skip

    clean = prepare(config("clean"), progress=False, workers=1)
    outage_s, started = 15.0, time.monotonic()
    reports: list[Any] = []

    def outage_after_the_first_unit(report: Any) -> None:
        reports.append(report)
        if len(reports) == 1:
            proxy.go_down(outage_s)

    waited = prepare(config("waited"), progress=False, workers=1, on_progress=outage_after_the_first_unit)
    print(f"injected: GCS down {outage_s:g} s after unit 0; found: {proxy.injected} requests refused, "
          f"{len(reports)} units written in {time.monotonic() - started:.1f} s, skipped {waited.skipped}")  # fmt: skip
    assert proxy.injected > 0 and time.monotonic() - started >= outage_s
    assert "storage unreachable" in caplog.text and "storage is back" in caplog.text  # waited, as the trainer does
    assert waited.skipped == clean.skipped  # the outage skipped nothing
    assert waited.index is not None and clean.index is not None
    assert list(clean.index.sources) == ["a.png", "b.jpg", "clip.mp4", "sub/c.png"]
    assert json.loads(waited.index.to_json())["samples"] == json.loads(clean.index.to_json())["samples"]
    for name in store.list("clean/shards"):
        if name.endswith(".tar"):
            assert store.read(name.replace("clean/", "waited/", 1)) == store.read(name), name


def test_more_bad_inputs_than_max_bad_samples_fail_the_finalize_with_the_reasons(
    corpus: str, gcs: str, tiny_model_root: Path, tmp_path: Path
) -> None:
    file = _dataset_file(tmp_path, corpus, f"{gcs}/strict", str(tiny_model_root), max_bad=1)
    code, out = _step(file)  # every step in this process, as `wanloom data build` runs on a laptop
    assert code == EXIT_CONFIG_ERROR
    assert "2 inputs skipped, more than maxBadSamples 1" in out and "media/broken.png: undecodable" in out
    built = open_storage(f"{gcs}/strict")
    assert not built.exists("index.json")  # nothing a TrainingJob could start on
    assert [s["source"] for s in json.loads(built.read("skipped.json"))] == ["media/broken.png", "media/missing.png"]


def test_a_dataset_file_with_bad_fields_names_them(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    spec = {
        "source": {"manifest": "s3://b/m.jsonl"},
        "output": "out",
        "encoders": {"variant": "tiny", "weights": "w", "backend": "torch"},
        "buckets": [{"frames": 2, "height": 64, "width": 64}],
        "resources": {"tpu": {"topology": "2x2x1"}},
    }
    doc = {"apiVersion": "wanloom.dev/v1alpha1", "kind": "LatentDataset", "metadata": {"name": "x"}, "spec": spec}
    bad.write_text(yaml.safe_dump(doc))
    code, out = _step(bad, "--step", "plan")
    assert code == EXIT_CONFIG_ERROR
    for field in ("spec.source.manifest", "spec.buckets[0].frames", "spec.encoders.backend"):
        assert field in out, out
