"""The CUDA C++ RoPE and cache write (:func:`metrale.kernels.qkv_rope.qkv_rope_cache_words`) run on
the host through the CUDA emulation header against
:func:`~metrale.kernels.qkv_rope.qkv_rope_cache_reference`: grouped KV heads, the per-head q/k norm
(zero-centred too), interleaved pairs, partial rotary, head sizes past a warp's lanes."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.kernels import qkv_rope
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

# The emulation programs' arguments 1-13 and the inputs both forms read.
ARGUMENTS = r"""
    const std::string folder = argv[1];
    const int rows = std::atoi(argv[2]), nh = std::atoi(argv[3]), nkv = std::atoi(argv[4]), d = std::atoi(argv[5]);
    const int half = std::atoi(argv[6]), blocks = std::atoi(argv[7]), block_size = std::atoi(argv[8]);
    const int has_norm = std::atoi(argv[9]), interleaved = std::atoi(argv[10]);
    const float factor = std::atof(argv[11]), eps = std::atof(argv[12]), offset = std::atof(argv[13]);
"""
INPUTS = r"""
    float* qkv = read<float>(folder + "/qkv", (size_t)rows * (nh + 2 * nkv) * d);
    int* positions = read<int>(folder + "/positions", rows);
    int* slots = read<int>(folder + "/slots", rows);
    float* inv_freq = read<float>(folder + "/inv_freq", half);
    unsigned short* q_norm = read<unsigned short>(folder + "/q_norm", d);
    unsigned short* k_norm = read<unsigned short>(folder + "/k_norm", d);
"""

EMULATION_MAIN = r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 14) emu::fail("usage: folder rows nh nkv d half blocks block_size has_norm interleaved factor eps offset");
""" + ARGUMENTS + INPUTS + r"""
    const size_t cache = (size_t)blocks * block_size * nkv * d;
    unsigned short* k_cache = read<unsigned short>(folder + "/k_cache", cache);
    unsigned short* v_cache = read<unsigned short>(folder + "/v_cache", cache);
    float* q = allocate<float>((size_t)rows * nh * d);
    emu::launch({(unsigned)rows, (unsigned)((nh + nkv + ROPE_WORD_HEADS - 1) / ROPE_WORD_HEADS), 1},
                {32 * ROPE_WORD_HEADS, 1, 1}, [&] {
        qkv_rope_cache_words(qkv, positions, slots, inv_freq, factor, q_norm, k_norm, eps, offset, has_norm, interleaved,
                             nh, nkv, d, half, block_size, q, k_cache, v_cache);
    });
    write(folder + "/q", q, (size_t)rows * nh * d);
    write(folder + "/k_cache", k_cache, cache);
    write(folder + "/v_cache", v_cache, cache);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qkv_rope_words_emulated")
    binary = build_emulated(folder / "qkv_rope.cpp", qkv_rope.KERNEL + EMULATION_MAIN)

    def run(arrays, rows, nh, nkv, d, half, blocks, block_size, has_norm, interleaved, factor, eps, offset):
        case = folder / "case"
        case.mkdir(exist_ok=True)
        for name, array in arrays.items():
            np.ascontiguousarray(array).tofile(case / name)
        subprocess.run([str(binary), str(case), str(rows), str(nh), str(nkv), str(d), str(half), str(blocks),
                        str(block_size), str(int(has_norm)), str(int(interleaved)), repr(factor), repr(eps),
                        repr(offset)], check=True, timeout=600)
        shape = (blocks, block_size, nkv, d)
        return (np.fromfile(case / "q", np.float32).reshape(rows, nh, d),
                np.fromfile(case / "k_cache", np.uint16).reshape(shape), np.fromfile(case / "v_cache", np.uint16).reshape(shape))

    return run


@pytest.mark.parametrize("rows, nh, nkv, d, rotary, has_norm, interleaved, offset, first_position", [
    (1, 32, 8, 64, 64, False, False, 0.0, 0),  # Llama-1B's heads
    (3, 4, 2, 128, 128, True, False, 0.0, 0),  # a Qwen3-style q/k norm
    (2, 6, 2, 256, 64, True, False, 1.0, 0),  # partial rotary (Qwen3-Next), a zero-centred norm
    (2, 2, 1, 48, 48, False, True, 0.0, 0),  # interleaved pairs
    (4, 4, 2, 128, 128, False, False, 0.0, 127072),  # a 128k context's last positions: angles past 10^5 radians
])
def test_the_kernel_matches_the_reference(emulated, rows, nh, nkv, d, rotary, has_norm, interleaved, offset,
                                          first_position):
    rng = np.random.default_rng(rows + d + rotary)
    blocks, block_size = 4, 8
    half = rotary // 2
    arrays = dict(
        qkv=(2 * rng.standard_normal((rows, (nh + 2 * nkv) * d))).astype(np.float32),
        positions=(first_position + rng.integers(0, 4000, rows)).astype(np.int32),
        slots=rng.permutation(blocks * block_size)[:rows].astype(np.int32),
        inv_freq=(1.0 / 10000 ** (np.arange(half, dtype=np.float32) / half)).astype(np.float32),
        q_norm=float32_to_bf16((0.5 * rng.standard_normal(d)).astype(np.float32)),
        k_norm=float32_to_bf16((0.5 * rng.standard_normal(d)).astype(np.float32)),
        k_cache=np.zeros((blocks, block_size, nkv, d), np.uint16),
        v_cache=np.zeros((blocks, block_size, nkv, d), np.uint16),
    )
    q, k_cache, v_cache = emulated(arrays, rows, nh, nkv, d, half, blocks, block_size, has_norm, interleaved, 1.25,
                                   1e-6, offset)
    expected_k = np.zeros((blocks, block_size, nkv, d), np.float32)
    expected_v = np.zeros_like(expected_k)
    norms = (bf16_to_float32(arrays["q_norm"]), bf16_to_float32(arrays["k_norm"])) if has_norm else (None, None)
    expected_q = qkv_rope.qkv_rope_cache_reference(
        arrays["qkv"], arrays["positions"], arrays["slots"], arrays["inv_freq"], 1.25, nh, nkv, d, expected_k,
        expected_v, *norms, 1e-6, offset, interleaved, rotary_dim=rotary)
    np.testing.assert_allclose(q, expected_q, rtol=2e-4, atol=2e-4 * np.abs(expected_q).max())
    k = bf16_to_float32(k_cache)
    assert np.abs(k - expected_k).max() <= 1e-2 * np.abs(expected_k).max()  # one bf16 rounding
    np.testing.assert_array_equal(bf16_to_float32(v_cache), bf16_to_float32(float32_to_bf16(expected_v)))


def test_the_reference_skips_rows_of_slot_minus_one():
    """A row of slot -1 writes nothing (as the CUDA C++ kernel, which skips it); NumPy's negative
    index would have stored it in the cache's last slot."""
    from metrale.kernels.attention import paged_kv_write_reference

    k_cache, v_cache = np.zeros((2, 4, 1, 8), np.float32), np.zeros((2, 4, 1, 8), np.float32)
    k, v = np.ones((3, 1, 8), np.float32), 2 * np.ones((3, 1, 8), np.float32)
    paged_kv_write_reference(k_cache, v_cache, np.array([0, -1, 5], np.int32), k, v)
    assert k_cache.reshape(8, 8)[[0, 5]].min() == 1.0 and v_cache.reshape(8, 8)[[0, 5]].min() == 2.0
    assert not k_cache.reshape(8, 8)[[1, 2, 3, 4, 6, 7]].any() and not v_cache.reshape(8, 8)[[1, 2, 3, 4, 6, 7]].any()


