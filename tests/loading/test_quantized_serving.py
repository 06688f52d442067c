"""Quantized weights through the rest of the engine on the CPU: a rank's part of a weight is the
part of the whole quantized weight (tensor parallelism changes no weight-only result), speculation
and prefix caching give the tokens of a plain run, LoRA over quantized weights is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.errors import UnsupportedQuantizationError
from metrale.kernels.quantized import dequantize
from metrale.loading.checkpoint import Checkpoint
from metrale.models import embedded_model_path

IDS = list(range(3, 60))
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_an_online_rank_part_is_the_part_of_the_whole_rows_quantization():
    checkpoint = Checkpoint(embedded_model_path("tiny-dense"), quantization="fp8")
    name = "model.layers.0.mlp.down_proj.weight"
    whole = dequantize(checkpoint.quantized(name))
    part = dequantize(checkpoint.quantized(name, rows=slice(32, 96), columns=slice(160, 320)))
    assert np.array_equal(part, whole[32:96, 160:320])


def test_tensor_parallel_ranks_give_the_weight_only_logits_of_one_rank(tmp_path):
    pytest.importorskip("torch")
    from metrale.benchmarks.quantized import write_quantized_checkpoint

    folder = write_quantized_checkpoint(Path(embedded_model_path("tiny-dense")), tmp_path / "w4a16", "w4a16",
                                        device="cpu")
    with LLM(folder, device="cpu", show_progress=False) as one:
        single = one.score(IDS)
    with LLM(folder, device="cpu", tensor_parallel_size=2, show_progress=False) as two:
        split = two.score(IDS)
    assert np.abs(split - single).max() <= 1e-5 * np.abs(single).max()


@pytest.mark.parametrize("options", [
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    {"enable_prefix_caching": False, "overlap_scheduling": False},
])
def test_speculation_and_caching_keep_the_quantized_tokens(options):
    prompt = IDS + IDS[:20]  # a repeat for the n-gram drafter to find
    with LLM("tiny-dense", device="cpu", quantization="fp8", show_progress=False) as plain:
        expected = plain.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        again = plain.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # a prefix-cache hit
    with LLM("tiny-dense", device="cpu", quantization="fp8", show_progress=False, **options) as other:
        assert other.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected == again


def test_lora_over_quantized_weights_is_refused():
    with pytest.raises(UnsupportedQuantizationError, match="LoRA adapters over quantized weights"):
        LLM("tiny-dense", device="cpu", quantization="fp8", enable_lora=True, show_progress=False)


def test_block_fp8_deepseek_v3_serves_mla_and_experts_quantized(tmp_path):
    """DeepSeek-V3 as it ships, in 128x128-block FP8: the experts' stacks and the attention output
    are quantized products, ``kv_b_proj`` (absorbed into the attention on the host) and every other
    weight read their values dequantized as torch computes them from the stored codes and scales,
    nothing stored is left unread, and the model generates. (The tiny random model's logits move by
    a large share under FP8 rounding of its weights alone, so they are no test of the products;
    the products' math is tested against the tools on Llama and in the kernels' own tests.)"""
    pytest.importorskip("torch")
    from safetensors.torch import load_file

    from conftest import build_mla_checkpoint, mla_configs
    from metrale.kernels.quantized import QuantizedWeight
    from metrale.testing.quantized import write_block_fp8_checkpoint

    cls, config = mla_configs()["deepseek_v3"]
    source = build_mla_checkpoint(cls, config, tmp_path / "float", seed=31)
    folder = write_block_fp8_checkpoint(source, tmp_path / "fp8")
    stored = load_file(str(folder / "model.safetensors"))
    with LLM(folder, device="cpu", show_progress=False) as quantized:
        moe_layer = quantized.model.layers[1]
        assert isinstance(moe_layer.feed_forward.experts.gate_up, QuantizedWeight)
        assert isinstance(moe_layer.attention.o, QuantizedWeight)
        assert isinstance(moe_layer.attention.q_kv_a, QuantizedWeight)  # q_a_proj and kv_a_proj, stacked quantized
        for name in ("model.layers.1.self_attn.kv_b_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight"):
            codes, scale = stored[name].float(), stored[name[: -len(".weight")] + ".weight_scale_inv"]
            expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: codes.shape[0], : codes.shape[1]]
            assert np.array_equal(quantized.checkpoint.tensor(name), (codes * expanded).numpy()), name
        assert quantized.checkpoint.unconsumed() == []
        out = quantized.generate([IDS], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == GREEDY.max_tokens


def test_stacks_regrouped_from_several_tensors_stay_quantized():
    """GDN's gated attention regroups q_proj's rows per head around k_proj and v_proj, its linear
    attention stacks in_proj_qkvz and in_proj_ba, MLA stacks q_proj and kv_a_proj_with_mqa: with
    every part quantized the stacks stay quantized, each row the quantized row it came from."""
    from metrale.kernels.quantized import QuantizedWeight, quantize_fp8_per_channel

    with LLM("tiny-gdn", device="cpu", quantization="fp8", show_progress=False) as llm:
        checkpoint, config = llm.checkpoint, llm.model.config
        kinds = list(config.layer_types)
        index = kinds.index("full_attention")
        linear_layer = llm.model.layers[next(i for i, kind in enumerate(kinds) if kind != "full_attention")]
        qkv_gate, in_proj = llm.model.layers[index].mixer.qkv_gate, linear_layer.mixer.in_proj
        assert isinstance(qkv_gate, QuantizedWeight) and isinstance(in_proj, QuantizedWeight)
        prefix, d = f"model.layers.{index}.self_attn", config.head_dim
        q_and_gate = checkpoint.stored_tensor(f"{prefix}.q_proj.weight").reshape(config.num_heads, 2, d, -1)
        regrouped = np.concatenate([q_and_gate[:, 0].reshape(-1, config.hidden_size),
                                    checkpoint.stored_tensor(f"{prefix}.k_proj.weight"),
                                    checkpoint.stored_tensor(f"{prefix}.v_proj.weight"),
                                    q_and_gate[:, 1].reshape(-1, config.hidden_size)])
        assert np.array_equal(dequantize(qkv_gate), dequantize(quantize_fp8_per_channel(regrouped)))
    with LLM("tiny-mla", device="cpu", quantization="fp8", show_progress=False) as llm:
        assert isinstance(llm.model.layers[0].attention.q_kv_a, QuantizedWeight)


def test_fp8_codes_without_a_quantization_config_are_refused(tmp_path):
    """FP8 weights whose config.json lost its quantization_config: their scales would go unread and
    the codes be taken for the weights, so the checkpoint is refused, naming the tensor."""
    pytest.importorskip("torch")
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from metrale.testing.hf import build_hf_checkpoint
    from metrale.testing.quantized import write_block_fp8_checkpoint

    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    source = build_hf_checkpoint(LlamaForCausalLM, config, tmp_path / "float", seed=5)
    folder = write_block_fp8_checkpoint(source, tmp_path / "fp8")
    settings = json.loads((folder / "config.json").read_text())
    del settings["quantization_config"]
    (folder / "config.json").write_text(json.dumps(settings))
    with pytest.raises(UnsupportedQuantizationError, match=r"stored as F8_E4M3 codes.*quantization_config"):
        LLM(folder, device="cpu", show_progress=False)
