"""Token sampling on the device: greedy, temperature, top-k, top-p, seeded per request.

Semantics (shared by the reference and the kernel), per row with logits ``l``:

* temperature 0: the first index of the maximum;
* otherwise ``s = l / T``; top-k keeps ``s >= `` the k-th largest value (ties kept), min-p keeps
  ``s >= max(s) + log_min_p`` (``log_min_p = log(min_p)`` in float32, computed on the host; -inf
  keeps all); weights are ``exp(s - max)`` over kept tokens; top-p then keeps ``s >= t`` for the
  largest threshold ``t`` whose kept mass reaches ``p`` of the total;
* the token is the first index, in vocabulary order, whose running kept mass exceeds
  ``u * total`` for a uniform ``u`` in [0, 1);
* a row with no distribution to draw from -- a NaN or +inf logit, or every logit -inf -- gets
  the token -1 (the engine finishes that request with an error).

``u`` comes from :func:`request_uniform` (a SplitMix64 hash of the request's seed and step), so a
seed fixes the tokens on the device.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def request_uniform(seed: int, step: int) -> float:
    """The uniform draw in [0, 1) of a request's ``step`` (24 random bits)."""
    mixed = _splitmix64(((seed & _MASK) * 0x100000001B3 ^ (step & _MASK)) & _MASK)
    return (mixed >> 40) / float(1 << 24)


def sample_reference(
    logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, uniforms: np.ndarray,
    log_min_p: np.ndarray | None = None,
) -> np.ndarray:
    """Tokens ``[R]`` int32 for ``logits [R, V]`` float32, per-row parameters and uniforms
    (``log_min_p`` None: no min-p)."""
    tokens = np.empty(logits.shape[0], dtype=np.int32)
    for row in range(logits.shape[0]):
        row_logits = np.asarray(logits[row], dtype=np.float32)
        if not (row_logits < np.inf).all() or not (row_logits > -np.inf).any():
            tokens[row] = -1
            continue
        if temperature[row] == 0:
            tokens[row] = int(np.argmax(row_logits))
            continue
        s = (row_logits / np.float32(temperature[row])).astype(np.float32)
        keep = np.ones(s.shape, dtype=bool)
        k = int(top_k[row])
        if 0 < k < s.shape[0]:
            keep &= s >= np.partition(s, -k)[-k]
        if log_min_p is not None and log_min_p[row] > -np.inf:
            keep &= s >= np.float32(s.max() + np.float32(log_min_p[row]))
        weights = np.where(keep, np.exp((s - s.max()).astype(np.float64)), 0.0)
        total = weights.sum()
        if top_p[row] < 1.0:
            order = np.argsort(-s[keep], kind="stable")
            values = s[keep][order]
            mass = np.cumsum(weights[keep][order])
            cut = min(int(np.searchsorted(mass, top_p[row] * total)), len(values) - 1)
            keep &= s >= values[cut]
            weights = np.where(keep, weights, 0.0)
            total = weights.sum()
        cumulative = np.cumsum(weights)
        index = int(np.searchsorted(cumulative, uniforms[row] * total, side="right"))
        drawable = np.nonzero(weights > 0)[0]
        tokens[row] = min(max(index, drawable[0]), drawable[-1])
    return tokens


# ------------------------------------------------------------------------------ CUDA kernel

import math  # noqa: E402

from numba import cuda, float32, int32, int64, uint64  # noqa: E402

from metrale.kernels._device import (  # noqa: E402
    SIMULATED,
    DeviceArray,
    block_max,
    block_sum,
    check_array,
    device_view,
    float_to_bits,
    jit_kernel,
    numba_stream,
)

SAMPLE_THREADS = 16 if SIMULATED else 512
RADIX_BITS = 4
RADIX_BUCKETS = 1 << RADIX_BITS


@cuda.jit(device=True)
def _order_key(value):
    # float32 -> int64 whose order matches the float order.
    bits = int64(float_to_bits(value))
    if bits >= 2147483648:
        return -(bits - 2147483648) - 1
    return bits


@cuda.jit(device=True)
def _uniform(seed, step):
    x = (uint64(seed) * uint64(0x100000001B3)) ^ uint64(step)
    x = x + uint64(0x9E3779B97F4A7C15)
    z = (x ^ (x >> uint64(30))) * uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> uint64(27))) * uint64(0x94D049BB133111EB)
    z = z ^ (z >> uint64(31))
    return float32(z >> uint64(40)) / float32(16777216.0)



@cuda.jit(device=True)
def _radix_add(hist, s, valid, lo, shift, scaled_max, by_mass):
    # Adds one scaled value to the bucket of the bracket [lo, lo + RADIX_BUCKETS << shift) it falls in.
    if valid:
        offset = _order_key(s) - lo
        if offset >= 0:
            bucket = offset >> shift
            if bucket < RADIX_BUCKETS:
                if by_mass:
                    hist[bucket] += math.exp(s - scaled_max)
                else:
                    hist[bucket] += float32(1.0)


