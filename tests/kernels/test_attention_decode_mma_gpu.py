"""The tensor-core decode attention against the NumPy reference: head sizes 64, 128 and 256, groups
of 1 to 20 query heads (two head blocks), cache blocks of 1 and 16 tokens, sliding windows, one
split (the normalised output written directly) and several (merged by the combine kernel), a
replay from a CUDA graph with the rows' positions moved on, rows far shorter than their split
count after a kernel left NaN in shared memory, and the backend op, whose registry chooses the
kernel for decode rows of these geometries."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import bf16, rel_error  # noqa: E402

from metrale.kernels import attention, attention_decode_mma
from metrale.loading.checkpoint import bf16_to_float32

pytestmark = pytest.mark.gpu


def decode_case(rng, rows, heads, kv_heads, head_dim, max_context, block_size):
    """``rows`` decode rows, one per sequence (in another order than the sequences); the last sees
    ``max_context`` keys, the others up to that many; the cache's blocks shuffled, with spare ones
    no table names (room for 64 more tokens a sequence)."""
    contexts = rng.integers(1, max_context + 1, rows)
    contexts[-1] = max_context
    blocks_per_seq = [-(-(int(c) + 64) // block_size) for c in contexts]
    total_blocks = sum(blocks_per_seq) + 5
    order = rng.permutation(np.arange(total_blocks))
    tables = np.zeros((rows, max(blocks_per_seq)), np.int32)
    used = 0
    for s, count in enumerate(blocks_per_seq):
        tables[s, :count] = order[used : used + count]
        used += count
    k_cache = bf16(rng, (total_blocks, block_size, kv_heads, head_dim))
    v_cache = bf16(rng, (total_blocks, block_size, kv_heads, head_dim))
    q = rng.standard_normal((rows, heads, head_dim)).astype(np.float32)
    seq_index = rng.permutation(rows).astype(np.int32)
    tables = tables[np.argsort(seq_index)]
    positions = (contexts - 1).astype(np.int32)
    return q, k_cache, v_cache, tables, seq_index, positions


def reference(q, k_cache, v_cache, tables, seq_index, positions, window):
    rows = q.shape[0]
    return attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, q.shape[2] ** -0.5,
        window).reshape(rows, -1)


def workspace(rows, heads, splits, head_dim):
    import cupy as cp

    return (cp.full((rows, heads, splits, head_dim), np.nan, dtype=np.float32),
            cp.full((rows, heads, splits), np.nan, dtype=np.float32), cp.full((rows, heads, splits), np.nan, dtype=np.float32))


@pytest.mark.parametrize("heads, kv_heads, head_dim", [
    (32, 8, 128), (16, 8, 128), (14, 2, 64), (8, 8, 64), (40, 2, 128), (16, 2, 256), (4, 2, 32),
])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("splits", [1, 3, "chosen"])
def test_decode_attention_matches_the_reference(heads, kv_heads, head_dim, block_size, window, splits):
    import cupy as cp

    rng = np.random.default_rng(heads + kv_heads + head_dim + block_size)
    rows, max_context = 9, 1500
    q, k_cache, v_cache, tables, seq_index, positions = decode_case(rng, rows, heads, kv_heads, head_dim, max_context,
                                                                    block_size)
    if splits == "chosen":
        splits = attention_decode_mma.device_split_count(rows, heads, kv_heads, head_dim, 4096)
    out = cp.full((rows, heads * head_dim), 0xFFFF, dtype=np.uint16)
    attention_decode_mma.decode_attention(*(cp.asarray(a) for a in (q, k_cache, v_cache, tables, seq_index, positions)),
                                          head_dim**-0.5, window, workspace(rows, heads, splits, head_dim), out)
    got = bf16_to_float32(cp.asnumpy(out))
    assert not np.isnan(got).any()
    assert rel_error(got, reference(q, k_cache, v_cache, tables, seq_index, positions, window)) <= 1e-2


def test_decode_attention_replays_in_a_cuda_graph_as_positions_advance():
    import cupy as cp

    rng = np.random.default_rng(21)
    rows, heads, kv_heads, head_dim, max_context = 6, 16, 8, 128, 700
    q, k_cache, v_cache, tables, seq_index, positions = decode_case(rng, rows, heads, kv_heads, head_dim, 600, 16)
    arguments = [cp.asarray(a) for a in (q, k_cache, v_cache, tables, seq_index, positions)]
    splits = attention_decode_mma.device_split_count(rows, heads, kv_heads, head_dim, max_context)
    space = workspace(rows, heads, splits, head_dim)
    out = cp.zeros((rows, heads * head_dim), dtype=np.uint16)
    stream = cp.cuda.Stream(non_blocking=True)

    def run():
        attention_decode_mma.decode_attention(*arguments, head_dim**-0.5, None, space, out, stream)

    run()  # compiled outside the capture
    stream.synchronize()
    with stream:
        stream.begin_capture()
        run()
        graph = stream.end_capture()
    for step in (0, 1, 37):
        moved = positions + step
        with stream:  # (a non-blocking stream: the writes must be ordered before the replay)
            arguments[5][...] = cp.asarray(moved)
            out[...] = 0
        graph.launch(stream)
        stream.synchronize()
        want = reference(q, k_cache, v_cache, tables, seq_index, moved, None)
        assert rel_error(bf16_to_float32(cp.asnumpy(out)), want) <= 1e-2, step


@pytest.mark.parametrize("decode_mma", [True, False])
def test_the_backend_op_takes_the_tensor_cores_for_decode_rows(monkeypatch, decode_mma):
    """The CUDA backend's paged_attention: the tensor-core kernel for decode rows, unless the
    backend's settings turn it off (METRALE_DECODE_MMA=0)."""
    import cupy as cp

    from metrale.backends.cuda import CudaBackend
    from metrale.config import EnvironmentConfig

    calls = []
    launch = attention_decode_mma.decode_attention
    monkeypatch.setattr(attention_decode_mma, "decode_attention", lambda *a, **k: calls.append(1) or launch(*a, **k))
    rng = np.random.default_rng(22)
    rows, heads, kv_heads, head_dim = 5, 32, 8, 128
    q, k_cache, v_cache, tables, seq_index, positions = decode_case(rng, rows, heads, kv_heads, head_dim, 900, 16)
    batch = type("Batch", (), dict(
        block_tables=cp.asarray(tables), seq_index=cp.asarray(seq_index), positions=cp.asarray(positions),
        max_context=900, row_starts=np.arange(rows + 1), extras={}))()
    backend = CudaBackend(environment=EnvironmentConfig(decode_mma=decode_mma))
    with backend.activate():
        out = backend.ops.paged_attention(cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache), batch,
                                          head_dim**-0.5, None)
    backend.synchronize()
    assert bool(calls) == decode_mma
    want = reference(q, k_cache, v_cache, tables, seq_index, positions, None)
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), want) <= 1e-2


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 64), (32, 8, 128), (40, 2, 128), (16, 2, 256)])
def test_the_last_split_merges_as_the_combine_kernel_does(heads, kv_heads, head_dim):
    import cupy as cp

    rng = np.random.default_rng(heads * head_dim)
    rows, splits = 7, 5
    q, k_cache, v_cache, tables, seq_index, positions = decode_case(rng, rows, heads, kv_heads, head_dim, 700, 16)
    arguments = [cp.asarray(a) for a in (q, k_cache, v_cache, tables, seq_index, positions)]
    counters = cp.zeros(attention_decode_mma.counter_count(rows, heads, kv_heads), dtype=np.int32)
    outputs = []
    for merge in (None, counters, counters):  # the combine kernel, then two merged launches on the same counters
        out = cp.full((rows, heads * head_dim), 0xFFFF, dtype=np.uint16)
        attention_decode_mma.decode_attention(*arguments, head_dim**-0.5, None, workspace(rows, heads, splits, head_dim),
                                              out, counters=merge)
        cp.cuda.Device().synchronize()
        outputs.append(bf16_to_float32(cp.asnumpy(out)))
    assert not cp.asnumpy(counters).any()  # zero again for the next launch
    want = reference(q, k_cache, v_cache, tables, seq_index, positions, None)
    for got in outputs:
        assert not np.isnan(got).any()
        assert rel_error(got, want) <= 1e-2
    # The same arithmetic as the combine kernel but for the order of one sum: at most a bf16 step apart.
    assert np.abs(outputs[1] - outputs[0]).max() <= 2.0**-7 * np.abs(outputs[0]).max()
    np.testing.assert_array_equal(outputs[1], outputs[2])


