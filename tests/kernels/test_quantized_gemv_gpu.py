"""The quantized-weight kernels (``metrale.kernels.quantized_gemv``) against their NumPy references on
a real GPU: Llama-8B projection shapes in every weight code and activation scheme at 1 to 32 rows,
the prompt path's staging and dequantization, and a CUDA-graph replay with new inputs."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.kernels.quantized import QuantizedWeight, float32_to_fp8_e4m3, pack_nibbles, quantize_fp8_per_channel

pytestmark = pytest.mark.gpu

# (K, N): the 8B shape's qkv, o, gate_up and down projections.
LLAMA_8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


def host_weight(codes: str, inner: int, columns: int, activations: str, rng: np.random.Generator) -> QuantizedWeight:
    if codes == "fp8" and activations == "fp8_group":
        scales = rng.uniform(1e-4, 3e-4, size=(-(-columns // 128), -(-inner // 128))).astype(np.float32)
        stored = float32_to_fp8_e4m3(rng.normal(size=(columns, inner)).astype(np.float32) * 100)
        return QuantizedWeight("fp8", stored, scales, (128, 128), (columns, inner), activations="fp8_group")
    if codes == "fp8":
        return quantize_fp8_per_channel(rng.normal(size=(columns, inner)).astype(np.float32) * 0.02, activations)
    groups = inner // 128
    scales = rng.uniform(1e-3, 3e-3, size=(columns, groups)).astype(np.float32)
    if codes == "int4":
        stored = pack_nibbles(rng.integers(0, 16, size=(columns, inner), dtype=np.uint8))
        return QuantizedWeight("int4", stored, scales, (1, 128), (columns, inner))
    stored = rng.integers(0, 256, size=(columns, inner), dtype=np.uint8)
    return QuantizedWeight("int8", stored, scales[:, :1].copy(), (1, inner), (columns, inner), activations=activations)


@pytest.fixture(scope="module")
def backend():
    from metrale.backends.cuda import CudaBackend

    backend = CudaBackend()
    yield backend
    backend.close()


def uploaded(backend, host: QuantizedWeight) -> QuantizedWeight:
    """``host`` on the device, its copies done: the backend copies on its own stream, which the
    null stream's launches below do not wait for."""
    weight = backend.quantized_weight(host)
    backend.stream.synchronize()
    return weight


def rel_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("codes, activations", [("fp8", "fp8_token"), ("fp8", "fp8_group"), ("int4", "weight_only"),
                                                ("int8", "int8_token")])
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_the_decode_gemv_matches_the_reference_on_llama_shapes(backend, codes, activations, rows):
    import cupy as cp

    from metrale.kernels import quantized_gemv as qg

    rng = np.random.default_rng(rows)
    for inner, columns in LLAMA_8B:
        host = host_weight(codes, inner, columns, activations, rng)
        weight = uploaded(backend, host)
        x = rng.normal(size=(rows, inner)).astype(np.float32)
        out = cp.full((rows, columns), np.nan, np.float32)
        # Rows that do not fit shared memory (32 of 4,096 columns, 8 of 14,336) are staged in the workspace.
        staged_shape, scales_shape = qg.workspace_shapes(rows, host)
        workspace = (cp.empty(staged_shape, np.uint32), cp.empty(scales_shape, np.float32))
        qg.quantized_gemv(cp.asarray(x), weight, out, cp.cuda.get_current_stream(),
                          multiprocessors=qg_multiprocessors(), workspace=workspace)
        assert rel_error(cp.asnumpy(out), qg.quantized_gemv_reference(x, host)) < 1e-4


