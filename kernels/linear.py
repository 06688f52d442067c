"""Linear layer ``y = x W^T + b`` (cuBLAS on the GPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import cupy


def linear_reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """``x [T, in]``, ``weight [out, in]``, ``bias [out]`` -> ``[T, out]`` float32."""
    y = np.asarray(x, dtype=np.float32) @ weight.T
    if bias is not None:
        y = y + bias
    return y.astype(np.float32, copy=False)


# ------------------------------------------------------------------------------ cuBLAS GEMM

from metrale.kernels._device import DeviceArray, check_array  # noqa: E402

# cuBLAS / CUDA enum values (cublas_api.h, library_types.h).
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUDA_R_32F = 0
CUDA_R_16BF = 14
CUDA_R_8F_E4M3 = 28
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 * 1024 * 1024


class CublasGemm:
    """``y = x W^T`` through ``cublasGemmEx`` (nvmath bindings): bf16 inputs, fp32 accumulate.

    The handle is bound to one stream and given a fixed workspace at construction, so every
    call can be recorded into a CUDA graph (CuPy's own cuBLAS wrapper refuses stream capture).
    """

    def __init__(self, stream: cupy.cuda.Stream) -> None:
        import cupy
        from nvmath.bindings import cublas

        self._cublas = cublas
        self.handle = cublas.create()
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)
        cublas.set_stream(self.handle, stream.ptr)
        cublas.set_workspace(self.handle, self.workspace.data.ptr, WORKSPACE_BYTES)
        # Host scalars: read at call (and capture) time with the default host pointer mode.
        self._one = np.ones(1, dtype=np.float32)
        self._zero = np.zeros(1, dtype=np.float32)

    def __call__(self, x: DeviceArray, weight: DeviceArray, out: DeviceArray, accumulate: bool = False) -> DeviceArray:
        """``x [N, K]`` bf16 bits, ``weight [M, K]`` bf16 bits -> ``out [N, M]`` fp32 or bf16; or
        all three float32 (a float32 product: cuBLAS's default math mode, no TF32). With
        ``accumulate`` the product is added to ``out`` (cuBLAS's beta = 1)."""
        op = "linear"
        single = getattr(x, "dtype", None) == np.float32
        in_dtype, in_type = (np.float32, CUDA_R_32F) if single else (np.uint16, CUDA_R_16BF)
        check_array(op, "x", x, in_dtype, ndim=2)
        rows, inner = x.shape
        check_array(op, "weight", weight, in_dtype, (None, inner))
        width = weight.shape[0]
        if single and out.dtype != np.float32:
            from metrale.errors import KernelArgumentError

            raise KernelArgumentError(f"{op}: a float32 product writes float32, not {out.dtype}")
        if out.dtype == np.float32:
            out_type = CUDA_R_32F
        elif out.dtype == np.uint16:
            out_type = CUDA_R_16BF
        else:
            from metrale.errors import KernelArgumentError

            raise KernelArgumentError(f"{op}: out has dtype {out.dtype}, expected float32 or uint16 (bf16)")
        check_array(op, "out", out, out.dtype, (rows, width))
        if rows == 0:
            return out
        # Row-major y [N, M] is column-major y^T [M, N] = W (x^T): A = W as column-major [K, M]
        # transposed, B = x as column-major [K, N].
        self._cublas.gemm_ex(
            self.handle, CUBLAS_OP_T, CUBLAS_OP_N, width, rows, inner,
            self._one.ctypes.data, weight.data.ptr, in_type, inner,
            x.data.ptr, in_type, inner,
            (self._one if accumulate else self._zero).ctypes.data, out.data.ptr, out_type, width,
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT,
        )
        return out

    def per_head(self, x: DeviceArray, weight: DeviceArray, out: DeviceArray) -> DeviceArray:
        """``out[n, h] = weight[h] @ x[n, h]`` through ``cublasGemmStridedBatchedEx``, one product
        per head: ``x [N, heads, in]`` bf16 bits (a view whose last axis is contiguous), ``weight
        [heads * out, in]`` bf16 bits, ``out [N, heads, out]`` float32 (contiguous). Each head's
        weight is read once for all rows, where a kernel per row reads it per row."""
        op = "head_linear"
        check_array(op, "x", x, np.uint16, ndim=3)
        rows, heads, inner = x.shape
        check_array(op, "weight", weight, np.uint16, (None, inner))
        width = weight.shape[0] // heads
        check_array(op, "weight", weight, np.uint16, (heads * width, inner))
        check_array(op, "out", out, np.float32, (rows, heads, width))
        item = x.itemsize
        if x.strides[2] != item or not out.flags.c_contiguous:
            from metrale.errors import KernelArgumentError

            raise KernelArgumentError(f"{op}: x strides {list(x.strides)} need a contiguous last axis "
                                      f"and out a contiguous array")
        if rows == 0 or heads == 0:
            return out
        # Per head, column-major out_h^T [out, N] (ldc heads * out) = W_h (column-major [in, out]
        # transposed) times x_h^T (column-major [in, N], ldb the row stride).
        self._cublas.gemm_strided_batched_ex(
            self.handle, CUBLAS_OP_T, CUBLAS_OP_N, width, rows, inner,
            self._one.ctypes.data, weight.data.ptr, CUDA_R_16BF, inner, width * inner,
            x.data.ptr, CUDA_R_16BF, x.strides[0] // item, x.strides[1] // item,
            self._zero.ctypes.data, out.data.ptr, CUDA_R_32F, heads * width, width,
            heads, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT,
        )
        return out

    def close(self) -> None:
        if self.handle:
            self._cublas.destroy(self.handle)
            self.handle = 0


# Reduction schemes of a split-K product (cublasLtReductionScheme_t): none, or in the output
# buffer by the product's own kernel.
REDUCTION_NONE_OR_INPLACE = 1


class CublasLtGemm:
    """``y = x W^T`` through cuBLASLt (nvmath bindings): bf16 inputs, float32 or bf16 output,
    fp32 accumulation, the algorithm the heuristic ranks first among those whose split-K partial
    sums need no separate kernel (``reduction_schemes``, a cublasLtReductionScheme_t mask; none
    or in place by default), where ``cublasGemmEx`` may pick a split-K product followed by a
    reduction kernel (the down projection of a batch of 32 rows, for one).

    One plan (descriptors and algorithm) per shape, made on its first call (host work only, so a
    first call may be recorded into a CUDA graph). Bound to one stream and a fixed workspace.
    """

    def __init__(self, stream: cupy.cuda.Stream, reduction_schemes: int = REDUCTION_NONE_OR_INPLACE) -> None:
        import cupy
        from nvmath.bindings import cublasLt

        self._lt = cublasLt
        self.handle = cublasLt.create()
        self.stream = stream
        self.reduction_schemes = reduction_schemes
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)
        self._plans: dict[tuple[int, ...], tuple[int, int, int, int, object]] = {}
        self._one = np.ones(1, dtype=np.float32)
        self._zero = np.zeros(1, dtype=np.float32)

    def _plan(self, rows: int, inner: int, width: int, out_type: int,
              in_type: int = CUDA_R_16BF, outer_scales: bool = False) -> tuple[int, int, int, int, object]:
        key = (rows, inner, width, out_type, in_type, outer_scales)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        lt = self._lt
        desc = lt.matmul_desc_create(CUBLAS_COMPUTE_32F, CUDA_R_32F)
        transpose = np.array([CUBLAS_OP_T], dtype=np.int32)
        lt.matmul_desc_set_attribute(desc, lt.MatmulDescAttribute.TRANSA, transpose.ctypes.data, transpose.nbytes)
        if outer_scales:  # a scale per row of W (A's rows) and per row of x (B's columns), applied to the sums
            mode = np.array([int(lt.MatmulMatrixScale.OUTER_VEC_32F)], dtype=np.int32)
            for attribute in (lt.MatmulDescAttribute.A_SCALE_MODE, lt.MatmulDescAttribute.B_SCALE_MODE):
                lt.matmul_desc_set_attribute(desc, attribute, mode.ctypes.data, mode.nbytes)
            # The library refuses vector scales without addresses (CUBLAS_STATUS_INVALID_VALUE): the
            # workspace's stands in until each call sets the scales' own.
            placeholder = np.array([self.workspace.data.ptr], dtype=np.uint64)
            for attribute in (lt.MatmulDescAttribute.A_SCALE_POINTER, lt.MatmulDescAttribute.B_SCALE_POINTER):
                lt.matmul_desc_set_attribute(desc, attribute, placeholder.ctypes.data, placeholder.nbytes)
        # The layouts of CublasGemm: column-major y^T [M, N] = (W as [K, M])^T x^T ([K, N]).
        a = lt.matrix_layout_create(in_type, inner, width, inner)
        b = lt.matrix_layout_create(in_type, inner, rows, inner)
        c = lt.matrix_layout_create(out_type, width, rows, width)
        preference = lt.matmul_preference_create()
        workspace = np.array([WORKSPACE_BYTES], dtype=np.uint64)
        lt.matmul_preference_set_attribute(preference, lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES,
                                           workspace.ctypes.data, workspace.nbytes)
        mask = np.array([self.reduction_schemes], dtype=np.uint32)
        lt.matmul_preference_set_attribute(preference, lt.MatmulPreferenceAttribute.REDUCTION_SCHEME_MASK,
                                           mask.ctypes.data, mask.nbytes)
        results = lt.MatmulHeuristicResult(1)
        count = np.zeros(1, dtype=np.int32)
        try:
            lt.matmul_algo_get_heuristic(self.handle, desc, a, b, c, c, preference, 1, results.ptr, count.ctypes.data)
        finally:
            lt.matmul_preference_destroy(preference)
        if count[0] < 1:
            from metrale.errors import KernelArgumentError

            raise KernelArgumentError(f"linear: cuBLASLt has no algorithm for {rows} x {inner} -> {width} with "
                                      f"reduction schemes {self.reduction_schemes}")
        # (results stays referenced: its first entry's algo is read at every call.)
        plan = self._plans[key] = (desc, a, b, c, results)
        return plan

    def __call__(self, x: DeviceArray, weight: DeviceArray, out: DeviceArray) -> DeviceArray:
        """``x [N, K]`` bf16 bits, ``weight [M, K]`` bf16 bits -> ``out [N, M]`` float32 or bf16."""
        from metrale.errors import KernelArgumentError

        op = "linear"
        check_array(op, "x", x, np.uint16, ndim=2)
        rows, inner = x.shape
        check_array(op, "weight", weight, np.uint16, (None, inner))
        width = weight.shape[0]
        if out.dtype == np.float32:
            out_type = CUDA_R_32F
        elif out.dtype == np.uint16:
            out_type = CUDA_R_16BF
        else:
            raise KernelArgumentError(f"{op}: out has dtype {out.dtype}, expected float32 or uint16 (bf16)")
        check_array(op, "out", out, out.dtype, (rows, width))
        if rows == 0:
            return out
        desc, a, b, c, results = self._plan(rows, inner, width, out_type)
        self._lt.matmul(self.handle, desc, self._one.ctypes.data, weight.data.ptr, a, x.data.ptr, b,
                        self._zero.ctypes.data, out.data.ptr, c, out.data.ptr, c, results.ptr,  # type: ignore[attr-defined]
                        self.workspace.data.ptr, WORKSPACE_BYTES, self.stream.ptr)
        return out

    def fp8(self, x: DeviceArray, weight: DeviceArray, out: DeviceArray, row_scales: DeviceArray | None = None,
            column_scales: DeviceArray | None = None) -> DeviceArray:
        """``x [N, K]`` and ``weight [M, K]`` FP8 E4M3 codes (uint8) -> ``out [N, M]`` float32 (or bf16
        bits, uint16, with scales): the products of the codes' values on FP8 tensor cores, fp32
        accumulation; unscaled (a caller scales the rows and columns after), or, given float32
        ``row_scales [N]`` and ``column_scales [M]``, each sum times its row's and column's scale in
        the product's epilogue (cuBLASLt's outer-vector scales). ``K`` a multiple of 16, ``M`` of 4
        (cuBLASLt's FP8 layouts); :class:`~metrale.errors.KernelArgumentError` where cuBLASLt has no
        algorithm (an older GPU or library, for the scaled product)."""
        from metrale.errors import KernelArgumentError

        op = "linear (FP8)"
        check_array(op, "x", x, np.uint8, ndim=2)
        rows, inner = x.shape
        check_array(op, "weight", weight, np.uint8, (None, inner))
        width = weight.shape[0]
        scaled = row_scales is not None or column_scales is not None
        if scaled:
            check_array(op, "row_scales", row_scales, np.float32, (rows,))
            check_array(op, "column_scales", column_scales, np.float32, (width,))
        out_types = {np.dtype(np.float32): CUDA_R_32F, np.dtype(np.uint16): CUDA_R_16BF} if scaled else {
            np.dtype(np.float32): CUDA_R_32F}
        if out.dtype not in out_types:
            raise KernelArgumentError(f"{op}: out has dtype {out.dtype}, expected "
                                      f"{'float32 or uint16 (bf16)' if scaled else 'float32'}")
        check_array(op, "out", out, out.dtype, (rows, width))
        if inner % 16 or width % 4:
            raise KernelArgumentError(f"{op}: inner size {inner} (a multiple of 16) or width {width} (of 4) not served")
        if rows == 0:
            return out
        try:
            desc, a, b, c, results = self._plan(rows, inner, width, out_types[out.dtype], CUDA_R_8F_E4M3, scaled)
        except (self._lt.cuBLASLtError, AttributeError) as error:  # an older GPU or library
            raise KernelArgumentError(f"{op}: cuBLASLt serves no FP8 product of {rows} x {inner} -> {width}: "
                                      f"{error}") from error
        if scaled:
            assert row_scales is not None and column_scales is not None  # (checked above)
            # The scales' addresses, set for this call (host work, recorded with the call in a graph).
            for attribute, array in ((self._lt.MatmulDescAttribute.A_SCALE_POINTER, column_scales),
                                     (self._lt.MatmulDescAttribute.B_SCALE_POINTER, row_scales)):
                pointer = np.array([array.data.ptr], dtype=np.uint64)
                self._lt.matmul_desc_set_attribute(desc, attribute, pointer.ctypes.data, pointer.nbytes)
        self._lt.matmul(self.handle, desc, self._one.ctypes.data, weight.data.ptr, a, x.data.ptr, b,
                        self._zero.ctypes.data, out.data.ptr, c, out.data.ptr, c, results.ptr,  # type: ignore[attr-defined]
                        self.workspace.data.ptr, WORKSPACE_BYTES, self.stream.ptr)
        return out
