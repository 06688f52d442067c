"""Quantized weights and activations: the number formats, and the NumPy references of their
dequantization and of the quantized matrix product.

Every checkpoint format (compressed-tensors, Hugging Face ``fp8``, GPTQ, AWQ, MXFP4, online FP8)
is read into one :class:`QuantizedWeight` layout, so the op layer and its kernels meet four codes
only:

* ``fp8`` -- ``codes`` uint8 ``[out, in]``, OCP FP8 E4M3 (``e4m3fn``) bit patterns;
* ``int4`` -- ``codes`` uint8 ``[out, ceil(in / 2)]``, two unsigned 4-bit values per byte, the even
  column in the low nibble;
* ``int8`` -- ``codes`` uint8 ``[out, in]``, unsigned 8-bit values;
* ``mxfp4`` -- ``codes`` uint8 ``[out, ceil(in / 2)]``, two FP4 E2M1 values per byte, the even column
  in the low nibble (OCP microscaling; the scales are powers of two).

A weight value is ``(code - zero) * scale``: ``scales`` float32 ``[ceil(out / block[0]), ceil(in /
block[1])]`` (one per-tensor scale is the block ``(out, in)``, per-channel ``(1, in)``, a group of
``g`` columns ``(1, g)``, DeepSeek's blocks ``(128, 128)``, MXFP4's ``(1, 32)``); ``zeros`` the same
shape (asymmetric integers), or None: zero for the float codes, ``2**(bits - 1)`` for the integer
ones. ``input_order`` (int32 ``[in]``, GPTQ's act-order) stores the columns permuted so each group
is contiguous: the product gathers ``x[:, input_order]`` first.

``activations`` says how the product treats its input: ``"weight_only"`` (the input stays at
full precision), ``"fp8_token"`` (each row quantized to FP8 with its own scale, computed at run
time), ``"fp8_tensor"`` (one static FP8 scale, ``input_scale``), ``"fp8_group"`` (each row's groups of
``activation_group`` columns, DeepSeek's per-token-group scaling) or ``"int8_token"`` (each row to
INT8, W8A8).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from metrale.errors import QuantizationError

#: The weight codes a :class:`QuantizedWeight` may hold.
WEIGHT_CODES = ("fp8", "int4", "int8", "mxfp4")
#: How a quantized product treats its input (see the module docstring).
ACTIVATION_SCHEMES = ("weight_only", "fp8_token", "fp8_tensor", "fp8_group", "int8_token")

#: The largest finite FP8 E4M3 magnitude.
FP8_E4M3_MAX = 448.0
#: The largest INT8 magnitude a symmetric activation scale maps to.
INT8_MAX = 127.0
#: The smallest scale an activation row gets (an all-zero row would otherwise divide by zero).
MIN_ACTIVATION_SCALE = 1e-12


# ----------------------------------------------------------------------------- FP8 E4M3


@functools.cache
def fp8_e4m3_table() -> np.ndarray:
    """float32 ``[256]``: the value of every E4M3 (``e4m3fn``) bit pattern; 0x7F and 0xFF are NaN."""
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = (codes & 0x7).astype(np.float64)
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent.astype(np.float64) - 7.0)
    subnormal = mantissa / 8.0 * 2.0**-6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


def fp8_e4m3_to_float32(codes: np.ndarray) -> np.ndarray:
    """The float32 values of E4M3 bit patterns (uint8)."""
    return fp8_e4m3_table()[np.asarray(codes, dtype=np.uint8)]


def float32_to_fp8_e4m3(values: np.ndarray) -> np.ndarray:
    """uint8 E4M3 bit patterns of ``values``: rounded to the nearest (ties to the even code) and
    saturated at +-448, as a quantizer that clamps before the cast does. NaN stays NaN."""
    values = np.asarray(values, dtype=np.float32)
    magnitude = np.abs(values)
    np.minimum(magnitude, np.float32(FP8_E4M3_MAX), out=magnitude)  # (NaN stays NaN)
    bits = magnitude.view(np.uint32)
    # Normal codes: the float32 mantissa rounded to 3 bits (ties to even; a carry moves the
    # exponent up), the exponent rebased from float32's bias 127 to E4M3's 7.
    rounded = (bits >> np.uint32(20)) & np.uint32(1)
    rounded += bits
    rounded += np.uint32(0x7FFFF)
    rounded >>= np.uint32(20)
    rounded -= np.uint32(120 << 3)
    codes = rounded.astype(np.uint8)
    # Below 2**-6 the codes are subnormal, steps of 2**-9 (a code of 8 is the smallest normal).
    small = magnitude < np.float32(2.0**-6)
    codes[small] = np.rint(magnitude[small] * np.float32(512.0)).astype(np.uint8)
    codes |= (values.view(np.uint32) >> np.uint32(24)).astype(np.uint8) & np.uint8(0x80)
    codes[np.isnan(values)] = 0x7F
    return codes


def round_to_fp8(values: np.ndarray) -> np.ndarray:
    """``values`` rounded to the nearest E4M3 value (float32), saturating at +-448."""
    return fp8_e4m3_to_float32(float32_to_fp8_e4m3(values))


# ----------------------------------------------------------------------------- FP4 E2M1

#: The magnitudes of FP4 E2M1 codes 0..7 (bit 3 is the sign).
FP4_E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def fp4_e2m1_to_float32(nibbles: np.ndarray) -> np.ndarray:
    """The float32 values of 4-bit E2M1 codes (any integer array holding 0..15)."""
    nibbles = np.asarray(nibbles, dtype=np.uint8)
    values = FP4_E2M1_MAGNITUDES[nibbles & 0x7]
    return np.where(nibbles & 0x8, -values, values).astype(np.float32)


def e8m0_to_float32(exponents: np.ndarray) -> np.ndarray:
    """The float32 scales of E8M0 codes (``2**(code - 127)``; 255 is NaN)."""
    exponents = np.asarray(exponents, dtype=np.uint8)
    scales = np.ldexp(np.float32(1.0), np.minimum(exponents, 254).astype(np.int32) - 127).astype(np.float32)
    return np.where(exponents == 255, np.float32(np.nan), scales).astype(np.float32)


# -------------------------------------------------------------------------- integer codes


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """uint8 ``[rows, ceil(columns / 2)]`` of 4-bit values ``[rows, columns]`` (0..15), the even
    column in the low nibble (an odd last column pairs with a zero)."""
    values = np.asarray(values, dtype=np.uint8)
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros(values.shape[:-1] + (1,), np.uint8)], axis=-1)
    return (values[..., 0::2] & 0xF) | ((values[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: np.ndarray, columns: int) -> np.ndarray:
    """uint8 ``[rows, columns]``: the 4-bit values of :func:`pack_nibbles`' bytes."""
    packed = np.asarray(packed, dtype=np.uint8)
    both = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (-1,))
    return both[..., :columns]


