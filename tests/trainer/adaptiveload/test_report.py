import textwrap
from pathlib import Path

import pytest

from wanloom_trainer.adaptiveload.comparison.report import run_plan
from wanloom_trainer.adaptiveload.cost.shape_bench import BenchPoint, load_points, save_points
from wanloom_trainer.config.variants import get_variant

TINY = get_variant("tiny")
ROOT = Path(__file__).resolve().parents[3]


def write_job(tmp_path: Path, data: Path, resources: str, extra: str = "") -> Path:
    job = tmp_path / "job.yaml"
    job.write_text(
        textwrap.dedent(
            f"""\
            apiVersion: wanloom.dev/v1alpha1
            kind: TrainingJob
            metadata: {{name: plan-test}}
            spec:
              model: {{variant: tiny}}
              data: {{uri: {data}}}
              adaptiveLoad: {{scheduler: balanced, memoryBudgetTokens: 4096{extra}}}
              training: {{steps: 10, globalBatch: 16}}
              resources: {resources}
            """
        )
    )
    return job


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from wanloom_trainer.data.synthetic import write_synthetic

    root = tmp_path_factory.mktemp("data")
    write_synthetic(str(root), TINY, 120, seed=0)
    return root


def test_plan_prints_buckets_and_policies(tmp_path, dataset):
    out = run_plan(write_job(tmp_path, dataset, "{cpu: {nodes: 1, devicesPerNode: 4}}"))
    assert "120 samples, 4 data-parallel ranks, mode spmd" in out
    import re

    steps = int(re.search(r"predicted over the same stream \((\d+) steps of 16 samples", out).group(1))
    assert 256 <= steps < 256 + 7  # 1,024 samples per rank in whole windows (7 steps: the 120-sample epoch)
    assert "analytic FLOPs" in out
    # tiny: uniform, shift 1, boundary 0.875 -> 12.5% of samples to the high-noise expert
    assert "routing: uniform timesteps, shift 1; expected share of samples: high-noise expert (t >= 875) 12.5%" in out
    for word in ("latent (T,H,W)", "B sampler", "B paper", "bucket-sampler", "paper", "balanced", "load CV", "shapes"):
        assert word in out
    balanced = next(line for line in out.splitlines() if re.match(r"balanced +[0-9.]+x ", line))
    slower = float(balanced.split()[1].rstrip("x")) < 1.0  # a step is a fraction of a row: the sampler's are huge
    assert ("balancing cannot help here; set spec.adaptiveLoad.scheduler: equal-tokens" in out) == slower


def fake_points():
    pts = []
    for b, shape in [
        (1, (1, 8, 8)),
        (4, (1, 8, 8)),
        (1, (3, 8, 8)),
        (4, (3, 8, 8)),
        (1, (5, 16, 16)),
        (2, (5, 16, 16)),
    ]:
        s = TINY.tokens(*shape)
        t = 0.01 + b * (1e-4 * s + 1e-7 * s * s)
        pts.append(BenchPoint(b, shape, s, t, (t,)))
    return pts


def test_plan_reuses_a_stored_benchmark(tmp_path, dataset):
    bench = tmp_path / "bench.json"
    save_points(bench, "tiny|cpu|d1f1c1t1", fake_points())
    out = run_plan(write_job(tmp_path, dataset, "{backend: torch, cpu: {nodes: 1}}"), bench)
    assert "shape benchmark" in out and "tiny|cpu|d1f1c1t1" in out and "held-out" in out
    assert "mode per-rank-lockstep" in out


def test_bench_for_an_absent_accelerator_is_a_clear_error(tmp_path, dataset):
    job = write_job(tmp_path, dataset, "{gpu: {type: h200, perNode: 8, nodes: 1}}")
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present: the benchmark would run")
    except ImportError:
        pass
    from wanloom_trainer.train.bench_step import measure_shape_bench

    with pytest.raises(ValueError, match=r"has no shape benchmark for .*run `wanloom plan --bench"):
        run_plan(job, tmp_path / "bench.json")  # nothing to measure with: the stored entry is required
    with pytest.raises(ValueError, match="must run on the job's h200 devices"):
        run_plan(job, tmp_path / "bench.json", measure=measure_shape_bench)