@pytest.mark.parametrize("codes, activations", [("fp8", "fp8_token"), ("int4", "weight_only"), ("int8", "int8_token")])
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_the_decode_gemv_reads_bf16_rows_as_their_float32_values(backend, codes, activations, rows):
    import cupy as cp

    from metrale.kernels import quantized_gemv as qg
    from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16

    rng = np.random.default_rng(rows + 40)
    for inner, columns in LLAMA_8B:
        host = host_weight(codes, inner, columns, activations, rng)
        weight = uploaded(backend, host)
        bits = float32_to_bf16(rng.normal(size=(rows, inner)).astype(np.float32))
        staged_shape, scales_shape = qg.workspace_shapes(rows, host)
        workspace = (cp.empty(staged_shape, np.uint32), cp.empty(scales_shape, np.float32))
        outputs = []
        for x in (cp.asarray(bf16_to_float32(bits)), cp.asarray(bits)):
            out = cp.full((rows, columns), np.nan, np.float32)
            qg.quantized_gemv(x, weight, out, cp.cuda.get_current_stream(), multiprocessors=qg_multiprocessors(),
                              workspace=workspace)
            outputs.append(cp.asnumpy(out))
        np.testing.assert_array_equal(outputs[1], outputs[0])
        assert rel_error(outputs[1], qg.quantized_gemv_reference(bf16_to_float32(bits), host)) < 1e-4


def qg_multiprocessors() -> int:
    from metrale.kernels.decode_gemv import multiprocessor_count

    return multiprocessor_count()


@pytest.mark.parametrize("codes, activations", [("fp8", "fp8_group"), ("int4", "weight_only")])
def test_the_prompt_path_stages_and_dequantizes_as_the_references(backend, codes, activations):
    import cupy as cp

    from metrale.kernels import quantized_gemv as qg
    from metrale.kernels.bf16 import bf16_to_float32

    rng = np.random.default_rng(5)
    host = host_weight(codes, 4096, 1024, activations, rng)
    weight = uploaded(backend, host)
    x = rng.normal(size=(300, 4096)).astype(np.float32)
    staged = cp.empty((300, 4096), np.uint16)
    qg.stage_activations(cp.asarray(x), weight, staged, cp.cuda.get_current_stream())
    assert np.array_equal(bf16_to_float32(cp.asnumpy(staged)), qg.stage_activations_reference(x, host))
    dense = cp.empty((1024, 4096), np.uint16)
    qg.dequantize_bf16(weight, dense, cp.cuda.get_current_stream())
    assert np.array_equal(bf16_to_float32(cp.asnumpy(dense)), qg.dequantize_bf16_reference(host))
    # The product of the two bf16 matrices (the scaled-weights reference), float32 sums.
    y = backend.ops.linear(cp.asarray(x), weight)
    assert rel_error(cp.asnumpy(y), qg.quantized_gemv_reference(x, host, exact=False)) < 1e-4


@pytest.mark.parametrize("rows", [1, 4])
def test_a_graph_replays_the_decode_gemv_with_new_inputs(backend, rows):
    import cupy as cp

    from metrale.kernels import quantized_gemv as qg

    rng = np.random.default_rng(9)
    host = host_weight("fp8", 4096, 4096, "fp8_token", rng)
    weight = uploaded(backend, host)
    x = cp.asarray(rng.normal(size=(rows, 4096)).astype(np.float32))
    # One row is staged by the GEMV's own prologue; 4 rows of these split column tiles by stage_rows first.
    assert qg.shared_stage(rows, host, qg_multiprocessors()) == (rows == 1)
    staged_shape, scales_shape = qg.workspace_shapes(rows, host)
    workspace = (cp.empty(staged_shape, np.uint32), cp.empty(scales_shape, np.float32))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out = cp.empty((rows, 4096), np.float32)
        qg.quantized_gemv(x, weight, out, stream, multiprocessors=qg_multiprocessors(),
                          workspace=workspace)  # compiles before capture
        stream.begin_capture()
        qg.quantized_gemv(x, weight, out, stream, multiprocessors=qg_multiprocessors(), workspace=workspace)
        graph = stream.end_capture()
    fresh = rng.normal(size=(rows, 4096)).astype(np.float32)
    x[...] = cp.asarray(fresh)
    graph.launch(stream)
    stream.synchronize()
    assert rel_error(cp.asnumpy(out), qg.quantized_gemv_reference(fresh, host)) < 1e-4


