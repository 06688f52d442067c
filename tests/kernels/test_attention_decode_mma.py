"""The tensor-core decode attention (metrale.kernels.attention_decode_mma) without a GPU: the NumPy
model of the kernel's steps against the float64 reference, the key ranges of the splits, the split
choice, the launcher's checks, and the CUDA C++ kernel itself run on the host through
``cuda_emulation.h`` (a fiber per CUDA thread; ldmatrix, mma.sync, cp.async and the warp shuffles
from the PTX ISA's layouts) against the model."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from emulation import build_emulated

from metrale.errors import KernelArgumentError
from metrale.kernels import attention, attention_decode_mma
from metrale.kernels.attention_grouped import MAX_SPLITS
from metrale.kernels.attention_latent_mma import combine_partials_model
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

SCALE = 0.125


def rel_error(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


def decode_case(rng, contexts, heads, kv_heads, head_dim, block_size, spare_blocks=3):
    """One decode row per sequence of ``contexts[i]`` cached tokens, over shuffled cache blocks."""
    blocks_per_seq = [-(-c // block_size) for c in contexts]
    total_blocks = sum(blocks_per_seq) + spare_blocks
    order = rng.permutation(np.arange(total_blocks))
    tables = np.zeros((len(contexts), max(blocks_per_seq)), np.int32)
    used = 0
    for s, count in enumerate(blocks_per_seq):
        tables[s, :count] = order[used : used + count]
        used += count
    shape = (total_blocks, block_size, kv_heads, head_dim)
    k_cache = float32_to_bf16(rng.standard_normal(shape).astype(np.float32))
    v_cache = float32_to_bf16(rng.standard_normal(shape).astype(np.float32))
    q = rng.standard_normal((len(contexts), heads, head_dim)).astype(np.float32)
    seq_index = np.arange(len(contexts), dtype=np.int32)
    positions = np.asarray(contexts, np.int32) - 1
    return q, k_cache, v_cache, tables, seq_index, positions


def model_output(q, k_cache, v_cache, tables, seq_index, positions, window, splits):
    partials = attention_decode_mma.decode_attention_partials_model(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, SCALE, window, splits)
    return combine_partials_model(*partials)


@pytest.mark.parametrize("contexts, heads, kv_heads, head_dim, block_size, window, splits", [
    ((1, 63, 64, 65, 200), 16, 8, 128, 16, 0, 1),
    ((1, 63, 64, 65, 200), 32, 8, 64, 1, 0, 3),
    ((130, 7), 8, 8, 128, 32, 50, 4),  # a window; splits past the shorter row's keys
    ((300,), 40, 2, 256, 16, 0, 5),  # 20 heads a KV head: two head blocks, the second of four
])
def test_the_model_matches_the_reference(contexts, heads, kv_heads, head_dim, block_size, window, splits):
    rng = np.random.default_rng(sum(contexts) + heads + splits)
    q, k_cache, v_cache, tables, seq_index, positions = decode_case(rng, contexts, heads, kv_heads, head_dim, block_size)
    model = model_output(q, k_cache, v_cache, tables, seq_index, positions, window, splits)
    reference = attention.paged_attention_reference(q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables,
                                                    seq_index, positions, SCALE, window or None)
    assert rel_error(model, reference) <= 1e-2


@pytest.mark.parametrize("softcap, with_sinks", [(3.0, False), (None, True), (3.0, True)])
def test_the_model_caps_logits_and_counts_sinks_as_the_reference(softcap, with_sinks):
    rng = np.random.default_rng(9)
    q, k_cache, v_cache, tables, seq_index, positions = decode_case(rng, (1, 70, 200), 8, 2, 64, 16)
    q *= 4  # logits large enough to cap
    sinks = rng.standard_normal(8).astype(np.float32) + 1.0 if with_sinks else None
    partials = attention_decode_mma.decode_attention_partials_model(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, SCALE, None, 3, softcap,
        sinks)
    reference = attention.paged_attention_reference(q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables,
                                                    seq_index, positions, SCALE, None, softcap, sinks)
    plain = attention.paged_attention_reference(q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables,
                                                seq_index, positions, SCALE)
    assert rel_error(combine_partials_model(*partials), reference) <= 1e-2 < rel_error(plain, reference)


def test_split_ranges_cover_the_window_once():
    for position in (0, 5, 63, 64, 1000):
        for window in (None, 1, 17, 4096):
            for splits in (1, 3, 32):
                ranges = [attention_decode_mma.split_range(position, s, splits, window) for s in range(splits)]
                keys = [k for lo, hi in ranges for k in range(lo, hi)]
                first = max(0, position + 1 - window) if window else 0
                assert keys == list(range(first, position + 1))


def test_split_count_fills_the_resident_blocks_within_the_limits():
    # 128 dims: two blocks a multiprocessor; 64: three; 256: one. (MAX_SPLITS is the merge's limit.)
    assert attention_decode_mma.split_count(128, 16, 8, 128, 2064, 132) == 1
    assert attention_decode_mma.split_count(1, 32, 8, 128, 2064, 132) == min(33, MAX_SPLITS)
    assert attention_decode_mma.split_count(1, 32, 8, 128, 512, 132) == min(8, MAX_SPLITS)  # a step of keys each
    assert attention_decode_mma.split_count(16, 32, 8, 128, 2048, 132) == 2
    assert attention_decode_mma.split_count(16, 32, 8, 64, 2048, 132) == 3
    assert attention_decode_mma.split_count(4, 16, 2, 256, 2048, 132) == min(16, MAX_SPLITS)
    assert attention_decode_mma.split_count(2, 128, 2, 128, 4096, 132) == min(16, MAX_SPLITS)  # four head blocks a KV head


def test_supported_geometries():
    supports = attention_decode_mma.supports
    if attention_decode_mma.SIMULATED:
        assert not supports(32, 8, 128, 128)  # the simulator runs the CUDA-core kernels
        return
    assert supports(32, 8, 128, 128) and supports(16, 2, 256, 256) and supports(8, 8, 64, 64) and supports(4, 2, 32, 32)
    assert not supports(32, 8, 192, 128)
    assert not supports(32, 8, 96, 96)
    assert not supports(30, 8, 128, 128)


def test_wrong_arguments_are_refused_before_any_launch():
    q = np.zeros((2, 16, 128), np.float32)
    cache = np.zeros((1, 16, 8, 128), np.uint16)
    workspace = (np.zeros((2, 16, 1, 128), np.float32), np.zeros((2, 16, 1), np.float32), np.zeros((2, 16, 1), np.float32))
    with pytest.raises(KernelArgumentError):  # positions of the wrong length
        attention_decode_mma.decode_attention(q, cache, cache, np.zeros((2, 1), np.int32), np.zeros(2, np.int32),
                                              np.zeros(3, np.int32), SCALE, None, workspace, np.zeros((2, 2048), np.uint16))
    with pytest.raises(KernelArgumentError, match="unsupported"):
        attention_decode_mma.decode_attention(np.zeros((2, 16, 96), np.float32), np.zeros((1, 16, 8, 96), np.uint16),
                                              np.zeros((1, 16, 8, 96), np.uint16), np.zeros((2, 1), np.int32),
                                              np.zeros(2, np.int32), np.zeros(2, np.int32), SCALE, None, workspace,
                                              np.zeros((2, 16 * 96), np.uint16))


# ------------------------------------------------------------------------------- emulation

EMULATION_MAIN = r"""

