"""The chunked tensor-core gated delta rule's host side and its NumPy model of the kernel's steps
(bf16 operands included) against the float32 reference. The kernel runs in
test_gated_delta_chunked_emulated.py (its source on the CPU) and
tests/kernels/test_gated_delta_chunked_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.errors import KernelArgumentError
from metrale.kernels import gated_delta, gated_delta_chunked

#: Every segment length the kernel treats differently: one token, a partial chunk, a whole chunk,
#: one past it, several chunks with a partial last one, and an empty segment.
LENGTHS = (1, 63, 64, 65, 200, 0)


def prompt_case(rng, lengths, heads, key_dim, value_dim, decay=0.5):
    """Segments of ``lengths`` tokens with the layer's input statistics (unit keys, queries of
    norm ``d_k^-1/2``, ``g <= 0``, ``beta`` in (0, 1)) over distinct slots of non-zero states."""
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    tokens = int(starts[-1])
    k = rng.standard_normal((tokens, heads, key_dim)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q = rng.standard_normal((tokens, heads, key_dim)).astype(np.float32)
    q *= np.float32(key_dim**-0.5) / np.linalg.norm(q, axis=-1, keepdims=True)
    v = rng.standard_normal((tokens, heads, value_dim)).astype(np.float32)
    g = -rng.uniform(0.0, decay, (tokens, heads)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (tokens, heads)).astype(np.float32)
    state = (0.5 * rng.standard_normal((len(lengths) + 2, heads, key_dim, value_dim))).astype(np.float32)
    slots = rng.permutation(np.arange(1, len(lengths) + 2))[: len(lengths)].astype(np.int32)
    return q, k, v, g, beta, state, slots, starts


def rel_error(actual, expected):
    return float(np.abs(actual.astype(np.float64) - expected).max() / max(np.abs(expected).max(), 1e-30))


@pytest.mark.parametrize("key_dim, value_dim", [(128, 128), (64, 128)])
def test_the_model_of_the_kernel_matches_the_reference(key_dim, value_dim):
    """bf16 operands move outputs and states by a few thousandths of their largest magnitude."""
    q, k, v, g, beta, state, slots, starts = prompt_case(np.random.default_rng(key_dim), LENGTHS, 3, key_dim, value_dim)
    want_state, model_state = state.copy(), state.copy()
    expected = gated_delta.prompt_rule_reference(q, k, v, g, beta, want_state, slots, starts)
    out = gated_delta_chunked.chunked_prompt_rule_reference(q, k, v, g, beta, model_state, slots, starts)
    assert rel_error(out, expected) <= 1.5e-2
    assert rel_error(model_state, want_state) <= 1.5e-2
    assert rel_error(out, expected) > 0  # the roundings are there


def test_the_model_without_its_roundings_is_the_reference(monkeypatch):
    """The model's algebra (``V' = T R``, the decayed state update, the padded steps) is exactly
    the chunked form: with float32 operands they agree to float32 rounding."""
    monkeypatch.setattr(gated_delta_chunked, "_bf16_rounded", lambda x: np.asarray(x, dtype=np.float32))
    q, k, v, g, beta, state, slots, starts = prompt_case(np.random.default_rng(5), LENGTHS, 2, 16, 8)
    want_state, model_state = state.copy(), state.copy()
    expected = gated_delta.prompt_rule_reference(q, k, v, g, beta, want_state, slots, starts)
    out = gated_delta_chunked.chunked_prompt_rule_reference(q, k, v, g, beta, model_state, slots, starts)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(model_state, want_state, rtol=1e-4, atol=1e-5)


def test_slow_decays_carry_the_state_across_many_chunks():
    """Decays near 1 keep every earlier chunk's roundings in the state: 1,000 tokens, 16 chunks."""
    q, k, v, g, beta, state, slots, starts = prompt_case(np.random.default_rng(9), (1000,), 2, 64, 64, decay=0.01)
    want_state, model_state = state.copy(), state.copy()
    expected = gated_delta.prompt_rule_reference(q, k, v, g, beta, want_state, slots, starts)
    out = gated_delta_chunked.chunked_prompt_rule_reference(q, k, v, g, beta, model_state, slots, starts)
    assert rel_error(out, expected) <= 1.5e-2
    assert rel_error(model_state, want_state) <= 1.5e-2


