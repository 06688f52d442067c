"""The batch-invariant linear kernel (:mod:`metrale.kernels.linear_invariant`) on the GPU: a row's
bits alone and among up to 300 others, on the 8B shape's projections, and its values against the
float64 product."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

pytestmark = pytest.mark.gpu


def product(x, w, bias=None, out_dtype=np.uint16):
    import cupy as cp

    from metrale.kernels import linear_invariant as li

    m, n = x.shape[0], w.shape[0]
    out = cp.empty((m, n), dtype=out_dtype)
    partial = cp.empty((li.split_count(n, w.shape[1]), m, n), dtype=np.float32)
    li.invariant_linear(x, w, out, partial, None, bias)
    cp.cuda.get_current_stream().synchronize()
    return cp.asnumpy(out)


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_a_row_gives_the_same_bits_alone_and_in_batches_of_every_size(n, k):
    import cupy as cp

    rng = np.random.default_rng(n + k)
    w = cp.asarray(float32_to_bf16((rng.standard_normal((n, k)) * 0.02).astype(np.float32)))
    rows = float32_to_bf16(rng.standard_normal((300, k)).astype(np.float32))
    alone = product(cp.asarray(rows[:1]), w)
    for m in (2, 7, 16, 17, 64, 65, 300):
        batch = product(cp.asarray(rows[:m]), w)
        assert np.array_equal(batch[0], alone[0]), m
    # and every row of the largest batch as it is alone in a batch of 16
    assert np.array_equal(product(cp.asarray(rows[:16]), w), batch[:16])


@pytest.mark.parametrize("m", [1, 33])
def test_the_product_matches_float64(m):
    import cupy as cp

    rng = np.random.default_rng(m)
    n, k = 1000, 2048
    x = float32_to_bf16(rng.standard_normal((m, k)).astype(np.float32))
    w = float32_to_bf16((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
    bias = rng.standard_normal(n).astype(np.float32)
    got = product(cp.asarray(x), cp.asarray(w), cp.asarray(bias), np.float32)
    exact = bf16_to_float32(x).astype(np.float64) @ bf16_to_float32(w).astype(np.float64).T + bias
    assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()
