"""The Gemma family (Gemma-2, Gemma-3 text) against transformers: logits of prompts longer than
the sliding window, greedy generation, cache continuity, both layer kinds with their own RoPE,
prefix caching, n-gram speculation, LoRA against PEFT, and the embedding scale's rounding."""

from __future__ import annotations

import json
import shutil

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
def test_score_matches_transformers(gemma_checkpoint, length):
    ids = random_ids(length, length)
    llm = load(gemma_checkpoint)
    assert llm.family.name == "gemma"
    error = max_relative_error(llm.score(ids), hf_reference_logits(gemma_checkpoint, ids))
    assert error <= TOLERANCE, f"relative error {error:.3g}"


def test_greedy_generation_matches_transformers(gemma_checkpoint):
    prompt = random_ids(11, 99)
    ours = load(gemma_checkpoint).generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert ours[0].token_ids == hf_greedy(gemma_checkpoint, prompt, 24)


def test_every_layer_kind_is_exercised(gemma_checkpoints):
    gemma2 = load(gemma_checkpoints["gemma2"]).model
    assert [layer.geometry.sliding_window for layer in gemma2.layers] == [8, None, 8, None]
    assert {layer.geometry.softcap for layer in gemma2.layers} == {3.0}
    assert gemma2.layers[0].attention.q_norm is None
    gemma3 = load(gemma_checkpoints["gemma3"]).model
    windows = [layer.geometry.sliding_window for layer in gemma3.layers]
    assert windows == [8, None, 8, None]
    assert gemma3.layers[0].attention.q_norm is not None
    # The global layers' RoPE is linearly scaled by 8 and has theta 1e6; the local ones' 1e4, unscaled.
    local, overall = (np.asarray(gemma3.layers[i].geometry.inv_freq) for i in (0, 1))
    d = gemma3.config.head_dim
    np.testing.assert_allclose(local, 10_000.0 ** -(np.arange(0, d, 2) / d), rtol=1e-6)
    np.testing.assert_allclose(overall, 1_000_000.0 ** -(np.arange(0, d, 2) / d) / 8, rtol=1e-6)


def test_prefill_then_decode_equals_score(gemma_checkpoint):
    llm = load(gemma_checkpoint, block_size=4)
    ids = random_ids(30, 5)
    scored = llm.score(ids)
    seq = SequenceState.from_prompt(ids[:3])
    rows = [llm.forward.prefill(ids[:3], seq)[0]]
    rows += [llm.forward.decode(t, seq)[0] for t in ids[3:]]
    error = max_relative_error(np.stack(rows), scored[2:])
    assert error <= 1e-5, f"relative error {error:.3g}"
    llm.cache.release(seq)


def test_prefix_caching_keeps_the_tokens(gemma_checkpoint):
    shared = random_ids(24, 7)
    prompts = [shared + random_ids(5, 8), shared + random_ids(6, 9)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in load(gemma_checkpoint, enable_prefix_caching=False).generate(prompts, params)]
    cached_llm = load(gemma_checkpoint, enable_prefix_caching=True, block_size=4)
    cached_llm.generate(prompts[:1], params)  # the shared blocks are cached before the batch
    cached = [o.token_ids for o in cached_llm.generate(prompts, params)]
    assert cached == plain


def test_ngram_speculation_keeps_the_greedy_tokens(gemma_checkpoint):
    prompt = random_ids(6, 3) * 3
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = load(gemma_checkpoint).generate(prompt, params)[0].token_ids
    speculative = load(gemma_checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert speculative.generate(prompt, params)[0].token_ids == plain


def test_lora_on_every_projection_equals_peft(gemma_checkpoint, tmp_path):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = build_peft_adapter(gemma_checkpoint, tmp_path / "a", seed=3, r=8, lora_alpha=16, target_modules=targets)
    prompt = random_ids(12, 4)
    import torch

    with torch.no_grad():
        expected = peft(torch.tensor([prompt])).logits[0].numpy()
    with load(gemma_checkpoint, enable_lora=True, max_lora_rank=8, max_loras=1) as llm:
        got = llm.score(prompt, lora_request=LoRARequest("a", 1, tmp_path / "a"))
        base = llm.score(prompt)
    assert max_relative_error(got, expected) <= TOLERANCE
    assert max_relative_error(base, expected) > 1e-2  # the adapter changes the logits


def test_lora_replacing_embedding_rows_is_refused(gemma_checkpoints, tmp_path):
    path = gemma_checkpoints["gemma2"]
    build_peft_adapter(path, tmp_path / "a", seed=1, r=4, lora_alpha=8, target_modules=["q_proj"],
                       trainable_token_indices={"embed_tokens": [3, 5]})
    llm = load(path, enable_lora=True, max_lora_rank=4, max_loras=1)
    with pytest.raises(AdapterError, match="embed"):
        llm.generate(random_ids(5, 1), SamplingParams(max_tokens=2),
                     lora_request=LoRARequest("a", 1, str(tmp_path / "a")))


def test_gemma3_configs_in_the_older_rope_fields_load_alike(gemma_checkpoints, tmp_path):
    """``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``, as Gemma-3 checkpoints on the
    Hub write them, give the logits transformers computes from the same file."""
    folder = tmp_path / "legacy"
    shutil.copytree(gemma_checkpoints["gemma3"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters")
    config.pop("layer_types")
    config.update(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window_pattern=2,
                  rope_scaling={"rope_type": "linear", "factor": 8.0})
    (folder / "config.json").write_text(json.dumps(config))
    ids = random_ids(40, 2)
    got = load(folder).score(ids)
    assert max_relative_error(got, hf_reference_logits(folder, ids)) <= TOLERANCE
    assert max_relative_error(got, load(gemma_checkpoints["gemma3"]).score(ids)) <= 1e-6


@pytest.mark.parametrize("hidden, dtype", [(64, "BF16"), (3584, "BF16"), (3840, "F16"), (2304, "F32")])
def test_the_embedding_scale_is_rounded_as_torch_rounds_it(hidden, dtype):
    torch = pytest.importorskip("torch")
    from metrale.plugins.gemma.model import embedding_scale

    torch_dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[dtype]
    assert embedding_scale(hidden, dtype) == float(torch.tensor(hidden**0.5).to(torch_dtype))
