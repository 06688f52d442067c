"""The Hopper prompt attention (metrale.kernels.attention_hopper) without a GPU: the CUDA C++
kernel run on the host through ``cuda_emulation.h`` (a fiber per CUDA thread; mbarrier phases,
TMA tensor loads in the 128-byte swizzle, named barriers and ``wgmma`` with the PTX ISA's operand
layouts, each product run at the wait that needs it) against the NumPy reference: GQA, (key,
value) head sizes of (64, 64), (128, 128), (192, 128) and (256, 256), pages smaller and larger than
a step, prompt chunks after a cached prefix, several steps through both stages, sliding windows,
logit soft caps and sinks, in each form of the consumer loop; the refusals before any launch; and
the sm_90a build through ptxas, which must neither spill nor serialize the products."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated
from kernel_helpers import rel_error
from test_attention_mma_emulated import prompt_case

from metrale.kernels import attention, attention_hopper, attention_mma
from metrale.loading.checkpoint import bf16_to_float32

#: The kernel's forms: the consumers taking turns at their products, each one's softmax under its
#: own products (attention_hopper.PINGPONG, attention_hopper.OVERLAP).
VARIANTS = {"turns-overlap": (True, True), "turns": (True, False), "overlap": (False, True), "plain": (False, False)}

EMULATION_MAIN = r"""

TensorMap cache_map(const unsigned short* cache, int dim, int slots, int kv_heads, int block_size) {
    TensorMap map{};
    map.base = reinterpret_cast<const unsigned char*>(cache);
    map.dims[0] = dim; map.dims[1] = kv_heads; map.dims[2] = slots;
    map.strides[0] = 2; map.strides[1] = 2 * dim; map.strides[2] = 2ull * dim * kv_heads;
    map.box[0] = 64; map.box[1] = 1; map.box[2] = block_size < BLOCK_KEYS ? block_size : BLOCK_KEYS;
    map.swizzle_128 = 1;
    return map;
}

