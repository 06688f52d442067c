"""MXFP4 GPT-OSS checkpoints for the tests, written from the format's definition (the OCP
microscaling spec, as GPT-OSS's released checkpoints store it), independently of the engine's
reader: each expert stack ``{name}`` of a full-precision checkpoint, ``[E, in, out]``, is stored
as ``{name}_blocks`` uint8 ``[E, out, in / 32, 16]`` (FP4 E2M1 codes, two per byte, the even
input column in the low nibble) and ``{name}_scales`` uint8 ``[E, out, in / 32]`` (E8M0: ``2**(code
- 127)``), and config.json gains ``quantization_config``. Its twin holds the dequantized values at
full precision, in transformers' layout: what transformers computes the quantized model as."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

#: The magnitudes of E2M1 codes 0..7; bit 3 of a code is the sign.
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
BLOCK = 32
#: The expert stacks GPT-OSS stores as MXFP4 (their biases stay bf16).
QUANTIZED_STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
#: The released checkpoints' quantization_config.
QUANTIZATION_CONFIG = {"quant_method": "mxfp4",
                       "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                  "model.embed_tokens", "lm_head"]}


def quantize_mxfp4(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(blocks, scales, values)`` of a float ``[..., out, in]`` array: each block of 32 input
    columns scaled by the power of two that brings its largest magnitude to at most 6, each value
    rounded to the nearest E2M1 magnitude; ``values`` float32 ``[..., out, in]`` is what the codes
    stand for."""
    matrix = np.asarray(matrix, np.float32)
    *lead, inner = matrix.shape
    grouped = matrix.reshape(*lead, inner // BLOCK, BLOCK)
    largest = np.abs(grouped).max(axis=-1)
    exponent = np.where(largest > 0, np.ceil(np.log2(np.maximum(largest, 1e-30) / 6.0)), -127).astype(np.int32)
    exponent = np.clip(exponent, -127, 127)
    scale = np.exp2(exponent.astype(np.float32))
    scaled = grouped / scale[..., None]
    magnitude = np.abs(np.abs(scaled)[..., None] - E2M1_MAGNITUDES).argmin(axis=-1).astype(np.uint8)
    nibbles = magnitude | (np.signbit(scaled).astype(np.uint8) << 3)
    blocks = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)
    signed = np.where(nibbles & 8, -E2M1_MAGNITUDES[nibbles & 7], E2M1_MAGNITUDES[nibbles & 7])
    values = (signed * scale[..., None]).reshape(*lead, inner).astype(np.float32)
    return blocks, (exponent + 127).astype(np.uint8), values


def write_mxfp4_twins(source: Path, quantized: Path, dequantized: Path) -> None:
    """From the full-precision GPT-OSS checkpoint ``source``: ``quantized``, its expert stacks
    stored MXFP4, and ``dequantized``, the same model with those stacks at their dequantized
    values (transformers' ``[E, in, out]``)."""
    tensors = load_file(str(source / "model.safetensors"))
    packed, unpacked = {}, {}
    for name, value in tensors.items():
        if name.endswith(QUANTIZED_STACKS):
            blocks, scales, values = quantize_mxfp4(value.transpose(0, 2, 1))  # [E, out, in]
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            unpacked[name] = np.ascontiguousarray(values.transpose(0, 2, 1))
        else:
            packed[name] = unpacked[name] = value
    config = json.loads((source / "config.json").read_text())
    for folder, stored, extra in ((quantized, packed, {"quantization_config": QUANTIZATION_CONFIG}),
                                  (dequantized, unpacked, {})):
        folder.mkdir(parents=True)
        for file in source.iterdir():
            if file.name not in ("model.safetensors", "config.json"):
                shutil.copy(file, folder / file.name)
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
        save_file({name: np.ascontiguousarray(value) for name, value in stored.items()}, str(folder / "model.safetensors"))
