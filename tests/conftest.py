"""Shared fixtures: tiny random-weight Hugging Face checkpoints of the dense family."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def pytest_configure(config):
    """Kernels run under numba's CUDA simulator unless the run selects GPU tests (-m gpu)."""
    if "gpu" in (config.getoption("markexpr") or "").replace("not gpu", ""):
        return
    if "numba" in sys.modules and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        raise pytest.UsageError("numba was imported before the CUDA simulator could be enabled")
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    # The simulator's block manager polls its threads while holding the GIL; a short switch
    # interval lets the simulated threads reach their barriers sooner.
    sys.setswitchinterval(5e-5)
    _serialize_simulated_shared_arrays()


def _serialize_simulated_shared_arrays():
    """Make the simulator's ``cuda.shared.array`` create each array once per block.

    The simulator keys a block's shared arrays by the source line that declares them and creates
    one on the first thread to get there, without a lock: two threads arriving together (likely
    with the short switch interval) can each create their own, and the block's threads then
    disagree about the array's contents. This does the same lookup under a lock.
    """
    import threading
    import traceback

    import numpy as np
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    original = kernelapi.FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory, or the simulator's error
            return original(self, shape, dtype, alignment)
        caller = tuple(traceback.extract_stack(sys._getframe(1), limit=1)[-1])[0:2]
        with lock:
            allocated = self._allocations.get(caller)
            if allocated is None:
                if isinstance(dtype, types.Type):
                    dtype = numpy_support.as_dtype(dtype)
                allocated = self._allocations[caller] = np.empty(shape, dtype)
        return allocated

    kernelapi.FakeCUDAShared.array = array

BASE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    max_position_embeddings=256,
)


def dense_configs():
    """(name, model class, config) of the four dense variants FAMILIES.md §7 lists."""
    from transformers import (
        LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
        Qwen3Config, Qwen3ForCausalLM,
    )

    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return {
        "llama": (LlamaForCausalLM, LlamaConfig(**BASE, num_key_value_heads=2, rms_norm_eps=1e-5, rope_parameters=llama3)),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**BASE, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=True)),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**BASE, num_key_value_heads=2, head_dim=32)),
        "mistral": (MistralForCausalLM, MistralConfig(**BASE, num_key_value_heads=1, sliding_window=4)),
    }


@pytest.fixture(scope="session")
def dense_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One float32 checkpoint folder per dense variant."""
    from metrale.testing.hf import build_hf_checkpoint

    root = tmp_path_factory.mktemp("dense")
    return {
        name: build_hf_checkpoint(cls, config, root / name, seed=index)
        for index, (name, (cls, config)) in enumerate(dense_configs().items())
    }


@pytest.fixture(params=["llama", "qwen2", "qwen3", "mistral"])
def dense_checkpoint(request, dense_checkpoints) -> Path:
    return dense_checkpoints[request.param]
