"""Every CUDA kernel against its NumPy reference, under numba's CUDA simulator (tiny shapes).

The suite's conftest enables the simulator (``NUMBA_ENABLE_CUDASIM=1``) before numba is imported,
so these run on any machine. Shapes are deliberately not multiples of the block sizes.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from metrale.errors import KernelArgumentError
from metrale.kernels import activation, attention, rmsnorm
from metrale.kernels import qkv_rope as rope
from metrale.kernels._device import bf16_to_float, float_to_bf16
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

pytestmark = [
    pytest.mark.skipif(
        not __import__("metrale.kernels._device", fromlist=["SIMULATED"]).SIMULATED,
        reason="the real-GPU variants of these tests carry the gpu marker",
    ),
    # The simulator runs the 64-bit hash on NumPy scalars, which warn when they wrap.
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]


def rounded(values):
    """float32 values as the GPU path stores them (bf16)."""
    return bf16_to_float32(float32_to_bf16(np.asarray(values, dtype=np.float32)))


def rel_error(actual, expected):
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


@cuda.jit
def round_trip(values, bits, widened):
    i = cuda.grid(1)
    if i < values.shape[0]:
        bits[i] = float_to_bf16(values[i])
        widened[i] = bf16_to_float(bits[i])


def test_bf16_conversions_match_the_host_helpers():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(40).astype(np.float32) * 10.0 ** rng.integers(-8, 8, 40),
                             np.array([0.0, -0.0, 1.0, 3.3895e38, -1e-40], np.float32)]).astype(np.float32)
    bits = np.zeros(values.shape, np.uint16)
    widened = np.zeros(values.shape, np.float32)
    round_trip[2, 32](values, bits, widened)
    np.testing.assert_array_equal(bits, float32_to_bf16(values))
    np.testing.assert_array_equal(widened, bf16_to_float32(bits))


# Hidden 45 runs past the values a thread keeps in registers; 20 leaves some of them unused.
@pytest.mark.parametrize("hidden", [45, 20])
@pytest.mark.parametrize("add_residual, offset", [(True, 0.0), (False, 1.0)])
def test_rmsnorm_residual(add_residual, offset, hidden):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, hidden)).astype(np.float32)
    residual = rng.standard_normal((3, hidden)).astype(np.float32)
    weight = float32_to_bf16((offset == 0) + 0.2 * rng.standard_normal(hidden).astype(np.float32))
    expected_normed, expected_sum = rmsnorm.rmsnorm_residual_reference(
        x, residual if add_residual else None, bf16_to_float32(weight), 1e-5, offset
    )
    out = np.zeros((3, hidden), np.uint16)
    rmsnorm.rmsnorm_residual(x, residual, weight, 1e-5, offset, add_residual, out)
    np.testing.assert_allclose(residual, expected_sum, rtol=1e-6)
    assert rel_error(bf16_to_float32(out), expected_normed) <= 8e-3


def test_silu_and_mul_and_cast():
    rng = np.random.default_rng(3)
    gate_up = (3 * rng.standard_normal((3, 2 * 70))).astype(np.float32)
    out = np.zeros((3, 70), np.uint16)
    activation.silu_and_mul(gate_up, out)
    expected = activation.silu_and_mul_reference(gate_up[:, :70], gate_up[:, 70:])
    assert rel_error(bf16_to_float32(out), expected) <= 8e-3
    cast = np.zeros((3, 70), np.uint16)
    activation.to_bf16(expected, cast)
    np.testing.assert_array_equal(cast, float32_to_bf16(expected))
    widened = np.full((3, 70), np.nan, np.float32)
    activation.to_float32(cast, widened)
    np.testing.assert_array_equal(widened, bf16_to_float32(cast))  # exact: bf16 is float32's upper half


def test_silu_and_mul_of_a_bf16_product():
    rng = np.random.default_rng(4)
    gate_up = float32_to_bf16((3 * rng.standard_normal((3, 2 * 70))).astype(np.float32))
    out = np.zeros((3, 70), np.uint16)
    with pytest.raises(KernelArgumentError, match="dtype uint16, expected float32"):
        activation.silu_and_mul(gate_up, out)  # each launcher its kernel's dtype
    activation.silu_and_mul_bits(gate_up, out)
    widened = bf16_to_float32(gate_up)
    expected = activation.silu_and_mul_reference(widened[:, :70], widened[:, 70:])
    assert rel_error(bf16_to_float32(out), expected) <= 8e-3


def random_cache(rng, blocks, block_size, kv_heads, head_dim):
    return float32_to_bf16(rng.standard_normal((blocks, block_size, kv_heads, head_dim)).astype(np.float32))


@pytest.mark.parametrize("qk_norm, interleaved, rotary", [(False, False, 12), (True, False, 12), (True, True, 6)])
def test_qkv_rope_cache(qk_norm, interleaved, rotary):
    rng = np.random.default_rng(4)
    rows, heads, kv_heads, head_dim, block_size = 5, 4, 2, 12, 4
    qkv = rng.standard_normal((rows, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    positions = np.array([0, 1, 7, 30, 2], np.int32)
    slots = np.array([4, 5, 11, 2, 13], np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, rotary, 2) / rotary)).astype(np.float32)
    q_norm = float32_to_bf16(1 + 0.2 * rng.standard_normal(head_dim).astype(np.float32)) if qk_norm else None
    k_norm = float32_to_bf16(1 + 0.2 * rng.standard_normal(head_dim).astype(np.float32)) if qk_norm else None
    k_cache, v_cache = random_cache(rng, 5, block_size, kv_heads, head_dim), random_cache(rng, 5, block_size, kv_heads, head_dim)
    k_ref, v_ref = bf16_to_float32(k_cache), bf16_to_float32(v_cache)
    expected_q = rope.qkv_rope_cache_reference(
        qkv, positions, slots, inv_freq, 1.1, heads, kv_heads, head_dim, k_ref, v_ref,
        None if q_norm is None else bf16_to_float32(q_norm), None if k_norm is None else bf16_to_float32(k_norm),
        1e-6, 0.0, interleaved,
    )
    q_out = np.full((rows, heads, head_dim), np.nan, np.float32)
    rope.qkv_rope_cache(qkv, positions, slots, inv_freq, 1.1, heads, kv_heads, head_dim, k_cache, v_cache, q_out,
                        q_norm, k_norm, 1e-6, 0.0, interleaved)
    assert rel_error(q_out, expected_q) <= 1e-5
    assert rel_error(bf16_to_float32(k_cache), k_ref) <= 8e-3
    assert rel_error(bf16_to_float32(v_cache), v_ref) <= 8e-3
    untouched = np.setdiff1d(np.arange(5 * block_size), slots)
    np.testing.assert_array_equal(
        bf16_to_float32(k_cache).reshape(-1, kv_heads, head_dim)[untouched], k_ref.reshape(-1, kv_heads, head_dim)[untouched]
    )


GEOMETRIES = [(None, 2, 4), (3, 2, 4), (None, 1, 4), (5, 4, 4), (None, 1, 6)]  # (window, kv_heads, heads)


# The grouped and staged kernels exchange values between lanes through shared memory under the
# simulator, which is slow there: they run on the geometries that exercise their head chunks and
# windows, with 32 dims (both halves of a key's words; one lane per value word) and 16 dims (two
# keys per value load). Heads 6 over one KV head fill one block of four heads and half another.
@pytest.mark.parametrize(
    "kernel, head_dim, window, kv_heads, heads",
    [("per-head", 8, *g) for g in GEOMETRIES]
    + [(k, 32, *GEOMETRIES[1]) for k in ("grouped", "staged")]
    + [(k, 16, *GEOMETRIES[3]) for k in ("grouped", "staged")]
    + [(k, 16, *GEOMETRIES[4]) for k in ("grouped", "staged")]
    + [(f"{k} one split", 32, *GEOMETRIES[0]) for k in ("grouped", "staged")],
)
def test_paged_attention_decode_and_prefill_rows(window, kv_heads, heads, kernel, head_dim, monkeypatch):
    # Under the simulator SPLIT_SIZE is tiny, so these rows span several key splits.
    from metrale.kernels import attention_grouped

    block_size = 4
    if kernel != "per-head":
        assert attention_grouped.supports(heads, kv_heads, head_dim, head_dim)
    if kernel.endswith("one split"):
        monkeypatch.setattr(attention_grouped, "MIN_SPLIT_KEYS", 9)
    rng = np.random.default_rng(5)
    k_cache = random_cache(rng, 9, block_size, kv_heads, head_dim)
    v_cache = random_cache(rng, 9, block_size, kv_heads, head_dim)
    block_tables = np.array([[3, 1, 7, 0], [2, 5, 0, 0]], np.int32)
    # Rows: a prefill chunk of sequence 0 at positions 5..7, and one decode row of sequence 1.
    seq_index = np.array([0, 0, 0, 1], np.int32)
    positions = np.array([5, 6, 7, 6], np.int32)
    q = rng.standard_normal((4, heads, head_dim)).astype(np.float32)
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), block_tables.astype(np.int64), seq_index, positions,
        head_dim**-0.5, window,
    ).reshape(4, heads * head_dim)
    splits = (attention.attention_splits(9) if kernel == "per-head"
              else attention_grouped.split_count(4, heads, kv_heads, 9))
    assert (splits == 1) == kernel.endswith("one split")
    out = np.zeros((4, heads * head_dim), np.uint16)
    decode_launcher(kernel)(q, k_cache, v_cache, block_tables, seq_index, positions, head_dim**-0.5, window, 9,
                            decode_workspace(4, heads, splits, head_dim), out)
    assert rel_error(bf16_to_float32(out), expected) <= 8e-3


def decode_launcher(kernel):
    """The launcher of the decode attention kernel named (``per-head``, ``grouped`` or ``staged``)."""
    from metrale.kernels import attention_grouped, attention_staged

    return {"per-head": attention.decode_attention, "grouped": attention_grouped.decode_attention,
            "staged": attention_staged.decode_attention}[kernel.split()[0]]


def decode_workspace(rows, heads, splits, value_dim):
    return (np.zeros((rows, heads, splits, value_dim), np.float32), np.zeros((rows, heads, splits), np.float32),
            np.zeros((rows, heads, splits), np.float32))


@pytest.mark.parametrize("kernel", ["grouped", "staged"])
@pytest.mark.parametrize("window", [None, 21])
def test_grouped_attention_walks_several_tiles(window, kernel, monkeypatch):
    # One split per row, so each warp of a block walks several tiles (chunks) of keys and the
    # online softmax rescales between them; the rows end mid-tile and mid-block.
    from metrale.kernels import attention_grouped

    monkeypatch.setattr(attention_grouped, "MIN_SPLIT_KEYS", 1000)
    rng = np.random.default_rng(8)
    heads, kv_heads, head_dim, block_size = 3, 1, 16, 4
    k_cache = random_cache(rng, 24, block_size, kv_heads, head_dim)
    v_cache = random_cache(rng, 24, block_size, kv_heads, head_dim)
    block_tables = rng.permutation(np.arange(1, 24, dtype=np.int32))[:22].reshape(2, 11)
    seq_index = np.array([0, 1], np.int32)
    positions = np.array([40, 29], np.int32)
    q = 3 * rng.standard_normal((2, heads, head_dim)).astype(np.float32)
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), block_tables.astype(np.int64), seq_index, positions,
        head_dim**-0.5, window,
    ).reshape(2, heads * head_dim)
    assert attention_grouped.split_count(2, heads, kv_heads, 44) == 1
    out = np.zeros((2, heads * head_dim), np.uint16)
    decode_launcher(kernel)(q, k_cache, v_cache, block_tables, seq_index, positions, head_dim**-0.5, window, 44,
                            decode_workspace(2, heads, 1, head_dim), out)
    assert rel_error(bf16_to_float32(out), expected) <= 8e-3


def test_the_grouped_launchers_refuse_what_they_do_not_serve():
    from metrale.kernels import attention_grouped, attention_staged

    q = np.zeros((1, 2, 12), np.float32)  # 12 dims: three words, not a power of two
    cache = np.zeros((2, 4, 1, 12), np.uint16)
    for launch in (attention_grouped.decode_attention, attention_staged.decode_attention):
        with pytest.raises(KernelArgumentError, match="unsupported"):
            launch(q, cache, cache, np.zeros((1, 2), np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32), 0.3,
                   None, 8, decode_workspace(1, 2, 1, 12), np.zeros((1, 24), np.uint16))


def test_attention_combine_merges_splits():
    rng = np.random.default_rng(6)
    rows, heads, splits, dv = 2, 3, 3, 5
    scores = [rng.standard_normal(n) for n in (4, 2, 0)]
    values = [rng.standard_normal((n, dv)) for n in (4, 2, 0)]
    acc = np.zeros((rows, heads, splits, dv), np.float32)
    best = np.full((rows, heads, splits), -np.inf, np.float32)
    total = np.zeros((rows, heads, splits), np.float32)
    for s, (sc, va) in enumerate(zip(scores, values)):
        if len(sc):
            m = sc.max()
            best[:, :, s], total[:, :, s] = m, np.exp(sc - m).sum()
            acc[:, :, s] = np.exp(sc - m) @ va
    all_scores, all_values = np.concatenate(scores), np.concatenate(values)
    weights = np.exp(all_scores - all_scores.max())
    expected = (weights @ all_values) / weights.sum()
    out = np.zeros((rows, heads * dv), np.uint16)
    attention.attention_combine_kernel[(rows, heads), attention.ATTENTION_THREADS](acc, best, total, out)
    assert rel_error(bf16_to_float32(out).reshape(rows, heads, dv), np.broadcast_to(expected, (rows, heads, dv))) <= 8e-3


def test_launchers_name_bad_shapes():
    with pytest.raises(KernelArgumentError, match=r"out has shape \[2, 5\], expected \[2, 4\]"):
        rmsnorm.rmsnorm_residual(np.zeros((2, 4), np.float32), np.zeros((2, 4), np.float32),
                                 np.zeros(4, np.uint16), 1e-6, 0.0, True, np.zeros((2, 5), np.uint16))
    with pytest.raises(KernelArgumentError, match="not C-contiguous"):
        activation.to_bf16(np.zeros((4, 6), np.float32)[:, ::2], np.zeros((4, 3), np.uint16))


@pytest.mark.parametrize("window, kv_heads", [(None, 2), (3, 2), (None, 1), (6, 4)])
def test_prefill_attention_query_tiles(window, kv_heads):
    """Two prompts' chunks (one starting mid-sequence over a cached prefix) and a decode row."""
    from metrale.kernels import attention_prefill

    rng = np.random.default_rng(9)
    heads, head_dim, block_size = 4, 8, 4
    k_cache = random_cache(rng, 12, block_size, kv_heads, head_dim)
    v_cache = random_cache(rng, 12, block_size, kv_heads, head_dim)
    block_tables = np.array([[3, 1, 7, 9, 0], [2, 5, 11, 0, 0], [4, 6, 0, 0, 0]], np.int32)
    # Segment 0: positions 0..9 (a whole prompt); segment 1: positions 6..10 (a later chunk);
    # segment 2: one decode row at position 5.
    seq_index = np.array([0] * 10 + [1] * 5 + [2], np.int32)
    positions = np.array(list(range(10)) + list(range(6, 11)) + [5], np.int32)
    row_starts = np.array([0, 10, 15, 16])
    q = rng.standard_normal((16, heads, head_dim)).astype(np.float32)
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), block_tables, seq_index, positions, head_dim**-0.5,
        window,
    ).reshape(16, -1)
    tiles = attention_prefill.query_tiles(row_starts, attention_prefill.rows_per_tile(heads, kv_heads))
    out = np.zeros((16, heads * head_dim), np.uint16)
    attention_prefill.paged_attention_prefill(
        q, attention_prefill.as_words(k_cache), attention_prefill.as_words(v_cache), block_tables, seq_index,
        positions, tiles, head_dim**-0.5, window, out,
    )
    assert rel_error(bf16_to_float32(out), expected) <= 8e-3


