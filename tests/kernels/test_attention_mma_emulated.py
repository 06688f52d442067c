"""The tensor-core prompt attention (metrale.kernels.attention_mma) without a GPU: the CUDA C++
kernel run on the host through ``cuda_emulation.h`` (a fiber per CUDA thread; ldmatrix, mma.sync,
cp.async and the warp shuffles from the PTX ISA's layouts) against the NumPy reference: GQA, key
and value head sizes of 64, MLA's (192, 128) and 256 (queries kept in shared memory), prompt chunks
after a cached prefix, sliding windows, logit soft caps and sinks, copies landing late or at once."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import build_emulated
from kernel_helpers import bf16, rel_error

from metrale.kernels import attention, attention_mma
from metrale.loading.checkpoint import bf16_to_float32

EMULATION_MAIN = r"""

int main(int argc, char** argv) {
    if (argc != 13) return 2;
    const std::string folder = argv[1];
    const int rows = std::atoi(argv[2]), heads = std::atoi(argv[3]), kv_heads = std::atoi(argv[4]);
    const int blocks = std::atoi(argv[5]), block_size = std::atoi(argv[6]), max_blocks = std::atoi(argv[7]);
    const int tiles = std::atoi(argv[8]), window = std::atoi(argv[9]);
    const float scale = std::atof(argv[10]), softcap = std::atof(argv[11]);
    const int flags = std::atoi(argv[12]);   // 1: sinks, 2: copies deferred to their waits
    emu::defer_copies = (flags & 2) != 0;
    const size_t keys = (size_t)blocks * block_size * kv_heads;
    auto* q = read<float>(folder + "/q", (size_t)rows * heads * HEAD_DIM);
    auto* k_cache = read<cache_t>(folder + "/k_cache", keys * HEAD_DIM);
    auto* v_cache = read<cache_t>(folder + "/v_cache", keys * VALUE_DIM);
#if FP8_CACHE
    auto* k_scales = read<float>(folder + "/k_scales", keys);
    auto* v_scales = read<float>(folder + "/v_scales", keys);
#else
    const float* k_scales = nullptr;
    const float* v_scales = nullptr;
#endif
    auto* tables = read<int>(folder + "/tables", (size_t)max_blocks * (rows + 1));
    auto* seq_index = read<int>(folder + "/seq_index", rows);
    auto* positions = read<int>(folder + "/positions", rows);
    auto* tile_rows = read<int>(folder + "/tiles", (size_t)tiles * 2);
    auto* sinks = (flags & 1) ? read<float>(folder + "/sinks", heads) : nullptr;
    auto* out = allocate<unsigned short>((size_t)rows * heads * VALUE_DIM);
#if HEAD_ROWS
    const unsigned columns = (unsigned)(kv_heads * ((heads / kv_heads + BLOCK_ROWS - 1) / BLOCK_ROWS));
#else
    const unsigned columns = (unsigned)heads;
#endif
    emu::launch({(unsigned)tiles, columns, 1}, {THREADS, 1, 1}, [&] {
        prefill_attention_mma(q, k_cache, v_cache, tables, seq_index, positions, tile_rows, heads, kv_heads,
                              block_size, max_blocks, scale, window, softcap, sinks, out, k_scales, v_scales);
    });
    write(folder + "/out", out, (size_t)rows * heads * VALUE_DIM);
    return 0;
}
"""


def prompt_case(rng, chunks, heads, kv_heads, head_dim, value_dim, block_size):
    """Sequences whose prompt rows are ``chunks[i] = (cached, new)``: ``new`` rows at positions
    ``cached .. cached + new - 1``, over a cache of shuffled blocks."""
    blocks_per_seq = [-(-(cached + new) // block_size) for cached, new in chunks]
    total_blocks = sum(blocks_per_seq) + 2
    order = rng.permutation(np.arange(1, total_blocks))
    tables = np.zeros((len(chunks), max(blocks_per_seq)), np.int32)
    used = 0
    for s, count in enumerate(blocks_per_seq):
        tables[s, :count] = order[used : used + count]
        used += count
    seq_index = np.concatenate([np.full(new, s, np.int32) for s, (_, new) in enumerate(chunks)])
    positions = np.concatenate([np.arange(cached, cached + new, dtype=np.int32) for cached, new in chunks])
    starts = np.concatenate([[0], np.cumsum([new for _, new in chunks])]).astype(np.int32)
    q = (2.0 * rng.standard_normal((len(positions), heads, head_dim))).astype(np.float32)
    k_cache = bf16(rng, (total_blocks, block_size, kv_heads, head_dim))
    v_cache = bf16(rng, (total_blocks, block_size, kv_heads, value_dim))
    return q, k_cache, v_cache, tables, seq_index, positions, starts


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The kernel built against the emulation per geometry and soft cap; returns a runner of one launch."""
    folder = tmp_path_factory.mktemp("prompt_mma_emulated")
    binaries = {}

    def run(q, k_cache, v_cache, tables, seq_index, positions, starts, scale, window, softcap, sinks, defer_copies,
            scales=None, head_rows=False):
        """``scales``: the FP8 caches' ``(k_scales, v_scales)``, ``k_cache`` and ``v_cache`` their codes;
        ``head_rows``: the decode rows' form, every row a segment of its own."""
        rows, heads, head_dim = q.shape
        value_dim, kv_heads = v_cache.shape[3], k_cache.shape[2]
        fp8 = scales is not None
        key = (head_dim, value_dim, bool(softcap), fp8, head_rows)
        if key not in binaries:
            source = attention_mma.kernel_source(head_dim, value_dim, bool(softcap), with_instructions=False, fp8=fp8,
                                                 head_rows=head_rows)
            binaries[key] = build_emulated(
                folder / f"kernel{head_dim}_{value_dim}_{int(bool(softcap))}_{int(fp8)}_{int(head_rows)}.cpp",
                source + EMULATION_MAIN)
        tiles = attention_mma.decode_rows(rows) if head_rows else attention_mma.query_tiles(starts)
        # The tables padded to one row more than the rows, whatever the sequences: main reads a fixed size.
        padded = np.zeros((rows + 1, tables.shape[1]), np.int32)
        padded[: tables.shape[0]] = tables
        case = folder / "case"
        case.mkdir(exist_ok=True)
        arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache, tables=padded, seq_index=seq_index, positions=positions,
                      tiles=tiles, sinks=sinks if sinks is not None else np.zeros(heads, np.float32))
        if fp8:
            arrays["k_scales"], arrays["v_scales"] = (np.asarray(a, np.float32) for a in scales)
        for name, array in arrays.items():
            np.ascontiguousarray(array).tofile(case / name)
        flags = (1 if sinks is not None else 0) | (2 if defer_copies else 0)
        subprocess.run([str(binaries[key]), str(case), *map(str, (
            rows, heads, kv_heads, k_cache.shape[0], k_cache.shape[1], tables.shape[1], len(tiles), window or 0,
            scale, softcap or 0.0, flags))], check=True, timeout=900)
        return bf16_to_float32(np.fromfile(case / "out", np.uint16).reshape(rows, heads * value_dim))

    return run


