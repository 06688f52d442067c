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

    def __call__(self, x: DeviceArray, weight: DeviceArray, out: DeviceArray) -> DeviceArray:
        """``x [N, K]`` bf16 bits, ``weight [M, K]`` bf16 bits -> ``out [N, M]`` fp32 or bf16; or
        all three float32 (a float32 product: cuBLAS's default math mode, no TF32)."""
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
            self._zero.ctypes.data, out.data.ptr, out_type, width,
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
