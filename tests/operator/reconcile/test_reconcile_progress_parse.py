"""Progress arithmetic (pure): parsing rank 0's exposition, step time over an interval, finding rank 0."""

from __future__ import annotations

from wanloom_api import keys
from wanloom_operator.reconcile.progress import parse_metrics, progress_patch, rank0_host, rank0_pod, step_time_seconds

TEXT = """# HELP wanloom_step Last completed optimizer step.
# TYPE wanloom_step gauge
wanloom_step{trainingjob="j"} 40.0
# TYPE wanloom_step_time_seconds histogram
wanloom_step_time_seconds_bucket{trainingjob="j",rank="0",le="+Inf"} 40.0
wanloom_step_time_seconds_sum{trainingjob="j",rank="0"} 80.0
wanloom_step_time_seconds_count{trainingjob="j",rank="0"} 40.0
wanloom_step_time_seconds_sum{trainingjob="j",rank="1"} 120.0
wanloom_step_time_seconds_count{trainingjob="j",rank="1"} 40.0
# TYPE wanloom_loss gauge
wanloom_loss{trainingjob="j",expert="high_noise"} 0.5
wanloom_loss{trainingjob="j",expert="low_noise"} NaN
# TYPE wanloom_mfu_ratio gauge
wanloom_mfu_ratio{trainingjob="j"} 0.4
"""


def test_parse_and_first_read() -> None:
    scrape = parse_metrics(TEXT)
    patch = progress_patch(scrape, None, "now")
    # The slowest rank's mean; NaN losses (an expert without samples yet) are skipped; unset series are left out.
    assert patch == {"step": 40, "stepTimeSeconds": 3.0, "loss": 0.5, "updatedAt": "now"}


def test_step_time_is_measured_over_the_interval() -> None:
    before = parse_metrics(TEXT)
    after = parse_metrics(TEXT.replace("} 80.0", "} 90.0").replace("} 120.0", "} 125.0").replace("} 40.0", "} 50.0"))
    assert step_time_seconds(after, before) == 1.0  # rank 0: (90-80)/(50-40); rank 1: 0.5
    assert step_time_seconds(before, before) is None  # no new steps: keep the last value
    assert step_time_seconds(before, after) == 3.0  # counters went back (a restart): totals since the restart


def _pod(jobset: str, job: str, completion: str, phase: str = "Running", ip: str = "10.0.0.1") -> dict:
    return {
        "metadata": {
            "labels": {keys.JOBSET_NAME: jobset, keys.JOBSET_JOB_INDEX: job},
            "annotations": {keys.JOB_COMPLETION_INDEX: completion},
        },
        "status": {"phase": phase, "podIP": ip},
    }


def test_rank0_is_job_0_completion_0_and_running() -> None:
    pods = [
        _pod("js", "1", "0", ip="10.0.0.2"),
        _pod("js", "0", "1", ip="10.0.0.3"),
        _pod("js", "0", "0", phase="Pending", ip="10.0.0.4"),
        _pod("other", "0", "0", ip="10.0.0.5"),
        _pod("js", "0", "0", ip="10.0.0.6"),
    ]
    assert rank0_pod(pods, "js")["status"]["podIP"] == "10.0.0.6"
    assert rank0_host("pod-ip", pods, "js", "js-slice-0-0.js", "ns") == "10.0.0.6"
    assert rank0_host("pod-ip", pods[:4], "js", "js-slice-0-0.js", "ns") is None
    assert rank0_host("dns", [], "js", "js-slice-0-0.js", "ns") == "js-slice-0-0.js.ns.svc"
    assert rank0_host("static:127.0.0.1", [], "js", "x", "ns") == "127.0.0.1"
