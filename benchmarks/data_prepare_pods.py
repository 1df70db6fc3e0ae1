"""A LatentDataset encoded by 1, then 2 pods on the real node (`make cluster` with its node and `make images`), each
pod limited to one CPU: how much the second pod buys, as the cluster runs it.

The corpus is generated here and put in the cluster's GCS emulator: ``--clips`` MPEG-4 clips (33 frames at 16 fps,
96x128) and ``--images`` PNGs under a JSONL manifest, units of ``--per-unit``; the tiny encoders' weights beside
them. The operator runs out of the cluster (``wanloom operator --namespace``, as the control-plane tests run it);
the encode pods run the TPU image (the JAX encoders on the CPU). The time is the encode Job's, from the Job
controller's ``startTime`` to its ``completionTime`` (whole seconds): image pulls are done, pod starts are in it.

Run: ``PYTHONPATH=operator:trainer_images:cli .venv/bin/python benchmarks/data_prepare_pods.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STATE = ROOT / ".cluster"
BUCKET = "wanloom-bench"


def _load(path: Path, name: str) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _corpus(folder: Path, clips: int, images: int, tiny: Any) -> list[dict[str, Any]]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    rows = []
    for i in range(clips):
        tiny.write_video(folder / f"clip{i:03d}.mp4", frames=33, height=96, width=128, fps=16)
        rows.append({"path": f"clip{i:03d}.mp4", "caption": "a dog runs on the grass"})
    for i in range(images):
        Image.fromarray(rng.integers(0, 255, (96, 128, 3), dtype=np.uint8)).save(folder / f"img{i:03d}.png")
        rows.append({"path": f"img{i:03d}.png", "caption": "a red cat sits in the sky"})
    return rows


def _dataset(name: str, namespace: str, root: str, workers: int, per_unit: int, env: dict[str, Any]) -> dict:
    node = env["node"]
    pod_env = [
        {"name": "STORAGE_EMULATOR_HOST", "value": env["gcs"]},
        {"name": "GOOGLE_CLOUD_PROJECT", "value": "wanloom-bench"},
    ]
    return {
        "apiVersion": "wanloom.dev/v1alpha1",
        "kind": "LatentDataset",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "source": {"manifest": f"{root}/corpus/manifest.jsonl"},
            "output": f"{root}/{name}",
            "encoders": {"variant": "tiny", "weights": f"{root}/encoders", "batchSize": 4},
            "buckets": [{"frames": 1, "height": 96, "width": 128}, {"frames": 33, "height": 96, "width": 128}],
            "dtype": "bfloat16",
            "samplesPerShard": per_unit,
            "workers": workers,
            "resources": {
                "cpu": {"cpu": "1", "memory": "3Gi"},
                "image": node["images"][1],
                "env": pod_env,
                "nodeSelector": {node["label"]: "true"},
                "tolerations": [{"key": node["label"], "operator": "Exists", "effect": "NoSchedule"}],
            },
        },
    }


def _seconds(stamp: Any) -> float:
    if isinstance(stamp, datetime):
        return stamp.timestamp()
    return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()


def _install_crds(client: Any) -> None:
    """The operator's CRDs, where the tests have not installed them yet."""
    from wanloom_api.crd import all_crds

    ext = client.ApiextensionsV1Api()
    for crd in all_crds():
        if not ext.list_custom_resource_definition(field_selector=f"metadata.name={crd['metadata']['name']}").items:
            ext.create_custom_resource_definition(crd)
    time.sleep(3)  # established


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", type=int, default=96)
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--per-unit", type=int, default=8)
    args = parser.parse_args()
    env = json.loads((STATE / "env").read_text())
    if not env.get("node"):
        raise SystemExit("the cluster has no real node: make cluster (as root, with podman) after make images")
    from kubernetes import client, config

    from wanloom_trainer.checkpoint.gcs import GcsLocation, upload_dir

    os.environ.update(STORAGE_EMULATOR_HOST=env["gcs"], GOOGLE_CLOUD_PROJECT="wanloom-bench")
    config.load_kube_config(env["kubeconfig"])
    core, api, batch = client.CoreV1Api(), client.CustomObjectsApi(), client.BatchV1Api()
    namespace = f"bench-prepare-{uuid.uuid4().hex[:6]}"
    root = f"gs://{BUCKET}/{namespace}"
    tiny = _load(ROOT / "tests" / "trainer" / "data" / "tiny_media.py", "tiny_media")
    with tempfile.TemporaryDirectory(prefix="wanloom-bench-pods-") as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        rows = _corpus(corpus, args.clips, args.images, tiny)
        (corpus / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        upload_dir(corpus, GcsLocation.parse(f"{root}/corpus"))
        upload_dir(tiny.write_tiny_encoders(Path(tmp) / "encoders"), GcsLocation.parse(f"{root}/encoders"))
    _install_crds(client)
    core.create_namespace({"metadata": {"name": namespace}})
    operator_env = {**os.environ, "KUBECONFIG": env["kubeconfig"], "WANLOOM_PROGRESS_INTERVAL_SECONDS": "2"}
    command = [sys.executable, "-c", "from wanloom_cli import main; main()", "operator", f"--namespace={namespace}",
               "--metrics-port=0", "--liveness-port=0"]  # fmt: skip
    operator = subprocess.Popen(command, env=operator_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    units = -(-len(rows) // args.per_unit)
    print(f"{args.clips} clips (33x96x128) + {args.images} images, {units} units of {args.per_unit}; encode pods of "
          f"1 CPU each on the real node ({env['node']['name']})")  # fmt: skip
    times = {}
    try:
        for workers in (1, 2):
            name = f"corpus-{workers}"
            doc = _dataset(name, namespace, root, workers, args.per_unit, env)
            api.create_namespaced_custom_object("wanloom.dev", "v1alpha1", namespace, "latentdatasets", doc)
            deadline = time.monotonic() + 1800
            while time.monotonic() < deadline:
                obj = api.get_namespaced_custom_object("wanloom.dev", "v1alpha1", namespace, "latentdatasets", name)
                phase = (obj.get("status") or {}).get("phase")
                if phase in ("Ready", "Failed"):
                    break
                time.sleep(2)
            if phase != "Ready":
                raise SystemExit(f"{name}: {phase} {(obj.get('status') or {}).get('message')}")
            job = batch.read_namespaced_job(f"{name}-encode", namespace)
            times[workers] = _seconds(job.status.completion_time) - _seconds(job.status.start_time)
            print(f"  {workers} pod(s): encode Job {times[workers]:.0f} s, {obj['status']['samplesEncoded']} samples")
        print(f"1 -> 2 pods: {times[1]:.0f} s -> {times[2]:.0f} s, {times[1] / times[2]:.2f}x")
    finally:
        operator.terminate()
        operator.wait(timeout=60)
        core.delete_namespace(namespace)


if __name__ == "__main__":
    main()
