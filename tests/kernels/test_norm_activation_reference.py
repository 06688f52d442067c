"""The LayerNorm, GELU and partial-rotary references against PyTorch and transformers (CPU)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from metrale.kernels import activation, layernorm
from metrale.kernels import qkv_rope as rope

torch = pytest.importorskip("torch")

TOLERANCE = 1e-6  # relative to the largest magnitude of the expected values


def rel_error(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


# ------------------------------------------------------------------------------- LayerNorm


def torch_layer_norm(x, weight, bias, eps, dtype):
    as_tensor = lambda array: None if array is None else torch.from_numpy(array).to(dtype)  # noqa: E731
    return torch.nn.functional.layer_norm(as_tensor(x), (x.shape[-1],), as_tensor(weight), as_tensor(bias), eps).numpy()


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape, mean, spread", [((5, 2560), 0.0, 1.0), ((2, 3, 96), 40.0, 0.05), ((1, 7), -3.0, 2.0)])
def test_layernorm_reference_matches_torch(shape, mean, spread, with_bias):
    rng = np.random.default_rng([shape[-1], int(with_bias)])
    x = (mean + spread * rng.standard_normal(shape)).astype(np.float32)
    weight = (1 + 0.3 * rng.standard_normal(shape[-1])).astype(np.float32)
    bias = rng.standard_normal(shape[-1]).astype(np.float32) if with_bias else None
    actual = layernorm.layernorm_reference(x, weight, bias, 1e-5)
    assert actual.dtype == np.float32 and actual.shape == x.shape
    assert rel_error(actual, torch_layer_norm(x, weight, bias, 1e-5, torch.float64)) <= TOLERANCE
    # torch's float32 kernel loses half an ulp of the mean in x - mean: 2e-5 of the result for
    # rows of mean 40 and spread 0.05, far below the bf16 outputs' resolution, 1e-7 for centred rows.
    loss = 0.5 * np.spacing(np.float32(abs(mean))) / spread if mean else 0.0
    assert rel_error(actual, torch_layer_norm(x, weight, bias, 1e-5, torch.float32)) <= TOLERANCE + 4 * loss


def test_layernorm_residual_reference_adds_then_norms():
    rng = np.random.default_rng(1)
    x, residual = rng.standard_normal((4, 64)).astype(np.float32), rng.standard_normal((4, 64)).astype(np.float32)
    weight, bias = rng.standard_normal(64).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    normed, summed = layernorm.layernorm_residual_reference(x, residual, weight, bias, 1e-6)
    np.testing.assert_array_equal(summed, x + residual)
    assert rel_error(normed, torch_layer_norm(x + residual, weight, bias, 1e-6, torch.float32)) <= TOLERANCE
    normed, summed = layernorm.layernorm_residual_reference(x, None, weight, None, 1e-6)
    np.testing.assert_array_equal(summed, x)
    np.testing.assert_array_equal(normed, layernorm.layernorm_reference(x, weight, None, 1e-6))


# ------------------------------------------------------------------------------------ GELU


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_reference_matches_torch_on_a_million_values(approximate):
    rng = np.random.default_rng(2)
    x = (3 * rng.standard_normal((1000, 1000))).astype(np.float32)
    x[0, :8] = [0.0, -0.0, 1e-30, -1e-30, 60.0, -60.0, np.inf, -np.inf]
    start = time.perf_counter()
    actual = activation.gelu_reference(x, approximate)
    seconds = time.perf_counter() - start
    assert actual.dtype == np.float32 and actual.shape == x.shape
    finite = np.isfinite(x)
    expected = torch.nn.functional.gelu(torch.from_numpy(x), approximate=approximate).numpy()
    assert rel_error(actual[finite], expected[finite]) <= TOLERANCE
    # Elementwise against torch in float64 (its float32 1 + erf cancels for negative inputs: 3e-6
    # relative near -1.5). The reference evaluates in float64 too and rounds once; the float64
    # 1 + erf (1 + tanh) still cancels, to an ulp of 1 (2e-16) absolute, in the far negative tail.
    exact = torch.nn.functional.gelu(torch.from_numpy(x).double(), approximate=approximate).numpy()
    np.testing.assert_allclose(actual[finite], exact[finite], rtol=TOLERANCE, atol=1e-14)
    assert actual[0, 6] == np.inf and np.isnan(actual[0, 7])  # 0.5 * -inf * (1 + -1), NaN as in torch
    # About 0.12 s here for the erf form (one math.erf call per element), far less for tanh.
    assert seconds < 5.0, f"gelu_reference({approximate!r}) took {seconds:.2f} s for a million values"


def test_gelu_reference_erf_is_libm_exact():
    # Against math.erf directly in float64, where no float32 rounding hides an error.
    x = np.linspace(-9.0, 9.0, 20001)
    expected = np.array([0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x], np.float32)
    np.testing.assert_array_equal(activation.gelu_reference(x), expected)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_mul_reference_matches_torch(approximate):
    rng = np.random.default_rng(3)
    gate, up = (2 * rng.standard_normal((7, 300))).astype(np.float32), rng.standard_normal((7, 300)).astype(np.float32)
    expected = (torch.nn.functional.gelu(torch.from_numpy(gate), approximate=approximate) * torch.from_numpy(up)).numpy()
    assert rel_error(activation.gelu_and_mul_reference(gate, up, approximate), expected) <= TOLERANCE


# ---------------------------------------------------------------------------- partial rotary


def partial_rotary_case(head_dim, rotary_dim, seed):
    """qkv ``[6, (4 + 2 * 2) d]``, positions, distinct slots, ``inv_freq`` as transformers builds it."""
    rng = np.random.default_rng([head_dim, rotary_dim, seed])
    qkv = rng.standard_normal((6, 8 * head_dim)).astype(np.float32)
    positions = np.array([0, 1, 2, 17, 300, 4095], np.int32)
    slots = rng.choice(16, 6, replace=False).astype(np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / rotary_dim)).astype(np.float32)
    return qkv, positions, slots, inv_freq


def reference_q_and_k(qkv, positions, slots, inv_freq, head_dim, rotary_dim, interleaved, norms=(None, None)):
    """q ``[T, 4, d]`` and the stored k ``[T, 2, d]`` of :func:`rope.qkv_rope_cache_reference`."""
    k_cache = np.zeros((4, 4, 2, head_dim), np.float32)
    v_cache = np.zeros_like(k_cache)
    q = rope.qkv_rope_cache_reference(qkv, positions, slots, inv_freq, 1.0, 4, 2, head_dim, k_cache, v_cache, *norms,
                                      1e-6, 1.0, interleaved, rotary_dim=rotary_dim)
    np.testing.assert_array_equal(v_cache.reshape(-1, 2, head_dim)[slots], qkv[:, 6 * head_dim:].reshape(-1, 2, head_dim))
    return q, k_cache.reshape(-1, 2, head_dim)[slots]


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 16), (80, 32), (32, 32)])
def test_partial_rotary_reference_matches_gpt_neox(head_dim, rotary_dim, qk_norm):
    """Half-split pairs: GPT-NeoX (Pythia's rotary_pct), Phi, and, with the zero-centred q/k norm
    over the whole head before RoPE, Qwen3-Next's gated attention."""
    modeling = pytest.importorskip("transformers.models.gpt_neox.modeling_gpt_neox")

    qkv, positions, slots, inv_freq = partial_rotary_case(head_dim, rotary_dim, 0)
    rng = np.random.default_rng(7)
    norms = (0.3 * rng.standard_normal((2, head_dim))).astype(np.float32) if qk_norm else (None, None)
    q, k = reference_q_and_k(qkv, positions, slots, inv_freq, head_dim, rotary_dim, False, tuple(norms))

    def heads(start, count, norm):
        # [T, count, d] -> [1, count, T, d], the layout of apply_rotary_pos_emb's inputs.
        x = torch.from_numpy(qkv[:, start * head_dim : (start + count) * head_dim].reshape(-1, count, head_dim))
        if norm is not None:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + torch.from_numpy(norm))
        return x.transpose(0, 1)[None]

    # transformers: cos/sin [T, rotary_dim] from cat(freqs, freqs); apply_rotary_pos_emb rotates the
    # first rotary_dim dims and concatenates the rest back.
    freqs = torch.from_numpy(positions).float()[:, None] * torch.from_numpy(inv_freq)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    q_hf, k_hf = modeling.apply_rotary_pos_emb(heads(0, 4, norms[0]), heads(4, 2, norms[1]), emb.cos()[None], emb.sin()[None])
    q_hf, k_hf = q_hf[0].transpose(0, 1).numpy(), k_hf[0].transpose(0, 1).numpy()
    assert rel_error(q, q_hf) <= TOLERANCE
    assert rel_error(k, k_hf) <= TOLERANCE
    if rotary_dim < head_dim:
        assert rel_error(q[..., rotary_dim:], q_hf[..., rotary_dim:]) <= TOLERANCE  # passed through, normed or not