SOFTCAP_SINKS = [(20.0, None), (None, True), (5.0, True)]


@pytest.mark.parametrize("softcap, with_sinks", SOFTCAP_SINKS)
@pytest.mark.parametrize("window", [None, 3])
def test_per_head_decode_attention_caps_logits_and_counts_sinks(softcap, with_sinks, window):
    """The per-head kernels with Gemma-2's soft cap and GPT-OSS's sinks, over several key splits;
    with the window, the row at position 20 has no key in its first split (which carries the sink)."""
    rng = np.random.default_rng(31)
    heads, kv_heads, head_dim, block_size = 4, 2, 8, 4
    k_cache = random_cache(rng, 12, block_size, kv_heads, head_dim)
    v_cache = random_cache(rng, 12, block_size, kv_heads, head_dim)
    block_tables = np.array([[3, 1, 7, 9, 11, 2], [2, 5, 0, 0, 0, 0]], np.int32)
    seq_index = np.array([0, 1, 0], np.int32)
    positions = np.array([20, 6, 13], np.int32)
    q = 4 * rng.standard_normal((3, heads, head_dim)).astype(np.float32)  # logits large enough to cap
    sinks = rng.standard_normal(heads).astype(np.float32) + 1.0 if with_sinks else None
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), block_tables, seq_index, positions, head_dim**-0.5,
        window, softcap, sinks).reshape(3, -1)
    plain = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), block_tables, seq_index, positions, head_dim**-0.5,
        window).reshape(3, -1)
    assert rel_error(plain, expected) > 2e-2  # the options change the result
    splits = attention.attention_splits(21)
    assert splits > 2
    out = np.zeros((3, heads * head_dim), np.uint16)
    attention.decode_attention(q, k_cache, v_cache, block_tables, seq_index, positions, head_dim**-0.5, window, 21,
                               decode_workspace(3, heads, splits, head_dim), out, softcap=softcap, sinks=sinks)
    assert rel_error(bf16_to_float32(out), expected) <= 8e-3


