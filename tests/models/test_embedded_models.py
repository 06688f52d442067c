"""The checkpoints shipped in metrale/models: format, model cards, and parity with transformers."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.models import DEFAULT_MODEL, embedded_model_path, embedded_models
from metrale.testing import max_relative_error

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "checkpoints"
NAMES = ["tiny-dense", "tiny-mla", "tiny-gdn"]
ARCHITECTURES = {"tiny-dense": "LlamaForCausalLM", "tiny-mla": "DeepseekV3ForCausalLM", "tiny-gdn": "Qwen3NextForCausalLM"}
WINDOW = 256


@pytest.fixture(scope="module")
def held_out_tokens():
    """The held-out documents of the training corpus, tokenised as in training (at most 4096 tokens)."""
    sys.path.insert(0, str(TOOLS))
    try:
        import tiny_corpus
    finally:
        sys.path.remove(str(TOOLS))
    from tokenizers import Tokenizer

    _, held_out = tiny_corpus.extract()
    tokenizer = Tokenizer.from_file(str(embedded_model_path("tiny-dense") / "tokenizer.json"))
    eos = tokenizer.token_to_id(tiny_corpus.SEPARATOR)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(held_out, add_special_tokens=False):
        ids += [eos, *encoding.ids]
        if len(ids) >= 4096:
            break
    return ids[:4096]


def hf_model(name):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(embedded_model_path(name), dtype=torch.float32).eval()


def windowed_cross_entropy(logits_of, ids):
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        window = ids[start : start + WINDOW + 1]
        if len(window) < 2:
            break
        logits = np.asarray(logits_of(window[:-1]), dtype=np.float64)
        logits -= logits.max(axis=-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        total -= log_probs[np.arange(len(window) - 1), window[1:]].sum()
        count += len(window) - 1
    return total / count


def test_every_model_is_shipped_and_small():
    assert set(NAMES) <= set(embedded_models())
    assert DEFAULT_MODEL == "tiny-dense"
    for name in NAMES:
        folder = embedded_model_path(name)
        for file in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md"):
            assert (folder / file).is_file(), f"{name} lacks {file}"
        size = sum(f.stat().st_size for f in folder.iterdir())
        assert size <= 4_000_000, f"{name} takes {size} bytes"  # (tiny-mla and tiny-gdn with their MTP modules)


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_is_bf16_and_loads_with_transformers(name):
    from safetensors import safe_open

    folder = embedded_model_path(name)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[name]]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        float_dtypes = {str(handle.get_slice(k).get_dtype()) for k in handle.keys()} - {"F32"}
    assert float_dtypes == {"BF16"}
    model = hf_model(name)
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([[0, 5, 6, 7]])).logits
    assert logits.shape == (1, 4, config["vocab_size"]) and torch.isfinite(logits).all()


@pytest.mark.parametrize("name", NAMES)
def test_model_card_reports_perplexity_below_the_unigram_baseline(name):
    card = (embedded_model_path(name) / "README.md").read_text()
    assert "PSF License" in card and "standard library" in card
    perplexity = float(re.search(r"held-out perplexity[^|]*\|\s*\*\*([\d.]+)\*\*", card).group(1))
    unigram = float(re.search(r"unigram baseline perplexity[^|]*\|\s*([\d.]+)", card).group(1))
    assert perplexity < unigram / 5, f"{name}: perplexity {perplexity} vs unigram {unigram}"
    training = json.loads((embedded_model_path(name) / "training.json").read_text())
    assert math.isclose(training["held_out_perplexity"], perplexity, rel_tol=1e-3)


#: The embedded models whose families are built in: each must pass the same checks.
SERVED = ["tiny-dense", "tiny-mla", "tiny-gdn"]


@pytest.fixture(scope="module", params=SERVED)
def tiny(request):
    return request.param, LLM(request.param, device="cpu", show_progress=False)


def test_logits_match_transformers(tiny, held_out_tokens):
    import torch

    name, llm = tiny
    ids = held_out_tokens[:200]
    with torch.no_grad():
        expected = hf_model(name)(torch.tensor([ids])).logits[0].numpy()
    error = max_relative_error(llm.score(ids), expected)
    assert error <= 1e-3, f"{name}: relative error {error:.3g}"


def test_greedy_output_matches_transformers(tiny):
    from metrale.testing.hf import hf_greedy

    name, llm = tiny
    prompt = llm.encode("Return the")
    ours = llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
    assert ours.token_ids == hf_greedy(embedded_model_path(name), prompt, 32)


def test_held_out_perplexity_matches_transformers(tiny, held_out_tokens):
    import torch

    name, llm = tiny
    model = hf_model(name)

    def hf_logits(window):
        with torch.no_grad():
            return model(torch.tensor([window])).logits[0].numpy()

    ours = math.exp(windowed_cross_entropy(llm.score, held_out_tokens))
    theirs = math.exp(windowed_cross_entropy(hf_logits, held_out_tokens))
    assert abs(ours - theirs) / theirs <= 0.01, f"{name}: perplexity {ours:.3f} vs transformers {theirs:.3f}"
    card = json.loads((embedded_model_path(name) / "training.json").read_text())
    assert ours < card["unigram_perplexity"] / 5


def test_default_generation_reads_like_the_corpus(tiny):
    name, llm = tiny
    text = llm.generate("Return the", SamplingParams(max_tokens=24, temperature=0.0))[0].text
    words = re.findall(r"[A-Za-z]+", text)
    common = {"the", "a", "of", "to", "is", "and", "in", "or", "if", "object", "file", "value", "return", "string"}
    assert len(words) >= 3 and any(w.lower() in common for w in words), f"{name}: {text!r}"
