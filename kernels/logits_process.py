"""Logits processing before sampling, and log probabilities after it, on the device.

Each request that uses penalties holds one row of a token-count table ``counts [S, V]`` int32
(:class:`metrale.runner.sampling.PenaltySlots`): the low 30 bits count how often the token was
generated, bit 30 (:data:`PROMPT_FLAG`) marks a token of the prompt. The sampler's kernels, in
their order on the stream:

1. :func:`apply_logit_bias` -- ``logits[row, token] += value`` for sparse ``(row, token, value)``
   entries (a request's ``logit_bias``, and -inf for the tokens ``min_tokens`` forbids; each
   ``(row, token)`` at most once);
2. :func:`apply_penalties` -- for a row with a count slot, every token ``t`` with ``g``
   generated occurrences: when ``g > 0`` or ``t`` is in the prompt the repetition penalty
   (``l / r`` when ``l > 0``, else ``l * r``), then ``l -= frequency * g + presence * (g > 0)``;
3. the sampling kernel (:mod:`metrale.kernels.sampling`);
4. :func:`count_tokens` -- ``counts[slot, token] += 1`` for each row's sampled token;
5. :func:`top_logprobs` -- on the logits as the model produced them: each row's chosen token's
   log probability (log-softmax in float32) and rank (1 + the tokens with a larger logit), and
   the ``k`` most likely tokens (ties: the smaller id first).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32

from metrale.kernels._device import (
    SIMULATED,
    DeviceArray,
    block_max,
    block_sum,
    check_array,
    device_view,
    jit_kernel,
    numba_stream,
)

#: Bit 30 of a count: the token is in the request's prompt.
PROMPT_FLAG = 1 << 30
COUNT_MASK = PROMPT_FLAG - 1

PROCESS_THREADS = 32 if SIMULATED else 256
LOGPROB_THREADS = 32 if SIMULATED else 512
#: Vocabulary blocks per row of the penalty kernel's grid.
PENALTY_BLOCKS = 2 if SIMULATED else 32


# ------------------------------------------------------------------------------ references


def apply_logit_bias_reference(logits: np.ndarray, rows: np.ndarray, tokens: np.ndarray, values: np.ndarray) -> None:
    """``logits[rows[i], tokens[i]] += values[i]`` in place (pairs distinct)."""
    np.add.at(logits, (np.asarray(rows, np.int64), np.asarray(tokens, np.int64)), np.asarray(values, np.float32))


def apply_penalties_reference(logits: np.ndarray, slots: np.ndarray, counts: np.ndarray, repetition: np.ndarray,
                              frequency: np.ndarray, presence: np.ndarray) -> None:
    """The penalties of every row with ``slots[row] >= 0``, in place (module docstring)."""
    for row in np.nonzero(np.asarray(slots) >= 0)[0]:
        entry = counts[slots[row]]
        generated = (entry & COUNT_MASK).astype(np.float32)
        seen = (entry != 0)
        values = logits[row]
        r = np.float32(repetition[row])
        penalized = np.where(values > 0, values / r, values * r).astype(np.float32)
        values = np.where(seen, penalized, values).astype(np.float32)
        values = values - np.float32(frequency[row]) * generated - np.float32(presence[row]) * (generated > 0)
        logits[row] = values.astype(np.float32)


def count_tokens_reference(counts: np.ndarray, slots: np.ndarray, tokens: np.ndarray) -> None:
    """``counts[slots[i], tokens[i]] += 1`` for rows with a slot and a token >= 0, in place."""
    for slot, token in zip(np.asarray(slots), np.asarray(tokens)):
        if slot >= 0 and token >= 0:
            counts[slot, token] += 1


def top_logprobs_reference(logits: np.ndarray, tokens: np.ndarray, ks: np.ndarray, max_k: int
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids [R, max_k + 1], logprobs [R, max_k + 1], ranks [R])``: column 0 the chosen token,
    columns ``1..k`` the ``k = ks[row]`` most likely tokens; -1 / 0 elsewhere and for rows with
    ``ks < 0`` or no token."""
    rows = logits.shape[0]
    ids = np.full((rows, max_k + 1), -1, np.int32)
    values = np.zeros((rows, max_k + 1), np.float32)
    ranks = np.zeros(rows, np.int32)
    for row in range(rows):
        k, token = int(ks[row]), int(tokens[row])
        if k < 0 or token < 0:
            continue
        row_logits = np.asarray(logits[row], np.float32)
        best = row_logits.max()
        total = np.exp((row_logits - best).astype(np.float64)).sum()
        lse = np.float32(best + np.log(total))
        ids[row, 0], values[row, 0] = token, row_logits[token] - lse
        ranks[row] = 1 + int((row_logits > row_logits[token]).sum())
        order = np.lexsort((np.arange(len(row_logits)), -row_logits))[:k]
        ids[row, 1 : k + 1] = order
        values[row, 1 : k + 1] = row_logits[order] - lse
    return ids, values, ranks


