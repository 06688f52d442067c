"""The decode GEMV kernels (``metrale.kernels.decode_gemv``) against the NumPy reference on a real
GPU: Llama-1B and Llama-8B projection shapes with every prologue at 1 to 8 rows, every split of K,
float32 and bf16 outputs, a bias, the norm's summed rows, and a CUDA-graph replay with new
inputs."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import bf16, rel_error  # noqa: E402

from metrale.loading.checkpoint import bf16_to_float32

pytestmark = pytest.mark.gpu

# (mode, K, N, bf16 out): a model's decode projections -- the norm before qkv and gate_up, plain o,
# SiLU before down.
LLAMA_1B = [("rmsnorm", 2048, 3072, False), ("plain", 2048, 2048, False), ("rmsnorm", 2048, 16384, True),
            ("silu", 8192, 2048, False)]
LLAMA_8B = [("rmsnorm", 4096, 6144, False), ("plain", 4096, 4096, False), ("rmsnorm", 4096, 28672, True),
            ("silu", 14336, 4096, False)]

_weights: dict = {}


@pytest.fixture(scope="module")
def backend():
    from metrale.backends.cuda import CudaBackend

    backend = CudaBackend()
    yield backend
    backend.close()


def weight_of(inner, columns):
    import cupy as cp

    key = (inner, columns)
    if key not in _weights:
        bits = bf16(np.random.default_rng(inner + columns), (columns, inner), scale=0.02)
        _weights[key] = (bf16_to_float32(bits), cp.asarray(bits))
    return _weights[key]


def launch(mode, x, weight_device, rows, inner, columns, bf16_out, *, residual=None, norm=None, bias=None, split=None):
    import cupy as cp

    from metrale.kernels import decode_gemv as dg

    out = cp.full((rows, columns), 0x7FC0 if bf16_out else np.nan, np.uint16 if bf16_out else np.float32)
    summed = cp.full((rows, inner), np.nan, np.float32) if mode == dg.RMSNORM else None
    dg.decode_gemv(mode, cp.asarray(x), weight_device, out, cp.cuda.get_current_stream(),
                   residual=None if residual is None else cp.asarray(residual),
                   norm_weight=None if norm is None else cp.asarray(norm), summed=summed,
                   bias=None if bias is None else cp.asarray(bias), eps=1e-5, split=split)
    host = cp.asnumpy(out)
    return (bf16_to_float32(host) if bf16_out else host), (None if summed is None else cp.asnumpy(summed))


def inputs(rng, mode, rows, inner):
    """The launch's x (and residual, norm) and the reference's."""
    from metrale.kernels import decode_gemv as dg

    if mode == dg.RMSNORM:
        x = rng.standard_normal((rows, inner)).astype(np.float32)
        residual = (4 * rng.standard_normal((rows, inner))).astype(np.float32)
        norm = bf16(rng, (inner,), 0.3)
        return dict(x=x, residual=residual, norm=norm), dict(x=x, residual=residual, norm_weight=bf16_to_float32(norm))
    x = bf16(rng, (rows, 2 * inner if mode == dg.SILU else inner), 2.0)
    return dict(x=x), dict(x=bf16_to_float32(x))


# Every shape at 1, 3 and 8 rows but Llama-8B's down projection at 8 rows, whose staged rows
# (8 x 14336 x 2 bytes) exceed a block's shared memory: that shape is not served
# (tests/kernels/test_decode_gemv.py checks that supports() says so).
CASES = [(shape, rows) for shape in LLAMA_1B + LLAMA_8B for rows in (1, 3, 8) if not (shape[1] == 14336 and rows == 8)]


# The launcher's split for every case; every split for two of them (a narrow and a wide projection);
# two and four row tiles on the Llama-1B shapes whose staged rows fit (an inner size of 2,048).
CASES = [(shape, rows, None) for shape, rows in CASES] + [
    (shape, 3, split) for shape in (LLAMA_1B[1], LLAMA_1B[2]) for split in (1, 2, 4, 8)] + [
    (shape, rows, None) for shape in LLAMA_1B if shape[1] == 2048 for rows in (13, 32)]


@pytest.mark.parametrize("shape, rows, split", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}{'-bf16' if c[3] else ''}"
                         if isinstance(c, tuple) else str(c))
def test_model_shapes_match_the_reference(shape, rows, split):
    from metrale.kernels import decode_gemv as dg

    name, inner, columns, bf16_out = shape
    mode = {"plain": dg.PLAIN, "rmsnorm": dg.RMSNORM, "silu": dg.SILU}[name]
    assert dg.supports(rows, inner, mode)
    weight, weight_device = weight_of(inner, columns)
    rng = np.random.default_rng(rows + inner)
    launch_inputs, reference_inputs = inputs(rng, mode, rows, inner)
    x = launch_inputs.pop("x")
    got, summed = launch(mode, x, weight_device, rows, inner, columns, bf16_out, split=split, **launch_inputs)
    expected, expected_summed = dg.decode_gemv_reference(mode, reference_inputs.pop("x"), weight, bf16_out=bf16_out,
                                                         eps=1e-5, **reference_inputs)
    assert np.isfinite(got).all()
    assert rel_error(got, expected) <= (1e-2 if bf16_out or mode == dg.RMSNORM else 1e-4)
    if mode == dg.RMSNORM:
        np.testing.assert_array_equal(summed, expected_summed)


def test_bias_and_a_graph_replay_with_new_inputs(backend):
    """A launch records into a CUDA graph (the grid from the shapes alone) and a replay follows
    new rows written into the same buffer."""
    import cupy as cp

    from metrale.kernels import decode_gemv as dg

    inner, columns, rows = 1024, 3000, 4
    weight, weight_device = weight_of(inner, columns)
    rng = np.random.default_rng(7)
    bias = rng.standard_normal(columns).astype(np.float32)
    stream = backend.stream
    with cp.cuda.using_allocator(backend.graph_pool.malloc), backend.activate():
        x = cp.asarray(bf16(rng, (rows, inner)))
        bias_device = cp.asarray(bias)
        out = cp.zeros((rows, columns), np.float32)
        dg.decode_gemv(dg.PLAIN, x, weight_device, out, stream, bias=bias_device)  # compiles
        stream.synchronize()
        stream.begin_capture(getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", 2))
        try:
            dg.decode_gemv(dg.PLAIN, x, weight_device, out, stream, bias=bias_device)
        finally:
            graph = stream.end_capture()
    for seed in (1, 2):
        new = bf16(np.random.default_rng(seed), (rows, inner))
        with backend.activate():
            x.set(new, stream=stream)
            out.fill(np.nan)
            graph.launch(stream=stream)
            stream.synchronize()
            got = cp.asnumpy(out)
        expected, _ = dg.decode_gemv_reference(dg.PLAIN, bf16_to_float32(new), weight, bias=bias)
        assert rel_error(got, expected) <= 1e-4


@pytest.mark.parametrize("inner, units", [(2048, 8192), (4096, 14336)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_swiglu_epilogue_matches_the_reference_and_the_silu_path(backend, inner, units, rows):
    import cupy as cp

    from metrale.kernels import decode_gemv as dg
    from metrale.ops.builtin import decode_gemv_kernels

    rng = np.random.default_rng(rows + units)
    weight, weight_device = weight_of(inner, 2 * units)
    x = (3 * rng.standard_normal((rows, inner))).astype(np.float32)
    residual = rng.standard_normal((rows, inner)).astype(np.float32)
    norm = bf16(rng, (inner,), scale=0.5)
    with backend.activate():
        act = cp.full((rows, units), 0x7FC0, np.uint16)
        summed = cp.full((rows, inner), np.nan, np.float32)
        dg.decode_gemv(dg.RMSNORM_SWIGLU, cp.asarray(x), weight_device, act, backend.stream, residual=cp.asarray(residual),
                       norm_weight=cp.asarray(norm), summed=summed, eps=1e-5)
        got = bf16_to_float32(cp.asnumpy(act))
    expected, expected_summed = dg.decode_gemv_reference(dg.RMSNORM_SWIGLU, x, weight, residual=residual,
                                                         norm_weight=bf16_to_float32(norm), eps=1e-5)
    assert not np.isnan(got).any()
    assert rel_error(got, expected) <= 2e-2
    assert rel_error(cp.asnumpy(summed), expected_summed) <= 1e-6
    # The op's two paths: the gate in the gate/up kernel's epilogue, or in the down kernel's
    # prologue; the op serves only MLPs whose down rows fit the latter (not 8 rows of 14,336).
    down_bits = bf16(rng, (inner, units), scale=0.02)
    if not dg.supports(rows, units, dg.SILU):
        return
    outputs = []
    for epilogue in (False, True):
        (kernel,) = [k for k in decode_gemv_kernels(swiglu_epilogue=epilogue) if k.op == "rmsnorm_mlp"]
        with backend.activate():
            out, _ = kernel.build(backend)(cp.asarray(x), cp.asarray(residual), cp.asarray(norm), 1e-5, 0.0,
                                           weight_device, cp.asarray(down_bits))
            outputs.append(cp.asnumpy(out))
    assert rel_error(outputs[1], outputs[0]) <= 2e-2
    assert rel_error(outputs[1], expected @ bf16_to_float32(down_bits).T) <= 2e-2
