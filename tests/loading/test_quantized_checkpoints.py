"""Quantized checkpoints load as the producing tool wrote them (CPU).

Tiny float32 models are quantized by compressed-tensors itself (its presets, its min-max
``calculate_qparams`` and its compressors, as llm-compressor does without calibration data) and
in Hugging Face's block-wise FP8 format (torch's ``float8_e4m3fn``). Per scheme: the weights
Metrale dequantizes equal the tool's own decompression, Metrale's logits equal a float32
reference of the same quantized math, and greedy generation agrees with it.

The references: for FP8 inputs, transformers run by compressed-tensors' own fake-quantized
forward. compressed-tensors' dynamic INT8 input scale is ``amax / 127.5`` (its range is
[-128, 127]); Metrale, as vLLM, uses ``amax / 127`` (symmetric [-127, 127]), so the W8A8 reference
is transformers with the tool's dequantized weights and inputs quantized by that documented rule
(:func:`int8_per_token`), and the tool's own forward is only required to be close.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from metrale.entrypoints.llm import LLM  # noqa: E402
from metrale.errors import CheckpointError, QuantizationError, UnsupportedQuantizationError  # noqa: E402
from metrale.kernels.quantized import QuantizedWeight, dequantize  # noqa: E402
from metrale.loading.checkpoint import Checkpoint  # noqa: E402
from metrale.params import SamplingParams  # noqa: E402
from metrale.testing import quantized as tool  # noqa: E402
from metrale.testing.hf import build_hf_checkpoint, hf_greedy, hf_reference_logits  # noqa: E402

PROMPT = [3, 17, 250, 9, 77, 120, 5, 64, 31, 2]
GREEDY_TOKENS = 4
#: Metrale's logits against a reference of the same quantized math, relative to the largest logit.
LOGIT_TOLERANCE = 1e-4
#: Metrale's dequantized weights against the tool's, relative to the largest weight.
WEIGHT_TOLERANCE = 1e-6

#: (preset, weight-argument overrides): every compressed-tensors scheme needing no calibration.
LLAMA_SCHEMES = {
    "FP8_DYNAMIC": ("FP8_DYNAMIC", {}),
    "FP8_BLOCK": ("FP8_BLOCK", {}),
    "W4A16": ("W4A16", {}),
    "W4A16_ASYM": ("W4A16_ASYM", {}),
    "W8A16": ("W8A16", {}),
    "W8A8": ("W8A8", {}),
    "W8A16_ASYM": ("W8A16", {"symmetric": False}),
    "W4A16_CHANNEL": ("W4A16", {"strategy": "channel", "group_size": None}),
    "W4A16_g32": ("W4A16", {"group_size": 32}),
}
#: Weight-only schemes on DeepSeek-V2 (MLA, shared and routed experts); groups of 16 columns
#: divide every input width of the tiny model (128, 48, 32).
DEEPSEEK_SCHEMES = {
    "W4A16_g16": ("W4A16", {"group_size": 16}),
    "W4A16_ASYM_g16": ("W4A16_ASYM", {"group_size": 16}),
    "W8A16_g16": ("W8A16", {"group_size": 16}),
}
#: The W8A8 logits against the INT8-input reference: an INT8 code of an input that sits at a
#: rounding tie in one float32 summation order and not in the other moves by one step (a relative
#: change of 1/127 of that input), so independent float32 implementations differ by such flips;
#: the bound stays well below the distance to the tool's own forward (scale amax / 127.5) and to
#: the same weights with unquantized inputs.
INT8_INPUT_LOGIT_TOLERANCE = 1e-2


def relative(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(np.asarray(actual) - np.asarray(expected)).max() / np.abs(np.asarray(expected)).max())


def int8_per_token(x):
    """Metrale's documented dynamic INT8 input rule: per row ``scale = max |x| / 127``, values
    rounded half to even and clamped to [-127, 127]."""
    scale = (x.abs().amax(-1, keepdim=True) / 127.0).clamp_min(1e-12)
    return torch.round(x / scale).clamp(-127, 127) * scale


def metrale_greedy(llm, prompt, tokens=GREEDY_TOKENS):
    return llm.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))[0].token_ids


def torch_greedy(model, prompt, tokens=GREEDY_TOKENS):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


# ------------------------------------------------------------------------------ checkpoints


@pytest.fixture(scope="module")
def llama_full_precision(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    # Every matrix dimension a multiple of 128: the tool compresses 128x128 blocks and groups of 128.
    return build_hf_checkpoint(LlamaForCausalLM, config, tmp_path_factory.mktemp("llama") / "float", seed=1)


@pytest.fixture(scope="module")
def deepseek_full_precision(tmp_path_factory) -> Path:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1,
        q_lora_rank=None, n_shared_experts=1, topk_method="greedy")
    return build_hf_checkpoint(DeepseekV2ForCausalLM, config, tmp_path_factory.mktemp("deepseek") / "float", seed=2)


@pytest.fixture(scope="module", params=sorted(LLAMA_SCHEMES))
def llama_compressed(request, llama_full_precision, tmp_path_factory):
    preset, overrides = LLAMA_SCHEMES[request.param]
    chosen = tool.scheme(preset, **overrides)
    folder = tool.write_compressed_checkpoint(llama_full_precision, chosen,
                                              tmp_path_factory.mktemp("llama") / request.param)
    return request.param, chosen, folder


@pytest.fixture(scope="module", params=sorted(DEEPSEEK_SCHEMES))
def deepseek_compressed(request, deepseek_full_precision, tmp_path_factory):
    preset, overrides = DEEPSEEK_SCHEMES[request.param]
    chosen = tool.scheme(preset, **overrides)
    folder = tool.write_compressed_checkpoint(deepseek_full_precision, chosen,
                                              tmp_path_factory.mktemp("deepseek") / request.param)
    return request.param, chosen, folder


def assert_weights_match_tool(folder: Path) -> int:
    expected = tool.tool_dequantized_weights(folder)
    assert expected, f"{folder}: the tool decompressed no weight"
    checkpoint = Checkpoint(folder)
    for name, weight in expected.items():
        assert checkpoint.is_quantized(name), f"{name} is not read as quantized"
        error = relative(checkpoint.tensor(name), weight.numpy())
        assert error <= WEIGHT_TOLERANCE, f"{name}: relative error {error:.3g} against the tool's decompression"
    return len(expected)


# ------------------------------------------------------------------------- compressed-tensors


def test_llama_weights_equal_the_tools_decompression(llama_compressed):
    name, _, folder = llama_compressed
    # Every linear layer of both blocks (q, k, v, o, gate, up, down) is quantized; lm_head is not.
    assert assert_weights_match_tool(folder) == 14, name
    assert not Checkpoint(folder).is_quantized("lm_head.weight")


def test_llama_logits_and_greedy_equal_the_quantized_reference(llama_compressed, llama_full_precision, tmp_path):
    name, chosen, folder = llama_compressed
    fake_quantized = tool.tool_fake_quantized_model(llama_full_precision, chosen)
    with torch.no_grad():
        tool_logits = fake_quantized(torch.tensor([PROMPT])).logits[0].numpy()
    llm = LLM(folder, device="cpu", show_progress=False)
    ours = llm.score(PROMPT)
    if chosen.input_activations is not None and chosen.input_activations.type == "int":
        # The tool's INT8 input scale (amax / 127.5) is not Metrale's (amax / 127): the reference
        # is the tool's dequantized weights with Metrale's documented input rule.
        reference = int8_input_reference(tool.write_dequantized_checkpoint(
            folder, llama_full_precision, tmp_path / "dequantized", tool.tool_dequantized_weights(folder)))
        with torch.no_grad():
            expected = reference(torch.tensor([PROMPT])).logits[0].numpy()
        assert relative(ours, tool_logits) < 0.1, f"{name}: far from the tool's own forward"
        greedy_reference, tolerance = reference, INT8_INPUT_LOGIT_TOLERANCE
    else:
        expected, greedy_reference, tolerance = tool_logits, fake_quantized, LOGIT_TOLERANCE
    error = relative(ours, expected)
    assert error <= tolerance, f"{name}: logits relative error {error:.3g}"
    assert metrale_greedy(llm, PROMPT) == torch_greedy(greedy_reference, PROMPT)


def int8_input_reference(folder: Path):
    """transformers' float32 model of ``folder`` whose quantized layers (all linear layers but
    lm_head) quantize their inputs with :func:`int8_per_token`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module_name != "lm_head":
            module.register_forward_pre_hook(lambda _, args: (int8_per_token(args[0]),))
    return model