def test_merged_splits_replay_from_a_graph_and_the_engine_keeps_its_tokens():
    import cupy as cp

    from metrale import LLM, SamplingParams, hookimpl

    rows, heads, kv_heads, head_dim = 3, 32, 8, 64
    q, k_cache, v_cache, tables, seq_index, positions = decode_case(np.random.default_rng(31), rows, heads, kv_heads,
                                                                    head_dim, 600, 16)
    arguments = [cp.asarray(a) for a in (q, k_cache, v_cache, tables, seq_index, positions)]
    counters = cp.zeros(attention_decode_mma.counter_count(rows, heads, kv_heads), dtype=np.int32)
    space = workspace(rows, heads, 6, head_dim)
    out = cp.zeros((rows, heads * head_dim), dtype=np.uint16)
    stream = cp.cuda.Stream(non_blocking=True)

    def run():
        attention_decode_mma.decode_attention(*arguments, head_dim**-0.5, None, space, out, stream, counters)

    cp.cuda.Device().synchronize()  # (the arrays above were written on the default stream)
    run()
    stream.synchronize()
    with stream:
        stream.begin_capture()
        run()
        graph = stream.end_capture()
    for step in (0, 5, 40):
        moved = positions + step
        with stream:
            arguments[5][...] = cp.asarray(moved)
            out[...] = 0
        graph.launch(stream)
        stream.synchronize()
        want = reference(q, k_cache, v_cache, tables, seq_index, moved, None)
        assert rel_error(bf16_to_float32(cp.asnumpy(out)), want) <= 1e-2, step

    prompts = [np.random.default_rng(n).integers(0, 3072, n).tolist() for n in (300, 70, 9)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = {}
    from metrale.model.plugin_manager import get_plugin_manager
    from metrale.ops.selection import merged_decode_attention_kernels

    class MergedSplits:
        METRALE_CONTRACT_VERSION = "1.1"

        @hookimpl
        def metrale_register_ops(self, registry):
            for kernel in merged_decode_attention_kernels():
                registry.add_kernel(kernel)

    for merge in (False, True):
        manager = get_plugin_manager()
        if merge:
            manager.register(MergedSplits(), name="merged-splits")
        llm = LLM("tiny-dense", device="cuda", show_progress=False, max_model_len=1024, plugin_manager=manager)
        assert ("merged in the kernel" in llm.backend.ops.paged_attention_decode.kernels[0][0].name) == merge
        outputs = llm.generate(prompts, params, use_tqdm=False)
        llm.close()
        assert all(o.error is None and len(o.token_ids) == 24 for o in outputs)
        tokens[merge] = [o.token_ids for o in outputs]
    # Greedy tokens of a random model part at near ties when a sum changes order: nearly all agree.
    pairs = [(a, b) for merged, plain in zip(tokens[True], tokens[False]) for a, b in zip(merged, plain)]
    assert sum(a == b for a, b in pairs) >= 0.9 * len(pairs)


#: Fills a block's dynamic shared memory with ones bits (NaN as bf16 and as float32), so a kernel
#: that runs next on the multiprocessor and reads shared memory it never wrote sees NaN.
POISON_SHARED = r"""
extern "C" __global__ void poison_shared(int words) {
    extern __shared__ unsigned int memory[];
    for (int i = threadIdx.x; i < words; i += blockDim.x) memory[i] = 0xffffffffu;
}
"""


@pytest.mark.parametrize("head_dim, splits, max_context", [(64, 12, 65), (128, 16, 130), (64, 8, 65)])
def test_short_rows_under_many_splits_read_no_stale_shared_memory(head_dim, splits, max_context):
    """Rows far shorter than the split count was chosen for (a graph captured for a longer
    context replaying a short one): a split past a row's last key finds the step's own key inside
    its first stage; whatever shared memory held there must not reach the output."""
    import cupy as cp

    from metrale.kernels.attention_latent_mma import multiprocessor_count

    heads, kv_heads, rows = 32, 8, 9
    rng = np.random.default_rng(head_dim + splits)
    q, k_cache, v_cache, tables, seq_index, positions = decode_case(rng, rows, heads, kv_heads, head_dim, max_context,
                                                                    16)
    poison = cp.RawKernel(POISON_SHARED, "poison_shared")
    shared = 200 * 1024
    poison.max_dynamic_shared_size_bytes = shared
    want = reference(q, k_cache, v_cache, tables, seq_index, positions, None)
    for counters in (None, cp.zeros(attention_decode_mma.counter_count(rows, heads, kv_heads), np.int32)):
        out = cp.full((rows, heads * head_dim), 0xFFFF, dtype=np.uint16)
        arguments = [cp.asarray(a) for a in (q, k_cache, v_cache, tables, seq_index, positions)]
        stream = cp.cuda.get_current_stream()
        poison((2 * multiprocessor_count(),), (1024,), (np.int32(shared // 4),), shared_mem=shared, stream=stream)
        attention_decode_mma.decode_attention(*arguments, head_dim**-0.5, None,
                                              workspace(rows, heads, splits, head_dim), out, stream, counters)
        got = bf16_to_float32(cp.asnumpy(out))
        assert not np.isnan(got).any(), "a stale shared value reached the output"
        assert rel_error(got, want) <= 1e-2


@pytest.mark.parametrize("softcap, with_sinks", [(30.0, False), (None, True), (30.0, True)])
@pytest.mark.parametrize("splits", [1, 5, "merged"])
def test_decode_attention_caps_logits_and_counts_sinks(softcap, with_sinks, splits):
    """Gemma-2's soft cap and GPT-OSS's sinks on tensor cores: one split, five merged by the combine
    kernel, five merged by the kernel itself (the sink counted once, by split 0)."""
    import cupy as cp

    rng = np.random.default_rng(51)
    rows, heads, kv_heads, head_dim = 5, 64, 8, 64
    q, k_cache, v_cache, tables, seq_index, positions = decode_case(rng, rows, heads, kv_heads, head_dim, 900, 16)
    q *= 8  # logits large enough to cap
    sinks = (rng.standard_normal(heads) + 2).astype(np.float32) if with_sinks else None
    count = 1 if splits == 1 else 5
    counters = cp.zeros(attention_decode_mma.counter_count(rows, heads, kv_heads), np.int32) if splits == "merged" else None
    out = cp.full((rows, heads * head_dim), 0xFFFF, dtype=np.uint16)
    attention_decode_mma.decode_attention(*(cp.asarray(a) for a in (q, k_cache, v_cache, tables, seq_index, positions)),
                                          head_dim**-0.5, None, workspace(rows, heads, count, head_dim), out,
                                          counters=counters, softcap=softcap,
                                          sinks=None if sinks is None else cp.asarray(sinks))
    want = attention.paged_attention_reference(q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index,
                                               positions, head_dim**-0.5, None, softcap, sinks).reshape(rows, -1)
    got = bf16_to_float32(cp.asnumpy(out))
    assert not np.isnan(got).any()
    assert rel_error(got, want) <= 1e-2


@pytest.mark.parametrize("head_dim", [64, 256])
def test_the_backend_op_serves_softcap_and_sinks_on_a_mixed_step(head_dim):
    """paged_attention of the CUDA backend with both options on decode rows and a prompt chunk: the
    registry routes the prompt rows to a kernel that serves them (the CUDA-core prefill kernel at 64
    dims, the decode kernels a row at a time at 256)."""
    import cupy as cp

    from metrale.backends.cuda import CudaBackend

    rng = np.random.default_rng(52 + head_dim)
    heads, kv_heads, block_size = 16, 4, 16
    _, k_cache, v_cache, tables, seq_index, positions = decode_case(rng, 3, heads, kv_heads, head_dim, 600, block_size)
    # Rows: the three decode rows, then a chunk of 40 rows of the last row's sequence (at 599) before it.
    seq_index = np.concatenate([seq_index, np.full(40, seq_index[-1])]).astype(np.int32)
    positions = np.concatenate([positions, np.arange(559, 599)]).astype(np.int32)
    q = 4 * rng.standard_normal((43, heads, head_dim)).astype(np.float32)
    sinks = (rng.standard_normal(heads) + 1).astype(np.float32)
    batch = type("Batch", (), dict(block_tables=cp.asarray(tables), seq_index=cp.asarray(seq_index),
                                   positions=cp.asarray(positions), max_context=700, row_starts=np.array([0, 1, 2, 3, 43]),
                                   extras={}))()
    backend = CudaBackend()
    with backend.activate():
        out = backend.ops.paged_attention(cp.asarray(q), cp.asarray(k_cache), cp.asarray(v_cache), batch,
                                          head_dim**-0.5, None, 20.0, cp.asarray(sinks))
    backend.synchronize()
    want = attention.paged_attention_reference(q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index,
                                               positions, head_dim**-0.5, None, 20.0, sinks).reshape(43, -1)
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), want) <= 1e-2
    backend.close()


@pytest.mark.parametrize("heads, kv_heads, head_dim", [
    (32, 8, 128), (14, 2, 64), (16, 2, 256),
    (40, 2, 128),  # groups of 20 heads: two tiles of 8 a block, two blocks a KV head
])
@pytest.mark.parametrize("splits", [1, "chosen"])
def test_an_fp8_cache_reads_closer_to_the_float_attention_than_the_bf16_kernel_its_dequantized_rows(
        heads, kv_heads, head_dim, splits):
    """The FP8 cache's launch (codes and scales on the device) against the float attention over
    the codes times their scales: at least as close as the bf16 launch over ``dequantized_cache``,
    within the bf16 output's rounding."""
    import cupy as cp

    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray
    from metrale.kernels.quantized import fp8_e4m3_to_float32
    from metrale.loading.checkpoint import float32_to_bf16

    rng = np.random.default_rng(heads + head_dim)
    rows, max_context = 9, 1500
    q, k_bits, v_bits, tables, seq_index, positions = decode_case(rng, rows, heads, kv_heads, head_dim, max_context, 16)
    host = [Fp8CacheArray.zeros(k_bits.shape).quantize(bf16_to_float32(bits)) for bits in (k_bits, v_bits)]
    device = [Fp8CacheArray(cp.asarray(codes), cp.asarray(scales)) for codes, scales in host]
    dequantized = [cp.asarray(float32_to_bf16(attention_decode_mma.dequantized_cache(*pair))) for pair in host]
    if splits == "chosen":
        splits = attention_decode_mma.device_split_count(rows, heads, kv_heads, head_dim, 4096, fp8=True)
    metadata = [cp.asarray(a) for a in (tables, seq_index, positions)]
    outputs = []
    for k_cache, v_cache in (device, dequantized):
        out = cp.full((rows, heads * head_dim), 0xFFFF, dtype=np.uint16)
        attention_decode_mma.decode_attention(cp.asarray(q), k_cache, v_cache, *metadata, head_dim**-0.5, None,
                                              workspace(rows, heads, splits, head_dim), out)
        outputs.append(cp.asnumpy(out))
    exact = [fp8_e4m3_to_float32(codes) * scales[..., None] for codes, scales in host]
    expected = attention.paged_attention_reference(q, *exact, tables, seq_index, positions, head_dim**-0.5,
                                                   None).reshape(rows, -1)
    fp8_error, bf16_error = (rel_error(bf16_to_float32(out), expected) for out in outputs)
    assert fp8_error <= bf16_error
    assert fp8_error <= 4e-3
