"""The conformance kit's transformers helpers: content-keyed model cache, weight noise that keeps
biases biases, and the guard against degenerate greedy output."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.testing.conformance import assert_varied_greedy
from metrale.testing.hf import build_hf_checkpoint, checkpoint_digest, hf_reference_logits, perturb_weights


def tiny_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, max_position_embeddings=64)
    return GPTNeoXForCausalLM, config


def test_a_checkpoint_rewritten_in_place_is_loaded_again(tmp_path, dense_checkpoints):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(dense_checkpoints["llama"], folder)
    ids = [1, 2, 3, 4]
    before = hf_reference_logits(folder, ids)
    digest = checkpoint_digest(folder)
    from transformers import LlamaForCausalLM

    from conftest import dense_configs

    _, config = dense_configs()["llama"]
    build_hf_checkpoint(LlamaForCausalLM, config, folder, seed=99)  # other weights, same path
    assert checkpoint_digest(folder) != digest
    after = hf_reference_logits(folder, ids)
    assert np.abs(after - before).max() > 1e-2


def test_weight_noise_keeps_layernorm_biases_near_zero():
    model_class, config = tiny_neox()
    model = model_class(config)
    perturb_weights(model, seed=3)
    parameters = dict(model.named_parameters())
    norm_weights = [p for n, p in parameters.items() if "layernorm" in n and n.endswith(".weight")]
    norm_biases = [p for n, p in parameters.items() if "layernorm" in n and n.endswith(".bias")]
    assert norm_weights and norm_biases
    assert all(abs(float(p.detach().mean()) - 1.0) < 0.15 for p in norm_weights)
    assert all(abs(float(p.detach().mean())) < 0.15 for p in norm_biases)


@pytest.mark.parametrize("continuations, degenerate", [
    ([[5] * 8] * 6, True),
    ([[5, 6] * 4] * 6, True),
    ([list(range(i, i + 8)) for i in range(6)], False),
])
def test_degenerate_greedy_output_fails_the_kit(continuations, degenerate):
    if degenerate:
        with pytest.raises(AssertionError, match="degenerate"):
            assert_varied_greedy(continuations, vocab_size=128)
    else:
        assert_varied_greedy(continuations, vocab_size=128)
