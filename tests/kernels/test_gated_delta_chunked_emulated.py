"""The chunked gated delta rule's CUDA C++ source, run on the CPU (``emulated_cuda.h``: a fiber per
CUDA thread, ``mma.sync`` from the PTX fragment layouts), against the NumPy model of its steps and
the float32 reference. Needs g++ on Linux; skipped without it.

It checks what only a GPU run would otherwise show: the fragment layouts and indexing (the model
agrees to the odd bf16 rounding of a differently ordered float32 sum), the barriers (two
scheduling orders of the threads between barriers give the same bits), and the bounds (inputs
inside NaN guards, outputs and shared memory inside sentinel guards).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_gated_delta_chunked import prompt_case, rel_error

from metrale.kernels import gated_delta, gated_delta_chunked

pytestmark = pytest.mark.skipif(shutil.which("g++") is None or not sys.platform.startswith("linux"),
                                reason="the emulation needs g++ and ucontext")

HEADER = Path(__file__).with_name("emulated_cuda.h")
GUARD = 1024  # elements either side of every array
LAUNCHER = """
extern "C" int run(const float* q, const float* k, const float* v, const float* g, const float* beta, float* state,
                   const int* slots, const int* starts, int heads, float* out, unsigned segments, unsigned splits,
                   unsigned seed) {
    return emu::launch({segments, (unsigned)heads, splits}, THREADS, SHARED_BYTES,
                       [&] { gated_delta_chunked(q, k, v, g, beta, state, slots, starts, heads, out); }, seed);
}
"""


def emulated_source(key_dim: int, value_dim: int, columns: int) -> str:
    """The kernel's source for the variant, on :file:`emulated_cuda.h` instead of the device."""
    source = (gated_delta_chunked.SOURCE.replace("__KEY_DIM__", str(key_dim)).replace("__VALUE_DIM__", str(value_dim))
              .replace("__COLUMNS__", str(columns))
              .replace("__SHARED_BYTES__", str(gated_delta_chunked.shared_bytes(key_dim, columns))))
    source = source.replace("#include <cuda_bf16.h>", '#include "emulated_cuda.h"')
    start = source.index("__device__ __forceinline__ void mma_16x8x16")
    end = source.index("}\n", source.index("asm volatile", start)) + 2
    source = source[:start] + source[end:]  # the header's mma takes the inline PTX's place
    shared = "extern __shared__ __align__(16) unsigned char shared[];"
    assert shared in source
    source = source.replace(shared, "unsigned char* shared = emu::shared_memory;")
    return source.replace('extern "C" __global__ void', "static void") + LAUNCHER


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    libraries = {}

    def library(key_dim, value_dim, columns):
        variant = (key_dim, value_dim, columns)
        if variant not in libraries:
            folder = tmp_path_factory.mktemp("emulated")
            cpp, shared_object = folder / "kernel.cpp", folder / "kernel.so"
            cpp.write_text(emulated_source(*variant))
            subprocess.run(["g++", "-std=c++17", "-O1", "-fno-strict-aliasing", "-shared", "-fPIC", f"-I{HEADER.parent}",
                            str(cpp), "-o", str(shared_object)], check=True, capture_output=True, timeout=300)
            libraries[variant] = ctypes.CDLL(str(shared_object))
        return libraries[variant]

    return library


def guarded(array, fill):
    """``(buffer, view)``: a copy of ``array`` inside a buffer with ``GUARD`` elements of ``fill``
    either side."""
    buffer = np.full(array.size + 2 * GUARD, fill, dtype=array.dtype)
    buffer[GUARD : GUARD + array.size] = array.ravel()
    return buffer, buffer[GUARD : GUARD + array.size].reshape(array.shape)


def emulate(library, columns, q, k, v, g, beta, state, slots, starts, seed):
    inputs = [guarded(np.ascontiguousarray(a), np.nan)[1] for a in (q, k, v, g, beta)]
    indices = [guarded(np.ascontiguousarray(a), -1)[1] for a in (slots, starts)]
    out_buffer, out = guarded(np.full(v.shape, np.nan, np.float32), 7.0)
    state_buffer, device_state = guarded(state, 7.0)
    pointer = [a.ctypes.data_as(ctypes.c_void_p) for a in (*inputs, device_state, *indices)]
    error = library.run(*pointer[:6], pointer[6], pointer[7], ctypes.c_int(q.shape[1]), out.ctypes.data_as(ctypes.c_void_p),
                        ctypes.c_uint(len(slots)), ctypes.c_uint(v.shape[2] // columns), ctypes.c_uint(seed))
    assert error == 0, "a barrier not every thread reaches" if error == 1 else "shared memory written past its end"
    for buffer, array in ((out_buffer, out), (state_buffer, device_state)):
        assert (buffer[:GUARD] == 7.0).all() and (buffer[GUARD + array.size :] == 7.0).all(), "written out of bounds"
    return out.copy(), device_state.copy()


@pytest.mark.parametrize("key_dim, value_dim, columns", [(64, 64, 32), (64, 128, 64), (128, 64, 32), (128, 128, 64)])
def test_the_kernel_source_computes_its_model(build, key_dim, value_dim, columns):
    """Segments of 1, 63, 65, 130 and 0 tokens from non-zero states, two heads."""
    q, k, v, g, beta, state, slots, starts = prompt_case(np.random.default_rng(key_dim + value_dim + columns),
                                                         (1, 63, 65, 130, 0), 2, key_dim, value_dim)
    model_state, reference_state = state.copy(), state.copy()
    model = gated_delta_chunked.chunked_prompt_rule_reference(q, k, v, g, beta, model_state, slots, starts)
    reference = gated_delta.prompt_rule_reference(q, k, v, g, beta, reference_state, slots, starts)
    library = build(key_dim, value_dim, columns)
    out, final_state = emulate(library, columns, q, k, v, g, beta, state, slots, starts, seed=1)
    again = emulate(library, columns, q, k, v, g, beta, state, slots, starts, seed=2)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(again[0], out)
    np.testing.assert_array_equal(again[1], final_state)
    assert rel_error(out, model) <= 2e-3
    assert rel_error(final_state, model_state) <= 2e-3
    assert rel_error(out, reference) <= 1.5e-2
    assert rel_error(final_state, reference_state) <= 1.5e-2
    untouched = np.setdiff1d(np.arange(state.shape[0]), slots)
    np.testing.assert_array_equal(final_state[untouched], state[untouched])
