"""The tensor-core MLA decode attention (metrale.kernels.attention_latent_mma) without a GPU: the
NumPy model of the kernel's steps against the float64 reference, the split choice, the launcher's
checks, and the CUDA C++ kernel itself run on the host through ``cuda_emulation.h`` (a thread per
CUDA thread; ldmatrix, mma.sync, cp.async and the warp shuffles from the PTX ISA's layouts)
against the model's per-split partials."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.errors import KernelArgumentError
from metrale.kernels import attention_latent, attention_latent_mma
from metrale.kernels.attention_grouped import MAX_SPLITS
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

WIDTH, VALUE_DIM = attention_latent_mma.WIDTH, attention_latent_mma.VALUE_DIM


def rel_error(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


def latent_case(rng, contexts, heads, block_size, spare_blocks=3):
    """One decode row per sequence of ``contexts[i]`` cached tokens, over shuffled cache blocks;
    latent values of DeepSeek's scale (normed latents near 1, RoPE keys larger)."""
    blocks_per_seq = [-(-c // block_size) for c in contexts]
    total_blocks = sum(blocks_per_seq) + spare_blocks
    order = rng.permutation(np.arange(total_blocks))
    tables = np.zeros((len(contexts), max(blocks_per_seq)), np.int32)
    used = 0
    for s, count in enumerate(blocks_per_seq):
        tables[s, :count] = order[used : used + count]
        used += count
    latent = float32_to_bf16(rng.standard_normal((total_blocks, block_size, WIDTH)).astype(np.float32))
    q = (0.5 * rng.standard_normal((len(contexts), heads, WIDTH))).astype(np.float32)
    seq_index = np.arange(len(contexts), dtype=np.int32)
    positions = np.asarray(contexts, np.int32) - 1
    return q, latent, tables, seq_index, positions


SCALE = 0.1


@pytest.mark.parametrize("contexts, heads, block_size, splits", [
    ((1, 63, 64, 65, 200), 16, 16, 1),
    ((1, 63, 64, 65, 200), 16, 16, 3),
    ((130, 7), 32, 64, 4),  # splits past the shorter row's context, and empty ones
    ((300,), 128, 16, 5),
])
def test_the_model_matches_the_reference(contexts, heads, block_size, splits):
    rng = np.random.default_rng(sum(contexts) + heads + splits)
    q, latent, tables, seq_index, positions = latent_case(rng, contexts, heads, block_size)
    latent_f32 = bf16_to_float32(latent)
    keys = attention_latent_mma.split_keys(max(contexts), splits)
    model = attention_latent_mma.latent_attention_model(q, latent_f32, tables, seq_index, positions, SCALE, splits, keys)
    reference = attention_latent.latent_attention_reference(q, latent_f32, tables, seq_index, positions, VALUE_DIM, SCALE)
    assert rel_error(model, reference) <= 1e-2


def test_the_split_merge_does_not_depend_on_the_split_count():
    rng = np.random.default_rng(7)
    q, latent, tables, seq_index, positions = latent_case(rng, (500,), 16, 16)
    latent_f32 = bf16_to_float32(latent)
    one = attention_latent_mma.latent_attention_model(q, latent_f32, tables, seq_index, positions, SCALE, 1, 512)
    eight = attention_latent_mma.latent_attention_model(q, latent_f32, tables, seq_index, positions, SCALE, 8, 64)
    assert rel_error(eight, one) <= 2e-3


def test_split_count_fills_one_wave_within_the_limits():
    # (MAX_SPLITS is the merge's limit: 32 on a GPU, smaller under numba's simulator.)
    assert attention_latent_mma.split_count(1, 16, 512, 132) == min(8, MAX_SPLITS)  # one step of keys each
    assert attention_latent_mma.split_count(1, 16, 100_000, 132) == MAX_SPLITS
    assert attention_latent_mma.split_count(32, 16, 2048, 132) == 4  # 128 blocks
    assert attention_latent_mma.split_count(1, 128, 2048, 132) == min(16, MAX_SPLITS)
    assert attention_latent_mma.split_count(32, 128, 2048, 132) == 1
    assert attention_latent_mma.split_count(4, 16, 1, 132) == 1
    for context in (1, 63, 64, 65, 2048, 5000):
        for splits in (1, 3, 32):
            keys = attention_latent_mma.split_keys(context, splits)
            assert keys % attention_latent_mma.BLOCK_KEYS == 0 and splits * keys >= context


def test_supported_geometries():
    assert attention_latent_mma.supports(16, 576, 512)
    assert attention_latent_mma.supports(128, 576, 512)
    assert not attention_latent_mma.supports(8, 576, 512)
    assert not attention_latent_mma.supports(24, 576, 512)
    assert not attention_latent_mma.supports(16, 320, 256)
    assert not attention_latent_mma.supports(16, 576, 256)


def test_unsupported_geometries_are_refused_before_any_launch():
    q = np.zeros((1, 8, WIDTH), np.float32)
    with pytest.raises(KernelArgumentError, match="unsupported"):
        attention_latent_mma.latent_attention(q, np.zeros((1, 16, WIDTH), np.uint16), np.zeros((1, 1), np.int32),
                                              np.zeros(1, np.int32), np.zeros(1, np.int32), VALUE_DIM, SCALE, 1,
                                              np.zeros((1, 8 * VALUE_DIM), np.uint16))


def test_wrong_arguments_are_refused_before_any_launch():
    q = np.zeros((2, 16, WIDTH), np.float32)
    with pytest.raises(KernelArgumentError):
        attention_latent_mma.latent_attention(q, np.zeros((1, 16, WIDTH), np.uint16), np.zeros((2, 1), np.int32),
                                              np.zeros(2, np.int32), np.zeros(3, np.int32), VALUE_DIM, SCALE, 1,
                                              np.zeros((2, 16 * VALUE_DIM), np.uint16))


# ------------------------------------------------------------------------------- emulation

EMULATION_MAIN = r"""

int main(int argc, char** argv) {
    if (argc != 12) return 2;
    const std::string folder = argv[1];
    const int rows = std::atoi(argv[2]), heads = std::atoi(argv[3]), blocks = std::atoi(argv[4]);
    const int block_size = std::atoi(argv[5]), max_blocks = std::atoi(argv[6]), splits = std::atoi(argv[7]);
    const int split_keys = std::atoi(argv[8]);
    const float scale = std::atof(argv[9]);
    emu::defer_copies = std::atoi(argv[10]);
    const bool fp8 = std::atoi(argv[11]);   // must match FP8_CACHE
    if (fp8 != (bool)FP8_CACHE) return 3;
    auto* q = read<float>(folder + "/q", (size_t)rows * heads * WIDTH);
    auto* latent = read<cache_t>(folder + "/latent", (size_t)blocks * block_size * WIDTH);
    auto* latent_scales = read<float>(folder + "/scales", (size_t)blocks * block_size);
    auto* tables = read<int>(folder + "/tables", (size_t)rows * max_blocks);
    auto* seq_index = read<int>(folder + "/seq_index", rows);
    auto* positions = read<int>(folder + "/positions", rows);
    const size_t partials = (size_t)rows * heads * splits;
    auto* out_acc = allocate<float>(partials * VALUE_DIM);
    auto* out_max = allocate<float>(partials);
    auto* out_sum = allocate<float>(partials);
    emu::launch({(unsigned)rows, (unsigned)(heads / BLOCK_HEADS), (unsigned)splits}, {THREADS, 1, 1}, [&] {
        latent_attention_mma(q, latent, latent_scales, tables, seq_index, positions, heads, block_size, max_blocks,
                             split_keys, scale, out_acc, out_max, out_sum);
    });
    write(folder + "/out_acc", out_acc, partials * VALUE_DIM);
    write(folder + "/out_max", out_max, partials);
    write(folder + "/out_sum", out_sum, partials);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The kernel built against the emulation (over a bf16 cache, and over an FP8 one); returns a
    runner of one launch (``scales`` given: ``latent`` holds E4M3 codes)."""
    folder = tmp_path_factory.mktemp("latent_mma_emulated")
    binaries = {}

    def run(q, latent, tables, seq_index, positions, splits, keys, defer_copies=True, scales=None):
        fp8 = scales is not None
        if fp8 not in binaries:
            binaries[fp8] = build_emulated(folder / f"kernel_{int(fp8)}.cpp",
                                           attention_latent_mma.kernel_source(fp8, with_instructions=False)
                                           + EMULATION_MAIN)
        rows, heads, _ = q.shape
        case = folder / "case"
        case.mkdir(exist_ok=True)
        if scales is None:
            scales = np.ones(latent.shape[:2], np.float32)  # unread over a bf16 cache
        for name, array in dict(q=q, latent=latent, scales=scales, tables=tables, seq_index=seq_index,
                                positions=positions).items():
            np.ascontiguousarray(array).tofile(case / name)
        subprocess.run([str(binaries[fp8]), str(case), *map(str, (rows, heads, latent.shape[0], latent.shape[1],
                                                                  tables.shape[1], splits, keys, SCALE,
                                                                  int(defer_copies), int(fp8)))],
                       check=True, timeout=600)
        return (np.fromfile(case / "out_acc", np.float32).reshape(rows, heads, splits, VALUE_DIM),
                np.fromfile(case / "out_max", np.float32).reshape(rows, heads, splits),
                np.fromfile(case / "out_sum", np.float32).reshape(rows, heads, splits))

    return run


@pytest.mark.parametrize("contexts, splits, defer_copies", [
    ((1, 200), 1, True),  # one key; four steps, the last of 8 keys
    ((63, 64), 2, True),  # a short step; one full step (the second split of each is empty)
    ((65, 200), 2, False),  # a step of 1 key after a full one; copies land at once
])
def test_the_kernel_run_emulated_matches_its_model(emulated, contexts, splits, defer_copies):
    rng = np.random.default_rng(sum(contexts) + splits)
    q, latent, tables, seq_index, positions = latent_case(rng, contexts, 16, 16)
    keys = attention_latent_mma.split_keys(max(contexts), splits)
    out_acc, out_max, out_sum = emulated(q, latent, tables, seq_index, positions, splits, keys, defer_copies)
    latent_f32 = bf16_to_float32(latent)
    want_acc, want_max, want_sum = attention_latent_mma.latent_attention_partials_model(
        q, latent_f32, tables, seq_index, positions, SCALE, splits, keys)
    assert not np.isnan(out_acc).any() and not np.isnan(out_sum).any()
    used = want_sum > 0
    np.testing.assert_array_equal(out_sum > 0, used)
    np.testing.assert_allclose(out_max[used], want_max[used], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out_sum[used], want_sum[used], rtol=2e-3)
    assert rel_error(out_acc, want_acc) <= 2e-3
    assert not out_acc[~used].any(), "a split without keys writes zeros"
    merged = attention_latent_mma.combine_partials_model(out_acc, out_max, out_sum)
    reference = attention_latent.latent_attention_reference(q, latent_f32, tables, seq_index, positions, VALUE_DIM, SCALE)
    assert rel_error(merged, reference) <= 1e-2


def fp8_latent_case(rng, contexts, heads, block_size):
    """:func:`latent_case` with its rows in an FP8 cache (a scale a slot), and every finite E4M3
    code (subnormals and both zeros included) planted in the first block's rows, under their own
    scales."""
    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

    q, latent, tables, seq_index, positions = latent_case(rng, contexts, heads, block_size)
    cache = Fp8CacheArray.zeros(latent.shape)
    codes, scales = cache.quantize(bf16_to_float32(latent))
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    first = tables[0, 0]
    planted = np.resize(finite, block_size * WIDTH).reshape(block_size, WIDTH)
    codes[first] = planted
    return q, codes, scales, tables, seq_index, positions


@pytest.mark.parametrize("contexts, splits, defer_copies", [
    ((1, 200), 1, True),
    ((65, 130), 2, False),
])
def test_the_kernel_over_an_fp8_cache_run_emulated_matches_its_model(emulated, contexts, splits, defer_copies):
    from metrale.kernels.quantized import fp8_e4m3_to_float32

    rng = np.random.default_rng(11 + sum(contexts))
    q, codes, scales, tables, seq_index, positions = fp8_latent_case(rng, contexts, 16, 16)
    keys = attention_latent_mma.split_keys(max(contexts), splits)
    out_acc, out_max, out_sum = emulated(q, codes, tables, seq_index, positions, splits, keys, defer_copies, scales)
    values = fp8_e4m3_to_float32(codes)
    want_acc, want_max, want_sum = attention_latent_mma.latent_attention_partials_model(
        q, values, tables, seq_index, positions, SCALE, splits, keys, scales)
    used = want_sum > 0
    np.testing.assert_array_equal(out_sum > 0, used)
    np.testing.assert_allclose(out_max[used], want_max[used], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out_sum[used], want_sum[used], rtol=2e-3)
    assert rel_error(out_acc, want_acc) <= 2e-3
    merged = attention_latent_mma.combine_partials_model(out_acc, out_max, out_sum)
    dequantized = values * scales[..., None]
    reference = attention_latent.latent_attention_reference(q, dequantized, tables, seq_index, positions, VALUE_DIM,
                                                            SCALE)
    assert rel_error(merged, reference) <= 1e-2
