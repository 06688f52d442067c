"""The tensor-core prefill attention's host side (its kernel runs on the GPU only)."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.errors import KernelArgumentError
from metrale.kernels import attention_mma


def test_tiles_cover_every_row_once_and_never_cross_a_segment():
    starts = np.array([0, 200, 264, 265, 394], np.int32)
    tiles = attention_mma.query_tiles(starts)
    covered = np.concatenate([np.arange(first, first + count) for first, count in tiles])
    np.testing.assert_array_equal(covered, np.arange(394))
    assert (tiles[:, 1] <= attention_mma.BLOCK_ROWS).all()
    segment = np.searchsorted(starts, np.arange(394), side="right") - 1
    for first, count in tiles:
        assert segment[first] == segment[first + count - 1]


def test_supported_geometries():
    assert attention_mma.supports(32, 8, 128, 128)
    assert attention_mma.supports(14, 2, 64, 64)
    assert not attention_mma.supports(32, 8, 96, 96)
    assert attention_mma.supports(16, 16, 192, 128)  # MLA's expanded form
    assert attention_mma.supports(16, 2, 256, 256)
    assert not attention_mma.supports(16, 16, 128, 192)
    assert not attention_mma.supports(12, 8, 128, 128)  # heads not a multiple of the KV heads


def test_shared_memory_fits_one_block_of_an_h200():
    for head_dim, value_dim in attention_mma.HEAD_DIMS:
        assert attention_mma.shared_bytes(head_dim, value_dim) <= 227 * 1024
    # Two stages of 64 keys and values of 64 dims (rows padded to 72) hold the query staging.
    assert attention_mma.shared_bytes(64, 64) == 2 * 2 * 64 * 144


def test_the_source_is_specialised_per_head_size_and_soft_cap():
    placeholders = ("__HEAD_DIM__", "__VALUE_DIM__", "__BLOCK_KEYS__", "__SOFTCAP__")
    assert all(placeholder in attention_mma.KERNEL for placeholder in placeholders)
    source = attention_mma.kernel_source(192, 128, softcap=True)
    assert not any(placeholder in source for placeholder in placeholders)
    assert "#define HEAD_DIM 192" in source and "#define VALUE_DIM 128" in source and "#define SOFTCAP 1" in source
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in source
    # Without the PTX helpers, for the CPU emulation, which brings its own.
    assert "mma.sync" not in attention_mma.kernel_source(64, 64, with_instructions=False)


def test_unsupported_arguments_are_refused_before_any_launch():
    q = np.zeros((4, 32, 96), np.float32)
    cache = np.zeros((2, 16, 8, 96), np.uint16)
    with pytest.raises(KernelArgumentError, match="unsupported"):
        attention_mma.prefill_attention(q, cache, cache, np.zeros((1, 2), np.int32), np.zeros(4, np.int32),
                                        np.arange(4, dtype=np.int32), np.array([[0, 4]], np.int32), 1.0, None,
                                        np.zeros((4, 32 * 96), np.uint16))
