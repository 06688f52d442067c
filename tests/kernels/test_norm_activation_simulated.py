"""LayerNorm, GELU, GELU-and-mul and partial-rotary RoPE kernels against their NumPy references,
under numba's CUDA simulator (tiny shapes, not multiples of the block sizes)."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.errors import KernelArgumentError
from metrale.kernels import activation, layernorm
from metrale.kernels import qkv_rope as rope
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

pytestmark = pytest.mark.skipif(
    not __import__("metrale.kernels._device", fromlist=["SIMULATED"]).SIMULATED,
    reason="the real-GPU variants of these tests carry the gpu marker",
)


def rel_error(actual, expected):
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


# ------------------------------------------------------------------------------- LayerNorm


# Hidden 45 runs past the values a thread keeps in registers; 20 leaves some of them unused.
@pytest.mark.parametrize("hidden", [45, 20])
@pytest.mark.parametrize("add_residual", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layernorm_residual(hidden, add_residual, with_bias):
    rng = np.random.default_rng([hidden, add_residual, with_bias])
    # A mean far from 0 and a small spread (variance 0.02): a one-pass E[s^2] - mean^2 in float32
    # gets it wrong by about its own size (E[s^2] = 9e4 has an ulp of 0.008).
    x = (300.0 + 0.1 * rng.standard_normal((3, hidden))).astype(np.float32)
    residual = (0.1 * rng.standard_normal((3, hidden))).astype(np.float32)
    weight = float32_to_bf16((1 + 0.2 * rng.standard_normal(hidden)).astype(np.float32))
    bias = rng.standard_normal(hidden).astype(np.float32) if with_bias else None
    expected_normed, expected_sum = layernorm.layernorm_residual_reference(
        x, residual if add_residual else None, bf16_to_float32(weight), bias, 1e-5
    )
    out = np.zeros((3, hidden), np.uint16)
    returned = layernorm.layernorm_residual(x, residual, weight, bias, 1e-5, add_residual, out)
    assert returned is out
    np.testing.assert_allclose(residual, expected_sum, rtol=1e-6)
    assert rel_error(bf16_to_float32(out), expected_normed) <= 8e-3


def test_layernorm_residual_constant_row_gives_the_bias():
    # Zero variance: (x - mean) is exactly 0, so every output is the bias (1 / sqrt(eps) finite).
    x = np.full((2, 21), 3.25, np.float32)
    residual = np.zeros((2, 21), np.float32)
    bias = np.linspace(-1, 1, 21, dtype=np.float32)
    out = np.zeros((2, 21), np.uint16)
    layernorm.layernorm_residual(x, residual, float32_to_bf16(np.ones(21, np.float32)), bias, 1e-5, True, out)
    np.testing.assert_array_equal(out, np.broadcast_to(float32_to_bf16(bias), (2, 21)))


def test_layernorm_residual_without_rows_launches_nothing():
    out = np.zeros((0, 8), np.uint16)
    empty = np.zeros((0, 8), np.float32)
    assert layernorm.layernorm_residual(empty, empty.copy(), np.zeros(8, np.uint16), None, 1e-5, True, out) is out


def test_layernorm_residual_names_bad_arguments():
    x, residual, weight, out = np.zeros((2, 4), np.float32), np.zeros((2, 4), np.float32), np.zeros(4, np.uint16), \
        np.zeros((2, 4), np.uint16)
    with pytest.raises(KernelArgumentError, match=r"bias has shape \[5\], expected \[4\]"):
        layernorm.layernorm_residual(x, residual, weight, np.zeros(5, np.float32), 1e-5, True, out)
    with pytest.raises(KernelArgumentError, match="bias has dtype uint16, expected float32"):
        layernorm.layernorm_residual(x, residual, weight, np.zeros(4, np.uint16), 1e-5, True, out)
    with pytest.raises(KernelArgumentError, match="weight has dtype float32, expected uint16"):
        layernorm.layernorm_residual(x, residual, np.zeros(4, np.float32), None, 1e-5, True, out)
    with pytest.raises(KernelArgumentError, match=r"out has shape \[2, 5\], expected \[2, 4\]"):
        layernorm.layernorm_residual(x, residual, weight, None, 1e-5, True, np.zeros((2, 5), np.uint16))


# ------------------------------------------------------------------------------------ GELU


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate):
    rng = np.random.default_rng(11)
    x = (3 * rng.standard_normal((3, 70))).astype(np.float32)
    x[0, :6] = [0.0, -0.0, 12.0, -12.0, 1e-6, -1e-6]
    out = np.zeros((3, 70), np.uint16)
    assert activation.gelu(x, approximate == "tanh", out) is out
    expected = activation.gelu_reference(x, approximate)
    assert rel_error(bf16_to_float32(out), expected) <= 8e-3
    # Above -1 (no cancellation in float32's 1 + erf or 1 + tanh), rounding to bf16 is the only
    # loss: half a bf16 ulp, at most 2^-8 (3.9e-3) relative.
    kept = x > -1
    np.testing.assert_allclose(bf16_to_float32(out)[kept], expected[kept], rtol=5e-3, atol=1e-30)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_mul(approximate):
    rng = np.random.default_rng(12)
    gate_up = (3 * rng.standard_normal((3, 2 * 37))).astype(np.float32)
    out = np.zeros((3, 37), np.uint16)
    assert activation.gelu_and_mul(gate_up, approximate == "tanh", out) is out
    expected = activation.gelu_and_mul_reference(gate_up[:, :37], gate_up[:, 37:], approximate)
    assert rel_error(bf16_to_float32(out), expected) <= 8e-3


def test_the_two_gelu_kernels_differ_where_the_approximations_do():
    # At x = -3 erf-GELU is -0.00405 and the tanh form -0.00364: 10% apart, far over bf16's rounding.
    x = np.full((1, 3), -3.0, np.float32)
    exact, approximate = np.zeros((1, 3), np.uint16), np.zeros((1, 3), np.uint16)
    activation.gelu(x, False, exact)
    activation.gelu(x, True, approximate)
    assert rel_error(bf16_to_float32(exact), activation.gelu_reference(x, "none")) <= 4e-3
    assert rel_error(bf16_to_float32(approximate), activation.gelu_reference(x, "tanh")) <= 4e-3
    assert rel_error(bf16_to_float32(exact), bf16_to_float32(approximate)) > 0.05


def test_gelu_launchers_name_bad_arguments():
    with pytest.raises(KernelArgumentError, match=r"gelu: out has shape \[2, 3\], expected \[2, 4\]"):
        activation.gelu(np.zeros((2, 4), np.float32), False, np.zeros((2, 3), np.uint16))
    with pytest.raises(KernelArgumentError, match="gelu: x has dtype uint16, expected float32"):
        activation.gelu(np.zeros((2, 4), np.uint16), False, np.zeros((2, 4), np.uint16))
    with pytest.raises(KernelArgumentError, match="last extent is odd"):
        activation.gelu_and_mul(np.zeros((2, 5), np.float32), True, np.zeros((2, 2), np.uint16))
    with pytest.raises(KernelArgumentError, match=r"gelu_and_mul: out has shape \[2, 3\], expected \[2, 2\]"):
        activation.gelu_and_mul(np.zeros((2, 4), np.float32), True, np.zeros((2, 3), np.uint16))
    with pytest.raises(KernelArgumentError, match="approximate is 'sigmoid'"):
        activation.gelu_reference(np.zeros(3, np.float32), "sigmoid")


# ---------------------------------------------------------------------------- partial rotary


def random_cache(rng, blocks, block_size, kv_heads, head_dim):
    return float32_to_bf16(rng.standard_normal((blocks, block_size, kv_heads, head_dim)).astype(np.float32))


def inverse_frequencies(rotary_dim):
    return (1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)).astype(np.float32)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("head_dim, rotary_dim", [(14, 6), (12, 4), (10, 10)])
def test_qkv_rope_cache_partial_rotary(interleaved, qk_norm, head_dim, rotary_dim):
    rng = np.random.default_rng([head_dim, rotary_dim, interleaved, qk_norm])
    rows, heads, kv_heads, block_size = 3, 3, 1, 4
    qkv = rng.standard_normal((rows, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    positions = np.array([0, 5, 41], np.int32)
    slots = np.array([6, 1, 9], np.int32)
    inv_freq = inverse_frequencies(rotary_dim)
    q_norm = float32_to_bf16(1 + 0.2 * rng.standard_normal(head_dim).astype(np.float32)) if qk_norm else None
    k_norm = float32_to_bf16(1 + 0.2 * rng.standard_normal(head_dim).astype(np.float32)) if qk_norm else None
    k_cache, v_cache = random_cache(rng, 3, block_size, kv_heads, head_dim), random_cache(rng, 3, block_size, kv_heads, head_dim)
    k_ref, v_ref = bf16_to_float32(k_cache), bf16_to_float32(v_cache)
    q_weight = None if q_norm is None else bf16_to_float32(q_norm)
    k_weight = None if k_norm is None else bf16_to_float32(k_norm)
    expected_q = rope.qkv_rope_cache_reference(
        qkv, positions, slots, inv_freq, 1.0, heads, kv_heads, head_dim, k_ref, v_ref, q_weight, k_weight,
        1e-6, 1.0 if qk_norm else 0.0, interleaved, rotary_dim=rotary_dim,
    )
    q_out = np.full((rows, heads, head_dim), np.nan, np.float32)
    rope.qkv_rope_cache(qkv, positions, slots, inv_freq, 1.0, heads, kv_heads, head_dim, k_cache, v_cache, q_out,
                        q_norm, k_norm, 1e-6, 1.0 if qk_norm else 0.0, interleaved, rotary_dim=rotary_dim)
    assert rel_error(q_out, expected_q) <= 1e-5
    assert rel_error(bf16_to_float32(k_cache), k_ref) <= 8e-3
    assert rel_error(bf16_to_float32(v_cache), v_ref) <= 8e-3
    # The dims past rotary_dim are the (normed) inputs, untouched by RoPE.
    q_in = qkv[:, : heads * head_dim].reshape(rows, heads, head_dim)
    if qk_norm:
        from metrale.kernels.rmsnorm import rmsnorm_reference

        q_in = rmsnorm_reference(q_in, q_weight, 1e-6, 1.0)
    np.testing.assert_allclose(q_out[..., rotary_dim:], q_in[..., rotary_dim:], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(expected_q[..., rotary_dim:], q_in[..., rotary_dim:], rtol=1e-6, atol=1e-7)


def test_qkv_rope_cache_rotary_dim_defaults_to_the_frequencies():
    rng = np.random.default_rng(13)
    heads, kv_heads, head_dim = 2, 1, 8
    qkv = rng.standard_normal((2, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    arguments = (np.array([3, 9], np.int32), np.array([0, 1], np.int32), inverse_frequencies(4), 1.0, heads, kv_heads,
                 head_dim)
    caches = [np.zeros((1, 2, kv_heads, head_dim), np.uint16) for _ in range(4)]
    implicit, explicit = np.zeros((2, heads, head_dim), np.float32), np.zeros((2, heads, head_dim), np.float32)
    rope.qkv_rope_cache(qkv, *arguments, caches[0], caches[1], implicit)
    rope.qkv_rope_cache(qkv, *arguments, caches[2], caches[3], explicit, rotary_dim=4)
    np.testing.assert_array_equal(implicit, explicit)
    np.testing.assert_array_equal(caches[0], caches[2])
    reference_caches = [np.zeros((1, 2, kv_heads, head_dim), np.float32) for _ in range(2)]
    np.testing.assert_array_equal(rope.qkv_rope_cache_reference(qkv, *arguments, *reference_caches),
                                  rope.qkv_rope_cache_reference(qkv, *arguments, *reference_caches, rotary_dim=4))


@pytest.mark.parametrize("rotary_dim, frequencies, message", [
    (5, 2, "rotary_dim 5 must be even and between 2 and head_dim 8"),
    (10, 5, "rotary_dim 10 must be even and between 2 and head_dim 8"),
    (0, 0, "rotary_dim 0 must be even and between 2 and head_dim 8"),
    (None, 0, "rotary_dim 0 must be even and between 2 and head_dim 8"),
    (None, 5, "rotary_dim 10 must be even and between 2 and head_dim 8"),
    (4, 4, "rotary_dim 4 needs inv_freq of 2 entries, got 4"),
    (4.0, 2, "rotary_dim is 4.0, expected an int"),
])
def test_qkv_rope_cache_refuses_bad_rotary_dims(rotary_dim, frequencies, message):
    heads, kv_heads, head_dim = 2, 1, 8
    qkv = np.zeros((2, (heads + 2 * kv_heads) * head_dim), np.float32)
    positions, slots = np.zeros(2, np.int32), np.array([0, 1], np.int32)
    inv_freq = np.ones(frequencies, np.float32)
    k_cache, v_cache = np.zeros((1, 2, kv_heads, head_dim), np.uint16), np.zeros((1, 2, kv_heads, head_dim), np.uint16)
    with pytest.raises(KernelArgumentError, match=f"qkv_rope_cache: {message}"):
        rope.qkv_rope_cache(qkv, positions, slots, inv_freq, 1.0, heads, kv_heads, head_dim, k_cache, v_cache,
                            np.zeros((2, heads, head_dim), np.float32), rotary_dim=rotary_dim)
    with pytest.raises(KernelArgumentError, match=f"qkv_rope_cache: {message}"):
        rope.qkv_rope_cache_reference(qkv, positions, slots, inv_freq, 1.0, heads, kv_heads, head_dim,
                                      k_cache.astype(np.float32), v_cache.astype(np.float32), rotary_dim=rotary_dim)
