"""The CUDA C++ MLA cache write and query assembly
(:func:`metrale.kernels.attention_latent.latent_cache_write_words`,
:func:`~metrale.kernels.attention_latent.latent_query_words`) run on the host through the CUDA
emulation header against their references, from strided views of a wider projection as the MLA
family passes them; half-split and interleaved pairs."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated

from metrale.kernels import attention_latent
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

EMULATION_MAIN = r"""
#include <string>

int main(int argc, char** argv) {
    if (argc != 13) emu::fail("usage: folder rows heads rank half width projection slots interleaved factor eps q_offset");
    const std::string folder = argv[1];
    const int rows = std::atoi(argv[2]), heads = std::atoi(argv[3]), rank = std::atoi(argv[4]), half = std::atoi(argv[5]);
    const int width = std::atoi(argv[6]), projection = std::atoi(argv[7]), slots = std::atoi(argv[8]);
    const int interleaved = std::atoi(argv[9]);
    const float factor = std::atof(argv[10]), eps = std::atof(argv[11]);
    const int kv_offset = std::atoi(argv[12]);   // where kv_a starts in a projected row
    float* projected = read<float>(folder + "/projected", (size_t)rows * projection);
    float* q_latent = read<float>(folder + "/q_latent", (size_t)rows * heads * rank);
    int* positions = read<int>(folder + "/positions", rows);
    int* slot_mapping = read<int>(folder + "/slot_mapping", rows);
    float* inv_freq = read<float>(folder + "/inv_freq", half);
    unsigned short* norm = read<unsigned short>(folder + "/norm", rank);
    const int latent_width = rank + 2 * half;
    unsigned short* latent = read<unsigned short>(folder + "/latent", (size_t)slots * latent_width);
    float* out = allocate<float>((size_t)rows * heads * latent_width);
    emu::launch({(unsigned)rows, 1, 1}, {LATENT_WORD_THREADS, 1, 1}, [&] {
        latent_cache_write_words(projected + kv_offset, projection, norm, eps, positions, inv_freq, factor, interleaved,
                                 slot_mapping, latent, rank, half);
    });
    // q's heads: the first heads * width values of each projected row.
    emu::launch({(unsigned)rows, (unsigned)heads, 1}, {LATENT_WORD_THREADS, 1, 1}, [&] {
        latent_query_words(q_latent, projected, projection, width, width, positions, inv_freq, factor, interleaved, out,
                           rank, half);
    });
    write(folder + "/latent", latent, (size_t)slots * latent_width);
    write(folder + "/out", out, (size_t)rows * heads * latent_width);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("latent_words_emulated")
    return folder, build_emulated(folder / "latent.cpp", attention_latent.WORD_KERNELS + EMULATION_MAIN)


@pytest.mark.parametrize("rows, heads, rank, half, width, interleaved", [
    (1, 16, 512, 32, 192, False),  # DeepSeek-V2-Lite: 16 heads of 128 + 64, latents of 512 + 64
    (3, 2, 48, 4, 24, True),
])
def test_cache_write_and_queries_match_the_references(emulated, rows, heads, rank, half, width, interleaved):
    folder, binary = emulated
    rng = np.random.default_rng(rows + rank)
    kv_width = rank + 2 * half
    projection = heads * width + kv_width
    slots = 2 * rows + 3
    arrays = dict(
        projected=(2 * rng.standard_normal((rows, projection))).astype(np.float32),
        q_latent=rng.standard_normal((rows, heads, rank)).astype(np.float32),
        positions=rng.integers(0, 5000, rows).astype(np.int32),
        slot_mapping=rng.permutation(slots)[:rows].astype(np.int32),
        inv_freq=(1.0 / 10000 ** (np.arange(half, dtype=np.float32) / half)).astype(np.float32),
        norm=float32_to_bf16((1 + 0.3 * rng.standard_normal(rank)).astype(np.float32)),
        latent=np.zeros((slots, kv_width), np.uint16),
    )
    case = folder / "case"
    case.mkdir(exist_ok=True)
    for name, array in arrays.items():
        np.ascontiguousarray(array).tofile(case / name)
    subprocess.run([str(binary), str(case), str(rows), str(heads), str(rank), str(half), str(width), str(projection),
                    str(slots), str(int(interleaved)), "1.25", "1e-06", str(heads * width)], check=True, timeout=600)
    latent = bf16_to_float32(np.fromfile(case / "latent", np.uint16)).reshape(slots, 1, kv_width)
    out = np.fromfile(case / "out", np.float32).reshape(rows, heads, kv_width)
    projected = arrays["projected"]
    expected_latent = np.zeros((slots, 1, kv_width), np.float32)
    attention_latent.latent_cache_write_reference(
        projected[:, heads * width:], bf16_to_float32(arrays["norm"]), 1e-6, arrays["positions"], arrays["inv_freq"],
        1.25, interleaved, arrays["slot_mapping"], expected_latent)
    assert np.abs(latent - expected_latent).max() <= 1e-2 * np.abs(expected_latent).max()  # one bf16 rounding
    expected = attention_latent.latent_query_reference(
        arrays["q_latent"], projected[:, : heads * width].reshape(rows, heads, width), arrays["positions"],
        arrays["inv_freq"], 1.25, interleaved)
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5 * np.abs(expected).max())
