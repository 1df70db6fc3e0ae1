"""End to end with a real Prometheus: scrape a local `wanloom run` of the tiny job, check the contract's metrics
arrive and run every query of the Grafana dashboard against it.

Prometheus (Debian's package) runs on 127.0.0.1 with a 1 s scrape interval. Its static targets carry the labels a
PodMonitor would add (`namespace`, `pod`), so the dashboard's `$namespace` variable has something to select. The
run's dataset misses one shard, so the loader really skips a sample. The operator's panels read the operator's
real exporter (OperatorMetrics), fed in-process as its handlers would feed it; the data-preparation panels read a
LatentDataset pod's real exporter (PrepareMetrics), fed by a real `prepare` of generated media.

Most of the time goes into XLA compiling the tiny model's step shapes (minutes on a busy 2-core machine; the
compile cache makes a rerun faster), hence `slow`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from wanloom_api.metrics import DATASET_METRICS, PREPARE_STAGES, TRAINER_METRICS

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "helm" / "wanloom" / "dashboards" / "wanloom.json"
PROMETHEUS = shutil.which("prometheus")
NAMESPACE = "wanloom-e2e"
LATENTDATASET = "corpus-e2e"
RATE_INTERVAL = "15s"  # what Grafana's $__rate_interval becomes at a 1 s scrape interval and a short time range


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _wait_for(check: Callable[[], Any], timeout: float, what: str) -> None:
    """Poll ``check`` until it returns something truthy; the timeout error shows its last answer."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return
        except OSError as err:
            last = err
        time.sleep(0.5)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


