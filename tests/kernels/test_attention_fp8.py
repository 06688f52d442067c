"""The FP8-cache kernels (:mod:`metrale.kernels.attention_fp8`) under numba's CUDA simulator: rows
written into an FP8 cache as the host's :class:`~metrale.kernels.kv_cache_fp8.Fp8CacheArray`
writes them (per-row and static scales, padding rows skipped, bf16 and float32 rows), and the
attention over one against the reference over the dequantized cache (prompt and decode rows, GQA,
sliding windows, soft cap and sinks)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from metrale.kernels import attention, attention_fp8
from metrale.kernels._device import SIMULATED
from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16
from metrale.kernels.kv_cache_fp8 import Fp8CacheArray
from metrale.kernels.quantized import float32_to_fp8_e4m3, fp8_e4m3_table

pytestmark = [
    pytest.mark.skipif(not SIMULATED, reason="the real-GPU variants of these tests carry the gpu marker"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]


@pytest.mark.parametrize("static_scale, as_bits", [(None, False), (None, True), (0.01, False)])
def test_rows_are_written_as_the_host_writes_them(static_scale, as_bits):
    rng = np.random.default_rng(1)
    rows = (rng.standard_normal((5, 2, 16)) * np.array([1.0, 100.0])[None, :, None]).astype(np.float32)
    rows[3, 1] = 0.0  # an all-zero row keeps scale 1
    if as_bits:
        bits = float32_to_bf16(rows)
        rows = bf16_to_float32(bits)
    slots = np.array([3, 9, -1, 4, 12], np.int32)  # one padding row
    host = Fp8CacheArray.zeros((4, 4, 2, 16), static_scale)
    host.write(slots, rows)
    device = Fp8CacheArray.zeros((4, 4, 2, 16), static_scale)
    attention_fp8.write_fp8_rows(bits if as_bits else rows, slots, device)
    assert np.array_equal(device.scales, host.scales)
    assert np.array_equal(device.codes, host.codes)


@cuda.jit
def encode(values, codes, decoded):
    i = cuda.threadIdx.x
    if i < values.shape[0]:
        codes[i] = attention_fp8.e4m3_code(values[i])
        decoded[i] = attention_fp8.e4m3_value(codes[i])


def test_every_code_encodes_as_the_host_encodes_it():
    table = fp8_e4m3_table()
    finite = table[~np.isnan(table)]
    ties = (table[1:126] + table[2:127]) / 2
    values = np.concatenate([finite, ties, -ties, np.array([500.0, -1e6, 1e-12], np.float32)]).astype(np.float32)
    codes = np.zeros(values.shape, np.uint8)
    decoded = np.zeros(values.shape, np.float32)
    encode[1, values.shape[0]](values, codes, decoded)
    assert np.array_equal(codes, float32_to_fp8_e4m3(values))
    assert np.array_equal(decoded, table[codes])


def random_fp8_cache(rng, blocks, block_size, kv_heads, dim):
    cache = Fp8CacheArray.zeros((blocks, block_size, kv_heads, dim))
    cache.write(np.arange(blocks * block_size, dtype=np.int32),
                rng.standard_normal((blocks * block_size, kv_heads, dim)).astype(np.float32))
    return cache


@pytest.mark.parametrize("window, softcap, with_sinks", [(None, None, False), (5, None, False), (None, 30.0, True)])
def test_attention_over_an_fp8_cache_matches_the_reference(window, softcap, with_sinks):
    rng = np.random.default_rng(7)
    heads, kv_heads, dim, block_size = 4, 2, 16, 4
    k_cache, v_cache = (random_fp8_cache(rng, 9, block_size, kv_heads, dim) for _ in range(2))
    block_tables = np.array([[3, 1, 7, 0], [2, 5, 0, 0]], np.int32)
    seq_index = np.array([0, 0, 0, 1], np.int32)  # a prompt chunk of sequence 0, a decode row of sequence 1
    positions = np.array([5, 6, 7, 6], np.int32)
    q = rng.standard_normal((4, heads, dim)).astype(np.float32)
    sinks = rng.standard_normal(heads).astype(np.float32) if with_sinks else None
    expected = attention.paged_attention_reference(
        q, k_cache.dequantize(), v_cache.dequantize(), block_tables.astype(np.int64), seq_index, positions, dim**-0.5,
        window, softcap, sinks).reshape(4, heads * dim)
    splits = attention.attention_splits(9)
    workspace = (np.zeros((4, heads, splits, dim), np.float32), np.zeros((4, heads, splits), np.float32),
                 np.zeros((4, heads, splits), np.float32))
    out = np.zeros((4, heads * dim), np.uint16)
    attention_fp8.decode_attention(q, k_cache, v_cache, block_tables, seq_index, positions, dim**-0.5, window, 9,
                                   workspace, out, softcap=softcap, sinks=sinks)
    got = bf16_to_float32(out)
    assert np.abs(got - expected).max() <= 8e-3 * np.abs(expected).max()
