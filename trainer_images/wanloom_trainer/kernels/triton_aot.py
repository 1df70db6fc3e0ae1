"""Compile Triton kernels for an NVIDIA target without a GPU and read what the hardware would get.

``triton.compile`` lowers a ``@triton.jit`` function to PTX and runs the ``ptxas`` bundled with Triton; ``ptxas -v``
on that PTX then reports registers per thread, spill stores/loads and the stack frame, the same figures a GPU build
gets. Occupancy follows from those and the launch's warps with the SM limits of Hopper and Blackwell (both: 64K
32-bit registers, 64 resident warps, 32 resident blocks, 227 KiB shared memory per block).

Used by ``benchmarks/adaln_kernels.py --aot`` and by the test that fails on any spill.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TARGETS = {"sm_90": 90, "sm_100": 100}
_REGISTERS_PER_SM = 65536
_MAX_WARPS_PER_SM = 64
_MAX_BLOCKS_PER_SM = 32
_SHARED_PER_SM = 228 * 1024
_REGISTER_ALLOCATION_UNIT = 256  # registers are allocated per warp in units of 256


@dataclass(frozen=True)
class Compiled:
    """Resource use of one compiled kernel."""

    kernel: str
    target: str
    num_warps: int
    registers: int  # per thread
    spill_stores: int  # bytes per thread
    spill_loads: int
    stack_bytes: int
    shared_bytes: int
    occupancy: float  # resident warps / 64

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores + self.spill_loads

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "spill_bytes": self.spill_bytes}


def parse_target(name: str) -> int:
    """``"sm_90"`` -> 90; raises ValueError naming the valid targets."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; valid: {', '.join(TARGETS)}")
    return TARGETS[name]


def occupancy(registers: int, num_warps: int, shared_bytes: int) -> float:
    """Fraction of the SM's 64 warp slots that blocks of this kernel can fill at once."""
    per_warp = -(-registers * 32 // _REGISTER_ALLOCATION_UNIT) * _REGISTER_ALLOCATION_UNIT
    blocks = min(
        _REGISTERS_PER_SM // per_warp // num_warps,
        _MAX_WARPS_PER_SM // num_warps,
        _MAX_BLOCKS_PER_SM,
        _SHARED_PER_SM // shared_bytes if shared_bytes else _MAX_BLOCKS_PER_SM,
    )
    return blocks * num_warps / _MAX_WARPS_PER_SM


def _ptxas(capability: int) -> Path:
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    blackwell = bin_dir / "ptxas-blackwell"
    return blackwell if capability >= 100 and blackwell.exists() else bin_dir / "ptxas"


_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def _resources(ptx: str, capability: int, kernel: str) -> dict[str, int]:
    """Run ``ptxas -v`` on the PTX and parse the kernel's registers, stack and spills."""
    arch = f"sm_{capability}a"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        Path(src).write_text(ptx)
        out = subprocess.run(
            [str(_ptxas(capability)), "-v", f"--gpu-name={arch}", src, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    text = out.stdout + out.stderr
    section = text[text.find(f"Compiling entry function '{kernel}'") :]
    stack, registers = _STACK.search(section), _REGISTERS.search(section)
    if stack is None or registers is None:
        raise RuntimeError(f"ptxas -v printed no resource lines for {kernel}:\n{text}")
    frame, stores, loads = (int(v) for v in stack.groups())
    return {"registers": int(registers.group(1)), "stack": frame, "stores": stores, "loads": loads}


def compile_kernel(
    fn: Any, signature: dict[str, str], constexprs: dict[str, Any], target: str, num_warps: int, num_stages: int = 1
) -> Compiled:
    """Compile ``fn`` for ``target`` (``sm_90`` / ``sm_100``) and report its resources.

    Args:
        fn: a ``@triton.jit`` function (compiled mode: ``TRITON_INTERPRET`` must be unset when it was defined).
        signature: Triton type of every argument (``"*bf16"``, ``"i32"``, ``"fp32"``, ``"constexpr"``).
        constexprs: values of the constexpr arguments.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    capability = parse_target(target)
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    name = compiled.metadata.name
    res = _resources(compiled.asm["ptx"], capability, name)
    shared = int(compiled.metadata.shared)
    return Compiled(
        kernel=name,
        target=target,
        num_warps=num_warps,
        registers=res["registers"],
        spill_stores=res["stores"],
        spill_loads=res["loads"],
        stack_bytes=res["stack"],
        shared_bytes=shared,
        occupancy=occupancy(res["registers"], num_warps, shared),
    )
