"""Tiny random-weight OLMo-2 checkpoints written by transformers' ``save_pretrained``, and the
fixtures of the tests in this folder (each test module imports the fixtures it uses).

They live in a module of their own rather than a ``conftest.py``: conftest files outside a
package all import as the module ``conftest``, so a second one would take the place of
``tests/conftest.py`` for the test modules that import helpers from it.

Two variants: ``plain`` (no biases, separate LM head, the default RoPE) and ``bias`` (q/k/v/o
biases, tied embeddings, a ``head_dim`` that makes the projections wider than the hidden size,
llama3-scaled RoPE).
"""

from __future__ import annotations

from pathlib import Path

import pytest

OLMO2_BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
VARIANTS = ("plain", "bias")
#: The biases' share of the generic noise: at full size a constant bias, which the post-norms
#: then scale up, outweighs what the token adds in these tiny models and greedy decoding repeats
#: one token whatever the prompt (the engine checks need continuations that differ).
BIAS_SCALE = 0.25

# Folders already written this session, by (variant, dtype): every test module that imports the
# fixtures shares them.
_BUILT: dict[tuple[str, str], Path] = {}


def olmo2_configs() -> dict:
    """``{variant: (model class, config)}`` of the tiny OLMo-2 checkpoints."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return {
        "plain": (Olmo2ForCausalLM, Olmo2Config(**OLMO2_BASE)),
        "bias": (Olmo2ForCausalLM, Olmo2Config(**OLMO2_BASE, attention_bias=True, tie_word_embeddings=True,
                                               head_dim=32, rms_norm_eps=1e-6, rope_parameters=LLAMA3_ROPE)),
    }


def build_olmo2_checkpoint(model_class, config, path: Path, seed: int, dtype: str = "float32") -> Path:
    """``model_class(config)`` with weights perturbed (:func:`metrale.testing.hf.perturb_weights`)
    and its biases then scaled by :data:`BIAS_SCALE`, saved to ``path`` in ``dtype``."""
    import torch

    from metrale.testing.hf import perturb_weights

    torch.manual_seed(seed)
    model = model_class(config).eval()
    perturb_weights(model, seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.mul_(BIAS_SCALE)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    return path


def build_olmo2_checkpoints(root: Path, dtype: str = "float32") -> dict[str, Path]:
    """One checkpoint folder per variant under ``root`` (saved in ``dtype``), written once a session."""
    folders = {}
    for index, (name, (cls, config)) in enumerate(olmo2_configs().items()):
        key = (name, dtype)
        if key not in _BUILT:
            _BUILT[key] = build_olmo2_checkpoint(cls, config, root / f"{name}-{dtype}", 61 + index, dtype)
        folders[name] = _BUILT[key]
    return folders


@pytest.fixture(scope="session")
def olmo2_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The float32 checkpoint folder of each variant."""
    return build_olmo2_checkpoints(tmp_path_factory.mktemp("olmo2"))


@pytest.fixture(params=VARIANTS)
def olmo2_checkpoint(request, olmo2_checkpoints) -> Path:
    """Each variant's float32 checkpoint folder in turn."""
    return olmo2_checkpoints[request.param]
