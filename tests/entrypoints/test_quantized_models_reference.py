"""Whole quantized models on the cpu backend against transformers running the same quantized math
in float32 (each quantized matrix replaced by its dequantized value, each product's input quantized
under its scheme): online FP8 on the embedded dense model, compressed-tensors W4A16, W8A8 and FP8
dynamic Llama checkpoints written by compressed-tensors itself.

Where inputs are quantized, two float32 implementations round an input differently wherever it
lies within their float32 difference of a rounding boundary (one code apart); later layers then
attend to the changed position. Those checkpoints have one layer (the embedded dense model a few),
and at most 5 % of the positions may differ by such a step: which inputs lie that close depends on
the float32 orders of the BLAS kernels the machine's CPU gets."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_checks import held_out_ids, load, quantized_reference_bf16_rows


def check_against_transformers(source, quantized, ids, what, flips=False, **options):
    cpu = load(quantized, "cpu", **options).score(ids)
    rows = quantized_reference_bf16_rows(source, quantized, ids, cpu, options.get("quantization"), device="cpu",
                                         dtype="float32")
    exact = rows <= 1e-4
    print(f"{what}: largest error {rows.max():.3g} of the largest logit; {int((~exact).sum())} of {len(rows)} "
          "positions above 1e-4")
    if flips:
        assert exact.mean() >= 0.95 and rows.max() <= 5e-2, f"{what}: {rows.max():.3g}, {exact.mean():.3f}"
    else:
        assert exact.all(), f"{what}: {rows.max():.3g}"


def test_online_fp8_dense_matches_transformers_running_the_same_math():
    llm = load("tiny-dense", "cpu")
    path = llm.checkpoint.path
    check_against_transformers(path, path, held_out_ids(llm, 96), "tiny-dense fp8", flips=True, quantization="fp8")


@pytest.mark.parametrize("preset", ["W4A16", "W8A8", "FP8_DYNAMIC"])
def test_compressed_tensors_llama_matches_transformers_running_the_same_math(tmp_path, preset):
    pytest.importorskip("compressed_tensors")
    from transformers import LlamaConfig, LlamaForCausalLM

    from metrale.testing import quantized as tool
    from metrale.testing.hf import build_hf_checkpoint

    quantized_inputs = preset != "W4A16"
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=1 if quantized_inputs else 2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)
    source = build_hf_checkpoint(LlamaForCausalLM, config, tmp_path / "float", seed=4)
    folder = tool.write_compressed_checkpoint(source, tool.scheme(preset), tmp_path / preset.lower())
    ids = np.random.default_rng(4).integers(0, 256, 80).tolist()
    check_against_transformers(source, folder, ids, f"llama {preset}", flips=quantized_inputs)