@pytest.mark.parametrize("softcap, with_sinks", SOFTCAP_SINKS)
def test_prefill_attention_caps_logits_and_counts_sinks(softcap, with_sinks):
    from metrale.kernels import attention_prefill

    rng = np.random.default_rng(32)
    heads, kv_heads, head_dim, block_size = 4, 2, 8, 4
    k_cache = random_cache(rng, 12, block_size, kv_heads, head_dim)
    v_cache = random_cache(rng, 12, block_size, kv_heads, head_dim)
    block_tables = np.array([[3, 1, 7, 9, 0], [2, 5, 11, 0, 0]], np.int32)
    seq_index = np.array([0] * 10 + [1] * 5, np.int32)
    positions = np.array(list(range(10)) + list(range(6, 11)), np.int32)
    row_starts = np.array([0, 10, 15])
    q = 4 * rng.standard_normal((15, heads, head_dim)).astype(np.float32)
    sinks = rng.standard_normal(heads).astype(np.float32) + 1.0 if with_sinks else None
    expected = attention.paged_attention_reference(
        q, bf16_to_float32(k_cache), bf16_to_float32(v_cache), block_tables, seq_index, positions, head_dim**-0.5,
        None, softcap, sinks).reshape(15, -1)
    tiles = attention_prefill.query_tiles(row_starts, attention_prefill.rows_per_tile(heads, kv_heads))
    out = np.zeros((15, heads * head_dim), np.uint16)
    attention_prefill.paged_attention_prefill(
        q, attention_prefill.as_words(k_cache), attention_prefill.as_words(v_cache), block_tables, seq_index,
        positions, tiles, head_dim**-0.5, None, out, softcap=softcap, sinks=sinks)
    assert rel_error(bf16_to_float32(out), expected) <= 8e-3


