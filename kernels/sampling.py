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

The kernel is CUDA C++ compiled by NVRTC through CuPy (a few hundred lines with no header: the
first sampled token of a fresh install waits a fraction of a second for it). ``tests/kernels``
runs it on the host through the CUDA emulation header against :func:`sample_reference`, and on
the GPU (``-m gpu``).
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

from metrale.errors import KernelArgumentError  # noqa: E402
from metrale.kernels._device import DeviceArray, check_array  # noqa: E402

SAMPLE_THREADS = 512
RADIX_BITS = 4
RADIX_BUCKETS = 1 << RADIX_BITS

CONSTANTS = f"""
#define SAMPLE_THREADS {SAMPLE_THREADS}
#define RADIX_BITS {RADIX_BITS}
#define RADIX_BUCKETS {RADIX_BUCKETS}
"""

KERNEL = r"""
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define NEG_INF (__int_as_float(0xff800000))
#define POS_INF (__int_as_float(0x7f800000))

// A float's order key: an integer whose order is the floats' order (-0 just below +0).
__device__ __forceinline__ long long order_key(float value) {
    const long long bits = (long long)__float_as_uint(value);
    return bits >= 2147483648LL ? -(bits - 2147483648LL) - 1 : bits;
}

// The uniform draw in [0, 1) of a request's step: SplitMix64 of (seed * FNV prime) ^ step, 24 bits.
__device__ __forceinline__ float request_uniform(long long seed, long long step) {
    const unsigned long long x = ((unsigned long long)seed * 0x100000001B3ull ^ (unsigned long long)step)
                                 + 0x9E3779B97F4A7C15ull;
    unsigned long long z = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) / 16777216.f;
}

// Sum and maximum over the block, every thread getting it; `partial` holds SAMPLE_WARPS values.
__device__ float block_sum(float* partial, float value) {
    for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = value;
    __syncthreads();
    float total = partial[0];
    for (int w = 1; w < SAMPLE_WARPS; ++w) total += partial[w];
    __syncthreads();
    return total;
}

__device__ float block_max(float* partial, float value) {
    for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = value;
    __syncthreads();
    float best = partial[0];
    for (int w = 1; w < SAMPLE_WARPS; ++w) best = fmaxf(best, partial[w]);
    __syncthreads();
    return best;
}

// Adds one scaled value to the bucket of the bracket [lo, lo + RADIX_BUCKETS << shift) it falls in.
__device__ __forceinline__ void radix_add(float* histogram, float s, bool valid, long long lo, int shift, float scaled_max,
                                          bool by_mass) {
    if (!valid) return;
    const long long offset = order_key(s) - lo;
    if (offset < 0) return;
    const long long bucket = offset >> shift;
    if (bucket < RADIX_BUCKETS) histogram[bucket] += by_mass ? expf(s - scaled_max) : 1.f;
}

// The largest order key t >= start whose measure -- count, or mass exp(s - max) -- over the
// scaled values with key >= t reaches target (the measure over keys >= start must reach it).
// Radix search: a pass splits the bracket [lo, lo + 2^32 >> 4 * pass) into RADIX_BUCKETS buckets
// and keeps the highest bucket whose measure, plus all above it, reaches the target; eight passes
// of 4 bits pin the key exactly. Only values inside the bracket are weighed (the measure above it
// is carried); each thread reads four values at a time. `bucket_partial` holds [SAMPLE_WARPS]
// [RADIX_BUCKETS] values and `bucket_totals` RADIX_BUCKETS.
__device__ long long threshold_key(const float* __restrict__ row, int vocab, float inv_temp, float scaled_max, long long start,
                                   float target, bool by_mass, float* bucket_partial, float* bucket_totals) {
    const int tid = threadIdx.x, last = vocab - 1;
    long long lo = start;
    float above = 0.f;
    for (int shift = 32 - RADIX_BITS; shift >= 0; shift -= RADIX_BITS) {
        float histogram[RADIX_BUCKETS];
        for (int j = 0; j < RADIX_BUCKETS; ++j) histogram[j] = 0.f;
        for (int base = tid; base < vocab; base += 4 * SAMPLE_THREADS) {
            const int i1 = base + SAMPLE_THREADS, i2 = base + 2 * SAMPLE_THREADS, i3 = base + 3 * SAMPLE_THREADS;
            const float v0 = row[base] * inv_temp, v1 = row[min(i1, last)] * inv_temp;
            const float v2 = row[min(i2, last)] * inv_temp, v3 = row[min(i3, last)] * inv_temp;
            radix_add(histogram, v0, true, lo, shift, scaled_max, by_mass);
            radix_add(histogram, v1, i1 < vocab, lo, shift, scaled_max, by_mass);
            radix_add(histogram, v2, i2 < vocab, lo, shift, scaled_max, by_mass);
            radix_add(histogram, v3, i3 < vocab, lo, shift, scaled_max, by_mass);
        }
        // The buckets' totals: each warp's by shuffles, then the warps' in warp order by one
        // thread a bucket, read by every thread (so all of them choose the same bucket).
        for (int j = 0; j < RADIX_BUCKETS; ++j) {
            float value = histogram[j];
            for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
            if (tid % 32 == 0) bucket_partial[(tid / 32) * RADIX_BUCKETS + j] = value;
        }
        __syncthreads();
        if (tid < RADIX_BUCKETS) {
            float total = 0.f;
            for (int w = 0; w < SAMPLE_WARPS; ++w) total += bucket_partial[w * RADIX_BUCKETS + tid];
            bucket_totals[tid] = total;
        }
        __syncthreads();
        // Bucket 0 is the fallback: its cumulative measure reached the target in the previous
        // pass, up to rounding.
        float running = above;
        int chosen = 0;
        for (int j = RADIX_BUCKETS - 1; j > 0; --j) {
            if (running + bucket_totals[j] >= target) {
                chosen = j;
                break;
            }
            running += bucket_totals[j];
        }
        __syncthreads();   // every thread has read the totals before the next pass writes them
        lo += (long long)chosen << shift;
        above = running;
    }
    return lo;
}

// Grid: one block of SAMPLE_THREADS per row. logits [rows, vocab] float32; temperature, top_p,
// log_min_p, uniforms [rows] float32; top_k [rows] int32; seeds, steps [rows] int64; out_tokens
// [rows] int32. Thresholds come from a radix search over the order keys of the scaled values
// (exact); the token from the per-thread masses of contiguous chunks, in vocabulary order.
// uniforms[row] < 0 draws u from (seeds[row], steps[row]).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_tokens(
    const float* __restrict__ logits, int vocab, const float* __restrict__ temperature, const int* __restrict__ top_k,
    const float* __restrict__ top_p, const float* __restrict__ log_min_p, const long long* __restrict__ seeds,
    const long long* __restrict__ steps, const float* __restrict__ uniforms, int* __restrict__ out_tokens)
{
    __shared__ float partial[SAMPLE_WARPS];
    __shared__ int partial_index[SAMPLE_WARPS];
    __shared__ float bucket_partial[SAMPLE_WARPS * RADIX_BUCKETS];
    __shared__ float bucket_totals[RADIX_BUCKETS];
    __shared__ float chunk_mass[SAMPLE_THREADS];
    __shared__ int owner_thread;
    __shared__ float owner_running;
    const int row = blockIdx.x, tid = threadIdx.x, last = vocab - 1;
    const float* __restrict__ values = logits + (long long)row * vocab;
    const float temp = temperature[row];
    // The row's largest value and the first index holding it. Each thread reads four values at
    // a time (loads past the row clamped to its last value and ignored), indices rising within
    // a thread, so the first of equal values is kept; a NaN or +inf marks the thread broken.
    float local_best = NEG_INF;
    int local_index = vocab;
    bool broken = false;
    for (int base = tid; base < vocab; base += 4 * SAMPLE_THREADS) {
        const int i1 = base + SAMPLE_THREADS, i2 = base + 2 * SAMPLE_THREADS, i3 = base + 3 * SAMPLE_THREADS;
        const float v0 = values[base], v1 = values[min(i1, last)], v2 = values[min(i2, last)], v3 = values[min(i3, last)];
        if (!(v0 < POS_INF && v1 < POS_INF && v2 < POS_INF && v3 < POS_INF)) broken = true;
        if (v0 > local_best) { local_best = v0; local_index = base; }
        if (i1 < vocab && v1 > local_best) { local_best = v1; local_index = i1; }
        if (i2 < vocab && v2 > local_best) { local_best = v2; local_index = i2; }
        if (i3 < vocab && v3 > local_best) { local_best = v3; local_index = i3; }
    }
    if (broken) local_best = POS_INF;
    // +inf: some thread saw a NaN or +inf; -inf: every logit is -inf. No distribution: token -1.
    const float best = block_max(partial, local_best);
    if (!(best < POS_INF && best > NEG_INF)) {
        if (tid == 0) out_tokens[row] = -1;
        return;
    }
    if (temp == 0.f) {
        // Greedy: the smallest index holding the maximum.
        int index = local_best == best ? local_index : vocab;
        for (int offset = 16; offset > 0; offset >>= 1) index = min(index, __shfl_sync(0xffffffffu, index, (tid % 32) ^ offset));
        if (tid % 32 == 0) partial_index[tid / 32] = index;
        __syncthreads();
        if (tid == 0) {
            for (int w = 1; w < SAMPLE_WARPS; ++w) index = min(index, partial_index[w]);
            out_tokens[row] = index;
        }
        return;
    }
    const float inv_temp = 1.f / temp;
    const float scaled_max = best * inv_temp;
    // Top-k: the largest key t with count(key >= t) >= k.
    long long k_key = -2147483648LL;
    const int k = top_k[row];
    if (0 < k && k < vocab) {
        k_key = threshold_key(values, vocab, inv_temp, scaled_max, k_key, (float)k, false, bucket_partial, bucket_totals);
    }
    // Min-p: the tokens within log_min_p of the largest scaled logit (both bounds are lower bounds).
    const float lmp = log_min_p[row];
    if (lmp > NEG_INF) k_key = max(k_key, order_key(scaled_max + lmp));
    float mass = 0.f;
    for (int i = tid; i < vocab; i += SAMPLE_THREADS) {
        const float s = values[i] * inv_temp;
        if (order_key(s) >= k_key) mass += expf(s - scaled_max);
    }
    float total = block_sum(partial, mass);
    long long threshold = k_key;
    const float p = top_p[row];
    if (p < 1.f) {
        threshold = threshold_key(values, vocab, inv_temp, scaled_max, k_key, p * total, true, bucket_partial, bucket_totals);
        float kept = 0.f;
        for (int i = tid; i < vocab; i += SAMPLE_THREADS) {
            const float s = values[i] * inv_temp;
            if (order_key(s) >= threshold) kept += expf(s - scaled_max);
        }
        total = block_sum(partial, kept);
    }
    float u = uniforms[row];
    if (u < 0.f) u = request_uniform(seeds[row], steps[row]);
    const float target = u * total;
    // Each thread owns a contiguous chunk; thread 0 finds the chunk holding the target, its owner
    // the token in it.
    const int chunk = (vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int start = tid * chunk, stop = min(start + chunk, vocab);
    float own = 0.f;
    for (int i = start; i < stop; ++i) {
        const float s = values[i] * inv_temp;
        if (order_key(s) >= threshold) own += expf(s - scaled_max);
    }
    chunk_mass[tid] = own;
    __syncthreads();
    if (tid == 0) {
        float running = 0.f;
        int owner = -1, last_nonempty = 0;
        for (int t = 0; t < SAMPLE_THREADS; ++t) {
            if (chunk_mass[t] > 0.f) {
                last_nonempty = t;
                if (running + chunk_mass[t] > target) {
                    owner = t;
                    break;
                }
                running += chunk_mass[t];
            }
        }
        if (owner < 0) {   // rounding left the target past the last mass: the last kept token
            owner = last_nonempty;
            running -= chunk_mass[owner];
        }
        owner_thread = owner;
        owner_running = running;
    }
    __syncthreads();
    if (tid == owner_thread) {
        float running = owner_running;
        int choice = -1, last_kept = -1;
        for (int i = start; i < stop; ++i) {
            const float s = values[i] * inv_temp;
            if (order_key(s) >= threshold) {
                const float weight = expf(s - scaled_max);
                if (weight > 0.f) last_kept = i;
                running += weight;
                if (running > target) {
                    choice = i;
                    break;
                }
            }
        }
        out_tokens[row] = choice >= 0 ? choice : last_kept;
    }
}
"""