@cuda.jit(device=True)
def _threshold_key(logits, row, inv_temp, scaled_max, start, target, by_mass, partial, hist, tid):
    # The largest order key t >= start whose measure -- count, or mass exp(s - max) -- over the
    # scaled values with key >= t reaches target (the measure over keys >= start must reach it).
    # Radix search: a pass splits the bracket [lo, lo + 2^32 >> 4 * pass) into RADIX_BUCKETS
    # buckets and keeps the highest bucket whose measure, plus all above it, reaches the target;
    # eight passes of 4 bits pin the key exactly. Only values inside the bracket are weighed
    # (the measure above it is carried), and each thread reads four values at a time.
    vocab = logits.shape[1]
    last = vocab - 1
    lo = int64(start)
    above = float32(0.0)
    shift = int64(32 - RADIX_BITS)
    while shift >= 0:
        for j in range(RADIX_BUCKETS):
            hist[j] = float32(0.0)
        for base in range(tid, vocab, 4 * SAMPLE_THREADS):
            i1 = base + SAMPLE_THREADS
            i2 = base + 2 * SAMPLE_THREADS
            i3 = base + 3 * SAMPLE_THREADS
            v0 = logits[row, base] * inv_temp
            v1 = logits[row, min(i1, last)] * inv_temp
            v2 = logits[row, min(i2, last)] * inv_temp
            v3 = logits[row, min(i3, last)] * inv_temp
            _radix_add(hist, v0, True, lo, shift, scaled_max, by_mass)
            _radix_add(hist, v1, i1 < vocab, lo, shift, scaled_max, by_mass)
            _radix_add(hist, v2, i2 < vocab, lo, shift, scaled_max, by_mass)
            _radix_add(hist, v3, i3 < vocab, lo, shift, scaled_max, by_mass)
        # Every thread takes part in every block_sum; bucket 0 is the fallback (its cumulative
        # measure reached the target in the previous pass, up to rounding).
        running = above
        chosen = int64(-1)
        for j in range(RADIX_BUCKETS - 1, -1, -1):
            bucket_total = block_sum(partial, tid, hist[j], SAMPLE_THREADS)
            if chosen < 0:
                if running + bucket_total >= target or j == 0:
                    chosen = j
                else:
                    running += bucket_total
        lo += chosen << shift
        above = running
        shift -= RADIX_BITS
    return lo