@pytest.mark.parametrize("codes, activations, tokens", [
    ("fp8", "fp8_group", 1), ("fp8", "fp8_group", 8), ("fp8", "fp8_group", 32),
    ("int4", "weight_only", 1), ("int4", "weight_only", 8),
])
def test_the_decode_experts_match_the_reference_on_deepseek_lite_shapes(backend, codes, activations, tokens):
    import cupy as cp

    from metrale.kernels import quantized_moe_decode as qm

    rng = np.random.default_rng(tokens)
    experts, hidden, inter, top_k = 16, 2048, 1408, 6  # DeepSeek-V2-Lite's widths, fewer experts
    gate_up = host_weight(codes, hidden, experts * 2 * inter, activations, rng)
    down = host_weight(codes, inter, experts * hidden, activations, rng)
    x = rng.normal(size=(tokens, hidden)).astype(np.float32)
    chosen = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, size=(tokens, top_k)).astype(np.float32)
    out = backend.ops.moe_experts(cp.asarray(x), cp.asarray(chosen), cp.asarray(weights),
                                  uploaded(backend, gate_up), uploaded(backend, down))
    if codes == "fp8":
        # The FP8 GEMV's routed form: the codes' exact products. Its gated values may round to the
        # other bf16 neighbour, and a down input then to the neighbouring FP8 code.
        from metrale.kernels import fp8_gemv as fg

        assert fg.serves_experts(tokens, top_k, gate_up, down)
        expected = fg.fp8_decode_experts_reference(x, chosen, weights, gate_up, down)
        assert rel_error(cp.asnumpy(out), expected) < 2e-3
        return
    expected = qm.quantized_decode_experts_reference(x, chosen, weights, gate_up, down)
    assert rel_error(cp.asnumpy(out), expected) < 1e-4


@pytest.mark.parametrize("tokens", [1, 32])
def test_the_fp8_routed_experts_read_bf16_rows_as_their_float32_values(backend, tokens):
    """``moe_experts`` of bf16 rows (a norm's output, not widened first) gives the float32 rows' bits."""
    import cupy as cp

    from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16

    rng = np.random.default_rng(tokens + 5)
    experts, hidden, inter, top_k = 16, 2048, 1408, 6
    gate_up = uploaded(backend, host_weight("fp8", hidden, experts * 2 * inter, "fp8_group", rng))
    down = uploaded(backend, host_weight("fp8", inter, experts * hidden, "fp8_group", rng))
    bits = float32_to_bf16(rng.normal(size=(tokens, hidden)).astype(np.float32))
    chosen = cp.asarray(np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32))
    weights = cp.asarray(rng.uniform(0.1, 1.0, size=(tokens, top_k)).astype(np.float32))
    from_bits = backend.ops.moe_experts(cp.asarray(bits), chosen, weights, gate_up, down)
    from_floats = backend.ops.moe_experts(cp.asarray(bf16_to_float32(bits)), chosen, weights, gate_up, down)
    backend.synchronize()
    assert cp.array_equal(from_bits, from_floats)


