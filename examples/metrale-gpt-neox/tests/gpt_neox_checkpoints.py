"""Tiny GPT-NeoX configs for the tests, one per combination of the options that change the
forward: residual form, rotary fraction, GELU form, attention biases and tied embeddings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BASE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
    max_position_embeddings=256, layer_norm_eps=1e-5, bos_token_id=0, eos_token_id=2,
)

#: name -> GPTNeoXConfig keyword arguments. Heads are 16 wide: rotary_pct 0.25 rotates 4 dims.
VARIANTS: dict[str, dict[str, Any]] = {
    # Pythia's layout: parallel residual, a quarter of each head rotated, erf GELU.
    "parallel": dict(use_parallel_residual=True, rotary_pct=0.25, hidden_act="gelu", rotary_emb_base=10000),
    # Sequential residual, the whole head rotated, tanh GELU.
    "sequential": dict(use_parallel_residual=False, rotary_pct=1.0, hidden_act="gelu_new", rotary_emb_base=10000),
    # Half the head rotated, no attention biases, tied embeddings, another base.
    "tied_unbiased": dict(use_parallel_residual=True, rotary_pct=0.5, hidden_act="gelu_fast", rotary_emb_base=5000,
                          attention_bias=False, tie_word_embeddings=True),
}


def gpt_neox_config(name: str, **overrides: Any) -> Any:
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(**{**BASE, **VARIANTS[name], **overrides})


def build_gpt_neox_checkpoint(name: str, path: Path, *, seed: int = 0, dtype: Any = None, **overrides: Any) -> Path:
    """A ``save_pretrained`` checkpoint of variant ``name`` with seeded, perturbed weights."""
    from metrale.testing.hf import build_hf_checkpoint
    from transformers import GPTNeoXForCausalLM

    return build_hf_checkpoint(GPTNeoXForCausalLM, gpt_neox_config(name, **overrides), path, seed=seed, dtype=dtype)