# ------------------------------------------------------------------------------ kernels


@jit_kernel
def logit_bias_kernel(logits, rows, tokens, values):
    # Grid: ceil(E / threads) blocks, one thread per entry.
    i = cuda.grid(1)
    if i < rows.shape[0]:
        logits[rows[i], tokens[i]] += values[i]


@jit_kernel
def penalty_kernel(logits, slots, counts, repetition, frequency, presence):
    # Grid: (rows, PENALTY_BLOCKS) blocks of PROCESS_THREADS; each block strides over the vocabulary.
    row = cuda.blockIdx.x
    slot = slots[row]
    if slot < 0:
        return
    vocab = logits.shape[1]
    r = repetition[row]
    f = frequency[row]
    p = presence[row]
    step = cuda.gridDim.y * PROCESS_THREADS
    for i in range(cuda.blockIdx.y * PROCESS_THREADS + cuda.threadIdx.x, vocab, step):
        entry = counts[slot, i]
        if entry != 0:
            value = logits[row, i]
            value = value / r if value > 0.0 else value * r
            generated = entry & COUNT_MASK
            if generated > 0:
                value = value - f * float32(generated) - p
            logits[row, i] = value


@jit_kernel
def count_tokens_kernel(counts, slots, tokens):
    i = cuda.grid(1)
    if i < slots.shape[0]:
        slot = slots[i]
        token = tokens[i]
        if slot >= 0 and token >= 0:
            counts[slot, token] += 1


@jit_kernel
def top_logprobs_kernel(logits, tokens, ks, out_ids, out_values, out_ranks):
    # Grid: one block of LOGPROB_THREADS per row.
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    k = ks[row]
    token = tokens[row]
    if k < 0 or token < 0:
        return
    partial = cuda.shared.array(LOGPROB_THREADS, float32)
    pick = cuda.shared.array(1, int32)
    vocab = logits.shape[1]
    local = -math.inf
    for i in range(tid, vocab, LOGPROB_THREADS):
        local = max(local, logits[row, i])
    best = block_max(partial, tid, local, LOGPROB_THREADS)
    mass = float32(0.0)
    chosen = logits[row, token]
    larger = float32(0.0)
    for i in range(tid, vocab, LOGPROB_THREADS):
        value = logits[row, i]
        mass += math.exp(value - best)
        if value > chosen:
            larger += float32(1.0)
    total = block_sum(partial, tid, mass, LOGPROB_THREADS)
    above = block_sum(partial, tid, larger, LOGPROB_THREADS)
    lse = best + math.log(total)
    if tid == 0:
        out_ids[row, 0] = token
        out_values[row, 0] = chosen - lse
        out_ranks[row] = int32(above) + 1
    # The k largest, one per round: the largest (value, -id) below the previous round's pick.
    previous_value = math.inf
    previous_id = int32(-1)
    for j in range(k):
        local = -math.inf
        for i in range(tid, vocab, LOGPROB_THREADS):
            value = logits[row, i]
            if (value < previous_value or (value == previous_value and i > previous_id)) and value > local:
                local = value
        top = block_max(partial, tid, local, LOGPROB_THREADS)
        if tid == 0:
            pick[0] = vocab
        cuda.syncthreads()
        for i in range(tid, vocab, LOGPROB_THREADS):
            value = logits[row, i]
            if value == top and (value < previous_value or i > previous_id):
                cuda.atomic.min(pick, 0, i)
        cuda.syncthreads()
        chosen_id = pick[0]
        cuda.syncthreads()
        if tid == 0:
            out_ids[row, j + 1] = chosen_id
            out_values[row, j + 1] = top - lse
        previous_value = top
        previous_id = chosen_id


