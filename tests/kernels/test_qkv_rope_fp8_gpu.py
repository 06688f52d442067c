"""RoPE with the cache write into an FP8 cache on a real GPU: the fused form
(:func:`metrale.kernels.qkv_rope.qkv_rope_cache_fp8_words`) writes the codes and scales that the
bf16 kernel's rows quantized by :func:`metrale.kernels.attention_fp8.write_fp8_rows` give, bit for
bit, at model shapes, with static scales, and from a CUDA graph with new positions."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backend():
    from metrale.backends.cuda import CudaBackend

    backend = CudaBackend()
    yield backend
    backend.close()


def fp8_caches(blocks, block_size, kv_heads, head_dim, statics):
    import cupy as cp

    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

    shape = (blocks, block_size, kv_heads, head_dim)
    return [Fp8CacheArray(cp.zeros(shape, np.uint8), cp.ones(shape[:3], np.float32), static or None)
            for static in statics]


@pytest.mark.parametrize("rows, heads, kv_heads, head_dim, norm, statics", [
    (32, 32, 8, 128, False, (0.0, 0.0)),  # Llama-8B's heads, a decode batch
    (200, 16, 8, 128, True, (0.0, 0.0)),  # a prompt's rows, a q/k norm
    (5, 8, 2, 256, False, (0.05, 0.02)),  # 256 dims, the checkpoint's static scales
])
def test_the_fused_fp8_write_equals_the_rows_then_the_quantized_write(backend, rows, heads, kv_heads, head_dim, norm,
                                                                        statics):
    import cupy as cp

    from metrale.loading.checkpoint import float32_to_bf16

    rng = np.random.default_rng(rows + head_dim)
    blocks, block_size = -(-rows // 16) + 2, 16
    qkv = cp.asarray((2 * rng.standard_normal((rows, (heads + 2 * kv_heads) * head_dim))).astype(np.float32))
    positions = cp.asarray(rng.integers(0, 8000, rows).astype(np.int32))
    slots = cp.asarray(rng.permutation(blocks * block_size)[:rows].astype(np.int32))
    inv_freq = cp.asarray((1.0 / 500000 ** (np.arange(head_dim // 2) / (head_dim // 2))).astype(np.float32))
    norms = [cp.asarray(float32_to_bf16((0.5 * rng.standard_normal(head_dim)).astype(np.float32)))
             for _ in range(2)] if norm else [None, None]
    fused, composed = fp8_caches(blocks, block_size, kv_heads, head_dim, statics), \
        fp8_caches(blocks, block_size, kv_heads, head_dim, statics)
    with backend.activate():
        q_fused = backend.kernels.qkv_rope_cache_fp8(qkv, positions, slots, inv_freq, 1.0, heads, kv_heads, head_dim,
                                                     *fused, *norms)
        q_composed = backend.kernels.qkv_rope_cache_fp8_rows(qkv, positions, slots, inv_freq, 1.0, heads, kv_heads,
                                                             head_dim, *composed, *norms)
        backend.stream.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(q_fused), cp.asnumpy(q_composed))
    for mine, theirs in zip(fused, composed):
        np.testing.assert_array_equal(cp.asnumpy(mine.codes), cp.asnumpy(theirs.codes))
        np.testing.assert_array_equal(cp.asnumpy(mine.scales), cp.asnumpy(theirs.scales))
    assert int((cp.asnumpy(fused[0].codes) != 0).sum()) > rows * kv_heads * head_dim // 2  # rows were written


def test_the_fused_fp8_write_replays_from_a_graph_with_new_positions(backend):
    import cupy as cp

    from metrale.kernels import qkv_rope

    rng = np.random.default_rng(3)
    rows, heads, kv_heads, head_dim, blocks, block_size = 8, 32, 8, 128, 8, 16
    qkv = cp.asarray(rng.standard_normal((rows, (heads + 2 * kv_heads) * head_dim)).astype(np.float32))
    positions = cp.zeros(rows, np.int32)
    slots = cp.asarray(rng.permutation(blocks * block_size)[:rows].astype(np.int32))
    inv_freq = cp.asarray((1.0 / 10000 ** (np.arange(64) / 64)).astype(np.float32))
    caches = fp8_caches(blocks, block_size, kv_heads, head_dim, (0.0, 0.0))
    q = cp.empty((rows, heads, head_dim), np.float32)
    stream = cp.cuda.Stream(non_blocking=True)

    def run():
        qkv_rope.qkv_rope_cache_fp8_words(qkv, positions, slots, inv_freq, 1.0, heads, kv_heads, head_dim, *caches, q,
                                          stream=stream)

    run()
    stream.synchronize()
    with stream:
        stream.begin_capture()
        run()
        graph = stream.end_capture()
    fresh = rng.integers(0, 4000, rows).astype(np.int32)
    positions.set(fresh, stream=stream)
    graph.launch(stream)
    stream.synchronize()
    replayed = [cp.asnumpy(caches[0].codes).copy(), cp.asnumpy(caches[0].scales).copy(), cp.asnumpy(q).copy()]
    run()  # eagerly with the same positions
    stream.synchronize()
    np.testing.assert_array_equal(replayed[0], cp.asnumpy(caches[0].codes))
    np.testing.assert_array_equal(replayed[1], cp.asnumpy(caches[0].scales))
    np.testing.assert_array_equal(replayed[2], cp.asnumpy(q))
    assert np.abs(replayed[2][:, :, :64]).max() > 0  # the rotated queries of the new positions