class Prometheus:
    """A real Prometheus process scraping static targets every second."""

    def __init__(
        self, workdir: Path, targets: dict[str, tuple[int, dict[str, str]]], rules: dict[str, Any] | None = None
    ) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config: dict[str, Any] = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {
                    "job_name": job,
                    "honor_labels": True,  # as the chart's ServiceMonitor: keep the operator's per-job `namespace`
                    "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": labels}],
                }
                for job, (port, labels) in targets.items()
            ],
        }
        if rules is not None:  # the chart's PrometheusRule spec is a Prometheus rule file
            (workdir / "rules.yml").write_text(yaml.safe_dump(rules))
            config["rule_files"] = [str(workdir / "rules.yml")]
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                str(PROMETHEUS),
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        _wait_for(lambda: urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200, 30, "Prometheus")

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr} | ({"time": f"{at:.3f}"} if at else {})
        body = _get_json(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}")
        assert body["status"] == "success", body
        return body["data"]["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        query = urllib.parse.urlencode({"match[]": match})
        return _get_json(f"{self.url}/api/v1/label/{label}/values?{query}")["data"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# -- what Prometheus scrapes ---------------------------------------------------------------------------------------


def _write_job(workdir: Path, name: str) -> Path:
    """jobs/tiny-local.yaml with its paths in `workdir`, frequent checkpoints, cost refits and validations (every
    contract metric then has data), and room for the skipped samples."""
    job = yaml.safe_load((ROOT / "jobs" / "tiny-local.yaml").read_text())
    job["metadata"]["name"] = name
    job["spec"]["data"]["uri"] = str(workdir / "data")
    job["spec"]["data"]["maxBadSamples"] = 1_000_000
    job["spec"]["training"]["checkpoint"].update(uri=str(workdir / "checkpoints"), interval=20, keep=1)
    job["spec"]["adaptiveLoad"]["refitEverySteps"] = 5  # the cost-model panel has data within the first steps
    job["spec"]["validation"] = {"everySteps": 5, "samples": 4}  # the validation-loss panel, likewise
    path = workdir / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def _write_data_with_a_missing_shard(workdir: Path) -> None:
    """The job's synthetic dataset, one sample per shard, with one shard deleted: the loader skips that sample."""
    from wanloom_trainer.config.variants import get_variant
    from wanloom_trainer.data import write_synthetic

    job = yaml.safe_load((workdir / "job.yaml").read_text())["spec"]["data"]
    synthetic = job["synthetic"]
    write_synthetic(job["uri"], get_variant("tiny"), synthetic["samples"], synthetic["seed"], samples_per_shard=1)
    shards = sorted((workdir / "data" / "shards").glob("*.tar"))
    assert len(shards) == synthetic["samples"], shards
    shards[len(shards) // 2].unlink()


def _wanloom() -> list[str]:
    script = Path(sys.executable).with_name("wanloom")
    return [str(script)] if script.exists() else [sys.executable, "-c", "from wanloom_cli import main; main()"]


class LocalRun:
    """`wanloom run` of the tiny job in a subprocess, serving its metrics on `port`."""

    def __init__(self, workdir: Path, job: Path, port: int, compile_cache: Path) -> None:
        env = dict(os.environ)
        paths = [str(ROOT / "operator"), str(ROOT / "trainer_images"), env.get("PYTHONPATH", "")]
        env.update(PYTHONPATH=os.pathsep.join(p for p in paths if p), JAX_COMPILATION_CACHE_DIR=str(compile_cache))
        command = [*_wanloom(), "run", str(job), "--steps", "100000", "--metrics-port", str(port)]
        command += ["--run-dir", str(workdir / "run"), "--no-progress"]
        self.log_path = workdir / "wanloom-run.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            pytest.fail(f"wanloom run exited with {self.proc.returncode}:\n{self.log_path.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class OperatorExporter:
    """The operator's real exporter (OperatorMetrics), fed as the handlers feed it while the job runs."""

    def __init__(self, port: int, trainingjob: str) -> None:
        from wanloom_operator.metrics.operator import OperatorMetrics

        self.metrics, self.trainingjob = OperatorMetrics(), trainingjob
        self.metrics.observe_job(
            NAMESPACE,
            trainingjob,
            {"phase": "Running", "restarts": 1, "progress": {"stepTimeSeconds": 0.1, "loadImbalanceCV": 0.0}},
        )
        self.server = self.metrics.serve(port, "127.0.0.1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._reconcile, daemon=True)
        self._thread.start()

    def _reconcile(self) -> None:  # rate() needs the handler counters to move
        while not self._stop.wait(0.5):
            with self.metrics.handler("progress"):
                pass

    def restarted(self, restarts: int) -> None:
        """The JobSet restarted: the status the operator mirrors now counts ``restarts``."""
        self.metrics.observe_job(NAMESPACE, self.trainingjob, {"phase": "Running", "restarts": restarts})

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.server.shutdown()
        self.server.server_close()


class DatasetExporter:
    """A LatentDataset encode pod's real exporter (PrepareMetrics), fed by a real ``prepare`` of generated media with
    the tiny encoders: two images, a clip and a corrupt file, in units of two."""

    def __init__(self, port: int, workdir: Path, latentdataset: str) -> None:
        import importlib.util

        from PIL import Image

        from wanloom_trainer.data.bucketing import parse_bucket
        from wanloom_trainer.data.prepare.pipeline import PrepareConfig, prepare
        from wanloom_trainer.metrics.prepare import PrepareMetrics

        path = ROOT / "tests" / "trainer" / "data" / "tiny_media.py"
        spec = importlib.util.spec_from_file_location("wanloom_e2e_tiny_media", path)
        assert spec is not None and spec.loader is not None
        tiny = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tiny)
        media = workdir / "media"
        media.mkdir()
        for name, (h, w) in {"a.png": (60, 90), "b.png": (64, 64)}.items():
            Image.new("RGB", (w, h), (200, 30, 30)).save(media / name)
        tiny.write_video(media / "clip.mp4", frames=20, height=72, width=88, fps=16)
        (media / "broken.png").write_bytes(b"not a png")
        for name in ("a.png", "b.png", "clip.mp4", "broken.png"):
            (media / name).with_suffix(".txt").write_text("a red cat runs on the grass")
        self.metrics = PrepareMetrics(latentdataset)
        self.metrics.serve(port, "127.0.0.1")
        config = PrepareConfig(
            inputs=media,
            output=str(workdir / "latents"),
            model=tiny.write_tiny_encoders(workdir / "encoders"),
            variant="tiny",
            buckets=tuple(parse_bucket(b) for b in ("1x64x64", "1x64x96", "9x64x64")),
            samples_per_shard=2,
            dtype="float32",
        )
        prepare(config, progress=False, workers=1, on_progress=self.metrics.observe)

    def stop(self) -> None:
        self.metrics.close()


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, LocalRun, str, OperatorExporter]]:
    if PROMETHEUS is None:
        why = "the prometheus binary is not installed (apt-get install -y --no-install-recommends prometheus)"
        if os.environ.get("WANLOOM_REQUIRE_E2E"):  # CI sets it: there a missing Prometheus is a failure
            pytest.fail(why)
        pytest.skip(why)
    workdir = tmp_path_factory.mktemp("e2e")
    # XLA's compile cache outlives this test's temp dir, so a second run skips most of the compiling.
    compile_cache = tmp_path_factory.getbasetemp().parent / "wanloom-e2e-jax-cache"
    trainingjob = "tiny-e2e"
    job = _write_job(workdir, trainingjob)
    _write_data_with_a_missing_shard(workdir)
    trainer_port, operator_port, dataset_port = _free_port(), _free_port(), _free_port()
    run = LocalRun(workdir, job, trainer_port, compile_cache)
    operator = OperatorExporter(operator_port, trainingjob)
    dataset = None
    prom = None
    try:
        dataset = DatasetExporter(dataset_port, workdir, LATENTDATASET)
        prom = Prometheus(
            workdir,
            {
                # The labels a PodMonitor adds to a trainer pod's series.
                "wanloom-trainer": (trainer_port, {"namespace": NAMESPACE, "pod": f"{trainingjob}-0"}),
                "wanloom-operator": (operator_port, {"namespace": "wanloom-system"}),
                "wanloom-dataset": (dataset_port, {"namespace": NAMESPACE, "pod": f"{LATENTDATASET}-encode-0"}),
            },
            _chart_alert_rules(),
        )
        yield prom, run, trainingjob, operator
    finally:
        if prom is not None:
            prom.stop()
        if dataset is not None:
            dataset.stop()
        run.stop()
        operator.stop()


def _chart_alert_rules() -> dict[str, Any]:
    """The groups of the chart's PrometheusRule (metrics.prometheusRule), as Helm renders them."""
    from helm_python import Chart

    rendered = Chart.load(str(ROOT / "helm" / "wanloom")).render(
        {"metrics": {"prometheusRule": {"enabled": True}}}, name="wanloom", namespace="wanloom-system"
    )
    return yaml.safe_load(rendered["wanloom/templates/prometheusrule.yaml"])["spec"]


# -- checks --------------------------------------------------------------------------------------------------------

# Contract series a local CPU run cannot have, and why. Each must really be absent (the test says when it shows up).
# Metrics a local CPU run legitimately cannot export (name -> why). Empty: MFU uses the stated nominal CPU peak.
ABSENT_ON_CPU: dict[str, str] = {}
STEADY_STEPS = 5  # optimizer steps inside the last rate window before the queries run
SKIPPED = "wanloom_skipped_samples_total"


def _exposed_name(name: str) -> str:
    spec = next(m for m in TRAINER_METRICS if m.name == name)
    return f"{name}_count" if spec.kind == "histogram" else name


def _trainer_series(prom: Prometheus) -> set[str]:
    return {r["metric"]["__name__"] for r in prom.query('{__name__=~"wanloom_.+", job="wanloom-trainer"}')}


def _wait_until_training_is_steady(prom: Prometheus, run: LocalRun, timeout: float) -> float:
    """Wait for the step's contract series and a few steps in the last rate window; return that moment."""
    expected = {_exposed_name(m.name) for m in TRAINER_METRICS if m.name not in ABSENT_ON_CPU} - {SKIPPED}
    steady = f"sum(increase(wanloom_step_time_seconds_count[{RATE_INTERVAL}])) >= {STEADY_STEPS}"
    deadline, missing = time.monotonic() + timeout, expected
    while time.monotonic() < deadline:
        run.check_alive()
        missing = expected - _trainer_series(prom)
        if not missing and prom.query(steady):
            return time.time()
        time.sleep(1)
    pytest.fail(
        f"after {timeout:.0f} s: contract metrics not in Prometheus: {sorted(missing)}; "
        f"wanloom run log:\n{run.log_path.read_text()[-3000:]}"
    )


def _wait_for_skips(prom: Prometheus, run: LocalRun, trainingjob: str, timeout: float) -> None:
    """The missing shard's sample must be counted under reason="missing" once the loader has skipped it."""
    query = f'wanloom_skipped_samples_total{{reason="missing", trainingjob="{trainingjob}"}} > 0'
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if prom.query(query):
            return
        time.sleep(1)
    logged = "skipping sample" in run.log_path.read_text()
    pytest.fail(
        f"{SKIPPED} never reached Prometheus"
        + (
            " although the loader logged skipped samples: the run does not hand the exporter's record_skipped to "
            "the dataset (open_dataset(..., on_skip=...) / dataset.budget.on_skip in wanloom_trainer.train.run)"
            if logged
            else " and the loader logged no skip: the deleted shard was never read"
        )
    )


def _dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels if p["type"] != "row" for t in p["targets"]]


def _substitute(expr: str, trainingjob: str) -> str:
    """Grafana's variable substitution for one selected namespace and TrainingJob."""
    return (
        expr.replace("$__rate_interval", RATE_INTERVAL)
        .replace("$namespace", NAMESPACE)
        .replace("$trainingjob", trainingjob)
        .replace("$latentdataset", LATENTDATASET)
    )


def _has_data(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


@pytest.mark.slow
def test_local_run_feeds_the_contract_and_every_dashboard_query(scraped: tuple[Any, ...]) -> None:
    prom, run, trainingjob, _ = scraped
    at = _wait_until_training_is_steady(prom, run, timeout=600)
    series = _trainer_series(prom)
    outside = {n for n in series if n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
               not in {m.name for m in TRAINER_METRICS}}  # fmt: skip
    assert not outside, f"series outside the metrics contract: {sorted(outside)}"
    for name, why in ABSENT_ON_CPU.items():
        assert _exposed_name(name) not in series, (
            f"{name} now arrives from a CPU run; drop it from ABSENT_ON_CPU ({why})"
        )
    assert not prom.query('{__name__=~"wanloom_.+", exported_job!=""}'), "a wanloom series exported a `job` label"

    no_data, unexpected = [], []
    for title, expr in _dashboard_queries():
        result = prom.query(_substitute(expr, trainingjob), at)
        if any(name in expr for name in ABSENT_ON_CPU):
            if _has_data(result):
                unexpected.append(f"{title}: {expr}")
        elif not _has_data(result):
            no_data.append(f"{title}: {expr} -> {result}")
    assert not no_data, "dashboard queries without data:\n" + "\n".join(no_data)
    assert not unexpected, "queries on ABSENT_ON_CPU metrics returned data; update the list:\n" + "\n".join(unexpected)


@pytest.mark.slow
def test_a_dataset_pods_counts_reach_prometheus(scraped: tuple[Any, ...]) -> None:
    prom = scraped[0]
    selector = f'{{namespace="{NAMESPACE}", latentdataset="{LATENTDATASET}"}}'

    def value(expr: str) -> float | None:
        result = prom.query(expr)
        return float(result[0]["value"][1]) if result else None

    _wait_for(lambda: value(f"wanloom_prepare_units_total{selector}") == 2, 60, "two units in Prometheus")
    names = {r["metric"]["__name__"] for r in prom.query('{__name__=~"wanloom_.+", job="wanloom-dataset"}')}
    assert names == {m.name for m in DATASET_METRICS}
    assert value(f"wanloom_prepare_samples_total{selector}") == 3  # two images and the clip
    assert value(f'wanloom_prepare_skipped_total{{reason="undecodable", latentdataset="{LATENTDATASET}"}}') == 1
    stages = prom.query(f"wanloom_prepare_stage_seconds_total{selector} > 0")
    assert {r["metric"]["stage"] for r in stages} == set(PREPARE_STAGES)


@pytest.mark.slow
def test_skipped_samples_are_counted(scraped: tuple[Any, ...]) -> None:
    prom, run, trainingjob, _ = scraped
    _wait_until_training_is_steady(prom, run, timeout=600)
    _wait_for_skips(prom, run, trainingjob, timeout=30)


@pytest.mark.slow
def test_dashboard_variables_resolve(scraped: tuple[Any, ...]) -> None:
    prom, run, trainingjob, _ = scraped
    _wait_for(lambda: prom.query("wanloom_step") or run.check_alive(), 600, "wanloom_step")
    assert NAMESPACE in prom.label_values("namespace", "wanloom_step")
    assert trainingjob in prom.label_values("trainingjob", f'wanloom_step{{namespace=~"{NAMESPACE}"}}')
    match = f'wanloom_prepare_samples_total{{namespace=~"{NAMESPACE}"}}'
    _wait_for(lambda: LATENTDATASET in prom.label_values("latentdataset", match), 30, "the latentdataset variable")


@pytest.mark.slow
def test_the_charts_alerts_evaluate_and_the_restart_alert_fires(scraped: tuple[Any, ...]) -> None:
    prom, run, trainingjob, operator = scraped
    _wait_until_training_is_steady(prom, run, timeout=600)
    restarts = f'wanloom_operator_job_restarts{{trainingjob="{trainingjob}"}} == 1'
    _wait_for(lambda: prom.query(restarts), 30, "one restart scraped")
    operator.restarted(5)  # four preemptions within the hour: above the chart's restartsPerHour (3)
    expected = {r["alert"] for g in _chart_alert_rules()["groups"] for r in g["rules"]}

    def rules() -> dict[str, Any]:
        groups = _get_json(f"{prom.url}/api/v1/rules?type=alert")["data"]["groups"]
        return {r["name"]: r for g in groups for r in g["rules"]}

    _wait_for(lambda: rules().keys() == expected and all(r["health"] == "ok" for r in rules().values()), 30,
              "every chart alert loaded and evaluated")  # fmt: skip
    _wait_for(lambda: rules()["WanloomJobRestarts"]["state"] == "firing", 30, "WanloomJobRestarts firing")
    firing = rules()["WanloomJobRestarts"]["alerts"][0]["labels"]
    assert firing["namespace"] == NAMESPACE and firing["trainingjob"] == trainingjob, firing
    assert rules()["WanloomStorageOutage"]["state"] == "inactive"
