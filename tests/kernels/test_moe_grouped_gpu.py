"""The grouped MoE kernels (``metrale.kernels.moe_grouped``) against the NumPy reference on a real
GPU: DeepSeek-V2-Lite and Qwen3-Next expert shapes at prompt sizes, awkward shapes and routings,
other tilings, the device alignment, the CUDA op around them, and a CUDA-graph replay with new
routing."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import bf16, rel_error  # noqa: E402

from metrale.loading.checkpoint import bf16_to_float32

pytestmark = pytest.mark.gpu

# (H, I, E, k): DeepSeek-V2-Lite and Qwen3-Next experts.
DEEPSEEK = (2048, 1408, 64, 6)
QWEN3_NEXT = (2048, 512, 128, 10)


def distinct(rng, tokens, top_k, num_experts):
    return np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :top_k].astype(np.int32)


def all_to_expert_0(rng, tokens, top_k, num_experts):
    chosen = 1 + np.argsort(rng.random((tokens, num_experts - 1)), axis=1)[:, : top_k - 1]
    return np.concatenate([np.zeros((tokens, 1), np.int64), chosen], axis=1).astype(np.int32)


def few_experts(rng, tokens, top_k, num_experts):
    return distinct(rng, tokens, top_k, min(num_experts, top_k + 2))


_weights: dict = {}


def expert_weights(hidden, inter, num_experts):
    """bf16 stacked expert weights of a shape, on the host (as float32) and the device, made once
    per shape."""
    import cupy as cp

    key = (hidden, inter, num_experts)
    if key not in _weights:
        rng = np.random.default_rng(hidden + inter + num_experts)
        gate_up = bf16(rng, (num_experts * 2 * inter, hidden), scale=0.05)
        down = bf16(rng, (num_experts * hidden, inter), scale=0.05)
        _weights[key] = (bf16_to_float32(gate_up), bf16_to_float32(down), cp.asarray(gate_up), cp.asarray(down))
    return _weights[key]


def routing(rng, tokens, hidden, top_k, num_experts, choose):
    x = bf16(rng, (tokens, hidden))
    return x, choose(rng, tokens, top_k, num_experts), rng.random((tokens, top_k)).astype(np.float32)


def run_grouped(x, chosen, weights, gate_up, down, tiling=None):
    """``out`` of the grouped kernels (fresh scratch, filled with garbage first)."""
    import cupy as cp

    from metrale.kernels import moe_grouped

    tiling = tiling or moe_grouped.TILING
    tokens, hidden = x.shape
    top_k, inter = chosen.shape[1], down.shape[1]
    tiles = moe_grouped.max_tiles(tokens * top_k, down.shape[0] // hidden, tiling.block_m)
    rows = tiles * tiling.block_m
    scratch = dict(
        sorted_pairs=cp.full(rows, 12345, np.int32), tile_expert=cp.full(tiles, 12345, np.int32),
        act=cp.full((rows, inter), 0x7FC0, np.uint16), pair_out=cp.full((tokens * top_k, hidden), np.nan, np.float32),
        out=cp.full((tokens, hidden), np.nan, np.float32),
    )
    moe_grouped.grouped_experts(cp.asarray(x), cp.asarray(chosen), cp.asarray(weights), gate_up, down, **scratch,
                                tiling=tiling)
    return cp.asnumpy(scratch["out"])


@pytest.mark.parametrize("shape", [DEEPSEEK, QWEN3_NEXT], ids=["deepseek-v2-lite", "qwen3-next"])
@pytest.mark.parametrize("tokens", [300, 2048])
def test_grouped_experts_at_model_shapes(shape, tokens):
    from metrale.kernels import moe_grouped

    hidden, inter, num_experts, top_k = shape
    gate_up, down, gate_up_device, down_device = expert_weights(hidden, inter, num_experts)
    rng = np.random.default_rng(tokens)
    x, chosen, weights = routing(rng, tokens, hidden, top_k, num_experts, distinct)
    # The tiling the engine picks for this batch.
    got = run_grouped(x, chosen, weights, gate_up_device, down_device, moe_grouped.tiling_for(tokens, top_k, num_experts))
    expected = moe_grouped.grouped_experts_reference(bf16_to_float32(x), chosen, weights, gate_up, down)
    # bf16 inputs and a bf16 activation between the two products, as the pairwise kernels.
    assert rel_error(got, expected) <= 2e-2
    # Each pair's row is computed the same way whatever order the alignment gave the pairs.
    np.testing.assert_array_equal(
        run_grouped(x, chosen, weights, gate_up_device, down_device, moe_grouped.tiling_for(tokens, top_k, num_experts)), got)


@pytest.mark.parametrize("hidden, inter, num_experts, top_k, tokens, choose", [
    (200, 136, 7, 3, 300, distinct),  # H and I not multiples of the tiles
    (2048, 1408, 64, 6, 300, all_to_expert_0),  # expert 0 in every token: 300 of its pairs, others few
    (2048, 512, 128, 10, 300, few_experts),  # 12 of 128 experts chosen, the others get no pair
    (264, 72, 9, 2, 5, distinct),  # N * k < BLOCK_M: one partial tile per chosen expert
    (1024, 256, 1, 1, 100, distinct),  # a single expert
    (520, 40, 512, 8, 200, distinct),  # many experts, most with a single partial tile
])
def test_grouped_experts_at_awkward_shapes_and_routings(hidden, inter, num_experts, top_k, tokens, choose):
    from metrale.kernels import moe_grouped

    gate_up, down, gate_up_device, down_device = expert_weights(hidden, inter, num_experts)
    rng = np.random.default_rng(hidden + tokens)
    x, chosen, weights = routing(rng, tokens, hidden, top_k, num_experts, choose)
    got = run_grouped(x, chosen, weights, gate_up_device, down_device)
    expected = moe_grouped.grouped_experts_reference(bf16_to_float32(x), chosen, weights, gate_up, down)
    assert np.isfinite(got).all()
    assert rel_error(got, expected) <= 2e-2


@pytest.mark.parametrize("block_m, block_n, warps_m, warps_n, stages, block_k", [
    (64, 64, 2, 2, 2, 32), (128, 128, 4, 2, 3, 32), (128, 64, 4, 2, 2, 32),
    (64, 256, 2, 4, 4, 32), (128, 256, 2, 4, 3, 64), (128, 128, 2, 2, 3, 64),  # the last three opt into > 48 KiB
])
def test_other_tilings(block_m, block_n, warps_m, warps_n, stages, block_k):
    from metrale.kernels import moe_grouped

    tiling = moe_grouped.Tiling(block_m, block_n, warps_m, warps_n, stages, block_k)
    hidden, inter, num_experts, top_k = 520, 200, 16, 4
    gate_up, down, gate_up_device, down_device = expert_weights(hidden, inter, num_experts)
    rng = np.random.default_rng(block_m + block_n + stages)
    x, chosen, weights = routing(rng, 150, hidden, top_k, num_experts, distinct)
    got = run_grouped(x, chosen, weights, gate_up_device, down_device, tiling)
    expected = moe_grouped.grouped_experts_reference(bf16_to_float32(x), chosen, weights, gate_up, down)
    assert rel_error(got, expected) <= 2e-2


@pytest.mark.parametrize("tokens, top_k, num_experts, choose", [
    (2048, 10, 128, distinct), (300, 6, 64, all_to_expert_0), (5, 2, 9, distinct), (1000, 8, 512, few_experts),
    (3000, 8, 1024, distinct),
])
def test_the_device_alignment_matches_its_host_model(tokens, top_k, num_experts, choose):
    """The same tiles and, once each expert's run is sorted, the same pair lists."""
    import cupy as cp

    from metrale.kernels import moe_grouped

    chosen = choose(np.random.default_rng(tokens), tokens, top_k, num_experts)
    tiles = moe_grouped.max_tiles(tokens * top_k, num_experts)
    sorted_pairs = cp.full(tiles * moe_grouped.BLOCK_M, 777, np.int32)
    tile_expert = cp.full(tiles, 777, np.int32)
    moe_grouped.align(cp.asarray(chosen), num_experts, sorted_pairs, tile_expert)
    want_pairs, want_tiles = moe_grouped.align_reference(chosen, num_experts)
    got_tiles, got_pairs = cp.asnumpy(tile_expert), cp.asnumpy(sorted_pairs)
    np.testing.assert_array_equal(got_tiles, want_tiles)
    for expert in np.unique(want_tiles[want_tiles >= 0]):
        owned = np.flatnonzero(want_tiles == expert)
        run = slice(owned[0] * moe_grouped.BLOCK_M, (owned[-1] + 1) * moe_grouped.BLOCK_M)
        real = got_pairs[run][got_pairs[run] >= 0]
        np.testing.assert_array_equal(np.sort(real), want_pairs[run][want_pairs[run] >= 0])
        assert (got_pairs[run][real.size :] == -1).all()
    used = int((want_tiles >= 0).sum()) * moe_grouped.BLOCK_M
    assert (got_pairs[used:] == -1).all()


