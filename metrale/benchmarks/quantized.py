"""Quantized checkpoints for ``metrale bench --quantization``: the benchmark's random bf16 checkpoint
rewritten in a real quantized format, the bytes a decode step then reads, and the accuracy of the
quantized model against the bf16 one.

Formats (:data:`FORMATS`), each written as its tool stores it:

* ``fp8`` -- online: the bf16 checkpoint loaded with ``quantization="fp8"``;
* ``fp8-dynamic`` -- compressed-tensors ``float-quantized``: FP8 E4M3 weights with a scale per output
  channel, inputs quantized per token at run time (llm-compressor's ``FP8_DYNAMIC``);
* ``fp8-block`` -- Hugging Face ``quant_method: "fp8"``: 128x128 blocks, ``weight_scale_inv``, inputs
  per token and group of 128 (as DeepSeek-V3 and Qwen3-FP8 are stored);
* ``w8a8`` -- compressed-tensors ``int-quantized``: INT8 weights per channel, INT8 inputs per token;
* ``w4a16`` -- compressed-tensors ``pack-quantized``: INT4 weights in groups of 128, symmetric, bf16
  inputs (llm-compressor's ``W4A16``).

Every linear layer's matrix is quantized (attention, MLPs, experts); the embedding, the LM head,
the MoE routers and the norms stay as they are, as the tools leave them.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

FP8_MAX = 448.0
BLOCK = 128
GROUP = 128


@dataclass(frozen=True)
class QuantizedFormat:
    """One format of the benchmark: how to write it and the bytes it stores per weight."""

    name: str
    description: str
    #: Bytes per weight of a quantized matrix (codes plus scales, in the formats' usual groups).
    bytes_per_weight: float
    #: ``quantization=`` of the load (online formats), None for a written checkpoint.
    online: str | None = None


FORMATS = {
    "fp8": QuantizedFormat("fp8", "online FP8 (per-channel weights, per-token inputs)", 1.0, online="fp8"),
    "fp8-dynamic": QuantizedFormat("fp8-dynamic", "compressed-tensors FP8, per channel, dynamic per-token inputs", 1.0),
    "fp8-block": QuantizedFormat("fp8-block", "Hugging Face block FP8 (128x128), per-token-group inputs",
                                 1.0 + 4.0 / (BLOCK * BLOCK)),
    "w8a8": QuantizedFormat("w8a8", "compressed-tensors INT8 weights per channel, INT8 inputs per token", 1.0),
    "w4a16": QuantizedFormat("w4a16", "compressed-tensors INT4 weights, groups of 128, bf16 inputs",
                             0.5 + 2.0 / GROUP),
}

#: Weights the formats leave at full precision.
KEPT = ("embed_tokens", "lm_head", "mlp.gate", "shared_expert_gate")


def is_quantized_matrix(name: str, ndim: int) -> bool:
    """Whether the checkpoint tensor ``name`` is a linear layer's matrix the formats quantize."""
    if ndim != 2 or not name.endswith(".weight"):
        return False
    module = name[: -len(".weight")]
    return not any(module == kept or module.endswith("." + kept) for kept in KEPT)


# ------------------------------------------------------------------------------ quantizers
# torch on the device: the benchmark's checkpoints have billions of weights. Scales stored in bf16
# (as llm-compressor stores them in the model's dtype) are rounded before the codes are computed
# with them, so the stored pair dequantizes to the nearest code's value.


def _bf16_scale(scale: Any) -> Any:
    import torch

    return scale.to(torch.bfloat16).float()


def _fp8_per_channel(weight: Any) -> dict[str, Any]:
    import torch

    w = weight.float()
    scale = _bf16_scale((w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12))
    codes = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale": scale.to(torch.bfloat16)}


