"""A plugin's CUDA kernels on the GPU, written with metrale.ops.plugin_kernels as the plugin guide
says: checked against the reference, launched on the backend's stream, captured into a CUDA graph
and replayed with new inputs; the capture refusals; a CuPy RawKernel launched the same way."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from metrale.errors import GraphCaptureError
from metrale.ops import Kernel, Op, Operand, build_op_registry
from metrale.ops import plugin_kernels as pk
from metrale.ops.check import check_kernel

pytestmark = pytest.mark.gpu


def squared_relu(x):
    return np.square(np.maximum(np.asarray(x, dtype=np.float32), 0))


SQUARED_RELU = Op(
    "gpu_squared_relu", "``relu(x) ** 2``.",
    parameters=(Operand("x", "[N, H]", "activation"),),
    results=(Operand("y", "[N, H]", "matmul_input"),),
    reference=squared_relu,
    examples=lambda rng: [{"x": rng.standard_normal((n, 3000)).astype(np.float32)} for n in (1, 7)],
)

THREADS = 256


@pk.jit_kernel
def squared_relu_kernel(x, y):
    # One thread per element of the flattened x [n] f32; y [n] bf16 bits.
    i = cuda.grid(1)
    if i < x.shape[0]:
        value = max(x[i], np.float32(0.0))
        y[i] = pk.float_to_bf16(value * value)


def build(backend):
    def run(x):
        pk.check_operand("gpu_squared_relu", "x", x, "activation", ndim=2)
        y = backend.xp.empty(x.shape, dtype=np.uint16)
        pk.launch(squared_relu_kernel, pk.blocks(x.size, THREADS), THREADS, (x.reshape(-1), y.reshape(-1)), backend)
        return y

    return run


KERNEL = Kernel("gpu_squared_relu", "cuda", "test.squared_relu", build=build)


@pytest.fixture(scope="module")
def backend():
    from metrale.backends.cuda import CudaBackend

    backend = CudaBackend()
    yield backend
    backend.close()


def registry():
    registry = build_op_registry(None)
    plugin = registry.from_plugin("gpu_test")
    plugin.declare(SQUARED_RELU)
    plugin.add_kernel(KERNEL)
    return registry


def capture(backend, step):
    """(graph, result) of ``step()`` recorded on the backend's stream, its memory from the graph pool."""
    import cupy as cp

    stream = backend.stream
    with cp.cuda.using_allocator(backend.graph_pool.malloc), backend.activate():
        stream.begin_capture(getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", 2))
        try:
            result = step()
        finally:
            graph = stream.end_capture()
    return graph, result


def test_the_plugin_kernel_matches_its_reference(backend):
    assert check_kernel(registry(), KERNEL, backend) == []


def test_the_plugin_kernel_is_captured_and_replayed_with_new_inputs(backend):
    import cupy as cp

    from metrale.loading.checkpoint import bf16_to_float32

    function = KERNEL.build(backend)
    with backend.activate():
        x = cp.asarray(np.random.default_rng(0).standard_normal((5, 1000)).astype(np.float32))
        function(x)  # eagerly first: numba compiles outside the capture
        backend.synchronize()
    graph, y = capture(backend, lambda: function(x))
    for seed in (1, 2):
        new = np.random.default_rng(seed).standard_normal((5, 1000)).astype(np.float32)
        with backend.activate():
            x.set(new, stream=backend.stream)
            graph.launch(stream=backend.stream)
            backend.synchronize()
            got = bf16_to_float32(cp.asnumpy(y))
        np.testing.assert_allclose(got, squared_relu(new), rtol=1e-2, atol=1e-6)


def test_capture_refusals_raise_inside_a_capture_only(backend):
    assert not pk.capturing(backend)
    pk.refuse_capture(backend, "reading a count")

    def refusing():
        assert pk.capturing(backend)
        pk.refuse_capture(backend, "reading a count")

    with pytest.raises(GraphCaptureError, match="reading a count"):
        capture(backend, refusing)
    assert not backend.stream.is_capturing()


def test_a_plugin_op_declared_graph_unsafe_refuses_a_capture(backend):
    import dataclasses

    import cupy as cp

    registry = build_op_registry(None)
    plugin = registry.from_plugin("gpu_test")
    plugin.declare(dataclasses.replace(SQUARED_RELU, graph_safe=False))
    plugin.add_kernel(KERNEL)
    backend_ops = registry.table(backend)
    with backend.activate():
        x = cp.ones((2, 8), np.float32)
        backend_ops.gpu_squared_relu(x)
    with pytest.raises(GraphCaptureError, match="declared graph_safe=False"):
        capture(backend, lambda: backend_ops.gpu_squared_relu(x))


def test_a_cupy_raw_kernel_launches_on_the_backends_stream_and_is_captured(backend):
    import cupy as cp

    kernel = cp.RawKernel(r'''
    extern "C" __global__ void add_one(const float* x, float* y, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) y[i] = x[i] + 1.0f;
    }''', "add_one")
    with backend.activate():
        x = cp.arange(300, dtype=np.float32)
        y = cp.empty_like(x)
    pk.launch(kernel, pk.blocks(300, 128), 128, (x, y, np.int32(300)), backend)
    backend.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(y), np.arange(300, dtype=np.float32) + 1)
    graph, _ = capture(backend, lambda: pk.launch(kernel, pk.blocks(300, 128), 128, (x, y, np.int32(300)), backend))
    with backend.activate():
        x.fill(5)
        graph.launch(stream=backend.stream)
        backend.synchronize()
    assert float(cp.asnumpy(y).max()) == 6.0
