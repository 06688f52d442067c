"""LongRoPE in metrale/loading/rope.py against transformers' ``ROPE_INIT_FUNCTIONS["longrope"]``:
the inverse frequencies of both sets of factors, chosen by max_model_len as transformers chooses by
sequence length, and the attention factor; malformed LongRoPE sections refused naming the field."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest

from metrale.errors import CheckpointError, ConfigError
from metrale.loading.rope import rope_parameters

from .conftest import longrope_factors

RTOL = 1e-6  # float32 inv_freq, compared element-wise (transformers' pow and NumPy's may differ by an ulp)
HEAD_DIM = 16


def transformers_longrope(config: dict, seq_len: int | None) -> tuple[np.ndarray, float]:
    """transformers' (inv_freq, attention factor) of LongRoPE for a config.json-like ``config``
    read by LlamaConfig (the generic reading), at sequence length ``seq_len``."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM, **copy.deepcopy(config))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](hf, None, seq_len=seq_len)
    return inv_freq.numpy(), float(factor)


def assert_inv_freq(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.dtype == np.float32 and actual.shape == expected.shape, f"{what}: {actual.dtype} {actual.shape}"
    relative = np.abs(actual.astype(np.float64) - expected) / np.abs(expected.astype(np.float64))
    assert relative.max() <= RTOL, f"{what}: max relative error {relative.max():.3g}"


def longrope(partial: float = 1.0, **fields) -> dict:
    rotary_dim = int(HEAD_DIM * partial)
    return {"rope_type": "longrope", "rope_theta": 10000.0, **longrope_factors(3, rotary_dim), **fields}


CASES = {
    "original in the section": {"max_position_embeddings": 4096, "rope_parameters": longrope(
        original_max_position_embeddings=1024)},
    "top-level original wins": {"max_position_embeddings": 4096, "original_max_position_embeddings": 512,
                                "rope_parameters": longrope(original_max_position_embeddings=1024)},
    "explicit factor": {"max_position_embeddings": 4096, "rope_parameters": longrope(
        factor=32.0, original_max_position_embeddings=1024)},
    "explicit attention factor": {"max_position_embeddings": 4096, "rope_parameters": longrope(
        attention_factor=1.3, original_max_position_embeddings=1024)},
    "factor below 1": {"max_position_embeddings": 512, "rope_parameters": longrope(
        original_max_position_embeddings=1024)},
    "no original: max_position_embeddings": {"max_position_embeddings": 2048, "rope_parameters": longrope()},
    "partial rotary": {"max_position_embeddings": 4096, "partial_rotary_factor": 0.5, "rope_parameters": longrope(
        0.5, original_max_position_embeddings=1024)},
    "legacy rope_scaling": {"max_position_embeddings": 4096, "rope_theta": 250000.0,
                            "original_max_position_embeddings": 2048,
                            "rope_scaling": {"type": "longrope", **longrope_factors(4, HEAD_DIM)}},
}


@pytest.mark.parametrize("case", CASES)
def test_both_regimes_and_the_attention_factor_match_transformers(case):
    config = CASES[case]
    ours = rope_parameters(copy.deepcopy(config), HEAD_DIM, longrope=True)
    original = ours.scaling["original_max_position_embeddings"]
    for max_model_len in (1, original, original + 1, 4 * original):
        expected, factor = transformers_longrope(config, max_model_len)
        assert_inv_freq(ours.inverse_frequencies(max_model_len), expected, f"{case}, max_model_len={max_model_len}")
        assert ours.uses_long_factors(max_model_len) == (max_model_len > original)
        assert ours.attention_factor() == pytest.approx(factor, rel=1e-12), case
    # transformers' table before any forward (no length): the short factors.
    expected, _ = transformers_longrope(config, None)
    assert_inv_freq(ours.inverse_frequencies(original), expected, f"{case}, no length")


def test_the_two_regimes_differ():
    ours = rope_parameters(CASES["original in the section"], HEAD_DIM, longrope=True)
    assert not np.allclose(ours.inverse_frequencies(1024), ours.inverse_frequencies(1025))


def test_longrope_is_refused_unless_the_caller_chooses_its_factors():
    config = CASES["original in the section"]
    with pytest.raises(CheckpointError, match=r"RoPE type 'longrope' is not supported \(supported: default, linear, "
                                              r"llama3, yarn\)"):
        rope_parameters(config, HEAD_DIM)
    assert "longrope" in str(pytest.raises(CheckpointError, rope_parameters,
                                           {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, HEAD_DIM,
                                           longrope=True).value)


def test_a_longrope_table_needs_the_length_it_serves():
    ours = rope_parameters(CASES["original in the section"], HEAD_DIM, longrope=True)
    with pytest.raises(ConfigError, match="max_model_len"):
        ours.inverse_frequencies()


def test_other_types_ignore_the_length():
    ours = rope_parameters({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, HEAD_DIM, longrope=True)
    assert np.array_equal(ours.inverse_frequencies(), ours.inverse_frequencies(10**6))


EIGHT = [1.0] * 8


@pytest.mark.parametrize("section, said", [
    ({"long_factor": EIGHT}, "rope_parameters.short_factor is missing; longrope RoPE scaling needs 8 factors"),
    ({"short_factor": EIGHT}, "rope_parameters.long_factor is missing"),
    ({"short_factor": None, "long_factor": EIGHT}, "rope_parameters.short_factor is missing"),
    ({"short_factor": [1.0] * 7, "long_factor": EIGHT},
     "rope_parameters.short_factor has 7 entries; expected 8 (rotary_dim / 2: head_dim 16 x partial_rotary_factor 1.0"),
    ({"short_factor": EIGHT, "long_factor": [1.0] * 16}, "rope_parameters.long_factor has 16 entries; expected 8"),
    ({"short_factor": EIGHT, "long_factor": "1.0"}, 'rope_parameters.long_factor is "1.0"; expected an array of 8'),
    ({"short_factor": EIGHT, "long_factor": {"0": 1.0}}, "rope_parameters.long_factor is {"),
    ({"short_factor": [1.0] * 7 + ["2"], "long_factor": EIGHT}, 'rope_parameters.short_factor[7] is "2"; expected a '
                                                                "number > 0"),
    ({"short_factor": EIGHT, "long_factor": [1.0, 0.0] + [1.0] * 6}, "rope_parameters.long_factor[1] is 0.0"),
    ({"short_factor": EIGHT, "long_factor": [1.0, -2.0] + [1.0] * 6}, "rope_parameters.long_factor[1] is -2.0"),
    ({"short_factor": [True] * 8, "long_factor": EIGHT}, "rope_parameters.short_factor[0] is true"),
    ({"short_factor": [10**400] * 8, "long_factor": EIGHT}, "rope_parameters.short_factor[0] is 1000"),
    ({"short_factor": EIGHT, "long_factor": [float("inf")] * 8}, "rope_parameters.long_factor[0] is Infinity"),
    ({"short_factor": EIGHT, "long_factor": EIGHT, "original_max_position_embeddings": 0},
     "rope_parameters.original_max_position_embeddings is 0"),
    ({"short_factor": EIGHT, "long_factor": EIGHT, "attention_factor": -1.0},
     "rope_parameters.attention_factor is -1.0"),
    ({"short_factor": EIGHT, "long_factor": EIGHT, "factor": "4"}, 'rope_parameters.factor is "4"'),
])
def test_malformed_longrope_sections_are_refused_naming_the_field(section, said):
    config = {"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                                                   "original_max_position_embeddings": 1024, **section}}
    with pytest.raises(CheckpointError, match="^" + re.escape(f"/ckpt/config.json: {said}")):
        rope_parameters(config, HEAD_DIM, source="/ckpt/config.json", longrope=True)


def test_the_attention_factor_s_inputs_are_checked_when_read():
    factors = {"short_factor": EIGHT, "long_factor": EIGHT}
    no_lengths = {"rope_parameters": {"rope_type": "longrope", **factors, "original_max_position_embeddings": 64}}
    with pytest.raises(CheckpointError, match="longrope RoPE needs 'factor', 'attention_factor' or "
                                              "max_position_embeddings"):
        rope_parameters(no_lengths, HEAD_DIM, longrope=True)
    tiny = {"max_position_embeddings": 8, "original_max_position_embeddings": 1,
            "rope_parameters": {"rope_type": "longrope", **factors}}
    with pytest.raises(CheckpointError, match="original_max_position_embeddings >= 2"):
        rope_parameters(tiny, HEAD_DIM, longrope=True)
    given = {**tiny, "rope_parameters": {**tiny["rope_parameters"], "attention_factor": 1.1}}
    assert rope_parameters(given, HEAD_DIM, longrope=True).attention_factor() == 1.1
