"""Greedy sampling of a batch of logits rows, spread over the whole GPU (CUDA C++, compiled by NVRTC
through CuPy).

:mod:`metrale.kernels.sampling` draws a row's token with one block, which walks the row's whole
vocabulary several times (the scale, the top-k and top-p brackets, the draw): at batch 1 that is
one multiprocessor reading the 0.5 MB of a 128k-token row while all the others wait. When every row
of a step is greedy (temperature 0) the token is the row's arg-max alone, so here each row is cut
into parts of :data:`PART` values, a block per part and row finds the part's largest value and
its smallest index, and the last block of a row to finish (an atomic ticket on the row's counter,
reset by that block for the next launch) combines the parts in one reduction and writes the token.
As :func:`metrale.kernels.sampling.sample_reference` has it, a row holding NaN or +infinity, or
only -infinity, gets token -1; ties go to the smallest index.

``counters`` holds one int32 per row, zero between launches; launches that share them must run one
after another (one stream). ``tests/kernels`` runs the kernel on the host through the CUDA
emulation header, ``tests/kernels``' GPU tests (``-m gpu``) on the GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels._device import DeviceArray, check_array

THREADS = 256
#: Values of a row one block reads (eight a thread).
PART = 8 * THREADS
#: Parts of a row the last block combines (one a thread): rows up to THREADS * PART values.
MAX_PARTS = THREADS

CONSTANTS = f"""
#define THREADS {THREADS}
#define PART {PART}
#define NO_INDEX 0x7fffffff     // a part without a finite value above -infinity
#define NOT_FINITE (-2)         // a part holding NaN or +infinity
"""

KERNEL = r"""
// Keeps in (values[i], indices[i]) the better of entry i and entry j: a NOT_FINITE part wins (the row
// gets -1), then the larger value, then the smaller index.
__device__ __forceinline__ void keep_better(float* values, int* indices, int i, int j) {
    const int a = indices[i], b = indices[j];
    if (a == NOT_FINITE) return;
    if (b == NOT_FINITE || values[j] > values[i] || (values[j] == values[i] && b < a)) {
        values[i] = values[j];
        indices[i] = b;
    }
}

// Reduces the THREADS entries of (values, indices) into entry 0.
__device__ __forceinline__ void reduce_block(float* values, int* indices) {
    for (int stride = THREADS / 2; stride > 0; stride /= 2) {
        __syncthreads();
        if ((int)threadIdx.x < stride) keep_better(values, indices, threadIdx.x, threadIdx.x + stride);
    }
    __syncthreads();
}

// Grid (ceil(V / PART), rows), THREADS threads. logits: float32 [rows, V]; part_values float32 and
// part_indices int32 [rows, parts] scratch; counters: int32 [rows], zero between launches; tokens:
// int32 [rows].
extern "C" __global__ void __launch_bounds__(THREADS) greedy_sample(
    const float* __restrict__ logits, float* __restrict__ part_values, int* __restrict__ part_indices,
    int* __restrict__ counters, int* __restrict__ tokens, int V) {
    __shared__ float values[THREADS];
    __shared__ int indices[THREADS];
    __shared__ int last;
    const int tid = threadIdx.x, part = blockIdx.x, parts = gridDim.x, row = blockIdx.y;
    const float* in = logits + (size_t)row * V;
    const float positive_infinity = __int_as_float(0x7f800000), negative_infinity = __int_as_float(0xff800000);

    // 1. This part's best: eight loads a thread in flight at once, then the comparisons in index order.
    float loaded[8];
    #pragma unroll
    for (int u = 0; u < 8; ++u) {
        const int i = part * PART + u * THREADS + tid;
        loaded[u] = i < V ? in[i] : negative_infinity;
    }
    float best = negative_infinity;
    int index = NO_INDEX;
    #pragma unroll
    for (int u = 0; u < 8; ++u) {
        const float value = loaded[u];
        if (!(value < positive_infinity)) index = NOT_FINITE;   // NaN or +infinity
        else if (index != NOT_FINITE && value > best) { best = value; index = part * PART + u * THREADS + tid; }
    }
    values[tid] = best;
    indices[tid] = index;
    reduce_block(values, indices);

    // 2. The part's result out; the last part of the row to finish combines them all.
    if (tid == 0) {
        part_values[(size_t)row * parts + part] = values[0];
        part_indices[(size_t)row * parts + part] = indices[0];
        __threadfence();
        last = atomicAdd(counters + row, 1) == parts - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();   // the other parts' results are visible
    values[tid] = tid < parts ? part_values[(size_t)row * parts + tid] : negative_infinity;
    indices[tid] = tid < parts ? part_indices[(size_t)row * parts + tid] : NO_INDEX;
    reduce_block(values, indices);
    if (tid == 0) {
        const int chosen = indices[0];
        tokens[row] = chosen == NOT_FINITE || chosen == NO_INDEX ? -1 : chosen;
        counters[row] = 0;   // for the next launch
    }
}
"""


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return CONSTANTS + KERNEL


KERNEL_NAMES = ("greedy_sample",)


def parts(vocab: int) -> int:
    """Blocks a row of ``vocab`` values is cut into."""
    return -(-vocab // PART)


def supports(vocab: int) -> bool:
    """Whether rows of ``vocab`` values are served."""
    return 0 < vocab and parts(vocab) <= MAX_PARTS


def greedy_reference(logits: np.ndarray) -> np.ndarray:
    """Tokens ``[R]`` int32 of float32 ``logits [R, V]``: each row's first arg-max, or -1 for a row
    holding NaN or +infinity, or only -infinity."""
    logits = np.asarray(logits, dtype=np.float32)
    tokens = np.argmax(logits, axis=1).astype(np.int32)
    bad = ~(logits < np.inf).all(axis=1) | ~(logits > -np.inf).any(axis=1)
    tokens[bad] = -1
    return tokens


_kernels: dict[str, Any] = {}


def _kernel() -> Any:
    if "greedy" not in _kernels:
        import cupy

        _kernels["greedy"] = cupy.RawModule(code=source(), options=("--std=c++17",)).get_function(KERNEL_NAMES[0])
    return _kernels["greedy"]


def greedy_sample(logits: DeviceArray, part_values: DeviceArray, part_indices: DeviceArray, counters: DeviceArray,
                  tokens: DeviceArray, stream: Any = None) -> DeviceArray:
    """Launch :data:`KERNEL` (see the module docstring): ``tokens [R]`` int32 for float32 ``logits
    [R, V]``; ``part_values`` float32 and ``part_indices`` int32 ``[R, parts(V)]`` scratch;
    ``counters`` int32 ``[R]``, zero. Raises :class:`~metrale.errors.KernelArgumentError` for
    what it does not serve (:func:`supports`)."""
    op = "greedy_sample"
    check_array(op, "logits", logits, np.float32, ndim=2)
    rows, vocab = logits.shape
    if not supports(vocab):
        raise KernelArgumentError(f"{op}: rows of {vocab} values are not served (at most {MAX_PARTS * PART})")
    count = parts(vocab)
    check_array(op, "part_values", part_values, np.float32, (rows, count))
    check_array(op, "part_indices", part_indices, np.int32, (rows, count))
    check_array(op, "counters", counters, np.int32, (rows,))
    check_array(op, "tokens", tokens, np.int32, (rows,))
    if rows:
        import contextlib

        with stream if stream is not None else contextlib.nullcontext():
            _kernel()((count, rows), (THREADS,), (logits, part_values, part_indices, counters, tokens, np.int32(vocab)))
    return tokens
