"""The token-bitmask kernel against its NumPy reference, under numba's CUDA simulator (tiny shapes),
and the reference against a token-by-token reading of the bitmask.

The suite's conftest enables the simulator (``NUMBA_ENABLE_CUDASIM=1``) before numba is imported.
"""

from __future__ import annotations

import numpy as np
import pytest

from metrale.errors import KernelArgumentError
from metrale.kernels import token_mask
from metrale.kernels._device import SIMULATED

simulated = pytest.mark.skipif(not SIMULATED, reason="the real-GPU variants of these tests carry the gpu marker")


def random_case(rng, rows, vocab, masks, words):
    """Logits with no -inf of their own, random bitmasks (one all-zero, one all-ones) and row
    assignments covering no mask (-1, -7), each mask, and one past the bitmask."""
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 4
    bitmask = rng.integers(-(2**31), 2**31, size=(masks, words), dtype=np.int64).astype(np.int32)
    if masks >= 2:
        bitmask[0] = 0
        bitmask[1] = -1
    choices = np.array([-1, -7, masks, *range(masks)], dtype=np.int32)
    mask_rows = np.concatenate([choices, rng.choice(choices, size=max(rows - len(choices), 0))])[:rows]
    return logits, bitmask, rng.permutation(mask_rows).astype(np.int32)


def slow_reference(logits, bitmask, mask_rows):
    """Token by token, straight from the bit layout."""
    out = logits.copy()
    masks, words = bitmask.shape
    for r in range(logits.shape[0]):
        m = int(mask_rows[r])
        if m < 0:
            continue
        for t in range(logits.shape[1]):
            allowed = m < masks and t < 32 * words and (int(bitmask[m, t // 32]) >> (t % 32)) & 1
            if not allowed:
                out[r, t] = -np.inf
    return out


@pytest.mark.parametrize("rows, vocab, masks, words", [(7, 77, 3, 3), (6, 200, 4, 5), (6, 64, 3, 1)])
def test_reference_follows_the_bit_layout(rows, vocab, masks, words):
    rng = np.random.default_rng(rows * vocab)
    logits, bitmask, mask_rows = random_case(rng, rows, vocab, masks, words)
    expected = slow_reference(logits, bitmask, mask_rows)
    got = logits.copy()
    assert token_mask.apply_token_bitmask_reference(got, bitmask, mask_rows) is None
    np.testing.assert_array_equal(got, expected)
    # The cases cover what they claim: untouched rows, fully masked rows, a mix, and tokens past the mask.
    untouched = mask_rows < 0
    assert untouched.any() and (got[untouched] == logits[untouched]).all()
    assert (mask_rows == masks).any() and np.isneginf(got[mask_rows == masks]).all()
    mixed = got[(mask_rows >= 2) & (mask_rows < masks)]
    assert np.isneginf(mixed).any() and np.isfinite(mixed).any()
    if vocab > 32 * words:
        assert np.isneginf(got[mask_rows >= 0, 32 * words:]).all()


def test_reference_reads_the_sign_bit_and_keeps_allowed_logits_exactly():
    logits = np.arange(2 * 40, dtype=np.float32).reshape(2, 40) - 20.5
    bitmask = np.array([[np.int32(-(2**31)) | 1, 0b101]], dtype=np.int32)  # tokens 0, 31, 32, 34
    got = logits.copy()
    token_mask.apply_token_bitmask_reference(got, bitmask, np.array([0, -1], np.int32))
    assert np.flatnonzero(np.isfinite(got[0])).tolist() == [0, 31, 32, 34]
    np.testing.assert_array_equal(got[0, [0, 31, 32, 34]], logits[0, [0, 31, 32, 34]])
    np.testing.assert_array_equal(got[1], logits[1])


@simulated
@pytest.mark.parametrize("rows, vocab, masks, words", [
    (7, 77, 3, 3),     # V not a multiple of 32, the mask exactly covering it
    (6, 200, 4, 5),    # several vocabulary chunks a row, tokens past the mask (5 words = 160 tokens)
    (4, 33, 2, 4),     # a mask wider than the vocabulary
])
def test_kernel_matches_the_reference(rows, vocab, masks, words):
    rng = np.random.default_rng(1000 + rows * vocab)
    logits, bitmask, mask_rows = random_case(rng, rows, vocab, masks, words)
    expected = logits.copy()
    token_mask.apply_token_bitmask_reference(expected, bitmask, mask_rows)
    got = logits.copy()
    assert token_mask.apply_token_bitmask(got, bitmask, mask_rows) is got
    mismatched = np.argwhere(got != expected)
    assert mismatched.size == 0, f"{len(mismatched)} logits differ, first at (row, token) {mismatched[:5].tolist()}"
    assert np.isneginf(expected).any() and np.isfinite(expected).any()


@simulated
def test_kernel_with_no_rows_or_an_empty_bitmask():
    empty = np.zeros((0, 50), np.float32)
    assert token_mask.apply_token_bitmask(empty, np.zeros((1, 2), np.int32), np.zeros(0, np.int32)) is empty
    logits = np.ones((2, 50), np.float32)
    token_mask.apply_token_bitmask(logits, np.zeros((0, 2), np.int32), np.array([0, -1], np.int32))
    assert np.isneginf(logits[0]).all() and (logits[1] == 1).all()


@pytest.mark.parametrize("name, logits, bitmask, mask_rows", [
    ("logits", np.zeros((2, 40), np.float64), np.zeros((1, 2), np.int32), np.zeros(2, np.int32)),
    ("logits", np.zeros(40, np.float32), np.zeros((1, 2), np.int32), np.zeros(2, np.int32)),
    ("logits", np.zeros((40, 2), np.float32).T, np.zeros((1, 2), np.int32), np.zeros(2, np.int32)),
    ("bitmask", np.zeros((2, 40), np.float32), np.zeros((1, 2), np.uint32), np.zeros(2, np.int32)),
    ("bitmask", np.zeros((2, 40), np.float32), np.zeros(2, np.int32), np.zeros(2, np.int32)),
    ("mask_rows", np.zeros((2, 40), np.float32), np.zeros((1, 2), np.int32), np.zeros(3, np.int32)),
    ("mask_rows", np.zeros((2, 40), np.float32), np.zeros((1, 2), np.int32), np.zeros(2, np.int64)),
])
def test_launcher_rejects_wrong_arguments(name, logits, bitmask, mask_rows):
    with pytest.raises(KernelArgumentError, match=f"apply_token_bitmask: {name} "):
        token_mask.apply_token_bitmask(logits, bitmask, mask_rows)
