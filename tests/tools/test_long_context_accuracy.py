"""tools/sweeps/long_context_accuracy.py's float32 reference on the CPU: its attention (PyTorch's
SDPA over the repeated key and value heads, causal, no mask built) and its MLPs taken 8,192 tokens
at a time give transformers' own eager forward on a tiny grouped-query Llama."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "sweeps"))

import long_context_accuracy  # noqa: E402


def test_the_float32_reference_is_transformers_forward(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    prompt = torch.randint(0, 97, (40,)).tolist()
    eager = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = eager(torch.tensor([prompt]), logits_to_keep=1).logits[0, -1].numpy()

    long_context_accuracy.register_float32_attention()
    model = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                             attn_implementation=long_context_accuracy.FLOAT32_ATTENTION).eval()
    long_context_accuracy.chunk_mlps(model, tokens=16)  # 40 tokens: three pieces
    with torch.no_grad():
        got = model(torch.tensor([prompt]), logits_to_keep=1).logits[0, -1].numpy()
    assert abs(got - expected).max() <= 1e-5 * abs(expected).max()