def test_missing_dataset_names_the_index_and_the_alternatives(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no dataset index at .*nothing; plan with --shapes SHAPES.csv"):
        run_plan(write_job(tmp_path, tmp_path / "nothing", "{cpu: {nodes: 1}}"))


def test_plan_from_a_pixel_csv_in_the_backends_mode(tmp_path):
    import json

    csv = tmp_path / "shapes.csv"
    rows = ["frames,height,width"] + [f"{1 + 8 * (i % 3)},{64 + 16 * (i % 2)},{97 + i % 5}" for i in range(40)]
    csv.write_text("\n".join(rows) + "\n")
    job = write_job(tmp_path, tmp_path / "nothing", "{cpu: {nodes: 1, devicesPerNode: 4}}")
    doc = json.loads(run_plan(job, shapes_csv=csv, as_json=True))
    assert doc["mode"] == "spmd" and doc["ranks"] == 4 and doc["samples_per_step"] == 16
    assert doc["samples_per_rank"] == 4 and doc["baseline"] == "bucket-sampler"
    assert [b["samples"] for b in doc["buckets"]] and sum(b["samples"] for b in doc["buckets"]) == 40
    assert doc["expert_share"] == {"high_noise": pytest.approx(0.125), "low_noise": pytest.approx(0.875)}
    assert set(doc["policies"]) == {"bucket-sampler", "paper", "balanced"}
    for metrics in doc["policies"].values():
        assert set(metrics) == {
            "throughput_vs_baseline", "load_cv", "padding_fraction", "idle_fraction", "compiled_shapes"
        }  # fmt: skip
    assert doc["policies"]["bucket-sampler"]["throughput_vs_baseline"] == 1.0
    # Steps of 16 small samples are a fraction of a 4,096-token row, while the sampler fills rows with up to 170
    # samples of one bucket: packing is slower here, needs fewer step programs, and the report says so once.
    balanced = doc["policies"]["balanced"]
    assert balanced["throughput_vs_baseline"] < 1.0
    assert balanced["compiled_shapes"] < doc["policies"]["bucket-sampler"]["compiled_shapes"]
    assert doc["warnings"][-1] == (
        f"spec.adaptiveLoad.scheduler balanced is predicted at {balanced['throughput_vs_baseline']:.2f}x the bucket "
        "sampler on this data: balancing cannot help here; set spec.adaptiveLoad.scheduler: equal-tokens (one bucket "
        "per micro-batch)"
    )
    # What a step trains, beside the throughput: 16 samples in slots of 4 rows cannot always make exactly 16, and a
    # step that misses by more than 10% is said; the token budget's figures are there to compare.
    sem = doc["step_semantics"]
    assert doc["step_budget"] == "samples" and sem["global_batch"] == 16
    p5, _, p95, largest = sem["samples"]
    assert (p5 < 14.4 or p95 > 17.6) == any("not within 10% of globalBatch 16" in w for w in doc["warnings"])
    assert largest <= 24 and sem["worst_third"] <= 0.25
    assert doc["other_step_budget"]["step_budget"] == "tokens"


def test_plan_refuses_a_step_larger_than_an_epoch(tmp_path):
    csv = tmp_path / "shapes.csv"
    csv.write_text("frames,height,width\n" + "1,64,64\n" * 10)
    job = write_job(tmp_path, tmp_path / "nothing", "{cpu: {nodes: 1, devicesPerNode: 8}}")
    with pytest.raises(ValueError, match=r"spec.training.globalBatch 16 is more than the 10 samples .* at most 10"):
        run_plan(job, shapes_csv=csv, as_json=True)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("f,h,w\n1,64,64\n", "line 1 must be the header 'frames,height,width'"),
        ("frames,height,width\n1,64\n", "line 2: expected integers frames,height,width"),
        ("frames,height,width\n1,8,64\n", "line 2: 1x8x64 is too small"),
        ("frames,height,width\n", "no samples after the header"),
    ],
)
def test_bad_shapes_csv_names_the_line(tmp_path, text, message):
    csv = tmp_path / "bad.csv"
    csv.write_text(text)
    with pytest.raises(ValueError, match=message):
        run_plan(write_job(tmp_path, tmp_path / "nothing", "{cpu: {nodes: 1}}"), shapes_csv=csv)


