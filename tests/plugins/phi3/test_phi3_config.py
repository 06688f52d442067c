"""Phi-3's config.json read as transformers' ``Phi3Config`` reads it (defaults, the RoPE section's
rules, the sliding window), and wrong configs refused with a CheckpointError naming the file, the
field and the value -- before anything sized by the config is allocated."""

from __future__ import annotations

import copy
import json
import re
import shutil

import numpy as np
import pytest

from conftest import load_refused
from metrale.errors import CheckpointError
from metrale.plugins.phi3.config import Phi3Config

from .conftest import PHI3_BASE, longrope_factors

HUGE = 10**9
FACTORS = longrope_factors(9, 16)


def transformers_phi3(config: dict):
    from transformers import Phi3Config as HfPhi3Config

    return HfPhi3Config(**copy.deepcopy(config))


def transformers_inv_freq(hf, seq_len: int) -> tuple[np.ndarray, float]:
    """transformers' table of a Phi-3 model for a forward whose last position is ``seq_len - 1``."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    if hf.rope_parameters["rope_type"] == "default":
        inv_freq, factor = Phi3RotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf, None, seq_len=seq_len)
    return inv_freq.numpy(), float(factor)


READINGS = {
    "defaults": {},
    "default rope, theta in the section": {"rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}},
    "longrope, no top-level original (4096 wins over the section's)": {
        "max_position_embeddings": 8192, "rope_parameters": {"rope_type": "longrope", **FACTORS,
                                                             "original_max_position_embeddings": 32}},
    "legacy su": {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_theta": 1e4,
                  "rope_scaling": {"type": "su", **FACTORS}},
    "legacy yarn is longrope": {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                                "rope_scaling": {"rope_type": "yarn", "type": "yarn", **FACTORS}},
    "rope_scaling wins over rope_parameters": {
        "original_max_position_embeddings": 64, "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
        "rope_scaling": {"rope_type": "longrope", "rope_theta": 20000.0, **FACTORS}},
    "partial rotary (Phi-4-mini)": {
        "partial_rotary_factor": 0.75, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "longrope", **longrope_factors(2, 12)}},
    "explicit head_dim": {"head_dim": 32, "hidden_size": 64},
}


@pytest.mark.parametrize("case", READINGS)
def test_config_is_read_as_transformers_reads_it(case):
    config = {**PHI3_BASE, **READINGS[case]}
    ours, hf = Phi3Config.from_dict(copy.deepcopy(config)), transformers_phi3(config)
    decoder = ours.decoder
    assert decoder.max_position_embeddings == hf.max_position_embeddings
    assert ours.original_max_position_embeddings == hf.original_max_position_embeddings
    assert decoder.rms_norm_eps == hf.rms_norm_eps
    assert decoder.num_kv_heads == hf.num_key_value_heads
    assert decoder.tie_word_embeddings == hf.tie_word_embeddings
    assert decoder.sliding_window == hf.sliding_window
    assert decoder.head_dim == getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads)
    assert ours.rope.rope_type == hf.rope_parameters["rope_type"]
    for max_model_len in (8, 4096, 4097, decoder.max_position_embeddings):
        expected, factor = transformers_inv_freq(hf, max_model_len)
        actual = ours.rope.inverse_frequencies(max_model_len)
        assert actual.shape == expected.shape
        np.testing.assert_allclose(actual, expected, rtol=1e-6, err_msg=f"{case}, max_model_len={max_model_len}")
        assert ours.rope.attention_factor() == pytest.approx(factor, rel=1e-12)


def test_sliding_window_applies_to_every_layer_and_null_is_none():
    windowed = Phi3Config.from_dict({**PHI3_BASE, "sliding_window": 2047}).decoder
    assert windowed.layer_windows == (2047,) * PHI3_BASE["num_hidden_layers"]
    assert Phi3Config.from_dict({**PHI3_BASE, "sliding_window": None}).decoder.layer_windows == (None,) * 3


def test_no_biases_whatever_attention_bias_says():
    decoder = Phi3Config.from_dict({**PHI3_BASE, "attention_bias": True}).decoder
    assert not (decoder.qkv_bias or decoder.o_bias or decoder.mlp_bias or decoder.qk_norm)


@pytest.mark.parametrize("fields, said", [
    ({"hidden_act": "gelu_new"}, 'hidden_act is "gelu_new"; expected one of "silu"'),
    ({"hidden_act": None}, "hidden_act is null"),
    ({"head_dim": None}, "head_dim is null"),
    ({"original_max_position_embeddings": None}, "original_max_position_embeddings is null"),
    ({"original_max_position_embeddings": 4096.0}, "original_max_position_embeddings is 4096.0"),
    ({"max_position_embeddings": None}, "max_position_embeddings is null"),
    ({"rms_norm_eps": None}, "rms_norm_eps is null"),
    ({"sliding_window": 0}, "sliding_window is 0"),
    ({"sliding_window": "2047"}, 'sliding_window is "2047"'),
    ({"model_type": "phi"}, "model_type 'phi' is not 'phi3'"),
    ({"num_attention_heads": 3}, "num_attention_heads=3 is not a multiple of num_key_value_heads=2"),
    ({"vocab_size": None}, "lacks vocab_size"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "RoPE type 'linear' is not one Phi-3 serves"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE type 'dynamic' is not supported"),
    ({"rope_parameters": "longrope"}, 'rope_parameters is "longrope"'),
    ({"rope_scaling": ["su"]}, 'rope_scaling is ["su"]'),
    ({"rope_scaling": {"type": "su", "long_factor": FACTORS["long_factor"]}},
     "rope_scaling.short_factor is missing; longrope RoPE scaling needs 8 factors"),
    ({"rope_parameters": {"rope_type": "longrope", **FACTORS, "long_factor": [1.0] * 6}},
     "rope_parameters.long_factor has 6 entries; expected 8"),
    ({"partial_rotary_factor": 0.75, "rope_parameters": {"rope_type": "longrope", **FACTORS}},
     "rope_parameters.short_factor has 8 entries; expected 6 (rotary_dim / 2: head_dim 16 x partial_rotary_factor 0.75"),
])
def test_wrong_fields_are_refused_naming_the_field(fields, said):
    config = {**PHI3_BASE, **fields}
    with pytest.raises(CheckpointError, match="^" + re.escape("/ckpt/config.json") + ".*" + re.escape(said)):
        Phi3Config.from_dict(config, source="/ckpt/config.json")


def edited(source, folder, **fields):
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("field", ["hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size",
                                   "num_attention_heads"])
def test_huge_sizes_are_refused_before_any_allocation(tmp_path, phi3_checkpoints, warm_plugin_manager, field):
    fields = {field: HUGE, **({"num_key_value_heads": HUGE} if field == "num_attention_heads" else {})}
    load_refused(edited(phi3_checkpoints["phi3"], tmp_path / "ckpt", **fields), f"{field}={HUGE}", warm_plugin_manager)


@pytest.mark.parametrize("name, fields, match", [
    ("phi4_mini", {"num_key_value_heads": 4},
     r"qkv_proj.weight' has shape \[128, 64\], but config.json's num_attention_heads=4 num_key_value_heads=4"),
    ("phi3", {"head_dim": 8}, r"qkv_proj.weight' has shape \[128, 64\].*head_dim=8"),
    ("phi3", {"intermediate_size": 64},
     r"gate_up_proj.weight' has shape \[192, 64\], but config.json's intermediate_size=64"),
    ("phi4_mini", {"tie_word_embeddings": False}, "lm_head"),
    ("phi4_mini", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 5,
                                       "rope_theta": 1e4}}, r"rope_parameters.long_factor has 5 entries; expected 6"),
])
def test_configs_that_disagree_with_the_tensors_are_refused(tmp_path, phi3_checkpoints, warm_plugin_manager, name,
                                                            fields, match):
    load_refused(edited(phi3_checkpoints[name], tmp_path / "ckpt", **fields), match, warm_plugin_manager)
