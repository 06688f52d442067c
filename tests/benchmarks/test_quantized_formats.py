"""The benchmark's quantized checkpoints (:mod:`metrale.benchmarks.quantized`) are what the tools
write: compressed-tensors decompresses the three compressed-tensors formats to the weights Metrale
reads, the block FP8 checkpoint dequantizes as torch computes it, every format stays within its
precision of the bf16 weights, and Metrale loads each and generates."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from metrale.benchmarks import quantized as formats  # noqa: E402
from metrale.entrypoints.llm import LLM  # noqa: E402
from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16  # noqa: E402
from metrale.kernels.quantized import QuantizedWeight  # noqa: E402
from metrale.loading.checkpoint import Checkpoint  # noqa: E402
from metrale.params import SamplingParams  # noqa: E402
from metrale.testing.hf import build_hf_checkpoint  # noqa: E402

WRITTEN = ("fp8-dynamic", "fp8-block", "w8a8", "w4a16")
#: The largest error of a dequantized weight relative to its row's (group's) largest magnitude: E4M3
#: keeps 3 mantissa bits (half a step: 2**-4 of the value); INT8 has 127 steps to the largest, INT4
#: 7.5, and a value rounds to half a step, or up to a quarter more where the bf16-rounded scale made
#: the largest values clamp.
PRECISION = {"fp8-dynamic": 2.0**-4, "fp8-block": 2.0**-4, "w8a8": 0.75 / 127, "w4a16": 0.75 / 7.5}


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return build_hf_checkpoint(LlamaForCausalLM, config, tmp_path_factory.mktemp("bf16") / "llama", seed=3,
                               dtype=torch.bfloat16)


@pytest.fixture(scope="module", params=WRITTEN)
def written(request, bf16_llama, tmp_path_factory):
    folder = formats.write_quantized_checkpoint(bf16_llama, tmp_path_factory.mktemp(request.param) / "q",
                                                request.param, device="cpu")
    return request.param, folder


def test_every_linear_matrix_is_stored_quantized_within_its_precision(written, bf16_llama):
    name, folder = written
    source, quantized = Checkpoint(bf16_llama), Checkpoint(folder)
    matrices = [n for n in source.names() if formats.is_quantized_matrix(n, len(source.info(n).shape))]
    assert len(matrices) == 14  # 7 projections a layer
    for matrix in matrices:
        assert quantized.is_quantized(matrix)
        original, restored = source.tensor(matrix), quantized.tensor(matrix)
        row_scale = np.abs(original).max(axis=1, keepdims=True)
        assert np.all(np.abs(restored - original) <= PRECISION[name] * row_scale + 1e-7), matrix
    assert not quantized.is_quantized("lm_head.weight") and not quantized.is_quantized("model.embed_tokens.weight")


@pytest.mark.parametrize("name", ["fp8-dynamic", "w8a8", "w4a16"])
def test_compressed_tensors_decompresses_what_metrale_reads(name, bf16_llama, tmp_path):
    pytest.importorskip("compressed_tensors")
    from metrale.testing.quantized import tool_dequantized_weights

    folder = formats.write_quantized_checkpoint(bf16_llama, tmp_path / name, name, device="cpu")
    checkpoint = Checkpoint(folder)
    decompressed = tool_dequantized_weights(folder)
    assert len(decompressed) == 14
    for matrix, tool_values in decompressed.items():
        # The tool multiplies in the scales' dtype (bf16): Metrale's float32 product, rounded so.
        ours = bf16_to_float32(float32_to_bf16(checkpoint.tensor(matrix)))
        assert np.array_equal(ours, tool_values.numpy()), matrix


def test_block_fp8_dequantizes_as_torch_computes_it(bf16_llama, tmp_path):
    from safetensors.torch import load_file

    folder = formats.write_quantized_checkpoint(bf16_llama, tmp_path / "block", "fp8-block", device="cpu")
    stored = load_file(str(folder / "model.safetensors"))
    checkpoint = Checkpoint(folder)
    matrix = "model.layers.1.mlp.down_proj.weight"
    codes, scale = stored[matrix].float(), stored[matrix[: -len(".weight")] + ".weight_scale_inv"]
    expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: codes.shape[0], : codes.shape[1]]
    assert np.array_equal(checkpoint.tensor(matrix), (codes * expanded).numpy())


def test_metrale_loads_and_generates_every_format(written):
    _, folder = written
    llm = LLM(folder, device="cpu", show_progress=False)
    assert isinstance(llm.model.layers[0].mlp.down, QuantizedWeight)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_step_bytes_scale_the_linear_layers_only():
    assert formats.quantized_step_bytes(10_000, 2_000, "fp8-dynamic") == 2_000 + 4_000
    assert formats.quantized_step_bytes(10_000, 2_000, "w4a16") == int(2_000 + 4_000 * (0.5 + 2 / 128))


@pytest.mark.parametrize("name", ["fp8-dynamic", "w4a16"])
def test_a_checkpoint_drawn_straight_in_a_format_loads_in_shards(name, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    folder = formats.write_random_quantized_checkpoint((config, LlamaForCausalLM), tmp_path / name, name,
                                                       shard_bytes=1 << 18, device="cpu")
    assert len(list(folder.glob("model-*.safetensors"))) > 1  # sharded, with an index
    checkpoint = Checkpoint(folder)
    assert checkpoint.is_quantized("model.layers.2.mlp.down_proj.weight")
    weights = checkpoint.tensor("model.layers.0.self_attn.q_proj.weight")
    assert 0.015 < float(weights.std()) < 0.025  # drawn as transformers initialises: normal, std 0.02
    llm = LLM(folder, device="cpu", show_progress=False)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_shape_is_loaded_in_a_format_online_or_from_its_written_checkpoint(tmp_path, monkeypatch):
    source = tmp_path / "llama-8b"
    assert formats.checkpoint_in_format(source, tmp_path, "fp8") == (source, "fp8")
    written = []

    def write(source_folder, destination, name, device="cuda"):
        written.append((source_folder, destination, name))
        return destination

    monkeypatch.setattr(formats, "write_quantized_checkpoint", write)
    assert formats.checkpoint_in_format(source, tmp_path, "w4a16") == (tmp_path / "llama-8b-w4a16", None)
    assert written == [(source, tmp_path / "llama-8b-w4a16", "w4a16")]
    with pytest.raises(ValueError, match="unknown quantized format 'int3'"):
        formats.checkpoint_in_format(source, tmp_path, "int3")


@pytest.mark.parametrize("name", ["fp8-dynamic", "w4a16"])
def test_a_hollow_checkpoint_leaves_the_codes_as_holes_and_loads(name, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = (config, LlamaForCausalLM)
    full = formats.write_random_quantized_checkpoint(model, tmp_path / "full", name, device="cpu")
    hollow = formats.write_random_quantized_checkpoint(model, tmp_path / "hollow", name, device="cpu", hollow=True)
    # The same layout (names, dtypes, shapes) as the written checkpoint, safetensors reads it.
    from safetensors import safe_open

    with safe_open(str(full / "model-00001.safetensors"), "pt") as a, \
            safe_open(str(hollow / "model-00001.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        codes = "model.layers.1.mlp.up_proj." + ("weight" if name == "fp8-dynamic" else "weight_packed")
        scales = "model.layers.1.mlp.up_proj.weight_scale"
        assert a.get_tensor(codes).dtype == b.get_tensor(codes).dtype
        assert not b.get_tensor(codes).view(torch.uint8).any() and a.get_tensor(codes).view(torch.uint8).any()
        assert torch.equal(a.get_tensor(scales), b.get_tensor(scales))
        embedding = "model.embed_tokens.weight"
        assert torch.equal(a.get_tensor(embedding), b.get_tensor(embedding))
    # The codes take no disk: the files' blocks fall short of their sizes by about the codes' bytes.
    file = hollow / "model-00001.safetensors"
    assert file.stat().st_blocks * 512 < file.stat().st_size - 300_000
    llm = LLM(hollow, device="cpu", show_progress=False)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
