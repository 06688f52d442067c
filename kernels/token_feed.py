"""Tokens fed on the device: a step's input token ids taken from the tokens the previous step
sampled, without reading them back to the host first (the engine's overlap scheduling,
:mod:`metrale.engine.engine`).

``token_ids[rows[i]] = max(source[indices[i]], 0)`` for every ``i``: a sampled token of -1 (a row
whose logits were not finite) becomes token 0, so the embedding never reads outside its table;
that row's request fails when its token is read back, and the row's result is dropped.

The kernel is CUDA C++ compiled by NVRTC through CuPy (a few lines with no header). ``tests/kernels``
runs it on the host through the CUDA emulation header and on the GPU (``-m gpu``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels._device import DeviceArray, check_array

FEED_THREADS = 128

KERNEL = r"""
// Grid: ceil(F / 128) blocks of 128 threads, a thread a fed row. token_ids [N], source [S], rows
// [F], indices [F], all int32; rows distinct and inside token_ids, indices inside source.
extern "C" __global__ void __launch_bounds__(128)
feed_tokens(int* __restrict__ token_ids, const int* __restrict__ source, const int* __restrict__ rows,
            const int* __restrict__ indices, int count) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) {
        const int token = source[indices[i]];
        token_ids[rows[i]] = token > 0 ? token : 0;
    }
}
"""

KERNEL_NAMES = ("feed_tokens",)


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return KERNEL


def feed_tokens_reference(token_ids: np.ndarray, source: np.ndarray, rows: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """``token_ids`` with ``token_ids[rows[i]] = max(source[indices[i]], 0)`` (updated in place,
    and returned)."""
    rows = np.asarray(rows, dtype=np.int64)
    values = np.asarray(source)[np.asarray(indices, dtype=np.int64)]
    token_ids[rows] = np.maximum(values, 0)
    return token_ids


_kernels: list[Any] = []


def _kernel() -> Any:
    if not _kernels:
        import cupy

        _kernels.append(cupy.RawModule(code=source(), options=("--std=c++17",)).get_function(KERNEL_NAMES[0]))
    return _kernels[0]


def feed_tokens(token_ids: DeviceArray, source: DeviceArray, rows: DeviceArray, indices: DeviceArray,
                stream: Any = None) -> DeviceArray:
    """Launch :data:`KERNEL` (see :func:`feed_tokens_reference`) on ``stream`` (a CuPy stream;
    None: the current one). Raises :class:`~metrale.errors.KernelArgumentError` for arrays of other
    dtypes, shapes or layouts, more fed rows than tokens, or host arrays."""
    op = "feed_tokens"
    check_array(op, "token_ids", token_ids, np.int32, ndim=1)
    check_array(op, "source", source, np.int32, ndim=1)
    count = rows.shape[0]
    check_array(op, "rows", rows, np.int32, (count,))
    check_array(op, "indices", indices, np.int32, (count,))
    if count > token_ids.shape[0]:
        raise KernelArgumentError(f"{op}: {count} fed rows for a batch of {token_ids.shape[0]} tokens")
    if any(isinstance(array, np.ndarray) for array in (token_ids, source, rows, indices)):
        raise KernelArgumentError(f"{op}: the arrays must be on the device (CuPy arrays), not host arrays")
    if count:
        import contextlib

        with stream if stream is not None else contextlib.nullcontext():
            _kernel()((-(-count // FEED_THREADS),), (FEED_THREADS,), (token_ids, source, rows, indices, np.int32(count)))
    return token_ids
