"""The batch-invariant linear product (:mod:`metrale.kernels.linear_invariant`) on the GPU: a row's
bits alone, in decode batches (the decode kernel) and among up to 300 rows (the tiled kernel), on
the 8B shape's projections and the LM head; every one of 32 rows the same through both kernels; the
values against the float64 product."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

pytestmark = pytest.mark.gpu


def product(x, w, bias=None):
    import cupy as cp

    from metrale.kernels import linear_invariant as li

    out = cp.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    li.invariant_linear(x, w, out, None, bias)
    cp.cuda.get_current_stream().synchronize()
    return cp.asnumpy(out)


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)])
def test_a_row_gives_the_same_bits_alone_and_in_batches_of_every_size(n, k):
    import cupy as cp

    rng = np.random.default_rng(n + k)
    w = cp.asarray(float32_to_bf16((rng.standard_normal((n, k)) * 0.02).astype(np.float32)))
    rows = float32_to_bf16(rng.standard_normal((300, k)).astype(np.float32))
    alone = product(cp.asarray(rows[:1]), w)
    for m in (2, 7, 16, 17, 32, 33, 64, 129, 300):
        batch = product(cp.asarray(rows[:m]), w)
        assert np.array_equal(batch[0].view(np.uint32), alone[0].view(np.uint32)), m
    # Every row of a decode batch (the decode kernel, where it takes them) as in the 300 (the tiled kernel).
    for m in (8, 32):
        assert np.array_equal(product(cp.asarray(rows[:m]), w).view(np.uint32), batch[:m].view(np.uint32)), m
    shuffled = np.random.default_rng(1).permutation(300)
    assert np.array_equal(product(cp.asarray(rows[shuffled]), w).view(np.uint32), batch[shuffled].view(np.uint32))


@pytest.mark.parametrize("m", [1, 33, 300])
def test_the_product_matches_float64(m):
    import cupy as cp

    rng = np.random.default_rng(m)
    n, k = 1000, 2048
    x = float32_to_bf16(rng.standard_normal((m, k)).astype(np.float32))
    w = float32_to_bf16((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
    bias = rng.standard_normal(n).astype(np.float32)
    got = product(cp.asarray(x), cp.asarray(w), cp.asarray(bias))
    exact = bf16_to_float32(x).astype(np.float64) @ bf16_to_float32(w).astype(np.float64).T + bias
    assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()
