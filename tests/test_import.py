"""``import metrale`` must not import CuPy or numba, nor touch CUDA."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("cupy", "numba", "numba.cuda", "nvmath", "torch", "transformers")


def modules_after(code: str) -> list[str]:
    probe = f"import sys, json\n{code}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_metrale_loads_no_gpu_stack():
    assert modules_after("import metrale\nfrom metrale import LLM, SamplingParams, RequestOutput, hookimpl") == []


def test_building_a_plugin_manager_loads_no_gpu_stack():
    code = "from metrale.plugin_manager import get_plugin_manager\nget_plugin_manager(entry_points=False)"
    assert modules_after(code) == []


def test_loading_a_checkpoint_on_the_cpu_loads_no_gpu_stack():
    code = "import metrale\nllm = metrale.LLM('tiny-dense', device='cpu', show_progress=False)\nllm.score([1, 2, 3])"
    assert modules_after(code) == []
