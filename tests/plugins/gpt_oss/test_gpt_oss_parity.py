"""The GPT-OSS family against transformers: logits of prompts past the sliding window and YaRN's
original context, greedy generation, cache continuity, speculation and prefix caching keeping the
greedy tokens, the clamps of the SwiGLU reached, LoRA on the attention against PEFT."""

from __future__ import annotations

import json

import numpy as np
import pytest

from metrale import LLM, LoRARequest, SamplingParams
from metrale.errors import AdapterError
from metrale.sequence import SequenceState
from metrale.testing import max_relative_error
from metrale.testing.hf import build_peft_adapter, hf_greedy, hf_reference_logits

TOLERANCE = 1e-4


def load(path, **options):
    return LLM(path, device="cpu", show_progress=False, **options)


def random_ids(length, seed, vocab=128):
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


@pytest.mark.parametrize("length", [1, 9, 40])
def test_score_matches_transformers(gpt_oss_checkpoint, length):
    ids = random_ids(length, length)
    llm = load(gpt_oss_checkpoint)
    assert llm.family.name == "gpt_oss"
    error = max_relative_error(llm.score(ids), hf_reference_logits(gpt_oss_checkpoint, ids))
    assert error <= TOLERANCE, f"relative error {error:.3g}"


def test_greedy_generation_matches_transformers(gpt_oss_checkpoint):
    prompt = random_ids(11, 99)
    ours = load(gpt_oss_checkpoint).generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert ours[0].token_ids == hf_greedy(gpt_oss_checkpoint, prompt, 24)


def test_the_checkpoints_exercise_what_they_should(gpt_oss_checkpoints):
    """Windows shorter than the prompts, sinks and biases that are not zero, and a SwiGLU whose
    clamps bind: in transformers' own run, the gate exceeds the limit and the up projection leaves
    [-limit, limit] at a good share of the values in every layer."""
    import torch
    from transformers import AutoModelForCausalLM

    path = gpt_oss_checkpoints["gpt_oss"]
    model = load(path).model
    assert model.config.layer_windows == (8, None, 8, None)
    assert model.config.rope.rope_type == "yarn" and model.config.rope.scaling["truncate"] is False
    assert load(gpt_oss_checkpoints["gpt_oss_mqa"]).model.config.layer_windows == (None, 8, 8, None)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    limit = reference.config.swiglu_limit
    seen = []
    for layer in reference.model.layers:
        assert layer.self_attn.sinks.abs().min() > 0 and layer.mlp.experts.gate_up_proj_bias.abs().min() > 0
        experts = layer.mlp.experts
        apply_gate = experts._apply_gate

        def recording(gate_up, apply_gate=apply_gate):
            seen.append(gate_up.detach().clone())
            return apply_gate(gate_up)

        experts._apply_gate = recording
    with torch.no_grad():
        reference(torch.tensor([random_ids(40, 7)]))
    assert seen, "transformers' experts never ran _apply_gate"
    gate = torch.cat([values[..., ::2].reshape(-1) for values in seen])
    up = torch.cat([values[..., 1::2].reshape(-1) for values in seen])
    assert 0.1 < float((gate > limit).float().mean()) < 0.9, "the gate's clamp binds too rarely or too often"
    assert 0.1 < float((up.abs() > limit).float().mean()) < 0.9, "the up projection's clamp binds too rarely or too often"


def test_prefill_then_decode_equals_score(gpt_oss_checkpoint):
    llm = load(gpt_oss_checkpoint, block_size=4)
    ids = random_ids(30, 5)
    scored = llm.score(ids)
    seq = SequenceState.from_prompt(ids[:3])
    rows = [llm.forward.prefill(ids[:3], seq)[0]]
    rows += [llm.forward.decode(t, seq)[0] for t in ids[3:]]
    error = max_relative_error(np.stack(rows), scored[2:])
    assert error <= 1e-5, f"relative error {error:.3g}"
    llm.cache.release(seq)


def test_ngram_speculation_keeps_the_greedy_tokens(gpt_oss_checkpoint):
    prompt = random_ids(6, 3) * 3
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = load(gpt_oss_checkpoint).generate(prompt, params)[0].token_ids
    speculative = load(gpt_oss_checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert speculative.generate(prompt, params)[0].token_ids == plain


def test_prefix_caching_keeps_the_greedy_tokens(gpt_oss_checkpoints):
    path = gpt_oss_checkpoints["gpt_oss"]
    shared = random_ids(21, 11)
    prompts = [shared + random_ids(5, 12), shared + random_ids(9, 13)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [hf_greedy(path, prompt, 12) for prompt in prompts]
    llm = load(path, enable_prefix_caching=True, block_size=4)
    first = llm.generate(prompts[:1], params)[0].token_ids
    second = llm.generate(prompts[1:], params)[0].token_ids  # its first 20 tokens' blocks are cached
    assert [first, second] == expected


def test_lora_on_the_attention_matches_peft(tmp_path, gpt_oss_checkpoints):
    import torch

    path = gpt_oss_checkpoints["gpt_oss"]
    peft = build_peft_adapter(path, tmp_path / "attention", seed=5, r=4, lora_alpha=8,
                              target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    ids = random_ids(20, 17)
    with torch.no_grad():
        expected = peft(torch.tensor([ids])).logits[0].numpy()
    llm = load(path, enable_lora=True)
    request = LoRARequest("attention", 1, str(tmp_path / "attention"))
    error = max_relative_error(llm.score(ids, lora_request=request), expected)
    assert error <= TOLERANCE, f"relative error {error:.3g}"
    assert max_relative_error(llm.score(ids), expected) > 100 * TOLERANCE, "the adapter changed nothing"


@pytest.mark.parametrize("target, match", [("experts", "routed experts"), ("router", "router")])
def test_lora_on_the_experts_or_the_router_is_refused(tmp_path, gpt_oss_checkpoints, target, match):
    path = gpt_oss_checkpoints["gpt_oss"]
    build_peft_adapter(path, tmp_path / "adapter", r=4, target_modules=["q_proj"])
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", target]
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    llm = load(path, enable_lora=True)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with pytest.raises(AdapterError, match=match):
        llm.generate(random_ids(5, 1), params, lora_request=LoRARequest(target, 1, str(tmp_path / "adapter")))
