"""Tiny random-weight Phi-3 checkpoints written by transformers (float32): a plain Phi-3 (GQA, a
sliding window shorter than the longest prompts) and a Phi-4-mini-like one (partial rotary 0.75,
tied embeddings, LongRoPE with original_max_position_embeddings=32 and
max_position_embeddings=128)."""

from __future__ import annotations

import numpy as np
import pytest

#: LongRoPE's pretraining context of the Phi-4-mini-like checkpoint: a ``max_model_len`` up to it
#: takes the short factors, one above it the long factors.
ORIGINAL_CONTEXT = 32
PHI3_BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def longrope_factors(seed: int, rotary_dim: int) -> dict[str, list[float]]:
    """Seeded short factors near 1 and long factors well above it, as LongRoPE's search finds them."""
    generator = np.random.default_rng(seed)
    return {"short_factor": (1.0 + 0.5 * generator.random(rotary_dim // 2)).round(4).tolist(),
            "long_factor": (1.5 + 6.0 * generator.random(rotary_dim // 2)).round(4).tolist()}


def phi3_configs():
    """(model class, config) of the two test checkpoints, by name."""
    from transformers import Phi3Config, Phi3ForCausalLM

    head_dim = PHI3_BASE["hidden_size"] // PHI3_BASE["num_attention_heads"]
    rotary_dim = int(head_dim * 0.75)
    return {
        "phi3": (Phi3ForCausalLM, Phi3Config(**PHI3_BASE, max_position_embeddings=256, sliding_window=16,
                                             rope_parameters={"rope_type": "default", "rope_theta": 5000.0})),
        "phi4_mini": (Phi3ForCausalLM, Phi3Config(
            **PHI3_BASE, max_position_embeddings=128, original_max_position_embeddings=ORIGINAL_CONTEXT,
            partial_rotary_factor=0.75, tie_word_embeddings=True,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, **longrope_factors(5, rotary_dim)})),
    }


@pytest.fixture(scope="session")
def phi3_checkpoints(tmp_path_factory):
    """One float32 checkpoint folder per entry of :func:`phi3_configs`."""
    from metrale.testing.hf import build_hf_checkpoint

    root = tmp_path_factory.mktemp("phi3")
    return {name: build_hf_checkpoint(cls, config, root / name, seed=60 + index)
            for index, (name, (cls, config)) in enumerate(phi3_configs().items())}


@pytest.fixture(params=["phi3", "phi4_mini"])
def phi3_checkpoint(request, phi3_checkpoints):
    return phi3_checkpoints[request.param]