KERNEL_NAMES = ("sample_tokens",)


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return CONSTANTS + KERNEL


_kernels: list[Any] = []


def _kernel() -> Any:
    if not _kernels:
        import cupy

        _kernels.append(cupy.RawModule(code=source(), options=("--std=c++17",)).get_function(KERNEL_NAMES[0]))
    return _kernels[0]


def sample(
    logits: DeviceArray, temperature: DeviceArray, top_k: DeviceArray, top_p: DeviceArray, seeds: DeviceArray, steps: DeviceArray,
    uniforms: DeviceArray, out_tokens: DeviceArray, stream: Any = None, log_min_p: DeviceArray = None,
) -> DeviceArray:
    """CUDA launcher: one token per row of ``logits [R, V]`` (CuPy arrays) into ``out_tokens [R]``
    int32 on ``stream`` (a CuPy stream or a raw handle; None: the current one); ``log_min_p`` None: no min-p.
    Raises :class:`~metrale.errors.KernelArgumentError` for arrays of other dtypes, shapes or
    layouts, or host arrays."""
    op = "sample"
    check_array(op, "logits", logits, np.float32, ndim=2)
    rows, vocab = logits.shape
    check_array(op, "temperature", temperature, np.float32, (rows,))
    check_array(op, "top_k", top_k, np.int32, (rows,))
    check_array(op, "top_p", top_p, np.float32, (rows,))
    check_array(op, "seeds", seeds, np.int64, (rows,))
    check_array(op, "steps", steps, np.int64, (rows,))
    check_array(op, "uniforms", uniforms, np.float32, (rows,))
    check_array(op, "out_tokens", out_tokens, np.int32, (rows,))
    if log_min_p is not None:
        check_array(op, "log_min_p", log_min_p, np.float32, (rows,))
    arrays = (logits, temperature, top_k, top_p, seeds, steps, uniforms, out_tokens, log_min_p)
    if any(isinstance(array, np.ndarray) for array in arrays):
        raise KernelArgumentError(f"{op}: the arrays must be on the device (CuPy arrays), not host arrays")
    if not rows:
        return out_tokens
    if vocab >= 2**31:
        raise KernelArgumentError(f"{op}: rows of {vocab} values are not served (fewer than 2**31)")
    import contextlib

    import cupy

    if isinstance(stream, int):  # a raw stream handle
        stream = cupy.cuda.ExternalStream(stream) if stream else None
    with stream if stream is not None else contextlib.nullcontext():
        if log_min_p is None:  # no min-p: -inf for every row, written on the launch's stream
            log_min_p = cupy.full(rows, -np.inf, np.float32)
        _kernel()((rows,), (SAMPLE_THREADS,), (logits, np.int32(vocab), temperature, top_k, top_p, log_min_p, seeds,
                                               steps, uniforms, out_tokens))
    return out_tokens