def test_deepseek_weights_logits_and_greedy_equal_the_tools(deepseek_compressed, deepseek_full_precision, tmp_path):
    name, _, folder = deepseek_compressed
    count = assert_weights_match_tool(folder)
    # Per block: MLA's q, kv_a, kv_b, o; the dense MLP's or the shared expert's gate, up, down;
    # and the 4 routed experts' 3 matrices in the MoE block.
    assert count == 2 * (4 + 3) + 4 * 3, name
    reference = tool.write_dequantized_checkpoint(folder, deepseek_full_precision, tmp_path / "dequantized",
                                                  tool.tool_dequantized_weights(folder))
    llm = LLM(folder, device="cpu", show_progress=False)
    error = relative(llm.score(PROMPT), hf_reference_logits(reference, PROMPT))
    assert error <= LOGIT_TOLERANCE, f"{name}: logits relative error {error:.3g}"
    assert metrale_greedy(llm, PROMPT) == hf_greedy(reference, PROMPT, GREEDY_TOKENS)


# -------------------------------------------------------------------- Hugging Face block FP8


def fp8_group_input(x, group=128):
    """Per token and group of ``group`` columns: ``scale = max |x| / 448``, values cast to torch's
    ``float8_e4m3fn`` and back (DeepSeek's per-token-group input quantization)."""
    grouped = x.unflatten(-1, (-1, group))
    scale = (grouped.abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-12)
    return ((grouped / scale).to(torch.float8_e4m3fn).float() * scale).flatten(-2)