int main(int argc, char** argv) {
    if (argc != 15) return 2;
    const std::string folder = argv[1];
    const int rows = std::atoi(argv[2]), heads = std::atoi(argv[3]), kv_heads = std::atoi(argv[4]);
    const int blocks = std::atoi(argv[5]), block_size = std::atoi(argv[6]), max_blocks = std::atoi(argv[7]);
    const int splits = std::atoi(argv[8]), window = std::atoi(argv[9]);
    const float scale = std::atof(argv[10]);
    emu::defer_copies = std::atoi(argv[11]);
    const int launches = std::atoi(argv[12]);   // 0: one launch without counters (the combine kernel merges)
    const float softcap = std::atof(argv[13]);
    const bool with_sinks = std::atoi(argv[14]);
    const size_t cache = (size_t)blocks * block_size * kv_heads * HEAD_DIM;
    auto* q = read<float>(folder + "/q", (size_t)rows * heads * HEAD_DIM);
    auto* k_cache = read<cache_t>(folder + "/k_cache", cache);
    auto* v_cache = read<cache_t>(folder + "/v_cache", cache);
#if FP8_CACHE
    auto* k_scales = read<float>(folder + "/k_scales", cache / HEAD_DIM);
    auto* v_scales = read<float>(folder + "/v_scales", cache / HEAD_DIM);
#else
    const float* k_scales = nullptr;
    const float* v_scales = nullptr;
#endif
    auto* tables = read<int>(folder + "/tables", (size_t)rows * max_blocks);
    auto* seq_index = read<int>(folder + "/seq_index", rows);
    auto* positions = read<int>(folder + "/positions", rows);
    auto* sinks = with_sinks ? read<float>(folder + "/sinks", heads) : nullptr;
    const size_t partials = (size_t)rows * heads * splits;
    auto* out_acc = allocate<float>(partials * HEAD_DIM);
    auto* out_max = allocate<float>(partials);
    auto* out_sum = allocate<float>(partials);
    auto* out = allocate<unsigned short>((size_t)rows * heads * HEAD_DIM);
    const int group = heads / kv_heads, head_blocks = (group + BLOCK_HEADS - 1) / BLOCK_HEADS;
    int* counters = launches ? allocate<int>((size_t)rows * kv_heads * head_blocks) : nullptr;
    for (int i = 0; launches && i < rows * kv_heads * head_blocks; ++i) counters[i] = 0;
    for (int launch = 0; launch < (launches ? launches : 1); ++launch) {
        emu::launch({(unsigned)rows, (unsigned)(kv_heads * head_blocks), (unsigned)splits}, {THREADS, 1, 1}, [&] {
            decode_attention_mma(q, k_cache, v_cache, tables, seq_index, positions, heads, kv_heads, block_size,
                                 max_blocks, scale, window, softcap, sinks, out_acc, out_max, out_sum, out, counters,
                                 k_scales, v_scales);
        });
    }
    int unreset = 0;
    for (int i = 0; launches && i < rows * kv_heads * head_blocks; ++i) unreset += counters[i] != 0;
    if (unreset) emu::fail("counters left non-zero after a launch");
    write(folder + "/out_acc", out_acc, partials * HEAD_DIM);
    write(folder + "/out_max", out_max, partials);
    write(folder + "/out_sum", out_sum, partials);
    write(folder + "/out", out, (size_t)rows * heads * HEAD_DIM);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The kernel built against the emulation per head size; returns a runner of one launch."""
    folder = tmp_path_factory.mktemp("decode_mma_emulated")
    binaries: dict[tuple[int, int | None, bool, bool, int], Path] = {}

    def build(head_dim, stage_count, softcap, fp8, tiles):
        key = (head_dim, stage_count, softcap, fp8, tiles)
        if key not in binaries:
            binaries[key] = build_emulated(
                folder / f"kernel{head_dim}_{stage_count}_{int(softcap)}_{int(fp8)}_{tiles}.cpp",
                attention_decode_mma.kernel_source(head_dim, with_instructions=False, stage_count=stage_count,
                                                   softcap=softcap, fp8=fp8, head_tiles=tiles)
                + EMULATION_MAIN)
        return binaries[key]

    def run(q, k_cache, v_cache, tables, seq_index, positions, window, splits, defer_copies=True, launches=0,
            stage_count=None, softcap=None, sinks=None, scales=None):
        """``scales``: the FP8 caches' ``(k_scales, v_scales)``, ``k_cache`` and ``v_cache`` their codes."""
        rows, heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        case = folder / "case"
        case.mkdir(exist_ok=True)
        arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache, tables=tables, seq_index=seq_index, positions=positions)
        if sinks is not None:
            arrays["sinks"] = np.asarray(sinks, np.float32)
        if scales is not None:
            arrays["k_scales"], arrays["v_scales"] = (np.asarray(a, np.float32) for a in scales)
        for name, array in arrays.items():
            np.ascontiguousarray(array).tofile(case / name)
        fp8 = scales is not None
        tiles = attention_decode_mma.head_tiles(heads, kv_heads) if fp8 else 2
        subprocess.run([str(build(head_dim, stage_count, bool(softcap), fp8, tiles)), str(case), *map(str, (
            rows, heads, kv_heads, k_cache.shape[0], k_cache.shape[1], tables.shape[1], splits, window, SCALE,
            int(defer_copies), launches, softcap or 0.0, int(sinks is not None)))], check=True, timeout=600)
        return (np.fromfile(case / "out_acc", np.float32).reshape(rows, heads, splits, head_dim),
                np.fromfile(case / "out_max", np.float32).reshape(rows, heads, splits),
                np.fromfile(case / "out_sum", np.float32).reshape(rows, heads, splits),
                np.fromfile(case / "out", np.uint16).reshape(rows, heads, head_dim))

    return run


