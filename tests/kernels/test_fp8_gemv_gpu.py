"""The FP8 decode GEMV (``metrale.kernels.fp8_gemv``) against its NumPy reference on a real GPU:
the Llama-8B projection shapes at 1 to 32 rows (staged in shared memory and in the workspace),
float32 and bf16 rows, per-channel and per-tensor scales, a bias, a CUDA-graph replay with new
inputs, the backend's ``linear`` choosing it for decode rows, and its gated form (the 8B gate/up
projection, ``silu_and_mul`` in the epilogue) directly and as the backend's ``linear_silu``."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.kernels.quantized import QuantizedWeight, float32_to_fp8_e4m3, quantize_fp8_per_channel

pytestmark = pytest.mark.gpu

# (K, N): the 8B shape's qkv, o, gate_up and down projections.
LLAMA_8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


@pytest.fixture(scope="module")
def backend():
    from metrale.backends.cuda import CudaBackend

    backend = CudaBackend()
    yield backend
    backend.close()


def uploaded(backend, host: QuantizedWeight) -> QuantizedWeight:
    """``host`` on the device, its copies done (the backend copies on its own stream)."""
    weight = backend.quantized_weight(host)
    backend.stream.synchronize()
    return weight


def multiprocessors() -> int:
    from metrale.kernels.decode_gemv import multiprocessor_count

    return multiprocessor_count()


def rel_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def run(x, weight, host, rows, bias=None):
    import cupy as cp

    from metrale.kernels import fp8_gemv as fg

    out = cp.full((rows, host.shape[0]), np.nan, np.float32)
    staged_shape, scales_shape = fg.workspace_shapes(rows, host)
    workspace = (cp.empty(staged_shape, np.uint32), cp.empty(scales_shape, np.float32))
    fg.fp8_gemv(x, weight, out, cp.cuda.get_current_stream(), bias=bias, multiprocessors=multiprocessors(),
                workspace=workspace)
    return cp.asnumpy(out)


@pytest.mark.parametrize("rows", [1, 3, 8, 32])
@pytest.mark.parametrize("bf16_rows", [False, True])
def test_the_fp8_gemv_matches_the_reference_on_llama_shapes(backend, rows, bf16_rows):
    import cupy as cp

    from metrale.kernels import fp8_gemv as fg
    from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16

    rng = np.random.default_rng(rows)
    for inner, columns in LLAMA_8B:
        host = quantize_fp8_per_channel(rng.normal(size=(columns, inner)).astype(np.float32) * 0.02, "fp8_token")
        weight = uploaded(backend, host)
        x = rng.normal(size=(rows, inner)).astype(np.float32)
        x[0, :5] *= 40
        if bf16_rows:
            bits = float32_to_bf16(x)
            x = bf16_to_float32(bits)
            got = run(cp.asarray(bits), weight, host, rows)
        else:
            got = run(cp.asarray(x), weight, host, rows)
        assert rel_error(got, fg.fp8_gemv_reference(x, host)) < 2e-5, (inner, columns)


def test_per_tensor_scales_a_static_input_scale_and_a_bias(backend):
    import cupy as cp

    from metrale.kernels import fp8_gemv as fg

    rng = np.random.default_rng(5)
    columns, inner = 1000, 2048  # a partial column tile
    host = QuantizedWeight("fp8", float32_to_fp8_e4m3(rng.normal(size=(columns, inner)).astype(np.float32) * 50),
                           np.asarray([[0.003]], np.float32), (columns, inner), (columns, inner),
                           activations="fp8_tensor", input_scale=np.asarray(0.01, np.float32))
    weight = uploaded(backend, host)
    bias = rng.normal(size=columns).astype(np.float32)
    for rows in (1, 6):
        x = rng.normal(size=(rows, inner)).astype(np.float32)
        got = run(cp.asarray(x), weight, host, rows, bias=cp.asarray(bias))
        assert rel_error(got, fg.fp8_gemv_reference(x, host, bias)) < 2e-5


@pytest.mark.parametrize("rows", [1, 8])
def test_a_graph_replays_the_fp8_gemv_with_new_inputs(backend, rows):
    import cupy as cp

    from metrale.kernels import fp8_gemv as fg

    rng = np.random.default_rng(9)
    inner, columns = 4096, 6144
    host = quantize_fp8_per_channel(rng.normal(size=(columns, inner)).astype(np.float32) * 0.02, "fp8_token")
    weight = uploaded(backend, host)
    x = cp.zeros((rows, inner), np.float32)
    out = cp.zeros((rows, columns), np.float32)
    staged_shape, scales_shape = fg.workspace_shapes(rows, host)
    workspace = (cp.empty(staged_shape, np.uint32), cp.empty(scales_shape, np.float32))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fg.fp8_gemv(x, weight, out, stream, multiprocessors=multiprocessors(), workspace=workspace)
        stream.synchronize()
        stream.begin_capture()
        fg.fp8_gemv(x, weight, out, stream, multiprocessors=multiprocessors(), workspace=workspace)
        graph = stream.end_capture()
    for seed in (1, 2):
        values = np.random.default_rng(seed).normal(size=(rows, inner)).astype(np.float32)
        x.set(values, stream=stream)
        graph.launch(stream)
        stream.synchronize()
        assert rel_error(cp.asnumpy(out), fg.fp8_gemv_reference(values, host)) < 2e-5


def test_the_backend_takes_the_fp8_gemv_for_decode_rows(backend):
    import cupy as cp

    from metrale.kernels import fp8_gemv as fg
    from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16

    rng = np.random.default_rng(11)
    host = quantize_fp8_per_channel(rng.normal(size=(512, 1024)).astype(np.float32) * 0.02, "fp8_token")
    weight = uploaded(backend, host)
    bits = float32_to_bf16(rng.normal(size=(2, 1024)).astype(np.float32))
    x = cp.asarray(bits)
    backend.stream.synchronize()
    got = backend.ops.linear(x, weight)
    backend.stream.synchronize()
    assert rel_error(cp.asnumpy(got), fg.fp8_gemv_reference(bf16_to_float32(bits), host)) < 2e-5
    # The very sums of a direct launch (the general quantized GEMV scales every 32 columns' sums).
    np.testing.assert_array_equal(cp.asnumpy(got), run(x, weight, host, 2))


@pytest.mark.parametrize("rows", [1, 2, 5, 32])
def test_the_gated_fp8_gemv_is_silu_and_mul_of_the_product_on_the_8b_gate_up(backend, rows):
    import cupy as cp

    from metrale.kernels import fp8_gemv as fg
    from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16

    rng = np.random.default_rng(rows + 40)
    host = quantize_fp8_per_channel(rng.normal(size=(28672, 4096)).astype(np.float32) * 0.02, "fp8_token")
    weight = uploaded(backend, host)
    bits = float32_to_bf16(rng.normal(size=(rows, 4096)).astype(np.float32))
    x = cp.asarray(bits)
    out = cp.full((rows, 14336), 0x7FC0, np.uint16)
    workspace = None
    if not fg.shared_stage(rows, host):
        staged_shape, scales_shape = fg.workspace_shapes(rows, host)
        workspace = (cp.empty(staged_shape, np.uint32), cp.empty(scales_shape, np.float32))
    fg.fp8_gemv(x, weight, out, cp.cuda.get_current_stream(), multiprocessors=multiprocessors(), workspace=workspace,
                swiglu=True)
    got = bf16_to_float32(cp.asnumpy(out))
    values = bf16_to_float32(bits)
    expected = fg.fp8_gemv_reference(values, host, swiglu=True)
    assert not np.isnan(got).any()
    assert rel_error(got, expected) < 2.0**-7
    if rows < 8:  # (from 8 rows the backend takes the FP8 tensor cores)
        gated = backend.ops.linear_silu(x, weight)
        backend.stream.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(gated), cp.asnumpy(out))


@pytest.mark.parametrize("rows, with_residual", [(1, True), (3, False), (4, True)])
@pytest.mark.parametrize("block", [False, True])
def test_the_norm_prologue_on_the_8b_shapes_through_the_backend(backend, rows, with_residual, block):
    """``rmsnorm_linear`` (qkv) and ``rmsnorm_mlp`` of FP8 weights with the norm in the FP8 GEMV's
    prologue, against the reference of the unfused ops: per-channel weights with per-token inputs,
    and block-wise FP8 (a scale per group of 128 normed values)."""
    import cupy as cp

    from metrale.kernels import fp8_gemv as fg
    from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16

    rng = np.random.default_rng(rows + 80)
    x = rng.normal(size=(rows, 4096)).astype(np.float32)
    residual = rng.normal(size=(rows, 4096)).astype(np.float32) if with_residual else None
    gains = float32_to_bf16(rng.uniform(0.5, 1.5, size=4096).astype(np.float32))

    def weight(shape):
        if not block:
            return quantize_fp8_per_channel(rng.normal(size=shape).astype(np.float32) * 0.02, "fp8_token")
        scales = rng.uniform(1e-4, 3e-4, size=(shape[0] // 128, shape[1] // 128)).astype(np.float32)
        return QuantizedWeight("fp8", float32_to_fp8_e4m3(rng.normal(size=shape).astype(np.float32) * 100), scales,
                               (128, 128), shape, activations="fp8_group")

    qkv, gate_up, down = (weight(shape) for shape in ((6144, 4096), (28672, 4096), (4096, 14336)))
    assert all(fg.serves_norm(rows, w) for w in (qkv, gate_up))
    device = {name: uploaded(backend, host) for name, host in (("qkv", qkv), ("gate_up", gate_up), ("down", down))}
    normed, summed = fg.norm_reference(x, residual, bf16_to_float32(gains), 1e-5)
    args = (cp.asarray(x), None if residual is None else cp.asarray(residual), cp.asarray(gains), 1e-5, 0.0)
    out, got_summed = backend.ops.rmsnorm_linear(*args, device["qkv"])
    mlp, mlp_summed = backend.ops.rmsnorm_mlp(*args, device["gate_up"], device["down"])
    backend.stream.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(got_summed), summed)
    np.testing.assert_array_equal(cp.asnumpy(mlp_summed), summed)
    assert rel_error(cp.asnumpy(out), fg.fp8_gemv_reference(normed, qkv)) < 2e-2
    act = fg.fp8_gemv_reference(normed, gate_up, swiglu=True)
    assert rel_error(cp.asnumpy(mlp), fg.fp8_gemv_reference(act, down)) < 3e-2


@pytest.mark.parametrize("rows", [1, 4, 9, 32])
def test_block_fp8_on_the_8b_shapes_and_through_the_backend(backend, rows):
    """Block-wise FP8 (128 x 128 weight scales, inputs per group of 128, as DeepSeek-V3 and
    Qwen3-FP8 store them): the GEMV against its reference on the 8B shapes, and the backend's
    ``linear`` and ``linear_silu`` choosing it."""
    import cupy as cp

    from metrale.kernels import fp8_gemv as fg
    from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16

    rng = np.random.default_rng(rows + 100)
    for inner, columns in LLAMA_8B:
        scales = rng.uniform(1e-4, 4e-4, size=(-(-columns // 128), -(-inner // 128))).astype(np.float32)
        stored = float32_to_fp8_e4m3(rng.normal(size=(columns, inner)).astype(np.float32) * 100)
        host = QuantizedWeight("fp8", stored, scales, (128, 128), (columns, inner), activations="fp8_group",
                               activation_group=128)
        weight = uploaded(backend, host)
        bits = float32_to_bf16(rng.normal(size=(rows, inner)).astype(np.float32))
        values = bf16_to_float32(bits)
        got = run(cp.asarray(bits), weight, host, rows)
        assert rel_error(got, fg.fp8_gemv_reference(values, host)) < 2e-5, (inner, columns)
        through = backend.ops.linear(cp.asarray(bits), weight)
        backend.stream.synchronize()
        assert rel_error(cp.asnumpy(through), fg.fp8_gemv_reference(values, host)) < 2e-5
        if columns == 28672:
            gated = backend.ops.linear_silu(cp.asarray(bits), weight)
            backend.stream.synchronize()
            got_gated = bf16_to_float32(cp.asnumpy(gated))
            assert rel_error(got_gated, fg.fp8_gemv_reference(values, host, swiglu=True)) < 2.0**-7
