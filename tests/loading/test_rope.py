"""metrale/loading/rope.py against transformers' own RoPE initialisers, and kernels/qkv_rope.py against NumPy.

The reference of ``inverse_frequencies`` / ``attention_factor`` is transformers'
``ROPE_INIT_FUNCTIONS`` (and a rotary-embedding class's ``compute_default_rope_parameters`` for the
``default`` type, which ROPE_INIT_FUNCTIONS lacks). The reference of ``rope_reference`` is a
complex-number rotation written here.
"""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest

from metrale.errors import CheckpointError
from metrale.kernels.qkv_rope import rope_reference
from metrale.loading.rope import RopeParameters, rope_parameters

RTOL = 1e-6  # inv_freq spans decades: compare element-wise, relative (float32 is ~6e-8)


def _hf_rope_of_config(config: dict, head_dim: int) -> tuple[np.ndarray, float]:
    """transformers' (inv_freq, attention_factor) for a config.json-like dict ``config``."""
    from transformers import GPTNeoXConfig, LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = copy.deepcopy(config)  # transformers edits the rope dict in place
    hf = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, **config)
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](hf, None)
    elif hf.rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
        # Llama's default initialiser ignores partial_rotary_factor; GPT-NeoX's honours it.
        from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

        hf = GPTNeoXConfig(hidden_size=head_dim * 4, num_attention_heads=4, **copy.deepcopy(config))
        inv_freq, factor = GPTNeoXRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        inv_freq, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    return inv_freq.numpy(), float(factor)


def _hf_rope(rope: dict, head_dim: int, max_positions: int) -> tuple[np.ndarray, float]:
    return _hf_rope_of_config({"max_position_embeddings": max_positions, "rope_parameters": rope}, head_dim)


def _assert_inv_freq(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.dtype == np.float32, f"{what}: dtype {actual.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    relative = np.abs(actual.astype(np.float64) - expected) / np.abs(expected.astype(np.float64))
    worst = float(np.abs(actual.astype(np.float64) - expected).max())
    assert relative.max() <= RTOL, f"{what}: max relative error {relative.max():.3g}, max abs error {worst:.3g}"


LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

CASES = {
    "default": ({"rope_type": "default", "rope_theta": 10000.0}, 64, 4096),
    "default-theta1e6": ({"rope_type": "default", "rope_theta": 1e6}, 128, 32768),
    "linear": ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, 64, 4096),
    "linear-2.5": ({"rope_type": "linear", "rope_theta": 5e5, "factor": 2.5}, 96, 4096),
    "llama3": (LLAMA3, 128, 131072),
    "llama3-small-context": ({**LLAMA3, "factor": 4.0, "original_max_position_embeddings": 512,
                              "low_freq_factor": 2.0, "high_freq_factor": 8.0}, 64, 4096),
    "yarn": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
              "original_max_position_embeddings": 1024}, 64, 4096),
    "yarn-mscale": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                     "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}, 64, 163840),
    "yarn-mscale-equal": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                           "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 0.707},
                          64, 163840),
    "yarn-mscale-only": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
                          "original_max_position_embeddings": 2048, "mscale": 0.8}, 64, 32768),
    "yarn-attention-factor": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 1024, "attention_factor": 0.85}, 64, 4096),
    "yarn-no-truncate": ({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024,
                          "truncate": False, "beta_fast": 16.0, "beta_slow": 2.0}, 64, 4096),
    "yarn-factor-from-lengths": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": None,
                                  "original_max_position_embeddings": 1024}, 64, 8192),
    "yarn-qwen-like": ({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                        "original_max_position_embeddings": 32768}, 128, 131072),
    # transformers fills a missing original_max_position_embeddings with max_position_embeddings.
    "yarn-no-original-length": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}, 64, 4096),
    "llama3-no-original-length": ({"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0}, 64, 2048),
}


@pytest.mark.parametrize("case", list(CASES))
def test_inverse_frequencies_and_attention_factor_match_transformers(case):
    rope, head_dim, max_positions = CASES[case]
    expected_inv, expected_factor = _hf_rope(rope, head_dim, max_positions)
    params = rope_parameters({"max_position_embeddings": max_positions, "rope_parameters": dict(rope)}, head_dim)
    assert params.rope_type == rope["rope_type"]
    assert params.rotary_dim == head_dim
    _assert_inv_freq(params.inverse_frequencies(), expected_inv, case)
    assert math.isclose(params.attention_factor(), expected_factor, rel_tol=1e-12), (
        f"{case}: attention factor {params.attention_factor()} != {expected_factor}"
    )


def test_the_scaled_cases_actually_scale():
    """Guards the comparison above: each scaled case differs from plain RoPE, and llama3 / yarn
    cover their interpolated, extrapolated and blended regions."""
    for case in ("linear", "llama3", "yarn", "yarn-no-truncate"):
        rope, head_dim, max_positions = CASES[case]
        plain, _ = _hf_rope({"rope_type": "default", "rope_theta": rope["rope_theta"]}, head_dim, max_positions)
        scaled, _ = _hf_rope(rope, head_dim, max_positions)
        ratio = plain / scaled
        factor = rope["factor"]
        kept = np.isclose(ratio, 1.0, rtol=1e-6)
        divided = np.isclose(ratio, factor, rtol=1e-6)
        if case == "linear":
            assert divided.all()
        else:
            blended = ~kept & ~divided
            assert kept.any() and divided.any() and blended.any(), f"{case}: ratios {ratio}"
    inv_a, _ = _hf_rope(CASES["yarn-no-truncate"][0], 64, 4096)
    inv_b, _ = _hf_rope({**CASES["yarn-no-truncate"][0], "truncate": True}, 64, 4096)
    assert not np.allclose(inv_a, inv_b, rtol=1e-6)
    assert CASES["yarn-mscale"][0]["mscale"] != CASES["yarn-mscale"][0]["mscale_all_dim"]


def test_truncate_changes_metrale_yarn_as_it_changes_transformers():
    rope, head_dim, max_positions = CASES["yarn-no-truncate"]
    for truncate in (False, True):
        expected, _ = _hf_rope({**rope, "truncate": truncate}, head_dim, max_positions)
        params = rope_parameters({"max_position_embeddings": max_positions,
                                  "rope_parameters": {**rope, "truncate": truncate}}, head_dim)
        _assert_inv_freq(params.inverse_frequencies(), expected, f"truncate={truncate}")


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_yarn_attention_factor_is_one_without_extension(factor):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor, "original_max_position_embeddings": 1024}
    _, expected = _hf_rope(rope, 64, 1024)
    params = rope_parameters({"max_position_embeddings": 1024, "rope_parameters": rope}, 64)
    assert params.attention_factor() == expected == 1.0