@pytest.fixture(scope="module")
def block_fp8(llama_full_precision, tmp_path_factory):
    return tool.write_block_fp8_checkpoint(llama_full_precision, tmp_path_factory.mktemp("llama") / "block_fp8")


def torch_block_dequantized(folder: Path) -> dict:
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    weights = {}
    for name, codes in tensors.items():
        scale = tensors.get(name[: -len(".weight")] + ".weight_scale_inv") if name.endswith(".weight") else None
        if scale is not None:
            expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: codes.shape[0], : codes.shape[1]]
            weights[name] = codes.float() * expanded
    return weights


def test_block_fp8_weights_logits_and_greedy(block_fp8, llama_full_precision, tmp_path):
    from transformers import AutoModelForCausalLM

    expected = torch_block_dequantized(block_fp8)
    checkpoint = Checkpoint(block_fp8)
    assert len(expected) == 14
    for name, weight in expected.items():
        assert relative(checkpoint.tensor(name), weight.numpy()) <= WEIGHT_TOLERANCE, name
    reference_folder = tool.write_dequantized_checkpoint(block_fp8, llama_full_precision, tmp_path / "deq", expected)
    reference = AutoModelForCausalLM.from_pretrained(str(reference_folder), dtype=torch.float32).eval()
    for module_name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and module_name != "lm_head":
            module.register_forward_pre_hook(lambda _, args: (fp8_group_input(args[0]),))
    llm = LLM(block_fp8, device="cpu", show_progress=False)
    with torch.no_grad():
        error = relative(llm.score(PROMPT), reference(torch.tensor([PROMPT])).logits[0].numpy())
    assert error <= LOGIT_TOLERANCE, f"block FP8 logits relative error {error:.3g}"
    assert metrale_greedy(llm, PROMPT) == torch_greedy(reference, PROMPT)


def test_static_fp8_inputs_and_tensor_scales_equal_the_tools_forward(llama_full_precision, tmp_path):
    """compressed-tensors' FP8 preset: one weight scale a tensor and static per-tensor input scales
    (``input_scale``, from a min-max calibration pass); the logits are the tool's own forward with
    those scales, and a checkpoint missing them is refused."""
    chosen = tool.scheme("FP8")
    assert chosen.weights.strategy == "tensor" and not chosen.input_activations.dynamic
    calibration = [7, 200, 41, 3, 99, 18, 250, 64]
    scales = tool.calibrated_input_scales(llama_full_precision, calibration)
    assert len(scales) == 14
    folder = tool.write_compressed_checkpoint(llama_full_precision, chosen, tmp_path / "fp8", input_scales=scales)
    assert assert_weights_match_tool(folder) == 14
    reference = tool.tool_fake_quantized_model(llama_full_precision, chosen, input_scales=scales)
    llm = LLM(folder, device="cpu", show_progress=False)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0].numpy()
        unquantized_inputs = tool.tool_fake_quantized_model(
            llama_full_precision, chosen.model_copy(update={"input_activations": None}))(
            torch.tensor([PROMPT])).logits[0].numpy()
    ours = llm.score(PROMPT)
    error = relative(ours, expected)
    assert error <= LOGIT_TOLERANCE, f"static FP8 logits relative error {error:.3g}"
    assert relative(ours, unquantized_inputs) > 10 * LOGIT_TOLERANCE   # the input scales are applied
    assert metrale_greedy(llm, PROMPT) == torch_greedy(reference, PROMPT)
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.input_scale"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="input_scale"):
        LLM(folder, device="cpu", show_progress=False)