@pytest.mark.parametrize("activations", ["fp8_token", "fp8_tensor"])
def test_prompt_rows_of_fp8_take_the_fp8_tensor_cores(backend, activations):
    """Per-channel FP8 weights and FP8 inputs: the codes' product on FP8 tensor cores (cuBLASLt),
    rows and columns scaled after, equal to the reference's float32 math within accumulation
    error; the bf16 path is not taken."""
    import cupy as cp

    from metrale.kernels import quantized_gemv as qg
    from metrale.kernels.quantized import quantized_linear_reference

    rng = np.random.default_rng(17)
    host = quantize_fp8_per_channel(rng.normal(size=(4096, 4096)).astype(np.float32) * 0.02, "fp8_token")
    if activations == "fp8_tensor":
        host = QuantizedWeight("fp8", host.codes, host.scales, host.block, host.shape, activations="fp8_tensor",
                               input_scale=np.asarray(0.05, np.float32))
    assert qg.fp8_tensor_core_path(host)
    weight = uploaded(backend, host)
    x = rng.normal(size=(512, 4096)).astype(np.float32)
    y = cp.asnumpy(backend.ops.linear(cp.asarray(x), weight))
    assert backend.kernels._fp8_unserved == set()  # cuBLASLt served the shape in FP8
    # Hopper's FP8 tensor cores keep fewer mantissa bits than float32 in their partial sums.
    assert rel_error(y, quantized_linear_reference(x, host)) < 5e-4


