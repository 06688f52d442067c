"""The Gated DeltaNet and MLA glue kernels against their NumPy references on a real GPU, at
Qwen3-Next sizes (16 key heads, 32 value heads of 128 dims, a 4-tap conv) and DeepSeek-V2-Lite
sizes (16 heads, a 512 latent, 128 + 64 query dims) (``-m gpu``)."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import rel_error  # noqa: E402

pytestmark = pytest.mark.gpu

KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, TAPS = 16, 32, 128, 128, 4
CHANNELS = 2 * KEY_HEADS * KEY_DIM + VALUE_HEADS * VALUE_DIM
HEADS, RANK, NOPE, ROTARY = 16, 512, 128, 64


@pytest.fixture(autouse=True)
def cupy_module():
    global cp
    import cupy

    cp = cupy
    return cupy


def test_ungroup_at_qwen3_next_sizes():
    from metrale.kernels import gated_delta

    rng = np.random.default_rng(90)
    rows, ratio = 37, VALUE_HEADS // KEY_HEADS
    qkvz = rng.standard_normal((rows, KEY_HEADS * (2 * KEY_DIM + 2 * ratio * VALUE_DIM))).astype(np.float32)
    want_inputs, want_z = gated_delta.ungroup_reference(qkvz, KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM)
    inputs = cp.full((rows, CHANNELS), np.nan, dtype=np.float32)
    z = cp.full((rows, VALUE_HEADS, VALUE_DIM), np.nan, dtype=np.float32)
    gated_delta.ungroup(cp.asarray(qkvz), KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, inputs, z)
    np.testing.assert_array_equal(cp.asnumpy(inputs), want_inputs)
    np.testing.assert_array_equal(cp.asnumpy(z), want_z)


def test_gates_at_qwen3_next_sizes():
    from metrale.kernels import gated_delta

    rng = np.random.default_rng(91)
    rows = 37
    ba = (4 * rng.standard_normal((rows, 2 * VALUE_HEADS))).astype(np.float32)
    a_log = rng.uniform(-2, 2, VALUE_HEADS).astype(np.float32)
    dt_bias = rng.standard_normal(VALUE_HEADS).astype(np.float32)
    want_g, want_beta = gated_delta.gates_reference(ba, a_log, dt_bias, KEY_HEADS)
    g = cp.full((rows, VALUE_HEADS), np.nan, dtype=np.float32)
    beta = cp.full((rows, VALUE_HEADS), np.nan, dtype=np.float32)
    gated_delta.gates(cp.asarray(ba), cp.asarray(a_log), cp.asarray(dt_bias), KEY_HEADS, g, beta)
    np.testing.assert_allclose(cp.asnumpy(g), want_g, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(cp.asnumpy(beta), want_beta, rtol=1e-5, atol=1e-7)


def test_split_heads_at_qwen3_next_sizes():
    from metrale.kernels import gated_delta

    rng = np.random.default_rng(92)
    rows = 300
    mixed = rng.standard_normal((rows, CHANNELS)).astype(np.float32)
    want_q, want_k, want_v = gated_delta.split_heads_reference(mixed, KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM)
    q = cp.full((rows, VALUE_HEADS, KEY_DIM), np.nan, dtype=np.float32)
    k = cp.full((rows, VALUE_HEADS, KEY_DIM), np.nan, dtype=np.float32)
    v = cp.full((rows, VALUE_HEADS, VALUE_DIM), np.nan, dtype=np.float32)
    gated_delta.split_heads(cp.asarray(mixed), KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, q, k, v)
    np.testing.assert_allclose(cp.asnumpy(q), want_q, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(cp.asnumpy(k), want_k, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(cp.asnumpy(v), want_v)


def test_conv_prompts_at_qwen3_next_sizes():
    """Four prompt segments (300, 2, 77 and 1 rows; two shorter than K - 1) from non-zero states."""
    from metrale.kernels import gated_delta

    rng = np.random.default_rng(93)
    starts = np.array([0, 300, 302, 379, 380], np.int32)
    slots = np.array([2, 5, 1, 3], np.int32)
    inputs = rng.standard_normal((int(starts[-1]), CHANNELS)).astype(np.float32)
    weight = (0.5 * rng.standard_normal((CHANNELS, TAPS))).astype(np.float32)
    conv_state = rng.standard_normal((6, CHANNELS, TAPS - 1)).astype(np.float32)
    want_state = conv_state.copy()
    expected = gated_delta.conv_prompts_reference(inputs, weight, want_state, slots, starts)
    device_state = cp.asarray(conv_state)
    out = cp.full(inputs.shape, np.nan, dtype=np.float32)
    gated_delta.conv_prompts(cp.asarray(inputs), cp.asarray(weight), device_state, cp.asarray(slots),
                             cp.asarray(starts), out)
    assert rel_error(cp.asnumpy(out), expected) <= 1e-5
    np.testing.assert_array_equal(cp.asnumpy(device_state), want_state)


def test_gated_add_at_qwen3_next_sizes():
    from metrale.kernels import gated

    rng = np.random.default_rng(94)
    x = rng.standard_normal((37, 2048)).astype(np.float32)
    y = rng.standard_normal((37, 2048)).astype(np.float32)
    gate = (3 * rng.standard_normal((37, 1))).astype(np.float32)
    expected = gated.gated_add_reference(x, y, gate)
    out = cp.full(x.shape, np.nan, dtype=np.float32)
    gated.gated_add(cp.asarray(x), cp.asarray(y), cp.asarray(gate), out)
    np.testing.assert_allclose(cp.asnumpy(out), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("interleaved", [False, True])
def test_latent_query_at_deepseek_v2_lite_sizes(interleaved):
    from metrale.kernels import attention_latent

    rng = np.random.default_rng(95)
    rows = 40
    q_latent = rng.standard_normal((rows, HEADS, RANK)).astype(np.float32)
    q = rng.standard_normal((rows, HEADS, NOPE + ROTARY)).astype(np.float32)
    positions = rng.integers(0, 4000, rows).astype(np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, ROTARY, 2) / ROTARY)).astype(np.float32)
    expected = attention_latent.latent_query_reference(q_latent, q, positions, inv_freq, 1.2, interleaved)
    out = cp.full((rows, HEADS, RANK + ROTARY), np.nan, dtype=np.float32)
    attention_latent.latent_query(cp.asarray(q_latent), cp.asarray(q), cp.asarray(positions), cp.asarray(inv_freq),
                                  1.2, interleaved, out)
    result = cp.asnumpy(out)
    np.testing.assert_array_equal(result[:, :, :RANK], q_latent)
    assert rel_error(result, expected) <= 1e-5
