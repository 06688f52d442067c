"""The Gated DeltaNet and MLA glue kernels against their NumPy references, under numba's CUDA
simulator (tiny shapes, not multiples of the block sizes; one and two value heads per key head)."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.errors import KernelArgumentError

pytestmark = [
    pytest.mark.skipif(
        not __import__("metrale.kernels._device", fromlist=["SIMULATED"]).SIMULATED,
        reason="the real-GPU variants of these tests carry the gpu marker",
    ),
]

# (key heads, value heads, key dim, value dim): G = 1, G = 2, and G = 2 with dims past the
# simulator's block of threads.
HEAD_GEOMETRIES = [(2, 2, 3, 5), (2, 4, 3, 2), (3, 6, 20, 7)]


@pytest.mark.parametrize("key_heads, value_heads, key_dim, value_dim", HEAD_GEOMETRIES)
def test_ungroup_copies_every_projection_value_to_its_place(key_heads, value_heads, key_dim, value_dim):
    from metrale.kernels import gated_delta

    rng = np.random.default_rng(70)
    rows, ratio = 3, value_heads // key_heads
    qkvz = rng.standard_normal((rows, key_heads * (2 * key_dim + 2 * ratio * value_dim))).astype(np.float32)
    want_inputs, want_z = gated_delta.ungroup_reference(qkvz, key_heads, value_heads, key_dim, value_dim)
    inputs = np.full((rows, 2 * key_heads * key_dim + value_heads * value_dim), np.nan, np.float32)
    z = np.full((rows, value_heads, value_dim), np.nan, np.float32)
    gated_delta.ungroup(qkvz, key_heads, value_heads, key_dim, value_dim, inputs, z)
    np.testing.assert_array_equal(inputs, want_inputs)
    np.testing.assert_array_equal(z, want_z)


@pytest.mark.parametrize("key_heads, value_heads", [(3, 3), (3, 6), (2, 8)])
def test_gates_match_the_reference(key_heads, value_heads):
    from metrale.kernels import gated_delta

    rng = np.random.default_rng(71)
    rows = 5
    # Wide enough that softplus sees large positive and negative arguments.
    ba = (6 * rng.standard_normal((rows, 2 * value_heads))).astype(np.float32)
    a_log = rng.uniform(-2, 1, value_heads).astype(np.float32)
    dt_bias = rng.standard_normal(value_heads).astype(np.float32)
    want_g, want_beta = gated_delta.gates_reference(ba, a_log, dt_bias, key_heads)
    g = np.full((rows, value_heads), np.nan, np.float32)
    beta = np.full((rows, value_heads), np.nan, np.float32)
    gated_delta.gates(ba, a_log, dt_bias, key_heads, g, beta)
    np.testing.assert_allclose(g, want_g, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(beta, want_beta, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("key_heads, value_heads, key_dim, value_dim", HEAD_GEOMETRIES)
def test_split_heads_match_the_reference(key_heads, value_heads, key_dim, value_dim):
    from metrale.kernels import gated_delta

    rng = np.random.default_rng(72)
    rows = 4
    mixed = rng.standard_normal((rows, 2 * key_heads * key_dim + value_heads * value_dim)).astype(np.float32)
    mixed[1, :key_dim] = 0.0  # an all-zero head: only the eps keeps it finite
    want_q, want_k, want_v = gated_delta.split_heads_reference(mixed, key_heads, value_heads, key_dim, value_dim)
    q = np.full((rows, value_heads, key_dim), np.nan, np.float32)
    k = np.full((rows, value_heads, key_dim), np.nan, np.float32)
    v = np.full((rows, value_heads, value_dim), np.nan, np.float32)
    gated_delta.split_heads(mixed, key_heads, value_heads, key_dim, value_dim, q, k, v)
    np.testing.assert_allclose(q, want_q, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(k, want_k, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(v, want_v)


# Segments of 5, 1, 2, 0 and 7 rows from scattered slots: shorter than K - 1, empty, and (with
# the simulator's CONV_ROWS of 3) thread chunks that start inside a segment and cross into the next.
@pytest.mark.parametrize("taps", [4, 2, 1])
def test_conv_prompts_match_the_reference(taps):
    from metrale.kernels import gated_delta

    rng = np.random.default_rng(73)
    channels = 2 * gated_delta.CONV_THREADS + 3
    starts = np.array([0, 5, 6, 8, 8, 15], np.int32)
    slots = np.array([4, 1, 2, 5, 3], np.int32)
    inputs = rng.standard_normal((int(starts[-1]), channels)).astype(np.float32)
    weight = rng.standard_normal((channels, taps)).astype(np.float32)
    conv_state = rng.standard_normal((6, channels, taps - 1)).astype(np.float32)
    want_state = conv_state.copy()
    expected = gated_delta.conv_prompts_reference(inputs, weight, want_state, slots, starts)
    out = np.full(inputs.shape, np.nan, np.float32)
    gated_delta.conv_prompts(inputs, weight, conv_state, slots, starts, out)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(conv_state, want_state)


def test_conv_prompts_leave_rows_outside_the_segments_alone():
    from metrale.kernels import gated_delta

    rng = np.random.default_rng(74)
    channels, taps = 5, 3
    starts = np.array([2, 4, 6], np.int32)  # rows 0, 1 and 6 belong to no segment
    slots = np.array([0, 1], np.int32)
    inputs = rng.standard_normal((7, channels)).astype(np.float32)
    weight = rng.standard_normal((channels, taps)).astype(np.float32)
    conv_state = rng.standard_normal((2, channels, taps - 1)).astype(np.float32)
    want_state = conv_state.copy()
    expected = gated_delta.conv_prompts_reference(inputs, weight, want_state, slots, starts)
    out = np.full(inputs.shape, 7.0, np.float32)
    gated_delta.conv_prompts(inputs, weight, conv_state, slots, starts, out)
    np.testing.assert_allclose(out[2:6], expected[2:6], rtol=1e-5, atol=1e-6)
    assert (out[[0, 1, 6]] == 7.0).all()
    np.testing.assert_array_equal(conv_state, want_state)


def test_gated_add_matches_the_reference():
    from metrale.kernels import gated

    rng = np.random.default_rng(75)
    x = rng.standard_normal((3, 2 * gated.GATE_THREADS + 5)).astype(np.float32)
    y = rng.standard_normal(x.shape).astype(np.float32)
    gate = (4 * rng.standard_normal((3, 1))).astype(np.float32)
    expected = gated.gated_add_reference(x, y, gate)
    out = np.full(x.shape, np.nan, np.float32)
    gated.gated_add(x, y, gate, out)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)
    gated.gated_add(x, y, gate, x)  # in place
    np.testing.assert_array_equal(x, out)


@pytest.mark.parametrize("interleaved", [False, True])
def test_latent_query_matches_the_reference(interleaved):
    from metrale.kernels import attention_latent

    rng = np.random.default_rng(76)
    rows, heads, rank, nope, rotary = 3, 3, attention_latent.QUERY_THREADS + 5, 4, 6
    q_latent = rng.standard_normal((rows, heads, rank)).astype(np.float32)
    q = rng.standard_normal((rows, heads, nope + rotary)).astype(np.float32)
    positions = np.array([0, 7, 3000], np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, rotary, 2) / rotary)).astype(np.float32)
    expected = attention_latent.latent_query_reference(q_latent, q, positions, inv_freq, 1.3, interleaved)
    out = np.full((rows, heads, rank + rotary), np.nan, np.float32)
    attention_latent.latent_query(q_latent, q, positions, inv_freq, 1.3, interleaved, out)
    np.testing.assert_array_equal(out[:, :, :rank], q_latent)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_launchers_refuse_inconsistent_shapes():
    from metrale.kernels import attention_latent, gated, gated_delta

    f32 = np.float32
    with pytest.raises(KernelArgumentError, match="not a multiple"):
        gated_delta.ungroup(np.zeros((2, 30), f32), 2, 3, 3, 2, np.zeros((2, 18), f32), np.zeros((2, 3, 2), f32))
    with pytest.raises(KernelArgumentError, match="qkvz"):
        gated_delta.ungroup(np.zeros((2, 31), f32), 2, 2, 3, 2, np.zeros((2, 16), f32), np.zeros((2, 2, 2), f32))
    with pytest.raises(KernelArgumentError, match="ba"):
        gated_delta.gates(np.zeros((2, 6), f32), np.zeros(4, f32), np.zeros(4, f32), 2, np.zeros((2, 4), f32),
                          np.zeros((2, 4), f32))
    with pytest.raises(KernelArgumentError, match="q_out"):
        gated_delta.split_heads(np.zeros((2, 16), f32), 2, 2, 3, 2, np.zeros((2, 2, 2), f32), np.zeros((2, 2, 3), f32),
                                np.zeros((2, 2, 2), f32))
    with pytest.raises(KernelArgumentError, match="taps"):
        gated_delta.conv_prompts(np.zeros((3, 4), f32), np.zeros((4, 9), f32), np.zeros((1, 4, 8), f32),
                                 np.zeros(1, np.int32), np.array([0, 3], np.int32), np.zeros((3, 4), f32))
    with pytest.raises(KernelArgumentError, match="starts"):
        gated_delta.conv_prompts(np.zeros((3, 4), f32), np.zeros((4, 4), f32), np.zeros((1, 4, 3), f32),
                                 np.zeros(1, np.int32), np.array([0, 3, 3], np.int32), np.zeros((3, 4), f32))
    with pytest.raises(KernelArgumentError, match="gate"):
        gated.gated_add(np.zeros((2, 4), f32), np.zeros((2, 4), f32), np.zeros((2, 4), f32), np.zeros((2, 4), f32))
    with pytest.raises(KernelArgumentError, match="rotary"):
        attention_latent.latent_query(np.zeros((1, 2, 4), f32), np.zeros((1, 2, 4), f32), np.zeros(1, np.int32),
                                      np.zeros(3, f32), 1.0, False, np.zeros((1, 2, 10), f32))
