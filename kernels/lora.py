"""LoRA on the GPU: every row's adapter update in one launch per step of the product, whatever
the mix of adapters in the batch (docs/lora.rst).

* the shrink is one cuBLAS product of the rows with every slot's ``A`` at once (``[N, S G R]``:
  a few megabytes of adapter weights, read once, where a per-row gather reads its slot's ``A``
  once per row);
* :func:`lora_expand_kernel` -- ``y[i, o] += shrunk[i, slot s_i's g R : (g + 1) R] . b[s_i, o]``
  for output column ``o`` of projection ``g``, a thread per column over a tile of rows;
* :func:`lora_token_rows_kernel` -- embedding rows an adapter replaces;
* :func:`lora_logit_rows_kernel` -- LM-head rows an adapter replaces, a dot product each.

Rows of slot 0 (the base model) return at once. Slots, the stacked weights and the row metadata
are device arrays that never move, so a CUDA graph replays any mix of adapters.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32

from metrale.kernels._device import (
    SIMULATED,
    DeviceArray,
    bf16_to_float,
    block_sum,
    check_array,
    device_view,
    jit_kernel,
    numba_stream,
)

LORA_THREADS = 32 if SIMULATED else 128
EXPAND_THREADS = 32 if SIMULATED else 128
EXPAND_ROWS = 4 if SIMULATED else 32


@jit_kernel
def lora_expand_kernel(y, shrunk, b, splits, slots):
    # Grid: (ceil(out / EXPAND_THREADS), ceil(N / EXPAND_ROWS)); a thread per output column, for
    # EXPAND_ROWS rows. y [N, out] f32 (updated); shrunk [N, S G R] f32 (slot s's G R columns start
    # at (s - 1) G R); b [S + 1, out, R] bf16 bits; splits [G + 1] int32; slots [N] int32. A
    # thread reads its column's R values of each slot once from memory (the rows of one slot hit
    # the cache), the shrunk rows are the same for every thread of the block.
    column = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if column >= y.shape[1]:
        return
    group = int32(0)
    while column >= splits[group + 1]:
        group += 1
    rank = b.shape[2]
    groups = splits.shape[0] - 1
    first = cuda.blockIdx.y * EXPAND_ROWS
    last = min(first + EXPAND_ROWS, y.shape[0])
    for row in range(first, last):
        slot = slots[row]
        if slot == 0:
            continue
        base = ((slot - 1) * groups + group) * rank
        acc = float32(0.0)
        for r in range(rank):
            acc += shrunk[row, base + r] * bf16_to_float(b[slot, column, r])
        y[row, column] += acc


@jit_kernel
def lora_token_rows_kernel(x, ids, slots, tokens, rows):
    # Grid: N blocks of LORA_THREADS. x [N, H] f32 (updated); ids, slots [N] int32; tokens [S, T]
    # int32 (-1 pads); rows [S, T, H] f32.
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    slot = slots[row]
    if slot == 0:
        return
    found = cuda.shared.array(1, int32)
    if tid == 0:
        found[0] = -1
    cuda.syncthreads()
    token = ids[row]
    for k in range(tid, tokens.shape[1], LORA_THREADS):
        if tokens[slot, k] == token:
            found[0] = k  # token ids of one slot are distinct: at most one thread writes
    cuda.syncthreads()
    k = found[0]
    if k >= 0:
        for column in range(tid, x.shape[1], LORA_THREADS):
            x[row, column] = rows[slot, k, column]


@jit_kernel
def lora_logit_rows_kernel(logits, h, h_bf16, slots, tokens, rows):
    # Grid: (N rows, T), LORA_THREADS threads. logits [N, V] f32 (updated); h [N, H] f32 or bf16
    # bits (h_bf16); slots [N] int32; tokens [S, T] int32 (-1 pads); rows [S, T, H] f32.
    row = cuda.blockIdx.x
    k = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    slot = slots[row]
    if slot == 0:
        return
    token = tokens[slot, k]
    if token < 0:
        return
    partial = cuda.shared.array(LORA_THREADS, float32)
    acc = float32(0.0)
    for column in range(tid, h.shape[1], LORA_THREADS):
        value = bf16_to_float(h[row, column]) if h_bf16 else float32(h[row, column])
        acc += value * rows[slot, k, column]
    total = block_sum(partial, tid, acc, LORA_THREADS)
    if tid == 0:
        logits[row, token] = total


def lora_expand(y: DeviceArray, shrunk: DeviceArray, b: DeviceArray, splits: DeviceArray, slots: DeviceArray,
                stream: object = None) -> DeviceArray:
    """Add each row's LoRA update to ``y [N, out]`` (float32, in place) from ``shrunk [N, S G R]``,
    the rows' products with every slot's ``A`` (slot ``s`` at columns ``(s - 1) G R``), and
    ``b [S + 1, out, R]`` bf16 bits; ``splits [G + 1]`` and ``slots [N]`` int32."""
    op = "lora_linear"
    check_array(op, "y", y, np.float32, ndim=2)
    rows, width = y.shape
    groups = splits.shape[0] - 1
    check_array(op, "b", b, np.uint16, (None, width, None))
    check_array(op, "splits", splits, np.int32, ndim=1)
    check_array(op, "slots", slots, np.int32, (rows,))
    check_array(op, "shrunk", shrunk, np.float32, (rows, (b.shape[0] - 1) * groups * b.shape[2]))
    if rows and width:
        lora_expand_kernel[(-(-width // EXPAND_THREADS), -(-rows // EXPAND_ROWS)), EXPAND_THREADS, numba_stream(stream)](
            device_view(y), device_view(shrunk), device_view(b), device_view(splits), device_view(slots),
        )
    return y


def lora_token_rows(x: DeviceArray, ids: DeviceArray, slots: DeviceArray, tokens: DeviceArray, rows: DeviceArray,
                    stream: object = None) -> DeviceArray:
    """Replace the embedding rows ``x [N, H]`` (float32, in place) adapters replace."""
    op = "lora_token_rows"
    check_array(op, "x", x, np.float32, ndim=2)
    count, hidden = x.shape
    check_array(op, "ids", ids, np.int32, (count,))
    check_array(op, "slots", slots, np.int32, (count,))
    check_array(op, "tokens", tokens, np.int32, ndim=2)
    check_array(op, "rows", rows, np.float32, (tokens.shape[0], tokens.shape[1], hidden))
    if count:
        lora_token_rows_kernel[count, LORA_THREADS, numba_stream(stream)](
            device_view(x), device_view(ids), device_view(slots), device_view(tokens), device_view(rows),
        )
    return x


def lora_logit_rows(logits: DeviceArray, h: DeviceArray, slots: DeviceArray, tokens: DeviceArray, rows: DeviceArray,
                    stream: object = None) -> DeviceArray:
    """Replace the logits ``[N, V]`` (float32, in place) of the LM-head rows adapters replace;
    ``h [N, H]`` is the LM head's input (float32 or bf16 bits)."""
    op = "lora_logit_rows"
    check_array(op, "logits", logits, np.float32, ndim=2)
    count = logits.shape[0]
    if h.dtype not in (np.float32, np.uint16):
        check_array(op, "h", h, np.float32)
    check_array(op, "h", h, h.dtype, (count, None))
    check_array(op, "slots", slots, np.int32, (count,))
    check_array(op, "tokens", tokens, np.int32, ndim=2)
    check_array(op, "rows", rows, np.float32, (tokens.shape[0], tokens.shape[1], h.shape[1]))
    if count and tokens.shape[1]:
        lora_logit_rows_kernel[(count, tokens.shape[1]), LORA_THREADS, numba_stream(stream)](
            device_view(logits), device_view(h), h.dtype == np.uint16, device_view(slots), device_view(tokens),
            device_view(rows),
        )
    return logits