int main(int argc, char** argv) {
    if (argc != 13) return 2;
    const std::string folder = argv[1];
    const int rows = std::atoi(argv[2]), heads = std::atoi(argv[3]), kv_heads = std::atoi(argv[4]);
    const int blocks = std::atoi(argv[5]), block_size = std::atoi(argv[6]), max_blocks = std::atoi(argv[7]);
    const int tiles = std::atoi(argv[8]), window = std::atoi(argv[9]);
    const float scale = std::atof(argv[10]), softcap = std::atof(argv[11]);
    const int with_sinks = std::atoi(argv[12]);
    const size_t keys = (size_t)blocks * block_size * kv_heads;
    auto* q = read<float>(folder + "/q", (size_t)rows * heads * HEAD_DIM);
    auto* k_cache = read<unsigned short>(folder + "/k_cache", keys * HEAD_DIM);
    auto* v_cache = read<unsigned short>(folder + "/v_cache", keys * VALUE_DIM);
    auto* tables = read<int>(folder + "/tables", (size_t)max_blocks * (rows + 1));
    auto* seq_index = read<int>(folder + "/seq_index", rows);
    auto* positions = read<int>(folder + "/positions", rows);
    auto* tile_rows = read<int>(folder + "/tiles", (size_t)tiles * 2);
    auto* sinks = with_sinks ? read<float>(folder + "/sinks", heads) : nullptr;
    auto* out = allocate<unsigned short>((size_t)rows * heads * VALUE_DIM);
    const int slots = blocks * block_size;
    const TensorMap k_map = cache_map(k_cache, HEAD_DIM, slots, kv_heads, block_size);
    const TensorMap v_map = cache_map(v_cache, VALUE_DIM, slots, kv_heads, block_size);
#if HEADS_INNER
    const dim3 grid{(unsigned)heads, (unsigned)tiles, 1};
#else
    const dim3 grid{(unsigned)tiles, (unsigned)heads, 1};
#endif
    emu::launch(grid, {THREADS, 1, 1}, [&] {
        prefill_attention_wgmma(k_map, v_map, q, tables, seq_index, positions, tile_rows, heads, kv_heads, block_size,
                                max_blocks, slots, scale, window, softcap, sinks, out);
    });
    write(folder + "/out", out, (size_t)rows * heads * VALUE_DIM);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The kernel built against the emulation per head sizes and soft cap; returns a runner of one launch."""
    folder = tmp_path_factory.mktemp("prompt_hopper_emulated")
    binaries = {}

    def run(q, k_cache, v_cache, tables, seq_index, positions, starts, scale, window, softcap, sinks, pingpong=True,
            overlap=True, consumers=2, heads_inner=True):
        rows, heads, head_dim = q.shape
        kv_heads, value_dim = k_cache.shape[2], v_cache.shape[3]
        key = (head_dim, value_dim, bool(softcap), pingpong, overlap, consumers, heads_inner)
        if key not in binaries:
            source = attention_hopper.kernel_source(head_dim, value_dim, bool(softcap), with_instructions=False,
                                                    pingpong=pingpong, overlap=overlap, consumers=consumers,
                                                    heads_inner=heads_inner)
            binaries[key] = build_emulated(folder / "kernel{}_{}_{}_{}_{}_{}_{}.cpp".format(*map(int, key)),
                                           source + EMULATION_MAIN)
        # Tiles that fill the form's blocks (64 rows a consumer warpgroup).
        tiles = attention_mma.query_tiles(starts, 64 * consumers)
        padded = np.zeros((rows + 1, tables.shape[1]), np.int32)
        padded[: tables.shape[0]] = tables
        case = folder / "case"
        case.mkdir(exist_ok=True)
        arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache, tables=padded, seq_index=seq_index, positions=positions,
                      tiles=tiles, sinks=sinks if sinks is not None else np.zeros(heads, np.float32))
        for name, array in arrays.items():
            np.ascontiguousarray(array).tofile(case / name)
        subprocess.run([str(binaries[key]), str(case), *map(str, (
            rows, heads, kv_heads, k_cache.shape[0], k_cache.shape[1], tables.shape[1], len(tiles), window or 0,
            scale, softcap or 0.0, int(sinks is not None)))], check=True, timeout=900)
        return bf16_to_float32(np.fromfile(case / "out", np.uint16).reshape(rows, heads * value_dim))

    return run


@pytest.mark.parametrize("head_dim, value_dim, heads, kv_heads, block_size, softcap, with_sinks, window, variant", [
    (64, 64, 4, 2, 16, None, False, None, "turns-overlap"),   # causal GQA, pages of 16 rows (8 loads a step)
    (128, 128, 2, 1, 16, None, False, None, "turns-overlap"),  # two panels of 64 columns a row
    (64, 64, 2, 2, 256, 5.0, True, None, "turns-overlap"),    # pages larger than a step; cap and sinks
    (128, 128, 2, 2, 8, None, True, 150, "turns-overlap"),    # pages of 8 rows; a window skipping whole steps
    (64, 64, 4, 1, 32, 5.0, False, 40, "turns-overlap"),      # a window inside a step
    (192, 128, 2, 2, 16, None, False, None, "turns-overlap"),  # MLA's expanded heads: 3 key panels, 2 value panels
    (256, 256, 2, 1, 16, 5.0, True, 40, "turns-overlap"),     # 64 keys a step, four panels, 256 value columns
    (128, 128, 2, 2, 8, None, True, 150, "turns"),            # the consumers taking turns, no overlap
    (256, 256, 2, 1, 16, 5.0, True, 40, "turns"),
    (128, 128, 2, 2, 8, None, True, 150, "overlap"),          # overlap without turns
    (64, 64, 4, 1, 32, 5.0, False, 40, "plain"),              # neither
    # Three consumer warpgroups (tiles of 192 rows: the first prompt's 200 rows are a full tile
    # and one of 8, in the first consumer's groups only).
    (64, 64, 4, 2, 16, None, False, None, "3-overlap"),
    (64, 64, 2, 2, 256, 5.0, True, None, "3-overlap"),
    (64, 64, 4, 1, 32, 5.0, False, 40, "3-plain"),
    (64, 64, 2, 2, 8, None, True, 150, "3-overlap"),
    (128, 128, 4, 2, 16, 5.0, True, 40, "3-overlap"),         # steps of 64 keys past 64 dims
    (128, 128, 2, 2, 256, None, False, None, "3-plain"),
    # The grid as (tiles, heads), its tiles the fastest dimension, rather than (heads, tiles).
    (128, 128, 4, 2, 16, None, True, None, "overlap:tiles-inner"),
    (64, 64, 4, 1, 32, 5.0, False, 40, "3-overlap:tiles-inner"),
])
def test_the_kernel_run_emulated_matches_the_reference(emulated, head_dim, value_dim, heads, kv_heads, block_size,
                                                       softcap, with_sinks, window, variant):
    variant, _, grid_order = variant.partition(":")
    consumers = 3 if variant.startswith("3-") else 2
    pingpong, overlap = VARIANTS[variant.removeprefix("3-")]
    rng = np.random.default_rng(head_dim + heads + block_size + (window or 0))
    # A prompt of two tiles (the second ending mid-step), keys over three steps (both stages, one
    # of them twice), a chunk of 40 rows after a cached prefix, and one of 5 (rows in the first
    # consumer's groups only).
    q, k_cache, v_cache, tables, seq_index, positions, starts = prompt_case(
        rng, [(0, 200), (300, 40), (60, 5)], heads, kv_heads, head_dim, value_dim, block_size)
    sinks = (rng.standard_normal(heads) + 2.0).astype(np.float32) if with_sinks else None
    scale = head_dim**-0.5
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, scale, window, softcap,
        sinks).reshape(len(positions), -1)
    got = emulated(q, k_cache, v_cache, tables, seq_index, positions, starts, scale, window, softcap, sinks, pingpong,
                   overlap, consumers, heads_inner=grid_order != "tiles-inner")
    # bf16 queries and probabilities on top of the bf16 output.
    assert rel_error(got, expected) <= 2e-2
    if softcap or with_sinks or window:
        plain = attention.paged_attention_reference(
            q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, scale
        ).reshape(len(positions), -1)
        assert rel_error(got, plain) > 0.05  # the cap, the sinks and the window were applied


@pytest.mark.parametrize("heads, kv_heads, head_dim, value_dim, block_size, served", [
    (8, 2, 128, 128, 16, True),
    (8, 8, 64, 64, 256, True),
    (8, 2, 256, 256, 16, True),
    (8, 8, 192, 128, 16, True),    # MLA's expanded heads
    (8, 2, 128, 128, 4, False),    # pages of fewer than 8 rows
    (8, 2, 128, 128, 24, False),   # pages not a power of two
    (8, 2, 96, 96, 16, False),     # a head size not served
    (8, 2, 128, 64, 16, False),    # keys and values of sizes not served together
    (6, 4, 128, 128, 16, False),   # heads not a multiple of the KV heads
])
def test_supported_geometries(heads, kv_heads, head_dim, value_dim, block_size, served):
    assert attention_hopper.supports(heads, kv_heads, head_dim, value_dim, block_size) is served


def test_unsupported_geometries_are_refused_before_any_launch():
    from metrale.errors import KernelArgumentError

    rng = np.random.default_rng(1)
    q, k_cache, v_cache, tables, seq_index, positions, starts = prompt_case(rng, [(0, 20)], 8, 2, 128, 128, 4)
    tiles = attention_hopper.query_tiles(starts)
    out = np.zeros((len(positions), 8 * 128), np.uint16)
    with pytest.raises(KernelArgumentError, match="pages of 4 rows"):
        attention_hopper.prefill_attention(q, k_cache, v_cache, tables, seq_index, positions, tiles, 0.1, None, out)
    with pytest.raises(KernelArgumentError, match="softcap"):
        q16, k16, v16, tables16, seq16, positions16, starts16 = prompt_case(rng, [(0, 20)], 8, 2, 128, 128, 16)
        attention_hopper.prefill_attention(q16, k16, v16, tables16, seq16, positions16,
                                           attention_hopper.query_tiles(starts16), 0.1, None, out, softcap=-1.0)
    # More tiles than the grid's second dimension takes (every row a tile of its own here).
    many = np.repeat(attention_hopper.query_tiles(starts16)[:1], attention_hopper.MAX_TILES + 1, axis=0)
    with pytest.raises(KernelArgumentError, match="tiles exceed the grid"):
        attention_hopper.prefill_attention(q16, k16, v16, tables16, seq16, positions16, many, 0.1, None, out)


def ptxas_log(code: str) -> str:
    """The sm_90a build's ptxas report (``-v``) of the kernel's source; asserts it compiled."""
    from test_cuda_sources import nvrtc_library

    library = nvrtc_library()
    if library is None:
        pytest.skip("no NVRTC library to compile the kernel with")
    import ctypes

    program = ctypes.c_void_p()
    assert library.nvrtcCreateProgram(ctypes.byref(program), code.encode(), b"kernel.cu", 0, None, None) == 0
    options = [b"--std=c++17", b"--use_fast_math", b"--gpu-architecture=sm_90a", b"--ptxas-options=-v"]
    try:
        status = library.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        library.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        library.nvrtcGetProgramLog(program, log)
    finally:
        library.nvrtcDestroyProgram(ctypes.byref(program))
    text = log.value.decode(errors="replace")
    assert status == 0, text[-4000:]
    return text


@pytest.mark.parametrize("head_dim, value_dim", attention_hopper.HEAD_DIMS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_ptxas_neither_spills_nor_serializes_the_products(head_dim, value_dim, variant):
    """The sm_90a build as the GPU gets it, through ptxas: no register spills, and no products
    serialized (ptxas serializes wgmma under a branch it takes for divergent, at a large cost)."""
    pingpong, overlap = VARIANTS[variant]
    text = ptxas_log(attention_hopper.kernel_source(head_dim, value_dim, True, pingpong=pingpong, overlap=overlap))
    assert "0 bytes spill stores, 0 bytes spill loads" in text, text
    assert "Potential Performance Loss" not in text, text


@pytest.mark.parametrize("head_dims", attention_hopper.THREE_CONSUMER_FORMS)
@pytest.mark.parametrize("softcap", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_ptxas_three_consumers_fit_their_registers(head_dims, softcap, overlap):
    """The three-consumer forms: the consumers' 160 registers hold the step without spilling, and
    no product is serialized."""
    text = ptxas_log(attention_hopper.kernel_source(*head_dims, softcap, overlap=overlap, consumers=3))
    assert "0 bytes spill stores, 0 bytes spill loads" in text, text
    assert "Potential Performance Loss" not in text, text


def test_three_consumers_are_refused_the_turns():
    with pytest.raises(ValueError, match="two"):
        attention_hopper.kernel_source(64, 64, pingpong=True, consumers=3)
    with pytest.raises(ValueError, match="consumers"):
        attention_hopper.kernel_source(64, 64, consumers=4)
    with pytest.raises(ValueError, match="three consumers"):
        attention_hopper.kernel_source(256, 256, consumers=3)


def test_query_tiles_fill_the_blocks_of_the_head_sizes():
    starts = np.array([0, 400, 401])
    for head_dims, rows in (((64, 64), 192), ((128, 128), 128), ((192, 128), 128), ((256, 256), 128)):
        assert attention_hopper.tile_rows(*head_dims) == rows
        tiles = attention_hopper.query_tiles(starts, *head_dims)
        assert tiles[:, 1].max() == rows
        assert tiles[:, 1].sum() == 401