EMULATION_FP8_MAIN = r"""
#include <string>

// Both forms over the same inputs: the bf16 kernel into bf16 caches, the FP8 kernel into FP8
// caches (codes and scales); argv[14], argv[15]: the caches' static scales (0: none).
int main(int argc, char** argv) {
    if (argc != 16) emu::fail("usage: folder rows nh nkv d half blocks block_size has_norm interleaved factor eps offset "
                              "k_static v_static");
""" + ARGUMENTS + r"""    const float k_static = std::atof(argv[14]), v_static = std::atof(argv[15]);
""" + INPUTS + r"""    const size_t slots_count = (size_t)blocks * block_size * nkv, cache = slots_count * d;
    unsigned short* k_cache = allocate<unsigned short>(cache);
    unsigned short* v_cache = allocate<unsigned short>(cache);
    unsigned char* k_codes = allocate<unsigned char>(cache);
    unsigned char* v_codes = allocate<unsigned char>(cache);
    float* k_scales = allocate<float>(slots_count);
    float* v_scales = allocate<float>(slots_count);
    for (size_t i = 0; i < cache; ++i) k_cache[i] = v_cache[i] = 0, k_codes[i] = v_codes[i] = 0;
    for (size_t i = 0; i < slots_count; ++i) k_scales[i] = v_scales[i] = -1.0f;   // untouched slots show
    float* q = allocate<float>((size_t)rows * nh * d);
    float* q_fp8 = allocate<float>((size_t)rows * nh * d);
    const dim3 grid{(unsigned)rows, (unsigned)((nh + nkv + ROPE_WORD_HEADS - 1) / ROPE_WORD_HEADS), 1};
    emu::launch(grid, {32 * ROPE_WORD_HEADS, 1, 1}, [&] {
        qkv_rope_cache_words(qkv, positions, slots, inv_freq, factor, q_norm, k_norm, eps, offset, has_norm, interleaved,
                             nh, nkv, d, half, block_size, q, k_cache, v_cache);
    });
    emu::launch(grid, {32 * ROPE_WORD_HEADS, 1, 1}, [&] {
        qkv_rope_cache_fp8_words(qkv, positions, slots, inv_freq, factor, q_norm, k_norm, eps, offset, has_norm,
                                 interleaved, nh, nkv, d, half, block_size, q_fp8, k_codes, v_codes, k_scales, v_scales,
                                 k_static, v_static);
    });
    write(folder + "/q", q, (size_t)rows * nh * d);
    write(folder + "/q_fp8", q_fp8, (size_t)rows * nh * d);
    write(folder + "/k_cache", k_cache, cache);
    write(folder + "/v_cache", v_cache, cache);
    write(folder + "/k_codes", k_codes, cache);
    write(folder + "/v_codes", v_codes, cache);
    write(folder + "/k_scales", k_scales, slots_count);
    write(folder + "/v_scales", v_scales, slots_count);
    return 0;
}
"""


