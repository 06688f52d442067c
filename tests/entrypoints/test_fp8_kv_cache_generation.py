"""``LLM(..., kv_cache_dtype="fp8")`` end to end on the embedded tiny models: it generates, its
logits stay close to the float32 cache's, prefix-cache hits give the tokens a miss gives, a
memory budget holds more blocks, and a checkpoint's static ``k_scale`` / ``v_scale`` are used."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.cache.spec import PagedKVSpec, PagedLatentSpec
from metrale.entrypoints.cli import main
from metrale.errors import UnsupportedQuantizationError
from metrale.models import embedded_model_path

MODELS = ("tiny-dense", "tiny-mla", "tiny-gdn")
#: Largest error of the teacher-forced logits against the float32 cache's, relative to their
#: largest magnitude. E4M3 keeps 3 mantissa bits, so each cached value rounds to within 2**-4 of
#: its (token, head) row's largest magnitude; attention averages those errors over the keys and
#: the projections after it mix them, and the tiny models measure 1-3%. 8% leaves room for other
#: prompts while still catching a scale applied twice or not at all (errors of order 1).
LOGITS_TOLERANCE = 0.08


def _prompt(seed: int, length: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 200, length)]


def _llm(model: str, kv_cache_dtype: str, **options) -> LLM:
    return LLM(model, device="cpu", kv_cache_dtype=kv_cache_dtype, show_progress=False, **options)


@pytest.mark.parametrize("model", MODELS)
def test_fp8_cache_logits_and_tokens_stay_close_to_the_float_cache(model, capsys):
    prompts = [_prompt(seed, 24 + 5 * seed) for seed in range(3)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    results = {}
    for dtype in ("auto", "fp8"):
        with _llm(model, dtype) as llm:
            results[dtype] = (llm.score(prompts[0]), [o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    (exact, exact_tokens), (fp8, fp8_tokens) = results["auto"], results["fp8"]
    relative = float(np.abs(fp8 - exact).max() / np.abs(exact).max())
    agreement = np.mean([a == b for left, right in zip(exact_tokens, fp8_tokens) for a, b in zip(left, right)])
    with capsys.disabled():
        print(f"\n{model}: fp8 cache logits relative error {relative:.4f}, greedy agreement {agreement:.2f}")
    assert np.isfinite(fp8).all()
    assert relative < LOGITS_TOLERANCE
    assert all(len(tokens) == 16 for tokens in fp8_tokens)
    # Greedy decoding of random tiny models meets near ties, where a perturbed cache may choose
    # the other token; the first token of each prompt follows logits checked above.
    assert [tokens[0] for tokens in fp8_tokens] == [tokens[0] for tokens in exact_tokens]


@pytest.mark.parametrize("model", MODELS)
def test_a_prefix_cache_hit_gives_the_tokens_of_a_miss(model):
    prompt = _prompt(7, 45)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    # Prompts in chunks of 8 tokens: the GDN family snapshots its recurrent states where chunks end.
    with _llm(model, "fp8", block_size=4, max_num_batched_tokens=8, enable_prefix_caching=False) as llm:
        uncached = llm.generate([prompt], params)[0]
    with _llm(model, "fp8", block_size=4, max_num_batched_tokens=8) as llm:
        miss = llm.generate([prompt], params)[0]
        hit = llm.generate([prompt + [5, 6]], params)[0]
        again = llm.generate([prompt], params)[0]
    assert miss.num_cached_tokens == 0 and hit.num_cached_tokens >= 32 and again.num_cached_tokens >= 32
    assert miss.outputs[0].token_ids == uncached.outputs[0].token_ids == again.outputs[0].token_ids


def _bytes_per_token(spec, fp8: bool) -> int:
    total = 0
    for layer in spec.layers:
        if isinstance(layer, PagedKVSpec):
            heads = layer.num_kv_heads
            total += 2 * heads * layer.head_dim * 1 + 2 * heads * 4 if fp8 else 2 * heads * layer.head_dim * 4
        elif isinstance(layer, PagedLatentSpec):
            total += layer.width + 4 if fp8 else layer.width * 4
    return total


@pytest.mark.parametrize("model", MODELS)
def test_a_memory_budget_holds_more_fp8_blocks(model):
    budget, block = 1 << 21, 16
    blocks = {}
    for dtype in ("auto", "fp8"):
        with _llm(model, dtype, memory_bytes=budget, block_size=block, enable_prefix_caching=False) as llm:
            spec, cache = llm.cache.spec, llm.cache
            states = (cache.state_slots.num_slots + 1) * spec.state_bytes_per_slot() if cache.state_slots else 0
            expected = (budget - states) // (block * _bytes_per_token(spec, dtype == "fp8")) - 1
            assert cache.num_blocks == expected
            blocks[dtype] = cache.num_blocks
    # One byte per value instead of four, plus a float32 scale per token and head.
    assert blocks["fp8"] > 3 * blocks["auto"]


def test_static_checkpoint_scales_are_used_and_consumed(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "tiny-dense-kv-scales"
    shutil.copytree(embedded_model_path("tiny-dense"), folder)
    tensors = load_file(folder / "model.safetensors")
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    for index in range(layers):
        attention = f"model.layers.{index}.self_attn"
        tensors[f"{attention}.k_scale"] = torch.tensor(0.02 * (index + 1), dtype=torch.float32)
        # Some exports keep the value scale on v_proj.
        tensors[f"{attention}.v_proj.v_scale"] = torch.tensor([0.03], dtype=torch.float32)
    save_file(tensors, folder / "model.safetensors")
    prompt = _prompt(3, 30)
    for dtype in ("auto", "fp8"):
        with _llm(str(folder), dtype) as llm:
            assert llm.checkpoint.unconsumed() == []
            layer = llm.cache.layers[1]
            if dtype == "fp8":
                assert (layer.k.static_scale, layer.v.static_scale) == (pytest.approx(0.04), pytest.approx(0.03))
                llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0))
                # Every written slot and head carries the static scale (unwritten ones keep 1).
                written = layer.k.scales != 1
                assert written.any(axis=-1).sum() >= len(prompt) and np.all(layer.k.scales[written] == np.float32(0.04))
            else:
                assert layer.k.dtype == np.float32


def test_the_cli_offers_kv_cache_dtype(capsys):
    for command in (["generate", "--help"], ["serve", "--help"]):
        with pytest.raises(SystemExit):
            main(command)
        assert "--kv-cache-dtype" in capsys.readouterr().out


def test_bad_kv_cache_dtypes_raise_before_loading():
    for value in ("fp8_e5m2", "int8"):
        with pytest.raises(UnsupportedQuantizationError, match="fp8_e4m3"):
            _llm("tiny-dense", value)
