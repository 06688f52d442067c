"""Token bitmasks applied to logits on the device: the tokens a request's grammar forbids get
-inf before sampling (structured output, :mod:`metrale.structured`).

A bitmask row holds ``W`` int32 words in llguidance's layout: bit ``i`` of word ``w`` allows token
``32 * w + i``. Logits row ``r`` takes bitmask row ``mask_rows[r]``; per row ``r`` of ``logits [R, V]``:

* ``mask_rows[r] < 0``: the row is left as it is (a request without a grammar);
* ``0 <= mask_rows[r] < M``: every token whose bit is 0 gets -inf, and so does every token
  ``t >= 32 * W`` (past the mask);
* ``mask_rows[r] >= M``: every token gets -inf (a row pointing past the bitmask allows nothing,
  so the sampler gives it token -1 and the engine fails the request, rather than reading past
  the bitmask).

Allowed tokens keep their logits bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from metrale.errors import KernelArgumentError
from metrale.kernels._device import SIMULATED, DeviceArray, check_array, device_view, jit_kernel, numba_stream

MASK_THREADS = 32 if SIMULATED else 256
#: Tokens each thread covers in a block's chunk (consecutive chunks of ``MASK_THREADS`` tokens).
MASK_TOKENS_PER_THREAD = 2 if SIMULATED else 8
MASK_CHUNK = MASK_THREADS * MASK_TOKENS_PER_THREAD
#: CUDA's limit on a grid's y extent (the vocabulary chunks).
MAX_GRID_Y = 65535


def apply_token_bitmask_reference(logits: np.ndarray, bitmask: np.ndarray, mask_rows: np.ndarray) -> None:
    """Set to -inf, in place, the logits ``[R, V]`` float32 of the tokens that bitmask row
    ``mask_rows[r]`` (of ``bitmask [M, W]`` int32) forbids, for every row ``r`` with
    ``mask_rows[r] >= 0`` (see the module docstring)."""
    bitmask = np.asarray(bitmask, dtype=np.int32)
    mask_rows = np.asarray(mask_rows, dtype=np.int64)
    vocab = logits.shape[1]
    masks, words = bitmask.shape
    tokens = np.arange(vocab)
    covered = tokens < 32 * words
    word_index = np.minimum(tokens // 32, max(words - 1, 0))
    shifts = (tokens % 32).astype(np.int32)
    for row, mask_row in enumerate(mask_rows):
        if mask_row < 0:
            continue
        if mask_row >= masks or words == 0:
            logits[row] = -np.inf
            continue
        allowed = covered & (((bitmask[mask_row, word_index] >> shifts) & 1) == 1)
        logits[row, ~allowed] = -np.inf


@jit_kernel
def apply_token_bitmask_kernel(logits, bitmask, mask_rows):
    # Grid: (R, ceil(V / MASK_CHUNK)) blocks of MASK_THREADS threads; block (r, c) covers tokens
    # [c * MASK_CHUNK, (c + 1) * MASK_CHUNK) of row r, thread i the tokens i, i + MASK_THREADS, ...
    # of that chunk. logits [R, V] float32, bitmask [M, W] int32, mask_rows [R] int32. Logits are
    # only written (never read): consecutive threads store consecutive tokens, and the 32 threads
    # of a warp read one bitmask word (a broadcast).
    row = cuda.blockIdx.x
    mask_row = mask_rows[row]
    if mask_row < 0:
        return
    vocab = logits.shape[1]
    words = bitmask.shape[1]
    missing = mask_row >= bitmask.shape[0]
    start = cuda.blockIdx.y * MASK_CHUNK + cuda.threadIdx.x
    for j in range(MASK_TOKENS_PER_THREAD):
        token = start + j * MASK_THREADS
        if token < vocab:
            word = token >> 5
            allowed = False
            if not missing and word < words:
                allowed = ((bitmask[mask_row, word] >> (token & 31)) & 1) != 0
            if not allowed:
                logits[row, token] = float32(-math.inf)


def apply_token_bitmask(logits: DeviceArray, bitmask: DeviceArray, mask_rows: DeviceArray, stream: object = None) -> DeviceArray:
    """Launch :func:`apply_token_bitmask_kernel` (see :func:`apply_token_bitmask_reference`) on
    ``stream``: ``logits`` is updated in place and returned."""
    op = "apply_token_bitmask"
    check_array(op, "logits", logits, np.float32, ndim=2)
    rows, vocab = logits.shape
    check_array(op, "bitmask", bitmask, np.int32, ndim=2)
    check_array(op, "mask_rows", mask_rows, np.int32, (rows,))
    chunks = -(-vocab // MASK_CHUNK)
    if chunks > MAX_GRID_Y:
        raise KernelArgumentError(f"{op}: logits has shape {[rows, vocab]}, more than {MAX_GRID_Y * MASK_CHUNK} tokens a row")
    if rows and vocab:
        apply_token_bitmask_kernel[(rows, chunks), MASK_THREADS, numba_stream(stream)](
            device_view(logits), device_view(bitmask), device_view(mask_rows)
        )
    return logits
