"""The tensor-core prefill attention against the NumPy reference: GQA, head sizes 64, 128 and
256, MLA's expanded form (keys of 192 dims, values of 128), block sizes 1, 16 and 32, prompt
chunks after a cached prefix, several sequences, sliding windows, logit soft caps and sinks, capture
into a CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import bf16, rel_error  # noqa: E402

from metrale.kernels import attention, attention_mma
from metrale.loading.checkpoint import bf16_to_float32

pytestmark = pytest.mark.gpu


def attention_case(rng, heads, kv_heads, head_dim, block_size, chunks, value_dim=None):
    """Sequences whose prompt rows are ``chunks[i] = (cached, new)``: ``new`` rows at positions
    ``cached .. cached + new - 1``, over a cache of shuffled blocks."""
    blocks_per_seq = [-(-(cached + new) // block_size) for cached, new in chunks]
    total_blocks = sum(blocks_per_seq) + 3
    order = rng.permutation(np.arange(1, total_blocks))
    tables = np.zeros((len(chunks), max(blocks_per_seq)), np.int32)
    used = 0
    for s, count in enumerate(blocks_per_seq):
        tables[s, :count] = order[used : used + count]
        used += count
    seq_index = np.concatenate([np.full(new, s, np.int32) for s, (_, new) in enumerate(chunks)])
    positions = np.concatenate([np.arange(cached, cached + new, dtype=np.int32) for cached, new in chunks])
    starts = np.concatenate([[0], np.cumsum([new for _, new in chunks])]).astype(np.int32)
    q = rng.standard_normal((len(positions), heads, head_dim)).astype(np.float32)
    k_cache = bf16(rng, (total_blocks, block_size, kv_heads, head_dim))
    v_cache = bf16(rng, (total_blocks, block_size, kv_heads, value_dim or head_dim))
    return q, k_cache, v_cache, tables, seq_index, positions, starts


@pytest.mark.parametrize("heads, kv_heads, head_dim, value_dim", [
    (32, 8, 128, 128), (32, 8, 64, 64), (16, 16, 128, 128), (14, 2, 64, 64), (16, 2, 256, 256), (16, 16, 192, 128),
    (4, 2, 32, 32),
])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("window", [None, 100])
def test_prefill_attention_matches_the_reference(heads, kv_heads, head_dim, value_dim, block_size, window):
    import cupy as cp

    rng = np.random.default_rng(heads + head_dim + block_size)
    chunks = [(0, 200), (77, 64), (300, 1), (5, 129)]
    q, k_cache, v_cache, tables, seq_index, positions, starts = attention_case(
        rng, heads, kv_heads, head_dim, block_size, chunks, value_dim
    )
    scale = head_dim**-0.5
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, scale, window
    ).reshape(len(positions), -1)
    out = cp.zeros((len(positions), heads * value_dim), dtype=np.uint16)
    attention_mma.prefill_attention(
        cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache), cp.asarray(tables), cp.asarray(seq_index),
        cp.asarray(positions), cp.asarray(attention_mma.query_tiles(starts)), scale, window, out,
    )
    # bf16 queries and probabilities on top of the bf16 output.
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), expected) <= 2e-2


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(64, 8, 64), (16, 8, 256), (32, 8, 128)])
@pytest.mark.parametrize("softcap, with_sinks", [(3.0, False), (None, True), (3.0, True)])
@pytest.mark.parametrize("window", [None, 100])
def test_prefill_attention_caps_logits_and_counts_sinks_as_the_reference(heads, kv_heads, head_dim, softcap, with_sinks,
                                                                          window):
    import cupy as cp

    rng = np.random.default_rng(heads + head_dim + (window or 0))
    chunks = [(0, 200), (77, 64), (5, 129)]
    q, k_cache, v_cache, tables, seq_index, positions, starts = attention_case(rng, heads, kv_heads, head_dim, 16,
                                                                               chunks)
    # Queries large enough that the cap bends the logits; sinks of the logits' size.
    q *= 3.0
    sinks = (rng.standard_normal(heads) + 2.0).astype(np.float32) if with_sinks else None
    scale = head_dim**-0.5
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, scale, window, softcap,
        sinks).reshape(len(positions), -1)
    plain = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, scale, window
    ).reshape(len(positions), -1)
    assert rel_error(plain, expected) > 0.1  # the cap and the sinks change the answer
    out = cp.zeros((len(positions), heads * head_dim), dtype=np.uint16)
    attention_mma.prefill_attention(
        cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache), cp.asarray(tables), cp.asarray(seq_index),
        cp.asarray(positions), cp.asarray(attention_mma.query_tiles(starts)), scale, window, out, softcap=softcap,
        sinks=None if sinks is None else cp.asarray(sinks),
    )
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), expected) <= 2e-2


def test_prefill_attention_of_a_long_prompt_over_a_long_prefix():
    import cupy as cp

    rng = np.random.default_rng(9)
    q, k_cache, v_cache, tables, seq_index, positions, starts = attention_case(rng, 32, 8, 128, 16, [(4000, 512)])
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, 128**-0.5
    ).reshape(len(positions), -1)
    out = cp.zeros((len(positions), 32 * 128), dtype=np.uint16)
    attention_mma.prefill_attention(
        cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache), cp.asarray(tables), cp.asarray(seq_index),
        cp.asarray(positions), cp.asarray(attention_mma.query_tiles(starts)), 128**-0.5, None, out,
    )
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), expected) <= 2e-2


def test_prefill_attention_replays_in_a_cuda_graph():
    import cupy as cp

    rng = np.random.default_rng(3)
    q, k_cache, v_cache, tables, seq_index, positions, starts = attention_case(rng, 16, 16, 192, 16, [(10, 100)], 128)
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, 0.1
    ).reshape(len(positions), -1)
    arguments = [cp.asarray(a) for a in (q, k_cache, v_cache, tables, seq_index, positions, attention_mma.query_tiles(starts))]
    out = cp.zeros((len(positions), 16 * 128), dtype=np.uint16)
    stream = cp.cuda.Stream(non_blocking=True)
    attention_mma.prefill_attention(*arguments, 0.1, None, out, stream)  # compiled outside the capture
    out[...] = 0
    cp.cuda.Device().synchronize()  # (written on the default stream, which the capture's does not wait for)
    with stream:
        stream.begin_capture()
        attention_mma.prefill_attention(*arguments, 0.1, None, out, stream)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), expected) <= 2e-2


@pytest.mark.parametrize("heads, kv_heads, head_dim, value_dim", [(32, 8, 128, 128), (14, 2, 64, 64),
                                                                  (16, 2, 256, 256), (16, 16, 192, 128)])
def test_an_fp8_cache_reads_as_the_bf16_kernel_reads_its_dequantized_rows(heads, kv_heads, head_dim, value_dim):
    """Prompt rows over an FP8 cache (codes and scales on the device): the bf16 launch's output over
    the dequantized rows to the bit, and the float reference over the codes times their scales."""
    import cupy as cp

    from metrale.kernels.attention_decode_mma import dequantized_cache
    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray
    from metrale.kernels.quantized import fp8_e4m3_to_float32
    from metrale.loading.checkpoint import float32_to_bf16

    rng = np.random.default_rng(heads + head_dim + 3)
    chunks = [(0, 200), (77, 64), (300, 1)]
    q, k_bits, v_bits, tables, seq_index, positions, starts = attention_case(rng, heads, kv_heads, head_dim, 16, chunks,
                                                                             value_dim)
    host = [Fp8CacheArray.zeros(bits.shape).quantize(bf16_to_float32(bits)) for bits in (k_bits, v_bits)]
    device = [Fp8CacheArray(cp.asarray(codes), cp.asarray(scales)) for codes, scales in host]
    dequantized = [cp.asarray(float32_to_bf16(dequantized_cache(*pair))) for pair in host]
    scale = head_dim**-0.5
    metadata = [cp.asarray(a) for a in (tables, seq_index, positions, attention_mma.query_tiles(starts))]
    outputs = []
    for k_cache, v_cache in (device, dequantized):
        out = cp.zeros((len(positions), heads * value_dim), dtype=np.uint16)
        attention_mma.prefill_attention(cp.asarray(q), k_cache, v_cache, *metadata, scale, None, out)
        outputs.append(cp.asnumpy(out))
    np.testing.assert_array_equal(outputs[0], outputs[1])
    exact = [fp8_e4m3_to_float32(codes) * scales[..., None] for codes, scales in host]
    expected = attention.paged_attention_reference(q, *exact, tables, seq_index, positions, scale,
                                                   None).reshape(len(positions), -1)
    assert rel_error(bf16_to_float32(outputs[0]), expected) <= 2e-2


@pytest.mark.parametrize("heads, kv_heads, head_dim, value_dim", [
    (32, 8, 128, 128), (14, 2, 64, 64), (16, 16, 192, 128), (16, 2, 256, 256), (80, 1, 64, 64),
])
@pytest.mark.parametrize("softcap, with_sinks, window", [(None, False, None), (30.0, True, 100)])
def test_decode_rows_give_the_prompt_forms_bits(heads, kv_heads, head_dim, value_dim, softcap, with_sinks, window):
    """Rows of several sequences through the decode rows' form (a row's query heads of a KV head as
    one tile; 80 heads over one KV head: two tiles of heads) give, bit for bit, what the prompt form
    gives the same rows inside their prompts."""
    import cupy as cp

    rng = np.random.default_rng(heads + head_dim)
    q, k_cache, v_cache, tables, seq_index, positions, starts = attention_case(
        rng, heads, kv_heads, head_dim, 16, [(0, 300), (0, 70)], value_dim)
    sinks = (rng.standard_normal(heads) + 2.0).astype(np.float32) if with_sinks else None
    scale = head_dim**-0.5
    device = [cp.asarray(array) for array in (k_cache, v_cache, tables)]

    def run(function, rows, tiles):
        out = cp.zeros((len(rows), heads * value_dim), dtype=np.uint16)
        function(cp.asarray(q[rows]), *device, cp.asarray(seq_index[rows]), cp.asarray(positions[rows]),
                 cp.asarray(tiles), scale, window, out, softcap=softcap,
                 sinks=None if sinks is None else cp.asarray(sinks))
        return cp.asnumpy(out)

    everything = np.arange(len(positions))
    prompts = run(attention_mma.prefill_attention, everything, attention_mma.query_tiles(starts))
    picked = np.array([299, 0, 63, 300 + 69, 64, 300, 171, 128], np.int32)
    decoded = run(attention_mma.decode_rows_attention, picked, attention_mma.decode_rows(len(picked)))
    assert np.array_equal(decoded, prompts[picked])
    expected = attention.paged_attention_reference(
        q[picked], bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index[picked], positions[picked],
        scale, window, softcap, sinks).reshape(len(picked), -1)
    assert rel_error(bf16_to_float32(decoded), expected) <= 2e-2
