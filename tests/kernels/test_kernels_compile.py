"""Every CUDA kernel compiles to PTX for the H200 (no GPU needed: NVVM from the test extras).

The simulator runs kernels as Python, so a construct numba cannot compile (a non-constant
shared-array size, a type it cannot unify) would otherwise only fail on the GPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "compile_kernels.py"


def test_every_kernel_compiles_for_compute_capability_9_0():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.startswith(("ok", "FAILED"))]
    assert result.returncode == 0 and lines and all(line.startswith("ok") for line in lines), (
        result.stdout[-4000:] + result.stderr[-2000:]
    )
    assert len(lines) >= 10
