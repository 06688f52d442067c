"""Tokens fed on the device: a step's input token ids taken from the tokens the previous step
sampled, without reading them back to the host first (the engine's overlap scheduling,
:mod:`metrale.engine.engine`).

``token_ids[rows[i]] = max(source[indices[i]], 0)`` for every ``i``: a sampled token of -1 (a row
whose logits were not finite) becomes token 0, so the embedding never reads outside its table;
that row's request fails when its token is read back, and the row's result is dropped.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from metrale.errors import KernelArgumentError
from metrale.kernels._device import SIMULATED, DeviceArray, check_array, device_view, jit_kernel, numba_stream

FEED_THREADS = 32 if SIMULATED else 128


def feed_tokens_reference(token_ids: np.ndarray, source: np.ndarray, rows: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """``token_ids`` with ``token_ids[rows[i]] = max(source[indices[i]], 0)`` (updated in place,
    and returned)."""
    rows = np.asarray(rows, dtype=np.int64)
    values = np.asarray(source)[np.asarray(indices, dtype=np.int64)]
    token_ids[rows] = np.maximum(values, 0)
    return token_ids


@jit_kernel
def feed_tokens_kernel(token_ids, source, rows, indices):
    # Grid: ceil(F / threads) blocks, one thread per fed row. token_ids [N], source [S], rows [F],
    # indices [F], all int32; rows distinct and inside token_ids, indices inside source.
    i = cuda.grid(1)
    if i < rows.shape[0]:
        token = source[indices[i]]
        token_ids[rows[i]] = token if token > 0 else 0


def feed_tokens(token_ids: DeviceArray, source: DeviceArray, rows: DeviceArray, indices: DeviceArray,
                stream: object = None) -> DeviceArray:
    """Launch :func:`feed_tokens_kernel` (see :func:`feed_tokens_reference`) on ``stream``."""
    op = "feed_tokens"
    check_array(op, "token_ids", token_ids, np.int32, ndim=1)
    check_array(op, "source", source, np.int32, ndim=1)
    count = rows.shape[0]
    check_array(op, "rows", rows, np.int32, (count,))
    check_array(op, "indices", indices, np.int32, (count,))
    if count > token_ids.shape[0]:
        raise KernelArgumentError(f"{op}: {count} fed rows for a batch of {token_ids.shape[0]} tokens")
    if count:
        blocks = -(-count // FEED_THREADS)
        feed_tokens_kernel[blocks, FEED_THREADS, numba_stream(stream)](
            device_view(token_ids), device_view(source), device_view(rows), device_view(indices)
        )
    return token_ids
