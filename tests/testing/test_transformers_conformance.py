"""The ready-made transformers-backed conformance class, on a Llama config."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

from metrale.testing.hf import TransformersConformance


def tiny_llama() -> LlamaConfig:
    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)


class TestLlamaThroughTheReadyMadeClass(TransformersConformance):
    hf_model_class = LlamaForCausalLM
    hf_config = staticmethod(tiny_llama)
    prompt_lengths = (1, 9)
    chunk_sizes = (1, 4)