def test_attention_launchers_refuse_bad_options():
    q = np.zeros((1, 4, 8), np.float32)
    cache = np.zeros((2, 4, 2, 8), np.uint16)
    arguments = (q, cache, cache, np.zeros((1, 2), np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32), 0.3, None,
                 4, decode_workspace(1, 4, 1, 8), np.zeros((1, 32), np.uint16))
    with pytest.raises(KernelArgumentError, match="sinks has shape"):
        attention.decode_attention(*arguments, sinks=np.zeros(3, np.float32))
    with pytest.raises(KernelArgumentError, match="softcap"):
        attention.decode_attention(*arguments, softcap=-1.0)


@pytest.mark.parametrize("splits, fp8", [(1, False), (3, False), (3, True)])
def test_latent_attention_matches_the_reference(splits, fp8):
    """Absorbed MLA decode attention: three rows of two sequences (one block table each, blocks
    shuffled), ten heads (two head groups, the second partly empty), a latent of 40 values with 32
    value dims, and contexts that span several key chunks and end inside one; over a bf16 cache
    and an FP8 one (each row's codes and scale)."""
    from metrale.kernels import attention_grouped, attention_latent
    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

    rng = np.random.default_rng(31)
    heads, width, value_dim, block_size = 10, 40, 32, 4
    rows = rng.standard_normal((21, block_size, width)).astype(np.float32) * rng.uniform(0.1, 10, (21, block_size, 1))
    latent_bits = float32_to_bf16(rows.astype(np.float32))
    latent = bf16_to_float32(latent_bits)
    words, pairs, scales = latent_bits.view(np.uint32), np.zeros((1, 1, 1), np.uint16), np.ones((1, 1), np.float32)
    if fp8:
        latent = Fp8CacheArray.zeros((21, block_size, width))
        latent.write(np.arange(21 * block_size), rows.reshape(-1, width))
        words, pairs, scales = np.zeros((1, 1, 1), np.uint32), latent.codes.view(np.uint16), latent.scales
    tables = (1 + rng.permutation(20)).astype(np.int32).reshape(2, 10)
    seq_index = np.array([0, 1, 1], np.int32)
    positions = np.array([2 * attention_latent.CHUNK + 5, 2, attention_latent.CHUNK + 3], np.int32)
    q = rng.standard_normal((3, heads, width)).astype(np.float32)
    scale = 0.3
    expected = attention_latent.latent_attention_reference(q, latent, tables, seq_index, positions, value_dim, scale)
    out_acc = np.zeros((3, heads, splits, value_dim), np.float32)
    out_max = np.zeros((3, heads, splits), np.float32)
    out_sum = np.zeros((3, heads, splits), np.float32)
    groups = attention_latent.head_groups(heads)
    attention_latent.latent_attention_kernel[(3, groups, splits), attention_latent.THREADS](
        q, words, pairs, scales, np.int32(fp8), tables, seq_index, positions, np.float32(scale),
        np.int32(value_dim // 2), out_acc, out_max, out_sum,
    )
    out = np.zeros((3, heads * value_dim), np.uint16)
    dim_blocks = -(-value_dim // attention_grouped.COMBINE_THREADS)  # wide values spread over the grid
    attention_grouped.grouped_combine_kernel[(3, heads, dim_blocks), attention_grouped.COMBINE_THREADS](
        out_acc, out_max, out_sum, out)
    assert rel_error(bf16_to_float32(out).reshape(3, heads, value_dim), expected) <= 8e-3


@pytest.mark.parametrize("interleaved", [False, True])
def test_latent_cache_write_matches_the_reference(interleaved):
    """Three rows into a paged latent cache (block size 4) at scattered slots: the normalised
    latent and the rotated rope key, both RoPE pairings, a YaRN-like attention factor."""
    from metrale.kernels import attention_latent

    rng = np.random.default_rng(32)
    rank, rope_dims = 12, 8
    kv_a = rng.standard_normal((3, rank + rope_dims)).astype(np.float32)
    weight_bits = float32_to_bf16(rng.uniform(0.5, 1.5, rank).astype(np.float32))
    positions = np.array([0, 7, 130], np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, rope_dims, 2) / rope_dims)).astype(np.float32)
    slots = np.array([9, 2, 17], np.int32)
    expected = np.zeros((6, 4, rank + rope_dims), np.float32)
    attention_latent.latent_cache_write_reference(kv_a, bf16_to_float32(weight_bits), 1e-6, positions, inv_freq,
                                                  1.3, interleaved, slots, expected)
    latent = np.zeros((6, 4, rank + rope_dims), np.uint16)
    attention_latent.latent_cache_write_kernel[3, attention_latent.WRITE_THREADS](
        kv_a, weight_bits, np.float32(1e-6), positions, inv_freq, np.float32(1.3), np.int32(interleaved), slots, latent)
    assert rel_error(bf16_to_float32(latent), expected) <= 8e-3
    written = np.zeros((6, 4), bool)
    written[slots // 4, slots % 4] = True
    assert not latent[~written].any()


@pytest.mark.parametrize("method, n_group, topk_group, renormalise", [
    ("greedy", 1, 1, False), ("group_limited_greedy", 4, 2, False), ("noaux_tc", 4, 2, True), ("noaux_tc", 8, 3, False),
])
def test_moe_routing_matches_the_reference(method, n_group, topk_group, renormalise):
    from metrale.kernels import moe

    rng = np.random.default_rng(41)
    tokens, experts, top_k = 5, 16, 3
    logits = (2 * rng.standard_normal((tokens, experts))).astype(np.float32)
    bias = (0.3 * rng.standard_normal(experts)).astype(np.float32)
    want_experts, want_weights = moe.route_reference(logits, bias, method, n_group, topk_group, top_k, renormalise, 2.5)
    got_experts = np.zeros((tokens, top_k), np.int32)
    got_weights = np.zeros((tokens, top_k), np.float32)
    moe.route(logits, bias, method, n_group, topk_group, top_k, renormalise, 2.5, got_experts, got_weights)
    np.testing.assert_array_equal(got_experts, want_experts)
    np.testing.assert_allclose(got_weights, want_weights, rtol=1e-5, atol=1e-6)
    if method != "greedy":  # the group limit really removed experts
        unlimited, _ = moe.route_reference(logits, bias, method, n_group, n_group, top_k, renormalise, 2.5)
        assert (unlimited != want_experts).any()


def test_router_logits_are_float32_products():
    from metrale.kernels import moe

    rng = np.random.default_rng(44)
    x = float32_to_bf16(rng.standard_normal((3, 12)).astype(np.float32))
    gate = rng.standard_normal((5, 12)).astype(np.float32)
    out = np.zeros((3, 5), np.float32)
    moe.router_logits(x, gate, out)
    np.testing.assert_allclose(out, bf16_to_float32(x) @ gate.T, rtol=1e-5, atol=1e-5)


def test_moe_experts_match_the_reference():
    from metrale.kernels import moe

    rng = np.random.default_rng(42)
    tokens, hidden, inter, count, top_k = 3, 12, 8, 5, 2
    x = float32_to_bf16(rng.standard_normal((tokens, hidden)).astype(np.float32))
    gate_up = float32_to_bf16((0.5 * rng.standard_normal((count * 2 * inter, hidden))).astype(np.float32))
    down = float32_to_bf16((0.5 * rng.standard_normal((count * hidden, inter))).astype(np.float32))
    expert_ids = np.array([[4, 0], [2, 4], [1, 3]], np.int32)
    weights = rng.random((tokens, top_k)).astype(np.float32)
    expected = moe.experts_reference(bf16_to_float32(x), expert_ids, weights, bf16_to_float32(gate_up),
                                     bf16_to_float32(down))
    act = np.zeros((tokens * top_k, inter), np.uint16)
    out = np.zeros((tokens, hidden), np.float32)
    moe.experts(x, expert_ids, weights, gate_up, down, act, out)
    assert rel_error(out, expected) <= 1e-2


def test_head_linear_matches_the_reference():
    from metrale.kernels import head_linear

    rng = np.random.default_rng(43)
    rows, heads, width_in, width_out = 2, 3, 8, 5
    x = float32_to_bf16(rng.standard_normal((rows, heads, width_in)).astype(np.float32))
    weight = float32_to_bf16(rng.standard_normal((heads * width_out, width_in)).astype(np.float32))
    expected = head_linear.head_linear_reference(bf16_to_float32(x), bf16_to_float32(weight))
    out = np.zeros((rows, heads, width_out), np.float32)
    head_linear.head_linear(x, weight, out)
    assert rel_error(out, expected) <= 1e-5


def test_gated_delta_decode_kernels_match_the_references():
    """Conv update and one gated-delta step for three rows (two slots, one the dummy slot 0),
    states updated in place."""
    from metrale.kernels import gated_delta

    rng = np.random.default_rng(61)
    rows, channels, width, heads, dk, dv = 3, 20, 4, 2, 6, 5
    slots = np.array([2, 0, 1], np.int32)
    inputs = rng.standard_normal((rows, channels)).astype(np.float32)
    weight = rng.standard_normal((channels, width)).astype(np.float32)
    conv_state = rng.standard_normal((3, channels, width - 1)).astype(np.float32)
    want_conv_state = conv_state.copy()
    expected = gated_delta.conv_update_reference(inputs, weight, want_conv_state, slots)
    out = np.zeros((rows, channels), np.float32)
    gated_delta.conv_update(inputs, weight, conv_state, slots, out)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(conv_state, want_conv_state)

    k = rng.standard_normal((rows, heads, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q = rng.standard_normal((rows, heads, dk)).astype(np.float32)
    v = rng.standard_normal((rows, heads, dv)).astype(np.float32)
    g = -rng.uniform(0, 1, (rows, heads)).astype(np.float32)
    beta = rng.uniform(0, 1, (rows, heads)).astype(np.float32)
    state = rng.standard_normal((3, heads, dk, dv)).astype(np.float32)
    want_state = state.copy()
    expected = gated_delta.recurrent_step_reference(q, k, v, g, beta, want_state, slots)
    out = np.zeros((rows, heads, dv), np.float32)
    gated_delta.recurrent_step(q, k, v, g, beta, state, slots, out)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state, want_state, rtol=1e-5, atol=1e-5)


def test_gated_delta_prompt_kernel_matches_the_chunked_rule():
    """Three prompt segments (9, 1 and 6 tokens: several staged chunks, a one-token segment) from
    three slots with non-zero states; value dims spanning two column blocks (the second partly
    empty) and key dims that are not a multiple of the parts."""
    from metrale.kernels import gated_delta

    rng = np.random.default_rng(63)
    heads, dk, dv = 2, 10, gated_delta.PROMPT_COLUMNS + 3
    starts = np.array([0, 9, 10, 16], np.int32)
    slots = np.array([3, 1, 2], np.int32)
    tokens = int(starts[-1])
    k = rng.standard_normal((tokens, heads, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q = (rng.standard_normal((tokens, heads, dk)) / np.sqrt(dk)).astype(np.float32)
    v = rng.standard_normal((tokens, heads, dv)).astype(np.float32)
    g = -rng.uniform(0, 1, (tokens, heads)).astype(np.float32)
    beta = rng.uniform(0, 1, (tokens, heads)).astype(np.float32)
    state = rng.standard_normal((4, heads, dk, dv)).astype(np.float32)
    want_state = state.copy()
    expected = gated_delta.prompt_rule_reference(q, k, v, g, beta, want_state, slots, starts)
    out = np.zeros((tokens, heads, dv), np.float32)
    gated_delta.prompt_rule(q, k, v, g, beta, state, slots, starts, out)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(state, want_state, rtol=1e-4, atol=1e-4)


def test_qwen3_next_gates_match_the_references():
    from metrale.kernels import gated

    rng = np.random.default_rng(62)
    x = rng.standard_normal((6, 20)).astype(np.float32)
    z = rng.standard_normal((6, 20)).astype(np.float32)
    weight = rng.standard_normal(20).astype(np.float32)
    out = np.zeros((6, 20), np.uint16)
    gated.gated_rmsnorm(x, z, weight, 1e-6, out)
    assert rel_error(bf16_to_float32(out), gated.gated_rmsnorm_reference(x, z, weight, 1e-6)) <= 8e-3
    attention = float32_to_bf16(rng.standard_normal((3, 50)).astype(np.float32))
    gate = rng.standard_normal((3, 50)).astype(np.float32)
    gated_out = np.zeros((3, 50), np.uint16)
    gated.sigmoid_gate(attention, gate, gated_out)
    expected = gated.sigmoid_gate_reference(bf16_to_float32(attention), gate)
    assert rel_error(bf16_to_float32(gated_out), expected) <= 8e-3