@pytest.mark.parametrize("rows, nh, nkv, d, rotary, has_norm, interleaved, statics", [
    (3, 32, 8, 128, 128, False, False, (0.0, 0.0)),  # Llama-8B's heads
    (2, 4, 2, 128, 128, True, False, (0.0, 0.0)),  # a q/k norm
    (2, 6, 2, 256, 64, True, False, (0.0, 0.0)),  # partial rotary, 256 dims
    (2, 2, 1, 48, 48, False, True, (0.0, 0.0)),  # interleaved pairs, a head past a warp's lanes unevenly
    (2, 4, 2, 64, 64, False, False, (0.02, 0.05)),  # the checkpoint's static scales
])
def test_the_fp8_form_writes_the_bf16_forms_rows_quantized_as_an_fp8_cache_write_does(
        tmp_path, rows, nh, nkv, d, rotary, has_norm, interleaved, statics):
    """The FP8 form against the bf16 form over the same inputs: the same queries, and in each
    written slot the codes and scale that :meth:`~metrale.kernels.kv_cache_fp8.Fp8CacheArray.quantize`
    gives the bf16 form's row (the rule :func:`metrale.kernels.attention_fp8.write_fp8_rows`
    applies on the GPU), bit for bit; slots of no row keep what they held, and a row of zeros takes
    scale 1."""
    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

    binary = build_emulated(tmp_path / "qkv_rope_fp8.cpp", qkv_rope.KERNEL + EMULATION_FP8_MAIN)
    rng = np.random.default_rng(rows + d + rotary + int(1000 * statics[0]))
    blocks, block_size, half = 4, 8, rotary // 2
    qkv = (2 * rng.standard_normal((rows, (nh + 2 * nkv) * d))).astype(np.float32)
    qkv[0, (nh + nkv) * d : (nh + nkv + 1) * d] = 0.0  # the first row's first value head: all zeros
    arrays = dict(
        qkv=qkv,
        positions=rng.integers(0, 4000, rows).astype(np.int32),
        slots=rng.permutation(blocks * block_size)[:rows].astype(np.int32),
        inv_freq=(1.0 / 10000 ** (np.arange(half, dtype=np.float32) / half)).astype(np.float32),
        q_norm=float32_to_bf16((0.5 * rng.standard_normal(d)).astype(np.float32)),
        k_norm=float32_to_bf16((0.5 * rng.standard_normal(d)).astype(np.float32)),
    )
    for name, array in arrays.items():
        np.ascontiguousarray(array).tofile(tmp_path / name)
    subprocess.run([str(binary), str(tmp_path), *map(str, (rows, nh, nkv, d, half, blocks, block_size, int(has_norm),
                                                          int(interleaved))), repr(1.25), repr(1e-6), repr(0.0),
                    repr(statics[0]), repr(statics[1])], check=True, timeout=600)
    shape = (blocks * block_size, nkv, d)

    def read(name, dtype, shape):
        return np.fromfile(tmp_path / name, dtype).reshape(shape)

    np.testing.assert_array_equal(read("q_fp8", np.float32, (rows, nh, d)), read("q", np.float32, (rows, nh, d)))
    slots = arrays["slots"]
    for part, static in (("k", statics[0]), ("v", statics[1])):
        bf16_rows = bf16_to_float32(read(f"{part}_cache", np.uint16, shape)[slots])
        want_codes, want_scales = Fp8CacheArray.zeros(shape, static or None).quantize(bf16_rows)
        codes, scales = read(f"{part}_codes", np.uint8, shape), read(f"{part}_scales", np.float32, shape[:2])
        np.testing.assert_array_equal(codes[slots], want_codes)
        np.testing.assert_array_equal(scales[slots], want_scales)
        others = np.setdiff1d(np.arange(blocks * block_size), slots)
        assert (scales[others] == -1.0).all() and not codes[others].any()
    if not statics[1]:
        assert read("v_scales", np.float32, shape[:2])[slots[0], 0] == 1.0  # the row of zeros