@pytest.mark.parametrize("contexts, heads, kv_heads, head_dim, block_size, window, splits, defer_copies, stage_count", [
    ((1, 200), 4, 2, 64, 16, 0, 2, True, None),  # one key; four steps, the last of 8 keys
    ((63, 64, 300), 4, 1, 64, 1, 0, 3, True, None),  # one-token blocks; the three-stage ring wraps
    ((65, 200), 2, 2, 64, 16, 70, 2, False, None),  # a window; copies land at once
    ((150,), 20, 1, 64, 32, 0, 2, True, None),  # two head blocks of one KV head, the second of four heads
    ((130,), 2, 1, 256, 16, 0, 2, True, None),  # 256 dims: two stages
    ((1, 200), 4, 2, 32, 16, 0, 2, True, None),  # 32 dims: a warp owns one value tile
    ((150,), 20, 1, 32, 32, 40, 3, False, None),
    # Short rows under many splits (a graph captured for a longer context): the own key lies in
    # the first stage of splits that do not hold it, past their last key.
    ((65, 20), 8, 2, 64, 16, 0, 12, True, None),
    ((65,), 4, 1, 128, 16, 0, 12, False, None),
    # More stages than the default (a launch of many rows): the five-stage ring wraps, the own
    # key in the first, a middle and the last issued stage, rows shorter than the ring.
    ((1, 100, 257, 700), 8, 2, 64, 16, 0, 2, True, 5),
    ((300, 129), 4, 1, 64, 16, 0, 2, False, 6),
    ((500, 40), 8, 2, 128, 16, 90, 2, True, 4),
])
def test_the_kernel_run_emulated_matches_its_model(emulated, contexts, heads, kv_heads, head_dim, block_size, window,
                                                   splits, defer_copies, stage_count):
    rng = np.random.default_rng(sum(contexts) + heads + splits)
    q, k_cache, v_cache, tables, seq_index, positions = decode_case(rng, contexts, heads, kv_heads, head_dim, block_size)
    out_acc, out_max, out_sum, _ = emulated(q, k_cache, v_cache, tables, seq_index, positions, window, splits,
                                            defer_copies, stage_count=stage_count)
    want_acc, want_max, want_sum = attention_decode_mma.decode_attention_partials_model(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, SCALE, window or None,
        splits)
    assert not np.isnan(out_acc).any() and not np.isnan(out_sum).any()
    used = want_sum > 0
    np.testing.assert_array_equal(out_sum > 0, used)
    np.testing.assert_allclose(out_max[used], want_max[used], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out_sum[used], want_sum[used], rtol=2e-3)
    assert rel_error(out_acc, want_acc) <= 2e-3
    assert not out_acc[~used].any(), "a split without keys writes zeros"


