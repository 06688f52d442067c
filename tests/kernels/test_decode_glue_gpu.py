"""The decode step's CUDA C++ glue kernels against their NumPy references on a real GPU, at model
shapes and through the views the families pass: RMSNorm with the residual add, RoPE with the
cache write, MLA's per-head products (a strided float32 view of the queries), its latent cache
write and query assembly (views of the stacked projection), the split merge; and each recorded
into a CUDA graph with dependent launches one after another."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import bf16, rel_error  # noqa: E402

from metrale.loading.checkpoint import bf16_to_float32

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backend():
    from metrale.backends.cuda import CudaBackend

    backend = CudaBackend()
    yield backend
    backend.close()


@pytest.mark.parametrize("rows, hidden, add, offset", [(1, 2048, True, 0.0), (32, 4096, True, 0.0), (3, 2048, False, 1.0)])
def test_rmsnorm_residual(backend, rows, hidden, add, offset):
    import cupy as cp

    from metrale.kernels import rmsnorm

    rng = np.random.default_rng(rows + hidden)
    x = (3 * rng.standard_normal((rows, hidden))).astype(np.float32)
    residual = rng.standard_normal((rows, hidden)).astype(np.float32)
    weight = bf16(rng, (hidden,), 0.5)
    with backend.activate():
        residual_device = cp.asarray(residual)
        out = cp.full((rows, hidden), 0x7FC0, np.uint16)
        rmsnorm.rmsnorm_residual_words(cp.asarray(x), residual_device, cp.asarray(weight), 1e-6, offset, add, out,
                                       backend.stream)
        got, summed = bf16_to_float32(cp.asnumpy(out)), cp.asnumpy(residual_device)
    expected, expected_summed = rmsnorm.rmsnorm_residual_reference(x, residual if add else None,
                                                                   bf16_to_float32(weight), 1e-6, offset)
    np.testing.assert_array_equal(summed, expected_summed)
    assert rel_error(got, expected) <= 1e-2


@pytest.mark.parametrize("rows, heads, kv_heads, head_dim, rotary, norm, first_position", [
    (1, 32, 8, 64, 64, False, 0), (8, 32, 8, 128, 128, False, 0), (2, 16, 2, 256, 64, True, 0),
    (8, 32, 8, 128, 128, False, 123072)])  # a 128k context's last positions: angles past 10^5 radians
def test_qkv_rope_cache(backend, rows, heads, kv_heads, head_dim, rotary, norm, first_position):
    import cupy as cp

    from metrale.kernels import qkv_rope

    rng = np.random.default_rng(rows + head_dim)
    blocks, block_size = 8, 16
    qkv = (2 * rng.standard_normal((rows, (heads + 2 * kv_heads) * head_dim))).astype(np.float32)
    positions = (first_position + rng.integers(0, 8000, rows)).astype(np.int32)
    slots = rng.permutation(blocks * block_size)[:rows].astype(np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(rotary // 2, dtype=np.float32) / (rotary // 2))).astype(np.float32)
    q_norm, k_norm = (bf16(rng, (head_dim,), 0.5), bf16(rng, (head_dim,), 0.5)) if norm else (None, None)
    with backend.activate():
        k_cache = cp.zeros((blocks, block_size, kv_heads, head_dim), np.uint16)
        v_cache = cp.zeros_like(k_cache)
        q = cp.full((rows, heads, head_dim), np.nan, np.float32)
        qkv_rope.qkv_rope_cache_words(
            cp.asarray(qkv), cp.asarray(positions), cp.asarray(slots), cp.asarray(inv_freq), 1.0, heads, kv_heads,
            head_dim, k_cache, v_cache, q, None if q_norm is None else cp.asarray(q_norm),
            None if k_norm is None else cp.asarray(k_norm), 1e-6, 0.0, False, backend.stream, rotary_dim=rotary)
        got_q, got_k, got_v = cp.asnumpy(q), bf16_to_float32(cp.asnumpy(k_cache)), bf16_to_float32(cp.asnumpy(v_cache))
    expected_k = np.zeros((blocks, block_size, kv_heads, head_dim), np.float32)
    expected_v = np.zeros_like(expected_k)
    norms = (bf16_to_float32(q_norm), bf16_to_float32(k_norm)) if norm else (None, None)
    expected_q = qkv_rope.qkv_rope_cache_reference(qkv, positions, slots, inv_freq, 1.0, heads, kv_heads, head_dim,
                                                   expected_k, expected_v, *norms, 1e-6, 0.0, False, rotary_dim=rotary)
    assert rel_error(got_q, expected_q) <= 1e-5
    assert rel_error(got_k, expected_k) <= 1e-2 and rel_error(got_v, expected_v) <= 1e-2


@pytest.mark.parametrize("rows", [1, 8])
def test_mla_absorbed_glue_from_the_stacked_projection(backend, rows):
    """DeepSeek-V2-Lite's decode glue as the family calls it: the latent cache write and the
    query heads read from views of one stacked projection, the key product from a strided float32
    view, the value product from the attention's bf16 output."""
    import cupy as cp

    from metrale.kernels import attention_latent, head_linear

    heads, d_n, d_r, rank = 16, 128, 64, 512
    width = d_n + d_r
    rng = np.random.default_rng(rows)
    projected = (2 * rng.standard_normal((rows, heads * width + rank + d_r))).astype(np.float32)
    w_uk = bf16(rng, (heads * rank, d_n), 0.05)
    w_uv = bf16(rng, (heads * d_n, rank), 0.05)
    mixed = bf16(rng, (rows, heads, rank), 1.0)
    norm = bf16(rng, (rank,), 0.5)
    positions = rng.integers(0, 4000, rows).astype(np.int32)
    slots = rng.permutation(64)[:rows].astype(np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(d_r // 2, dtype=np.float32) / (d_r // 2))).astype(np.float32)
    with backend.activate():
        device = cp.asarray(projected)
        q = device[:, : heads * width].reshape(rows, heads, width)
        kv_a = device[:, heads * width:]
        latent = cp.zeros((4, 16, rank + d_r), np.uint16)
        positions_device, inv_freq_device = cp.asarray(positions), cp.asarray(inv_freq)
        attention_latent.latent_cache_write_words(kv_a, cp.asarray(norm), 1e-6, positions_device, inv_freq_device, 1.0,
                                                  False, cp.asarray(slots), latent, backend.stream)
        assert head_linear.words_supported(q[:, :, :d_n], cp.asarray(w_uk))
        q_latent = head_linear.head_linear_words(q[:, :, :d_n], cp.asarray(w_uk), cp.empty((rows, heads, rank), np.float32),
                                                 backend.stream)
        queries = attention_latent.latent_query_words(q_latent, q, positions_device, inv_freq_device, 1.0, False,
                                                      cp.empty((rows, heads, rank + d_r), np.float32), backend.stream)
        values = head_linear.head_linear_words(cp.asarray(mixed), cp.asarray(w_uv),
                                               cp.empty((rows, heads, d_n), np.float32), backend.stream)
        got = [cp.asnumpy(a) for a in (q_latent, queries, values)] + [bf16_to_float32(cp.asnumpy(latent))]
    q_host = projected[:, : heads * width].reshape(rows, heads, width)
    rounded = bf16_to_float32(bf16_from(q_host[:, :, :d_n]))
    expected_latent_q = head_linear.head_linear_reference(rounded, bf16_to_float32(w_uk))
    assert rel_error(got[0], expected_latent_q) <= 1e-4
    expected_queries = attention_latent.latent_query_reference(expected_latent_q, q_host, positions, inv_freq, 1.0,
                                                                 False)
    assert rel_error(got[1], expected_queries) <= 1e-4
    assert rel_error(got[2], head_linear.head_linear_reference(bf16_to_float32(mixed), bf16_to_float32(w_uv))) <= 1e-4
    expected_cache = np.zeros((4, 16, rank + d_r), np.float32)
    attention_latent.latent_cache_write_reference(projected[:, heads * width:], bf16_to_float32(norm), 1e-6, positions,
                                                  inv_freq, 1.0, False, slots, expected_cache)
    assert rel_error(got[3], expected_cache) <= 1e-2


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_head_linear_op_at_every_row_count(backend, rows):
    """The op as the MLA family calls it, on the kernel (few rows) and on one cuBLAS product per
    head (more than ``HEAD_LINEAR_WORD_ROWS``): the key product from a strided float32 view, the
    value product from bf16."""
    import cupy as cp

    from metrale.kernels import head_linear
    from metrale.ops.selection import HEAD_LINEAR_WORD_ROWS

    assert HEAD_LINEAR_WORD_ROWS < 32
    heads, d_n, d_r, rank = 16, 128, 64, 512
    rng = np.random.default_rng(100 + rows)
    q_host = rng.standard_normal((rows, heads, d_n + d_r)).astype(np.float32)
    w_uk = bf16(rng, (heads * rank, d_n), 0.05)
    w_uv = bf16(rng, (heads * d_n, rank), 0.05)
    mixed = bf16(rng, (rows, heads, rank), 1.0)
    with backend.activate():
        q = cp.asarray(q_host)
        q_latent = backend.ops.head_linear(q[:, :, :d_n], cp.asarray(w_uk))
        values = backend.ops.head_linear(cp.asarray(mixed), cp.asarray(w_uv))
        got_latent, got_values = cp.asnumpy(q_latent), cp.asnumpy(values)
    rounded = bf16_to_float32(bf16_from(q_host[:, :, :d_n]))
    assert got_latent.shape == (rows, heads, rank) and got_values.shape == (rows, heads, d_n)
    assert rel_error(got_latent, head_linear.head_linear_reference(rounded, bf16_to_float32(w_uk))) <= 1e-4
    assert rel_error(got_values, head_linear.head_linear_reference(bf16_to_float32(mixed), bf16_to_float32(w_uv))) <= 1e-4


def bf16_from(values):
    from metrale.loading.checkpoint import float32_to_bf16

    return float32_to_bf16(np.ascontiguousarray(values, dtype=np.float32))


@pytest.mark.parametrize("rows, heads, splits, value_dim", [(1, 16, 16, 512), (4, 32, 12, 64), (2, 16, 32, 256)])
def test_attention_combine(backend, rows, heads, splits, value_dim):
    import cupy as cp

    from metrale.kernels import attention_combine
    from metrale.kernels.attention_latent_mma import combine_partials_model

    rng = np.random.default_rng(splits + value_dim)
    acc = rng.standard_normal((rows, heads, splits, value_dim)).astype(np.float32)
    best = (3 * rng.standard_normal((rows, heads, splits))).astype(np.float32)
    total = rng.uniform(0.5, 4.0, (rows, heads, splits)).astype(np.float32)
    total[:, :, -1] = 0.0  # a split past the row's keys
    with backend.activate():
        out = cp.full((rows, heads * value_dim), 0x7FC0, np.uint16)
        attention_combine.combine(cp.asarray(acc), cp.asarray(best), cp.asarray(total), out, backend.stream)
        got = bf16_to_float32(cp.asnumpy(out)).reshape(rows, heads, value_dim)
    assert rel_error(got, combine_partials_model(acc, best, total)) <= 1e-2


# 70,000 rows: more than a grid's y dimension holds (a 128k prompt's MLP).
@pytest.mark.parametrize("rows, width", [(32, 8192), (5, 1408), (1, 40), (70_000, 64)])
def test_silu_and_mul_words(backend, rows, width):
    import cupy as cp

    from metrale.kernels import activation

    rng = np.random.default_rng(rows + width)
    gate_up = bf16(rng, (rows, 2 * width), 4.0)
    with backend.activate():
        gate_up_device = cp.asarray(gate_up)
        assert activation.words_supported(gate_up_device)
        got = backend.kernels.silu_and_mul_words(gate_up_device)
        got = bf16_to_float32(cp.asnumpy(got))
    values = bf16_to_float32(gate_up)
    expected = activation.silu_and_mul_reference(values[:, :width], values[:, width:])
    assert rel_error(got, expected) <= 1e-2


def test_the_glue_replays_from_a_graph_with_dependent_launches(backend):
    """The norm, the RoPE and cache write, the merge and the SiLU gate recorded one after another
    into a CUDA graph (their launches dependent, as in a decode graph) replay the eager results
    with new inputs."""
    import cupy as cp

    from metrale.kernels import activation, attention_combine, qkv_rope, rmsnorm

    rng = np.random.default_rng(7)
    hidden, heads, kv_heads, head_dim, splits = 2048, 32, 8, 64, 12
    stream = backend.stream
    with cp.cuda.using_allocator(backend.graph_pool.malloc), backend.activate():
        x = cp.asarray(rng.standard_normal((1, hidden)).astype(np.float32))
        residual = cp.asarray(rng.standard_normal((1, hidden)).astype(np.float32))
        weight = cp.asarray(bf16(rng, (hidden,), 0.5))
        normed = cp.empty((1, hidden), np.uint16)
        qkv = cp.asarray(rng.standard_normal((1, (heads + 2 * kv_heads) * head_dim)).astype(np.float32))
        positions, slots = cp.asarray(np.array([300], np.int32)), cp.asarray(np.array([5], np.int32))
        inv_freq = cp.asarray((1.0 / 10000 ** (np.arange(32, dtype=np.float32) / 32)).astype(np.float32))
        k_cache = cp.zeros((2, 16, kv_heads, head_dim), np.uint16)
        v_cache = cp.zeros_like(k_cache)
        q = cp.empty((1, heads, head_dim), np.float32)
        acc = cp.asarray(rng.standard_normal((1, heads, splits, head_dim)).astype(np.float32))
        best = cp.asarray(rng.standard_normal((1, heads, splits)).astype(np.float32))
        total = cp.asarray(rng.uniform(0.5, 2.0, (1, heads, splits)).astype(np.float32))
        out = cp.empty((1, heads * head_dim), np.uint16)
        gate_up = cp.asarray(bf16(rng, (4, 2 * 1024), 2.0))
        gated = cp.empty((4, 1024), np.uint16)

        def step():
            rmsnorm.rmsnorm_residual_words(x, residual, weight, 1e-6, 0.0, False, normed, stream)
            qkv_rope.qkv_rope_cache_words(qkv, positions, slots, inv_freq, 1.0, heads, kv_heads, head_dim, k_cache,
                                          v_cache, q, stream=stream)
            attention_combine.combine(acc, best, total, out, stream)
            activation.silu_and_mul_words(gate_up, gated, stream)

        step()
        stream.synchronize()
        stream.begin_capture(getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", 2))
        try:
            step()
        finally:
            graph = stream.end_capture()
        for name, array in (("x", x), ("qkv", qkv), ("acc", acc)):
            array.set(rng.standard_normal(array.shape).astype(np.float32), stream=stream)
        positions.set(np.array([1234], np.int32), stream=stream)
        gate_up.set(bf16(rng, gate_up.shape, 2.0), stream=stream)
        graph.launch(stream=stream)
        stream.synchronize()
        replayed = [cp.asnumpy(a).copy() for a in (normed, q, k_cache, out, gated)]
        step()
        stream.synchronize()
        eager = [cp.asnumpy(a) for a in (normed, q, k_cache, out, gated)]
    for a, b in zip(replayed, eager):
        np.testing.assert_array_equal(a, b)
