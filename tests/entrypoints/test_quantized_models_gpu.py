"""Quantized models on the cuda backend against the cpu backend running the same quantized math
(``-m gpu``): online FP8 on the three embedded families, Hugging Face block FP8 on DeepSeek-V3
(MLA and experts), a compressed-tensors W4A16 Llama; CUDA-graph decode gives the eager tokens."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_checks import (
    check_against_cpu_where_routing_agrees,
    check_calibrated,
    check_fp8_cache_against_cpu,
    check_tokens_part_only_at_near_ties,
    held_out_ids,
    load,
    quantized_reference_bf16_rows,
)

from metrale import SamplingParams
from metrale.kernels.quantized import QuantizedWeight

pytestmark = pytest.mark.gpu


def check_dense_against_cpu(path, ids, what, source, **options):
    """The quantized reference's own bf16 tolerance: the error's median and 99th percentile at most
    25 % above those of a bf16 run of the same quantized math in transformers (``source``: the
    full-precision checkpoint)."""
    cpu = load(path, "cpu", **options).score(ids)
    gpu_llm = load(path, "cuda", **options)
    assert isinstance(gpu_llm.model.layers[0].attention.qkv, QuantizedWeight)
    gpu = gpu_llm.score(ids)
    rows = np.abs(gpu - cpu).max(axis=1) / np.abs(cpu).max()
    check_calibrated(rows, quantized_reference_bf16_rows(source, path, ids, cpu, options.get("quantization")), what)


def test_online_fp8_tiny_dense_matches_the_cpu_backend():
    llm = load("tiny-dense", "cpu")
    check_dense_against_cpu(llm.checkpoint.path, held_out_ids(llm), "tiny-dense fp8", llm.checkpoint.path,
                            quantization="fp8")


@pytest.mark.parametrize("name", ["tiny-mla", "tiny-gdn"])
def test_online_fp8_moe_families_match_the_cpu_backend(name):
    llm = load(name, "cpu")
    check_against_cpu_where_routing_agrees(llm.checkpoint.path, held_out_ids(llm), f"{name} fp8",
                                           source=llm.checkpoint.path, quantization="fp8")


def test_block_fp8_deepseek_v3_matches_the_cpu_backend(tmp_path):
    from conftest import build_mla_checkpoint, mla_configs
    from metrale.testing.quantized import write_block_fp8_checkpoint

    cls, config = mla_configs()["deepseek_v3"]
    source = build_mla_checkpoint(cls, config, tmp_path / "float", seed=30)
    folder = write_block_fp8_checkpoint(source, tmp_path / "fp8")
    ids = np.random.default_rng(3).integers(0, 128, 256).tolist()
    check_against_cpu_where_routing_agrees(folder, ids, "deepseek-v3 block fp8", source=source)


def test_compressed_tensors_w4a16_llama_matches_the_cpu_backend(tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import LlamaConfig, LlamaForCausalLM

    from metrale.testing import quantized as tool
    from metrale.testing.hf import build_hf_checkpoint

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    source = build_hf_checkpoint(LlamaForCausalLM, config, tmp_path / "float", seed=4)
    folder = tool.write_compressed_checkpoint(source, tool.scheme("W4A16"), tmp_path / "w4a16")
    ids = np.random.default_rng(4).integers(0, 256, 300).tolist()
    check_dense_against_cpu(folder, ids, "llama w4a16", source)


@pytest.mark.parametrize("batch", [2, 10])
def test_graph_replayed_quantized_decode_gives_the_eager_tokens(batch):
    """Two rows take the quantized decode GEMV, ten the FP8 tensor-core product (FP8_TENSOR_CORE_MIN_ROWS)."""
    prompts = [[5, 9, 30, 2], list(range(40, 77))] + [list(range(3 * i, 3 * i + 5 + i)) for i in range(batch - 2)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eager = load("tiny-dense", "cuda", quantization="fp8", cuda_graphs=False).generate(prompts, params)
    graphed = load("tiny-dense", "cuda", quantization="fp8").generate(prompts, params)
    assert [o.token_ids for o in eager] == [o.token_ids for o in graphed]


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-gdn"])
def test_an_fp8_kv_cache_matches_the_cpu_backends(name):
    """The FP8 cache on the GPU (rows quantized after the bf16 RoPE kernel, attention over the
    codes) against the CPU's FP8 cache: bf16 tolerance."""
    llm = load(name, "cpu")
    ids = held_out_ids(llm)
    if name == "tiny-dense":
        check_dense_against_cpu_cache(llm.checkpoint.path, ids, name)
    else:
        check_against_cpu_where_routing_agrees(llm.checkpoint.path, ids, f"{name} fp8 cache", kv_cache_dtype="fp8")


def check_dense_against_cpu_cache(path, ids, what):
    cpu = load(path, "cpu", kv_cache_dtype="fp8").score(ids)
    gpu = load(path, "cuda", kv_cache_dtype="fp8").score(ids)
    rows = np.abs(gpu - cpu).max(axis=1) / np.abs(cpu).max()
    print(f"{what} fp8 cache: relative error {np.percentile(rows, 99):.3g} (99th percentile) / {rows.max():.3g} (max)")
    assert np.percentile(rows, 99) <= 2e-2 and rows.max() <= 5e-2