def _fp8_blocks(weight: Any) -> dict[str, Any]:
    import torch

    rows, columns = weight.shape
    padded = torch.zeros((-(-rows // BLOCK) * BLOCK, -(-columns // BLOCK) * BLOCK), dtype=torch.float32,
                         device=weight.device)
    padded[:rows, :columns] = weight.float()
    blocks = padded.reshape(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)
    codes = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(padded.shape)[:rows, :columns]
    return {"weight": codes.to(torch.float8_e4m3fn), "weight_scale_inv": scale.float()}


def _int8_per_channel(weight: Any) -> dict[str, Any]:
    import torch

    w = weight.float()
    scale = _bf16_scale((w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12))
    codes = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return {"weight": codes, "weight_scale": scale.to(torch.bfloat16)}


def _int4_groups(weight: Any) -> dict[str, Any]:
    import torch

    rows, columns = weight.shape
    w = weight.float().reshape(rows, columns // GROUP, GROUP)
    scale = _bf16_scale((w.abs().amax(dim=2, keepdim=True) / 7.5).clamp_min(1e-12))  # [-8, 7] around zero
    values = torch.round(w / scale).clamp(-8, 7).to(torch.int64).reshape(rows, columns) + 8
    # Eight 4-bit values a 32-bit word, value k at bits 4k (compressed-tensors' dense packing),
    # summed in 64 bits and stored as the int32 of the same bits.
    shifted = values.reshape(rows, columns // 8, 8) << (4 * torch.arange(8, device=weight.device, dtype=torch.int64))
    words = shifted.sum(dim=2)
    packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return {"weight_packed": packed, "weight_scale": scale.reshape(rows, columns // GROUP).to(torch.bfloat16),
            "weight_shape": torch.tensor([rows, columns], dtype=torch.int64)}


QUANTIZERS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "fp8-dynamic": _fp8_per_channel, "fp8-block": _fp8_blocks, "w8a8": _int8_per_channel, "w4a16": _int4_groups,
}


def _quantization_config(name: str) -> dict[str, Any]:
    if name == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": ["lm_head"]}
    weights: dict[str, Any] = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                               "dynamic": False}
    inputs: dict[str, Any] | None = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                     "dynamic": True}
    storage = "float-quantized"
    if name == "w8a8":
        weights["type"], inputs = "int", {**(inputs or {}), "type": "int"}
        storage = "int-quantized"
    elif name == "w4a16":
        weights.update(num_bits=4, type="int", strategy="group", group_size=GROUP)
        inputs, storage = None, "pack-quantized"
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs, "output_activations": None,
             "format": storage}
    return {"quant_method": "compressed-tensors", "format": storage, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None}


def write_quantized_checkpoint(source: Path, destination: Path, name: str, device: str = "cuda") -> Path:
    """The bf16 checkpoint ``source`` rewritten in format ``name`` (:data:`FORMATS`) to
    ``destination`` (kept when already written), one tensor at a time on ``device``."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    if name not in QUANTIZERS:
        raise ValueError(f"no checkpoint is written for format {name!r}")
    if (destination / "config.json").exists():
        return destination
    destination.mkdir(parents=True, exist_ok=True)
    quantize = QUANTIZERS[name]
    index: dict[str, str] = {}
    for shard in sorted(source.glob("*.safetensors")):
        written: dict[str, Any] = {}
        with safe_open(str(shard), framework="pt", device=device) as handle:
            for tensor_name in handle.keys():
                tensor = handle.get_tensor(tensor_name)
                if tensor.shape[-1] % GROUP == 0 and is_quantized_matrix(tensor_name, tensor.ndim):
                    module = tensor_name[: -len(".weight")]
                    for suffix, value in quantize(tensor).items():
                        written[f"{module}.{suffix}"] = value.contiguous().cpu()
                else:
                    written[tensor_name] = tensor.contiguous().cpu()
        save_file(written, destination / shard.name, metadata={"format": "pt"})
        index.update({tensor_name: shard.name for tensor_name in written})
        del written
        if device != "cpu":
            torch.cuda.empty_cache()
    if (source / "model.safetensors.index.json").exists():
        (destination / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    for file in source.iterdir():
        if file.is_file() and not file.name.startswith("model.safetensors") and not file.name.endswith(".safetensors"):
            shutil.copy(file, destination / file.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = _quantization_config(name)
    (destination / "config.json").write_text(json.dumps(config, indent=2))
    return destination


#: safetensors' names of the torch dtypes the formats write.
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "F8_E4M3",
                      "int8": "I8", "int32": "I32", "int64": "I64", "uint8": "U8"}
#: The tensors of a quantized module that hold its codes (the rest: scales, shapes).
CODE_TENSORS = ("weight", "weight_packed")


def save_with_holes(tensors: dict[str, Any], holes: set[str], path: Path, metadata: dict[str, str]) -> None:
    """A safetensors file of ``tensors`` (torch) in which the tensors named in ``holes`` take their
    place in the layout but are never written: the file is sparse there, reads give zeros, and the
    disk holds only the rest."""
    import torch

    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for tensor_name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[tensor_name] = {"dtype": SAFETENSORS_DTYPES[str(tensor.dtype).removeprefix("torch.")],
                               "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as file:
        file.write(len(encoded).to_bytes(8, "little") + encoded)
        base = file.tell()
        for tensor_name, tensor in tensors.items():
            if tensor_name not in holes:
                file.seek(base + header[tensor_name]["data_offsets"][0])
                file.write(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        file.truncate(base + offset)


def write_random_quantized_checkpoint(model: tuple[Any, Any], destination: Path, name: str,
                                     shard_bytes: int = 5 << 30, device: str = "cuda", hollow: bool = False) -> Path:
    """A random-weight checkpoint of ``model`` (``(config, model class)`` of transformers) written
    straight in format ``name``, a tensor at a time on ``device``, in shards of about ``shard_bytes``:
    for shapes whose bf16 checkpoint no GPU or disk of the benchmark holds. Each matrix is drawn as
    transformers initialises it (normal, standard deviation ``initializer_range``) and quantized as
    :func:`write_quantized_checkpoint` quantizes; norms are ones. With ``hollow`` the quantized
    matrices' codes are holes of sparse files (:func:`save_with_holes`: zeros, no disk), their scales
    and every other tensor written: for a shape whose quantized checkpoint the disk does not hold,
    timed as any other (the kernels' work does not depend on the codes' values) but computing
    nothing meaningful."""
    import torch
    from safetensors.torch import save_file

    if name not in QUANTIZERS:
        raise ValueError(f"no checkpoint is written for format {name!r}")
    if (destination / "config.json").exists():
        return destination
    config, model_class = model
    with torch.device("meta"):
        shapes = {tensor_name: tuple(tensor.shape) for tensor_name, tensor in model_class(config).state_dict().items()}
    destination.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(device=device).manual_seed(0)
    std = getattr(config, "initializer_range", 0.02)
    index: dict[str, str] = {}
    shard: dict[str, Any] = {}
    holes: set[str] = set()
    held = 0

    def flush() -> None:
        nonlocal shard, held
        if shard:
            file = f"model-{len(set(index.values())) + 1:05d}.safetensors"
            if hollow:
                save_with_holes(shard, holes, destination / file, metadata={"format": "pt"})
            else:
                save_file(shard, destination / file, metadata={"format": "pt"})
            index.update({tensor_name: file for tensor_name in shard})
        shard, held = {}, 0
        holes.clear()

    for tensor_name, shape in shapes.items():
        if len(shape) == 1:
            written = {tensor_name: torch.ones(shape, dtype=torch.bfloat16)}
        else:
            values = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, std, generator=generator)
            if shape[-1] % GROUP == 0 and is_quantized_matrix(tensor_name, len(shape)):
                module = tensor_name[: -len(".weight")]
                written = {}
                for suffix, value in QUANTIZERS[name](values).items():
                    # A hole needs only its dtype and shape: a tensor on the meta device.
                    hole = hollow and suffix in CODE_TENSORS
                    written[f"{module}.{suffix}"] = torch.empty_like(value, device="meta") if hole else value.cpu()
                    if hole:
                        holes.add(f"{module}.{suffix}")
            else:
                written = {tensor_name: values.cpu()}
        for written_name, value in written.items():
            shard[written_name] = value.contiguous()
            held += value.numel() * value.element_size()
        if held >= shard_bytes:
            flush()
    flush()
    (destination / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    quantized_config = config.to_dict()
    quantized_config.update(architectures=[model_class.__name__], quantization_config=_quantization_config(name))
    (destination / "config.json").write_text(json.dumps(quantized_config, indent=2))
    return destination


def checkpoint_in_format(source: Path, workdir: Path, name: str) -> tuple[Path, str | None]:
    """``(folder, quantization)`` to load the bf16 checkpoint ``source`` in format ``name``: the
    folder itself with ``quantization=`` for an online format, else the checkpoint written in the
    format under ``workdir`` (once) with None."""
    if name not in FORMATS:
        raise ValueError(f"unknown quantized format {name!r}; known: {', '.join(FORMATS)}")
    if FORMATS[name].online:
        return source, FORMATS[name].online
    return write_quantized_checkpoint(source, workdir / f"{source.name}-{name}", name), None


def quantized_step_bytes(bf16_bytes: int, embedding_bytes: int, name: str) -> int:
    """The bytes a decode step reads in format ``name`` when it reads ``bf16_bytes`` in bf16, of
    which ``embedding_bytes`` are the embedding and the LM head (kept at bf16); the rest counted as
    linear layers' matrices (the norms and routers, a fraction of a percent, with them)."""
    linear = bf16_bytes - embedding_bytes
    return int(embedding_bytes + linear / 2 * FORMATS[name].bytes_per_weight)


def accuracy(reference: Any, quantized: Any, prompt: list[int]) -> dict[str, float]:
    """The quantized model's teacher-forced logits on ``prompt`` against the bf16 model's: the
    largest error relative to the largest logit, and the share of positions whose top token agrees."""
    import numpy as np

    ours, theirs = quantized.score(prompt), reference
    scale = float(np.abs(theirs).max())
    return {"logit_error": float(np.abs(ours - theirs).max() / scale),
            "greedy_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).mean())}
