"""Kernel tests run on CPU in the interpreters.

Triton decides at decoration time whether a kernel is compiled or interpreted, so ``TRITON_INTERPRET=1`` must be set
before ``wanloom_trainer.kernels.adaln_triton`` is first imported; this conftest is loaded before the test modules
of this folder. On a machine with a CUDA GPU the variable is left alone and the Triton tests run compiled.
"""

from __future__ import annotations

import os
import shutil

if "TRITON_INTERPRET" not in os.environ and shutil.which("nvidia-smi") is None:
    os.environ["TRITON_INTERPRET"] = "1"
