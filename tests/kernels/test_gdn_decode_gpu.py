"""The fused Gated DeltaNet decode kernels (``metrale.kernels.gdn_decode``) at Qwen3-Next's layer
geometry on a real GPU, against the unfused references: the output and the moved-on states."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.loading.checkpoint import bf16_to_float32

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 8])
def test_qwen3_next_geometry_matches_the_references(rows):
    import cupy as cp

    from metrale.kernels import gdn_decode

    key_heads, value_heads, key_dim, value_dim, kernel = 16, 32, 128, 128, 4
    group = value_heads // key_heads
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    slots = rows + 3
    rng = np.random.default_rng(rows)
    host = dict(
        qkvz=rng.standard_normal((rows, key_heads * (2 * key_dim + 2 * group * value_dim))).astype(np.float32),
        ba=rng.standard_normal((rows, 2 * value_heads)).astype(np.float32),
        conv_weight=(0.5 * rng.standard_normal((channels, kernel))).astype(np.float32),
        conv_state=rng.standard_normal((slots, channels, kernel - 1)).astype(np.float32),
        a_log=(0.3 * rng.standard_normal(value_heads)).astype(np.float32),
        dt_bias=rng.standard_normal(value_heads).astype(np.float32),
        state=(0.1 * rng.standard_normal((slots, value_heads, key_dim, value_dim))).astype(np.float32),
        slots=rng.permutation(slots)[:rows].astype(np.int32),
        norm_weight=(1.0 + 0.3 * rng.standard_normal(value_dim)).astype(np.float32),
    )
    device = {name: cp.asarray(array) for name, array in host.items()}
    mixed = cp.empty((rows, channels), np.float32)
    out = cp.full((rows, value_heads, value_dim), 0x7FC0, np.uint16)
    gdn_decode.decode_step(device["qkvz"], device["ba"], device["conv_weight"], device["conv_state"], device["a_log"],
                           device["dt_bias"], device["state"], device["slots"], device["norm_weight"], 1e-6,
                           key_heads, value_heads, key_dim, value_dim, mixed, out, cp.cuda.get_current_stream())
    expected = gdn_decode.decode_reference(host["qkvz"], host["ba"], host["conv_weight"], host["conv_state"],
                                           host["a_log"], host["dt_bias"], host["state"], host["slots"],
                                           host["norm_weight"], 1e-6, key_heads, value_heads, key_dim, value_dim)
    got = bf16_to_float32(cp.asnumpy(out))
    assert np.abs(got - expected).max() <= 1e-2 * np.abs(expected).max()
    np.testing.assert_array_equal(cp.asnumpy(device["conv_state"]), host["conv_state"])
    np.testing.assert_allclose(cp.asnumpy(device["state"]), host["state"], rtol=1e-4, atol=1e-5)
