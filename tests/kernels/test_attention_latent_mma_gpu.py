"""The tensor-core MLA decode attention against the NumPy reference at DeepSeek's sizes (16 and 128
heads, latent rows of 576, values of 512): 1 and 32 rows, contexts up to 1, 512 and 2,048 over
shuffled cache blocks of 16 and 64, the backend op, and a replay from a CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import bf16, rel_error  # noqa: E402

from metrale.kernels import attention_latent, attention_latent_mma
from metrale.loading.checkpoint import bf16_to_float32

pytestmark = pytest.mark.gpu

WIDTH, VALUE_DIM, SCALE = 576, 512, 0.1147


def latent_case(rng, rows, heads, max_context, block_size):
    """``rows`` decode rows, one per sequence; the last sees ``max_context`` keys, the others up to
    that many; the cache's blocks shuffled, with spare ones no table names."""
    contexts = rng.integers(1, max_context + 1, rows)
    contexts[-1] = max_context
    blocks_per_seq = [-(-int(c) // block_size) for c in contexts]
    total_blocks = sum(blocks_per_seq) + 5
    order = rng.permutation(np.arange(total_blocks))
    tables = np.zeros((rows, max(blocks_per_seq)), np.int32)
    used = 0
    for s, count in enumerate(blocks_per_seq):
        tables[s, :count] = order[used : used + count]
        used += count
    latent = bf16(rng, (total_blocks, block_size, WIDTH))
    q = (0.5 * rng.standard_normal((rows, heads, WIDTH))).astype(np.float32)
    seq_index = rng.permutation(rows).astype(np.int32)  # rows in another order than their sequences
    tables = tables[np.argsort(seq_index)]
    positions = (contexts - 1).astype(np.int32)
    return q, latent, tables, seq_index, positions


def expected_output(q, latent, tables, seq_index, positions):
    rows, heads, _ = q.shape
    return attention_latent.latent_attention_reference(
        q, bf16_to_float32(latent), tables, seq_index, positions, VALUE_DIM, SCALE).reshape(rows, heads * VALUE_DIM)


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("rows", [1, 32])
@pytest.mark.parametrize("max_context", [1, 512, 2048])
@pytest.mark.parametrize("block_size", [16, 64])
def test_latent_attention_matches_the_reference(heads, rows, max_context, block_size):
    import cupy as cp

    rng = np.random.default_rng(heads + rows + max_context + block_size)
    q, latent, tables, seq_index, positions = latent_case(rng, rows, heads, max_context, block_size)
    expected = expected_output(q, latent, tables, seq_index, positions)
    out = cp.full((rows, heads * VALUE_DIM), 0xFFFF, dtype=np.uint16)
    attention_latent_mma.latent_attention(*(cp.asarray(a) for a in (q, latent, tables, seq_index, positions)),
                                          VALUE_DIM, SCALE, max_context, out)
    got = bf16_to_float32(cp.asnumpy(out))
    assert not np.isnan(got).any()
    assert rel_error(got, expected) <= 1e-2
    # The CUDA-core kernel, on the same inputs, to within the two kernels' roundings.
    cores = cp.zeros_like(out)
    attention_latent.latent_attention(*(cp.asarray(a) for a in (q, latent, tables, seq_index, positions)),
                                      VALUE_DIM, SCALE, max_context, cores)
    assert rel_error(got, bf16_to_float32(cp.asnumpy(cores))) <= 1.5e-2


def test_latent_attention_replays_in_a_cuda_graph():
    import cupy as cp

    rng = np.random.default_rng(11)
    q, latent, tables, seq_index, positions = latent_case(rng, 4, 16, 700, 16)
    expected = expected_output(q, latent, tables, seq_index, positions)
    arguments = [cp.asarray(a) for a in (q, latent, tables, seq_index, positions)]
    out = cp.zeros((4, 16 * VALUE_DIM), dtype=np.uint16)
    stream = cp.cuda.Stream(non_blocking=True)
    attention_latent_mma.latent_attention(*arguments, VALUE_DIM, SCALE, 700, out, stream)  # compiled outside the capture
    stream.synchronize()
    out[...] = 0
    cp.cuda.Device().synchronize()  # (written on the default stream, which the capture's does not wait for)
    with stream:
        stream.begin_capture()
        attention_latent_mma.latent_attention(*arguments, VALUE_DIM, SCALE, 700, out, stream)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), expected) <= 1e-2
    # New query values in the same buffers, replayed.
    q2 = (0.5 * rng.standard_normal(q.shape)).astype(np.float32)
    arguments[0][...] = cp.asarray(q2)
    cp.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), expected_output(q2, latent, tables, seq_index, positions)) <= 1e-2