# ======================================================================== config styles (4.x / 5.x)

STYLE_CASES = {
    "default": (10000.0, None),
    "linear": (5e5, {"factor": 3.0}),
    "llama3": (5e5, {k: v for k, v in LLAMA3.items() if k not in ("rope_type", "rope_theta")}),
    "yarn": (1e6, {"factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 1.0, "mscale_all_dim": 0.5}),
}


def _same_parameters(a: RopeParameters, b: RopeParameters) -> None:
    assert (a.rope_type, a.theta, a.rotary_dim, a.max_position_embeddings) == (
        b.rope_type, b.theta, b.rotary_dim, b.max_position_embeddings
    )
    assert np.array_equal(a.inverse_frequencies(), b.inverse_frequencies())
    assert a.attention_factor() == b.attention_factor()


@pytest.mark.parametrize("rope_type", list(STYLE_CASES))
@pytest.mark.parametrize("type_key", ["type", "rope_type"])
def test_both_config_styles_normalise_to_the_same_parameters(rope_type, type_key):
    theta, scaling = STYLE_CASES[rope_type]
    head_dim, max_positions = 64, 16384
    new_style = {"max_position_embeddings": max_positions,
                 "rope_parameters": {"rope_type": rope_type, "rope_theta": theta, **(scaling or {})}}
    old_style = {"max_position_embeddings": max_positions, "rope_theta": theta}
    if scaling is not None:
        old_style["rope_scaling"] = {type_key: rope_type, **scaling}
    new = rope_parameters(new_style, head_dim)
    old = rope_parameters(old_style, head_dim)
    _same_parameters(new, old)
    assert new.rope_type == rope_type and new.theta == theta
    # ... and both are what transformers makes of either style.
    for style, config in (("4.x", old_style), ("5.x", new_style)):
        expected, expected_factor = _hf_rope_of_config(config, head_dim)
        _assert_inv_freq(new.inverse_frequencies(), expected, f"{style} {rope_type}")
        assert math.isclose(new.attention_factor(), expected_factor, rel_tol=1e-12)


def test_default_theta_and_type_when_the_config_has_none():
    params = rope_parameters({"max_position_embeddings": 2048}, 64)
    assert params.rope_type == "default" and params.theta == 10000.0 and params.rotary_dim == 64
    expected, _ = _hf_rope({"rope_type": "default", "rope_theta": 10000.0}, 64, 2048)
    _assert_inv_freq(params.inverse_frequencies(), expected, "no rope fields")


def test_rope_parameters_theta_wins_over_a_stale_top_level_one():
    params = rope_parameters({"rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 32)
    assert params.theta == 1e6


# ============================================================================ partial rotary factor


@pytest.mark.parametrize("rope_type", ["default", "linear", "yarn", "llama3"])
@pytest.mark.parametrize("where", ["rope_parameters", "top_level"])
def test_partial_rotary_factor_matches_transformers(rope_type, where):
    head_dim, partial, max_positions = 64, 0.25, 16384
    theta, scaling = STYLE_CASES[rope_type]
    rope = {"rope_type": rope_type, "rope_theta": theta, **(scaling or {})}
    if where == "rope_parameters":
        config = {"max_position_embeddings": max_positions, "rope_parameters": {**rope, "partial_rotary_factor": partial}}
    else:
        config = {"max_position_embeddings": max_positions, "rope_parameters": rope, "partial_rotary_factor": partial}
    expected, expected_factor = _hf_rope_of_config(config, head_dim)
    params = rope_parameters(config, head_dim)
    assert params.rotary_dim == 16
    assert expected.shape == (8,)
    _assert_inv_freq(params.inverse_frequencies(), expected, f"partial {rope_type}")
    assert math.isclose(params.attention_factor(), expected_factor, rel_tol=1e-12)


def test_default_partial_factor_applies_only_when_the_config_has_none():
    assert rope_parameters({}, 64, default_partial_factor=0.5).rotary_dim == 32
    assert rope_parameters({"partial_rotary_factor": 0.25}, 64, default_partial_factor=0.5).rotary_dim == 16
    assert rope_parameters({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}}, 64,
                           default_partial_factor=0.5).rotary_dim == 48
    # inv_freq of a partial rotation uses the rotary dim (not head_dim) as its denominator.
    inv = rope_parameters({"rope_theta": 10000.0}, 64, default_partial_factor=0.5).inverse_frequencies()
    expected = 1.0 / 10000.0 ** (np.arange(0, 32, 2, dtype=np.float64) / 32)
    assert np.max(np.abs(inv - expected) / expected) <= RTOL


# =================================================================================== refusals


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "mrope-unknown"])
def test_unsupported_rope_types_are_refused(rope_type):
    rope = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 1024,
            "short_factor": [1.0] * 32, "long_factor": [2.0] * 32}
    with pytest.raises(CheckpointError, match=rope_type):
        rope_parameters({"rope_parameters": rope, "max_position_embeddings": 4096}, 64)
    with pytest.raises(CheckpointError, match=rope_type):
        rope_parameters({"rope_theta": 10000.0, "rope_scaling": {"type": rope_type, "factor": 2.0}}, 64)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear"},
        {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192},
    ],
)
def test_missing_scaling_fields_are_refused(rope):
    with pytest.raises(CheckpointError):
        rope_parameters({"rope_parameters": rope, "max_position_embeddings": 4096}, 64)