@pytest.mark.parametrize("head_dim, rotary_dim", [(256, 64), (32, 8), (16, 16)])
def test_partial_rotary_reference_matches_gpt_j(head_dim, rotary_dim):
    """Adjacent pairs (interleaved): GPT-J's ``rotary_dim``."""
    modeling = pytest.importorskip("transformers.models.gptj.modeling_gptj")

    qkv, positions, slots, inv_freq = partial_rotary_case(head_dim, rotary_dim, 1)
    q, k = reference_q_and_k(qkv, positions, slots, inv_freq, head_dim, rotary_dim, True)
    angles = torch.from_numpy(positions).float()[:, None] * torch.from_numpy(inv_freq)[None, :]
    sin, cos = torch.sin(angles)[None], torch.cos(angles)[None]

    def rotated(start, count):
        # GPT-J's layout [1, T, count, d]; its attention rotates the first rotary_dim dims only.
        x = torch.from_numpy(qkv[:, start * head_dim : (start + count) * head_dim].reshape(1, -1, count, head_dim))
        rot = modeling.apply_rotary_pos_emb(x[..., :rotary_dim], sin, cos)
        return torch.cat([rot, x[..., rotary_dim:]], dim=-1)[0].numpy()

    q_hf, k_hf = rotated(0, 4), rotated(4, 2)
    assert rel_error(q, q_hf) <= TOLERANCE
    assert rel_error(k, k_hf) <= TOLERANCE
    np.testing.assert_array_equal(q[..., rotary_dim:], q_hf[..., rotary_dim:])
