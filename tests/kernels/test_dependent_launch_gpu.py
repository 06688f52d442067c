"""Dependent launches (``metrale.kernels._launch``) on the GPU: a decode GEMV launched dependently
right after a slow kernel that writes its input reads the written input, eagerly and replayed
from a CUDA graph; the same with dependent launches turned off."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import bf16, rel_error  # noqa: E402

from metrale.loading.checkpoint import bf16_to_float32

pytestmark = pytest.mark.gpu

# Writes dst <- src after spinning `cycles` clocks; lets a dependent kernel start at once.
SLOW_COPY = r"""
extern "C" __global__ void slow_copy(const unsigned short* src, unsigned short* dst, int n, long long cycles) {
    allow_dependents();
    const long long start = clock64();
    while (clock64() - start < cycles) {}
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = src[i];
}
"""


@pytest.fixture(scope="module")
def backend():
    from metrale.backends.cuda import CudaBackend

    backend = CudaBackend()
    yield backend
    backend.close()


@pytest.mark.parametrize("dependent", [True, False])
def test_a_dependent_gemv_reads_what_the_kernel_ahead_wrote(backend, monkeypatch, dependent):
    import cupy as cp

    from metrale.kernels import _launch
    from metrale.kernels import decode_gemv as dg

    monkeypatch.setattr(_launch, "ENABLED", dependent)
    assert _launch.dependent_launch_available() is dependent
    slow_copy = cp.RawModule(code=_launch.DEPENDENT_LAUNCH + SLOW_COPY).get_function("slow_copy")
    rows, inner, columns = 2, 4096, 6144
    rng = np.random.default_rng(3)
    weight_bits = bf16(rng, (columns, inner), 0.02)
    weight = bf16_to_float32(weight_bits)
    stream = backend.stream
    with cp.cuda.using_allocator(backend.graph_pool.malloc), backend.activate():
        weight_device = cp.asarray(weight_bits)
        source = cp.asarray(bf16(rng, (rows, inner)))
        x = cp.zeros((rows, inner), np.uint16)
        out = cp.zeros((rows, columns), np.float32)

        def step():
            _launch.launch(slow_copy, (4,), (256,), (source, x, np.int32(rows * inner), np.int64(200_000)), 0, stream,
                           dependent=False)
            dg.decode_gemv(dg.PLAIN, x, weight_device, out, stream)

        step()  # eagerly (compiles)
        stream.synchronize()
        expected, _ = dg.decode_gemv_reference(dg.PLAIN, bf16_to_float32(cp.asnumpy(source)), weight)
        assert rel_error(cp.asnumpy(out), expected) <= 1e-4
        stream.begin_capture(getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", 2))
        try:
            step()
        finally:
            graph = stream.end_capture()
    for seed in (1, 2):
        new = bf16(np.random.default_rng(seed), (rows, inner))
        with backend.activate():
            source.set(new, stream=stream)
            x.fill(0)
            out.fill(np.nan)
            graph.launch(stream=stream)
            stream.synchronize()
            got = cp.asnumpy(out)
        expected, _ = dg.decode_gemv_reference(dg.PLAIN, bf16_to_float32(new), weight)
        assert rel_error(got, expected) <= 1e-4
