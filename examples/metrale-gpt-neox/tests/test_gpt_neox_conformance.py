"""The GPT-NeoX family passes Metrale's conformance kit against transformers' GPTNeoXForCausalLM."""

from __future__ import annotations

from metrale.testing.hf import TransformersConformance
from transformers import GPTNeoXForCausalLM

from gpt_neox_checkpoints import gpt_neox_config


class TestParallelResidualConformance(TransformersConformance):
    """Parallel residual, rotary_pct 0.25, erf GELU (Pythia's layout)."""

    hf_model_class = GPTNeoXForCausalLM
    hf_config = staticmethod(lambda: gpt_neox_config("parallel"))


class TestSequentialResidualConformance(TransformersConformance):
    """Sequential residual, rotary_pct 1.0, tanh GELU (``gelu_new``)."""

    hf_model_class = GPTNeoXForCausalLM
    hf_config = staticmethod(lambda: gpt_neox_config("sequential"))
    checkpoint_seed = 1


class TestTiedUnbiasedConformance(TransformersConformance):
    """rotary_pct 0.5, no attention biases, tied embeddings, ``gelu_fast``."""

    hf_model_class = GPTNeoXForCausalLM
    hf_config = staticmethod(lambda: gpt_neox_config("tied_unbiased"))
    checkpoint_seed = 2