# ------------------------------------------------------------------------------ launchers


def apply_logit_bias(logits: DeviceArray, rows: DeviceArray, tokens: DeviceArray, values: DeviceArray,
                     stream: object = None) -> DeviceArray:
    """Launch :func:`logit_bias_kernel` (see :func:`apply_logit_bias_reference`)."""
    op = "apply_logit_bias"
    check_array(op, "logits", logits, np.float32, ndim=2)
    count = rows.shape[0]
    check_array(op, "rows", rows, np.int32, (count,))
    check_array(op, "tokens", tokens, np.int32, (count,))
    check_array(op, "values", values, np.float32, (count,))
    if count:
        logit_bias_kernel[-(-count // PROCESS_THREADS), PROCESS_THREADS, numba_stream(stream)](
            device_view(logits), device_view(rows), device_view(tokens), device_view(values))
    return logits


def apply_penalties(logits: DeviceArray, slots: DeviceArray, counts: DeviceArray, repetition: DeviceArray,
                    frequency: DeviceArray, presence: DeviceArray, stream: object = None) -> DeviceArray:
    """Launch :func:`penalty_kernel` (see :func:`apply_penalties_reference`)."""
    op = "apply_penalties"
    check_array(op, "logits", logits, np.float32, ndim=2)
    rows, vocab = logits.shape
    check_array(op, "slots", slots, np.int32, (rows,))
    check_array(op, "counts", counts, np.int32, (None, vocab))
    for name, array in (("repetition", repetition), ("frequency", frequency), ("presence", presence)):
        check_array(op, name, array, np.float32, (rows,))
    if rows:
        penalty_kernel[(rows, PENALTY_BLOCKS), PROCESS_THREADS, numba_stream(stream)](
            device_view(logits), device_view(slots), device_view(counts), device_view(repetition),
            device_view(frequency), device_view(presence))
    return logits


def count_tokens(counts: DeviceArray, slots: DeviceArray, tokens: DeviceArray, stream: object = None) -> DeviceArray:
    """Launch :func:`count_tokens_kernel` (see :func:`count_tokens_reference`)."""
    op = "count_tokens"
    check_array(op, "counts", counts, np.int32, ndim=2)
    rows = slots.shape[0]
    check_array(op, "slots", slots, np.int32, (rows,))
    check_array(op, "tokens", tokens, np.int32, (rows,))
    if rows:
        count_tokens_kernel[-(-rows // PROCESS_THREADS), PROCESS_THREADS, numba_stream(stream)](
            device_view(counts), device_view(slots), device_view(tokens))
    return counts


def top_logprobs(logits: DeviceArray, tokens: DeviceArray, ks: DeviceArray, out_ids: DeviceArray,
                 out_values: DeviceArray, out_ranks: DeviceArray, stream: object = None) -> None:
    """Launch :func:`top_logprobs_kernel` (see :func:`top_logprobs_reference`; ``ks`` at most
    ``out_ids.shape[1] - 1``, rows with ``ks < 0`` are left as they are)."""
    op = "top_logprobs"
    check_array(op, "logits", logits, np.float32, ndim=2)
    rows = logits.shape[0]
    check_array(op, "tokens", tokens, np.int32, (rows,))
    check_array(op, "ks", ks, np.int32, (rows,))
    check_array(op, "out_ids", out_ids, np.int32, (rows, None))
    check_array(op, "out_values", out_values, np.float32, out_ids.shape)
    check_array(op, "out_ranks", out_ranks, np.int32, (rows,))
    if rows:
        top_logprobs_kernel[rows, LOGPROB_THREADS, numba_stream(stream)](
            device_view(logits), device_view(tokens), device_view(ks), device_view(out_ids),
            device_view(out_values), device_view(out_ranks))
