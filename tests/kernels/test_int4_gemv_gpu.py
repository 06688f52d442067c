"""The 4-bit weight-only decode GEMV (``metrale.kernels.int4_gemv``) against its NumPy reference on a
real GPU: the Llama-8B projection shapes at 1 to 32 rows (staged in shared memory and in the
workspace), zero points and act-order, float32 and bf16 rows, a CUDA-graph replay with new
inputs, and the gated form (the 8B gate/up projection, ``silu_and_mul`` in the epilogue) directly and
as the backend's ``linear_silu``."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.kernels.quantized import QuantizedWeight, pack_nibbles

pytestmark = pytest.mark.gpu

# (K, N): the 8B shape's qkv, o, gate_up and down projections.
LLAMA_8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


@pytest.fixture(scope="module")
def backend():
    from metrale.backends.cuda import CudaBackend

    backend = CudaBackend()
    yield backend
    backend.close()


def host_weight(rng, columns, inner, zeros=False, act_order=False, group=128) -> QuantizedWeight:
    scales = rng.uniform(1e-3, 3e-3, size=(columns, inner // group)).astype(np.float32)
    stored = pack_nibbles(rng.integers(0, 16, size=(columns, inner), dtype=np.uint8))
    zero_points = rng.integers(0, 16, size=scales.shape).astype(np.float32) if zeros else None
    order = rng.permutation(inner).astype(np.int32) if act_order else None
    return QuantizedWeight("int4", stored, scales, (1, group), (columns, inner), zeros=zero_points, input_order=order)


def uploaded(backend, host):
    weight = backend.quantized_weight(host)
    backend.stream.synchronize()
    return weight


def run(x, weight, host, rows):
    import cupy as cp

    from metrale.kernels import int4_gemv as ig
    from metrale.kernels.decode_gemv import multiprocessor_count

    out = cp.full((rows, host.shape[0]), np.nan, np.float32)
    workspace = cp.empty(ig.workspace_shape(rows, host), np.uint32)
    ig.int4_gemv(x, weight, out, cp.cuda.get_current_stream(), multiprocessors=multiprocessor_count(),
                 workspace=workspace)
    return cp.asnumpy(out)


def rel_error(got, expected) -> float:
    return float(np.abs(got - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("rows", [1, 4, 8, 32])
def test_the_int4_gemv_matches_the_reference_on_llama_shapes(backend, rows):
    import cupy as cp

    from metrale.kernels import int4_gemv as ig

    rng = np.random.default_rng(rows)
    for index, (inner, columns) in enumerate(LLAMA_8B):
        host = host_weight(rng, columns, inner, zeros=index % 2 == 1, act_order=index == 3)
        weight = uploaded(backend, host)
        x = rng.normal(size=(rows, inner)).astype(np.float32)
        assert rel_error(run(cp.asarray(x), weight, host, rows), ig.int4_gemv_reference(x, host)) < 2e-5, inner


@pytest.mark.parametrize("rows", [1, 8])
def test_bf16_rows_and_a_graph_replay(backend, rows):
    import cupy as cp

    from metrale.kernels import int4_gemv as ig
    from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16
    from metrale.kernels.decode_gemv import multiprocessor_count

    rng = np.random.default_rng(3)
    host = host_weight(rng, 4096, 4096, zeros=True, group=256)
    weight = uploaded(backend, host)
    x = cp.zeros((rows, 4096), np.uint16)
    out = cp.zeros((rows, 4096), np.float32)
    workspace = cp.empty(ig.workspace_shape(rows, host), np.uint32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        ig.int4_gemv(x, weight, out, stream, multiprocessors=multiprocessor_count(), workspace=workspace)
        stream.synchronize()
        stream.begin_capture()
        ig.int4_gemv(x, weight, out, stream, multiprocessors=multiprocessor_count(), workspace=workspace)
        graph = stream.end_capture()
    for seed in (1, 2):
        bits = float32_to_bf16(np.random.default_rng(seed).normal(size=(rows, 4096)).astype(np.float32))
        x.set(bits, stream=stream)
        graph.launch(stream)
        stream.synchronize()
        assert rel_error(cp.asnumpy(out), ig.int4_gemv_reference(bf16_to_float32(bits), host)) < 2e-5


@pytest.mark.parametrize("rows", [1, 3, 8, 32])
def test_the_gated_int4_gemv_is_silu_and_mul_of_the_product_on_the_8b_gate_up(backend, rows):
    import cupy as cp

    from metrale.kernels import int4_gemv as ig
    from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16
    from metrale.kernels.decode_gemv import multiprocessor_count

    rng = np.random.default_rng(rows + 60)
    host = host_weight(rng, 28672, 4096, zeros=rows % 2 == 1)
    weight = uploaded(backend, host)
    bits = float32_to_bf16(rng.normal(size=(rows, 4096)).astype(np.float32))
    x = cp.asarray(bits)
    out = cp.full((rows, 14336), 0x7FC0, np.uint16)
    workspace = None if ig.shared_stage(rows, host) else cp.empty(ig.workspace_shape(rows, host), np.uint32)
    ig.int4_gemv(x, weight, out, cp.cuda.get_current_stream(), multiprocessors=multiprocessor_count(),
                 workspace=workspace, swiglu=True)
    got = bf16_to_float32(cp.asnumpy(out))
    expected = ig.int4_gemv_reference(bf16_to_float32(bits), host, swiglu=True)
    assert not np.isnan(got).any()
    assert rel_error(got, expected) < 2.0**-7
    gated = backend.ops.linear_silu(x, weight)
    backend.stream.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(gated), cp.asnumpy(out))
