"""Matrix-vector products for decode batches (up to :data:`MAX_ROWS` rows) with the op before them
fused in: ``y = prologue(x) W^T``, bf16 weights read as 128-bit words (CUDA C++, compiled by
NVRTC through CuPy).

A decode step of a 1B model is launch-bound: every kernel costs a few microseconds in the CUDA
graph whatever it does, and the norm before a projection, or the SwiGLU gate before the down
projection, is a kernel of its own. Here the projection's kernel computes its input itself:

* :data:`PLAIN` -- ``x`` bf16 ``[rows, K]`` as it is;
* :data:`RMSNORM` -- ``x`` float32 ``[rows, K]`` plus the float32 residual (when given):
  ``s = x + residual`` (written to ``summed`` by block 0, the next residual), then
  ``bf16(s / sqrt(mean(s^2) + eps) * (offset + norm_weight))``, as
  :func:`metrale.kernels.rmsnorm.rmsnorm_residual` computes it;
* :data:`SILU` -- ``x`` bf16 ``[rows, 2K]`` (gate columns first): ``bf16(silu(gate) * up)``, as
  :func:`metrale.kernels.activation.silu_and_mul` computes it.

Each block first writes the prologue's ``[rows, K]`` bf16 input into shared memory (every block
computes it: the input is a few kilobytes, read from L2), then its warps loop over output columns
(:data:`COLUMNS` at a time, the grid sized to fill the GPU rather than to cover ``N``): the 32
lanes of a warp read a weight row as 16-byte words, :data:`UNROLL` words per column in flight
before any is used, multiply them with the staged rows and reduce with warp shuffles. The output
is float32 (plus ``bias``) or, with ``bf16_out``, bf16 bits (a gate-and-up projection feeding
:data:`SILU`). ``summed`` must not share memory with ``x`` or ``residual``: every block reads
them while block 0 writes it. ``K`` must be a multiple of 8; rows are padded to 1, 2, 4 or 8 (the padding rows
staged as zeros, never written).

:func:`decode_gemv_reference` is the NumPy reference; ``tests/kernels`` runs the kernels on the
host against it through the CUDA emulation header, ``tests/gpu`` on the GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels._device import DeviceArray, check_array
from metrale.kernels.activation import silu_and_mul_reference
from metrale.kernels.linear import linear_reference
from metrale.kernels.rmsnorm import rmsnorm_residual_reference

PLAIN, RMSNORM, SILU = 0, 1, 2
MODES = {PLAIN: "plain", RMSNORM: "rmsnorm", SILU: "silu"}

MAX_ROWS = 8
ROW_BUCKETS = (1, 2, 4, 8)
WARPS = 8
THREADS = 32 * WARPS
COLUMNS = 2  # output columns per warp at a time
UNROLL = 4  # 16-byte weight words per column and lane in flight
#: Largest staged input (``rows`` bucket x ``K`` x 2 bytes) a block takes; larger inputs are not
#: served (:func:`supports`).
MAX_STAGE_BYTES = 200 * 1024

#: The CUDA side only: the dynamic shared memory (the emulation header has its own).
INSTRUCTIONS = r"""
#define DYNAMIC_SHARED extern __shared__ __align__(16) unsigned char dynamic_shared[]
"""

CONSTANTS = f"""
#define WARPS {WARPS}
#define THREADS {THREADS}
#define COLUMNS {COLUMNS}
#define UNROLL {UNROLL}
#define MODE_PLAIN {PLAIN}
#define MODE_RMSNORM {RMSNORM}
#define MODE_SILU {SILU}
"""

#: The bf16 conversions, the 8-wide bf16 dot product and the warp sum the decode kernels share
#: (:mod:`metrale.kernels.moe_decode`, :mod:`metrale.kernels.gdn_decode` too).
HELPERS = r"""
__device__ __forceinline__ float bf16_low(unsigned word) { return __uint_as_float(word << 16); }
__device__ __forceinline__ float bf16_high(unsigned word) { return __uint_as_float(word & 0xffff0000u); }
__device__ __forceinline__ float bf16_bits(unsigned short bits) { return __uint_as_float((unsigned)bits << 16); }

