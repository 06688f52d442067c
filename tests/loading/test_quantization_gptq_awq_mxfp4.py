"""GPTQ, AWQ and MXFP4 checkpoints read into the engine's quantized layout.

Each test writes a tiny checkpoint whose tensors are packed here from the format's definition
(independently of the readers), then checks the weight the reader gives against the test's own
dequantization of what it packed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from metrale.errors import QuantizationError, UnsupportedQuantizationError
from metrale.kernels.quantized import dequantize, quantized_linear_reference
from metrale.loading.checkpoint import Checkpoint
from metrale.loading.quantization.mxfp4 import read_experts

OUT, IN = 24, 64
MODULE = "model.layers.0.self_attn.q_proj"
NAME = f"{MODULE}.weight"


def write_checkpoint(path: Path, quantization_config: dict, tensors: dict[str, np.ndarray]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "quantization_config": quantization_config}
    (path / "config.json").write_text(json.dumps(config))
    save_file({name: np.ascontiguousarray(value) for name, value in tensors.items()}, str(path / "model.safetensors"))
    return path


# ------------------------------------------------------------------------- the test's packers


def pack_along_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """int32 ``[rows * bits / 32, columns]``: value ``k`` of each word (row ``32 / bits * word + k``)
    at bits ``k * bits``, as GPTQ packs its weight."""
    per_word = 32 // bits
    values = values.astype(np.uint64) & ((1 << bits) - 1)
    words = np.zeros((values.shape[0] // per_word, values.shape[1]), np.uint64)
    for k in range(per_word):
        words |= values[k::per_word] << np.uint64(k * bits)
    return words.astype(np.uint32).view(np.int32)


def pack_along_columns(values: np.ndarray, bits: int) -> np.ndarray:
    """int32 ``[rows, columns * bits / 32]``: the same along the columns (GPTQ's zero points)."""
    return np.ascontiguousarray(pack_along_rows(values.T, bits).T)


def gptq_tensors(rng: np.random.Generator, bits: int, group_size: int, *, sym: bool, v1: bool, desc_act: bool,
                 module: str = MODULE, out: int = OUT, inner: int = IN) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The stored tensors of a random GPTQ weight and the float32 ``[out, in]`` matrix they stand for."""
    group = group_size if group_size > 0 else inner
    groups = inner // group
    levels = 1 << bits
    codes = rng.integers(0, levels, size=(out, inner))
    if sym:
        zeros = np.full((groups, out), levels // 2)
    else:
        zeros = rng.integers(1, levels, size=(groups, out))  # v1 stores zero - 1: keep it non-negative
    scales = rng.uniform(0.005, 0.05, size=(groups, out)).astype(np.float16)
    g_idx = np.arange(inner) // group
    if desc_act:
        g_idx = rng.permutation(g_idx)
    expected = (codes - zeros[g_idx].T).astype(np.float32) * scales[g_idx].T.astype(np.float32)
    tensors = {
        f"{module}.qweight": pack_along_rows(codes.T, bits),
        f"{module}.qzeros": pack_along_columns(zeros - 1 if v1 else zeros, bits),
        f"{module}.scales": scales,
        f"{module}.g_idx": g_idx.astype(np.int32),
        f"{module}.bias": rng.standard_normal(out).astype(np.float16),
    }
    return tensors, expected


def gptq_config(bits: int, group_size: int, *, sym: bool = True, v1: bool = True, desc_act: bool = False,
                **extra: object) -> dict:
    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym, "desc_act": desc_act}
    if not v1:
        config["checkpoint_format"] = "gptq_v2"
    config.update(extra)
    return config


#: AutoAWQ's GEMM packing: nibble i of a word holds output column AWQ_ORDER[i] of its eight.
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_pack(values: np.ndarray) -> np.ndarray:
    """int32 ``[rows, columns / 8]`` of 4-bit ``values`` ``[rows, columns]`` in AutoAWQ's order."""
    values = values.astype(np.uint64) & 0xF
    words = np.zeros((values.shape[0], values.shape[1] // 8), np.uint64)
    for nibble, column in enumerate(AWQ_ORDER):
        words |= values[:, column::8] << np.uint64(4 * nibble)
    return words.astype(np.uint32).view(np.int32)


def awq_tensors(rng: np.random.Generator, group_size: int, module: str = MODULE) -> tuple[dict, np.ndarray]:
    group = group_size if group_size > 0 else IN
    groups = IN // group
    codes = rng.integers(0, 16, size=(OUT, IN))
    zeros = rng.integers(0, 16, size=(groups, OUT))
    scales = rng.uniform(0.005, 0.05, size=(groups, OUT)).astype(np.float16)
    g_idx = np.arange(IN) // group
    expected = (codes - zeros[g_idx].T).astype(np.float32) * scales[g_idx].T.astype(np.float32)
    tensors = {f"{module}.qweight": awq_pack(codes.T), f"{module}.qzeros": awq_pack(zeros), f"{module}.scales": scales}
    return tensors, expected


def awq_config(group_size: int = 16, **extra: object) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm", **extra}


def check_products(weight, expected: np.ndarray, rng: np.random.Generator) -> None:
    x = rng.standard_normal((5, expected.shape[1])).astype(np.float32)
    np.testing.assert_allclose(quantized_linear_reference(x, weight), x @ expected.T, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------- GPTQ


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("v1", [True, False], ids=["gptq_v1", "gptq_v2"])
@pytest.mark.parametrize("desc_act", [False, True], ids=["in_order", "desc_act"])
@pytest.mark.parametrize("group_size", [16, -1])
def test_gptq_dequantizes_to_what_was_packed(tmp_path, bits, sym, v1, desc_act, group_size):
    rng = np.random.default_rng(bits * 100 + sym * 10 + v1 + 2 * desc_act + (group_size > 0) * 4)
    tensors, expected = gptq_tensors(rng, bits, group_size, sym=sym, v1=v1, desc_act=desc_act)
    checkpoint = Checkpoint(write_checkpoint(tmp_path, gptq_config(bits, group_size, sym=sym, v1=v1,
                                                                   desc_act=desc_act), tensors))
    assert checkpoint.is_quantized(NAME) and not checkpoint.is_quantized(f"{MODULE}.bias")
    assert checkpoint.shape_of(NAME) == (OUT, IN)
    weight = checkpoint.quantized(NAME, (OUT, IN))
    assert weight.codes_format == f"int{bits}"
    assert weight.shape == (OUT, IN)
    assert weight.activations == "weight_only"
    assert weight.block == (1, group_size if group_size > 0 else IN)
    assert (weight.zeros is None) == sym  # symmetric zero points are the implied 2**(bits - 1)
    assert (weight.input_order is not None) == (desc_act and group_size > 0)
    np.testing.assert_array_equal(dequantize(weight), expected)
    np.testing.assert_array_equal(checkpoint.tensor(NAME), expected)
    assert checkpoint.tensor(NAME).dtype == np.float32
    check_products(weight, expected, rng)


def test_gptq_zero_points_are_stored_minus_one_in_v1(tmp_path):
    rng = np.random.default_rng(0)
    tensors, expected = gptq_tensors(rng, 4, 16, sym=False, v1=True, desc_act=False)
    as_v2 = Checkpoint(write_checkpoint(tmp_path / "v2", gptq_config(4, 16, sym=False, v1=False), tensors))
    as_v1 = Checkpoint(write_checkpoint(tmp_path / "v1", gptq_config(4, 16, sym=False, v1=True), tensors))
    np.testing.assert_array_equal(as_v1.tensor(NAME), expected)
    scales = np.repeat(tensors[f"{MODULE}.scales"].astype(np.float32).T, 16, axis=1)
    # Read as v2, each zero point is one lower: every weight one scale higher.
    np.testing.assert_allclose(as_v2.tensor(NAME), expected + scales, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_rows_and_columns_of_a_rank(tmp_path, bits):
    rng = np.random.default_rng(7)
    tensors, expected = gptq_tensors(rng, bits, 16, sym=False, v1=True, desc_act=False)
    checkpoint = Checkpoint(write_checkpoint(tmp_path, gptq_config(bits, 16, sym=False), tensors))
    rows, columns = slice(5, 17), slice(16, 48)
    np.testing.assert_array_equal(dequantize(checkpoint.quantized(NAME, rows=rows)), expected[rows])
    np.testing.assert_array_equal(dequantize(checkpoint.quantized(NAME, columns=columns)), expected[:, columns])
    part = checkpoint.quantized(NAME, rows=rows, columns=columns)
    assert part.shape == (12, 32) and part.scales.shape == (12, 2)
    np.testing.assert_array_equal(dequantize(part), expected[rows, columns])
    np.testing.assert_array_equal(checkpoint.tensor(NAME, rows=rows, columns=columns), expected[rows, columns])
    with pytest.raises(QuantizationError, match="quantization blocks"):
        checkpoint.quantized(NAME, columns=slice(8, 40))


def test_gptq_act_order_rows_of_a_rank(tmp_path):
    rng = np.random.default_rng(8)
    tensors, expected = gptq_tensors(rng, 4, 16, sym=False, v1=True, desc_act=True)
    checkpoint = Checkpoint(write_checkpoint(tmp_path, gptq_config(4, 16, sym=False, desc_act=True), tensors))
    part = checkpoint.quantized(NAME, rows=slice(3, 11))
    assert part.input_order is not None
    np.testing.assert_array_equal(dequantize(part), expected[3:11])
    check_products(part, expected[3:11], rng)
    with pytest.raises(UnsupportedQuantizationError, match="act-order"):
        checkpoint.quantized(NAME, columns=slice(0, 32))


def test_gptq_refuses_groups_of_unequal_size(tmp_path):
    rng = np.random.default_rng(9)
    tensors, _ = gptq_tensors(rng, 4, 16, sym=True, v1=True, desc_act=True)
    g_idx = np.arange(IN) // 16
    g_idx[:4] = 1  # group 0 has 12 columns, group 1 has 20
    tensors[f"{MODULE}.g_idx"] = rng.permutation(g_idx).astype(np.int32)
    checkpoint = Checkpoint(write_checkpoint(tmp_path, gptq_config(4, 16, desc_act=True), tensors))
    with pytest.raises(UnsupportedQuantizationError, match="unequal size"):
        checkpoint.quantized(NAME)


def test_gptq_without_g_idx(tmp_path):
    rng = np.random.default_rng(10)
    tensors, expected = gptq_tensors(rng, 4, 32, sym=False, v1=True, desc_act=False)
    del tensors[f"{MODULE}.g_idx"]
    checkpoint = Checkpoint(write_checkpoint(tmp_path, gptq_config(4, 32, sym=False), tensors))
    assert checkpoint.shape_of(NAME) == (OUT, IN)
    np.testing.assert_array_equal(checkpoint.tensor(NAME), expected)


def test_gptq_modules_to_not_convert_and_dynamic(tmp_path):
    rng = np.random.default_rng(11)
    wide, wide_expected = gptq_tensors(rng, 8, 32, sym=False, v1=True, desc_act=False,
                                       module="model.layers.0.mlp.up_proj")
    narrow, narrow_expected = gptq_tensors(rng, 4, 16, sym=False, v1=True, desc_act=False)
    plain = {"model.layers.0.mlp.down_proj.weight": rng.standard_normal((IN, OUT)).astype(np.float16),
             "lm_head.weight": rng.standard_normal((OUT, IN)).astype(np.float16)}
    config = gptq_config(4, 16, sym=False, modules_to_not_convert=["lm_head"], dynamic={
        r"+:.*\.up_proj": {"bits": 8, "group_size": 32},
        r"-:.*\.down_proj": {},
    })
    checkpoint = Checkpoint(write_checkpoint(tmp_path, config, {**wide, **narrow, **plain}))
    assert not checkpoint.is_quantized("lm_head.weight")
    assert not checkpoint.is_quantized("model.layers.0.mlp.down_proj.weight")
    up = checkpoint.quantized("model.layers.0.mlp.up_proj.weight")
    assert up.codes_format == "int8" and up.block == (1, 32)
    np.testing.assert_array_equal(dequantize(up), wide_expected)
    np.testing.assert_array_equal(checkpoint.tensor(NAME), narrow_expected)


# -------------------------------------------------------------------------------------- AWQ


def test_awq_interleave_of_one_word(tmp_path):
    # Output columns 0..7 hold 1..8; nibbles from bit 0 hold columns 0, 2, 4, 6, 1, 3, 5, 7.
    word = np.array([[0x86427531]], np.uint32).view(np.int32)
    tensors = {
        f"{MODULE}.qweight": np.repeat(word, 32, axis=0),
        f"{MODULE}.qzeros": np.zeros((1, 1), np.int32),
        f"{MODULE}.scales": np.ones((1, 8), np.float16),
    }
    checkpoint = Checkpoint(write_checkpoint(tmp_path, awq_config(32), tensors))
    assert checkpoint.shape_of(NAME) == (8, 32)
    np.testing.assert_array_equal(checkpoint.tensor(NAME), np.repeat(np.arange(1, 9, dtype=np.float32)[:, None],
                                                                     32, axis=1))


@pytest.mark.parametrize("group_size", [16, -1])
def test_awq_dequantizes_to_what_was_packed(tmp_path, group_size):
    rng = np.random.default_rng(20 + group_size)
    tensors, expected = awq_tensors(rng, group_size)
    checkpoint = Checkpoint(write_checkpoint(tmp_path, awq_config(group_size), tensors))
    assert checkpoint.is_quantized(NAME) and checkpoint.shape_of(NAME) == (OUT, IN)
    weight = checkpoint.quantized(NAME)
    assert weight.codes_format == "int4" and weight.zeros is not None
    assert weight.block == (1, group_size if group_size > 0 else IN)
    np.testing.assert_array_equal(dequantize(weight), expected)
    np.testing.assert_array_equal(checkpoint.tensor(NAME), expected)
    check_products(weight, expected, rng)


def test_awq_autoawq_field_names(tmp_path):
    rng = np.random.default_rng(21)
    tensors, expected = awq_tensors(rng, 32)
    config = {"quant_method": "awq", "w_bit": 4, "q_group_size": 32, "zero_point": True, "version": "GEMM"}
    np.testing.assert_array_equal(Checkpoint(write_checkpoint(tmp_path, config, tensors)).tensor(NAME), expected)


def test_awq_rows_and_columns_of_a_rank(tmp_path):
    rng = np.random.default_rng(22)
    tensors, expected = awq_tensors(rng, 16)
    checkpoint = Checkpoint(write_checkpoint(tmp_path, awq_config(16, modules_to_not_convert=["lm_head"]), tensors))
    for rows in (slice(0, 8), slice(3, 21), slice(8, 24)):
        for columns in (None, slice(16, 48)):
            part = checkpoint.quantized(NAME, rows=rows, columns=columns)
            np.testing.assert_array_equal(dequantize(part), expected[rows][:, columns or slice(None)])


# ------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("config, match", [
    (gptq_config(3, 128), "3-bit"),
    (gptq_config(2, 128), "2-bit"),
    (gptq_config(4, 0), "group_size"),
    (gptq_config(4, 128, checkpoint_format="marlin"), "marlin"),
    (gptq_config(4, 128, meta={"checkpoint_format": "bitblas"}), "bitblas"),
    (gptq_config(4, 128, is_marlin_format=True), "Marlin"),
    (gptq_config(4, 128, dynamic={r"+:.*": {"bits": 3}}), "3-bit"),
    (awq_config(version="gemv"), "gemv"),
    (awq_config(version="marlin"), "marlin"),
    (awq_config(version="exllama"), "exllama"),
    (awq_config(bits=8), "8-bit"),
    (awq_config(zero_point=False), "zero points"),
    ({"quant_method": "bitsandbytes"}, "not served"),
    ({"bits": 4}, "no quant_method"),
])
def test_unsupported_configurations_are_refused(tmp_path, config, match):
    tensors = {"model.embed_tokens.weight": np.zeros((4, 4), np.float16)}
    with pytest.raises(UnsupportedQuantizationError, match=match):
        Checkpoint(write_checkpoint(tmp_path, config, tensors))


# ------------------------------------------------------------------------------------ MXFP4

#: The values of FP4 E2M1 codes 0..15 (bit 3 the sign), from the OCP microscaling definition.
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
EXPERTS, EXPERT_OUT, EXPERT_IN = 3, 6, 96


def mxfp4_tensors(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random ``_blocks`` / ``_scales`` of a ``(..., out, in)`` tensor and its float32 values."""
    *lead, inner = shape
    blocks = rng.integers(0, 256, size=(*lead, inner // 32, 16), dtype=np.uint8)
    scales = rng.integers(120, 134, size=(*lead, inner // 32), dtype=np.uint8)
    nibbles = np.stack([blocks & 0xF, blocks >> 4], axis=-1).reshape(*lead, inner // 32, 32)  # low nibble first
    values = E2M1[nibbles] * np.exp2(scales.astype(np.float32) - 127)[..., None]
    return blocks, scales, values.reshape(*lead, inner).astype(np.float32)


def mxfp4_config() -> dict:
    return {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}


def test_mxfp4_experts_match_transformers(tmp_path):
    rng = np.random.default_rng(30)
    base = "model.layers.0.mlp.experts.gate_up_proj"
    blocks, scales, values = mxfp4_tensors(rng, (EXPERTS, EXPERT_OUT, EXPERT_IN))
    checkpoint = Checkpoint(write_checkpoint(tmp_path, mxfp4_config(), {f"{base}_blocks": blocks,
                                                                        f"{base}_scales": scales}))
    assert checkpoint.is_quantized(base) and checkpoint.has(base)
    assert checkpoint.shape_of(base) == (EXPERTS, EXPERT_OUT, EXPERT_IN)
    experts = read_experts(checkpoint, base)
    assert len(experts) == EXPERTS
    for expert, weight in enumerate(experts):
        assert weight.codes_format == "mxfp4" and weight.shape == (EXPERT_OUT, EXPERT_IN)
        assert weight.block == (1, 32) and weight.scales.dtype == np.float32
        np.testing.assert_array_equal(weight.codes, blocks[expert].reshape(EXPERT_OUT, -1))
        np.testing.assert_array_equal(dequantize(weight), values[expert])
        check_products(weight, values[expert], rng)
    stacked = checkpoint.quantized(base)
    assert stacked.shape == (EXPERTS * EXPERT_OUT, EXPERT_IN)
    np.testing.assert_array_equal(checkpoint.tensor(base), values.reshape(-1, EXPERT_IN))

    torch = pytest.importorskip("torch")
    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except ImportError as error:
        pytest.skip(f"transformers' MXFP4 integration does not import: {error}")
    # transformers gives GptOss's [experts, in, out]: the transpose of each expert's [out, in].
    reference = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    assert tuple(reference.shape) == (EXPERTS, EXPERT_IN, EXPERT_OUT)
    for expert, weight in enumerate(experts):
        np.testing.assert_array_equal(dequantize(weight), reference[expert].numpy().T)


@pytest.mark.parametrize("stored_as", ["{m}.weight_blocks", "{m}_blocks"])
def test_mxfp4_matrix_rows_and_columns(tmp_path, stored_as):
    rng = np.random.default_rng(31)
    module = "model.layers.0.mlp.down_proj"
    blocks, scales, values = mxfp4_tensors(rng, (EXPERT_OUT, EXPERT_IN))
    base = stored_as.replace("{m}", module).removesuffix("_blocks")
    checkpoint = Checkpoint(write_checkpoint(tmp_path, mxfp4_config(), {f"{base}_blocks": blocks,
                                                                        f"{base}_scales": scales}))
    name = f"{module}.weight"
    assert checkpoint.is_quantized(name) and checkpoint.shape_of(name) == (EXPERT_OUT, EXPERT_IN)
    np.testing.assert_array_equal(checkpoint.tensor(name), values)
    part = checkpoint.quantized(name, rows=slice(1, 5), columns=slice(32, 96))
    assert part.shape == (4, 64) and part.scales.shape == (4, 2)
    np.testing.assert_array_equal(dequantize(part), values[1:5, 32:96])
    with pytest.raises(QuantizationError, match="quantization blocks"):
        checkpoint.quantized(name, columns=slice(16, 48))


def test_mxfp4_expert_rows_of_a_rank(tmp_path):
    rng = np.random.default_rng(32)
    base = "model.layers.0.mlp.experts.down_proj"
    blocks, scales, values = mxfp4_tensors(rng, (EXPERTS, EXPERT_OUT, EXPERT_IN))
    checkpoint = Checkpoint(write_checkpoint(tmp_path, mxfp4_config(), {f"{base}_blocks": blocks,
                                                                        f"{base}_scales": scales}))
    for expert, weight in enumerate(read_experts(checkpoint, base, rows=slice(2, 4), columns=slice(0, 64))):
        np.testing.assert_array_equal(dequantize(weight), values[expert, 2:4, :64])
    with pytest.raises(QuantizationError, match="not stored as MXFP4"):
        read_experts(checkpoint, "model.layers.0.mlp.experts.gate_up_proj")
