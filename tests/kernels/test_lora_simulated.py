"""The LoRA kernels (metrale/kernels/lora.py) against the ops' NumPy references, under numba's
CUDA simulator: the expand after the shrink's product with every slot, mixed slots with the base
model's rows, float32 and bf16 inputs, fused projections of several parts, more rows than a
block's tile, token rows of several adapters."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.checkpoint import bf16_to_float32, float32_to_bf16
from metrale.kernels import lora
from metrale.ops import builtin

pytestmark = pytest.mark.skipif(
    not __import__("metrale.kernels._device", fromlist=["SIMULATED"]).SIMULATED,
    reason="the real-GPU variants of these tests carry the gpu marker",
)


def bf16(values):
    return float32_to_bf16(np.asarray(values, np.float32))


@pytest.mark.parametrize("x_bf16", [False, True])
def test_lora_linear_matches_the_reference(x_bf16):
    rng = np.random.default_rng(0)
    rows, inner, rank, slots = 7, 40, 4, 3
    splits = np.array([0, 24, 32, 40], np.int32)
    a = bf16(rng.standard_normal((slots + 1, 3 * rank, inner)) * 0.3)
    b = bf16(rng.standard_normal((slots + 1, 40, rank)) * 0.3)
    a[0], b[0] = 0, 0
    x = rng.standard_normal((rows, inner)).astype(np.float32)
    x_in = bf16(x) if x_bf16 else x
    row_slots = np.array([0, 1, 2, 1, 3, 0, 2], np.int32)
    y = rng.standard_normal((rows, 40)).astype(np.float32)
    expected = builtin.lora_linear(y.copy(), bf16_to_float32(x_in) if x_bf16 else x, bf16_to_float32(a),
                                   bf16_to_float32(b), splits, row_slots)
    flat = bf16_to_float32(a[1:]).reshape(slots * 3 * rank, inner)
    shrunk = ((bf16_to_float32(x_in) if x_bf16 else x) @ flat.T).astype(np.float32)  # the cuBLAS product
    got = lora.lora_expand(y.copy(), shrunk, b, splits, row_slots)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[[0, 5]], y[[0, 5]])  # base-model rows untouched


def test_token_rows_and_logit_rows_match_the_references():
    rng = np.random.default_rng(1)
    tokens = np.array([[-1, -1, -1], [4, 9, -1], [2, -1, -1]], np.int32)
    table = rng.standard_normal((3, 3, 16)).astype(np.float32)
    ids = np.array([4, 9, 2, 4, 2], np.int32)
    row_slots = np.array([1, 1, 2, 0, 1], np.int32)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    expected = builtin.lora_token_rows(x.copy(), ids, row_slots, tokens, table)
    got = lora.lora_token_rows(x.copy(), ids, row_slots, tokens, table)
    np.testing.assert_array_equal(got, expected)
    assert (got[0] == table[1, 0]).all() and (got[3] == x[3]).all() and (got[4] == x[4]).all()
    logits = rng.standard_normal((5, 12)).astype(np.float32)
    h = rng.standard_normal((5, 16)).astype(np.float32)
    expected = builtin.lora_logit_rows(logits.copy(), bf16_to_float32(bf16(h)), row_slots, tokens, table)
    got = lora.lora_logit_rows(logits.copy(), bf16(h), row_slots, tokens, table)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert got[3].tolist() == logits[3].tolist()