def test_mixed_precision_groups_equal_the_tools_forward(llama_full_precision, tmp_path):
    """A recipe of two config groups in two formats (``format: mixed-precision``): FP8 with dynamic
    per-token inputs on the attention's projections (float-quantized), W4A16 on the MLP's
    (pack-quantized), matched by ``re:`` targets. Each weight is its group's decompression, and the
    logits are the tool's own forward under both groups."""
    attention = tool.scheme("FP8_DYNAMIC").model_copy(update={"targets": ["re:.*self_attn\\..*"]})
    mlp = tool.scheme("W4A16").model_copy(update={"targets": ["re:.*mlp\\..*"]})
    folder = tool.write_compressed_checkpoint(llama_full_precision, [attention, mlp], tmp_path / "mixed")
    quantization = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quantization["format"] == "mixed-precision"
    assert {group["format"] for group in quantization["config_groups"].values()} == {"float-quantized", "pack-quantized"}
    assert assert_weights_match_tool(folder) == 14
    checkpoint = Checkpoint(folder)
    assert checkpoint.quantized("model.layers.0.self_attn.o_proj.weight").codes_format == "fp8"
    assert checkpoint.quantized("model.layers.0.mlp.down_proj.weight").codes_format == "int4"
    reference = tool.tool_fake_quantized_model(llama_full_precision, [attention, mlp])
    llm = LLM(folder, device="cpu", show_progress=False)
    with torch.no_grad():
        error = relative(llm.score(PROMPT), reference(torch.tensor([PROMPT])).logits[0].numpy())
    assert error <= LOGIT_TOLERANCE, f"mixed-precision logits relative error {error:.3g}"
    assert metrale_greedy(llm, PROMPT) == torch_greedy(reference, PROMPT)


@pytest.mark.parametrize("preset", ["W4A16", "FP8_DYNAMIC"])
def test_a_quantized_lm_head_is_served_as_the_checkpoint_stores_it(preset, llama_full_precision, tmp_path):
    """A recipe that ignores nothing quantizes the LM head too: it loads as the tool's
    decompression, and the logits are the tool's forward with the head quantized (not the
    full-precision head's)."""
    chosen = tool.scheme(preset)
    folder = tool.write_compressed_checkpoint(llama_full_precision, chosen, tmp_path / preset, ignore=())
    assert assert_weights_match_tool(folder) == 15
    head = Checkpoint(folder).quantized("lm_head.weight")
    assert head is not None and head.codes_format == ("int4" if preset == "W4A16" else "fp8")
    reference = tool.tool_fake_quantized_model(llama_full_precision, chosen, ignore=())
    full_precision_head = tool.tool_fake_quantized_model(llama_full_precision, chosen)
    llm = LLM(folder, device="cpu", show_progress=False)
    ours = llm.score(PROMPT)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0].numpy()
        unquantized = full_precision_head(torch.tensor([PROMPT])).logits[0].numpy()
    error = relative(ours, expected)
    assert error <= LOGIT_TOLERANCE, f"{preset} with a quantized LM head: logits relative error {error:.3g}"
    assert relative(ours, unquantized) > 10 * LOGIT_TOLERANCE
    assert metrale_greedy(llm, PROMPT) == torch_greedy(reference, PROMPT)