def test_bf16_rounding_is_to_nearest_even():
    from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

    values = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    values[:3] = [1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -0.0]  # ties: down to even, up to even
    expected = bf16_to_float32(float32_to_bf16(values))
    np.testing.assert_array_equal(gated_delta_chunked._bf16_rounded(values), expected)


def test_supported_head_sizes():
    for key_dim in (64, 128):
        for value_dim in (64, 128):
            assert gated_delta_chunked.supports(key_dim, value_dim)
    assert not gated_delta_chunked.supports(96, 128)
    assert not gated_delta_chunked.supports(128, 256)
    assert not gated_delta_chunked.supports(256, 128)


def test_the_source_is_specialised_per_variant():
    for placeholder in ("__KEY_DIM__", "__VALUE_DIM__", "__COLUMNS__", "__SHARED_BYTES__"):
        assert placeholder in gated_delta_chunked.SOURCE
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in gated_delta_chunked.SOURCE
    assert "#include <cuda_bf16.h>" in gated_delta_chunked.SOURCE


def test_shared_memory_fits_a_hopper_block():
    # A 64 x 68 float32 tile is 17,408 bytes, a 64 x 136 bf16 tile as much.
    assert gated_delta_chunked.shared_bytes(128, 64) == 115_200
    assert gated_delta_chunked.shared_bytes(128, 32) == 92_672
    assert gated_delta_chunked.shared_bytes(64, 32) == 72_192
    for key_dim in gated_delta_chunked.HEAD_DIMS:
        for columns in gated_delta_chunked.COLUMNS_CHOICES:
            size = gated_delta_chunked.shared_bytes(key_dim, columns)
            assert 48 * 1024 < size <= 227 * 1024 and size % 16 == 0


def test_block_columns_spread_few_prompts_over_the_multiprocessors():
    assert gated_delta_chunked.block_columns(32, 128, 132) == 32  # one prompt, 32 heads: 64 blocks of 64 columns
    assert gated_delta_chunked.block_columns(96, 128, 132) == 64
    assert gated_delta_chunked.block_columns(200, 64, 132) == 64
    assert gated_delta_chunked.block_columns(16, 64, 132) == 32


def launch(q, v, columns=None, state=None, out=None):
    tokens, heads, key_dim = q.shape
    value_dim = v.shape[2]
    state = np.zeros((2, heads, key_dim, value_dim), np.float32) if state is None else state
    out = np.zeros(v.shape, np.float32) if out is None else out
    gated_delta_chunked.prompt_rule(q, q.copy(), v, np.zeros((tokens, heads), np.float32),
                                    np.zeros((tokens, heads), np.float32), state, np.array([1], np.int32),
                                    np.array([0, tokens], np.int32), out, columns=columns)


def test_unsupported_arguments_are_refused_before_any_launch():
    with pytest.raises(KernelArgumentError, match="unsupported"):
        launch(np.zeros((4, 2, 96), np.float32), np.zeros((4, 2, 128), np.float32))
    with pytest.raises(KernelArgumentError, match="unsupported"):
        launch(np.zeros((4, 2, 64), np.float32), np.zeros((4, 2, 64), np.float32), columns=128)
    with pytest.raises(KernelArgumentError, match="unsupported"):
        launch(np.zeros((4, 2, 64), np.float32), np.zeros((4, 2, 64), np.float32), columns=16)
    misaligned = np.zeros(4 * 2 * 64 * 64 + 1, np.float32)[1:].reshape(4, 2, 64, 64)
    with pytest.raises(KernelArgumentError, match="16-byte aligned"):
        launch(np.zeros((4, 2, 64), np.float32), np.zeros((4, 2, 64), np.float32), state=misaligned[:2])
    with pytest.raises(KernelArgumentError, match="shape"):
        launch(np.zeros((4, 2, 64), np.float32), np.zeros((3, 2, 64), np.float32))
