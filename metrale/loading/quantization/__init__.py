"""Quantized checkpoints: which weights of a checkpoint are quantized, and how to read them.

A checkpoint's ``config.json`` names its method in ``quantization_config.quant_method``; the
``quantization=`` option (vLLM's name) asks for the online quantization of a checkpoint stored at
full precision. :func:`weight_format` turns either into a :class:`WeightFormat`, which the
:class:`~metrale.loading.checkpoint.Checkpoint` asks, for each weight a family reads, whether the
weight is stored quantized (:meth:`WeightFormat.holds`) and reads it
(:meth:`WeightFormat.read`) into the engine's one layout,
:class:`~metrale.kernels.quantized.QuantizedWeight`. A method, number format or option the engine
does not serve raises :class:`~metrale.errors.UnsupportedQuantizationError` naming it and what is
served: a quantized checkpoint is never loaded as if it were not.

Served (``quant_method``): ``compressed-tensors`` (``float-quantized``, ``int-quantized``,
``pack-quantized``, ``naive-quantized``), ``fp8`` (block-wise, as DeepSeek-V3 and Qwen3-FP8 store
it), ``gptq``, ``awq`` and ``mxfp4``; online: ``fp8``.
"""

from __future__ import annotations

from metrale.errors import UnsupportedQuantizationError
from metrale.loading.config_fields import ConfigFields
from metrale.loading.quantization.base import (
    FORMATS,
    ONLINE_METHODS,
    OnlineFp8,
    WeightFormat,
    read_parts,
    register_format,
)


def served_methods() -> list[str]:
    """The ``quant_method`` values the engine reads."""
    _load_formats()
    return sorted(FORMATS)


def _load_formats() -> None:
    from metrale.loading.quantization import compressed_tensors, fp8, gptq, mxfp4  # noqa: F401 (they register)


def weight_format(config: ConfigFields, online: str | None = None) -> WeightFormat | None:
    """The format of a checkpoint whose ``config.json`` fields are ``config``, with the online
    method ``online`` asked for (None: none); None when its weights are stored at full precision
    and none is asked for."""
    _load_formats()
    section = config.section("quantization_config")
    if online is not None and online not in ONLINE_METHODS:
        raise UnsupportedQuantizationError(
            f"quantization={online!r} is not served; online methods: {', '.join(ONLINE_METHODS)} "
            f"(quantized checkpoints are read as stored: {', '.join(sorted(FORMATS))})")
    if section is None:
        return OnlineFp8() if online == "fp8" else None
    method = section.text("quant_method", None)
    if method is None:
        raise UnsupportedQuantizationError(f"{config.source}: quantization_config has no quant_method; "
                                           f"served methods: {', '.join(sorted(FORMATS))}")
    if method not in FORMATS:
        raise UnsupportedQuantizationError(
            f"{config.source}: quantization method {method!r} is not served; served methods: "
            f"{', '.join(sorted(FORMATS))} (and online: quantization='fp8' on a full-precision checkpoint)")
    if online is not None and online != method:
        raise UnsupportedQuantizationError(
            f"quantization={online!r} asks to quantize a checkpoint that is already quantized with {method!r}; "
            f"leave quantization unset (or set it to {method!r})")
    return FORMATS[method](section)


__all__ = ["FORMATS", "ONLINE_METHODS", "OnlineFp8", "WeightFormat", "read_parts", "register_format", "served_methods",
           "weight_format"]