@pytest.mark.parametrize("head_dim, value_dim, heads, kv_heads, softcap, with_sinks, window, defer_copies", [
    (64, 64, 4, 2, None, False, None, True),   # plain causal GQA, copies landing at their waits
    (32, 32, 4, 2, None, False, None, True),   # 32 dims (small models)
    (64, 64, 4, 2, None, True, 40, True),      # GPT-OSS: sinks and a sliding window
    (64, 64, 4, 1, 5.0, False, None, False),   # Gemma-2: capped logits; copies landing at once
    (64, 64, 2, 2, 5.0, True, 40, True),       # both, with a window
    (192, 128, 2, 2, None, True, None, True),  # MLA's expanded heads
    (256, 256, 2, 1, 5.0, True, 40, True),     # queries kept in shared memory, 32 keys a step
])
def test_the_kernel_run_emulated_matches_the_reference(emulated, head_dim, value_dim, heads, kv_heads, softcap,
                                                       with_sinks, window, defer_copies):
    rng = np.random.default_rng(head_dim + heads + (window or 0))
    # A prompt of two tiles (the second ending mid-step), and a chunk after a cached prefix.
    q, k_cache, v_cache, tables, seq_index, positions, starts = prompt_case(
        rng, [(0, 90), (70, 21)], heads, kv_heads, head_dim, value_dim, 16)
    sinks = (rng.standard_normal(heads) + 2.0).astype(np.float32) if with_sinks else None
    scale = head_dim**-0.5
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, scale, window, softcap,
        sinks).reshape(len(positions), -1)
    got = emulated(q, k_cache, v_cache, tables, seq_index, positions, starts, scale, window, softcap, sinks,
                   defer_copies)
    # bf16 queries and probabilities on top of the bf16 output.
    assert rel_error(got, expected) <= 2e-2
    if softcap or with_sinks:
        plain = attention.paged_attention_reference(
            q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), tables, seq_index, positions, scale, window
        ).reshape(len(positions), -1)
        assert rel_error(got, plain) > 0.1  # the cap and the sinks were applied