def test_yarn_without_a_factor_or_the_lengths_to_derive_it_is_refused():
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": 1024}
    params = rope_parameters({"rope_parameters": rope}, 64)  # no max_position_embeddings
    with pytest.raises(CheckpointError, match="factor"):
        params.inverse_frequencies()
    with pytest.raises(CheckpointError, match="factor"):
        params.attention_factor()


@pytest.mark.parametrize(
    "head_dim, config",
    [
        (7, {}),
        (63, {"rope_theta": 10000.0}),
        (64, {"partial_rotary_factor": 0.3}),  # int(19.2) = 19
        (4, {"partial_rotary_factor": 0.25}),  # 1 rotary dim
        (80, {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.0125}}),  # 1 rotary dim
    ],
)
def test_odd_or_too_small_rotary_dimension_is_refused(head_dim, config):
    with pytest.raises(CheckpointError, match="rotary dimension"):
        rope_parameters(config, head_dim)


@pytest.mark.parametrize(
    "config, said",
    [
        ({"rope_parameters": "yarn"}, 'rope_parameters is "yarn"; expected a JSON object'),
        ({"rope_scaling": [{"type": "linear"}]}, "rope_scaling is [{"),
        ({"rope_scaling": {"type": "linear", "factor": "4"}}, 'rope_scaling.factor is "4"; expected a number'),
        ({"rope_parameters": {"rope_type": "linear", "factor": 0}}, "rope_parameters.factor is 0; expected a number > 0"),
        ({"rope_parameters": {"rope_type": ["yarn"]}}, 'rope_parameters.rope_type is ["yarn"]; expected a string'),
        ({"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": "4096"}},
         'rope_parameters.original_max_position_embeddings is "4096"; expected an int'),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": "32"}},
         'rope_parameters.beta_fast is "32"; expected a number'),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale": -1}},
         "rope_parameters.mscale is -1; expected a number >= 0.0"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": "1"}},
         'rope_parameters.attention_factor is "1"; expected a number'),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": None, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}}, "llama3 RoPE scaling needs 'low_freq_factor'"),
        ({"rope_theta": "10000"}, 'rope_theta is "10000"; expected a number'),
        ({"rope_theta": 0.5}, "rope_theta is 0.5; expected a number > 1"),
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor is 1.5; expected a number <= 1.0"),
        ({"max_position_embeddings": "4096"}, 'max_position_embeddings is "4096"; expected an int'),
    ],
)
def test_rope_fields_of_the_wrong_type_are_refused_naming_file_and_field(config, said):
    with pytest.raises(CheckpointError, match="^" + re.escape(f"/ckpt/config.json: {said}")):
        rope_parameters(config, 64, source="/ckpt/config.json")