@pytest.mark.parametrize("contexts, stage_count", [((1, 70, 129), None), ((1, 70, 129, 520), 5)])
def test_one_split_writes_the_normalised_output(emulated, contexts, stage_count):
    rng = np.random.default_rng(3)
    q, k_cache, v_cache, tables, seq_index, positions = decode_case(rng, contexts, 8, 2, 64, 16)
    *_, out = emulated(q, k_cache, v_cache, tables, seq_index, positions, 0, 1, stage_count=stage_count)
    model = model_output(q, k_cache, v_cache, tables, seq_index, positions, None, 1)
    assert rel_error(bf16_to_float32(out), model) <= 1e-2
    reference = attention.paged_attention_reference(q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables,
                                                    seq_index, positions, SCALE)
    assert rel_error(bf16_to_float32(out), reference) <= 2e-2


@pytest.mark.parametrize("splits, launches", [(1, 0), (3, 0), (3, 2)])
@pytest.mark.parametrize("softcap, with_sinks", [(3.0, False), (None, True), (3.0, True)])
def test_the_kernel_caps_logits_and_counts_sinks_emulated(emulated, softcap, with_sinks, splits, launches):
    """One split (the normalised output), splits merged by the combine kernel (the partials against
    the model) and splits merged by the kernel itself: the sink counted once, by split 0."""
    rng = np.random.default_rng(17 + splits)
    q, k_cache, v_cache, tables, seq_index, positions = decode_case(rng, (1, 70, 200), 20, 1, 64, 16)
    q *= 4
    sinks = rng.standard_normal(20).astype(np.float32) + 1.0 if with_sinks else None
    out_acc, out_max, out_sum, out = emulated(q, k_cache, v_cache, tables, seq_index, positions, 0, splits,
                                              launches=launches, softcap=softcap, sinks=sinks)
    want = attention_decode_mma.decode_attention_partials_model(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, SCALE, None, splits,
        softcap, sinks)
    reference = attention.paged_attention_reference(q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables,
                                                    seq_index, positions, SCALE, None, softcap, sinks)
    if splits == 1 or launches:
        assert rel_error(bf16_to_float32(out), reference) <= 2e-2
        if splits == 1:
            return
    used = want[2] > 0
    np.testing.assert_allclose(out_max[used], want[1][used], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out_sum[used], want[2][used], rtol=2e-3)
    assert rel_error(out_acc, want[0]) <= 2e-3
    assert rel_error(combine_partials_model(out_acc, out_max, out_sum), reference) <= 2e-2


