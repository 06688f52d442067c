"""The LoRA kernels (metrale/kernels/lora.py) against the ops' NumPy references, under numba's
CUDA simulator: each row's slot's columns of the shrink kept (then the product the GPU runs), mixed
slots with the base model's rows, float32 and bf16 inputs, fused projections of several parts,
token rows of several adapters."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.kernels import lora
from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16
from metrale.ops import builtin

pytestmark = pytest.mark.skipif(
    not __import__("metrale.kernels._device", fromlist=["SIMULATED"]).SIMULATED,
    reason="the real-GPU variants of these tests carry the gpu marker",
)


def bf16(values):
    return float32_to_bf16(np.asarray(values, np.float32))


@pytest.mark.parametrize("x_bf16", [False, True])
def test_the_selection_keeps_each_row_s_slot_columns(x_bf16):
    rng = np.random.default_rng(0)
    example = builtin._lora_linear_examples(rng)[1]  # 7 rows, three projections, rank 16, 3 slots
    a, b, x, y, row_slots = (example[k] for k in ("a", "b", "x", "y", "slots"))
    row_slots[:3] = [0, 1, 3]
    a_bits, b_bits = bf16(a), bf16(b)
    x_used = bf16_to_float32(bf16(x)) if x_bf16 else x
    width = a.shape[1]
    # The shrink's product (cuBLAS on the GPU) with every slot's A.
    products = (x_used @ bf16_to_float32(a_bits).reshape(3 * width, -1).T).astype(np.float32)
    shrunk = lora.lora_select(products, width, row_slots, np.full(products.shape, 7, np.uint16))
    for row, slot in enumerate(row_slots):
        values = bf16_to_float32(shrunk[row]).reshape(3, width)
        for other in range(1, 4):
            if other == slot:
                np.testing.assert_array_equal(shrunk[row].reshape(3, width)[other - 1],
                                              bf16(products[row].reshape(3, width)[other - 1]))
            else:
                assert not values[other - 1].any()
    # The product the GPU then runs (cuBLAS, accumulated into y) gives the op's reference.
    got = y + bf16_to_float32(shrunk) @ bf16_to_float32(b_bits).T
    reference = builtin.lora_linear(y.copy(), x_used, bf16_to_float32(a_bits), bf16_to_float32(b_bits), row_slots)
    assert np.abs(got - reference).max() <= 1e-2 * np.abs(reference - y).max()
    np.testing.assert_array_equal(got[row_slots == 0], y[row_slots == 0])  # base-model rows untouched


def test_a_step_of_one_adapter_selects_from_that_slot_s_products():
    """The route of a step whose adapter rows are all of slot 2: the shrink with slot 2's A only."""
    rng = np.random.default_rng(3)
    example = builtin._lora_linear_examples(rng)[2]  # 33 rows, two projections, rank 4, 4 slots
    a, b, x, y = (example[k] for k in ("a", "b", "x", "y"))
    row_slots = np.where(rng.random(len(x)) < 0.6, 2, 0).astype(np.int32)
    a_bits, b_bits = bf16(a), bf16(b)
    width = a.shape[1]
    products = (x @ bf16_to_float32(a_bits[1]).T).astype(np.float32)
    shrunk = lora.lora_select(products, width, row_slots, np.full((len(x), 4 * width), 7, np.uint16), single_slot=2)
    got = y + bf16_to_float32(shrunk) @ bf16_to_float32(b_bits).T
    reference = builtin.lora_linear(y.copy(), x, bf16_to_float32(a_bits), bf16_to_float32(b_bits), row_slots, 2)
    assert np.abs(got - reference).max() <= 1e-2 * np.abs(reference - y).max()
    np.testing.assert_array_equal(got[row_slots == 0], y[row_slots == 0])
    assert not bf16_to_float32(shrunk)[:, [c for c in range(4 * width) if c // width != 1]].any()


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
