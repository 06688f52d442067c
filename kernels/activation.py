"""Gated and plain activations: SiLU-and-mul (the SwiGLU gate, ``silu(gate) * up``), GELU and
GELU-and-mul (GeGLU), and the float32 <-> bf16 casts.

The numba kernels serve every shape; :func:`silu_and_mul_words` is the CUDA C++ SiLU-and-mul the
CUDA backend runs on bf16 products whose width is a multiple of 8 (a product's output at a
decode batch too large for the decode GEMV): 16-byte words, launched dependently so its launch
overlaps the product ahead of it."""

from __future__ import annotations

import math

import numpy as np

from metrale.errors import KernelArgumentError

GELU_APPROXIMATIONS = ("none", "tanh")


def sigmoid_denominator(x: np.ndarray) -> np.ndarray:
    """``1 + exp(-x)`` in ``x``'s precision: ``y / sigmoid_denominator(x)`` is ``y * sigmoid(x)``.
    Where ``exp(-x)`` overflows (``x`` below about -88 in float32) it is infinite and the quotient
    its limit, 0, without NumPy's overflow warning."""
    with np.errstate(over="ignore"):
        return np.float32(1.0) + np.exp(-x)


def silu_and_mul_reference(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``gate * sigmoid(gate) * up``, float32, same shape as the inputs."""
    gate = np.asarray(gate, dtype=np.float32)
    return (gate / sigmoid_denominator(gate) * up).astype(np.float32)


# NumPy has no erf (and SciPy is no dependency): the C library's, element by element on float64,
# exact to an ulp or so, which a faster vectorised approximation is not (timings: docs/notes/first-builds.rst).
_erf = np.frompyfunc(math.erf, 1, 1)


def gelu_reference(x: np.ndarray, approximate: str = "none") -> np.ndarray:
    """GELU of ``x`` as ``torch.nn.functional.gelu(x, approximate=...)``, float32, same shape.

    ``"none"``: ``0.5 x (1 + erf(x / sqrt(2)))``; ``"tanh"``: ``0.5 x (1 + tanh(sqrt(2 / pi)
    (x + 0.044715 x^3)))``. Evaluated in float64 and rounded once.
    """
    if approximate not in GELU_APPROXIMATIONS:
        raise KernelArgumentError(f"gelu: approximate is {approximate!r}, expected one of {list(GELU_APPROXIMATIONS)}")
    x64 = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore"):  # -inf * 0 is NaN, as in torch
        if approximate == "tanh":
            inner = math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64 * x64 * x64)
            return (0.5 * x64 * (1.0 + np.tanh(inner))).astype(np.float32)
        erf = np.asarray(_erf(x64 * math.sqrt(0.5)), dtype=np.float64)
        return (0.5 * x64 * (1.0 + erf)).astype(np.float32)


def gelu_and_mul_reference(gate: np.ndarray, up: np.ndarray, approximate: str = "none") -> np.ndarray:
    """``gelu(gate) * up`` (GeGLU), float32, same shape as the inputs."""
    return (gelu_reference(gate, approximate) * np.asarray(up, dtype=np.float32)).astype(np.float32)


# ------------------------------------------------------------------------------ CUDA kernels

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

ELEMENTWISE_THREADS = 32 if SIMULATED else 256


@jit_kernel
def silu_and_mul_kernel(gate_up, out):
    # Grid: (N rows, ceil(I / threads)). gate_up [N, 2I] f32 (gate first), out [N, I] bf16 bits.
    row = cuda.blockIdx.x
    column = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    width = out.shape[1]
    if column < width:
        gate = gate_up[row, column]
        silu = gate / (float32(1.0) + math.exp(-gate))
        out[row, column] = float_to_bf16(silu * gate_up[row, width + column])


@jit_kernel
def silu_and_mul_bf16_kernel(gate_up, out):
    # silu_and_mul_kernel for gate_up [N, 2I] bf16 bits (a matrix product's bf16 output).
    row = cuda.blockIdx.x
    column = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    width = out.shape[1]
    if column < width:
        gate = bf16_to_float(gate_up[row, column])
        silu = gate / (float32(1.0) + math.exp(-gate))
        out[row, column] = float_to_bf16(silu * bf16_to_float(gate_up[row, width + column]))


SQRT_HALF = 0.7071067811865476  # 1 / sqrt(2)
SQRT_TWO_OVER_PI = 0.7978845608028654


@cuda.jit(device=True)
def gelu_value(value, approximate_tanh):
    """GELU of one float32 value: torch's tanh approximation when ``approximate_tanh``, else erf."""
    if approximate_tanh:
        inner = float32(SQRT_TWO_OVER_PI) * (value + float32(0.044715) * value * value * value)
        return float32(0.5) * value * (float32(1.0) + math.tanh(inner))
    return float32(0.5) * value * (float32(1.0) + math.erf(value * float32(SQRT_HALF)))


@jit_kernel
def gelu_kernel(x, approximate_tanh, out):
    # Grid: (N rows, ceil(W / threads)). x [N, W] f32, out [N, W] bf16 bits.
    row = cuda.blockIdx.x
    column = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if column < out.shape[1]:
        out[row, column] = float_to_bf16(gelu_value(x[row, column], approximate_tanh))


@jit_kernel
def gelu_and_mul_kernel(gate_up, approximate_tanh, out):
    # Grid: (N rows, ceil(I / threads)). gate_up [N, 2I] f32 (gate first), out [N, I] bf16 bits.
    row = cuda.blockIdx.x
    column = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    width = out.shape[1]
    if column < width:
        gelu = gelu_value(gate_up[row, column], approximate_tanh)
        out[row, column] = float_to_bf16(gelu * gate_up[row, width + column])


@jit_kernel
def to_bf16_kernel(source, out):
    # Grid: ceil(n / threads) over the flattened arrays. source f32 [n], out bf16 bits [n].
    index = cuda.grid(1)
    if index < out.shape[0]:
        out[index] = float_to_bf16(source[index])


@jit_kernel
def to_float32_kernel(source, out):
    # Grid: ceil(n / threads) over the flattened arrays. source bf16 bits [n], out f32 [n].
    index = cuda.grid(1)
    if index < out.shape[0]:
        out[index] = bf16_to_float(source[index])


def silu_and_mul(gate_up: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """``out <- bf16(silu(gate) * up)`` for ``gate_up [N, 2I]`` float32 (:func:`silu_and_mul_kernel`)."""
    return _launch_silu_and_mul(silu_and_mul_kernel, np.float32, gate_up, out, stream)


def silu_and_mul_bits(gate_up: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """``out <- bf16(silu(gate) * up)`` for ``gate_up [N, 2I]`` bf16 bits (:func:`silu_and_mul_bf16_kernel`)."""
    return _launch_silu_and_mul(silu_and_mul_bf16_kernel, np.uint16, gate_up, out, stream)


def _launch_silu_and_mul(kernel: Any, dtype: Any, gate_up: DeviceArray, out: DeviceArray, stream: object) -> DeviceArray:
    check_array("silu_and_mul", "gate_up", gate_up, dtype, ndim=2)
    rows, double = gate_up.shape
    if double % 2:
        raise KernelArgumentError(f"silu_and_mul: gate_up has shape {[rows, double]}, whose last extent is odd")
    check_array("silu_and_mul", "out", out, np.uint16, (rows, double // 2))
    if rows:
        grid = (rows, -(-(double // 2) // ELEMENTWISE_THREADS))
        kernel[grid, ELEMENTWISE_THREADS, numba_stream(stream)](device_view(gate_up), device_view(out))
    return out


def gelu(x: DeviceArray, approximate_tanh: bool, out: DeviceArray, stream: object = None) -> DeviceArray:
    """``out <- bf16(gelu(x))`` for ``x [N, W]`` float32 (tanh approximation when ``approximate_tanh``)."""
    check_array("gelu", "x", x, np.float32, ndim=2)
    rows, width = x.shape
    check_array("gelu", "out", out, np.uint16, (rows, width))
    if rows and width:
        grid = (rows, -(-width // ELEMENTWISE_THREADS))
        gelu_kernel[grid, ELEMENTWISE_THREADS, numba_stream(stream)](
            device_view(x), np.int32(bool(approximate_tanh)), device_view(out)
        )
    return out


def gelu_and_mul(gate_up: DeviceArray, approximate_tanh: bool, out: DeviceArray, stream: object = None) -> DeviceArray:
    """``out <- bf16(gelu(gate) * up)`` for ``gate_up [N, 2I]`` float32 (gate first, then up)."""
    check_array("gelu_and_mul", "gate_up", gate_up, np.float32, ndim=2)
    rows, double = gate_up.shape
    if double % 2:
        raise KernelArgumentError(f"gelu_and_mul: gate_up has shape {[rows, double]}, whose last extent is odd")
    check_array("gelu_and_mul", "out", out, np.uint16, (rows, double // 2))
    if rows and double:
        grid = (rows, -(-(double // 2) // ELEMENTWISE_THREADS))
        gelu_and_mul_kernel[grid, ELEMENTWISE_THREADS, numba_stream(stream)](
            device_view(gate_up), np.int32(bool(approximate_tanh)), device_view(out)
        )
    return out


def to_bf16(source: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """Round float32 ``source`` to bf16 bits in ``out`` (same shape)."""
    check_array("to_bf16", "source", source, np.float32)
    check_array("to_bf16", "out", out, np.uint16, tuple(source.shape))
    count = int(np.prod(source.shape))
    if count:
        blocks = -(-count // ELEMENTWISE_THREADS)
        to_bf16_kernel[blocks, ELEMENTWISE_THREADS, numba_stream(stream)](
            device_view(source.reshape(count)), device_view(out.reshape(count))
        )
    return out


def to_float32(source: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """Widen bf16 bits ``source`` to float32 in ``out`` (same shape), exactly."""
    check_array("to_float32", "source", source, np.uint16)
    check_array("to_float32", "out", out, np.float32, tuple(source.shape))
    count = int(np.prod(source.shape))
    if count:
        blocks = -(-count // ELEMENTWISE_THREADS)
        to_float32_kernel[blocks, ELEMENTWISE_THREADS, numba_stream(stream)](
            device_view(source.reshape(count)), device_view(out.reshape(count))
        )
    return out


# ------------------------------------------------------------------------------ CUDA C++ kernel

from typing import Any  # noqa: E402

from metrale.kernels._launch import DEPENDENT_LAUNCH, launch  # noqa: E402

#: Threads of a block of :func:`silu_and_mul_words`, each on one 16-byte word (8 values) of a row.
WORD_THREADS = 128

KERNEL = r"""
#define SILU_WORD_THREADS 128

// out[n, c] = bf16(silu(gate[n, c]) * up[n, c]) with gate = gate_up[n, :I], up = gate_up[n, I:].
// Grid (N, ceil(I / (8 * SILU_WORD_THREADS))) blocks of SILU_WORD_THREADS threads, a 16-byte word
// (8 values) a thread; gate_up bf16 bits [N, 2I], out bf16 bits [N, I], I a multiple of 8, both
// 16-byte aligned.
extern "C" __global__ void __launch_bounds__(SILU_WORD_THREADS) silu_and_mul_words(
    const uint4* __restrict__ gate_up, uint4* __restrict__ out, int width) {
    wait_for_producers();   // the product comes from the kernel ahead
    allow_dependents();     // after the wait: see metrale.kernels._launch
    const int words = width / 8, row = blockIdx.x;  // rows on x: y and z stop at 65,535
    const int word = blockIdx.y * SILU_WORD_THREADS + threadIdx.x;
    if (word >= words) return;
    const uint4 gate = gate_up[(size_t)row * 2 * words + word], up = gate_up[(size_t)row * 2 * words + words + word];
    uint4 value;
    value.x = silu_mul_pair(gate.x, up.x);
    value.y = silu_mul_pair(gate.y, up.y);
    value.z = silu_mul_pair(gate.z, up.z);
    value.w = silu_mul_pair(gate.w, up.w);
    out[(size_t)row * words + word] = value;
}
"""

KERNEL_NAMES = ("silu_and_mul_words",)


def source() -> str:
    """The CUDA C++ source NVRTC compiles (with :data:`metrale.kernels._words.HELPERS`)."""
    from metrale.kernels._words import HELPERS

    return DEPENDENT_LAUNCH + HELPERS + KERNEL


def words_supported(gate_up: Any) -> bool:
    """Whether :func:`silu_and_mul_words` serves ``gate_up``: bf16 bits, two dimensions, contiguous,
    16-byte aligned, a width (``I``) that is a multiple of 8."""
    from metrale.kernels._words import aligned

    shape: tuple[int, ...] = tuple(getattr(gate_up, "shape", ()))
    return (getattr(gate_up, "dtype", None) == np.uint16 and len(shape) == 2 and shape[1] % 16 == 0
            and bool(gate_up.flags.c_contiguous) and aligned(gate_up))


_word_kernels: list[Any] = []


def silu_and_mul_words(gate_up: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """:func:`silu_and_mul` of bf16 bits in CUDA C++, launched dependently: ``gate_up [N, 2I]``
    of :func:`words_supported`, ``out [N, I]`` contiguous and 16-byte aligned."""
    op = "silu_and_mul"
    check_array(op, "gate_up", gate_up, np.uint16, ndim=2)
    rows, double = gate_up.shape
    check_array(op, "out", out, np.uint16, (rows, double // 2))
    if not words_supported(gate_up):
        raise KernelArgumentError(f"{op}: the CUDA C++ kernel takes a contiguous, 16-byte aligned gate_up whose "
                                  f"halves are multiples of 8 values, not shape {[rows, double]}")
    if not _word_kernels:
        import cupy

        _word_kernels.append(cupy.RawModule(code=source(), options=("--std=c++17",))
                             .get_function("silu_and_mul_words"))
    width = double // 2
    if rows and width:
        launch(_word_kernels[0], (rows, -(-width // (8 * WORD_THREADS))), (WORD_THREADS,),
               (gate_up, out, np.int32(width)), 0, stream, dependent=True)
    return out
