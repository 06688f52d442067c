"""The CUDA implementations of the built-in ops: one method per kernel of an op, each checking and
adapting its arguments, allocating its outputs on the engine's memory pool and launching that
kernel of :mod:`metrale.kernels` on the engine stream (cuBLAS for matrix products). Which method
serves a call is the op registry's choice (:mod:`metrale.ops.selection`); a method never picks
another kernel.

Imported only by the CUDA backend (it imports CuPy and numba).
"""

from __future__ import annotations

from typing import Any, Callable

import cupy as cp
import numpy as np

from metrale.kernels import (
    activation,
    attention,
    attention_decode_mma,
    attention_fp8,
    attention_grouped,
    attention_latent,
    attention_latent_mma,
    attention_mma,
    attention_prefill,
    attention_staged,
    decode_gemv,
    embedding,
    gated,
    gated_delta,
    gated_delta_chunked,
    gdn_decode,
    layernorm,
    linear_invariant,
    lora,
    moe,
    moe_clamped,
    moe_decode,
    moe_grouped,
    moe_route_decode,
    qkv_rope,
    quantized_gemv,
    quantized_moe_decode,
    rmsnorm,
    token_feed,
)
from metrale.kernels import head_linear as head_linear_kernels
from metrale.kernels.linear import CublasGemm
from metrale.kernels.quantized import QuantizedWeight

f32, bf16 = np.float32, np.uint16


def _tanh_form(approximate: str) -> bool:
    """GELU's ``approximate`` argument as the kernels' flag ('none': erf, 'tanh': tanh)."""
    if approximate not in ("none", "tanh"):
        from metrale.errors import KernelArgumentError

        raise KernelArgumentError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return approximate == "tanh"



def _batch_constant(batch: Any, key: str, build: Callable[[], np.ndarray]) -> Any:
    """``build()`` on the device, made once per forward batch: every layer's call reuses it, so the
    host copies it (and waits for the copy) once, not once per layer."""
    value = batch.extras.get(key)
    if value is None:
        value = batch.extras[key] = cp.asarray(build())
    return value