@pytest.fixture(scope="module")
def backend():
    from metrale.backends.cuda import CudaBackend

    backend = CudaBackend()
    yield backend
    backend.close()


@pytest.mark.parametrize("tokens", [8, 9, 32, 64, 700])
def test_the_cuda_op_on_either_side_of_the_grouped_limit(backend, tokens):
    """8 tokens run on the decode kernels, pair by pair; 9 and more (``GROUPED_EXPERTS_MIN_TOKENS`` of
    metrale.ops.selection) through the grouped kernels, a decode batch's few pairs an expert
    included; all match the reference."""
    import cupy as cp

    from metrale.kernels import moe_grouped

    hidden, inter, num_experts, top_k = DEEPSEEK
    gate_up, down, gate_up_device, down_device = expert_weights(hidden, inter, num_experts)
    rng = np.random.default_rng(tokens)
    x, chosen, weights = routing(rng, tokens, hidden, top_k, num_experts, distinct)
    with backend.activate():
        got = backend.ops.moe_experts(cp.asarray(x), cp.asarray(chosen), cp.asarray(weights), gate_up_device,
                                      down_device)
        got = cp.asnumpy(got)
    expected = moe_grouped.grouped_experts_reference(bf16_to_float32(x), chosen, weights, gate_up, down)
    assert rel_error(got, expected) <= 2e-2