# ============================================================================ kernels/qkv_rope.py


def _numpy_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, factor: float, interleaved: bool):
    """Each rotated pair as one complex number times ``factor * e^{i p w}``, in float64."""
    x = x.astype(np.float64)
    half = len(inv_freq)
    rotary = 2 * half
    # Angles in float32, the convention of transformers (fp32 positions times fp32 inv_freq).
    angles = (positions.astype(np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]).astype(np.float64)
    turn = factor * np.exp(1j * angles)[:, None, :]  # [T, 1, half]
    out = x.copy()
    if interleaved:
        z = (x[..., 0:rotary:2] + 1j * x[..., 1:rotary:2]) * turn
        out[..., 0:rotary:2], out[..., 1:rotary:2] = z.real, z.imag
    else:
        z = (x[..., :half] + 1j * x[..., half:rotary]) * turn
        out[..., :half], out[..., half:rotary] = z.real, z.imag
    return out


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("head_dim, rotary_dim", [(20, 12), (16, 16), (10, 2)])
@pytest.mark.parametrize("factor", [1.0, 1.25])
def test_rope_reference_rotates_like_numpy(interleaved, head_dim, rotary_dim, factor):
    rng = np.random.default_rng([head_dim, rotary_dim, int(interleaved), int(factor * 100)])
    positions = np.array([0, 1, 2, 5, 17, 100, 3, 4, 31, 255], dtype=np.int64)
    x = (rng.standard_normal((len(positions), 3, head_dim)) + 0.5).astype(np.float32)
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, rotary_dim, 2) / rotary_dim)).astype(np.float32)
    original = x.copy()
    actual = rope_reference(x, positions, inv_freq, factor, interleaved=interleaved)
    expected = _numpy_rope(x, positions, inv_freq, factor, interleaved)
    assert np.array_equal(x, original), "rope_reference modified its input"
    assert actual.shape == x.shape and actual.dtype == np.float32
    worst = float(np.abs(actual - expected).max())
    assert worst <= 1e-5 * float(np.abs(expected).max()), f"max abs error {worst:.3g}"
    # Dims past the rotary part pass through bit for bit.
    assert np.array_equal(actual[..., rotary_dim:], x[..., rotary_dim:])
    # Position 0 is the identity (times the attention factor) on the rotary dims.
    zero = np.abs(actual[0, :, :rotary_dim] - factor * x[0, :, :rotary_dim]).max()
    assert zero <= 1e-6, f"position 0: max abs error {zero:.3g}"