class CudaKernels:
    """The built-in ops on one CUDA backend (its stream and cuBLAS handle)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self._gemm: Any = None
        # The FP8 tensor-core products of quantized weights (made at their first use), and the
        # shapes cuBLASLt has no FP8 algorithm for (or none applying the scales in its epilogue).
        self._fp8_gemm: Any = None
        self._fp8_unserved: set[tuple[int, int, int]] = set()
        # (rows, inner, columns) -> the row count cuBLASLt serves with the scales in its epilogue (the
        # rows, or the rows padded to a multiple of 16), None where it serves neither.
        self._fp8_epilogue_rows: dict[tuple[int, int, int], int | None] = {}
        self._route_counter: Any = None  # the decode router's ticket (moe_route_decode), zero between launches
        self._attention_counters: list[Any] = []  # the decode attention's merge tickets, by size

    @property
    def gemm(self) -> Any:
        """The cuBLAS products (:class:`~metrale.kernels.linear.CublasGemm`) on the stream, made at
        the first product that needs them: loading cuBLAS and its bindings costs a fresh process
        most of a second, and a small model's decode-sized products (the GEMV kernels) never do.
        The first use is always an eager launch (a step runs eagerly before its graph is
        recorded), never inside a capture."""
        if self._gemm is None:
            self._gemm = CublasGemm(self.stream)
        return self._gemm

    # ------------------------------------------------------------------------- conversions

    def to_bf16(self, x: Any) -> Any:
        x = cp.ascontiguousarray(x)
        return activation.to_bf16(x, cp.empty(x.shape, dtype=bf16), self.stream)

    def as_bf16(self, x: Any) -> Any:
        """``x`` as bf16 bits: float32 narrowed, bf16 bits kept (made contiguous)."""
        return self.to_bf16(x) if x.dtype == f32 else cp.ascontiguousarray(x)

    def to_float32(self, x: Any) -> Any:
        """``x`` as float32 for kernels that read it: bf16 bits widened in one pass, float32 kept
        (made contiguous; the callers only read it)."""
        if x.dtype == bf16:
            x = cp.ascontiguousarray(x)
            return activation.to_float32(x, cp.empty(x.shape, dtype=f32), self.stream)
        return cp.ascontiguousarray(x, dtype=f32)

    # ------------------------------------------------------------------------------- dense

    def embedding(self, weight: Any, ids: Any) -> Any:
        out = cp.empty((ids.shape[0], weight.shape[1]), dtype=f32)
        return embedding.embedding(weight, ids, out, self.stream)

    @staticmethod
    def _norm_arguments(x: Any, residual: Any, normed: bool = True) -> tuple[Any, Any, bool, Any]:
        """``(x, residual, add, out)`` of a residual norm: contiguous inputs (without a residual, a
        buffer for the sum), the bf16 output (None without ``normed``)."""
        x = cp.ascontiguousarray(x)
        add = residual is not None
        residual = cp.ascontiguousarray(residual) if add else cp.empty_like(x)
        return x, residual, add, cp.empty(x.shape, dtype=bf16) if normed else None

    def rmsnorm_residual(self, x: Any, residual: Any, weight: Any, eps: float, offset: float = 0.0) -> Any:
        x, residual, add, out = self._norm_arguments(x, residual)
        rmsnorm.rmsnorm_residual(x, residual, weight, eps, offset, add, out, self.stream)
        return out, residual

    def rmsnorm_residual_words(self, x: Any, residual: Any, weight: Any, eps: float, offset: float = 0.0) -> Any:
        """The CUDA C++ norm (float4 and uint2 loads, :mod:`metrale.ops.selection`)."""
        x, residual, add, out = self._norm_arguments(x, residual)
        rmsnorm.rmsnorm_residual_words(x, residual, weight, eps, offset, add, out, self.stream)
        return out, residual

    def layernorm_residual(self, x: Any, residual: Any, weight: Any, bias: Any, eps: float) -> Any:
        x = cp.ascontiguousarray(x, dtype=f32)
        add = residual is not None
        residual = cp.ascontiguousarray(residual, dtype=f32) if add else cp.empty_like(x)
        out = cp.empty(x.shape, dtype=bf16)
        layernorm.layernorm_residual(x, residual, weight, bias, eps, add, out, self.stream)
        return out, residual

    def layernorm(self, x: Any, weight: Any, bias: Any, eps: float) -> Any:
        return self.layernorm_residual(x, None, weight, bias, eps)[0]

    def gelu(self, x: Any, approximate: str = "none") -> Any:
        x = cp.ascontiguousarray(x, dtype=f32)
        return activation.gelu(x, _tanh_form(approximate), cp.empty(x.shape, dtype=bf16), self.stream)

    def gelu_and_mul(self, gate_up: Any, approximate: str = "none") -> Any:
        gate_up = cp.ascontiguousarray(gate_up, dtype=f32)
        out = cp.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=bf16)
        return activation.gelu_and_mul(gate_up, _tanh_form(approximate), out, self.stream)

    def linear(self, x: Any, weight: Any, bias: Any = None) -> Any:
        x = self.as_bf16(x)
        out = cp.empty((x.shape[0], weight.shape[0]), dtype=f32)
        self.gemm(x, weight, out)
        if bias is not None:
            out += bias
        return out

    def _invariant_arguments(self, x: Any, weight: Any, bias: Any) -> tuple[Any, Any, Any, Any]:
        """``(x, weight, bias, out)`` of a batch-invariant product: x as bf16 bits starting at a
        16-byte boundary (the kernels read 16 bytes at a time), the float32 output."""
        from metrale.kernels._words import aligned

        x = self.as_bf16(x)
        x = x if aligned(x) else x.copy()
        bias = None if bias is None else cp.ascontiguousarray(bias, dtype=f32)
        return x, cp.ascontiguousarray(weight), bias, cp.empty((x.shape[0], weight.shape[0]), dtype=f32)

    def invariant_linear(self, x: Any, weight: Any, bias: Any = None) -> Any:
        """The batch-invariant product's tiled kernel (:mod:`metrale.kernels.linear_invariant`):
        float32 out, each element summed in the decode GEMV's order; bound under
        ``batch_invariant=True`` for the rows the decode GEMV does not take."""
        x, weight, bias, out = self._invariant_arguments(x, weight, bias)
        multiprocessors = decode_gemv.multiprocessor_count()
        shape = linear_invariant.partial_shape(x.shape[0], weight.shape[0], multiprocessors)
        return linear_invariant.invariant_linear(x, weight, out, self.stream, bias, multiprocessors=multiprocessors,
                                                 partial=None if shape is None else cp.empty(shape, dtype=f32))

    def invariant_linear_decode_gemv(self, x: Any, weight: Any, bias: Any = None) -> Any:
        """Decode rows of the batch-invariant product: the decode GEMV's plain product with the
        split the tiled kernel follows (:func:`metrale.kernels.linear_invariant.split_of`)."""
        x, weight, bias, out = self._invariant_arguments(x, weight, bias)
        split = linear_invariant.split_of(weight.shape[0], decode_gemv.multiprocessor_count())
        return decode_gemv.decode_gemv(decode_gemv.PLAIN, x, weight, out, self.stream, bias=bias, split=split)

    # Products with a quantized weight (:mod:`metrale.kernels.quantized_gemv`), bound where
    # :func:`metrale.ops.selection.quantized_kernels` says.

    def quantized_linear_gemv(self, x: Any, weight: Any, bias: Any = None) -> Any:
        """Decode rows: the codes dequantized in registers, the input (float32 or bf16) quantized in
        the prologue."""
        rows = x.shape[0]
        out = cp.empty((rows, weight.shape[0]), dtype=f32)
        workspace = None
        multiprocessors = decode_gemv.multiprocessor_count()
        if not quantized_gemv.shared_stage(rows, weight, multiprocessors):
            staged_shape, scales_shape = quantized_gemv.workspace_shapes(rows, weight)
            workspace = (cp.empty(staged_shape, dtype=np.uint32), cp.empty(scales_shape, dtype=f32))
        # bf16 rows are read as they are (the kernel widens them), others as float32.
        rows_in = cp.ascontiguousarray(x) if x.dtype == bf16 else self.to_float32(x)
        return quantized_gemv.quantized_gemv(rows_in, weight, out, self.stream, bias=bias,
                                             multiprocessors=multiprocessors, workspace=workspace)

    def fp8_linear_gemv(self, x: Any, weight: Any, bias: Any = None) -> Any:
        """Decode rows of FP8 weights whose scales factor out of the sums (:mod:`metrale.kernels.fp8_gemv`):
        the codes multiplied as they are, the input (float32 or bf16) quantized in the prologue."""
        from metrale.kernels import fp8_gemv
        from metrale.kernels._words import aligned

        rows = x.shape[0]
        out = cp.empty((rows, weight.shape[0]), dtype=f32)
        workspace = None
        if not fp8_gemv.shared_stage(rows, weight):
            staged_shape, scales_shape = fp8_gemv.workspace_shapes(rows, weight)
            workspace = (cp.empty(staged_shape, dtype=np.uint32), cp.empty(scales_shape, dtype=f32))
        rows_in = cp.ascontiguousarray(x) if x.dtype == bf16 else self.to_float32(x)
        if not aligned(rows_in):  # a view into a larger array: the kernel reads 16 bytes at a time
            rows_in = rows_in.copy()
        return fp8_gemv.fp8_gemv(rows_in, weight, out, self.stream, bias=bias,
                                 multiprocessors=decode_gemv.multiprocessor_count(), workspace=workspace)

    def fp8_linear_silu_gemv(self, x: Any, weight: Any, bias: Any = None) -> Any:
        """``linear_silu`` of decode rows of an FP8 gate-and-up weight in one launch of
        :mod:`metrale.kernels.fp8_gemv`: each column tile holds a unit's gate and up rows, and the
        gate applies to the scaled sums before they go out (bf16)."""
        from metrale.kernels import fp8_gemv
        from metrale.kernels._words import aligned

        rows = x.shape[0]
        out = cp.empty((rows, weight.shape[0] // 2), dtype=bf16)
        workspace = None
        if not fp8_gemv.shared_stage(rows, weight):
            staged_shape, scales_shape = fp8_gemv.workspace_shapes(rows, weight)
            workspace = (cp.empty(staged_shape, dtype=np.uint32), cp.empty(scales_shape, dtype=f32))
        rows_in = cp.ascontiguousarray(x) if x.dtype == bf16 else self.to_float32(x)
        if not aligned(rows_in):
            rows_in = rows_in.copy()
        return fp8_gemv.fp8_gemv(rows_in, weight, out, self.stream, multiprocessors=decode_gemv.multiprocessor_count(),
                                 workspace=workspace, swiglu=True)

    def _fp8_norm_gemv(self, x: Any, residual: Any, norm_weight: Any, eps: float, offset: float, weight: Any,
                       bias: Any, swiglu: bool) -> tuple[Any, Any]:
        """One launch of :mod:`metrale.kernels.fp8_gemv` with ``rmsnorm_residual`` as its prologue:
        ``(out, summed)``."""
        from metrale.kernels import fp8_gemv
        from metrale.kernels._words import aligned

        # The prologue reads 16 bytes at a time: a view starting off that boundary is copied.
        x = cp.ascontiguousarray(x, dtype=f32)
        x = x if aligned(x) else x.copy()
        if residual is not None:
            residual = cp.ascontiguousarray(residual, dtype=f32)
            residual = residual if aligned(residual) else residual.copy()
        summed = cp.empty(x.shape, dtype=f32)
        rows, columns = x.shape[0], weight.shape[0]
        out = cp.empty((rows, columns // 2), dtype=bf16) if swiglu else cp.empty((rows, columns), dtype=f32)
        fp8_gemv.fp8_gemv(x, weight, out, self.stream, bias=bias, multiprocessors=decode_gemv.multiprocessor_count(),
                          swiglu=swiglu, residual=residual, norm_weight=cp.ascontiguousarray(norm_weight), eps=eps,
                          norm_offset=offset, summed=summed)
        return out, summed

    def fp8_rmsnorm_linear_gemv(self, x: Any, residual: Any, norm_weight: Any, eps: float, offset: float, weight: Any,
                                bias: Any = None) -> Any:
        """``rmsnorm_linear`` of decode rows of an FP8 weight in one launch: the norm in the FP8
        GEMV's prologue, before the rows' quantization."""
        return self._fp8_norm_gemv(x, residual, norm_weight, eps, offset, weight, bias, swiglu=False)

    def fp8_rmsnorm_mlp_gemv(self, x: Any, residual: Any, norm_weight: Any, eps: float, offset: float, gate_up: Any,
                             down: Any, gate_up_bias: Any = None, down_bias: Any = None) -> Any:
        """``rmsnorm_mlp`` of decode rows of FP8 weights in two launches: the norm in the gated
        gate/up GEMV's prologue, then the down GEMV reading its bf16 output."""
        act, summed = self._fp8_norm_gemv(x, residual, norm_weight, eps, offset, gate_up, None, swiglu=True)
        return self.fp8_linear_gemv(act, down, down_bias), summed

    def int4_linear_gemv(self, x: Any, weight: Any, bias: Any = None) -> Any:
        """Decode rows of 4-bit weight-only weights in groups of 128 columns or more
        (:mod:`metrale.kernels.int4_gemv`): the codes converted in registers, the input (float32 or
        bf16) staged as bf16 in the prologue."""
        from metrale.kernels import int4_gemv

        rows = x.shape[0]
        out = cp.empty((rows, weight.shape[0]), dtype=f32)
        workspace = None
        if not int4_gemv.shared_stage(rows, weight):
            workspace = cp.empty(int4_gemv.workspace_shape(rows, weight), dtype=np.uint32)
        rows_in = cp.ascontiguousarray(x) if x.dtype == bf16 else self.to_float32(x)
        return int4_gemv.int4_gemv(rows_in, weight, out, self.stream, bias=bias,
                                   multiprocessors=decode_gemv.multiprocessor_count(), workspace=workspace)

    def int4_linear_silu_gemv(self, x: Any, weight: Any, bias: Any = None) -> Any:
        """``linear_silu`` of decode rows of a 4-bit gate-and-up weight in one launch of
        :mod:`metrale.kernels.int4_gemv`: each column tile holds a unit's gate and up rows, and the
        gate applies to the sums before they go out (bf16)."""
        from metrale.kernels import int4_gemv

        rows = x.shape[0]
        out = cp.empty((rows, weight.shape[0] // 2), dtype=bf16)
        workspace = None
        if not int4_gemv.shared_stage(rows, weight):
            workspace = cp.empty(int4_gemv.workspace_shape(rows, weight), dtype=np.uint32)
        rows_in = cp.ascontiguousarray(x) if x.dtype == bf16 else self.to_float32(x)
        return int4_gemv.int4_gemv(rows_in, weight, out, self.stream, multiprocessors=decode_gemv.multiprocessor_count(),
                                   workspace=workspace, swiglu=True)

    def quantized_linear(self, x: Any, weight: Any, bias: Any = None) -> Any:
        """Prompt rows: FP8 inputs and weights whose scales factor out of the sums on FP8 tensor
        cores (cuBLASLt), the scales applied to the product's rows and columns; otherwise the input
        staged (gathered, quantized, bf16), the weight dequantized into a bf16 matrix, one cuBLAS
        product."""
        if quantized_gemv.fp8_tensor_core_path(weight):
            out = self._fp8_product(x, weight)
            if out is not None:
                return out if bias is None else out + bias
        rows, (columns, inner) = x.shape[0], weight.shape
        staged = cp.empty((rows, inner), dtype=bf16)
        quantized_gemv.stage_activations(self.to_float32(x), weight, staged, self.stream)
        dense = cp.empty((columns, inner), dtype=bf16)
        quantized_gemv.dequantize_bf16(weight, dense, self.stream)
        out = cp.empty((rows, columns), dtype=f32)
        self.gemm(staged, dense, out)
        if bias is not None:
            out += bias
        return out

    def fp8_gate_up_product(self, x: Any, weight: Any, bias: Any = None) -> Any:
        """The gate and up projections of prompt rows (``linear_silu`` before its gate) with FP8
        weights whose scales factor out: bf16 straight from the FP8 tensor-core product, the scales
        applied in its epilogue, where cuBLASLt has such an algorithm; the float32 product of
        :meth:`quantized_linear` otherwise."""
        if bias is None:
            out = self._fp8_product(x, weight, bf16_out=True)
            if out is not None:
                return out
        return self.quantized_linear(x, weight, bias)

    def _fp8_product(self, x: Any, weight: Any, bf16_out: bool = False) -> Any:
        """``quantize(x) W^T`` on FP8 tensor cores: the rows' codes and scales, then the codes'
        product (cuBLASLt), float32, each row times its input scale and each column its weight scale
        in one pass after; or (``bf16_out``) bf16 with the scales applied in the product's epilogue
        (cuBLASLt's outer-vector scales, which it serves for bf16 outputs), the float32 product where
        it has no such algorithm. None where it has no FP8 algorithm for the shape at all (the
        caller takes the bf16 product)."""
        rows, inner = x.shape[0], weight.shape[1]
        padded = self._fp8_rows_planned(rows, weight, bf16_out)
        if padded is None:
            return None
        codes, scales = self._fp8_codes_buffers(rows, padded, inner)
        rows_in = cp.ascontiguousarray(x) if x.dtype == bf16 else self.to_float32(x)
        quantized_gemv.quantize_rows_fp8(rows_in, weight, codes[:rows], scales[:rows], self.stream)
        return self._fp8_codes_product(codes, scales, rows, weight, bf16_out)

    def fp8_silu_product(self, gate_up: Any, weight: Any, bias: Any = None) -> Any:
        """``linear(silu_and_mul(gate_up), weight, bias)`` of a bf16 gate/up product's prompt rows
        and FP8 weights whose scales factor out: the activation's FP8 codes and scales written in one
        pass over ``gate_up`` (:func:`~metrale.kernels.quantized_gemv.silu_and_mul_fp8_rows`, no
        bf16 activation in between), then the codes' product as :meth:`quantized_linear` takes it.
        None where that pass does not serve them (nothing launched) or cuBLASLt has no FP8 algorithm
        for the shape (the caller takes the unfused ops)."""
        rows = gate_up.shape[0]
        if not quantized_gemv.serves_silu_fp8_rows(gate_up, weight):
            return None
        padded = self._fp8_rows_planned(rows, weight, False)
        if padded is None:
            return None
        codes, scales = self._fp8_codes_buffers(rows, padded, weight.shape[1])
        quantized_gemv.silu_and_mul_fp8_rows(gate_up, weight, codes[:rows], scales[:rows], self.stream)
        out = self._fp8_codes_product(codes, scales, rows, weight, False)
        if out is None or bias is None:
            return out
        return out + bias

    def fp8_norm_product(self, x: Any, residual: Any, norm_weight: Any, eps: float, offset: float, weight: Any,
                         bf16_out: bool = False) -> tuple[Any, Any] | None:
        """``(product, summed)`` of ``linear(rmsnorm(s), weight)`` with ``s = x + residual`` (``x`` with
        ``residual`` None) for prompt rows and FP8 weights whose scales factor out: the norm written
        straight as the product's FP8 input rows (:func:`~metrale.kernels.quantized_gemv.rmsnorm_fp8_rows`,
        no bf16 normed rows in between), then the codes' product as :meth:`_fp8_product` takes it
        (``bf16_out`` as there). ``product`` is None where cuBLASLt turned out to have no FP8 algorithm
        for the shape (``summed`` holds the sum: the caller norms it again without a residual and takes
        the unfused ops). None where the fused kernel does not serve them (nothing launched)."""
        x = cp.ascontiguousarray(x)
        if not quantized_gemv.serves_rmsnorm_fp8_rows(x, norm_weight, weight):
            return None
        rows = x.shape[0]
        padded = self._fp8_rows_planned(rows, weight, bf16_out)
        if padded is None:
            return None
        x, summed, add, _ = self._norm_arguments(x, residual, normed=False)
        codes, scales = self._fp8_codes_buffers(rows, padded, weight.shape[1])
        quantized_gemv.rmsnorm_fp8_rows(x, summed, norm_weight, eps, offset, add, weight, codes[:rows], scales[:rows],
                                        self.stream)
        return self._fp8_codes_product(codes, scales, rows, weight, bf16_out), summed

    def _fp8_rows_planned(self, rows: int, weight: Any, bf16_out: bool) -> int | None:
        """The rows an FP8 product of ``rows`` rows takes (padded to a multiple of 16 where
        cuBLASLt has an epilogue-scaled algorithm only for such counts, once known only as many as
        it takes), or None where cuBLASLt has no FP8 algorithm for the shape (known from an earlier
        call)."""
        columns, inner = weight.shape
        key = (rows, inner, columns)
        if key in self._fp8_unserved:
            return None
        known = self._fp8_epilogue_rows.get(key)
        epilogue = bf16_out and self._fp8_epilogue_rows.get(key, 0) is not None
        return (known or -(-rows // 16) * 16) if epilogue else rows

    @staticmethod
    def _fp8_codes_buffers(rows: int, padded: int, inner: int) -> tuple[Any, Any]:
        """Codes ``[padded, inner]`` and scales ``[padded]`` of FP8 input rows, the padding's scales
        zero (their outputs are dropped)."""
        codes, scales = cp.empty((padded, inner), dtype=np.uint8), cp.empty((padded,), dtype=f32)
        if padded > rows:
            scales[rows:] = 0
        return codes, scales

    def _fp8_codes_product(self, codes: Any, scales: Any, rows: int, weight: Any, bf16_out: bool) -> Any:
        """The product of ``rows`` rows of FP8 codes and their scales (``codes``/``scales`` padded as
        :meth:`_fp8_rows_planned` planned) with ``weight``, as :meth:`_fp8_product` describes."""
        from metrale.errors import KernelArgumentError
        from metrale.kernels.linear import CublasLtGemm

        columns, inner = weight.shape
        key = (rows, inner, columns)
        if self._fp8_gemm is None:
            self._fp8_gemm = CublasLtGemm(self.stream)
        padded = codes.shape[0]
        known = self._fp8_epilogue_rows.get(key)
        column_scales = weight.scales[:, 0]
        if weight.block[0] > 1:  # a scale per block of rows (per tensor: one block)
            column_scales = cp.repeat(column_scales, weight.block[0])[:columns]
        column_scales = cp.ascontiguousarray(column_scales)
        if bf16_out and self._fp8_epilogue_rows.get(key, 0) is not None:
            for served in [known] if known else list(dict.fromkeys((rows, padded))):
                try:
                    product = self._fp8_gemm.fp8(codes[:served], weight.codes,
                                                 cp.empty((served, columns), dtype=bf16),
                                                 row_scales=scales[:served], column_scales=column_scales)
                except KernelArgumentError:  # no algorithm with the scales in the epilogue for these rows
                    continue
                self._fp8_epilogue_rows[key] = served
                return product[:rows]
            self._fp8_epilogue_rows[key] = None  # scaled after the product
        codes, scales = codes[:rows], scales[:rows]
        out = cp.empty((rows, columns), dtype=f32)
        try:
            self._fp8_gemm.fp8(codes, weight.codes, out)
        except KernelArgumentError:  # no FP8 algorithm for the shape: it takes the bf16 product
            self._fp8_unserved.add(key)
            return None
        return quantized_gemv.scale_product(out, scales, column_scales, self.stream)

    def fp8_moe_experts_decode(self, x: Any, experts: Any, weights: Any, gate_up: Any, down: Any) -> Any:
        """Decode tokens over FP8 stacks: the FP8 decode GEMV a routed pair a grid row (only the
        chosen experts' codes read, multiplied as they are), then each token's pairs summed."""
        from metrale.kernels import fp8_gemv
        from metrale.kernels._words import aligned

        tokens, top_k = experts.shape
        act = cp.empty((tokens * top_k, down.shape[1]), dtype=bf16)
        partial = cp.empty((tokens * top_k, x.shape[1]), dtype=f32)
        out = cp.empty((tokens, x.shape[1]), dtype=f32)
        # bf16 rows (a norm's output) are read as they are, others as float32.
        rows = cp.ascontiguousarray(x) if x.dtype == bf16 else cp.ascontiguousarray(self.to_float32(x))
        if not aligned(rows):  # a view into a larger array: the kernel reads 16 bytes at a time
            rows = rows.copy()
        return fp8_gemv.fp8_decode_experts(
            rows, cp.ascontiguousarray(experts, dtype=np.int32), cp.ascontiguousarray(weights, dtype=f32), gate_up,
            down, act, partial, out, self.stream, multiprocessors=decode_gemv.multiprocessor_count())

    def quantized_moe_experts_decode(self, x: Any, experts: Any, weights: Any, gate_up: Any, down: Any) -> Any:
        """Decode tokens: only the chosen experts' codes read, dequantized in registers."""
        tokens, top_k = experts.shape
        act = cp.empty((tokens * top_k, down.shape[1]), dtype=bf16)
        out = cp.empty((tokens, x.shape[1]), dtype=f32)
        return quantized_moe_decode.quantized_decode_experts(
            self.to_float32(x), cp.ascontiguousarray(experts, dtype=np.int32), cp.ascontiguousarray(weights, dtype=f32),
            gate_up, down, act, out, self.stream)

    def quantized_moe_experts(self, x: Any, experts: Any, weights: Any, gate_up: Any, down: Any) -> Any:
        """Routed experts over quantized stacked weights: each stack dequantized into bf16 (in its
        original column order), the tokens quantized as the gate/up weights' scheme says, then the
        bf16 kernels pair by pair. The down projections' inputs stay bf16: the kernels compute
        them between their two products."""
        from dataclasses import replace

        if gate_up.activations != "weight_only":
            staged = cp.empty(x.shape, dtype=bf16)
            x = quantized_gemv.stage_activations(self.to_float32(x), replace(gate_up, input_order=None), staged,
                                                 self.stream)
        return self.moe_experts(x, experts, weights, self._dequantized(gate_up), self._dequantized(down))

    def _dequantized(self, weight: Any) -> Any:
        """bf16 bits ``[out, in]``: the quantized weight's matrix, its columns in their original order."""
        dense = cp.empty(weight.shape, dtype=bf16)
        quantized_gemv.dequantize_bf16(weight, dense, self.stream)
        if weight.input_order is None:
            return dense
        restored = cp.empty_like(dense)
        restored[:, weight.input_order] = dense
        return restored

    def gate_up_product(self, x: Any, weight: Any, bias: Any = None) -> Any:
        """The product of ``linear_silu`` before its gate (:mod:`metrale.ops.selection`): bf16 (what a
        bf16 model's gate and up projections give: half the bytes of float32 to write and to read
        back), float32 with a bias added."""
        x = self.as_bf16(x)
        gate_up = cp.empty((x.shape[0], weight.shape[0]), dtype=f32 if bias is not None else bf16)
        self.gemm(x, weight, gate_up)
        if bias is not None:
            gate_up += bias
        return gate_up

    # The decode GEMV kernels, bound where :func:`metrale.ops.builtin.default_decode_kernels` says;
    # :func:`metrale.ops.builtin.decode_gemv_kernels` offers them all to a registry.

    def linear_decode_gemv(self, x: Any, weight: Any, bias: Any = None) -> Any:
        out = cp.empty((x.shape[0], weight.shape[0]), dtype=f32)
        return decode_gemv.decode_gemv(decode_gemv.PLAIN, self.as_bf16(x), weight, out, self.stream, bias=bias)

    def linear_decode_gemv_f32(self, x: Any, weight: Any, bias: Any = None) -> Any:
        """Float32 rows rounded to bf16 while the kernel stages them: no to_bf16 kernel before it."""
        out = cp.empty((x.shape[0], weight.shape[0]), dtype=f32)
        return decode_gemv.decode_gemv(decode_gemv.PLAIN_F32, x, weight, out, self.stream, bias=bias)

    def linear_silu_decode_gemv(self, x: Any, weight: Any, bias: Any = None) -> Any:
        out = cp.empty((x.shape[0], weight.shape[0] // 2), dtype=bf16)
        return decode_gemv.decode_gemv(decode_gemv.PLAIN_SWIGLU, self.as_bf16(x), weight, out, self.stream)

    def rmsnorm_linear_decode_gemv(self, x: Any, residual: Any, norm_weight: Any, eps: float, offset: float,
                                   weight: Any, bias: Any = None) -> Any:
        x = cp.ascontiguousarray(x, dtype=f32)
        summed = cp.empty(x.shape, dtype=f32)
        out = cp.empty((x.shape[0], weight.shape[0]), dtype=f32)
        decode_gemv.decode_gemv(
            decode_gemv.RMSNORM, x, weight, out, self.stream, norm_weight=norm_weight, eps=eps, norm_offset=offset,
            residual=None if residual is None else cp.ascontiguousarray(residual, dtype=f32), summed=summed, bias=bias)
        return out, summed

    @staticmethod
    def _fused_mlp_arguments(x: Any, residual: Any, down: Any) -> tuple[Any, Any, Any, Any]:
        """``(x, residual, summed, out)`` of a fused decode MLP."""
        x = cp.ascontiguousarray(x, dtype=f32)
        residual = None if residual is None else cp.ascontiguousarray(residual, dtype=f32)
        return x, residual, cp.empty(x.shape, dtype=f32), cp.empty((x.shape[0], down.shape[0]), dtype=f32)

    def rmsnorm_mlp_decode_gemv_epilogue(self, x: Any, residual: Any, norm_weight: Any, eps: float, offset: float,
                                         gate_up: Any, down: Any, gate_up_bias: Any = None, down_bias: Any = None) -> Any:
        """The gate applied in the gate/up kernel's epilogue; the down kernel reads the result
        (:func:`metrale.ops.selection.decode_gemv_kernels` with ``swiglu_epilogue``)."""
        x, residual, summed, out = self._fused_mlp_arguments(x, residual, down)
        act = cp.empty((x.shape[0], gate_up.shape[0] // 2), dtype=bf16)
        decode_gemv.decode_gemv(decode_gemv.RMSNORM_SWIGLU, x, gate_up, act, self.stream, norm_weight=norm_weight,
                                eps=eps, norm_offset=offset, residual=residual, summed=summed)
        decode_gemv.decode_gemv(decode_gemv.PLAIN, act, down, out, self.stream, bias=down_bias)
        return out, summed

    def rmsnorm_mlp_decode_gemv(self, x: Any, residual: Any, norm_weight: Any, eps: float, offset: float, gate_up: Any,
                                down: Any, gate_up_bias: Any = None, down_bias: Any = None) -> Any:
        x, residual, summed, out = self._fused_mlp_arguments(x, residual, down)
        # The gate and up rows as bf16 (what the unfused path's product writes), read by the
        # down kernel's SiLU prologue.
        gated = cp.empty((x.shape[0], gate_up.shape[0]), dtype=bf16)
        decode_gemv.decode_gemv(
            decode_gemv.RMSNORM, x, gate_up, gated, self.stream, norm_weight=norm_weight, eps=eps, norm_offset=offset,
            residual=residual, summed=summed)
        decode_gemv.decode_gemv(decode_gemv.SILU, gated, down, out, self.stream, bias=down_bias)
        return out, summed

    def silu_and_mul(self, gate_up: Any) -> Any:
        out = cp.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=bf16)
        return activation.silu_and_mul(gate_up, out, self.stream)

    def silu_and_mul_bits(self, gate_up: Any) -> Any:
        """The numba gate of a bf16 product."""
        out = cp.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=bf16)
        return activation.silu_and_mul_bits(gate_up, out, self.stream)

    def silu_and_mul_words(self, gate_up: Any) -> Any:
        """The CUDA C++ gate of a bf16 product (linear_silu past the decode GEMV's rows), launched
        dependently."""
        out = cp.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=bf16)
        return activation.silu_and_mul_words(gate_up, out, self.stream)

    def qkv_rope_cache(self, qkv: Any, positions: Any, slot_mapping: Any, inv_freq: Any, attention_factor: float,
                       num_heads: int, num_kv_heads: int, head_dim: int, k_cache: Any, v_cache: Any, q_norm: Any = None,
                       k_norm: Any = None, eps: float = 1e-6, norm_offset: float = 0.0, interleaved: bool = False,
                       rotary_dim: int | None = None) -> Any:
        q = cp.empty((qkv.shape[0], num_heads, head_dim), dtype=f32)
        return qkv_rope.qkv_rope_cache_words(
            qkv, positions, slot_mapping, inv_freq, attention_factor, num_heads, num_kv_heads, head_dim,
            k_cache, v_cache, q, q_norm, k_norm, eps, norm_offset, interleaved, self.stream, rotary_dim=rotary_dim,
        )

    def qkv_rope_cache_fp8(self, qkv: Any, positions: Any, slot_mapping: Any, inv_freq: Any, attention_factor: float,
                           num_heads: int, num_kv_heads: int, head_dim: int, k_cache: Any, v_cache: Any,
                           q_norm: Any = None, k_norm: Any = None, eps: float = 1e-6, norm_offset: float = 0.0,
                           interleaved: bool = False, rotary_dim: int | None = None) -> Any:
        """Into an FP8 cache: the rotated keys and the values rounded to bf16 and quantized into the
        cache's slots by the same kernel."""
        q = cp.empty((qkv.shape[0], num_heads, head_dim), dtype=f32)
        return qkv_rope.qkv_rope_cache_fp8_words(
            qkv, positions, slot_mapping, inv_freq, attention_factor, num_heads, num_kv_heads, head_dim, k_cache,
            v_cache, q, q_norm, k_norm, eps, norm_offset, interleaved, self.stream, rotary_dim=rotary_dim,
        )

    def qkv_rope_cache_fp8_rows(self, qkv: Any, positions: Any, slot_mapping: Any, inv_freq: Any,
                                attention_factor: float, num_heads: int, num_kv_heads: int, head_dim: int, k_cache: Any,
                                v_cache: Any, q_norm: Any = None, k_norm: Any = None, eps: float = 1e-6,
                                norm_offset: float = 0.0, interleaved: bool = False,
                                rotary_dim: int | None = None) -> Any:
        """Into an FP8 cache of any head size: the rotated keys and the values written by the bf16
        kernel into rows of their own (a slot per row), then quantized into the cache's slots."""
        rows = qkv.shape[0]
        q = cp.empty((rows, num_heads, head_dim), dtype=f32)
        keys = cp.empty((rows, 1, num_kv_heads, head_dim), dtype=bf16)
        values = cp.empty((rows, 1, num_kv_heads, head_dim), dtype=bf16)
        qkv_rope.qkv_rope_cache_words(
            qkv, positions, cp.arange(rows, dtype=np.int32), inv_freq, attention_factor, num_heads, num_kv_heads,
            head_dim, keys, values, q, q_norm, k_norm, eps, norm_offset, interleaved, self.stream, rotary_dim=rotary_dim,
        )
        attention_fp8.write_fp8_rows(keys.reshape(rows, num_kv_heads, head_dim), slot_mapping, k_cache, self.stream)
        attention_fp8.write_fp8_rows(values.reshape(rows, num_kv_heads, head_dim), slot_mapping, v_cache, self.stream)
        return q

    def paged_attention_decode_fp8(self, q: Any, k_cache: Any, v_cache: Any, batch: Any, scale: float,
                                   sliding_window: int | None, out: Any, first_row: int, softcap: float | None = None,
                                   sinks: Any = None) -> Any:
        """The per-head split kernel over an FP8 cache (:mod:`metrale.kernels.attention_fp8`)."""
        rows, heads = q.shape[0], q.shape[1]
        seq_index, positions = self._decode_rows(batch, first_row, rows)
        splits = attention.attention_splits(batch.max_context)
        return attention_fp8.decode_attention(
            cp.ascontiguousarray(q, dtype=f32), k_cache, v_cache, batch.block_tables, seq_index, positions, scale,
            sliding_window, batch.max_context, self._workspace(rows, heads, splits, v_cache.codes.shape[3]), out,
            self.stream, softcap, None if sinks is None else cp.ascontiguousarray(sinks, dtype=f32))

    # ----------------------------------------------------------------------- paged attention
    # The kernels of paged_attention_decode (rows first_row .. first_row + R of the batch, each a
    # row of its own) and paged_attention_prompt (the segments from first_segment on), each writing
    # its rows of ``out``; metrale.ops.selection splits a step's rows between the two.

    @staticmethod
    def _decode_rows(batch: Any, first_row: int, rows: int) -> tuple[Any, Any]:
        """The sequence index and position of the batch's rows ``first_row .. first_row + rows``."""
        first_row = int(first_row)
        return batch.seq_index[first_row:first_row + rows], batch.positions[first_row:first_row + rows]

    @staticmethod
    def _workspace(rows: int, heads: int, splits: int, value_dim: int) -> tuple[Any, Any, Any]:
        """The split-K partials ``(acc [R, nh, splits, dv], max, sum [R, nh, splits])``."""
        return (cp.empty((rows, heads, splits, value_dim), dtype=f32), cp.empty((rows, heads, splits), dtype=f32),
                cp.empty((rows, heads, splits), dtype=f32))

    def _merge_counters(self, count: int) -> Any:
        """At least ``count`` int32 counters, zero between launches, for the decode attention's
        in-kernel merge. From the default pool, never freed: graphs keep their address (the graph
        pool would hand memory a finished capture freed to later allocations while its graph still
        writes it)."""
        for counters in self._attention_counters:
            if counters.size >= count:
                return counters
        with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
            counters = cp.zeros(max(count, 1024), dtype=np.int32)
        self._attention_counters.append(counters)
        return counters

    def paged_attention_decode_mma(self, q: Any, k_cache: Any, v_cache: Any, batch: Any, scale: float,
                                   sliding_window: int | None, out: Any, first_row: int, softcap: float | None = None,
                                   sinks: Any = None, merged: bool = False) -> Any:
        """The tensor-core decode kernel; with ``merged``, the last split of each row and head block
        merges the splits (:func:`metrale.ops.selection.merged_decode_attention_kernels`). The caches
        are bf16 or :class:`~metrale.kernels.kv_cache_fp8.Fp8CacheArray` s."""
        from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

        rows, heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        splits = attention_decode_mma.device_split_count(rows, heads, kv_heads, head_dim, batch.max_context,
                                                         isinstance(k_cache, Fp8CacheArray))
        seq_index, positions = self._decode_rows(batch, first_row, rows)
        counters = self._merge_counters(attention_decode_mma.counter_count(rows, heads, kv_heads)) if merged else None
        return attention_decode_mma.decode_attention(
            q, k_cache, v_cache, batch.block_tables, seq_index, positions, scale, sliding_window,
            self._workspace(rows, heads, splits, v_cache.shape[3]), out, self.stream, counters, softcap,
            None if sinks is None else cp.ascontiguousarray(sinks, dtype=f32))

    def paged_attention_decode_mma_merged(self, q: Any, k_cache: Any, v_cache: Any, batch: Any, scale: float,
                                          sliding_window: int | None, out: Any, first_row: int,
                                          softcap: float | None = None, sinks: Any = None) -> Any:
        return self.paged_attention_decode_mma(q, k_cache, v_cache, batch, scale, sliding_window, out, first_row,
                                               softcap, sinks, merged=True)

    def paged_attention_decode_grouped(self, q: Any, k_cache: Any, v_cache: Any, batch: Any, scale: float,
                                       sliding_window: int | None, out: Any, first_row: int,
                                       softcap: float | None = None, sinks: Any = None) -> Any:
        rows, heads = q.shape[0], q.shape[1]
        splits = attention_grouped.split_count(rows, heads, k_cache.shape[2], batch.max_context)
        seq_index, positions = self._decode_rows(batch, first_row, rows)
        return attention_grouped.decode_attention(
            q, k_cache, v_cache, batch.block_tables, seq_index, positions, scale, sliding_window, batch.max_context,
            self._workspace(rows, heads, splits, v_cache.shape[3]), out, self.stream)

    def paged_attention_decode_staged(self, q: Any, k_cache: Any, v_cache: Any, batch: Any, scale: float,
                                      sliding_window: int | None, out: Any, first_row: int,
                                      softcap: float | None = None, sinks: Any = None) -> Any:
        rows, heads = q.shape[0], q.shape[1]
        splits = attention_grouped.split_count(rows, heads, k_cache.shape[2], batch.max_context)
        seq_index, positions = self._decode_rows(batch, first_row, rows)
        return attention_staged.decode_attention(
            q, k_cache, v_cache, batch.block_tables, seq_index, positions, scale, sliding_window, batch.max_context,
            self._workspace(rows, heads, splits, v_cache.shape[3]), out, self.stream)

    def paged_attention_decode_split(self, q: Any, k_cache: Any, v_cache: Any, batch: Any, scale: float,
                                     sliding_window: int | None, out: Any, first_row: int,
                                     softcap: float | None = None, sinks: Any = None) -> Any:
        """The per-head CUDA-core kernels: any geometry, softcap and sinks."""
        rows, heads = q.shape[0], q.shape[1]
        seq_index, positions = self._decode_rows(batch, first_row, rows)
        splits = attention.attention_splits(batch.max_context)
        return attention.decode_attention(
            q, k_cache, v_cache, batch.block_tables, seq_index, positions, scale, sliding_window, batch.max_context,
            self._workspace(rows, heads, splits, v_cache.shape[3]), out, self.stream, softcap,
            None if sinks is None else cp.ascontiguousarray(sinks, dtype=f32))

    def paged_attention_prompt_mma(self, q: Any, k_cache: Any, v_cache: Any, batch: Any, scale: float,
                                   sliding_window: int | None, out: Any, first_segment: int,
                                   softcap: float | None = None, sinks: Any = None) -> Any:
        starts = batch.row_starts
        tiles = _batch_constant(batch, f"attention_mma_tiles_{first_segment}",
                                lambda: attention_mma.query_tiles(starts[first_segment:]))
        return attention_mma.prefill_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_index,
                                               batch.positions, tiles, scale, sliding_window, out, self.stream, softcap,
                                               None if sinks is None else cp.ascontiguousarray(sinks, dtype=f32))

    def paged_attention_decode_rows_mma(self, q: Any, k_cache: Any, v_cache: Any, batch: Any, scale: float,
                                        sliding_window: int | None, out: Any, rows: int,
                                        softcap: float | None = None, sinks: Any = None) -> Any:
        """The first ``rows`` rows (one-row segments: decode rows) through
        :func:`metrale.kernels.attention_mma.decode_rows_attention`, each row's query heads of a KV
        head together, every row computed as the prompt form computes it."""
        tiles = _batch_constant(batch, f"attention_mma_decode_rows_{rows}", lambda: attention_mma.decode_rows(rows))
        return attention_mma.decode_rows_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_index,
                                                   batch.positions, tiles, scale, sliding_window, out, self.stream,
                                                   softcap, None if sinks is None else cp.ascontiguousarray(sinks, dtype=f32))

    def paged_attention_prompt_wgmma(self, q: Any, k_cache: Any, v_cache: Any, batch: Any, scale: float,
                                     sliding_window: int | None, out: Any, first_segment: int,
                                     softcap: float | None = None, sinks: Any = None) -> Any:
        """The Hopper prompt attention (:mod:`metrale.kernels.attention_hopper`): tiles of its blocks'
        rows at these head sizes (128 or 192)."""
        from metrale.kernels import attention_hopper

        starts = batch.row_starts
        head_dim, value_dim = q.shape[2], v_cache.shape[3]
        tiles = _batch_constant(batch, f"attention_hopper_tiles_{first_segment}_{head_dim}_{value_dim}",
                                lambda: attention_hopper.query_tiles(starts[first_segment:], head_dim, value_dim))
        return attention_hopper.prefill_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_index,
                                                  batch.positions, tiles, scale, sliding_window, out, self.stream,
                                                  softcap, None if sinks is None else cp.ascontiguousarray(sinks, dtype=f32))

    def paged_attention_prompt_prefill(self, q: Any, k_cache: Any, v_cache: Any, batch: Any, scale: float,
                                       sliding_window: int | None, out: Any, first_segment: int,
                                       softcap: float | None = None, sinks: Any = None) -> Any:
        starts = batch.row_starts
        per_tile = attention_prefill.rows_per_tile(q.shape[1], k_cache.shape[2])
        tiles = _batch_constant(batch, f"attention_prefill_tiles_{per_tile}_{first_segment}",
                                lambda: attention_prefill.query_tiles(starts[first_segment:], per_tile))
        return attention_prefill.paged_attention_prefill(
            q, attention_prefill.as_words(k_cache), attention_prefill.as_words(v_cache), batch.block_tables,
            batch.seq_index, batch.positions, tiles, scale, sliding_window, out, self.stream, softcap,
            None if sinks is None else cp.ascontiguousarray(sinks, dtype=f32))

    # --------------------------------------------------------------------------------- MLA

    def latent_attention(self, q: Any, latent: Any, batch: Any, value_dim: int, scale: float) -> Any:
        out = cp.empty((q.shape[0], q.shape[1] * value_dim), dtype=bf16)
        return attention_latent.latent_attention(
            cp.ascontiguousarray(q, dtype=f32), latent, batch.block_tables, batch.seq_index, batch.positions,
            value_dim, scale, batch.max_context, out, self.stream,
        )

    def latent_attention_mma(self, q: Any, latent: Any, batch: Any, value_dim: int, scale: float) -> Any:
        """DeepSeek's geometry (heads in 16s, rows of 576, values of 512) on tensor cores."""
        out = cp.empty((q.shape[0], q.shape[1] * value_dim), dtype=bf16)
        return attention_latent_mma.latent_attention(
            cp.ascontiguousarray(q, dtype=f32), latent, batch.block_tables, batch.seq_index, batch.positions,
            value_dim, scale, batch.max_context, out, self.stream,
        )

    def latent_cache_write(self, kv_a: Any, norm_weight: Any, eps: float, positions: Any, inv_freq: Any,
                           attention_factor: float, interleaved: bool, slot_mapping: Any, latent: Any) -> None:
        if kv_a.dtype != f32 or kv_a.strides[-1] != kv_a.itemsize:
            kv_a = cp.ascontiguousarray(kv_a, dtype=f32)
        # A view of the stacked projection's rows: the kernel takes their stride, no copy.
        attention_latent.latent_cache_write_words(kv_a, norm_weight, eps, positions, inv_freq, attention_factor,
                                                  interleaved, slot_mapping, latent, self.stream)

    def latent_cache_write_fp8(self, kv_a: Any, norm_weight: Any, eps: float, positions: Any, inv_freq: Any,
                               attention_factor: float, interleaved: bool, slot_mapping: Any, latent: Any) -> None:
        """Into an FP8 latent cache: the rows written by the bf16 kernel into rows of their own (a
        slot per row), then quantized into the cache's slots (a scale a row)."""
        from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

        rows, width = kv_a.shape[0], latent.shape[2]
        staged = cp.empty((rows, 1, width), dtype=bf16)
        self.latent_cache_write(kv_a, norm_weight, eps, positions, inv_freq, attention_factor, interleaved,
                                cp.arange(rows, dtype=np.int32), staged)
        blocks, block_size = latent.shape[:2]
        as_one_head = Fp8CacheArray(latent.codes.reshape(blocks, block_size, 1, width),
                                    latent.scales.reshape(blocks, block_size, 1), latent.static_scale)
        attention_fp8.write_fp8_rows(staged.reshape(rows, 1, width), slot_mapping, as_one_head, self.stream)

    @staticmethod
    def _per_head_out(x: Any, weight: Any) -> Any:
        rows, heads = x.shape[0], x.shape[1]
        return cp.empty((rows, heads, weight.shape[0] // heads), dtype=f32)

    def head_linear(self, x: Any, weight: Any) -> Any:
        return head_linear_kernels.head_linear(self.as_bf16(x), weight, self._per_head_out(x, weight), self.stream)

    def head_linear_words(self, x: Any, weight: Any) -> Any:
        """A float32 input (a strided view of the queries) read and rounded in the kernel."""
        return head_linear_kernels.head_linear_words(x, weight, self._per_head_out(x, weight), self.stream)

    def head_linear_per_head(self, x: Any, weight: Any) -> Any:
        """One cuBLAS product per head, the rows together."""
        out = self._per_head_out(x, weight)
        x = self.to_bf16(x) if x.dtype == f32 else x
        if x.strides[2] != x.itemsize:
            x = cp.ascontiguousarray(x)
        return self.gemm.per_head(x, weight, out)

    # --------------------------------------------------------------------------------- MoE

    def moe_route(self, x: Any, gate: Any, bias: Any, method: str, n_group: int, topk_group: int, top_k: int,
                  renormalise: bool, scaling: float) -> Any:
        logits = cp.empty((x.shape[0], gate.shape[0]), dtype=f32)
        moe.router_logits(self.as_bf16(x), gate, logits, self.stream)
        return self._route(logits, bias, method, n_group, topk_group, top_k, renormalise, scaling)

    def moe_route_gemm(self, x: Any, gate: Any, bias: Any, method: str, n_group: int, topk_group: int, top_k: int,
                       renormalise: bool, scaling: float) -> Any:
        """A prompt's router product as one float32 cuBLAS product, then the choice of experts."""
        logits = cp.empty((x.shape[0], gate.shape[0]), dtype=f32)
        self.gemm(self.to_float32(self.as_bf16(x)), gate, logits)
        return self._route(logits, bias, method, n_group, topk_group, top_k, renormalise, scaling)

    def _route(self, logits: Any, bias: Any, method: str, n_group: int, topk_group: int, top_k: int,
               renormalise: bool, scaling: float) -> Any:
        chosen = cp.empty((logits.shape[0], top_k), dtype=np.int32)
        weights = cp.empty((logits.shape[0], top_k), dtype=f32)
        return moe.route(logits, bias, method, n_group, topk_group, top_k, renormalise, scaling, chosen, weights,
                         self.stream)

    def moe_route_decode(self, x: Any, gate: Any, bias: Any, method: str, n_group: int, topk_group: int, top_k: int,
                         renormalise: bool, scaling: float) -> Any:
        """The decode router kernel (:func:`metrale.ops.builtin.moe_route_decode_kernels`)."""
        if self._route_counter is None:
            # Made once, outside any graph (the capture of a step follows its eager run), and
            # never freed: graphs keep its address.
            self._route_counter = cp.zeros(1, dtype=np.int32)
        x = self.as_bf16(x)
        tokens, experts = x.shape[0], gate.shape[0]
        chosen = cp.empty((tokens, top_k), dtype=np.int32)
        weights = cp.empty((tokens, top_k), dtype=f32)
        return moe_route_decode.route_decode(
            x, gate, None if bias is None else cp.ascontiguousarray(bias, dtype=f32), method, n_group, topk_group, top_k,
            renormalise, scaling, cp.empty((tokens, experts), dtype=f32), self._route_counter, chosen, weights,
            self.stream)

    def moe_experts_decode(self, x: Any, experts: Any, weights: Any, gate_up: Any, down: Any) -> Any:
        """The decode MoE kernels (:func:`metrale.ops.builtin.moe_decode_kernels`)."""
        x = self.as_bf16(x)
        tokens, top_k, inter = x.shape[0], experts.shape[1], down.shape[1]
        act = cp.empty((tokens * top_k, inter), dtype=bf16)
        out = cp.empty((tokens, x.shape[1]), dtype=f32)
        return moe_decode.decode_experts(x, cp.ascontiguousarray(experts, dtype=np.int32),
                                         cp.ascontiguousarray(weights, dtype=f32), gate_up, down, act, out, self.stream)

    def moe_experts(self, x: Any, experts: Any, weights: Any, gate_up: Any, down: Any) -> Any:
        """Pair by pair: an expert's weights read once per (token, expert) pair."""
        x = self.as_bf16(x)
        tokens, hidden = x.shape
        top_k, inter = experts.shape[1], down.shape[1]
        out = cp.empty((tokens, hidden), dtype=f32)
        act = cp.empty((tokens * top_k, inter), dtype=bf16)
        return moe.experts(x, experts, weights, gate_up, down, act, out, self.stream)

    def moe_experts_grouped(self, x: Any, experts: Any, weights: Any, gate_up: Any, down: Any) -> Any:
        """Each expert's pairs as one tensor-core product, four launches whatever the routing, no
        host synchronisation: every chosen expert's weights read once."""
        return self._grouped_experts(x, experts, weights, gate_up, down)

    def _grouped_experts(self, x: Any, experts: Any, weights: Any, gate_up: Any, down: Any, **epilogue: Any) -> Any:
        """:func:`metrale.kernels.moe_grouped.grouped_experts` with its scratch sized for the batch;
        ``epilogue``: its biases and clamp (GPT-OSS)."""
        x = self.as_bf16(x)
        tokens, hidden = x.shape
        top_k, inter = experts.shape[1], down.shape[1]
        num_experts = down.shape[0] // hidden
        pairs = tokens * top_k
        tiling = moe_grouped.tiling_for(tokens, top_k, num_experts)
        tiles = moe_grouped.max_tiles(pairs, num_experts, tiling.block_m)
        rows = tiles * tiling.block_m
        return moe_grouped.grouped_experts(
            x, cp.ascontiguousarray(experts, dtype=np.int32), cp.ascontiguousarray(weights, dtype=f32), gate_up,
            down, cp.empty(rows, dtype=np.int32), cp.empty(tiles, dtype=np.int32), cp.empty((rows, inter), dtype=bf16),
            cp.empty((pairs, hidden), dtype=f32), cp.empty((tokens, hidden), dtype=f32), self.stream, tiling=tiling,
            **epilogue,
        )

    def moe_topk_softmax(self, logits: Any, top_k: int) -> Any:
        """Router logits computed apart (GPT-OSS): the routing kernel's softmax over every logit,
        renormalised over the top k (the softmax over those k); beyond the kernel's limits of
        experts and k, CuPy's sort."""
        logits = cp.ascontiguousarray(logits, dtype=f32)
        if logits.shape[1] <= moe.MAX_EXPERTS and top_k <= moe.MAX_TOP_K:
            return self._route(logits, None, "greedy", 1, 1, top_k, True, 1.0)
        chosen = cp.argsort(-logits, axis=1)[:, :top_k].astype(np.int32)
        top = cp.take_along_axis(logits, chosen, axis=1)
        shifted = cp.exp(top - top[:, :1])
        return chosen, (shifted / shifted.sum(axis=1, keepdims=True)).astype(f32)

    def moe_experts_clamped_bf16(self, x: Any, experts: Any, weights: Any, gate_up: Any, down: Any, alpha: float,
                                 limit: float, gate_up_bias: Any = None, down_bias: Any = None) -> Any:
        """GPT-OSS's experts pair by pair over bf16 stacks (:mod:`metrale.kernels.moe_clamped`); a
        quantized stack dequantized into bf16 first."""
        gate_up, down = self._clamped_stack(gate_up), self._clamped_stack(down)
        act, out = self._clamped_buffers(x, experts, down)
        return moe_clamped.clamped_experts_bf16(
            self.as_bf16(x), cp.ascontiguousarray(experts, dtype=np.int32), cp.ascontiguousarray(weights, dtype=f32),
            gate_up, down, alpha, limit, _f32_or_none(gate_up_bias), _f32_or_none(down_bias), act, out, self.stream)

    def moe_experts_clamped_grouped(self, x: Any, experts: Any, weights: Any, gate_up: Any, down: Any, alpha: float,
                                    limit: float, gate_up_bias: Any = None, down_bias: Any = None) -> Any:
        """GPT-OSS's experts as grouped tensor-core products, each expert's pairs
        one product (:func:`metrale.kernels.moe_grouped.grouped_experts` with its biases and clamped
        SwiGLU): for prompts, where pair by pair would read an expert's weights once per pair. A
        weight-only quantized stack (MXFP4) is dequantized into bf16 for the call."""
        return self._grouped_experts(x, experts, weights, self._clamped_stack(gate_up), self._clamped_stack(down),
                                     gate_up_bias=_f32_or_none(gate_up_bias), down_bias=_f32_or_none(down_bias),
                                     clamp=(alpha, limit))

    def moe_experts_clamped_mxfp4(self, x: Any, experts: Any, weights: Any, gate_up: Any, down: Any, alpha: float,
                                  limit: float, gate_up_bias: Any = None, down_bias: Any = None) -> Any:
        """GPT-OSS's experts pair by pair over plain MXFP4 stacks, their codes and E8M0 scales
        decoded in registers (:mod:`metrale.kernels.moe_clamped`)."""
        act, out = self._clamped_buffers(x, experts, down)
        return moe_clamped.clamped_experts_mxfp4(
            self.to_float32(x), cp.ascontiguousarray(experts, dtype=np.int32),
            cp.ascontiguousarray(weights, dtype=f32), gate_up, down, alpha, limit, _f32_or_none(gate_up_bias),
            _f32_or_none(down_bias), act, out, self.stream)

    @staticmethod
    def _clamped_buffers(x: Any, experts: Any, down: Any) -> tuple[Any, Any]:
        """The expert kernels' scratch ``[N * k, I]`` and output ``[N, H]`` (float32)."""
        tokens, hidden = x.shape
        return (cp.empty((tokens * experts.shape[1], down.shape[1]), dtype=f32),
                cp.empty((tokens, hidden), dtype=f32))

    def _clamped_stack(self, weight: Any) -> Any:
        """A stack as the bf16 expert kernels read it: a weight-only quantized stack dequantized
        into bf16; anything else as it is."""
        if isinstance(weight, QuantizedWeight) and weight.activations == "weight_only":
            return self._dequantized(weight)
        return weight

    # --------------------------------------------------------------------------------- GDN

    def gdn_conv_update(self, inputs: Any, weight: Any, conv_state: Any, slots: Any) -> Any:
        out = cp.empty(inputs.shape, dtype=f32)
        return gated_delta.conv_update(cp.ascontiguousarray(inputs, dtype=f32), weight, conv_state, slots, out,
                                       self.stream)

    def gdn_recurrent_step(self, q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, slots: Any) -> Any:
        out = cp.empty(v.shape, dtype=f32)
        q, k, v, g, beta = (cp.ascontiguousarray(a, dtype=f32) for a in (q, k, v, g, beta))
        return gated_delta.recurrent_step(q, k, v, g, beta, state, slots, out, self.stream)

    @staticmethod
    def _prompt_rule_arguments(q: Any, k: Any, v: Any, g: Any, beta: Any, slots: Any, starts: Any) -> tuple:
        q, k, v, g, beta = (cp.ascontiguousarray(a, dtype=f32) for a in (q, k, v, g, beta))
        return q, k, v, g, beta, cp.asarray(slots, dtype=np.int32), cp.asarray(starts, dtype=np.int32)

    def gdn_prompt_rule(self, q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, slots: Any, starts: Any) -> Any:
        """The recurrence, a token at a time."""
        out = cp.empty(v.shape, dtype=f32)
        q, k, v, g, beta, slots, starts = self._prompt_rule_arguments(q, k, v, g, beta, slots, starts)
        return gated_delta.prompt_rule(q, k, v, g, beta, state, slots, starts, out, self.stream)

    def gdn_prompt_rule_chunked(self, q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, slots: Any,
                                starts: Any) -> Any:
        """The chunked form on tensor cores."""
        out = cp.empty(v.shape, dtype=f32)
        q, k, v, g, beta, slots, starts = self._prompt_rule_arguments(q, k, v, g, beta, slots, starts)
        return gated_delta_chunked.prompt_rule(q, k, v, g, beta, state, slots, starts, out, self.stream)

    def gdn_decode_fused(self, qkvz: Any, ba: Any, conv_weight: Any, conv_state: Any, a_log: Any, dt_bias: Any,
                         state: Any, slots: Any, norm_weight: Any, eps: float, key_heads: int, value_heads: int,
                         key_dim: int, value_dim: int) -> Any:
        """The fused decode step (:func:`metrale.ops.builtin.gdn_decode_kernels`)."""
        rows = qkvz.shape[0]
        mixed = cp.empty((rows, 2 * key_heads * key_dim + value_heads * value_dim), dtype=f32)
        out = cp.empty((rows, value_heads, value_dim), dtype=bf16)
        return gdn_decode.decode_step(
            cp.ascontiguousarray(qkvz, dtype=f32), cp.ascontiguousarray(ba, dtype=f32), conv_weight, conv_state, a_log,
            dt_bias, state, cp.ascontiguousarray(slots, dtype=np.int32), norm_weight, eps, key_heads, value_heads,
            key_dim, value_dim, mixed, out, self.stream)

    def gdn_ungroup(self, qkvz: Any, key_heads: int, value_heads: int, key_dim: int, value_dim: int) -> Any:
        rows = qkvz.shape[0]
        inputs = cp.empty((rows, 2 * key_heads * key_dim + value_heads * value_dim), dtype=f32)
        z = cp.empty((rows, value_heads, value_dim), dtype=f32)
        gated_delta.ungroup(cp.ascontiguousarray(qkvz, dtype=f32), key_heads, value_heads, key_dim, value_dim, inputs, z,
                            self.stream)
        return inputs, z

    def gdn_gates(self, ba: Any, a_log: Any, dt_bias: Any, key_heads: int) -> Any:
        rows, value_heads = ba.shape[0], dt_bias.shape[0]
        g, beta = cp.empty((rows, value_heads), dtype=f32), cp.empty((rows, value_heads), dtype=f32)
        gated_delta.gates(cp.ascontiguousarray(ba, dtype=f32), a_log, dt_bias, key_heads, g, beta, self.stream)
        return g, beta

    def gdn_split_heads(self, mixed: Any, key_heads: int, value_heads: int, key_dim: int, value_dim: int) -> Any:
        rows = mixed.shape[0]
        q = cp.empty((rows, value_heads, key_dim), dtype=f32)
        k = cp.empty((rows, value_heads, key_dim), dtype=f32)
        v = cp.empty((rows, value_heads, value_dim), dtype=f32)
        gated_delta.split_heads(cp.ascontiguousarray(mixed, dtype=f32), key_heads, value_heads, key_dim, value_dim,
                                q, k, v, self.stream)
        return q, k, v

    def gdn_conv_prompts(self, inputs: Any, weight: Any, conv_state: Any, slots: Any, starts: Any) -> Any:
        out = cp.empty(inputs.shape, dtype=f32)
        return gated_delta.conv_prompts(cp.ascontiguousarray(inputs, dtype=f32), weight, conv_state,
                                        cp.asarray(slots, dtype=np.int32), cp.asarray(starts, dtype=np.int32), out,
                                        self.stream)

    def feed_tokens(self, token_ids: Any, source: Any, rows: Any, indices: Any) -> Any:
        return token_feed.feed_tokens(token_ids, source, rows, indices, self.stream)

    def lora_linear(self, y: Any, x: Any, a: Any, b: Any, slots: Any, route: Any = None) -> Any:
        # The shrink is one product with every slot's A (or, for a step of one adapter, that
        # slot's only); each row's own slot's columns are kept (bf16) and one product with every
        # slot's B is added to y.
        count, width, inner = a.shape
        shrunk = cp.empty((x.shape[0], count * width), dtype=bf16)
        if isinstance(route, int) and not isinstance(route, bool) and 0 < route <= count:
            products = self.linear(x, a[route - 1])
            lora.lora_select(products, width, slots, shrunk, self.stream, single_slot=route)
        else:
            lora.lora_select(self.linear(x, a.reshape(count * width, inner)), width, slots, shrunk, self.stream)
        return self.gemm(shrunk, b, y, accumulate=True)

    def lora_expand(self, ext: Any, b: Any, slots: Any, tiles: Any, width: int, bias: Any = None,
                    swiglu: bool = False) -> Any:
        # The kernel reads the rows' slots from their tiles.
        rows, out = ext.shape[0], b.shape[0]
        y = cp.empty((rows, out // 2), dtype=bf16) if swiglu else cp.empty((rows, out), dtype=f32)
        return lora.lora_expand(cp.ascontiguousarray(ext, dtype=f32), cp.ascontiguousarray(tiles, dtype=np.int32), b,
                                width, y, bias, swiglu, self.stream)

    def lora_token_rows(self, x: Any, ids: Any, slots: Any, tokens: Any, rows: Any) -> Any:
        return lora.lora_token_rows(x, ids, slots, tokens, rows, self.stream)

    def lora_logit_rows(self, logits: Any, h: Any, slots: Any, tokens: Any, rows: Any) -> Any:
        if h.dtype != bf16:
            h = cp.ascontiguousarray(h, dtype=f32)
        return lora.lora_logit_rows(logits, cp.ascontiguousarray(h), slots, tokens, rows, self.stream)

    def gated_add(self, x: Any, y: Any, gate: Any) -> Any:
        out = cp.empty(x.shape, dtype=f32)
        return gated.gated_add(cp.ascontiguousarray(x, dtype=f32), cp.ascontiguousarray(y, dtype=f32),
                               cp.ascontiguousarray(gate, dtype=f32), out, self.stream)

    def latent_query(self, q_latent: Any, q: Any, positions: Any, inv_freq: Any, attention_factor: float,
                     interleaved: bool) -> Any:
        rows, heads, rank = q_latent.shape
        out = cp.empty((rows, heads, rank + 2 * inv_freq.shape[0]), dtype=f32)
        if q.dtype != f32 or q.strides[-1] != q.itemsize:
            q = cp.ascontiguousarray(q, dtype=f32)
        return attention_latent.latent_query_words(cp.ascontiguousarray(q_latent, dtype=f32), q, positions, inv_freq,
                                                   attention_factor, interleaved, out, self.stream)

    def gated_rmsnorm(self, x: Any, z: Any, weight: Any, eps: float) -> Any:
        width = x.shape[-1]
        flat_x = cp.ascontiguousarray(x, dtype=f32).reshape(-1, width)
        out = cp.empty(flat_x.shape, dtype=bf16)
        gated.gated_rmsnorm(flat_x, cp.ascontiguousarray(z, dtype=f32).reshape(-1, width), weight, eps, out, self.stream)
        return out.reshape(x.shape)

    def sigmoid_gate(self, x: Any, gate: Any) -> Any:
        out = cp.empty(x.shape, dtype=bf16)
        return gated.sigmoid_gate(self.as_bf16(x), cp.ascontiguousarray(gate, dtype=f32), out, self.stream)


def _f32_or_none(values: Any) -> Any:
    """A bias operand as the kernels take it: contiguous float32, or None."""
    return None if values is None else cp.ascontiguousarray(values, dtype=f32)
