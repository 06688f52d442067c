"""The batch-invariant linear product on the GPU (:mod:`metrale.kernels.linear_invariant`'s tiled
kernel and the decode GEMV that takes decode rows in its place): a row's bits alone and among up to
300 rows, and every row of a decode batch through the decode GEMV bit for bit as through the tiled
kernel, on the 8B shape's projections and the LM head; the values against the float64 product."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

pytestmark = pytest.mark.gpu


def tiled(x, w, bias=None):
    import cupy as cp

    from metrale.kernels import linear_invariant as li

    out = cp.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    shape = li.partial_shape(x.shape[0], w.shape[0], li.decode_gemv.multiprocessor_count())
    li.invariant_linear(x, w, out, None, bias, partial=None if shape is None else cp.empty(shape, dtype=np.float32))
    cp.cuda.get_current_stream().synchronize()
    return cp.asnumpy(out)


def decoded(x, w, bias=None):
    """The decode GEMV's plain product with the split the tiled kernel follows."""
    import cupy as cp

    from metrale.kernels import decode_gemv as dg
    from metrale.kernels import linear_invariant as li

    out = cp.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    dg.decode_gemv(dg.PLAIN, x, w, out, None, bias=bias, split=li.split_of(w.shape[0], dg.multiprocessor_count()))
    cp.cuda.get_current_stream().synchronize()
    return cp.asnumpy(out)


def same_bits(a, b):
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)])
def test_a_row_gives_the_same_bits_alone_and_in_batches_of_every_size(n, k):
    import cupy as cp

    from metrale.kernels import decode_gemv as dg

    rng = np.random.default_rng(n + k)
    w = cp.asarray(float32_to_bf16((rng.standard_normal((n, k)) * 0.02).astype(np.float32)))
    rows = float32_to_bf16(rng.standard_normal((300, k)).astype(np.float32))
    batch = tiled(cp.asarray(rows), w)
    for m in (1, 2, 7, 16, 17, 33, 64, 65, 129):  # the narrow tiling up to 64 rows, the wide one past
        assert same_bits(tiled(cp.asarray(rows[:m]), w), batch[:m]), m
    shuffled = np.random.default_rng(1).permutation(300)
    assert same_bits(tiled(cp.asarray(rows[shuffled]), w), batch[shuffled])
    # Decode batches through the decode GEMV, as many rows as it stages at this inner size.
    for m in (1, 8, 32):
        if dg.supports(m, k, dg.PLAIN):
            assert same_bits(decoded(cp.asarray(rows[:m]), w), batch[:m]), m
    assert dg.supports(1, k, dg.PLAIN)


@pytest.mark.parametrize("m", [1, 33, 300])
def test_the_product_matches_float64(m):
    import cupy as cp

    rng = np.random.default_rng(m)
    n, k = 1000, 2048
    x = float32_to_bf16(rng.standard_normal((m, k)).astype(np.float32))
    w = float32_to_bf16((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
    bias = rng.standard_normal(n).astype(np.float32)
    got = tiled(cp.asarray(x), cp.asarray(w), cp.asarray(bias))
    exact = bf16_to_float32(x).astype(np.float64) @ bf16_to_float32(w).astype(np.float64).T + bias
    assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()
    if m <= 32:
        assert same_bits(decoded(cp.asarray(x), cp.asarray(w), cp.asarray(bias)), got)