def test_a_captured_graph_replays_with_new_routing(backend):
    """The op records into a CUDA graph (no host synchronisation; grids from shapes alone) and a
    replay follows new tokens, choices and weights written into the same buffers."""
    import cupy as cp

    from metrale.kernels import moe_grouped

    hidden, inter, num_experts, top_k = QWEN3_NEXT
    tokens = 300
    gate_up, down, gate_up_device, down_device = expert_weights(hidden, inter, num_experts)
    rng = np.random.default_rng(5)
    x, chosen, weights = routing(rng, tokens, hidden, top_k, num_experts, distinct)
    stream = backend.stream
    with cp.cuda.using_allocator(backend.graph_pool.malloc), backend.activate():
        x_device, chosen_device, weights_device = cp.asarray(x), cp.asarray(chosen), cp.asarray(weights)
        backend.ops.moe_experts(x_device, chosen_device, weights_device, gate_up_device, down_device)  # compiles
        stream.synchronize()
        stream.begin_capture(getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", 2))
        try:
            out = backend.ops.moe_experts(x_device, chosen_device, weights_device, gate_up_device, down_device)
        finally:
            graph = stream.end_capture()
    for choose in (few_experts, all_to_expert_0, distinct):
        x, chosen, weights = routing(rng, tokens, hidden, top_k, num_experts, choose)
        with backend.activate():
            x_device.set(x, stream=stream)
            chosen_device.set(chosen, stream=stream)
            weights_device.set(weights, stream=stream)
            out.fill(np.nan)
            graph.launch(stream=stream)
            stream.synchronize()
            got = cp.asnumpy(out)
        expected = moe_grouped.grouped_experts_reference(bf16_to_float32(x), chosen, weights, gate_up, down)
        assert rel_error(got, expected) <= 2e-2, choose.__name__


@pytest.mark.parametrize("tokens", [8, 40, 2048])
def test_gpt_oss_experts_through_the_op_match_the_clamped_reference(backend, tokens):
    """GPT-OSS-20B's expert shape (H 2880, I 2880, 32 experts, top 4) through the op
    ``moe_experts_clamped``: 8 tokens pair by pair, more through the grouped kernels with the
    biases and the clamped SwiGLU; all against metrale.kernels.moe_clamped's reference."""
    import cupy as cp

    from metrale.kernels import moe_clamped

    hidden, inter, num_experts, top_k = 2880, 2880, 32, 4
    gate_up, down, gate_up_device, down_device = expert_weights(hidden, inter, num_experts)
    rng = np.random.default_rng(tokens)
    x, chosen, weights = routing(rng, tokens, hidden, top_k, num_experts, distinct)
    gate_up_bias = rng.normal(0, 0.5, num_experts * 2 * inter).astype(np.float32)
    down_bias = rng.normal(0, 0.5, num_experts * hidden).astype(np.float32)
    alpha, limit = 1.702, 7.0
    with backend.activate():
        got = backend.ops.moe_experts_clamped(cp.asarray(x), cp.asarray(chosen), cp.asarray(weights), gate_up_device,
                                              down_device, alpha, limit, cp.asarray(gate_up_bias),
                                              cp.asarray(down_bias))
        got = cp.asnumpy(got)
    expected = moe_clamped.clamped_experts_reference(bf16_to_float32(x), chosen, weights, gate_up, down, alpha, limit,
                                                     gate_up_bias, down_bias)
    assert rel_error(got, expected) <= 2e-2