def test_the_backend_op_takes_the_tensor_cores_for_deepseek_heads(monkeypatch):
    import cupy as cp

    from metrale.backends.cuda import CudaBackend

    calls = []
    launch = attention_latent_mma.latent_attention
    monkeypatch.setattr(attention_latent_mma, "latent_attention", lambda *a, **k: calls.append(1) or launch(*a, **k))
    rng = np.random.default_rng(12)
    q, latent, tables, seq_index, positions = latent_case(rng, 3, 16, 300, 16)
    batch = type("Batch", (), dict(block_tables=cp.asarray(tables), seq_index=cp.asarray(seq_index),
                                   positions=cp.asarray(positions), max_context=300))()
    backend = CudaBackend()
    with backend.activate():
        out = backend.ops.latent_attention(cp.asarray(q), cp.asarray(latent), batch, VALUE_DIM, SCALE)
    backend.synchronize()
    assert calls
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), expected_output(q, latent, tables, seq_index, positions)) <= 1e-2


@pytest.mark.parametrize("rows, max_context", [(1, 2048), (32, 512)])
def test_latent_attention_over_an_fp8_cache_matches_the_reference(rows, max_context):
    """The CUDA-core kernel over an FP8 latent cache (each row's codes and scale, as the cache
    write stores them) against the reference over the dequantized cache, at DeepSeek's sizes."""
    import cupy as cp

    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

    rng = np.random.default_rng(rows + max_context)
    q, latent, tables, seq_index, positions = latent_case(rng, rows, 16, max_context, 16)
    values = bf16_to_float32(latent) * rng.uniform(0.05, 20.0, latent.shape[:2] + (1,)).astype(np.float32)
    host = Fp8CacheArray.zeros(latent.shape)
    host.write(np.arange(latent.shape[0] * latent.shape[1]), values.reshape(-1, WIDTH))
    expected = attention_latent.latent_attention_reference(
        q, host, tables, seq_index, positions, VALUE_DIM, SCALE).reshape(rows, -1)
    device = Fp8CacheArray(cp.asarray(host.codes), cp.asarray(host.scales))
    out = cp.full((rows, 16 * VALUE_DIM), 0xFFFF, dtype=np.uint16)
    attention_latent.latent_attention(cp.asarray(q), device, *(cp.asarray(a) for a in (tables, seq_index, positions)),
                                      VALUE_DIM, SCALE, max_context, out)
    got = bf16_to_float32(cp.asnumpy(out))
    assert not np.isnan(got).any()
    assert rel_error(got, expected) <= 1e-2


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("rows, max_context, block_size", [(1, 2048, 16), (32, 512, 64), (5, 700, 16)])
def test_the_tensor_cores_over_an_fp8_cache_match_the_reference(heads, rows, max_context, block_size):
    """The tensor-core kernel over an FP8 latent cache (rows of differing scales, and every finite
    E4M3 code, subnormals included, in one block) against the reference over the dequantized
    cache and against the CUDA-core kernel over the same codes."""
    import cupy as cp

    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

    rng = np.random.default_rng(heads + rows + max_context)
    q, latent, tables, seq_index, positions = latent_case(rng, rows, heads, max_context, block_size)
    # (Row scales within 4x of each other: with 0.05 to 20 the kernel's own NumPy model, its bf16
    # roundings of the queries and probabilities, is already 3e-2 from the reference.)
    values = bf16_to_float32(latent) * rng.uniform(0.5, 2.0, latent.shape[:2] + (1,)).astype(np.float32)
    host = Fp8CacheArray.zeros(latent.shape)
    host.write(np.arange(latent.shape[0] * latent.shape[1]), values.reshape(-1, WIDTH))
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    host.codes[tables[seq_index[-1], 0]] = np.resize(finite, (block_size, WIDTH))  # the longest row's first block
    expected = attention_latent.latent_attention_reference(
        q, host, tables, seq_index, positions, VALUE_DIM, SCALE).reshape(rows, -1)
    device = Fp8CacheArray(cp.asarray(host.codes), cp.asarray(host.scales))
    arguments = [cp.asarray(a) for a in (tables, seq_index, positions)]
    out = cp.full((rows, heads * VALUE_DIM), 0xFFFF, dtype=np.uint16)
    attention_latent_mma.latent_attention(cp.asarray(q), device, *arguments, VALUE_DIM, SCALE, max_context, out)
    got = bf16_to_float32(cp.asnumpy(out))
    assert not np.isnan(got).any()
    assert rel_error(got, expected) <= 1e-2
    cores = cp.zeros_like(out)
    attention_latent.latent_attention(cp.asarray(q), device, *arguments, VALUE_DIM, SCALE, max_context, cores)
    assert rel_error(got, bf16_to_float32(cp.asnumpy(cores))) <= 1.5e-2
