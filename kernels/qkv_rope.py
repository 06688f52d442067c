"""Rotary position embedding, half-split ("NeoX") or adjacent-pair ("GPT-J") pairing.

:func:`qkv_rope_cache` launches the numba kernel; :func:`qkv_rope_cache_words` is the CUDA C++
one the CUDA backend runs (a warp a head, launched dependently, so the attention kernel after it
and the projection before it overlap their launches with it).
"""

from __future__ import annotations

import numpy as np

from metrale.errors import KernelArgumentError


def rope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray, attention_factor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Angles ``fp32(p) * inv_freq`` in float32 (as transformers), scaled cos and sin ``[T, d_r/2]``."""
    angles = np.asarray(positions, dtype=np.float32)[:, None] * np.asarray(inv_freq, dtype=np.float32)[None, :]
    factor = np.float32(attention_factor)
    return (np.cos(angles) * factor).astype(np.float32), (np.sin(angles) * factor).astype(np.float32)


def rope_reference(
    x: np.ndarray,
    positions: np.ndarray,
    inv_freq: np.ndarray,
    attention_factor: float = 1.0,
    interleaved: bool = False,
) -> np.ndarray:
    """Rotate the first ``2 * len(inv_freq)`` dims of every head of ``x [T, heads, d]``.

    Half-split pairs dims ``(i, i + d_r/2)``; ``interleaved`` pairs ``(2i, 2i+1)`` and keeps the
    interleaved layout. Dims past ``d_r`` pass through unchanged.
    """
    x = np.asarray(x, dtype=np.float32)
    half = inv_freq.shape[0]
    rotary = 2 * half
    cos, sin = rope_cos_sin(positions, inv_freq, attention_factor)
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = x.copy()
    if interleaved:
        even, odd = x[..., 0:rotary:2], x[..., 1:rotary:2]
        out[..., 0:rotary:2] = even * cos - odd * sin
        out[..., 1:rotary:2] = odd * cos + even * sin
    else:
        first, second = x[..., :half], x[..., half:rotary]
        out[..., :half] = first * cos - second * sin
        out[..., half:rotary] = second * cos + first * sin
    return out


def checked_rotary_dim(op: str, rotary_dim: int | None, inv_freq: DeviceArray, head_dim: int) -> int:
    """The number of rotated dims of each head: ``rotary_dim``, or ``2 * len(inv_freq)`` when None.

    Raises :class:`KernelArgumentError` unless it is even, between 2 and ``head_dim``, and twice the
    length of ``inv_freq`` (one frequency per rotated pair).
    """
    pairs = int(inv_freq.shape[0])
    if rotary_dim is None:
        rotary_dim = 2 * pairs
    elif isinstance(rotary_dim, bool) or not isinstance(rotary_dim, (int, np.integer)):
        raise KernelArgumentError(f"{op}: rotary_dim is {rotary_dim!r}, expected an int")
    rotary_dim = int(rotary_dim)
    if rotary_dim % 2 or not 2 <= rotary_dim <= head_dim:
        raise KernelArgumentError(f"{op}: rotary_dim {rotary_dim} must be even and between 2 and head_dim {head_dim}")
    if rotary_dim != 2 * pairs:
        raise KernelArgumentError(
            f"{op}: rotary_dim {rotary_dim} needs inv_freq of {rotary_dim // 2} entries, got {pairs}"
        )
    return rotary_dim


def qkv_rope_cache_reference(
    qkv: np.ndarray,
    positions: np.ndarray,
    slot_mapping: np.ndarray,
    inv_freq: np.ndarray,
    attention_factor: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    q_norm: np.ndarray | None = None,
    k_norm: np.ndarray | None = None,
    eps: float = 1e-6,
    norm_offset: float = 0.0,
    interleaved: bool = False,
    *,
    rotary_dim: int | None = None,
) -> np.ndarray:
    """Split ``qkv [N, (nh + 2 nkv) d]`` into heads, apply the optional per-head q/k norm and
    RoPE, store K and V at ``slot_mapping`` in the paged cache; returns ``q [N, nh, d]``.

    The norm covers the whole head; RoPE rotates its first ``rotary_dim`` dims only (partial
    rotary: GPT-NeoX's ``rotary_pct``, ``partial_rotary_factor``), the rest pass through.
    ``inv_freq`` holds ``rotary_dim / 2`` frequencies; ``rotary_dim`` None means ``2 * len(inv_freq)``.
    """
    from metrale.kernels.attention import paged_kv_write_reference
    from metrale.kernels.rmsnorm import rmsnorm_reference

    checked_rotary_dim("qkv_rope_cache", rotary_dim, inv_freq, head_dim)
    rows = qkv.shape[0]
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_width].reshape(rows, num_heads, head_dim)
    k = qkv[:, q_width : q_width + kv_width].reshape(rows, num_kv_heads, head_dim)
    v = qkv[:, q_width + kv_width :].reshape(rows, num_kv_heads, head_dim)
    if q_norm is not None:
        q = rmsnorm_reference(q, q_norm, eps, norm_offset)
    if k_norm is not None:
        k = rmsnorm_reference(k, k_norm, eps, norm_offset)
    q = rope_reference(q, positions, inv_freq, attention_factor, interleaved)
    k = rope_reference(k, positions, inv_freq, attention_factor, interleaved)
    paged_kv_write_reference(k_cache, v_cache, slot_mapping, k, v)
    return q


# ------------------------------------------------------------------------------ CUDA kernel

import math  # noqa: E402

from numba import cuda, float32  # noqa: E402

from metrale.kernels._device import (  # noqa: E402
    SIMULATED,
    DeviceArray,
    bf16_to_float,
    check_array,
    device_view,
    float_to_bf16,
    jit_kernel,
    numba_stream,
)

#: A block handles HEADS_PER_BLOCK heads of one row, ROPE_LANES threads (a warp on the GPU) a head.
ROPE_LANES = 4 if SIMULATED else 32
HEADS_PER_BLOCK = 2 if SIMULATED else 8
ROPE_THREADS = ROPE_LANES * HEADS_PER_BLOCK
MAX_HEAD_DIM = 256
MAX_ROTARY_PAIRS = MAX_HEAD_DIM // 2


@jit_kernel
def qkv_rope_cache_kernel(
    qkv, positions, slot_mapping, inv_freq, attention_factor, q_norm, k_norm, eps, norm_offset,
    has_qk_norm, interleaved, num_heads, num_kv_heads, q_out, k_cache, v_cache,
):
    # Grid: (N rows, ceil((num_heads + num_kv_heads) / HEADS_PER_BLOCK)); ROPE_THREADS threads,
    # ROPE_LANES to a head. Heads < num_heads are queries (to q_out [N, nh, d] f32); the rest are
    # KV heads: K is normed, rotated and stored, V stored, both as bf16 bits at slot_mapping[row]
    # of the paged cache. The norm covers all d dims; RoPE the first 2 * len(inv_freq) (partial
    # rotary when < d): pairs (i, i + len(inv_freq)), or (2i, 2i + 1) when interleaved; the dims
    # past them pass through. The row's cos and sin are made once per block, in shared memory.
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    slot_in_block = tid // ROPE_LANES
    lane = tid % ROPE_LANES
    head = cuda.blockIdx.y * HEADS_PER_BLOCK + slot_in_block
    head_dim = q_out.shape[2]
    total_heads = num_heads + num_kv_heads
    half = inv_freq.shape[0]
    cos_table = cuda.shared.array(MAX_ROTARY_PAIRS, float32)
    sin_table = cuda.shared.array(MAX_ROTARY_PAIRS, float32)
    partial = cuda.shared.array(ROPE_THREADS, float32)
    position = float32(positions[row])
    for i in range(tid, half, ROPE_THREADS):
        angle = position * inv_freq[i]
        cos_table[i] = math.cos(angle) * attention_factor
        sin_table[i] = math.sin(angle) * attention_factor
    active = head < total_heads
    is_query = head < num_heads
    source = head * head_dim
    scale = float32(1.0)
    if has_qk_norm:
        # Every thread reaches the barriers, the padding heads of the last block included.
        acc = float32(0.0)
        if active:
            for i in range(lane, head_dim, ROPE_LANES):
                value = qkv[row, source + i]
                acc += value * value
        partial[tid] = acc
        cuda.syncthreads()
        total = float32(0.0)
        for other in range(ROPE_LANES):
            total += partial[slot_in_block * ROPE_LANES + other]
        scale = float32(1.0) / math.sqrt(total / float32(head_dim) + eps)
    cuda.syncthreads()  # the cos and sin tables are written
    if not active:
        return
    kv_head = head - num_heads
    block = 0
    offset = 0
    if not is_query:
        slot = slot_mapping[row]
        block = slot // k_cache.shape[1]
        offset = slot % k_cache.shape[1]
    for i in range(lane, half, ROPE_LANES):
        first = 2 * i if interleaved else i
        second = 2 * i + 1 if interleaved else i + half
        a = qkv[row, source + first]
        b = qkv[row, source + second]
        if has_qk_norm:
            norm = q_norm if is_query else k_norm
            a = a * scale * (norm_offset + bf16_to_float(norm[first]))
            b = b * scale * (norm_offset + bf16_to_float(norm[second]))
        cos = cos_table[i]
        sin = sin_table[i]
        rotated_first = a * cos - b * sin
        rotated_second = b * cos + a * sin
        if is_query:
            q_out[row, head, first] = rotated_first
            q_out[row, head, second] = rotated_second
        else:
            k_cache[block, offset, kv_head, first] = float_to_bf16(rotated_first)
            k_cache[block, offset, kv_head, second] = float_to_bf16(rotated_second)
    for i in range(2 * half + lane, head_dim, ROPE_LANES):  # past the rotary dims
        value = qkv[row, source + i]
        if has_qk_norm:
            norm = q_norm if is_query else k_norm
            value = value * scale * (norm_offset + bf16_to_float(norm[i]))
        if is_query:
            q_out[row, head, i] = value
        else:
            k_cache[block, offset, kv_head, i] = float_to_bf16(value)
    if not is_query:
        value_source = (num_heads + num_kv_heads + kv_head) * head_dim
        for i in range(lane, head_dim, ROPE_LANES):
            v_cache[block, offset, kv_head, i] = float_to_bf16(qkv[row, value_source + i])


def qkv_rope_cache(
    qkv: DeviceArray, positions: DeviceArray, slot_mapping: DeviceArray, inv_freq: DeviceArray, attention_factor: float,
    num_heads: int, num_kv_heads: int, head_dim: int, k_cache: DeviceArray, v_cache: DeviceArray, q_out: DeviceArray,
    q_norm: DeviceArray = None, k_norm: DeviceArray = None, eps: float = 1e-6, norm_offset: float = 0.0,
    interleaved: bool = False, stream: object = None, *, rotary_dim: int | None = None,
) -> DeviceArray:
    """CUDA launcher of :func:`qkv_rope_cache_reference` (bf16 cache, float32 ``q_out``).

    ``rotary_dim`` (None: ``2 * len(inv_freq)``) must be twice the length of ``inv_freq``.
    """
    op = "qkv_rope_cache"
    rows = qkv.shape[0]
    check_array(op, "qkv", qkv, np.float32, (rows, (num_heads + 2 * num_kv_heads) * head_dim))
    check_array(op, "positions", positions, np.int32, (rows,))
    check_array(op, "slot_mapping", slot_mapping, np.int32, (rows,))
    check_array(op, "inv_freq", inv_freq, np.float32, ndim=1)
    if head_dim > MAX_HEAD_DIM:
        raise KernelArgumentError(f"{op}: head_dim {head_dim} is over the kernel's {MAX_HEAD_DIM}")
    checked_rotary_dim(op, rotary_dim, inv_freq, head_dim)
    check_array(op, "k_cache", k_cache, np.uint16, (None, None, num_kv_heads, head_dim))
    check_array(op, "v_cache", v_cache, np.uint16, tuple(k_cache.shape))
    check_array(op, "q_out", q_out, np.float32, (rows, num_heads, head_dim))
    has_norm = q_norm is not None
    if has_norm:
        check_array(op, "q_norm", q_norm, np.uint16, (head_dim,))
        check_array(op, "k_norm", k_norm, np.uint16, (head_dim,))
    else:
        q_norm = k_norm = v_cache.reshape(-1)[:head_dim]  # never read; keeps one kernel specialisation
    if rows:
        grid = (rows, -(-(num_heads + num_kv_heads) // HEADS_PER_BLOCK))
        qkv_rope_cache_kernel[grid, ROPE_THREADS, numba_stream(stream)](
            device_view(qkv), device_view(positions), device_view(slot_mapping), device_view(inv_freq),
            np.float32(attention_factor), device_view(q_norm), device_view(k_norm), np.float32(eps),
            np.float32(norm_offset), np.int32(has_norm), np.int32(bool(interleaved)), np.int32(num_heads),
            np.int32(num_kv_heads), device_view(q_out), device_view(k_cache), device_view(v_cache),
        )
    return q_out


# ------------------------------------------------------------------------------ CUDA C++ kernel

from typing import Any  # noqa: E402

from metrale.kernels._launch import DEPENDENT_LAUNCH, launch  # noqa: E402
from metrale.kernels._tensor_cores import F16_PRIMITIVES  # noqa: E402

#: Heads (a warp each) of a block of :func:`qkv_rope_cache_words`.
WORD_HEADS = 4
#: The largest head size the FP8 form serves (its rows staged in shared memory).
FP8_MAX_HEAD_DIM = 512

KERNEL = f"""
#define ROPE_WORD_HEADS {WORD_HEADS}
#define ROPE_FP8_MAX_DIM {FP8_MAX_HEAD_DIM}
""" + r"""

__device__ __forceinline__ float rope_bf16_value(unsigned short bits) { return __uint_as_float((unsigned)bits << 16); }

// float32 -> bf16 bits, round to nearest even; NaN stays NaN.
__device__ __forceinline__ unsigned short rope_to_bf16(float value) {
    const unsigned word = __float_as_uint(value);
    if ((word & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (unsigned short)((word + 0x7fffu + ((word >> 16) & 1u)) >> 16);
}

// Grid (N, ceil((num_heads + num_kv_heads) / ROPE_WORD_HEADS)); 32 * ROPE_WORD_HEADS threads, a
// warp a head: query heads (to q_out [N, nh, d] float32), then KV heads (K normed, rotated and
// stored, V stored, as bf16 bits at slot_mapping[n] of the paged caches [blocks, block_size, nkv,
// d]). qkv [N, (nh + 2 nkv) d] float32. The norm (has_norm) covers the head's d dims; RoPE its
// first 2 * half: pairs (i, i + half), or (2i, 2i + 1) when interleaved, cos and sin of fp32(p) *
// inv_freq[i] times attention_factor; the dims past them pass through.
// FP8: the caches hold E4M3 codes (unsigned char) and k_scales, v_scales [blocks, block_size, nkv]
// float32 beside them. A K or V row's bf16 values (as above) are staged in shared memory (d at most
// ROPE_FP8_MAX_DIM), then quantized as an FP8 cache write quantizes bf16 rows: scale = max|row| /
// 448 (at least the smallest normal float32; 1 for a row of zeros), or the cache's static scale
// when positive (k_static, v_static), each code the E4M3 value nearest value / scale (ties to the
// even code, saturating at 448).
template <bool FP8, typename cache_word>
__device__ __forceinline__ void qkv_rope_cache_body(
    const float* __restrict__ qkv, const int* __restrict__ positions, const int* __restrict__ slot_mapping,
    const float* __restrict__ inv_freq, float attention_factor, const unsigned short* __restrict__ q_norm,
    const unsigned short* __restrict__ k_norm, float eps, float norm_offset, int has_norm, int interleaved,
    int num_heads, int num_kv_heads, int head_dim, int half, int block_size, float* __restrict__ q_out,
    cache_word* __restrict__ k_cache, cache_word* __restrict__ v_cache, float* __restrict__ k_scales,
    float* __restrict__ v_scales, float k_static, float v_static, float (*staged)[ROPE_FP8_MAX_DIM]) {
    allow_dependents();
    wait_for_producers();   // qkv comes from the projection ahead
    const int row = blockIdx.x, lane = threadIdx.x % 32;
    const int head = blockIdx.y * ROPE_WORD_HEADS + threadIdx.x / 32;
    if (head >= num_heads + num_kv_heads) return;   // whole warps: no barrier follows
    const bool query = head < num_heads;
    const float* row_values = qkv + (size_t)row * (num_heads + 2 * num_kv_heads) * head_dim;
    const float* source = row_values + (size_t)head * head_dim;
    float scale = 1.0f;
    if (has_norm) {
        float squares = 0.0f;
        for (int i = lane; i < head_dim; i += 32) squares += source[i] * source[i];
        for (int offset = 16; offset > 0; offset /= 2) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
        scale = 1.0f / sqrtf(squares / (float)head_dim + eps);
    }
    const unsigned short* norm = query ? q_norm : k_norm;
    const int kv_head = head - num_heads;
    const int slot = query ? 0 : slot_mapping[row];
    if (!query && slot < 0) return;
    // Cache slot s is block s / block_size, offset s % block_size: row s of [blocks * block_size, nkv, d].
    const size_t cache_row = query ? 0 : ((size_t)slot * num_kv_heads + kv_head) * head_dim;
    float* q_row = q_out + ((size_t)row * num_heads + head) * head_dim;
    const float position = (float)positions[row];
    // A key or value of the head at dim i, as bf16 (FP8: its bf16 value staged for the quantization).
    auto store = [&](int part, int i, float value) {
        const unsigned short bits = rope_to_bf16(value);
        if constexpr (FP8) staged[part][i] = rope_bf16_value(bits);
        else (part ? v_cache : k_cache)[cache_row + i] = bits;
    };
    for (int i = lane; i < half; i += 32) {
        const int first = interleaved ? 2 * i : i, second = interleaved ? 2 * i + 1 : i + half;
        float a = source[first], b = source[second];
        if (has_norm) {
            a = a * scale * (norm_offset + rope_bf16_value(norm[first]));
            b = b * scale * (norm_offset + rope_bf16_value(norm[second]));
        }
        const float angle = position * inv_freq[i];
        const float cosine = cosf(angle) * attention_factor, sine = sinf(angle) * attention_factor;
        const float rotated_first = a * cosine - b * sine, rotated_second = b * cosine + a * sine;
        if (query) {
            q_row[first] = rotated_first;
            q_row[second] = rotated_second;
        } else {
            store(0, first, rotated_first);
            store(0, second, rotated_second);
        }
    }
    for (int i = 2 * half + lane; i < head_dim; i += 32) {   // past the rotary dims
        float value = source[i];
        if (has_norm) value = value * scale * (norm_offset + rope_bf16_value(norm[i]));
        if (query) q_row[i] = value;
        else store(0, i, value);
    }
    if (query) return;
    const float* values = row_values + (size_t)(num_heads + num_kv_heads + kv_head) * head_dim;
    for (int i = lane; i < head_dim; i += 32) store(1, i, values[i]);
    if constexpr (FP8) {
        __syncwarp();   // the row's values staged by every lane
        // Cache slot s's scale: element s of [blocks * block_size, nkv] after the head.
        const size_t scale_at = (size_t)slot * num_kv_heads + kv_head;
#pragma unroll
        for (int part = 0; part < 2; ++part) {
            const float* row_values_staged = staged[part];
            float amax = 0.0f;
            for (int i = lane; i < head_dim; i += 32) amax = fmaxf(amax, fabsf(row_values_staged[i]));
            for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
            const float fixed = part ? v_static : k_static;
            const float scale = fixed > 0.0f ? fixed
                : amax > 0.0f ? fmaxf(amax / 448.0f, 1.17549435e-38f) : 1.0f;
            cache_word* target = (part ? v_cache : k_cache) + cache_row;
            for (int i = 2 * lane; i < head_dim; i += 64) {
                const unsigned pair = e4m3x2_of(row_values_staged[i] / scale, row_values_staged[i + 1] / scale);
                target[i] = (cache_word)(pair & 0xffu);
                target[i + 1] = (cache_word)(pair >> 8);
            }
            if (lane == 0) (part ? v_scales : k_scales)[scale_at] = scale;
        }
    }
}

extern "C" __global__ void __launch_bounds__(32 * ROPE_WORD_HEADS) qkv_rope_cache_words(
    const float* __restrict__ qkv, const int* __restrict__ positions, const int* __restrict__ slot_mapping,
    const float* __restrict__ inv_freq, float attention_factor, const unsigned short* __restrict__ q_norm,
    const unsigned short* __restrict__ k_norm, float eps, float norm_offset, int has_norm, int interleaved,
    int num_heads, int num_kv_heads, int head_dim, int half, int block_size, float* __restrict__ q_out,
    unsigned short* __restrict__ k_cache, unsigned short* __restrict__ v_cache) {
    qkv_rope_cache_body<false>(qkv, positions, slot_mapping, inv_freq, attention_factor, q_norm, k_norm, eps,
                               norm_offset, has_norm, interleaved, num_heads, num_kv_heads, head_dim, half, block_size,
                               q_out, k_cache, v_cache, nullptr, nullptr, 0.0f, 0.0f, nullptr);
}

// The same into an FP8 cache (above): codes and their scales.
extern "C" __global__ void __launch_bounds__(32 * ROPE_WORD_HEADS) qkv_rope_cache_fp8_words(
    const float* __restrict__ qkv, const int* __restrict__ positions, const int* __restrict__ slot_mapping,
    const float* __restrict__ inv_freq, float attention_factor, const unsigned short* __restrict__ q_norm,
    const unsigned short* __restrict__ k_norm, float eps, float norm_offset, int has_norm, int interleaved,
    int num_heads, int num_kv_heads, int head_dim, int half, int block_size, float* __restrict__ q_out,
    unsigned char* __restrict__ k_cache, unsigned char* __restrict__ v_cache, float* __restrict__ k_scales,
    float* __restrict__ v_scales, float k_static, float v_static) {
    __shared__ float staged[ROPE_WORD_HEADS][2][ROPE_FP8_MAX_DIM];
    qkv_rope_cache_body<true>(qkv, positions, slot_mapping, inv_freq, attention_factor, q_norm, k_norm, eps,
                              norm_offset, has_norm, interleaved, num_heads, num_kv_heads, head_dim, half, block_size,
                              q_out, k_cache, v_cache, k_scales, v_scales, k_static, v_static,
                              staged[threadIdx.x / 32]);
}
"""

KERNEL_NAMES = ("qkv_rope_cache_words", "qkv_rope_cache_fp8_words")


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return DEPENDENT_LAUNCH + F16_PRIMITIVES + KERNEL


_word_kernels: dict[str, Any] = {}


def _word_kernel(name: str) -> Any:
    """The compiled kernel ``name`` of :data:`KERNEL_NAMES` (NVRTC, once per process)."""
    if name not in _word_kernels:
        import cupy

        module = cupy.RawModule(code=source(), options=("--std=c++17",))
        for kernel_name in KERNEL_NAMES:
            _word_kernels[kernel_name] = module.get_function(kernel_name)
    return _word_kernels[name]


def qkv_rope_cache_words(
    qkv: DeviceArray, positions: DeviceArray, slot_mapping: DeviceArray, inv_freq: DeviceArray, attention_factor: float,
    num_heads: int, num_kv_heads: int, head_dim: int, k_cache: DeviceArray, v_cache: DeviceArray, q_out: DeviceArray,
    q_norm: DeviceArray = None, k_norm: DeviceArray = None, eps: float = 1e-6, norm_offset: float = 0.0,
    interleaved: bool = False, stream: object = None, *, rotary_dim: int | None = None,
) -> DeviceArray:
    """:func:`qkv_rope_cache` in CUDA C++ (a warp a head, launched dependently): same arguments,
    same result; contiguous arrays."""
    op = "qkv_rope_cache"
    rows = qkv.shape[0]
    check_array(op, "qkv", qkv, np.float32, (rows, (num_heads + 2 * num_kv_heads) * head_dim))
    check_array(op, "positions", positions, np.int32, (rows,))
    check_array(op, "slot_mapping", slot_mapping, np.int32, (rows,))
    check_array(op, "inv_freq", inv_freq, np.float32, ndim=1)
    rotary = checked_rotary_dim(op, rotary_dim, inv_freq, head_dim)
    check_array(op, "k_cache", k_cache, np.uint16, (None, None, num_kv_heads, head_dim))
    check_array(op, "v_cache", v_cache, np.uint16, tuple(k_cache.shape))
    check_array(op, "q_out", q_out, np.float32, (rows, num_heads, head_dim))
    has_norm = q_norm is not None
    if has_norm:
        check_array(op, "q_norm", q_norm, np.uint16, (head_dim,))
        check_array(op, "k_norm", k_norm, np.uint16, (head_dim,))
    else:
        q_norm = k_norm = v_cache.reshape(-1)[:head_dim]  # never read
    if rows:
        launch(_word_kernel("qkv_rope_cache_words"), (rows, -(-(num_heads + num_kv_heads) // WORD_HEADS)), (32 * WORD_HEADS,), (
            qkv, positions, slot_mapping, inv_freq, np.float32(attention_factor), q_norm, k_norm, np.float32(eps),
            np.float32(norm_offset), np.int32(has_norm), np.int32(bool(interleaved)), np.int32(num_heads),
            np.int32(num_kv_heads), np.int32(head_dim), np.int32(rotary // 2), np.int32(k_cache.shape[1]), q_out,
            k_cache, v_cache), 0, stream, dependent=True)
    return q_out


def qkv_rope_cache_fp8_words(
    qkv: DeviceArray, positions: DeviceArray, slot_mapping: DeviceArray, inv_freq: DeviceArray, attention_factor: float,
    num_heads: int, num_kv_heads: int, head_dim: int, k_cache: Any, v_cache: Any, q_out: DeviceArray,
    q_norm: DeviceArray = None, k_norm: DeviceArray = None, eps: float = 1e-6, norm_offset: float = 0.0,
    interleaved: bool = False, stream: object = None, *, rotary_dim: int | None = None,
) -> DeviceArray:
    """:func:`qkv_rope_cache_words` into FP8 caches (:class:`~metrale.kernels.kv_cache_fp8.Fp8CacheArray`
    on the device, ``[blocks, block_size, nkv, d]`` codes): each key and value row rounded to bf16
    as the bf16 kernel stores it, then quantized in the same kernel as
    :func:`metrale.kernels.attention_fp8.write_fp8_rows` quantizes bf16 rows (a scale a row from its
    largest magnitude, or the cache's static scale); heads of at most :data:`FP8_MAX_HEAD_DIM`."""
    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

    op = "qkv_rope_cache"
    if not (isinstance(k_cache, Fp8CacheArray) and isinstance(v_cache, Fp8CacheArray)):
        raise KernelArgumentError(f"{op}: the FP8 form takes FP8 key and value caches")
    if not 0 < head_dim <= FP8_MAX_HEAD_DIM or head_dim % 2:
        raise KernelArgumentError(f"{op}: heads of {head_dim} dims into an FP8 cache (even, at most {FP8_MAX_HEAD_DIM})")
    rows = qkv.shape[0]
    check_array(op, "qkv", qkv, np.float32, (rows, (num_heads + 2 * num_kv_heads) * head_dim))
    check_array(op, "positions", positions, np.int32, (rows,))
    check_array(op, "slot_mapping", slot_mapping, np.int32, (rows,))
    check_array(op, "inv_freq", inv_freq, np.float32, ndim=1)
    rotary = checked_rotary_dim(op, rotary_dim, inv_freq, head_dim)
    check_array(op, "k_cache", k_cache.codes, np.uint8, (None, None, num_kv_heads, head_dim))
    check_array(op, "v_cache", v_cache.codes, np.uint8, tuple(k_cache.codes.shape))
    check_array(op, "k_cache scales", k_cache.scales, np.float32, tuple(k_cache.codes.shape[:3]))
    check_array(op, "v_cache scales", v_cache.scales, np.float32, tuple(k_cache.codes.shape[:3]))
    check_array(op, "q_out", q_out, np.float32, (rows, num_heads, head_dim))
    has_norm = q_norm is not None
    if has_norm:
        check_array(op, "q_norm", q_norm, np.uint16, (head_dim,))
        check_array(op, "k_norm", k_norm, np.uint16, (head_dim,))
    else:
        q_norm = k_norm = inv_freq  # never read
    if rows:
        launch(_word_kernel("qkv_rope_cache_fp8_words"), (rows, -(-(num_heads + num_kv_heads) // WORD_HEADS)),
               (32 * WORD_HEADS,), (
            qkv, positions, slot_mapping, inv_freq, np.float32(attention_factor), q_norm, k_norm, np.float32(eps),
            np.float32(norm_offset), np.int32(has_norm), np.int32(bool(interleaved)), np.int32(num_heads),
            np.int32(num_kv_heads), np.int32(head_dim), np.int32(rotary // 2), np.int32(k_cache.codes.shape[1]),
            q_out, k_cache.codes, v_cache.codes, k_cache.scales, v_cache.scales,
            np.float32(k_cache.static_scale or 0.0), np.float32(v_cache.static_scale or 0.0)), 0, stream,
               dependent=True)
    return q_out
