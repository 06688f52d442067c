"""Every kernel against its NumPy reference on a real GPU, at real sizes (``-m gpu``)."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import bf16, rel_error  # noqa: E402

from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def cupy_module():
    global cp
    import cupy

    cp = cupy
    return cupy


def test_embedding_lm_head_sized():
    from metrale.kernels import embedding

    rng = np.random.default_rng(0)
    weight = bf16(rng, (128256, 2048))
    ids = rng.integers(0, 128256, 77).astype(np.int32)
    out = cp.full((77, 2048), np.nan, dtype=np.float32)
    embedding.embedding(cp.asarray(weight), cp.asarray(ids), out)
    np.testing.assert_array_equal(cp.asnumpy(out), bf16_to_float32(weight)[ids])


def test_rmsnorm_residual():
    from metrale.kernels import rmsnorm

    rng = np.random.default_rng(1)
    x = rng.standard_normal((37, 4096)).astype(np.float32)
    residual = rng.standard_normal((37, 4096)).astype(np.float32)
    weight = float32_to_bf16((1 + 0.2 * rng.standard_normal(4096)).astype(np.float32))
    normed, summed = rmsnorm.rmsnorm_residual_reference(x, residual, bf16_to_float32(weight), 1e-5)
    res, out = cp.asarray(residual), cp.zeros((37, 4096), dtype=np.uint16)
    rmsnorm.rmsnorm_residual(cp.asarray(x), res, cp.asarray(weight), 1e-5, 0.0, True, out)
    assert rel_error(cp.asnumpy(res), summed) <= 1e-6
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), normed) <= 8e-3


def test_reused_device_views_follow_address_shape_and_dtype():
    from metrale.kernels import activation
    from metrale.kernels._device import device_view

    base = cp.arange(64, dtype=np.float32)
    assert device_view(base) is device_view(base)
    assert device_view(base[8:]) is not device_view(base)  # another address
    assert device_view(base.reshape(8, 8)) is not device_view(base)  # another shape
    assert device_view(base.view(np.int32)) is not device_view(base)  # another dtype
    # Memory freed and handed to a new array of the same geometry: its reused view reads the
    # new array's contents (a view is only an address), so launches see the right data.
    for round_ in range(3):
        values = cp.full((4, 256), float(round_ + 1), dtype=np.float32)
        out = cp.zeros((4, 256), dtype=np.uint16)
        activation.to_bf16(values, out)
        np.testing.assert_array_equal(cp.asnumpy(out), float32_to_bf16(np.full((4, 256), round_ + 1.0, np.float32)))
        widened = cp.full((4, 256), np.nan, dtype=np.float32)
        activation.to_float32(out, widened)
        np.testing.assert_array_equal(cp.asnumpy(widened), np.full((4, 256), round_ + 1.0, np.float32))
        del values, out, widened


def test_numba_kernels_launch_directly_through_cupy():
    """The kernels run through :class:`metrale.kernels._device.DirectKernel`: compiled by numba,
    loaded and launched by CuPy, on the stream given."""
    from metrale.kernels import _device, activation

    assert isinstance(activation.silu_and_mul_kernel, _device.DirectKernel)
    gate_up = cp.asarray(np.linspace(-3, 3, 2 * 3 * 40, dtype=np.float32).reshape(3, 80))
    out = cp.zeros((3, 40), dtype=np.uint16)
    stream = cp.cuda.Stream(non_blocking=True)
    activation.silu_and_mul(gate_up, out, stream)
    stream.synchronize()
    host = cp.asnumpy(gate_up)
    expected = activation.silu_and_mul_reference(host[:, :40], host[:, 40:])
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), expected) <= 8e-3
    assert len(activation.silu_and_mul_kernel._launchers) >= 1


def test_silu_and_mul():
    from metrale.kernels import activation

    rng = np.random.default_rng(2)
    gate_up = (2 * rng.standard_normal((19, 2 * 14336))).astype(np.float32)
    out = cp.zeros((19, 14336), dtype=np.uint16)
    activation.silu_and_mul(cp.asarray(gate_up), out)
    expected = activation.silu_and_mul_reference(gate_up[:, :14336], gate_up[:, 14336:])
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), expected) <= 8e-3
    # A bf16 product (the linear_silu op's GEMM output) gives the same within bf16 rounding.
    activation.silu_and_mul_bits(cp.asarray(float32_to_bf16(gate_up)), out)
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), expected) <= 1.2e-2


@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_rope_cache(qk_norm):
    from metrale.kernels import qkv_rope as rope

    rng = np.random.default_rng(3)
    rows, heads, kv_heads, head_dim, blocks, block_size = 64, 32, 8, 128, 300, 16
    qkv = rng.standard_normal((rows, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    positions = rng.integers(0, 4000, rows).astype(np.int32)
    slots = rng.choice(blocks * block_size, rows, replace=False).astype(np.int32)
    inv_freq = (1.0 / 500000 ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    q_norm = float32_to_bf16((1 + 0.2 * rng.standard_normal(head_dim)).astype(np.float32)) if qk_norm else None
    k_norm = float32_to_bf16((1 + 0.2 * rng.standard_normal(head_dim)).astype(np.float32)) if qk_norm else None
    k_cache, v_cache = bf16(rng, (blocks, block_size, kv_heads, head_dim)), bf16(rng, (blocks, block_size, kv_heads, head_dim))
    k_ref, v_ref = bf16_to_float32(k_cache), bf16_to_float32(v_cache)
    expected = rope.qkv_rope_cache_reference(
        qkv, positions, slots, inv_freq, 1.0, heads, kv_heads, head_dim, k_ref, v_ref,
        None if q_norm is None else bf16_to_float32(q_norm), None if k_norm is None else bf16_to_float32(k_norm),
    )
    k_dev, v_dev = cp.asarray(k_cache), cp.asarray(v_cache)
    q = cp.zeros((rows, heads, head_dim), dtype=np.float32)
    rope.qkv_rope_cache(cp.asarray(qkv), cp.asarray(positions), cp.asarray(slots), cp.asarray(inv_freq), 1.0, heads,
                        kv_heads, head_dim, k_dev, v_dev, q, None if q_norm is None else cp.asarray(q_norm),
                        None if k_norm is None else cp.asarray(k_norm))
    assert rel_error(cp.asnumpy(q), expected) <= 1e-4
    assert rel_error(bf16_to_float32(cp.asnumpy(k_dev)), k_ref) <= 8e-3
    assert rel_error(bf16_to_float32(cp.asnumpy(v_dev)), v_ref) <= 8e-3


@pytest.mark.parametrize(
    "kernel", ["grouped", "grouped one split", "staged", "staged one split", "per-head", "mma"]
)
@pytest.mark.parametrize("window", [None, 700])
# Llama's geometry, and a group of 7 heads (two head chunks) with 64 dims (two keys per value load).
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 128), (14, 2, 64)])
def test_paged_attention_long_contexts(window, kernel, heads, kv_heads, head_dim, monkeypatch):
    from metrale.kernels import attention, attention_decode_mma, attention_grouped, attention_staged

    if kernel.endswith("one split"):
        monkeypatch.setattr(attention_grouped, "MIN_SPLIT_KEYS", 8192)

    rng = np.random.default_rng(4)
    block_size = 16
    lengths = [5000, 1, 613, 2049]
    blocks_per = [-(-n // block_size) for n in lengths]
    ids = rng.permutation(np.arange(1, sum(blocks_per) + 1))
    tables = np.zeros((len(lengths), max(blocks_per)), np.int32)
    start = 0
    for s, n in enumerate(blocks_per):
        tables[s, :n] = ids[start : start + n]
        start += n
    k_cache = bf16(rng, (sum(blocks_per) + 1, block_size, kv_heads, head_dim))
    v_cache = bf16(rng, (sum(blocks_per) + 1, block_size, kv_heads, head_dim))
    # Decode rows at each sequence's last position, plus prefill rows of sequence 3.
    seq_index = np.array([0, 1, 2, 3, 3, 3], np.int32)
    positions = np.array([4999, 0, 612, 2046, 2047, 2048], np.int32)
    q = rng.standard_normal((6, heads, head_dim)).astype(np.float32)
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, head_dim**-0.5, window
    ).reshape(6, -1)
    max_context = 8192  # more splits than any row needs, as in a captured graph
    splits = {"per-head": attention.attention_splits(max_context),
              "mma": attention_decode_mma.device_split_count(6, heads, kv_heads, head_dim, max_context)}.get(
        kernel, attention_grouped.split_count(6, heads, kv_heads, max_context))
    workspace = (cp.zeros((6, heads, splits, head_dim), dtype=np.float32), cp.zeros((6, heads, splits), dtype=np.float32),
                 cp.zeros((6, heads, splits), dtype=np.float32))
    out = cp.zeros((6, heads * head_dim), dtype=np.uint16)
    arguments = (cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache), cp.asarray(tables), cp.asarray(seq_index),
                 cp.asarray(positions), head_dim**-0.5, window)
    if kernel == "mma":
        attention_decode_mma.decode_attention(*arguments, workspace, out)
    else:
        launch = {"per-head": attention.decode_attention, "grouped": attention_grouped.decode_attention,
                  "staged": attention_staged.decode_attention}[kernel.split()[0]]
        launch(*arguments, max_context, workspace, out)
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), expected) <= 1e-2


@pytest.mark.parametrize("softcap, with_sinks", [(30.0, False), (None, True), (30.0, True)])
@pytest.mark.parametrize("kernel", ["per-head", "prefill"])
def test_paged_attention_caps_logits_and_counts_sinks(kernel, softcap, with_sinks):
    """The CUDA-core kernels that serve Gemma-2's soft cap and GPT-OSS's sinks, at a real geometry
    (64 heads of 64 dims over 8 KV heads) and long contexts."""
    from metrale.kernels import attention, attention_prefill

    rng = np.random.default_rng(41)
    heads, kv_heads, head_dim, block_size = 64, 8, 64, 16
    lengths = [1500, 700]
    blocks_per = [-(-n // block_size) for n in lengths]
    ids = rng.permutation(np.arange(1, sum(blocks_per) + 1))
    tables = np.zeros((2, max(blocks_per)), np.int32)
    tables[0, : blocks_per[0]] = ids[: blocks_per[0]]
    tables[1, : blocks_per[1]] = ids[blocks_per[0] :]
    k_cache = bf16(rng, (sum(blocks_per) + 1, block_size, kv_heads, head_dim))
    v_cache = bf16(rng, (sum(blocks_per) + 1, block_size, kv_heads, head_dim))
    seq_index = np.array([0] * 300 + [1] * 200, np.int32)
    positions = np.array(list(range(1200, 1500)) + list(range(500, 700)), np.int32)
    q = 3 * rng.standard_normal((500, heads, head_dim)).astype(np.float32)
    sinks = (rng.standard_normal(heads) + 2).astype(np.float32) if with_sinks else None
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, head_dim**-0.5, None,
        softcap, sinks).reshape(500, -1)
    out = cp.zeros((500, heads * head_dim), dtype=np.uint16)
    device = [cp.asarray(a) for a in (q, k_cache, v_cache, tables, seq_index, positions)]
    device_sinks = None if sinks is None else cp.asarray(sinks)
    if kernel == "per-head":
        splits = attention.attention_splits(2048)
        workspace = tuple(cp.zeros(shape, dtype=np.float32)
                          for shape in ((500, heads, splits, head_dim), (500, heads, splits), (500, heads, splits)))
        attention.decode_attention(*device, head_dim**-0.5, None, 2048, workspace, out, softcap=softcap,
                                   sinks=device_sinks)
    else:
        tiles = attention_prefill.query_tiles(np.array([0, 300, 500]), attention_prefill.rows_per_tile(heads, kv_heads))
        q_device, k_device, v_device, *rest = device
        attention_prefill.paged_attention_prefill(
            q_device, attention_prefill.as_words(k_device), attention_prefill.as_words(v_device), *rest,
            cp.asarray(tiles), head_dim**-0.5, None, out, softcap=softcap, sinks=device_sinks)
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), expected) <= 1e-2


def test_cublas_linear():
    from metrale.kernels.linear import CublasGemm

    rng = np.random.default_rng(5)
    stream = cp.cuda.Stream(non_blocking=True)
    gemm = CublasGemm(stream)
    for rows in (1, 7, 300):
        x, w = bf16(rng, (rows, 4096)), bf16(rng, (1000, 4096), 0.02)
        out = cp.zeros((rows, 1000), dtype=np.float32)
        with stream:
            gemm(cp.asarray(x), cp.asarray(w), out)
        stream.synchronize()
        expected = bf16_to_float32(x).astype(np.float64) @ bf16_to_float32(w).astype(np.float64).T
        assert rel_error(cp.asnumpy(out), expected) <= 1e-3, rows
    gemm.close()


def test_sampling_frequencies_and_greedy():
    from metrale.kernels import sampling

    logits = np.array([1.2, -0.4, 0.3, 2.0, -1.5] + [-30.0] * 995, np.float32)
    rows = 40000
    batch = cp.asarray(np.tile(logits, (rows, 1)))
    out = cp.zeros(rows, dtype=np.int32)
    ones = cp.ones(rows, dtype=np.float32)
    sampling.sample(batch, ones, cp.zeros(rows, dtype=np.int32), ones, cp.arange(rows, dtype=np.int64),
                    cp.zeros(rows, dtype=np.int64), cp.full(rows, -1.0, dtype=np.float32), out)
    frequencies = np.bincount(cp.asnumpy(out), minlength=1000)[:5] / rows
    expected = np.exp(logits[:5] - logits.max()) / np.exp(logits - logits.max()).sum()
    assert np.abs(frequencies - expected).max() <= 0.01, (frequencies, expected)
    greedy = cp.zeros(rows, dtype=np.int32)
    sampling.sample(batch, cp.zeros(rows, dtype=np.float32), cp.zeros(rows, dtype=np.int32), ones,
                    cp.zeros(rows, dtype=np.int64), cp.zeros(rows, dtype=np.int64), cp.full(rows, -1.0, dtype=np.float32),
                    greedy)
    assert set(cp.asnumpy(greedy).tolist()) == {3}


def test_sampling_thresholds_at_full_vocabulary():
    """Top-k, top-p and both over a 128,256-token vocabulary against the reference."""
    from metrale.kernels import sampling

    rng = np.random.default_rng(31)
    vocab = 128256
    cases = [(1.0, 50, 1.0), (0.7, 0, 0.9), (1.0, 40, 0.8), (1.2, 0, 0.5), (1.0, 1000, 0.97), (0.0, 0, 1.0)]
    logits = (3 * rng.standard_normal((len(cases), vocab))).astype(np.float32)
    temperature = np.array([c[0] for c in cases], np.float32)
    top_k = np.array([c[1] for c in cases], np.int32)
    top_p = np.array([c[2] for c in cases], np.float32)
    for u in (0.13, 0.5, 0.77, 0.999):
        uniforms = np.full(len(cases), u, np.float32)
        out = cp.full(len(cases), -1, dtype=np.int32)
        zeros = cp.zeros(len(cases), dtype=np.int64)
        sampling.sample(cp.asarray(logits), cp.asarray(temperature), cp.asarray(top_k), cp.asarray(top_p), zeros,
                        zeros, cp.asarray(uniforms), out)
        expected = sampling.sample_reference(logits, temperature, top_k, top_p, uniforms)
        np.testing.assert_array_equal(cp.asnumpy(out), expected)


def test_sampling_marks_rows_without_a_distribution_at_full_vocabulary():
    """NaN or +inf anywhere in a 128,256-token row, or every logit -inf: token -1, greedy or
    sampled; the rows around them are drawn as the reference draws them."""
    from metrale.kernels import sampling

    rng = np.random.default_rng(32)
    vocab = 128256
    logits = (3 * rng.standard_normal((6, vocab))).astype(np.float32)
    logits[1, 100_000] = np.nan
    logits[2, vocab - 1] = np.inf
    logits[3, :] = -np.inf
    logits[4, :1000] = -np.inf
    temperature = np.array([0.0, 0.0, 0.8, 0.8, 0.8, 0.0], np.float32)
    top_k = np.array([0, 0, 50, 0, 40, 0], np.int32)
    top_p = np.array([1.0, 1.0, 0.9, 1.0, 0.9, 1.0], np.float32)
    uniforms = np.full(6, 0.4, np.float32)
    expected = sampling.sample_reference(logits, temperature, top_k, top_p, uniforms)
    assert expected.tolist()[1:4] == [-1, -1, -1]
    out = cp.full(6, 7, dtype=np.int32)
    zeros = cp.zeros(6, dtype=np.int64)
    sampling.sample(cp.asarray(logits), cp.asarray(temperature), cp.asarray(top_k), cp.asarray(top_p), zeros, zeros,
                    cp.asarray(uniforms), out)
    np.testing.assert_array_equal(cp.asnumpy(out), expected)


@pytest.mark.parametrize("window", [None, 300])
def test_prefill_attention_query_tiles(window):
    from metrale.kernels import attention, attention_prefill

    rng = np.random.default_rng(6)
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    # A whole 700-token prompt, and a 333-token chunk over a 400-token cached prefix.
    lengths = [700, 733]
    blocks_per = [-(-n // block_size) for n in lengths]
    ids = rng.permutation(np.arange(1, sum(blocks_per) + 1))
    tables = np.zeros((2, max(blocks_per)), np.int32)
    tables[0, : blocks_per[0]] = ids[: blocks_per[0]]
    tables[1, : blocks_per[1]] = ids[blocks_per[0] :]
    k_cache = bf16(rng, (sum(blocks_per) + 1, block_size, kv_heads, head_dim))
    v_cache = bf16(rng, (sum(blocks_per) + 1, block_size, kv_heads, head_dim))
    seq_index = np.array([0] * 700 + [1] * 333, np.int32)
    positions = np.array(list(range(700)) + list(range(400, 733)), np.int32)
    q = rng.standard_normal((1033, heads, head_dim)).astype(np.float32)
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, head_dim**-0.5, window
    ).reshape(1033, -1)
    tiles = attention_prefill.query_tiles(np.array([0, 700, 1033]), attention_prefill.rows_per_tile(heads, kv_heads))
    out = cp.zeros((1033, heads * head_dim), dtype=np.uint16)
    attention_prefill.paged_attention_prefill(
        cp.asarray(q), attention_prefill.as_words(cp.asarray(k_cache)), attention_prefill.as_words(cp.asarray(v_cache)),
        cp.asarray(tables), cp.asarray(seq_index), cp.asarray(positions), cp.asarray(tiles), head_dim**-0.5, window, out,
    )
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), expected) <= 1e-2


@pytest.mark.parametrize("interleaved", [False, True])
def test_latent_cache_write_at_deepseek_sizes(interleaved):
    """40 rows of 512 latent + 64 rope dims into a 64-block cache at scattered slots."""
    from metrale.kernels import attention_latent

    rng = np.random.default_rng(33)
    rank, rope_dims, rows, block_size = 512, 64, 40, 16
    kv_a = rng.standard_normal((rows, rank + rope_dims)).astype(np.float32)
    weight = float32_to_bf16(rng.uniform(0.5, 1.5, rank).astype(np.float32))
    positions = rng.integers(0, 4000, rows).astype(np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, rope_dims, 2) / rope_dims)).astype(np.float32)
    slots = rng.permutation(64 * block_size)[:rows].astype(np.int32)
    expected = np.zeros((64, block_size, rank + rope_dims), np.float32)
    attention_latent.latent_cache_write_reference(kv_a, bf16_to_float32(weight), 1e-6, positions, inv_freq, 1.2,
                                                  interleaved, slots, expected)
    latent = cp.zeros((64, block_size, rank + rope_dims), dtype=cp.uint16)
    attention_latent.latent_cache_write(cp.asarray(kv_a), cp.asarray(weight), 1e-6, cp.asarray(positions),
                                        cp.asarray(inv_freq), 1.2, interleaved, cp.asarray(slots), latent)
    assert rel_error(bf16_to_float32(cp.asnumpy(latent)), expected) <= 8e-3


def test_latent_attention_at_deepseek_sizes():
    from metrale.kernels import attention_latent

    rng = np.random.default_rng(51)
    heads, width, value_dim, block_size = 16, 576, 512, 16
    lengths = [700, 1, 130]
    blocks_per = [-(-n // block_size) for n in lengths]
    ids = rng.permutation(np.arange(1, sum(blocks_per) + 1))
    tables = np.zeros((3, max(blocks_per)), np.int32)
    offset = 0
    for row, count in enumerate(blocks_per):
        tables[row, :count] = ids[offset : offset + count]
        offset += count
    latent = bf16(rng, (sum(blocks_per) + 1, block_size, width))
    q = rng.standard_normal((3, heads, width)).astype(np.float32)
    positions = np.array([n - 1 for n in lengths], np.int32)
    seq_index = np.arange(3, dtype=np.int32)
    scale = 0.1
    expected = attention_latent.latent_attention_reference(q, bf16_to_float32(latent), tables, seq_index, positions,
                                                           value_dim, scale)
    out = cp.zeros((3, heads * value_dim), dtype=np.uint16)
    attention_latent.latent_attention(cp.asarray(q), cp.asarray(latent), cp.asarray(tables), cp.asarray(seq_index),
                                      cp.asarray(positions), value_dim, scale, 700, out)
    assert rel_error(bf16_to_float32(cp.asnumpy(out)).reshape(3, heads, value_dim), expected) <= 1e-2


@pytest.mark.parametrize("method, experts, top_k, n_group, topk_group", [
    ("greedy", 64, 6, 1, 1), ("noaux_tc", 256, 8, 8, 4),
])
def test_moe_routing_and_experts_at_deepseek_sizes(method, experts, top_k, n_group, topk_group):
    from metrale.kernels import moe

    rng = np.random.default_rng(52)
    tokens, hidden, inter = 5, 2048, 256
    x = bf16(rng, (tokens, hidden))
    gate = (0.05 * rng.standard_normal((experts, hidden))).astype(np.float32)
    bias = (0.1 * rng.standard_normal(experts)).astype(np.float32)
    logits = cp.empty((tokens, experts), dtype=np.float32)
    moe.router_logits(cp.asarray(x), cp.asarray(gate), logits)
    np.testing.assert_allclose(cp.asnumpy(logits), bf16_to_float32(x) @ gate.T, rtol=1e-4, atol=1e-4)
    chosen = cp.empty((tokens, top_k), dtype=np.int32)
    weights = cp.empty((tokens, top_k), dtype=np.float32)
    moe.route(logits, cp.asarray(bias), method, n_group, topk_group, top_k, method == "noaux_tc", 2.5, chosen, weights)
    want_chosen, want_weights = moe.route_reference(cp.asnumpy(logits), bias, method, n_group, topk_group, top_k,
                                                    method == "noaux_tc", 2.5)
    np.testing.assert_array_equal(cp.asnumpy(chosen), want_chosen)
    np.testing.assert_allclose(cp.asnumpy(weights), want_weights, rtol=1e-5, atol=1e-6)
    used = int(want_chosen.max()) + 1
    gate_up = bf16(rng, (used * 2 * inter, hidden), scale=0.05)
    down = bf16(rng, (used * hidden, inter), scale=0.05)
    out = cp.empty((tokens, hidden), dtype=np.float32)
    act = cp.empty((tokens * top_k, inter), dtype=np.uint16)
    moe.experts(cp.asarray(x), chosen, weights, cp.asarray(gate_up), cp.asarray(down), act, out)
    expected = moe.experts_reference(bf16_to_float32(x), want_chosen, want_weights, bf16_to_float32(gate_up),
                                     bf16_to_float32(down))
    assert rel_error(cp.asnumpy(out), expected) <= 2e-2


def test_head_linear_at_deepseek_sizes():
    from metrale.kernels import head_linear

    rng = np.random.default_rng(53)
    x = bf16(rng, (4, 16, 128))
    weight = bf16(rng, (16 * 512, 128), scale=0.1)
    out = cp.empty((4, 16, 512), dtype=np.float32)
    head_linear.head_linear(cp.asarray(x), cp.asarray(weight), out)
    expected = head_linear.head_linear_reference(bf16_to_float32(x), bf16_to_float32(weight))
    assert rel_error(cp.asnumpy(out), expected) <= 1e-4


def test_gated_delta_decode_kernels_at_qwen3_next_sizes():
    from metrale.kernels import gated_delta

    rng = np.random.default_rng(54)
    rows, heads, dk, dv, width = 4, 32, 128, 128, 4
    channels = 2 * 16 * dk + heads * dv
    slots = np.array([3, 1, 0, 2], np.int32)
    inputs = rng.standard_normal((rows, channels)).astype(np.float32)
    weight = rng.standard_normal((channels, width)).astype(np.float32)
    conv_state = rng.standard_normal((4, channels, width - 1)).astype(np.float32)
    want_conv = conv_state.copy()
    expected = gated_delta.conv_update_reference(inputs, weight, want_conv, slots)
    device_conv = cp.asarray(conv_state)
    out = cp.empty((rows, channels), dtype=np.float32)
    gated_delta.conv_update(cp.asarray(inputs), cp.asarray(weight), device_conv, cp.asarray(slots), out)
    assert rel_error(cp.asnumpy(out), expected) <= 1e-5 and rel_error(cp.asnumpy(device_conv), want_conv) <= 1e-6
    k = rng.standard_normal((rows, heads, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q = (rng.standard_normal((rows, heads, dk)) / np.sqrt(dk)).astype(np.float32)
    v = rng.standard_normal((rows, heads, dv)).astype(np.float32)
    g = -rng.uniform(0, 1, (rows, heads)).astype(np.float32)
    beta = rng.uniform(0, 1, (rows, heads)).astype(np.float32)
    state = rng.standard_normal((4, heads, dk, dv)).astype(np.float32)
    want_state = state.copy()
    expected = gated_delta.recurrent_step_reference(q, k, v, g, beta, want_state, slots)
    device_state = cp.asarray(state)
    out = cp.empty((rows, heads, dv), dtype=np.float32)
    gated_delta.recurrent_step(*(cp.asarray(a) for a in (q, k, v, g, beta)), device_state, cp.asarray(slots), out)
    assert rel_error(cp.asnumpy(out), expected) <= 1e-4
    assert rel_error(cp.asnumpy(device_state), want_state) <= 1e-4


def test_gated_delta_prompt_kernel_at_qwen3_next_sizes():
    """Two prompts (300 and 77 tokens) from non-zero states, 32 heads of 128 x 128."""
    from metrale.kernels import gated_delta

    rng = np.random.default_rng(55)
    heads, dk, dv = 32, 128, 128
    starts = np.array([0, 300, 377], np.int32)
    slots = np.array([2, 1], np.int32)
    tokens = int(starts[-1])
    k = rng.standard_normal((tokens, heads, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q = (rng.standard_normal((tokens, heads, dk)) / np.sqrt(dk)).astype(np.float32)
    v = rng.standard_normal((tokens, heads, dv)).astype(np.float32)
    g = -rng.uniform(0, 0.5, (tokens, heads)).astype(np.float32)
    beta = rng.uniform(0, 1, (tokens, heads)).astype(np.float32)
    state = (0.1 * rng.standard_normal((3, heads, dk, dv))).astype(np.float32)
    want_state = state.copy()
    expected = gated_delta.prompt_rule_reference(q, k, v, g, beta, want_state, slots, starts)
    device_state = cp.asarray(state)
    out = cp.empty((tokens, heads, dv), dtype=np.float32)
    gated_delta.prompt_rule(*(cp.asarray(a) for a in (q, k, v, g, beta)), device_state, cp.asarray(slots),
                            cp.asarray(starts), out)
    assert rel_error(cp.asnumpy(out), expected) <= 1e-4
    assert rel_error(cp.asnumpy(device_state), want_state) <= 1e-4
