"""``import metrale`` must not import CuPy or numba, nor touch CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HEAVY = ("cupy", "numba", "numba.cuda", "nvmath", "torch", "transformers")


def run_probe(probe: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}  # the real numba.cuda
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env)
    return result.stdout.strip().splitlines()[-1]


def modules_after(code: str, heavy=HEAVY) -> list[str]:
    probe = f"import sys, json\n{code}\nprint(json.dumps([m for m in {heavy!r} if m in sys.modules]))"
    return json.loads(run_probe(probe))


def test_import_metrale_loads_no_gpu_stack():
    assert modules_after("import metrale\nfrom metrale import LLM, SamplingParams, RequestOutput, hookimpl") == []


def test_building_a_plugin_manager_loads_no_gpu_stack():
    code = "from metrale.model.plugin_manager import get_plugin_manager\nget_plugin_manager(entry_points=False)"
    assert modules_after(code) == []


def test_loading_a_checkpoint_on_the_cpu_loads_no_gpu_array_stack():
    """The kernel modules (and so numba) load with the CPU ops, but CuPy and cuBLAS never do."""
    code = "import metrale\nllm = metrale.LLM('tiny-dense', device='cpu', show_progress=False)\nllm.score([1, 2, 3])"
    assert modules_after(code, ("cupy", "nvmath", "torch", "transformers")) == []