def test_block_fp8_qwen3_moe_experts_equal_the_quantized_reference(tmp_path):
    """Qwen3-MoE in Hugging Face's block FP8 (as Qwen3-*-FP8 ship): attention and every expert's
    projections quantized in 128 x 128 blocks, their inputs per token and group of 128. The
    reference is transformers with the weights dequantized from the stored codes and every
    product's input quantized that way (its experts are one fused module, so their products are
    taken in the reference's own loop over the experts)."""
    import types

    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                            max_position_embeddings=64, norm_topk_prob=True)
    full = build_hf_checkpoint(Qwen3MoeForCausalLM, config, tmp_path / "float", seed=3)
    folder = tool.write_block_fp8_checkpoint(full, tmp_path / "fp8")
    weights = torch_block_dequantized(folder)
    assert len(weights) == 2 * (4 + 3 * 4)   # q, k, v, o and each expert's gate, up, down
    reference = AutoModelForCausalLM.from_pretrained(
        str(tool.write_dequantized_checkpoint(folder, full, tmp_path / "deq", weights)), dtype=torch.float32).eval()
    for module_name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and module_name != "lm_head" and not module_name.endswith("mlp.gate"):
            module.register_forward_pre_hook(lambda _, args: (fp8_group_input(args[0]),))

    def experts_with_quantized_inputs(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            tokens, slots = torch.where(top_k_index == expert)
            if tokens.numel():
                gate, up = torch.nn.functional.linear(fp8_group_input(hidden_states[tokens]),
                                                      self.gate_up_proj[expert]).chunk(2, dim=-1)
                down = torch.nn.functional.linear(fp8_group_input(self.act_fn(gate) * up), self.down_proj[expert])
                out.index_add_(0, tokens, down * top_k_weights[tokens, slots, None])
        return out

    for layer in reference.model.layers:
        layer.mlp.experts.forward = types.MethodType(experts_with_quantized_inputs, layer.mlp.experts)
    llm = LLM(folder, device="cpu", show_progress=False)
    assert isinstance(llm.model.layers[0].feed_forward.experts.gate_up, QuantizedWeight)
    assert llm.checkpoint.unconsumed() == []
    with torch.no_grad():
        error = relative(llm.score(PROMPT), reference(torch.tensor([PROMPT])).logits[0].numpy())
    assert error <= LOGIT_TOLERANCE, f"Qwen3-MoE block FP8 logits relative error {error:.3g}"
    assert metrale_greedy(llm, PROMPT) == torch_greedy(reference, PROMPT)


# ----------------------------------------------------------------- online FP8 and refusals

def test_online_fp8_quantizes_every_linear_layer(llama_full_precision):
    llm = LLM(llama_full_precision, device="cpu", show_progress=False, quantization="fp8")
    checkpoint = Checkpoint(llama_full_precision, quantization="fp8")
    linear = [n for n in checkpoint.names() if tool.is_linear_weight(n, len(checkpoint.info(n).shape), ("lm_head",))]
    assert len(linear) == 14 and all(isinstance(checkpoint.quantized(n), QuantizedWeight) for n in linear)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert not checkpoint.is_quantized(name), name
    # Online FP8 is FP8_DYNAMIC's math (per-channel amax / 448 weight scales, per-token inputs):
    # compressed-tensors' fake-quantized forward of that scheme is its reference. The random
    # tiny model amplifies quantization noise: against float32 the logits move by about 0.2 of
    # the largest (4-bit groups: 0.18), so only the exact reference can check it.
    fake_quantized = tool.tool_fake_quantized_model(llama_full_precision, tool.scheme("FP8_DYNAMIC"))
    with torch.no_grad():
        expected = fake_quantized(torch.tensor([PROMPT])).logits[0].numpy()
    ours = llm.score(PROMPT)
    assert relative(ours, expected) <= LOGIT_TOLERANCE
    assert relative(ours, hf_reference_logits(llama_full_precision, PROMPT)) > LOGIT_TOLERANCE  # quantized at all
    assert metrale_greedy(llm, PROMPT) == torch_greedy(fake_quantized, PROMPT)


@pytest.mark.parametrize("method", ["bitsandbytes", "gguf", "no-such-method"])
def test_unserved_methods_are_refused(method, llama_full_precision, tmp_path):
    folder = tmp_path / method
    shutil.copytree(llama_full_precision, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantizationError, match=rf"{method}.*compressed-tensors"):
        Checkpoint(folder)


def test_online_int4_and_fp8_over_another_method_are_refused(llama_full_precision, block_fp8, llama_compressed):
    with pytest.raises(UnsupportedQuantizationError, match="int4.*fp8"):
        Checkpoint(llama_full_precision, quantization="int4")
    with pytest.raises(UnsupportedQuantizationError, match="compressed-tensors"):
        Checkpoint(llama_compressed[2], quantization="fp8")


def test_quantization_config_over_unscaled_weights_is_refused(llama_full_precision, llama_compressed, tmp_path):
    folder = tmp_path / "unscaled"
    shutil.copytree(llama_full_precision, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = json.loads((llama_compressed[2] / "config.json").read_text())["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match="weight_scale"):
        LLM(folder, device="cpu", show_progress=False)


# ------------------------------------------------------------------ tensor-parallel parts


def test_parts_equal_slices_of_the_whole_weight(llama_compressed, block_fp8):
    for folder in (llama_compressed[2], block_fp8):
        checkpoint = Checkpoint(folder)
        name = "model.layers.0.mlp.gate_proj.weight"  # [256, 128]
        whole = dequantize(checkpoint.quantized(name))
        rows = dequantize(checkpoint.quantized(name, rows=slice(128, 256)))
        np.testing.assert_array_equal(rows, whole[128:256])
        down = "model.layers.0.mlp.down_proj.weight"  # [128, 256]
        columns = dequantize(checkpoint.quantized(down, columns=slice(128, 256)))
        np.testing.assert_array_equal(columns, dequantize(checkpoint.quantized(down))[:, 128:256])


def test_misaligned_parts_are_refused(llama_compressed, block_fp8):
    blocked = {"FP8_BLOCK", "W4A16", "W4A16_ASYM"}
    for folder, aligned_only in ((llama_compressed[2], llama_compressed[0] in blocked), (block_fp8, True)):
        checkpoint = Checkpoint(folder)
        if aligned_only:
            with pytest.raises(QuantizationError, match="does not fall on the quantization blocks"):
                checkpoint.quantized("model.layers.0.mlp.down_proj.weight", columns=slice(0, 96))


# ------------------------------------------------------------------ packed words read as they are


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_words_are_taken_byte_for_byte_as_the_kernels_codes(bits):
    """Words packed from random values (value k of a word at bit k * bits) give, byte for byte,
    the codes the kernels take: 8-bit values one a byte, 4-bit ones two a byte with the even
    column in the low nibble; column parts off whole bytes are not taken as they are."""
    from metrale.loading.quantization.compressed_tensors import _bytes_are_codes, _code_bytes

    rng = np.random.default_rng(bits)
    rows, columns, per_word = 12, 80, 32 // bits
    values = rng.integers(0, 1 << bits, size=(rows, columns)).astype(np.uint64)
    words = np.zeros((rows, columns // per_word), np.uint64)
    for k in range(per_word):
        words |= values[:, k::per_word] << np.uint64(k * bits)
    words = words.astype(np.uint32).view(np.int32)
    expected = (values[:, 0::2] | values[:, 1::2] << np.uint64(4)) if bits == 4 else values
    assert _bytes_are_codes(words, bits, rows, columns, None)
    np.testing.assert_array_equal(_code_bytes(words, bits, columns), expected.astype(np.uint8))
    assert _bytes_are_codes(words, bits, rows, columns, slice(16, 48))
    assert _bytes_are_codes(words, bits, rows, columns, slice(3, 48)) == (bits == 8)
    assert not _bytes_are_codes(words, bits, rows + 1, columns, None)
    assert not _bytes_are_codes(words[:, :-1], bits, rows, columns, None)


def test_a_weight_read_by_parts_matches_the_whole(llama_compressed):
    scheme, _, folder = llama_compressed
    checkpoint = Checkpoint(folder)
    name = "model.layers.0.mlp.down_proj.weight"  # [128, 256]
    whole = checkpoint.quantized(name)
    for columns in (None, slice(128, 256), slice(0, 128)):
        for rows in ((None,) if scheme == "FP8_BLOCK" else (None, slice(32, 96))):  # blocks of 128 rows
            part = checkpoint.quantized(name, rows=rows, columns=columns)
            assert part.shape == (len(range(*(rows or slice(None)).indices(128))),
                                  len(range(*(columns or slice(None)).indices(256))))
            np.testing.assert_array_equal(dequantize(part), dequantize(whole)[rows or slice(None)][:, columns or slice(None)])
