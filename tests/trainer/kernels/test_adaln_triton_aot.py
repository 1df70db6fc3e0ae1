"""Every Triton AdaLN kernel the launchers can start compiles for sm_90 and sm_100 without spilling registers.

Compiled (not interpreted) with Triton's bundled ptxas through ``benchmarks/adaln_kernels.py --aot``, in a
subprocess: this folder's conftest switches the interpreter on for the numerical tests, and Triton fixes the mode
when the kernels are defined.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wanloom_trainer.kernels.triton_aot import occupancy, parse_target

ROOT = Path(__file__).resolve().parents[3]


def test_occupancy_follows_registers_warps_and_shared_memory() -> None:
    assert occupancy(32, 8, 0) == 1.0  # 8 blocks of 8 warps fill the 64 warp slots
    assert occupancy(64, 8, 0) == 0.5  # 64K registers / (64 · 256 threads) = 4 blocks
    assert occupancy(255, 8, 0) == 0.125
    assert occupancy(32, 8, 100 * 1024) == 0.25  # two 100 KiB blocks fit in 228 KiB
    with pytest.raises(ValueError, match="valid: sm_90, sm_100"):
        parse_target("sm_80")


@pytest.mark.slow
def test_every_kernel_compiles_for_hopper_and_blackwell_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "operator"), str(ROOT / "trainer_images")])
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "adaln_kernels.py"), "--aot", "sm_90,sm_100", "--json"],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert run.stdout.strip(), run.stderr[-4000:]
    rows = json.loads(run.stdout)
    passes = {(r["target"], r["D"], r["dtype"], r["modulation"], r["pass"]) for r in rows}
    # 2 targets x 3 widths x 3 dtypes; per sample and per segment 4 kernels, per token 3 (no segment sum)
    assert len(passes) == 2 * 3 * 3 * (4 + 4 + 3) == len(rows)
    spilled = [r for r in rows if r["spill_bytes"] or r["stack_bytes"]]
    assert not spilled, spilled
    assert run.returncode == 0, run.stderr[-2000:]
    assert all(r["registers"] <= 128 and r["occupancy"] >= 0.25 for r in rows), rows