// float32 -> bf16 bits, round to nearest even; NaN stays NaN (metrale.kernels._device.float_to_bf16).
__device__ __forceinline__ unsigned short to_bf16(float value) {
    const unsigned word = __float_as_uint(value);
    if ((word & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (unsigned short)((word + 0x7fffu + ((word >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float dot8(const uint4 w, const uint4 x) {
    float sum = bf16_low(w.x) * bf16_low(x.x);
    sum += bf16_high(w.x) * bf16_high(x.x);
    sum += bf16_low(w.y) * bf16_low(x.y);
    sum += bf16_high(w.y) * bf16_high(x.y);
    sum += bf16_low(w.z) * bf16_low(x.z);
    sum += bf16_high(w.z) * bf16_high(x.z);
    sum += bf16_low(w.w) * bf16_low(x.w);
    sum += bf16_high(w.w) * bf16_high(x.w);
    return sum;
}

__device__ __forceinline__ float warp_sum(float value) {
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}
"""

KERNELS = r"""
// y[r, n] = dot(prologue(x)[r, :], weight[n, :]) (+ bias[n]) for r < rows, n < N.
// Grid: any number of blocks of THREADS threads; dynamic shared memory ROWS * K * 2 bytes (plus
// WARPS * ROWS floats for RMSNORM). x: bf16 bits [rows, K] (PLAIN), float32 [rows, K] (RMSNORM,
// with residual float32 [rows, K] when has_residual), bf16 bits [rows, 2K] (SILU); weight: bf16
// bits [N, K] (K a multiple of 8); out: float32 [rows, N], or bf16 bits with BF16_OUT.
template <int ROWS, int MODE, bool BF16_OUT>
__global__ void __launch_bounds__(THREADS) decode_gemv(
    const void* __restrict__ x, const float* __restrict__ residual, const unsigned short* __restrict__ norm_weight,
    float eps, float norm_offset, int has_residual, float* __restrict__ summed,
    const uint4* __restrict__ weight, const float* __restrict__ bias, void* __restrict__ out,
    int rows, int K, int N) {
    DYNAMIC_SHARED;
    unsigned short* stage = reinterpret_cast<unsigned short*>(dynamic_shared);   // [ROWS][K]
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

    // 1. The prologue's rows, as bf16, into shared memory (zeros for the padding rows).
    if (MODE == MODE_PLAIN) {
        const unsigned short* in = static_cast<const unsigned short*>(x);
        for (int i = tid; i < ROWS * K; i += THREADS) stage[i] = i / K < rows ? in[i] : (unsigned short)0;
    } else if (MODE == MODE_SILU) {
        const unsigned short* in = static_cast<const unsigned short*>(x);
        for (int i = tid; i < ROWS * K; i += THREADS) {
            const int r = i / K, k = i % K;
            unsigned short value = 0;
            if (r < rows) {
                const float gate = bf16_bits(in[(size_t)r * 2 * K + k]);
                const float silu = gate / (1.0f + expf(-gate));
                value = to_bf16(silu * bf16_bits(in[(size_t)r * 2 * K + K + k]));
            }
            stage[i] = value;
        }
    } else {
        const float* in = static_cast<const float*>(x);
        float* partial = reinterpret_cast<float*>(dynamic_shared + (size_t)ROWS * K * 2);   // [WARPS][ROWS]
        float squares[ROWS];
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) squares[r] = 0.0f;
        for (int k = tid; k < K; k += THREADS) {
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r < rows) {
                    float value = in[(size_t)r * K + k];
                    if (has_residual) value += residual[(size_t)r * K + k];
                    squares[r] += value * value;
                }
            }
        }
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float total = warp_sum(squares[r]);
            if (lane == 0) partial[warp * ROWS + r] = total;
        }
        __syncthreads();
        float inverse[ROWS];
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float total = 0.0f;
            #pragma unroll
            for (int w = 0; w < WARPS; ++w) total += partial[w * ROWS + r];
            inverse[r] = 1.0f / sqrtf(total / (float)K + eps);
        }
        for (int k = tid; k < K; k += THREADS) {
            const float scale = norm_offset + bf16_bits(norm_weight[k]);
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                unsigned short value = 0;
                if (r < rows) {
                    float sum = in[(size_t)r * K + k];
                    if (has_residual) sum += residual[(size_t)r * K + k];
                    if (blockIdx.x == 0) summed[(size_t)r * K + k] = sum;
                    value = to_bf16(sum * inverse[r] * scale);
                }
                stage[r * K + k] = value;
            }
        }
    }
    __syncthreads();

    // 2. Output columns, COLUMNS per warp at a time, over the whole grid.
    const int words = K / 8;   // 16-byte words per row
    const uint4* staged = reinterpret_cast<const uint4*>(stage);
    for (int n0 = (blockIdx.x * WARPS + warp) * COLUMNS; n0 < N; n0 += gridDim.x * WARPS * COLUMNS) {
        float acc[COLUMNS][ROWS];
        #pragma unroll
        for (int c = 0; c < COLUMNS; ++c)
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[c][r] = 0.0f;
        for (int base = lane; base < words; base += 32 * UNROLL) {
            uint4 loaded[COLUMNS][UNROLL];
            #pragma unroll
            for (int c = 0; c < COLUMNS; ++c) {
                const int column = min(n0 + c, N - 1);   // a column past N repeats the last one, never written
                #pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const int index = base + 32 * u;
                    if (index < words) loaded[c][u] = __ldg(weight + (size_t)column * words + index);
                }
            }
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int index = base + 32 * u;
                if (index < words) {
                    #pragma unroll
                    for (int r = 0; r < ROWS; ++r) {
                        const uint4 input = staged[r * words + index];
                        #pragma unroll
                        for (int c = 0; c < COLUMNS; ++c) acc[c][r] += dot8(loaded[c][u], input);
                    }
                }
            }
        }
        #pragma unroll
        for (int c = 0; c < COLUMNS; ++c) {
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float total = warp_sum(acc[c][r]);
                const int column = n0 + c;
                if (lane == c * ROWS + r && r < rows && column < N) {
                    const float value = bias != nullptr ? total + bias[column] : total;
                    if (BF16_OUT) static_cast<unsigned short*>(out)[(size_t)r * N + column] = to_bf16(value);
                    else static_cast<float*>(out)[(size_t)r * N + column] = value;
                }
            }
        }
    }
}
"""


def kernel_name(rows_bucket: int, mode: int, bf16_out: bool) -> str:
    """The C++ name of one instantiation of ``decode_gemv``."""
    return f"decode_gemv<{rows_bucket}, {mode}, {'true' if bf16_out else 'false'}>"


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return INSTRUCTIONS + CONSTANTS + HELPERS + KERNELS


def rows_bucket(rows: int) -> int:
    """The padded row count a launch of ``rows`` rows runs with."""
    for bucket in ROW_BUCKETS:
        if rows <= bucket:
            return bucket
    raise KernelArgumentError(f"decode_gemv serves at most {MAX_ROWS} rows, got {rows}")


def shared_bytes(rows: int, inner: int, mode: int) -> int:
    """Dynamic shared memory of a launch: the staged rows (and the norm's partial sums)."""
    bucket = rows_bucket(rows)
    return bucket * inner * 2 + (WARPS * bucket * 4 if mode == RMSNORM else 0)


def supports(rows: int, inner: int, mode: int = PLAIN) -> bool:
    """Whether a launch of ``rows`` rows and inner size ``inner`` is served."""
    return 0 < rows <= MAX_ROWS and inner > 0 and inner % 8 == 0 and shared_bytes(rows, inner, mode) <= MAX_STAGE_BYTES


# ------------------------------------------------------------------------------ reference


def decode_gemv_reference(
    mode: int, x: np.ndarray, weight: np.ndarray, *, residual: np.ndarray | None = None,
    norm_weight: np.ndarray | None = None, eps: float = 1e-6, norm_offset: float = 0.0, bias: np.ndarray | None = None,
    bf16_out: bool = False,
) -> tuple[np.ndarray, np.ndarray | None]:
    """``(out, summed)``: what a launch computes, from float32 arrays (``x``, ``weight`` and
    ``norm_weight`` holding bf16 values). The prologue's input is rounded to bf16 as the unfused
    ops round it; ``out`` is float32 (bf16 values with ``bf16_out``); ``summed`` is the RMSNORM
    prologue's ``x + residual`` (None for the other modes)."""
    from metrale.checkpoint import bf16_to_float32, float32_to_bf16

    def round_bf16(values: np.ndarray) -> np.ndarray:
        return bf16_to_float32(float32_to_bf16(np.asarray(values, dtype=np.float32)))

    summed = None
    x = np.asarray(x, dtype=np.float32)
    if mode == PLAIN:
        staged = x
    elif mode == SILU:
        inner = x.shape[1] // 2
        staged = round_bf16(silu_and_mul_reference(x[:, :inner], x[:, inner:]))
    elif mode == RMSNORM:
        assert norm_weight is not None
        normed, summed = rmsnorm_residual_reference(x, residual, norm_weight, eps, norm_offset)
        staged = round_bf16(normed)
    else:
        raise KernelArgumentError(f"decode_gemv: unknown mode {mode!r}")
    out = linear_reference(staged, weight, bias)
    return (round_bf16(out) if bf16_out else out.astype(np.float32)), summed


# ------------------------------------------------------------------------------- launcher

_kernels: dict[tuple[int, int, bool], Any] = {}
_grid_limit: dict[int, int] = {}


def _kernel(bucket: int, mode: int, bf16_out: bool) -> Any:
    key = (bucket, mode, bf16_out)
    kernel = _kernels.get(key)
    if kernel is None:
        import cupy

        name = kernel_name(bucket, mode, bf16_out)
        module = cupy.RawModule(code=source(), options=("--std=c++17",), name_expressions=(name,))
        kernel = module.get_function(name)
        _kernels[key] = kernel
    return kernel


def _blocks(column_groups: int, stage: int) -> int:
    """Blocks of a launch: enough to cover the columns, at most as many as the GPU holds at once
    with ``stage`` bytes of shared memory each."""
    import cupy

    device = cupy.cuda.Device().id
    if device not in _grid_limit:
        _grid_limit[device] = int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])
    per_sm = max(1, min(4, (220 * 1024) // max(stage, 1)))
    return max(1, min(column_groups, _grid_limit[device] * per_sm))


def decode_gemv(
    mode: int, x: DeviceArray, weight: DeviceArray, out: DeviceArray, stream: Any, *, residual: DeviceArray | None = None,
    norm_weight: DeviceArray | None = None, eps: float = 1e-6, norm_offset: float = 0.0,
    summed: DeviceArray | None = None, bias: DeviceArray | None = None,
) -> DeviceArray:
    """``out <- prologue(x) weight^T (+ bias)`` (see the module docstring) on ``stream``; with
    :data:`RMSNORM`, ``summed <- x (+ residual)``. ``out`` float32 ``[rows, N]``, or uint16 for a
    bf16 output. Raises :class:`~metrale.errors.KernelArgumentError` for shapes it does not serve
    (:func:`supports`)."""
    name = f"decode_gemv ({MODES.get(mode, mode)})"
    check_array(name, "weight", weight, np.uint16, ndim=2)
    columns, inner = weight.shape
    rows = x.shape[0] if getattr(x, "ndim", 0) == 2 else -1
    width = 2 * inner if mode == SILU else inner
    check_array(name, "x", x, np.float32 if mode == RMSNORM else np.uint16, (rows, width))
    if not supports(rows, inner, mode):
        raise KernelArgumentError(f"{name}: {rows} rows of inner size {inner} are not served "
                                  f"(at most {MAX_ROWS} rows; the inner size a multiple of 8, staged in "
                                  f"{MAX_STAGE_BYTES} bytes)")
    bf16_out = out.dtype == np.uint16
    check_array(name, "out", out, np.uint16 if bf16_out else np.float32, (rows, columns))
    if bias is not None:
        check_array(name, "bias", bias, np.float32, (columns,))
    if mode == RMSNORM:
        if norm_weight is None or summed is None:
            raise KernelArgumentError(f"{name}: the norm needs norm_weight and summed")
        check_array(name, "norm_weight", norm_weight, np.uint16, (inner,))
        check_array(name, "summed", summed, np.float32, (rows, inner))
        if residual is not None:
            check_array(name, "residual", residual, np.float32, (rows, inner))
    pointer = getattr(getattr(weight, "data", None), "ptr", None)
    if pointer is not None and pointer % 16:
        raise KernelArgumentError(f"{name}: weight does not start at a 16-byte boundary")
    bucket = rows_bucket(rows)
    kernel = _kernel(bucket, mode, bf16_out)
    stage = shared_bytes(rows, inner, mode)
    if stage > 48 * 1024:
        kernel.max_dynamic_shared_size_bytes = stage
    blocks = _blocks(-(-columns // (WARPS * COLUMNS)), stage)
    null = np.uint64(0)  # a null pointer for the arguments left out
    with stream if stream is not None else contextlib.nullcontext():
        kernel((blocks,), (THREADS,), (
            x, residual if residual is not None else null, norm_weight if norm_weight is not None else null,
            np.float32(eps), np.float32(norm_offset), np.int32(residual is not None),
            summed if summed is not None else null, weight, bias if bias is not None else null, out,
            np.int32(rows), np.int32(inner), np.int32(columns),
        ), shared_mem=stage)
    return out
