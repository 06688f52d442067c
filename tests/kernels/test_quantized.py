"""The quantized-weight layout and its NumPy references: the number codecs against torch's own
casts, dequantization against values computed here from the definitions, and the quantized
product against an independent float64 computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metrale.errors import QuantizationError
from metrale.kernels.quantized import (
    FP8_E4M3_MAX,
    QuantizedWeight,
    concatenate_weights,
    dequantize,
    e8m0_to_float32,
    float32_to_fp8_e4m3,
    fp4_e2m1_to_float32,
    fp8_e4m3_table,
    pack_nibbles,
    quantize_activations,
    quantize_fp8_per_channel,
    quantized_linear_reference,
    round_to_fp8,
    unpack_nibbles,
)


def torch_fp8_bits(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(values).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def test_every_e4m3_pattern_decodes_as_torch_does():
    torch_values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    ours = fp8_e4m3_table()
    assert np.array_equal(np.isnan(ours), np.isnan(torch_values))
    assert np.array_equal(ours[~np.isnan(ours)], torch_values[~np.isnan(torch_values)])


def test_encoding_rounds_as_torch_and_saturates():
    rng = np.random.default_rng(0)
    values = np.concatenate([
        rng.normal(size=20000).astype(np.float32) * 50,
        rng.normal(size=2000).astype(np.float32) * 1e-3,  # subnormals
        # Ties between neighbouring codes, zeros of both signs, the largest finite value.
        (fp8_e4m3_table()[1:126] + fp8_e4m3_table()[2:127]) / 2,
        np.array([0.0, -0.0, FP8_E4M3_MAX, -FP8_E4M3_MAX], np.float32),
    ]).astype(np.float32)
    assert np.array_equal(float32_to_fp8_e4m3(values), torch_fp8_bits(values))
    # Beyond the range: clamped to +-448 (a quantizer clamps before the cast).
    assert fp8_e4m3_table()[float32_to_fp8_e4m3(np.array([1e6, -500.0], np.float32))].tolist() == [448.0, -448.0]


def test_fp4_and_e8m0_follow_the_ocp_definitions():
    assert fp4_e2m1_to_float32(np.arange(16)).tolist() == [
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert e8m0_to_float32(np.array([127, 128, 120, 0], np.uint8)).tolist() == [1.0, 2.0, 2.0**-7, 2.0**-127]
    assert np.isnan(e8m0_to_float32(np.array([255], np.uint8)))[0]


def test_nibbles_pack_even_columns_low():
    values = np.array([[1, 2, 3], [15, 0, 7]], np.uint8)
    packed = pack_nibbles(values)
    assert packed.tolist() == [[0x21, 0x03], [0x0F, 0x07]]
    assert np.array_equal(unpack_nibbles(packed, 3), values)


def int4_weight(rng: np.random.Generator, out: int, inner: int, group: int,
                asymmetric: bool) -> tuple[QuantizedWeight, np.ndarray]:
    codes = rng.integers(0, 16, size=(out, inner), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, size=(out, inner // group)).astype(np.float32)
    zeros = rng.integers(0, 16, size=(out, inner // group)).astype(np.float32) if asymmetric else None
    expected = np.empty((out, inner), np.float64)
    for r in range(out):
        for c in range(inner):
            zero = zeros[r, c // group] if zeros is not None else 8.0
            expected[r, c] = (float(codes[r, c]) - zero) * scales[r, c // group]
    weight = QuantizedWeight("int4", pack_nibbles(codes), scales, (1, group), (out, inner), zeros=zeros)
    return weight, expected


@pytest.mark.parametrize("asymmetric", [False, True])
def test_int4_dequantizes_by_group(asymmetric):
    weight, expected = int4_weight(np.random.default_rng(1), 6, 32, 8, asymmetric)
    assert np.allclose(dequantize(weight), expected, rtol=0, atol=1e-6)


def test_block_scales_cover_ragged_edges():
    rng = np.random.default_rng(2)
    out, inner, block = 5, 7, (2, 4)
    codes = float32_to_fp8_e4m3(rng.normal(size=(out, inner)).astype(np.float32))
    scales = rng.uniform(0.5, 2, size=(3, 2)).astype(np.float32)
    weight = QuantizedWeight("fp8", codes, scales, block, (out, inner))
    values = fp8_e4m3_table()[codes]
    expected = np.array([[values[r, c] * scales[r // 2, c // 4] for c in range(inner)] for r in range(out)])
    assert np.array_equal(dequantize(weight), expected.astype(np.float32))


def test_act_order_permutes_the_input_not_the_result():
    rng = np.random.default_rng(3)
    weight, stored = int4_weight(rng, 4, 16, 4, asymmetric=False)
    order = rng.permutation(16).astype(np.int32)
    permuted = QuantizedWeight("int4", weight.codes, weight.scales, weight.block, weight.shape, input_order=order)
    original = np.empty_like(stored)
    original[:, order] = stored  # stored column j is the original column order[j]
    assert np.allclose(dequantize(permuted), original, atol=1e-6)
    x = rng.normal(size=(3, 16)).astype(np.float32)
    assert np.allclose(quantized_linear_reference(x, permuted), x.astype(np.float64) @ original.T, atol=1e-4)


def test_the_product_quantizes_inputs_per_token():
    rng = np.random.default_rng(4)
    weight = quantize_fp8_per_channel(rng.normal(size=(8, 32)).astype(np.float32))
    x = rng.normal(size=(3, 32)).astype(np.float32) * np.array([[1.0], [100.0], [1e-3]], np.float32)
    xq = np.empty_like(x, dtype=np.float64)
    for n in range(3):
        scale = np.abs(x[n]).max() / 448.0
        xq[n] = torch.from_numpy(x[n] / np.float32(scale)).to(torch.float8_e4m3fn).float().numpy() * scale
    expected = xq @ dequantize(weight).astype(np.float64).T
    got = quantized_linear_reference(x, weight)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def test_int8_inputs_round_half_to_even_at_127_steps():
    weight = QuantizedWeight("int8", np.full((1, 4), 129, np.uint8), np.ones((1, 1), np.float32), (1, 4), (1, 4),
                             activations="int8_token")
    x = np.array([[127.0, 0.5, 1.5, -2.5]], np.float32)  # scale 1: 0.5 -> 0, 1.5 -> 2, -2.5 -> -2
    assert quantize_activations(x, weight).tolist() == [[127.0, 0.0, 2.0, -2.0]]
    assert quantized_linear_reference(x, weight).tolist() == [[127.0]]


def test_group_inputs_take_a_scale_per_128_columns():
    weight = quantize_fp8_per_channel(np.ones((1, 256), np.float32), activations="fp8_group")
    x = np.concatenate([np.full(128, 1000.0), np.full(128, 0.01)]).astype(np.float32)[None]
    # Each group is its own amax, so both are exact (one scale for the row would flush 0.01 to 0).
    assert np.array_equal(quantize_activations(x, weight), x)


def test_concatenation_keeps_each_part_and_slicing_takes_rows():
    rng = np.random.default_rng(5)
    parts = [QuantizedWeight("fp8", float32_to_fp8_e4m3(rng.normal(size=(rows, 8)).astype(np.float32)),
                             rng.uniform(0.5, 2, size=(1, 1)).astype(np.float32), (rows, 8), (rows, 8),
                             activations="fp8_token") for rows in (3, 5)]
    fused = concatenate_weights(parts)
    assert fused.block == (1, 8) and fused.scales.shape == (8, 1)
    assert np.array_equal(dequantize(fused), np.concatenate([dequantize(p) for p in parts]))
    assert np.array_equal(dequantize(fused[3:8]), dequantize(parts[1]))
    blocks = QuantizedWeight("fp8", float32_to_fp8_e4m3(rng.normal(size=(8, 8)).astype(np.float32)),
                             rng.uniform(0.5, 2, size=(2, 2)).astype(np.float32), (4, 4), (8, 8))
    assert blocks[4:8].scales.shape == (1, 2)  # on a block edge: the arrays are shared
    assert np.array_equal(dequantize(blocks[1:6]), dequantize(blocks)[1:6])  # off an edge: per-row scales


def test_differently_quantized_parts_are_not_fused():
    rng = np.random.default_rng(6)
    fp8 = quantize_fp8_per_channel(rng.normal(size=(4, 8)).astype(np.float32))
    int4, _ = int4_weight(rng, 4, 8, 4, asymmetric=False)
    with pytest.raises(QuantizationError, match="quantized differently"):
        concatenate_weights([fp8, int4])


def test_inconsistent_layouts_are_refused():
    with pytest.raises(QuantizationError, match="codes"):
        QuantizedWeight("int4", np.zeros((4, 8), np.uint8), np.ones((4, 1), np.float32), (1, 8), (4, 8))
    with pytest.raises(QuantizationError, match="scales"):
        QuantizedWeight("fp8", np.zeros((4, 8), np.uint8), np.ones((4, 2), np.float32), (1, 8), (4, 8))
    with pytest.raises(QuantizationError, match="input_scale"):
        QuantizedWeight("fp8", np.zeros((4, 8), np.uint8), np.ones((1, 1), np.float32), (4, 8), (4, 8),
                        activations="fp8_tensor")


def test_online_quantization_is_within_fp8_precision():
    matrix = np.random.default_rng(7).normal(size=(64, 128)).astype(np.float32)
    weight = quantize_fp8_per_channel(matrix)
    # E4M3 keeps 3 mantissa bits: a relative rounding error of at most 2**-4 per value.
    assert np.all(np.abs(dequantize(weight) - matrix) <= np.abs(matrix) * 2.0**-4 + 2.0**-9 * weight.scales)
    assert np.array_equal(round_to_fp8(np.array([1.0625], np.float32)), np.array([1.0], np.float32))