@pytest.mark.parametrize("contexts, heads, kv_heads, head_dim, block_size, window, splits", [
    ((1, 200, 64), 8, 2, 64, 16, 0, 3),  # splits past the short rows' keys weigh nothing
    ((150,), 20, 1, 64, 32, 0, 2),  # two head blocks of one KV head, the second of four heads
    ((65, 200), 2, 2, 64, 16, 70, 4),  # a window
    ((70, 200), 8, 2, 32, 16, 0, 3),  # 32 dims
])
def test_the_last_split_merges_the_splits_itself(emulated, contexts, heads, kv_heads, head_dim, block_size, window,
                                                 splits):
    rng = np.random.default_rng(sum(contexts) + 7 * splits)
    q, k_cache, v_cache, tables, seq_index, positions = decode_case(rng, contexts, heads, kv_heads, head_dim, block_size)
    # Two launches on the same counters: the merging block leaves them at zero for the next one.
    *partials, out = emulated(q, k_cache, v_cache, tables, seq_index, positions, window, splits, launches=2)
    merged = combine_partials_model(*partials)
    np.testing.assert_array_equal(out, float32_to_bf16(merged))  # the combine kernel's arithmetic, to the bit
    model = model_output(q, k_cache, v_cache, tables, seq_index, positions, window or None, splits)
    assert rel_error(bf16_to_float32(out), model) <= 1e-2
    reference = attention.paged_attention_reference(q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables,
                                                    seq_index, positions, SCALE, window or None)
    assert rel_error(bf16_to_float32(out), reference) <= 2e-2