@pytest.mark.parametrize("head_dim, value_dim, heads, kv_heads, softcap, with_sinks, window, defer_copies", [
    (64, 64, 4, 2, None, False, None, True),
    (128, 128, 4, 1, 5.0, True, 40, False),
    (256, 256, 2, 1, None, False, None, True),  # queries kept in shared memory, 32 keys a step
    (192, 128, 2, 2, None, True, None, True),  # MLA's expanded heads: keys and values of different sizes
])
def test_an_fp8_cache_is_read_as_the_bf16_kernel_reads_its_dequantized_rows(
        emulated, head_dim, value_dim, heads, kv_heads, softcap, with_sinks, window, defer_copies):
    from metrale.kernels.attention_decode_mma import dequantized_cache
    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray
    from metrale.kernels.quantized import fp8_e4m3_to_float32
    from metrale.loading.checkpoint import float32_to_bf16

    rng = np.random.default_rng(head_dim + heads + 5)
    q, k_bits, v_bits, tables, seq_index, positions, starts = prompt_case(
        rng, [(0, 90), (70, 21)], heads, kv_heads, head_dim, value_dim, 16)
    (k_codes, k_scales), (v_codes, v_scales) = (
        Fp8CacheArray.zeros(bits.shape).quantize(bf16_to_float32(bits) * rng.uniform(0.5, 2.0, bits.shape[:3] + (1,)))
        for bits in (k_bits, v_bits))
    sinks = (rng.standard_normal(heads) + 2.0).astype(np.float32) if with_sinks else None
    scale = head_dim**-0.5
    got = emulated(q, k_codes, v_codes, tables, seq_index, positions, starts, scale, window, softcap, sinks,
                   defer_copies, scales=(k_scales, v_scales))
    # The bf16 kernel over the dequantized rows: the same output to the bit.
    k_values, v_values = dequantized_cache(k_codes, k_scales), dequantized_cache(v_codes, v_scales)
    bf16_run = emulated(q, float32_to_bf16(k_values), float32_to_bf16(v_values), tables, seq_index, positions, starts,
                        scale, window, softcap, sinks, defer_copies)
    np.testing.assert_array_equal(got, bf16_run)
    exact_k = fp8_e4m3_to_float32(k_codes) * k_scales[..., None]
    exact_v = fp8_e4m3_to_float32(v_codes) * v_scales[..., None]
    expected = attention.paged_attention_reference(q, exact_k, exact_v, tables, seq_index, positions, scale, window,
                                                   softcap, sinks).reshape(len(positions), -1)
    assert rel_error(got, expected) <= 2e-2


