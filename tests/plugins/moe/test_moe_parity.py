"""The MoE family (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers: logits of prompts longer
than Mixtral's sliding window, greedy generation, cache continuity, every layer kind."""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.errors import AdapterError
from metrale.sequence import SequenceState
from metrale.testing import max_relative_error
from metrale.testing.hf import hf_greedy, hf_reference_logits

TOLERANCE = 1e-4


def load(path, **options):
    return LLM(path, device="cpu", show_progress=False, **options)


def random_ids(length, seed, vocab=128):
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


@pytest.mark.parametrize("length", [1, 9, 40])
def test_score_matches_transformers(moe_checkpoint, length):
    ids = random_ids(length, length)
    llm = load(moe_checkpoint)
    assert llm.family.name == "moe"
    error = max_relative_error(llm.score(ids), hf_reference_logits(moe_checkpoint, ids))
    assert error <= TOLERANCE, f"relative error {error:.3g}"


def test_greedy_generation_matches_transformers(moe_checkpoint):
    prompt = random_ids(11, 99)
    ours = load(moe_checkpoint).generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert ours[0].token_ids == hf_greedy(moe_checkpoint, prompt, 24)


def test_every_layer_kind_is_exercised(moe_checkpoints):
    from metrale.layers.experts import SoftmaxMoe
    from metrale.layers.mlp import MlpWeights

    kinds = {name: [type(layer.feed_forward) for layer in load(path).model.layers]
             for name, path in moe_checkpoints.items()}
    assert kinds["qwen3_moe"] == [SoftmaxMoe, MlpWeights, SoftmaxMoe]  # mlp_only_layers=[1]
    assert kinds["qwen2_moe"] == [MlpWeights, SoftmaxMoe, MlpWeights]  # decoder_sparse_step=2
    assert kinds["mixtral"] == [SoftmaxMoe] * 3
    shared = load(moe_checkpoints["qwen2_moe"]).model.layers[1].feed_forward
    assert shared.shared is not None and shared.shared_gate is not None
    assert load(moe_checkpoints["mixtral"]).model.config.attention.layer_windows == (8, 8, 8)


def test_prefill_then_decode_equals_score(moe_checkpoint):
    llm = load(moe_checkpoint, block_size=4)
    ids = random_ids(30, 5)
    scored = llm.score(ids)
    seq = SequenceState.from_prompt(ids[:3])
    rows = [llm.forward.prefill(ids[:3], seq)[0]]
    rows += [llm.forward.decode(t, seq)[0] for t in ids[3:]]
    error = max_relative_error(np.stack(rows), scored[2:])
    assert error <= 1e-5, f"relative error {error:.3g}"
    llm.cache.release(seq)


def test_ngram_speculation_keeps_the_greedy_tokens(moe_checkpoint):
    prompt = random_ids(6, 3) * 3
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = load(moe_checkpoint).generate(prompt, params)[0].token_ids
    speculative = load(moe_checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert speculative.generate(prompt, params)[0].token_ids == plain


def test_lora_serves_the_attention_and_refuses_the_routed_experts(tmp_path, moe_checkpoints):
    """An adapter of the attention runs (and changes the tokens); one naming the experts or the
    router is refused with a typed error."""
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from metrale import LoRARequest

    path = moe_checkpoints["qwen3_moe"]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                           LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "attention")
    llm = load(path, enable_lora=True)
    prompt, params = random_ids(7, 1), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    base = llm.generate(prompt, params)[0].token_ids
    adapted = llm.generate(prompt, params, lora_request=LoRARequest("attention", 1, str(tmp_path / "attention")))
    assert adapted[0].token_ids != base
    for target, match in (("experts", "routed experts"), ("gate", "router")):
        folder = tmp_path / target
        model.save_pretrained(folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        config["target_modules"] = ["q_proj", "v_proj", target]
        (folder / "adapter_config.json").write_text(json.dumps(config))
        with pytest.raises(AdapterError, match=match):
            llm.generate(prompt, params, lora_request=LoRARequest(target, 2, str(folder)))