@pytest.mark.parametrize("backend", ["jax", "torch"])
@pytest.mark.slow
def test_the_shape_benchmark_times_the_jobs_own_step(tmp_path, backend):
    """The benchmark step is the job's backend step: it trains (parameters move), and it is timed per grid point."""
    import importlib.util

    from wanloom_trainer.adaptiveload.cost.shape_bench import run_shape_bench, save_points
    from wanloom_trainer.train.bench_step import BackendStep

    spec = importlib.util.spec_from_file_location("tiny_job", ROOT / "tests/trainer/train/scripts/tiny_job.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    step = BackendStep(tiny.tiny_config(tmp_path, resources={"backend": backend}))
    fresh = step.backend.init_state()  # the same seeded initialisation the step started from
    points = run_shape_bench(step, [(1, (1, 8, 8)), (2, (3, 8, 8))], TINY, warmup=1, repeats=1)
    assert all(p.seconds > 0 for p in points) and [p.tokens for p in points] == [16, 48]
    assert _leaves_differ(fresh, step.state)  # it trained: AdamW moved the parameters
    save_points(tmp_path / "b.json", "tiny|cpu|d1f1c1t1", points)
    assert load_points(tmp_path / "b.json", "tiny|cpu|d1f1c1t1") == points


def _leaves_differ(a, b) -> bool:
    import numpy as np

    if hasattr(a, "experts"):  # torch
        pa = [p.detach().cpu().numpy() for m in a.experts for p in m.parameters()]
        pb = [p.detach().cpu().numpy() for m in b.experts for p in m.parameters()]
    else:
        import jax

        pa, pb = (jax.tree_util.tree_leaves(s.params) for s in (a, b))
    return any(not np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(pa, pb, strict=True))


def fake_config(tmp_path, cost_model="auto", exponent=None, bench_file=None, accelerator="cpu"):
    from types import SimpleNamespace

    al = SimpleNamespace(cost_model=cost_model, exponent=exponent, bench_file=bench_file, memory_budget_tokens=4096)
    return SimpleNamespace(
        adaptive_load=al,
        model=SimpleNamespace(wan=TINY, variant="tiny"),
        accelerator=accelerator,
        accelerator_type=None if accelerator == "cpu" else "h200",
        parallel=SimpleNamespace(data=1, fsdp=1, context=1, tensor=1),
    )


def test_cost_source_paths(tmp_path):
    from wanloom_trainer.adaptiveload.cost.cost_source import resolve_cost_model

    assert resolve_cost_model(fake_config(tmp_path)).model.kind == "flops"
    h200 = resolve_cost_model(fake_config(tmp_path, accelerator="gpu"))
    assert h200.model.flops_per_second == pytest.approx(0.4 * 989e12) and "h200" in h200.description
    # The analytic model's documented per-micro-batch overhead (FSDP collectives and dispatch on a GPU).
    assert h200.model.overhead == 0.05 and "+ 50 ms per micro-batch" in h200.description
    power = resolve_cost_model(fake_config(tmp_path, cost_model="power", exponent=1.6)).model
    assert (power.kind, power.p) == ("power", 1.6)
    bench = tmp_path / "b.json"
    with pytest.raises(ValueError, match="has no shape benchmark for tiny\\|cpu\\|d1f1c1t1"):
        resolve_cost_model(fake_config(tmp_path, bench_file=str(bench)))
    save_points(bench, "tiny|cpu|d1f1c1t1", fake_points())
    fitted = resolve_cost_model(fake_config(tmp_path, cost_model="two-term", bench_file=str(bench)))
    assert fitted.model.kind == "two-term" and fitted.fit.quality["two-term"].r2 > 0.999
