"""The OLMo-2 family against transformers on the CPU: logits, greedy generation, cache
continuity, n-gram speculation, prefix caching, and LoRA adapters against PEFT."""

from __future__ import annotations

import json
import shutil

import numpy as np
import olmo2_fixtures
import pytest

from metrale import LLM, LoRARequest, SamplingParams
from metrale.sequence import SequenceState
from metrale.testing import max_relative_error
from metrale.testing.hf import build_peft_adapter, hf_greedy, hf_reference_logits

olmo2_checkpoints = olmo2_fixtures.olmo2_checkpoints
olmo2_checkpoint = olmo2_fixtures.olmo2_checkpoint

TOLERANCE = 1e-4
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def load(path, **options):
    return LLM(path, device="cpu", show_progress=False, **options)


def random_ids(length, seed, vocab=128):
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


@pytest.mark.parametrize("length", [1, 9, 40])
def test_score_matches_transformers(olmo2_checkpoint, length):
    ids = random_ids(length, length)
    llm = load(olmo2_checkpoint)
    assert llm.family.name == "olmo2"
    error = max_relative_error(llm.score(ids), hf_reference_logits(olmo2_checkpoint, ids))
    assert error <= TOLERANCE, f"relative error {error:.3g}"


def test_greedy_generation_matches_transformers(olmo2_checkpoint):
    prompt = random_ids(11, 99)
    ours = load(olmo2_checkpoint).generate(prompt, GREEDY)
    assert ours[0].token_ids == hf_greedy(olmo2_checkpoint, prompt, GREEDY.max_tokens)


def test_the_variants_exercise_what_they_are_for(olmo2_checkpoints):
    """The ``bias`` variant has the q/k/v/o biases, a tied LM head and projections wider than the
    hidden size; the ``plain`` one none of them."""
    plain, bias = (load(olmo2_checkpoints[name]).model for name in ("plain", "bias"))
    attention = bias.layers[0].attention
    assert attention.qkv_bias is not None and attention.o_bias is not None and bias.ends.lm_head is bias.ends.embed
    assert bias.config.q_width == 128 > bias.config.hidden_size and bias.config.rope.rope_type == "llama3"
    assert plain.layers[0].attention.qkv_bias is None and plain.ends.lm_head is not plain.ends.embed
    assert plain.config.q_width == plain.config.hidden_size and plain.config.rope.rope_type == "default"


def test_the_biases_move_the_logits(olmo2_checkpoints, tmp_path):
    """Guards the parity of the ``bias`` variant: without its biases the logits differ well
    beyond the parity tolerance."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "no-biases"
    shutil.copytree(olmo2_checkpoints["bias"], folder)
    tensors = load_file(folder / "model.safetensors")
    save_file({name: np.zeros_like(value) if name.endswith(".bias") else value for name, value in tensors.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    ids = random_ids(20, 4)
    assert max_relative_error(load(folder).score(ids), load(olmo2_checkpoints["bias"]).score(ids)) > 100 * TOLERANCE


def test_prefill_then_decode_equals_score(olmo2_checkpoint):
    llm = load(olmo2_checkpoint, block_size=4)
    ids = random_ids(30, 5)
    scored = llm.score(ids)
    seq = SequenceState.from_prompt(ids[:3])
    try:
        rows = [llm.forward.prefill(ids[:3], seq)[0]]
        rows += [llm.forward.decode(t, seq)[0] for t in ids[3:]]
    finally:
        llm.cache.release(seq)
    error = max_relative_error(np.stack(rows), scored[2:])
    assert error <= 1e-5, f"relative error {error:.3g}"


def test_ngram_speculation_keeps_the_greedy_tokens(olmo2_checkpoint):
    prompt = random_ids(6, 3) * 3
    plain = load(olmo2_checkpoint).generate(prompt, GREEDY)[0].token_ids
    speculative = load(olmo2_checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert speculative.generate(prompt, GREEDY)[0].token_ids == plain


def test_prefix_caching_keeps_the_greedy_tokens(olmo2_checkpoint):
    """Prompts sharing a prefix of several blocks: the second reads the first's cached blocks and
    still continues as without the prefix cache."""
    shared = random_ids(13, 7)
    prompts = [shared + random_ids(5, 8), shared + random_ids(3, 9)]
    without = [load(olmo2_checkpoint, enable_prefix_caching=False, block_size=4).generate([p], GREEDY)[0]
               for p in prompts]
    llm = load(olmo2_checkpoint, enable_prefix_caching=True, block_size=4)
    first = llm.generate([prompts[0]], GREEDY)[0]
    second = llm.generate([prompts[1]], GREEDY)[0]
    assert second.num_cached_tokens >= 12, "the second prompt found no cached prefix"
    assert [first.token_ids, second.token_ids] == [o.token_ids for o in without]


def peft_logits(peft, tokens):
    import torch

    with torch.no_grad():
        return peft(torch.tensor([tokens])).logits[0].numpy()


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"],
                                     ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]],
                         ids=["q-v", "every-projection"])
def test_lora_matches_peft(olmo2_checkpoint, tmp_path, targets):
    """An adapter's logits are PEFT's (the q and k adapters' updates normalised by the
    whole-projection norms as transformers does) and its greedy tokens differ from the base's."""
    peft = build_peft_adapter(olmo2_checkpoint, tmp_path / "adapter", seed=5, r=8, lora_alpha=16,
                              target_modules=targets)
    prompt = random_ids(12, 11)
    request = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    with load(olmo2_checkpoint, enable_lora=True, max_lora_rank=8) as llm:
        adapted = llm.score(prompt, lora_request=request)
        base = llm.score(prompt)
        adapted_tokens = llm.generate(prompt, GREEDY, lora_request=request)[0].token_ids
        base_tokens = llm.generate(prompt, GREEDY)[0].token_ids
    expected = peft_logits(peft, prompt)
    assert max_relative_error(adapted, expected) <= TOLERANCE
    assert max_relative_error(base, expected) > 1e-2, "the adapter left the logits as they were"
    assert adapted_tokens != base_tokens


def test_a_transformers_4_style_rope_config_loads_alike(olmo2_checkpoints, tmp_path):
    """A config.json written by transformers 4.x (top-level rope_theta, rope_scaling) gives the
    same logits."""
    folder = tmp_path / "olmo2-4x"
    shutil.copytree(olmo2_checkpoints["bias"], folder)
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    (folder / "config.json").write_text(json.dumps(config))
    ids = random_ids(40, 9)
    assert max_relative_error(load(folder).score(ids), hf_reference_logits(olmo2_checkpoints["bias"], ids)) <= TOLERANCE