def test_half_split_and_interleaved_pairings_differ():
    """Guards the pairing test: the two layouts are not the same rotation of the same input."""
    rng = np.random.default_rng(17)
    x = rng.standard_normal((4, 2, 8)).astype(np.float32)
    positions = np.array([1, 2, 3, 9])
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)).astype(np.float32)
    half = rope_reference(x, positions, inv_freq, interleaved=False)
    pairs = rope_reference(x, positions, inv_freq, interleaved=True)
    assert np.abs(half - pairs).max() > 0.1


def test_rope_reference_preserves_pair_norms():
    rng = np.random.default_rng(23)
    x = rng.standard_normal((6, 4, 32)).astype(np.float32)
    positions = np.arange(1000, 1006)
    inv_freq = (1.0 / 5e5 ** (np.arange(0, 24, 2) / 24)).astype(np.float32)
    out = rope_reference(x, positions, inv_freq, interleaved=False)
    before = x[..., :12] ** 2 + x[..., 12:24] ** 2
    after = out[..., :12] ** 2 + out[..., 12:24] ** 2
    assert np.abs(before - after).max() <= 1e-5 * before.max(), f"max abs error {np.abs(before - after).max():.3g}"


@pytest.mark.parametrize("legacy", [
    {"rotary_emb_base": 10000, "rotary_pct": 0.25},  # Pythia
    {"rotary_emb_base": 500000, "rotary_pct": 0.5},
])
def test_legacy_gpt_neox_rope_keys_mean_what_transformers_makes_of_them(legacy):
    """A Pythia-style config.json as transformers' GPT-NeoX config reads it: its legacy keys end
    up in ``rope_parameters``, which the engine must compute alike from the raw file."""
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    head_dim = 64
    hf = GPTNeoXConfig(hidden_size=head_dim * 4, num_attention_heads=4, **legacy)
    expected, _ = GPTNeoXRotaryEmbedding.compute_default_rope_parameters(hf)
    ours = rope_parameters(legacy, head_dim)
    assert ours.rotary_dim == int(head_dim * legacy["rotary_pct"])
    np.testing.assert_allclose(ours.inverse_frequencies(), expected.numpy(), rtol=RTOL)


def test_llama3_rotation_at_128k_positions_matches_transformers():
    """Llama-3.1's scaled RoPE applied at positions up to 131,071 (angles past 10^5 radians in
    the fastest pair): Metrale's rotation of q and k, from its own inverse frequencies, against
    transformers' ``LlamaRotaryEmbedding`` and ``apply_rotary_pos_emb`` in float32."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, heads, max_positions = 128, 4, 131072
    config = {"max_position_embeddings": max_positions, "rope_parameters": dict(LLAMA3)}
    hf = LlamaConfig(hidden_size=head_dim * heads, num_attention_heads=heads, head_dim=head_dim, **copy.deepcopy(config))
    positions = np.array([0, 1, 8191, 8192, 32767, 65536, 100003, 131070, 131071], dtype=np.int64)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((len(positions), heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((len(positions), heads, head_dim)).astype(np.float32)
    rotary = LlamaRotaryEmbedding(hf)
    cos, sin = rotary(torch.from_numpy(q), torch.from_numpy(positions)[None])
    # transformers' layout: [batch, heads, rows, d].
    expected_q, expected_k = (t[0].transpose(0, 1).numpy() for t in apply_rotary_pos_emb(
        torch.from_numpy(q).transpose(0, 1)[None], torch.from_numpy(k).transpose(0, 1)[None], cos, sin))
    params = rope_parameters(copy.deepcopy(config), head_dim)
    inv_freq, factor = params.inverse_frequencies(), params.attention_factor()
    for ours, expected in ((rope_reference(q, positions, inv_freq, factor), expected_q),
                           (rope_reference(k, positions, inv_freq, factor), expected_k)):
        # float32 cos / sin of the same float32 angles: a few units of the last place.
        assert np.abs(ours - expected).max() <= 1e-5 * np.abs(expected).max()
    # The fastest pair turns through ~1.3e5 radians by the last position: the check is not vacuous.
    assert float(positions[-1] * inv_freq[0]) > 1e5
    plain = rope_reference(q, positions, rope_parameters(
        {"max_position_embeddings": max_positions, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
        head_dim).inverse_frequencies())
    assert np.abs(plain - expected_q).max() > 0.1 * np.abs(expected_q).max()  # the llama3 scaling matters there
