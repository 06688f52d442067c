"""The cuBLASLt product without a separate split-K reduction (``metrale.kernels.linear.CublasLtGemm``)
against cublasGemmEx's (``CublasGemm``) at decode shapes of the Llama shapes, and replayed from a
CUDA graph with new inputs."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import bf16, rel_error  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows, inner, width, out_dtype", [
    (32, 8192, 2048, np.float32),  # Llama-1B's down projection at batch 32
    (32, 2048, 16384, np.uint16),  # its gate and up projections, bf16 out
    (16, 4096, 6144, np.float32),  # Llama-8B's QKV at batch 16
    (3, 2048, 2048, np.float32),
])
def test_the_product_matches_cublas_gemm_ex(rows, inner, width, out_dtype):
    import cupy as cp

    from metrale.kernels.linear import CublasGemm, CublasLtGemm

    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(rows + inner)
    x, weight = cp.asarray(bf16(rng, (rows, inner))), cp.asarray(bf16(rng, (width, inner), 0.05))
    with stream:
        expected = CublasGemm(stream)(x, weight, cp.empty((rows, width), out_dtype))
        lt = CublasLtGemm(stream)
        got = lt(x, weight, cp.empty((rows, width), out_dtype))
        graph_out = cp.empty((rows, width), out_dtype)
        stream.synchronize()
        stream.begin_capture(getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", 2))
        try:
            lt(x, weight, graph_out)
        finally:
            graph = stream.end_capture()
        x.set(bf16(rng, (rows, inner)), stream=stream)
        graph.launch(stream=stream)
        again = CublasGemm(stream)(x, weight, cp.empty((rows, width), out_dtype))
        stream.synchronize()

    def values(array):
        host = cp.asnumpy(array)
        return host if host.dtype == np.float32 else (host.astype(np.uint32) << 16).view(np.float32)

    assert rel_error(values(got), values(expected)) <= 1e-2
    assert rel_error(values(graph_out), values(again)) <= 1e-2