def test_the_fp8_product_applies_the_scales_in_its_epilogue_as_the_scaling_pass_does(backend):
    """cuBLASLt's outer-vector scales (a scale per row of x and per row of W, in the product's
    epilogue, bf16 out) against the unscaled FP8 product and the one-pass scaling kernel; bf16 rows
    give the float32 rows' codes; ``linear_silu`` of prompt rows takes the bf16 product, at a row
    count the library serves as it is and at one it serves only padded to a multiple of 16."""
    import cupy as cp

    from metrale.kernels import quantized_gemv as qg
    from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16
    from metrale.kernels.linear import CublasLtGemm
    from metrale.kernels.quantized import quantized_linear_reference

    rng = np.random.default_rng(19)
    host = quantize_fp8_per_channel(rng.normal(size=(3072, 2048)).astype(np.float32) * 0.02, "fp8_token")
    weight = uploaded(backend, host)
    rows = 2048
    bits = float32_to_bf16(rng.normal(size=(rows, 2048)).astype(np.float32))
    stream = backend.stream
    # The inputs held until the stream is synchronised: the kernels run on the backend's stream,
    # and a temporary's memory freed at once could be overwritten by the next upload meanwhile.
    bits_device, floats_device = cp.asarray(bits), cp.asarray(bf16_to_float32(bits))
    codes, scales = cp.empty((rows, 2048), np.uint8), cp.empty(rows, np.float32)
    qg.quantize_rows_fp8(bits_device, weight, codes, scales, stream)
    codes_f32, scales_f32 = cp.empty_like(codes), cp.empty_like(scales)
    qg.quantize_rows_fp8(floats_device, weight, codes_f32, scales_f32, stream)
    column_scales = cp.ascontiguousarray(weight.scales[:, 0])
    gemm = CublasLtGemm(stream)
    unscaled = cp.empty((rows, 3072), np.float32)
    gemm.fp8(codes, weight.codes, unscaled)
    qg.scale_product(unscaled, scales, column_scales, stream)
    scaled_bf16 = gemm.fp8(codes, weight.codes, cp.empty((rows, 3072), np.uint16), row_scales=scales,
                           column_scales=column_scales)
    stream.synchronize()
    assert cp.array_equal(codes, codes_f32) and cp.array_equal(scales, scales_f32)
    expected = cp.asnumpy(unscaled)
    assert rel_error(bf16_to_float32(cp.asnumpy(scaled_bf16)), expected) < 2.0**-8

    for count in (rows, 300, 37):
        x = bf16_to_float32(bits[:count])
        gated = backend.ops.linear_silu(cp.asarray(bits[:count]), weight)
        backend.synchronize()
        # the bf16 product with its scales was served, for 300 and 37 rows padded to 304 and 48
        assert backend.kernels._fp8_epilogue_rows[(count, 2048, 3072)] in (count, -(-count // 16) * 16)
        gate_up = quantized_linear_reference(x, host)
        gate, up = gate_up[:, :1536], gate_up[:, 1536:]
        reference = gate / (1 + np.exp(-gate)) * up
        got = cp.asnumpy(gated)
        assert got.shape == reference.shape
        got = bf16_to_float32(got) if got.dtype == np.uint16 else got
        assert rel_error(got, reference) < 2e-2


@pytest.mark.parametrize("activations", ["fp8_token", "fp8_tensor"])
@pytest.mark.parametrize("rows, width", [(300, 14336), (37, 28672), (8, 8)])
def test_silu_and_mul_fp8_rows_writes_the_codes_of_silu_and_mul_then_quantize_rows(backend, activations, rows, width):
    """The fused pass against the two kernels it replaces, bit for bit; 28,672 values a row take
    more than 48 KB of shared memory."""
    import cupy as cp

    from metrale.kernels import activation
    from metrale.kernels import quantized_gemv as qg
    from metrale.kernels.bf16 import float32_to_bf16

    rng = np.random.default_rng(width)
    weight = uploaded(backend, host_weight("fp8", width, 16, "fp8_token", rng))
    if activations == "fp8_tensor":
        weight = QuantizedWeight("fp8", weight.codes, weight.scales, weight.block, weight.shape, activations="fp8_tensor",
                                 input_scale=np.float32(0.05))
    gate_up = cp.asarray(float32_to_bf16(rng.normal(size=(rows, 2 * width)).astype(np.float32)
                                         * rng.uniform(1e-3, 30, size=(rows, 1)).astype(np.float32)))
    stream = backend.stream
    codes, scales = cp.empty((rows, width), np.uint8), cp.empty(rows, np.float32)
    qg.silu_and_mul_fp8_rows(gate_up, weight, codes, scales, stream)
    act = activation.silu_and_mul_words(gate_up, cp.empty((rows, width), np.uint16), stream)
    expected_codes, expected_scales = cp.empty_like(codes), cp.empty_like(scales)
    qg.quantize_rows_fp8(act, weight, expected_codes, expected_scales, stream)
    stream.synchronize()
    assert cp.array_equal(scales, expected_scales)
    assert cp.array_equal(codes, expected_codes)


@pytest.mark.parametrize("rows", [2048, 300])
def test_the_fp8_prompt_mlp_gives_the_unfused_ops_bits(backend, rows, monkeypatch):
    """``rmsnorm_mlp`` of FP8 prompt rows (the gate and the down product's input rows in one pass)
    against its parts through the op table: the same bits."""
    import cupy as cp

    fused = []
    product = backend.kernels.fp8_silu_product
    monkeypatch.setattr(backend.kernels, "fp8_silu_product", lambda *a, **k: fused.append(product(*a, **k)) or fused[-1])
    rng = np.random.default_rng(rows)
    gate_up = uploaded(backend, host_weight("fp8", 2048, 2 * 5632, "fp8_token", rng))
    down = uploaded(backend, host_weight("fp8", 5632, 2048, "fp8_token", rng))
    norm = backend.weight(rng.uniform(0.5, 1.5, size=2048).astype(np.float32))
    x = cp.asarray(rng.normal(size=(rows, 2048)).astype(np.float32))
    residual = cp.asarray(rng.normal(size=(rows, 2048)).astype(np.float32))
    ops = backend.ops
    # (Each call on copies: the norm may add the residual in place.)
    out, summed = ops.rmsnorm_mlp(x.copy(), residual.copy(), norm, 1e-5, 0.0, gate_up, down)
    assert len(fused) == 1 and fused[0] is not None   # the fused pass served it
    normed, expected_summed = ops.rmsnorm_residual(x.copy(), residual.copy(), norm, 1e-5, 0.0)
    expected = ops.linear(ops.linear_silu(normed, gate_up), down)
    backend.synchronize()
    assert cp.array_equal(summed, expected_summed)
    assert out.dtype == np.float32 and cp.array_equal(out, expected)


@pytest.mark.parametrize("activations", ["fp8_token", "fp8_tensor"])
@pytest.mark.parametrize("rows, width, add_residual", [(2048, 4096, True), (37, 8192, True), (9, 4, False)])
def test_rmsnorm_fp8_rows_writes_the_sums_and_codes_of_the_norm_then_quantize_rows(backend, activations, rows, width,
                                                                                  add_residual):
    """The fused pass against the two kernels it replaces, bit for bit: the sums (in place), codes
    and scales."""
    import cupy as cp

    from metrale.kernels import quantized_gemv as qg
    from metrale.kernels import rmsnorm
    from metrale.kernels.bf16 import float32_to_bf16

    rng = np.random.default_rng(width + rows)
    weight = uploaded(backend, host_weight("fp8", width, 16, "fp8_token", rng))
    if activations == "fp8_tensor":
        weight = QuantizedWeight("fp8", weight.codes, weight.scales, weight.block, weight.shape, activations="fp8_tensor",
                                 input_scale=np.float32(0.05))
    magnitudes = rng.uniform(1e-3, 30, size=(rows, 1)).astype(np.float32)
    x = cp.asarray(rng.normal(size=(rows, width)).astype(np.float32) * magnitudes)
    residual = cp.asarray(rng.normal(size=(rows, width)).astype(np.float32) * magnitudes)
    gains = cp.asarray(float32_to_bf16(rng.uniform(-1.5, 1.5, size=width).astype(np.float32)))
    stream = backend.stream
    summed, codes, scales = residual.copy(), cp.empty((rows, width), np.uint8), cp.empty(rows, np.float32)
    qg.rmsnorm_fp8_rows(x, summed, gains, 1e-5, 0.0, add_residual, weight, codes, scales, stream)
    expected_summed, normed = residual.copy(), cp.empty((rows, width), np.uint16)
    rmsnorm.rmsnorm_residual_words(x, expected_summed, gains, 1e-5, 0.0, add_residual, normed, stream)
    expected_codes, expected_scales = cp.empty_like(codes), cp.empty_like(scales)
    qg.quantize_rows_fp8(normed, weight, expected_codes, expected_scales, stream)
    stream.synchronize()
    assert cp.array_equal(summed, expected_summed)
    assert cp.array_equal(scales, expected_scales)
    assert cp.array_equal(codes, expected_codes)


@pytest.mark.parametrize("rows, bias, cublas_has_algorithm", [(2048, False, True), (300, True, True),
                                                             (64, False, False)])
def test_the_fp8_prompt_norm_linear_gives_the_unfused_ops_bits(backend, rows, bias, cublas_has_algorithm, monkeypatch):
    """``rmsnorm_linear`` of FP8 prompt rows (the norm written as the product's FP8 rows) against its
    parts through the op table: the same bits; where cuBLASLt turns out to have no FP8 algorithm
    after the norm ran, the sum is normed again (not added twice) and the unfused ops serve it (the
    bf16 product of the dequantized weight, as ``linear`` takes it then)."""
    import cupy as cp

    fused = []
    product = backend.kernels.fp8_norm_product
    monkeypatch.setattr(backend.kernels, "fp8_norm_product",
                        lambda *a, **k: fused.append(product(*a, **k)) or fused[-1])
    if not cublas_has_algorithm:
        codes_product = backend.kernels._fp8_codes_product
        monkeypatch.setattr(backend.kernels, "_fp8_codes_product",
                            lambda codes, *a, **k: None if codes.shape[0] >= rows else codes_product(codes, *a, **k))
    rng = np.random.default_rng(rows)
    weight = uploaded(backend, host_weight("fp8", 2048, 3072, "fp8_token", rng))
    norm = backend.weight(rng.uniform(0.5, 1.5, size=2048).astype(np.float32))
    bias_values = backend.constant(rng.normal(size=3072).astype(np.float32)) if bias else None
    x = cp.asarray(rng.normal(size=(rows, 2048)).astype(np.float32))
    residual = cp.asarray(rng.normal(size=(rows, 2048)).astype(np.float32))
    ops = backend.ops
    out, summed = ops.rmsnorm_linear(x.copy(), residual.copy(), norm, 1e-5, 0.0, weight, bias_values)
    assert len(fused) == 1 and fused[0] is not None and (fused[0][0] is not None) == cublas_has_algorithm
    normed, expected_summed = ops.rmsnorm_residual(x.copy(), residual.copy(), norm, 1e-5, 0.0)
    backend.synchronize()
    assert cp.array_equal(summed, expected_summed)
    expected = ops.linear(normed, weight, bias_values)   # (without an algorithm: the bf16 product, as the op's)
    backend.synchronize()
    assert out.dtype == np.float32 and cp.array_equal(out, expected)


@pytest.mark.parametrize("rows, columns, offset", [(37, 4096, 0), (5, 4099, 0), (2500, 64, 0), (9, 4096, 1)])
def test_scale_product_scales_rows_then_columns_in_one_pass(backend, rows, columns, offset):
    """Vector rows, odd widths, more rows than the grid has, column scales off a 16-byte boundary."""
    import cupy as cp

    from metrale.kernels import quantized_gemv

    rng = np.random.default_rng(21)
    product = rng.normal(size=(rows, columns)).astype(np.float32) * 1e3
    row_scales = rng.uniform(1e-3, 1e-1, size=rows).astype(np.float32)
    column_scales = rng.uniform(1e-4, 1e-2, size=columns + offset).astype(np.float32)
    out = cp.asarray(product)
    quantized_gemv.scale_product(out, cp.asarray(row_scales), cp.asarray(column_scales)[offset:], backend.stream)
    backend.synchronize()
    expected = (product * row_scales[:, None]).astype(np.float32) * column_scales[None, offset:]
    assert np.array_equal(cp.asnumpy(out), expected.astype(np.float32))


def test_the_fp8_routed_experts_replay_in_a_cuda_graph_with_new_choices(backend):
    """The FP8 routed-expert GEMV captured once: new inputs and new expert choices in the same
    buffers give the reference's result for them on replay (each pair finds its expert on the
    device)."""
    import cupy as cp

    from metrale.kernels import fp8_gemv as fg

    rng = np.random.default_rng(23)
    experts, hidden, inter, top_k, tokens = 16, 2048, 1408, 6, 2
    gate_up = host_weight("fp8", hidden, experts * 2 * inter, "fp8_group", rng)
    down = host_weight("fp8", inter, experts * hidden, "fp8_group", rng)
    device_gate_up, device_down = uploaded(backend, gate_up), uploaded(backend, down)

    def case():
        x = rng.normal(size=(tokens, hidden)).astype(np.float32)
        chosen = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
        return x, chosen, rng.uniform(0.1, 1.0, size=(tokens, top_k)).astype(np.float32)

    x, chosen, weights = case()
    arrays = [cp.asarray(a) for a in (x, chosen, weights)]
    act = cp.empty((tokens * top_k, inter), dtype=np.uint16)
    partial = cp.empty((tokens * top_k, hidden), dtype=np.float32)
    out = cp.zeros((tokens, hidden), dtype=np.float32)
    stream = cp.cuda.Stream(non_blocking=True)

    def run():
        fg.fp8_decode_experts(*arrays, device_gate_up, device_down, act, partial, out, stream,
                              multiprocessors=qg_multiprocessors())

    run()  # compiled outside the capture
    stream.synchronize()
    with stream:
        stream.begin_capture()
        run()
        graph = stream.end_capture()
    for _ in range(2):
        x, chosen, weights = case()
        for target, value in zip(arrays, (x, chosen, weights)):
            target.set(value, stream=stream)
        graph.launch(stream)
        stream.synchronize()
        assert rel_error(cp.asnumpy(out), fg.fp8_decode_experts_reference(x, chosen, weights, gate_up, down)) < 2e-3