def test_a_launch_of_many_rows_takes_more_stages_while_its_grid_stays_resident():
    mma = attention_decode_mma
    # Llama-1B's heads at 32 rows: 256 blocks of one split, two a multiprocessor; two blocks of
    # five stages still fit one, two of six do not.
    assert mma.split_count(32, 32, 8, 64, 512) == 1
    assert mma.launch_stages(32, 32, 8, 64, 1, 512) == 5
    assert 132 * mma.blocks_per_multiprocessor(64, 5) >= 256 > 132 * mma.blocks_per_multiprocessor(64, 6)
    # 128 dims: a fourth stage leaves one block a multiprocessor, too few for 256 blocks.
    assert mma.launch_stages(32, 32, 8, 128, 1, 512) == mma.stages(128) == 3
    # A launch of several splits keeps the default, however few its blocks.
    assert mma.launch_stages(1, 32, 8, 64, 8, 512) == 3
    assert mma.launch_stages(8, 32, 8, 64, 4, 512) == 3
    assert mma.launch_stages(32, 16, 2, 256, 2, 4096) == mma.stages(256) == 2
    # One split: as many as stay resident, no more than a block's steps can fill.
    assert mma.launch_stages(1, 32, 8, 64, 1, 128) == 3
    assert mma.launch_stages(1, 32, 8, 64, 1, 256) == 5
    assert mma.launch_stages(2, 32, 8, 64, 1, 1024) == 6
    assert mma.shared_bytes(64, 6) <= mma.MAX_SHARED_BYTES


def test_a_stage_count_set_by_hand_is_checked(monkeypatch):
    mma = attention_decode_mma
    monkeypatch.setattr(mma, "STAGES_OVERRIDE", 4)
    assert mma.launch_stages(1, 32, 8, 64, 8, 512) == 4
    for count, head_dim in ((1, 64), (7, 64), (4, 256)):
        monkeypatch.setattr(mma, "STAGES_OVERRIDE", count)
        with pytest.raises(KernelArgumentError, match="stages"):
            mma.launch_stages(1, 32, 8, head_dim, 8, 512)


def test_the_launcher_checks_the_counters(monkeypatch):
    monkeypatch.setattr(attention_decode_mma, "supports", lambda *geometry: True)  # (numba's simulator: never)
    q = np.zeros((2, 16, 128), np.float32)
    cache = np.zeros((1, 16, 8, 128), np.uint16)
    workspace = (np.zeros((2, 16, 2, 128), np.float32), np.zeros((2, 16, 2), np.float32), np.zeros((2, 16, 2), np.float32))
    assert attention_decode_mma.counter_count(2, 16, 8) == 16 and attention_decode_mma.counter_count(1, 40, 2) == 4
    with pytest.raises(KernelArgumentError, match="counters"):
        attention_decode_mma.decode_attention(q, cache, cache, np.zeros((2, 1), np.int32), np.zeros(2, np.int32),
                                              np.zeros(2, np.int32), SCALE, None, workspace,
                                              np.zeros((2, 2048), np.uint16), counters=np.zeros(15, np.int32))


def test_which_launches_merge_their_own_splits():
    # Llama-1B (12 splits of four 64-wide heads) and Llama-8B (16 of four 128-wide) merge in their
    # last block; Qwen3-Next's full attention (16 of eight 256-wide heads) takes the merge kernel.
    assert attention_decode_mma.merges_itself(32, 8, 64, 12)
    assert attention_decode_mma.merges_itself(32, 8, 128, 16)
    assert not attention_decode_mma.merges_itself(16, 2, 256, 16)


# ------------------------------------------------------------------------------ FP8 cache


def fp8_case(rng, contexts, heads, kv_heads, head_dim, block_size):
    """:func:`decode_case` with its caches quantized as an FP8 cache writes rows: ``(q, (k_codes,
    k_scales), (v_codes, v_scales), tables, seq_index, positions)``; some rows all zero (scale 1)."""
    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

    q, k_cache, v_cache, tables, seq_index, positions = decode_case(rng, contexts, heads, kv_heads, head_dim, block_size)
    caches = []
    # Rows of different magnitudes (so scales differ), the keys' within a range that keeps the
    # logits' bf16 rounding (the kernel's, as a bf16 cache's) small against the float reference.
    for bits, spread in ((k_cache, 2.0), (v_cache, 10.0)):
        rows = bf16_to_float32(bits) * rng.uniform(1 / spread, spread, size=bits.shape[:3] + (1,)).astype(np.float32)
        rows[0, 0] = 0.0
        cache = Fp8CacheArray.zeros(rows.shape)
        caches.append(cache.quantize(rows))
    return q, caches[0], caches[1], tables, seq_index, positions