@pytest.mark.parametrize("window", [None, 40])
def test_a_row_gives_the_same_bits_whatever_segment_and_chunk_it_is_computed_in(emulated, window):
    """What batch-invariant attention relies on: a query row's output bits are the same computed
    in a whole prompt, in a chunk after a cached prefix, alone as a one-row segment (a decode row),
    and beside another sequence's rows -- the keys are stepped through from the same positions and
    the keys past a row add exact zeros."""
    rng = np.random.default_rng(5)
    heads, kv_heads, dim, block_size = 4, 2, 64, 16
    q, k_cache, v_cache, tables, _, _, _ = prompt_case(rng, [(0, 90), (0, 37)], heads, kv_heads, dim, dim, block_size)
    # Sequence 0's queries by position; sequence 1's rows are the neighbours.
    queries = {position: q[position] for position in range(90)}
    neighbours = q[90:]
    scale = dim**-0.5

    def run(segments):
        """segments: (sequence, first position, rows); returns each row's output by (sequence, position)."""
        rows_q, seq_index, positions, starts = [], [], [], [0]
        for sequence, first, count in segments:
            for position in range(first, first + count):
                rows_q.append(queries[position] if sequence == 0 else neighbours[position])
                seq_index.append(sequence)
                positions.append(position)
            starts.append(starts[-1] + count)
        out = emulated(np.stack(rows_q), k_cache, v_cache, tables, np.array(seq_index, np.int32),
                       np.array(positions, np.int32), np.array(starts, np.int32), scale, window, None, None, True)
        return {(s, p): out[i] for i, (s, p) in enumerate(zip(seq_index, positions))}

    whole = run([(0, 0, 90)])
    for segments in ([(0, 40, 50)], [(1, 0, 37), (0, 70, 20)], [(0, 89, 1), (1, 0, 37)], [(0, 63, 1), (0, 64, 1)],
                     [(1, 30, 7), (0, 5, 1), (0, 6, 60)]):
        for (sequence, position), row in run(segments).items():
            if sequence == 0:
                assert np.array_equal(row.view(np.uint32), whole[(0, position)].view(np.uint32)), (segments, position)


@pytest.mark.parametrize("heads, kv_heads, dim, softcap, with_sinks, window", [
    (8, 2, 64, None, False, None),   # four query heads a KV head (Llama's grouping)
    (4, 4, 64, 5.0, True, 40),       # one head a KV head; capped logits, sinks, a sliding window
    (130, 2, 32, None, True, None),  # 65 heads a KV head: two tiles of heads, the second of one
    (2, 1, 256, None, False, 40),    # queries kept in shared memory, 32 keys a step
])
def test_decode_rows_give_the_prompt_forms_bits(emulated, heads, kv_heads, dim, softcap, with_sinks, window):
    """Each query row through the decode rows' form (its heads of a KV head as a tile's rows) gives
    the bits the prompt form gives the same row inside a whole prompt, whatever rows are beside it."""
    rng = np.random.default_rng(heads + dim)
    q, k_cache, v_cache, tables, seq_index, positions, starts = prompt_case(
        rng, [(0, 90), (0, 37)], heads, kv_heads, dim, dim, 16)
    sinks = (rng.standard_normal(heads) + 2.0).astype(np.float32) if with_sinks else None
    scale = dim**-0.5
    prompts = emulated(q, k_cache, v_cache, tables, seq_index, positions, starts, scale, window, softcap, sinks, True)
    picked = np.array([89, 0, 63, 90 + 36, 64, 90, 17], np.int32)  # rows of both sequences, in any order
    decoded = emulated(q[picked], k_cache, v_cache, tables, seq_index[picked], positions[picked],
                       np.arange(len(picked) + 1, dtype=np.int32), scale, window, softcap, sinks, True, head_rows=True)
    assert np.array_equal(decoded.view(np.uint32), prompts[picked].view(np.uint32))
    alone = emulated(q[picked[:1]], k_cache, v_cache, tables, seq_index[picked[:1]], positions[picked[:1]],
                     np.arange(2, dtype=np.int32), scale, window, softcap, sinks, False, head_rows=True)
    assert np.array_equal(alone.view(np.uint32), prompts[picked[:1]].view(np.uint32))
