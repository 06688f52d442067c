"""LayerNorm, GELU, GELU-and-mul and partial-rotary RoPE kernels against their NumPy references on a
real GPU, at model sizes (``-m gpu``)."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import bf16, rel_error  # noqa: E402

from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def cupy_module():
    global cp
    import cupy

    cp = cupy
    return cupy


# 2560 (Phi-2) leaves some of the values each thread keeps in registers unused; 4096 fills them all;
# 5120 runs past them into the re-read loop.
@pytest.mark.parametrize("hidden", [2560, 4096, 5120])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("add_residual, with_bias", [(True, True), (False, True), (True, False)])
def test_layernorm_residual(hidden, rows, add_residual, with_bias):
    from metrale.kernels import layernorm

    rng = np.random.default_rng([hidden, rows, add_residual, with_bias])
    # Rows with a mean far from 0: the kernel's two-pass variance keeps their small spread.
    x = (rng.standard_normal((rows, hidden)) + 20.0 * rng.standard_normal((rows, 1))).astype(np.float32)
    residual = rng.standard_normal((rows, hidden)).astype(np.float32)
    weight = float32_to_bf16((1 + 0.2 * rng.standard_normal(hidden)).astype(np.float32))
    bias = (0.5 * rng.standard_normal(hidden)).astype(np.float32) if with_bias else None
    normed, summed = layernorm.layernorm_residual_reference(
        x, residual if add_residual else None, bf16_to_float32(weight), bias, 1e-5
    )
    res, out = cp.asarray(residual), cp.zeros((rows, hidden), dtype=np.uint16)
    layernorm.layernorm_residual(cp.asarray(x), res, cp.asarray(weight), None if bias is None else cp.asarray(bias),
                                 1e-5, add_residual, out)
    assert rel_error(cp.asnumpy(res), summed) <= 1e-6
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), normed) <= 8e-3


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("rows, width", [(1, 10240), (19, 10240), (64, 2560)])
def test_gelu(approximate, rows, width):
    from metrale.kernels import activation

    rng = np.random.default_rng([rows, width])
    x = (3 * rng.standard_normal((rows, width))).astype(np.float32)
    out = cp.zeros((rows, width), dtype=np.uint16)
    activation.gelu(cp.asarray(x), approximate == "tanh", out)
    expected = activation.gelu_reference(x, approximate)
    actual = bf16_to_float32(cp.asnumpy(out))
    assert rel_error(actual, expected) <= 8e-3
    # Above -1 float32's 1 + erf (1 + tanh) does not cancel: bf16 rounding, at most 2^-8 (3.9e-3)
    # relative, is the only loss.
    kept = x > -1
    np.testing.assert_allclose(actual[kept], expected[kept], rtol=5e-3, atol=1e-30)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("rows", [1, 19, 64])
def test_gelu_and_mul(approximate, rows):
    from metrale.kernels import activation

    rng = np.random.default_rng(rows)
    intermediate = 16384  # Gemma's GeGLU width
    gate_up = (2 * rng.standard_normal((rows, 2 * intermediate))).astype(np.float32)
    out = cp.zeros((rows, intermediate), dtype=np.uint16)
    activation.gelu_and_mul(cp.asarray(gate_up), approximate == "tanh", out)
    expected = activation.gelu_and_mul_reference(gate_up[:, :intermediate], gate_up[:, intermediate:], approximate)
    assert rel_error(bf16_to_float32(cp.asnumpy(out)), expected) <= 8e-3


# (heads, kv_heads, head_dim, rotary_dim, q/k norm offset or None): Phi-2, Pythia-1.4B (rotary_pct
# 0.25) and Qwen3-Next's gated attention (partial factor 0.25, zero-centred q/k norm).
PARTIAL_ROTARY_GEOMETRIES = [(32, 32, 80, 32, None), (16, 16, 128, 32, None), (16, 2, 256, 64, 1.0)]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("heads, kv_heads, head_dim, rotary_dim, norm_offset", PARTIAL_ROTARY_GEOMETRIES)
def test_qkv_rope_cache_partial_rotary(heads, kv_heads, head_dim, rotary_dim, norm_offset, interleaved):
    from metrale.kernels import qkv_rope as rope

    rng = np.random.default_rng([head_dim, rotary_dim, interleaved])
    rows, blocks, block_size = 64, 100, 16
    qkv = rng.standard_normal((rows, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    positions = rng.integers(0, 4000, rows).astype(np.int32)
    slots = rng.choice(blocks * block_size, rows, replace=False).astype(np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)).astype(np.float32)
    qk_norm = norm_offset is not None
    q_norm = bf16(rng, head_dim, 0.2) if qk_norm else None
    k_norm = bf16(rng, head_dim, 0.2) if qk_norm else None
    offset = norm_offset or 0.0
    k_cache, v_cache = bf16(rng, (blocks, block_size, kv_heads, head_dim)), bf16(rng, (blocks, block_size, kv_heads, head_dim))
    k_ref, v_ref = bf16_to_float32(k_cache), bf16_to_float32(v_cache)
    expected = rope.qkv_rope_cache_reference(
        qkv, positions, slots, inv_freq, 1.0, heads, kv_heads, head_dim, k_ref, v_ref,
        None if q_norm is None else bf16_to_float32(q_norm), None if k_norm is None else bf16_to_float32(k_norm),
        1e-6, offset, interleaved, rotary_dim=rotary_dim,
    )
    k_dev, v_dev = cp.asarray(k_cache), cp.asarray(v_cache)
    q = cp.full((rows, heads, head_dim), np.nan, dtype=np.float32)
    rope.qkv_rope_cache(cp.asarray(qkv), cp.asarray(positions), cp.asarray(slots), cp.asarray(inv_freq), 1.0, heads,
                        kv_heads, head_dim, k_dev, v_dev, q, None if q_norm is None else cp.asarray(q_norm),
                        None if k_norm is None else cp.asarray(k_norm), 1e-6, offset, interleaved, rotary_dim=rotary_dim)
    actual = cp.asnumpy(q)
    assert rel_error(actual, expected) <= 1e-4
    # The pass-through dims see no RoPE arithmetic: only the norm's rounding separates them.
    assert rel_error(actual[..., rotary_dim:], expected[..., rotary_dim:]) <= 1e-5
    assert rel_error(bf16_to_float32(cp.asnumpy(k_dev)), k_ref) <= 8e-3
    assert rel_error(bf16_to_float32(cp.asnumpy(v_dev)), v_ref) <= 8e-3