def exact_split_partials(q, k_values, v_values, tables, seq_index, positions, window, splits):
    """Each split's log-sum-exp of its logits (natural units) and normalised output, in float64
    over the float caches ``[blocks, block_size, kv_heads, d]``: ``(lse [N, heads, splits], out
    [N, heads, splits, d])``, ``-inf`` and zeros for a split without keys."""
    rows, heads, head_dim = q.shape
    block_size, kv_heads = k_values.shape[1], k_values.shape[2]
    lse = np.full((rows, heads, splits), -np.inf)
    out = np.zeros((rows, heads, splits, head_dim))
    for row in range(rows):
        for split in range(splits):
            lo, hi = attention_decode_mma.split_range(int(positions[row]), split, splits, window or None)
            if lo >= hi:
                continue
            places = [(tables[seq_index[row], j // block_size], j % block_size) for j in range(lo, hi)]
            for head in range(heads):
                kv = head // (heads // kv_heads)
                keys = np.stack([k_values[b, o, kv] for b, o in places]).astype(np.float64)
                values = np.stack([v_values[b, o, kv] for b, o in places]).astype(np.float64)
                logits = keys @ q[row, head].astype(np.float64) * SCALE
                top = logits.max()
                weights = np.exp(logits - top)
                lse[row, head, split] = top + np.log(weights.sum())
                out[row, head, split] = weights @ values / weights.sum()
    return lse, out


@pytest.mark.parametrize("contexts, heads, kv_heads, head_dim, block_size, window, splits, defer_copies, stage_count", [
    ((1, 200), 4, 2, 64, 16, 0, 2, True, None),
    ((63, 64, 300), 8, 2, 128, 1, 0, 3, True, None),  # one-token blocks; the three-stage ring wraps
    ((65, 200), 2, 2, 64, 16, 70, 2, False, None),  # a window; copies land at once
    ((150,), 20, 1, 128, 32, 0, 2, True, None),  # two head blocks of one KV head
    ((130,), 2, 1, 256, 16, 0, 2, True, None),  # 256 dims: two stages
    ((65, 20), 8, 2, 64, 16, 0, 12, True, None),  # the own key in splits that do not hold it
    ((1, 100, 257, 700), 8, 2, 64, 16, 0, 2, True, 5),  # five stages
    ((70, 200), 4, 2, 32, 16, 0, 2, True, None),  # 32 dims
])
def test_the_fp8_cache_kernel_run_emulated_is_as_close_to_the_float_attention_as_the_bf16_kernel(
        emulated, contexts, heads, kv_heads, head_dim, block_size, window, splits, defer_copies, stage_count):
    """Each split's partials against float64 attention over the codes times their scales (the
    cache as it reads back): its log-sum-exp and normalised output; and the merged output at least
    as close as the bf16 kernel's over :func:`dequantized_cache` (the FP8 kernel puts the scales
    on the scores and probabilities in float32, its operands f16)."""
    from metrale.kernels.quantized import fp8_e4m3_to_float32

    rng = np.random.default_rng(sum(contexts) + heads + splits + 1)
    q, (k_codes, k_scales), (v_codes, v_scales), tables, seq_index, positions = fp8_case(
        rng, contexts, heads, kv_heads, head_dim, block_size)
    out_acc, out_max, out_sum, _ = emulated(q, k_codes, v_codes, tables, seq_index, positions, window, splits,
                                            defer_copies, stage_count=stage_count, scales=(k_scales, v_scales))
    exact_k = fp8_e4m3_to_float32(k_codes) * k_scales[..., None]
    exact_v = fp8_e4m3_to_float32(v_codes) * v_scales[..., None]
    want_lse, want_out = exact_split_partials(q, exact_k, exact_v, tables, seq_index, positions, window, splits)
    used = out_sum > 0
    np.testing.assert_array_equal(used, np.isfinite(want_lse))  # exactly the splits with keys have weight
    np.testing.assert_allclose(out_max[used] + np.log(out_sum[used]), want_lse[used], rtol=0, atol=3e-3)
    assert rel_error(out_acc[used] / out_sum[used][:, None], want_out[used]) <= 1e-3

    reference = attention.paged_attention_reference(q, exact_k, exact_v, tables, seq_index, positions, SCALE,
                                                    window or None)
    k_values = attention_decode_mma.dequantized_cache(k_codes, k_scales)
    v_values = attention_decode_mma.dequantized_cache(v_codes, v_scales)
    bf16_run = emulated(q, float32_to_bf16(k_values), float32_to_bf16(v_values), tables, seq_index, positions, window,
                        splits, defer_copies, stage_count=stage_count)
    fp8_error = rel_error(combine_partials_model(out_acc, out_max, out_sum), reference)
    assert fp8_error <= rel_error(combine_partials_model(*bf16_run[:3]), reference)
    assert fp8_error <= 1e-3


@pytest.mark.parametrize("splits, launches", [(1, 0), (3, 0), (3, 2)])
@pytest.mark.parametrize("softcap, with_sinks", [(3.0, False), (None, True), (3.0, True)])
def test_the_fp8_cache_kernel_caps_logits_and_counts_sinks_emulated(emulated, softcap, with_sinks, splits, launches):
    """The FP8 cache's warps each keep a softmax of their own keys: a sink counted once (by split 0)
    across the warps' merge and the splits', capped logits, against the float reference over the
    codes times their scales."""
    from metrale.kernels.quantized import fp8_e4m3_to_float32

    rng = np.random.default_rng(29 + splits)
    q, (k_codes, k_scales), (v_codes, v_scales), tables, seq_index, positions = fp8_case(
        rng, (1, 70, 200), 20, 1, 64, 16)
    q *= 4
    sinks = rng.standard_normal(20).astype(np.float32) + 1.0 if with_sinks else None
    out_acc, out_max, out_sum, out = emulated(q, k_codes, v_codes, tables, seq_index, positions, 0, splits,
                                              launches=launches, softcap=softcap, sinks=sinks,
                                              scales=(k_scales, v_scales))
    exact_k = fp8_e4m3_to_float32(k_codes) * k_scales[..., None]
    exact_v = fp8_e4m3_to_float32(v_codes) * v_scales[..., None]
    reference = attention.paged_attention_reference(q, exact_k, exact_v, tables, seq_index, positions, SCALE, None,
                                                    softcap, sinks)
    if splits == 1 or launches:
        assert rel_error(bf16_to_float32(out), reference) <= 5e-3
    if splits > 1:
        assert rel_error(combine_partials_model(out_acc, out_max, out_sum), reference) <= 1e-3


def test_the_fp8_cache_kernel_merges_its_splits_and_takes_less_shared_memory(emulated):
    rng = np.random.default_rng(23)
    q, (k_codes, k_scales), (v_codes, v_scales), tables, seq_index, positions = fp8_case(rng, (1, 200, 64), 8, 2, 128,
                                                                                        16)
    *partials, out = emulated(q, k_codes, v_codes, tables, seq_index, positions, 0, 3, launches=2,
                              scales=(k_scales, v_scales))
    np.testing.assert_array_equal(out, float32_to_bf16(combine_partials_model(*partials)))
    mma = attention_decode_mma
    assert mma.shared_bytes(128, 3, fp8=True) < mma.shared_bytes(128, 3)
    assert mma.blocks_per_multiprocessor(128, 3, fp8=True) >= mma.blocks_per_multiprocessor(128, 3)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("head_dim", attention_decode_mma.HEAD_DIMS)
def test_the_stages_a_launch_takes_fit_with_the_static_shared_memory(head_dim, fp8):
    """A launch of one split over few rows takes as many stages as fit: the block's dynamic
    shared memory and its static part (the stages' key offsets) within what a block may take."""
    mma = attention_decode_mma
    for rows in (1, 9, 32):
        count = mma.launch_stages(rows, 16, 2, head_dim, 1, 1600, 132, fp8)
        assert mma.shared_bytes(head_dim, count, fp8) + mma.static_shared_bytes(count) <= mma.MAX_SHARED_BYTES
        if count < mma.MAX_STAGES:  # stopped by memory: one more stage would not fit
            assert not mma.fits(head_dim, count + 1, fp8)