@jit_kernel
def sample_kernel(logits, temperature, top_k, top_p, log_min_p, seeds, steps, uniforms, out_tokens):
    # Grid: one block of SAMPLE_THREADS per row. Thresholds are found by a radix search over the
    # order keys of the float32 values (exact: eight passes of 4 bits); the token by a block
    # scan of per-thread chunk masses in vocabulary order. uniforms[row] < 0 draws u from
    # (seeds[row], steps[row]).
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    vocab = logits.shape[1]
    partial = cuda.shared.array(SAMPLE_THREADS, float32)
    chunk_mass = cuda.shared.array(SAMPLE_THREADS, float32)
    found = cuda.shared.array(2, int64)
    temp = temperature[row]
    # Greedy: block argmax, smallest index on ties. Each thread reads its values four at a time
    # (loads past the row clamped to its last value and ignored), so four loads are in flight
    # instead of one per dependent compare; within a thread indices still rise, so the first of
    # equal values is kept.
    local_best = float32(-math.inf)
    local_index = int64(vocab)
    last = vocab - 1
    # Whether this thread saw a NaN or +inf (clamped loads re-read a valid value: harmless).
    broken = False
    for base in range(tid, vocab, 4 * SAMPLE_THREADS):
        i1 = base + SAMPLE_THREADS
        i2 = base + 2 * SAMPLE_THREADS
        i3 = base + 3 * SAMPLE_THREADS
        v0 = logits[row, base]
        v1 = logits[row, min(i1, last)]
        v2 = logits[row, min(i2, last)]
        v3 = logits[row, min(i3, last)]
        if not (v0 < math.inf and v1 < math.inf and v2 < math.inf and v3 < math.inf):
            broken = True
        if v0 > local_best:
            local_best = v0
            local_index = base
        if i1 < vocab and v1 > local_best:
            local_best = v1
            local_index = i1
        if i2 < vocab and v2 > local_best:
            local_best = v2
            local_index = i2
        if i3 < vocab and v3 > local_best:
            local_best = v3
            local_index = i3
    if broken:
        local_best = float32(math.inf)
    # +inf here means some thread saw a NaN or +inf; -inf that every logit is -inf.
    best = block_max(partial, tid, local_best, SAMPLE_THREADS)
    if not (best < math.inf and best > -math.inf):
        if tid == 0:
            out_tokens[row] = int32(-1)
        return
    if temp == 0.0:
        if tid == 0:
            found[0] = vocab
        cuda.syncthreads()
        if local_best == best:
            cuda.atomic.min(found, 0, local_index)
        cuda.syncthreads()
        if tid == 0:
            out_tokens[row] = int32(found[0])
        return
    inv_temp = float32(1.0) / temp
    scaled_max = best * inv_temp
    hist = cuda.local.array(RADIX_BUCKETS, float32)
    # Top-k threshold: the largest key t with count(key >= t) >= k.
    k_key = int64(-2147483648)
    k = top_k[row]
    if 0 < k < vocab:
        k_key = _threshold_key(logits, row, inv_temp, scaled_max, k_key, float32(k), False, partial, hist, tid)
    # Min-p: the tokens within log_min_p of the largest scaled logit (both bounds are lower bounds).
    lmp = log_min_p[row]
    if lmp > -math.inf:
        k_key = max(k_key, _order_key(scaled_max + lmp))
    # Total kept mass.
    mass = float32(0.0)
    for i in range(tid, vocab, SAMPLE_THREADS):
        s = logits[row, i] * inv_temp
        if _order_key(s) >= k_key:
            mass += math.exp(s - scaled_max)
    total = block_sum(partial, tid, mass, SAMPLE_THREADS)
    threshold = k_key
    p = top_p[row]
    if p < 1.0:
        threshold = _threshold_key(logits, row, inv_temp, scaled_max, k_key, p * total, True, partial, hist, tid)
        kept = float32(0.0)
        for i in range(tid, vocab, SAMPLE_THREADS):
            s = logits[row, i] * inv_temp
            if _order_key(s) >= threshold:
                kept += math.exp(s - scaled_max)
        total = block_sum(partial, tid, kept, SAMPLE_THREADS)
    u = uniforms[row]
    if u < 0.0:
        u = _uniform(seeds[row], steps[row])
    target = u * total
    # Each thread owns a contiguous chunk; thread 0 finds the chunk holding the target.
    chunk = (vocab + SAMPLE_THREADS - 1) // SAMPLE_THREADS
    start = tid * chunk
    stop = min(start + chunk, vocab)
    own = float32(0.0)
    for i in range(start, stop):
        s = logits[row, i] * inv_temp
        if _order_key(s) >= threshold:
            own += math.exp(s - scaled_max)
    chunk_mass[tid] = own
    cuda.syncthreads()
    if tid == 0:
        running = float32(0.0)
        owner = int64(-1)
        last_nonempty = int64(0)
        for t in range(SAMPLE_THREADS):
            if chunk_mass[t] > 0.0:
                last_nonempty = t
                if owner < 0 and running + chunk_mass[t] > target:
                    owner = t
                    break
                running += chunk_mass[t]
        if owner < 0:
            owner = last_nonempty
            running -= chunk_mass[owner]
        found[0] = owner
        partial[0] = running
    cuda.syncthreads()
    if tid == found[0]:
        running = partial[0]
        choice = int64(-1)
        last_kept = int64(-1)
        for i in range(start, stop):
            s = logits[row, i] * inv_temp
            if _order_key(s) >= threshold:
                weight = math.exp(s - scaled_max)
                if weight > 0.0:
                    last_kept = i
                running += weight
                if running > target:
                    choice = i
                    break
        out_tokens[row] = int32(choice if choice >= 0 else last_kept)


def sample(
    logits: DeviceArray, temperature: DeviceArray, top_k: DeviceArray, top_p: DeviceArray, seeds: DeviceArray, steps: DeviceArray,
    uniforms: DeviceArray, out_tokens: DeviceArray, stream: object = None, log_min_p: DeviceArray = None,
) -> DeviceArray:
    """CUDA launcher: one token per row of ``logits [R, V]`` into ``out_tokens [R]`` int32
    (``log_min_p`` None: no min-p)."""
    op = "sample"
    check_array(op, "logits", logits, np.float32, ndim=2)
    rows = logits.shape[0]
    check_array(op, "temperature", temperature, np.float32, (rows,))
    check_array(op, "top_k", top_k, np.int32, (rows,))
    check_array(op, "top_p", top_p, np.float32, (rows,))
    check_array(op, "seeds", seeds, np.int64, (rows,))
    check_array(op, "steps", steps, np.int64, (rows,))
    check_array(op, "uniforms", uniforms, np.float32, (rows,))
    check_array(op, "out_tokens", out_tokens, np.int32, (rows,))
    if log_min_p is None:  # no min-p: an array of -inf where the logits are
        if isinstance(logits, np.ndarray):
            log_min_p = np.full(rows, -np.inf, np.float32)
        else:
            import cupy

            # Written on the launch's stream, so the kernel reads it after it is filled.
            on: Any = cupy.cuda.ExternalStream(stream) if isinstance(stream, int) and stream else stream
            with on if on is not None else cupy.cuda.get_current_stream():
                log_min_p = cupy.full(rows, -np.inf, np.float32)
    check_array(op, "log_min_p", log_min_p, np.float32, (rows,))
    if rows:
        sample_kernel[rows, SAMPLE_THREADS, numba_stream(stream)](
            device_view(logits), device_view(temperature), device_view(top_k), device_view(top_p), device_view(log_min_p),
            device_view(seeds), device_view(steps), device_view(uniforms), device_view(out_tokens),
        )
    return out_tokens
