"""The helpers of metrale.ops.plugin_kernels, under the CUDA simulator: operand dtypes, argument
checks, launching numba and CuPy-style kernels on a backend's stream, and capture refusals."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from metrale import hookimpl
from metrale.errors import GraphCaptureError, KernelArgumentError
from metrale.ops import OPERAND_KINDS, Kernel, Op, Operand
from metrale.ops import plugin_kernels as pk
from metrale.ops.check import place
from metrale.testing.kernel_check import SimulatedCudaBackend

pytestmark = pytest.mark.skipif(not pk.SIMULATED, reason="the real-GPU variants carry the gpu marker")


def test_the_dtype_table_is_what_the_backend_places_and_the_op_page_says():
    backend = SimulatedCudaBackend()
    for kind in OPERAND_KINDS:
        words = Operand("a", kind=kind).dtype_on("cuda")
        if kind not in pk.CUDA_DTYPES:
            assert kind in ("batch", "scalar", "option")
            with pytest.raises(KernelArgumentError, match="not an array kind"):
                pk.cuda_dtypes(kind)
            continue
        named = {"float32": np.float32, "bf16 bits": np.uint16, "int32": np.int32}
        assert {np.dtype(named[w]) for w in named if w in words} == set(pk.CUDA_DTYPES[kind]), kind
        op = Op("probe", "", (Operand("a", kind=kind),), (), lambda a: a)
        on_backend, _ = place(op, {"a": np.ones((2, 3), np.float32)}, backend)
        if kind != "cache":  # a cache example is placed as given
            assert on_backend["a"].dtype == pk.CUDA_DTYPES[kind][0], kind


def test_check_operand_names_the_op_the_operand_and_what_it_accepts():
    pk.check_operand("op", "x", np.zeros((2, 4), np.float32), "matmul_input", (2, None))
    pk.check_operand("op", "x", np.zeros((2, 4), np.uint16), "matmul_input", ndim=2)
    with pytest.raises(KernelArgumentError, match=r"^op: x \(matmul_input\) has dtype float64, expected uint16 or float32"):
        pk.check_operand("op", "x", np.zeros((2, 4)), "matmul_input")
    with pytest.raises(KernelArgumentError, match=r"op: ids has shape \[3\], expected \[4\]"):
        pk.check_operand("op", "ids", np.zeros(3, np.int32), "index", (4,))
    with pytest.raises(KernelArgumentError, match="is not C-contiguous"):
        pk.check_operand("op", "w", np.zeros((4, 4), np.uint16).T, "weight")


def test_blocks_cover_the_items():
    assert [pk.blocks(n, 32) for n in (0, 1, 32, 33)] == [1, 1, 1, 2]
    with pytest.raises(KernelArgumentError):
        pk.blocks(4, 0)


@pk.jit_kernel
def add_one(x, out):
    # One thread per element: x, out float32 [n].
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = x[i] + np.float32(1.0)


def test_launch_runs_a_numba_kernel_on_the_backends_stream():
    backend = SimulatedCudaBackend()
    x = np.arange(40, dtype=np.float32)
    out = backend.xp.empty(40, dtype=np.float32)
    pk.launch(add_one, pk.blocks(40, 16), 16, (x, out), backend)
    np.testing.assert_array_equal(out, x + 1)
    with pytest.raises(KernelArgumentError, match="args must be a tuple"):
        pk.launch(add_one, 1, 16, [x, out], backend)


class RecordingStream:
    def __init__(self, capturing=False):
        self.entered, self.capturing = 0, capturing

    def is_capturing(self):
        return self.capturing

    def __enter__(self):
        self.entered += 1
        return self

    def __exit__(self, *exc):
        return None


def test_launch_hands_a_cupy_style_kernel_its_arguments_with_the_stream_current():
    calls = []
    stream = RecordingStream()

    def raw_kernel(grid, block, args, shared_mem=0):
        calls.append((grid, block, args, shared_mem, stream.entered))

    class Backend:
        pass

    backend = Backend()
    backend.stream = stream
    pk.launch(raw_kernel, 3, (64, 2), ("a", np.int32(5)), backend, shared_bytes=128)
    assert calls == [((3,), (64, 2), ("a", np.int32(5)), 128, 1)]


def test_capture_refusals():
    class Backend:
        pass

    backend = Backend()
    assert not pk.capturing(backend)
    backend.stream = RecordingStream(capturing=False)
    pk.refuse_capture(backend, "reading the count")
    backend.stream.capturing = True
    assert pk.capturing(backend)
    with pytest.raises(GraphCaptureError, match="reading the count cannot run inside a CUDA graph capture"):
        pk.refuse_capture(backend, "reading the count")
    assert not pk.capturing(SimulatedCudaBackend())


def test_a_plugin_kernel_of_an_op_declared_graph_unsafe_refuses_a_capture():
    from metrale.model.plugin_manager import get_plugin_manager
    from metrale.ops import build_op_registry
    from metrale.ops.registry import OpTable

    class Plugin:
        METRALE_CONTRACT_VERSION = "1.3"

        def __init__(self, op, kernel):
            self.op, self.kernel = op, kernel

        @hookimpl
        def metrale_register_ops(self, registry):
            registry.declare(self.op)
            registry.add_kernel(self.kernel)

    def count(x):
        return np.asarray([np.count_nonzero(x)], np.float32)

    for graph_safe in (True, False):
        op = Op("nonzero_count", "", (Operand("x", "[N]"),), (Operand("n", "[1]"),), count, graph_safe=graph_safe)
        kernel = Kernel("nonzero_count", "cuda", "test.count", build=lambda backend: count)
        plugins = get_plugin_manager(entry_points=False)
        plugins.register(Plugin(op, kernel), name="counting")
        registry = build_op_registry(plugins)

        class FakeCudaBackend:
            name = "cuda"
            xp = np
            stream = RecordingStream(capturing=True)
            kernels = type("AnyKernel", (), {"__getattr__": lambda self, name: (lambda *a, **k: None)})()

        table = OpTable(registry, FakeCudaBackend())
        x = np.array([0.0, 2.0], np.float32)
        if graph_safe:
            assert table.nonzero_count(x).tolist() == [1.0]
        else:
            with pytest.raises(GraphCaptureError, match="'nonzero_count' is declared graph_safe=False"):
                table.nonzero_count(x)
            FakeCudaBackend.stream.capturing = False
            assert table.nonzero_count(x).tolist() == [1.0]