def test_an_fp8_kv_cache_decodes_in_graphs_as_eagerly_and_holds_twice_the_blocks():
    prompts = [[5, 9, 30, 2], list(range(40, 77))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eager = load("tiny-dense", "cuda", kv_cache_dtype="fp8", cuda_graphs=False).generate(prompts, params)
    # (A budget small enough that the blocks it holds, not max_model_len, bound the cache.)
    graphed_llm = load("tiny-dense", "cuda", kv_cache_dtype="fp8", memory_bytes=1 << 22)
    assert [o.token_ids for o in eager] == [o.token_ids for o in graphed_llm.generate(prompts, params)]
    bf16 = load("tiny-dense", "cuda", memory_bytes=1 << 22)
    # A byte a value and a float32 scale a token's head: 2 / (1 + 4 / d) the values of bf16's blocks
    # (1.94x at d = 128), less a block for rounding.
    head_dim = graphed_llm.model.config.head_dim
    ratio = 2 / (1 + 4 / head_dim)
    assert graphed_llm.cache.num_blocks >= ratio * bf16.cache.num_blocks - 2


def test_an_fp8_latent_cache_matches_the_cpu_backends_and_decodes_in_graphs_as_eagerly():
    """MLA's latents in FP8 on the GPU (rows quantized after the bf16 cache-write kernel, the
    CUDA-core latent attention over the codes, prompt rows over the gathered dequantized rows)
    against the CPU's FP8 cache; greedy tokens replayed from graphs as eagerly; the latent layers'
    cache arrays hold codes and a scale a slot."""
    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

    llm = load("tiny-mla", "cpu")
    check_fp8_cache_against_cpu(llm.checkpoint.path, held_out_ids(llm), "tiny-mla fp8 cache")
    prompts = [[5, 9, 30, 2], list(range(40, 77))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eager = load("tiny-mla", "cuda", kv_cache_dtype="fp8", cuda_graphs=False).generate(prompts, params)
    graphed = load("tiny-mla", "cuda", kv_cache_dtype="fp8")
    assert [o.token_ids for o in eager] == [o.token_ids for o in graphed.generate(prompts, params)]
    latents = [layer.latent for layer in graphed.cache.layers if hasattr(layer, "latent")]
    assert latents and all(isinstance(latent, Fp8CacheArray) and latent.codes.dtype == np.uint8 for latent in latents)


def test_an_fp8_latent_cache_of_deepseeks_geometry_takes_the_tensor_cores(tmp_path, monkeypatch):
    """A DeepSeek-V2 checkpoint of DeepSeek's attention geometry (16 heads, latent rows of 512 + 64
    values; dense MLPs) with an FP8 latent cache: decode steps take the tensor-core kernel over the codes, and
    the logits match the CPU's FP8 cache."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from conftest import MLA_BASE, MLA_FIELDS, build_mla_checkpoint
    from metrale.kernels import attention_latent_mma
    from metrale.kernels.kv_cache_fp8 import Fp8CacheArray

    fields = {**MLA_BASE, **MLA_FIELDS, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 16,
              "num_key_value_heads": 16, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32,
              "v_head_dim": 32, "first_k_dense_replace": 2}  # no routed experts: no routing flips
    config = DeepseekV2Config(**fields, q_lora_rank=None, n_shared_experts=1, topk_method="greedy")
    path = build_mla_checkpoint(DeepseekV2ForCausalLM, config, tmp_path / "deepseek", seed=41)
    launches = []
    launch = attention_latent_mma.latent_attention
    monkeypatch.setattr(attention_latent_mma, "latent_attention",
                        lambda q, latent, *a, **k: launches.append(type(latent)) or launch(q, latent, *a, **k))
    ids = np.random.default_rng(5).integers(0, 128, 256).tolist()
    bound = check_fp8_cache_against_cpu(path, ids, "deepseek-v2 geometry fp8 cache")
    # Decode steps: greedy tokens as the CPU's, or parting at a top-2 margin within twice the
    # logits' error bound (the two logits may move by it in opposite directions).
    prompts = [ids[:40], ids[100:107]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    cpu = load(path, "cpu", kv_cache_dtype="fp8")
    want = [o.token_ids for o in cpu.generate(prompts, params)]
    got = [o.token_ids for o in load(path, "cuda", kv_cache_dtype="fp8", cuda_graphs=False).generate(prompts, params)]
    assert Fp8CacheArray in launches
    check_tokens_part_only_at_near_ties(cpu, prompts, got, want, "deepseek-v2 geometry fp8 cache", margin=2 * bound)


def test_online_fp8_is_quantized_on_the_device_as_on_the_host():
    """The CUDA backend quantizes ``quantization="fp8"`` weights on the device: the same codes and
    scales as the host's :func:`~metrale.kernels.quantized.quantize_fp8_per_channel`, fused parts
    stacked along the rows, a rank's columns taken after the rows' scales."""
    from metrale.backends.cuda import CudaBackend
    from metrale.kernels.quantized import quantize_fp8_per_channel
    from metrale.loading.checkpoint import Checkpoint

    path = load("tiny-dense", "cpu").checkpoint.path
    checkpoint = Checkpoint(path, quantization="fp8")
    prefix = "model.layers.0.self_attn"
    parts = [(f"{prefix}.{p}_proj.weight", checkpoint.info(f"{prefix}.{p}_proj.weight").shape) for p in "qkv"]
    stacked = np.concatenate([checkpoint.stored_tensor(name) for name, _ in parts])
    assert CudaBackend._quantizes_online(checkpoint, parts)  # the device's path, not the host's
    backend = CudaBackend()
    for columns in (None, slice(0, stacked.shape[1] // 2)):
        got = backend.load_weight(checkpoint, *[(name, shape, None, columns) for name, shape in parts])
        want = quantize_fp8_per_channel(stacked)
        want_codes = want.codes if columns is None else want.codes[:, columns]
        assert np.array_equal(backend.xp.asnumpy(got.codes), want_codes)
        assert np.array_equal(backend.xp.asnumpy(got.scales), want.scales)
        assert got.shape == want_codes.shape and got.block == (1, want_codes.shape[1])
        assert got.activations == "fp8_token"
    backend.close()