# ----------------------------------------------------------------------------- the weight


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized ``[out, in]`` matrix in the engine's layout (the module docstring); its arrays
    live on one backend (NumPy on the CPU, CuPy on the GPU)."""

    codes_format: str
    codes: Any
    scales: Any
    block: tuple[int, int]
    shape: tuple[int, int]
    zeros: Any = None
    input_order: Any = None
    activations: str = "weight_only"
    input_scale: Any = None
    activation_group: int = 128
    #: The checkpoint format it was read from, in words (shown by errors and the docs' matrix).
    source: str = ""

    def __post_init__(self) -> None:
        if self.codes_format not in WEIGHT_CODES:
            raise QuantizationError(f"weight codes must be one of {WEIGHT_CODES}, got {self.codes_format!r}")
        if self.activations not in ACTIVATION_SCHEMES:
            raise QuantizationError(f"activation scheme must be one of {ACTIVATION_SCHEMES}, got {self.activations!r}")
        out, inner = self.shape
        columns = -(-inner // 2) if self.codes_format in ("int4", "mxfp4") else inner
        if tuple(self.codes.shape) != (out, columns):
            raise QuantizationError(f"{self.codes_format} codes of a [{out}, {inner}] weight must be [{out}, {columns}], "
                                    f"got {list(self.codes.shape)}")
        rows_per, columns_per = self.block
        expected = (-(-out // max(rows_per, 1)), -(-inner // max(columns_per, 1)))
        if rows_per < 1 or columns_per < 1 or tuple(self.scales.shape) != expected:
            raise QuantizationError(f"scales of a [{out}, {inner}] weight in blocks {self.block} must be "
                                    f"{list(expected)}, got {list(self.scales.shape)}")
        if self.zeros is not None and tuple(self.zeros.shape) != expected:
            raise QuantizationError(f"zero points must have the scales' shape {list(expected)}, got {list(self.zeros.shape)}")
        if self.input_order is not None and tuple(self.input_order.shape) != (inner,):
            raise QuantizationError(f"input_order must be [{inner}], got {list(self.input_order.shape)}")
        if self.activations == "fp8_tensor" and self.input_scale is None:
            raise QuantizationError("a static FP8 activation scheme needs its input_scale")

    # The array protocol families use on weights: a shape, a dtype-like tag, row views.
    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        """The bytes a product reads: codes, scales and zero points."""
        total = self.codes.nbytes + self.scales.nbytes
        return total + (self.zeros.nbytes if self.zeros is not None else 0)

    @property
    def bits(self) -> int:
        return 4 if self.codes_format in ("int4", "mxfp4") else 8

    def __getitem__(self, rows: slice) -> "QuantizedWeight":
        """Rows ``rows`` (a slice of step 1) of the matrix, as a quantized weight sharing the
        arrays where the blocks allow (an expert of stacked experts, a rank's rows)."""
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise QuantizationError(f"a quantized weight takes row slices of step 1, not {rows!r}")
        start, stop, _ = rows.indices(self.shape[0])
        stop = max(stop, start)
        weight = self if start % self.block[0] == 0 and (stop % self.block[0] == 0 or stop == self.shape[0]) \
            else self.per_row_scales()
        per = weight.block[0]
        first, last = start // per, -(-stop // per)
        return replace(
            weight,
            codes=weight.codes[start:stop],
            scales=weight.scales[first:last],
            zeros=None if weight.zeros is None else weight.zeros[first:last],
            shape=(stop - start, self.shape[1]),
            block=(per if stop - start >= per else max(stop - start, 1), weight.block[1]) if per > 1 else weight.block,
        )

    def per_row_scales(self) -> "QuantizedWeight":
        """The same weight with a scale row per matrix row (blocks ``(1, block[1])``), which any
        row range and any concatenation can take."""
        if self.block[0] == 1:
            return self
        xp = _array_module(self.scales)
        repeat = functools.partial(_repeat_rows, xp, count=self.block[0], rows=self.shape[0])
        return replace(self, scales=repeat(self.scales), zeros=None if self.zeros is None else repeat(self.zeros),
                       block=(1, self.block[1]))


def _array_module(array: Any) -> Any:
    return np if isinstance(array, np.ndarray) else __import__("cupy")


def _repeat_rows(xp: Any, array: Any, *, count: int, rows: int) -> Any:
    return xp.ascontiguousarray(xp.repeat(array, count, axis=0)[:rows])


def concatenate_weights(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """The quantized weights ``parts`` stacked along the rows (a fused q/k/v, gate/up, stacked
    experts): one layout, one activation scheme; blocks that do not line up with a part's rows
    become per-row scales first."""
    first = parts[0]
    if len(parts) == 1:
        return first
    for part in parts[1:]:
        same = (part.codes_format, part.activations, part.block[1], part.shape[1], part.input_scale is None,
                part.zeros is None, part.input_order is None)
        if same != (first.codes_format, first.activations, first.block[1], first.shape[1], first.input_scale is None,
                    first.zeros is None, first.input_order is None):
            raise QuantizationError(
                "the weights fused into one product are quantized differently "
                f"({first.codes_format}/{first.activations}/block {first.block} and "
                f"{part.codes_format}/{part.activations}/block {part.block})")
        if part.input_order is not None and not np.array_equal(_host(part.input_order), _host(first.input_order)):
            raise QuantizationError("the weights fused into one product have different act-order permutations")
    aligned = all(p.block[0] == first.block[0] and p.shape[0] % p.block[0] == 0 for p in parts[:-1]) and \
        parts[-1].block[0] == first.block[0]
    if not aligned:
        parts = [p.per_row_scales() for p in parts]
    xp = _array_module(first.codes)
    input_scale = first.input_scale
    if input_scale is not None:
        # One static input scale serves the fused product: the largest of the parts' (as vLLM).
        input_scale = xp.asarray(max(float(_host(p.input_scale).max()) for p in parts), dtype=xp.float32)
    rows = sum(p.shape[0] for p in parts)
    return replace(
        parts[0],
        codes=xp.concatenate([p.codes for p in parts]),
        scales=xp.concatenate([p.scales for p in parts]),
        zeros=None if first.zeros is None else xp.concatenate([p.zeros for p in parts]),
        shape=(rows, first.shape[1]),
        block=(parts[0].block[0] if aligned else 1, parts[0].block[1]),
        input_scale=input_scale,
    )


def _host(array: Any) -> np.ndarray:
    return array if isinstance(array, np.ndarray) else array.get()


# ------------------------------------------------------------------------ the references


def _expand(per_block: np.ndarray, block: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    """``[out, in]``: each block's value over its block."""
    expanded = np.repeat(np.repeat(per_block, block[0], axis=0), block[1], axis=1)
    return expanded[: shape[0], : shape[1]]


def weight_codes(weight: QuantizedWeight) -> np.ndarray:
    """float32 ``[out, in]``: the codes' values before scale and zero point (E4M3 and E2M1 decoded,
    integers as they are), in the stored column order."""
    out, inner = weight.shape
    codes = np.asarray(weight.codes)
    if weight.codes_format == "fp8":
        return fp8_e4m3_to_float32(codes)
    if weight.codes_format == "mxfp4":
        return fp4_e2m1_to_float32(unpack_nibbles(codes, inner))
    if weight.codes_format == "int4":
        return unpack_nibbles(codes, inner).astype(np.float32)
    return codes.astype(np.float32)


def dequantize(weight: QuantizedWeight, *, stored_order: bool = False) -> np.ndarray:
    """float32 ``[out, in]``: the matrix the quantized weight stands for (NumPy arrays only). With
    ``stored_order`` its columns stay in the act-order the codes are stored in."""
    values = weight_codes(weight)
    zeros = weight.zeros
    if zeros is None and weight.codes_format in ("int4", "int8"):
        values = values - float(1 << (weight.bits - 1))
    elif zeros is not None:
        values = values - _expand(np.asarray(zeros, np.float32), weight.block, weight.shape)
    values = values * _expand(np.asarray(weight.scales, np.float32), weight.block, weight.shape)
    if weight.input_order is not None and not stored_order:
        restored = np.empty_like(values)
        restored[:, np.asarray(weight.input_order)] = values
        values = restored
    return values.astype(np.float32)


def quantize_activations(x: np.ndarray, weight: QuantizedWeight) -> np.ndarray:
    """float32 ``[N, in]``: ``x`` as the product sees it under the weight's activation scheme
    (quantized and dequantized again; ``x`` itself for weight-only schemes)."""
    x = np.asarray(x, dtype=np.float32)
    scheme = weight.activations
    if scheme == "weight_only":
        return x
    if scheme == "fp8_tensor":
        scale = np.float32(np.asarray(weight.input_scale, np.float32).max())
        return round_to_fp8(x / scale) * scale
    if scheme == "fp8_group":
        group = weight.activation_group
        rows, inner = x.shape
        padded = np.zeros((rows, -(-inner // group) * group), np.float32)
        padded[:, :inner] = x
        grouped = padded.reshape(rows, -1, group)
        scale = np.maximum(np.abs(grouped).max(axis=2, keepdims=True) / FP8_E4M3_MAX, MIN_ACTIVATION_SCALE)
        return (round_to_fp8(grouped / scale) * scale).reshape(rows, -1)[:, :inner].astype(np.float32)
    limit = FP8_E4M3_MAX if scheme == "fp8_token" else INT8_MAX
    scale = np.maximum(np.abs(x).max(axis=1, keepdims=True) / limit, MIN_ACTIVATION_SCALE).astype(np.float32)
    if scheme == "fp8_token":
        return (round_to_fp8(x / scale) * scale).astype(np.float32)
    return (np.clip(np.rint(x / scale), -INT8_MAX, INT8_MAX) * scale).astype(np.float32)


def quantized_linear_reference(x: np.ndarray, weight: QuantizedWeight, bias: np.ndarray | None = None) -> np.ndarray:
    """float32 ``[N, out]``: ``x @ W.T + bias`` as the quantized product computes it: the input in
    the weight's column order, quantized under its activation scheme, times the dequantized
    weight, accumulated in float32."""
    x = np.asarray(x, dtype=np.float32)
    if weight.input_order is not None:
        x = x[:, np.asarray(weight.input_order)]
    y = quantize_activations(x, weight) @ dequantize(weight, stored_order=True).T
    if bias is not None:
        y = y + np.asarray(bias, dtype=np.float32)
    return y.astype(np.float32)


# --------------------------------------------------------------------- quantizing at load


def quantize_fp8_per_channel(matrix: np.ndarray, activations: str = "fp8_token") -> QuantizedWeight:
    """A float ``[out, in]`` matrix as FP8 E4M3 with one scale per row (``max |row| / 448``), the
    online quantization of a bf16 checkpoint (``quantization="fp8"``)."""
    matrix = np.asarray(matrix, dtype=np.float32)
    if matrix.ndim != 2:
        raise QuantizationError(f"only matrices are quantized, got shape {list(matrix.shape)}")
    scale = np.maximum(np.abs(matrix).max(axis=1, keepdims=True) / FP8_E4M3_MAX, MIN_ACTIVATION_SCALE)
    scale = scale.astype(np.float32)
    return QuantizedWeight("fp8", float32_to_fp8_e4m3(matrix / scale), scale, (1, matrix.shape[1]), matrix.shape,
                           activations=activations, source="online fp8")


def scale_blocks(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The shape of the scales of a ``shape`` matrix in blocks ``block``."""
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
