"""Quantized checkpoints written by the producing tools, and their references (needs torch,
transformers and compressed-tensors).

* :func:`write_compressed_checkpoint` quantizes a full-precision checkpoint folder with
  compressed-tensors as llm-compressor does without calibration data (min-max weight scales,
  :func:`weight_qparams`; each module compressed by the tool's own compressor of the format it
  infers) and writes the folder llm-compressor saves: the compressed tensors, ``config.json`` with
  the tool's ``quantization_config``;
* :func:`tool_dequantized_weights` is the tool's own decompression of the stored tensors;
* :func:`tool_fake_quantized_model` is transformers running the tool's fake-quantized forward
  (weights and inputs quantized and dequantized as the scheme says; static input scales from
  :func:`calibrated_input_scales`);
* :func:`write_block_fp8_checkpoint` writes Hugging Face's block-wise ``quant_method: "fp8"``
  format (``weight_scale_inv`` per block), quantized with torch's ``float8_e4m3fn``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Sequence

#: Module names the ``Linear`` target of compressed-tensors never covers: the embedding, the
#: norms, the MoE router (a router module of its own in transformers, not a Linear layer).
NOT_LINEAR = ("embed_tokens", "norm", "mlp.gate")


def scheme(preset: str, **weights: Any) -> Any:
    """The compressed-tensors preset ``preset`` for ``Linear`` targets, with its weight
    arguments ``weights`` replaced (a smaller ``group_size``, ...)."""
    from compressed_tensors.quantization import preset_name_to_scheme

    chosen = preset_name_to_scheme(preset, ["Linear"])
    if weights:
        chosen = chosen.model_copy(update={"weights": chosen.weights.model_copy(update=weights)})
    return chosen


def weight_qparams(weight: Any, args: Any) -> tuple[Any, Any]:
    """The scale and zero point of ``weight`` under ``args`` from its minimum and maximum over
    each of its strategy's blocks (llm-compressor's default min-max observer), computed by the
    tool's ``calculate_qparams``."""
    from compressed_tensors.quantization.utils import calculate_qparams

    weight = weight.float()
    if args.strategy == "channel":
        low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    elif args.strategy == "group":
        grouped = weight.unflatten(-1, (-1, args.group_size))
        low, high = grouped.amin(-1), grouped.amax(-1)
    elif args.strategy == "block":
        rows, columns = args.block_structure
        # A partial last block is padded with zeros: the range always holds zero anyway.
        padded = weight.new_zeros(-(-weight.shape[0] // rows) * rows, -(-weight.shape[1] // columns) * columns)
        padded[: weight.shape[0], : weight.shape[1]] = weight
        blocks = padded.unflatten(0, (-1, rows)).unflatten(-1, (-1, columns))
        low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
    else:
        low, high = weight.amin().reshape(1), weight.amax().reshape(1)
    return calculate_qparams(low, high, args)


def is_linear_weight(name: str, ndim: int, ignore: Sequence[str]) -> bool:
    """Whether the stored tensor ``name`` is the weight of a linear layer the ``Linear`` target
    quantizes (``ignore``: module names left at full precision)."""
    if not name.endswith(".weight") or ndim != 2:
        return False
    module = name[: -len(".weight")]
    if module in ignore or any(module.endswith("." + part) for part in ignore):
        return False
    return not any(module.endswith(part) or module.split(".")[-1].endswith(part) for part in NOT_LINEAR)


def _read_tensors(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def groups_of(chosen: Any) -> list[Any]:
    """The schemes of ``chosen``: one scheme (its ``targets`` ``["Linear"]`` from :func:`scheme`), or
    several (each with targets of its own: ``"re:"`` patterns or module names), one config group each."""
    return list(chosen) if isinstance(chosen, (list, tuple)) else [chosen]


def scheme_of(module: str, schemes: Sequence[Any]) -> Any:
    """The first of ``schemes`` whose ``targets`` take the linear layer ``module`` (``"Linear"``, or
    a name or ``"re:"`` pattern as compressed-tensors' own ``match_name`` matches them), or None."""
    from compressed_tensors.utils.match import match_name

    for chosen in schemes:
        if any(target == "Linear" or match_name(module, target) for target in chosen.targets):
            return chosen
    return None


def write_compressed_checkpoint(source: str | Path, chosen: Any, destination: str | Path,
                                ignore: Sequence[str] = ("lm_head",),
                                input_scales: dict[str, float] | None = None) -> Path:
    """The full-precision checkpoint folder ``source`` quantized under the compressed-tensors
    scheme ``chosen`` (:func:`scheme`; or several, each its own config group, :func:`groups_of`),
    written to ``destination`` as llm-compressor writes it (schemes of several formats: each group
    names its own, the config ``mixed-precision``). Static input schemes take each module's
    ``input_scale`` from ``input_scales`` (module name -> scale, as calibration leaves them:
    :func:`calibrated_input_scales`)."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    from safetensors.torch import save_file

    source, destination = Path(source), Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    schemes = [chosen.model_copy(deep=True) for chosen in groups_of(chosen)]
    for chosen in schemes:
        chosen.format = infer_module_format(torch.nn.Linear, chosen).value
    written: dict[str, Any] = {}
    for name, tensor in _read_tensors(source).items():
        module = name[: -len(".weight")]
        chosen = scheme_of(module, schemes) if is_linear_weight(name, tensor.ndim, ignore) else None
        if chosen is None:
            written[name] = tensor.contiguous()
            continue
        scale, zero_point = weight_qparams(tensor, chosen.weights)
        state = {"weight": tensor.float(), "weight_scale": scale, "weight_zero_point": zero_point}
        compressor = BaseCompressor.get_value_from_registry(chosen.format)
        for key, value in compressor.compress(state, chosen).items():
            written[f"{module}.{key}"] = value.contiguous()
        if chosen.input_activations is not None and not chosen.input_activations.dynamic:
            if input_scales is None or module not in input_scales:
                raise KeyError(f"{module}: a static input scheme needs the module's input scale")
            written[f"{module}.input_scale"] = torch.tensor([input_scales[module]], dtype=torch.float32)
    save_file(written, destination / "model.safetensors", metadata={"format": "pt"})
    for file in source.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and not file.name.endswith(".index.json"):
            shutil.copy(file, destination / file.name)
    config = json.loads((source / "config.json").read_text())
    formats = {chosen.format for chosen in schemes}
    quantization = QuantizationConfig(config_groups={f"group_{i}": chosen for i, chosen in enumerate(schemes)},
                                      ignore=list(ignore), format=formats.pop() if len(formats) == 1 else "mixed-precision",
                                      quantization_status=QuantizationStatus.COMPRESSED)
    config["quantization_config"] = quantization.to_dict()
    (destination / "config.json").write_text(json.dumps(config, indent=2))
    return destination


def tool_dequantized_weights(folder: str | Path) -> dict[str, Any]:
    """``{module}.weight`` -> float32 tensor for every quantized module of the compressed-tensors
    checkpoint ``folder``, decompressed from the stored tensors by the tool's own compressor (each
    module's config group's)."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    folder = Path(folder)
    config = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    schemes = list(config.config_groups.values())
    modules: dict[str, dict[str, Any]] = {}
    for name, tensor in _read_tensors(folder).items():
        module, _, local = name.rpartition(".")
        if local.startswith("weight_") and local != "weight":
            modules.setdefault(module, {})[local] = tensor
    tensors = _read_tensors(folder)
    weights = {}
    for module, state in modules.items():
        chosen = scheme_of(module, schemes)
        if chosen is None:
            raise KeyError(f"{folder}: {module} has quantized tensors but no config group takes it")
        compressor = BaseCompressor.get_value_from_registry(chosen.format or config.format)
        if f"{module}.weight" in tensors:
            state["weight"] = tensors[f"{module}.weight"]
        weights[f"{module}.weight"] = compressor.decompress(state, chosen)["weight"].to(torch.float32)
    return weights


def write_dequantized_checkpoint(folder: str | Path, full_precision: str | Path, destination: str | Path,
                                 weights: dict[str, Any]) -> Path:
    """The float32 checkpoint ``full_precision`` with its quantized weights replaced by
    ``weights`` (a tool's dequantization), written to ``destination``: transformers runs it as the
    reference of the quantized checkpoint ``folder``'s weights."""
    from safetensors.torch import save_file

    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    tensors = _read_tensors(Path(full_precision))
    missing = set(weights) - set(tensors)
    if missing:
        raise KeyError(f"{folder}: dequantized weights with no full-precision tensor: {sorted(missing)}")
    tensors.update({name: value.float().contiguous() for name, value in weights.items()})
    save_file(tensors, destination / "model.safetensors", metadata={"format": "pt"})
    for file in Path(full_precision).iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and not file.name.endswith(".index.json"):
            shutil.copy(file, destination / file.name)
    return destination


def calibrated_input_scales(full_precision: str | Path, token_ids: Sequence[int], ignore: Sequence[str] = ("lm_head",),
                            code_max: float = 448.0) -> dict[str, float]:
    """Module name -> static input scale of every linear layer of ``full_precision`` (but
    ``ignore``): the largest magnitude of its input over a float32 forward of ``token_ids``, over
    ``code_max`` (E4M3's largest code by default), as a min-max calibration leaves them."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(full_precision), dtype=torch.float32).eval()
    largest: dict[str, float] = {}

    def record(name: str) -> Any:
        def hook(_: Any, inputs: Any) -> None:
            largest[name] = max(largest.get(name, 0.0), float(inputs[0].abs().max()))
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name not in ignore:
            module.register_forward_pre_hook(record(name))
    with torch.no_grad():
        model(torch.tensor([list(token_ids)]))
    return {name: value / code_max for name, value in largest.items()}


def tool_fake_quantized_model(full_precision: str | Path, chosen: Any, ignore: Sequence[str] = ("lm_head",),
                              input_scales: dict[str, float] | None = None) -> Any:
    """transformers' float32 model of ``full_precision`` run by compressed-tensors' fake-quantized
    forward under ``chosen`` (one scheme or several, :func:`groups_of`; status frozen: every
    targeted layer quantizes and dequantizes its weight with the :func:`weight_qparams` scales,
    and its input as the scheme says: static input schemes with ``input_scales``, as
    :func:`write_compressed_checkpoint` takes them)."""
    import torch
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(full_precision), dtype=torch.float32).eval()
    config = QuantizationConfig(config_groups={f"group_{i}": group for i, group in enumerate(groups_of(chosen))},
                                ignore=list(ignore), quantization_status=QuantizationStatus.FROZEN)
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for name, module in model.named_modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            scale, zero_point = weight_qparams(module.weight.data, module.quantization_scheme.weights)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
            inputs = module.quantization_scheme.input_activations
            if inputs is not None and not inputs.dynamic:
                if input_scales is None or name not in input_scales:
                    raise KeyError(f"{name}: a static input scheme needs the module's input scale")
                module.input_scale.data.fill_(input_scales[name])
    return model


def block_fp8_quantize(weight: Any, block: tuple[int, int] = (128, 128)) -> tuple[Any, Any]:
    """``(codes, scale)`` of ``weight`` in Hugging Face's block-wise FP8: per ``block`` of the matrix
    ``scale = max |w| / 448``, ``codes = (w / scale)`` cast to ``float8_e4m3fn``; ``scale`` is what
    the checkpoint stores as ``weight_scale_inv``."""
    import torch

    rows, columns = weight.shape
    grid = (-(-rows // block[0]), -(-columns // block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1], dtype=torch.float32)
    padded[:rows, :columns] = weight.float()
    blocks = padded.unflatten(0, (grid[0], block[0])).unflatten(-1, (grid[1], block[1]))
    scale = blocks.abs().amax((1, 3)) / torch.finfo(torch.float8_e4m3fn).max
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    expanded = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :columns]
    codes = (weight.float() / expanded).to(torch.float8_e4m3fn)
    return codes, scale


def write_block_fp8_checkpoint(source: str | Path, destination: str | Path, block: tuple[int, int] = (128, 128),
                               ignore: Sequence[str] = ("lm_head",)) -> Path:
    """The full-precision checkpoint ``source`` in Hugging Face's ``quant_method: "fp8"`` block-wise
    format, written to ``destination``."""
    from safetensors.torch import save_file

    source, destination = Path(source), Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    written: dict[str, Any] = {}
    for name, tensor in _read_tensors(source).items():
        if not is_linear_weight(name, tensor.ndim, ignore):
            written[name] = tensor.contiguous()
            continue
        codes, scale = block_fp8_quantize(tensor, block)
        written[name] = codes.contiguous()
        written[name[: -len(".weight")] + ".weight_scale_inv"] = scale.contiguous()
    save_file(written, destination / "model.safetensors", metadata={"format": "pt"})
    for file in source.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and not file.name.endswith(".index.json"):
            shutil.copy(file, destination / file.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), "modules_to_not_convert": list(ignore)}
    (destination / "config.json").write_text(json.dumps(config, indent=2))
    return destination
