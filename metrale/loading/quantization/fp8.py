"""Hugging Face ``quant_method: "fp8"`` checkpoints: block-wise FP8, as DeepSeek-V3 and the
Qwen3-*-FP8 checkpoints store it.

``weight_block_size`` ``[b0, b1]`` (``[128, 128]``): each linear module ``{m}`` stores ``{m}.weight``
in FP8 E4M3 and ``{m}.weight_scale_inv`` float32 ``[ceil(out / b0), ceil(in / b1)]``, the factor a
block's codes are *multiplied* by (the inverse of the quantizer's scale, hence the name). Inputs
are quantized per token and group of ``b1`` columns at run time (``activation_scheme:
"dynamic"``). ``modules_to_not_convert`` (or ``ignored_layers``) lists full-precision modules.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import UnsupportedQuantizationError
from metrale.kernels.quantized import QuantizedWeight
from metrale.loading.config_fields import ConfigFields
from metrale.loading.quantization.base import (
    WeightFormat,
    block_part,
    check_scales_stored,
    check_shape,
    float_tensor,
    matches,
    module_of,
    register_format,
    sliced,
)


@register_format("fp8")
class BlockFp8Format(WeightFormat):
    """The block-wise FP8 reader (the module docstring)."""

    method = "fp8"

    def __init__(self, config: ConfigFields) -> None:
        block = config.integers("weight_block_size", None, null=None)
        if block is None or len(block) != 2 or min(block) < 1:
            raise UnsupportedQuantizationError(
                f"{config.source}: quant_method 'fp8' is served block-wise (weight_block_size [b0, b1], as DeepSeek-V3 "
                f"stores it); weight_block_size is {block!r}")
        self.block = (int(block[0]), int(block[1]))
        scheme = config.text("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise UnsupportedQuantizationError(f"{config.source}: activation_scheme {scheme!r} is not served with "
                                               "block-wise FP8 (dynamic is)")
        fmt = config.text("fmt", "e4m3")
        if fmt != "e4m3":
            raise UnsupportedQuantizationError(f"{config.source}: FP8 format {fmt!r} is not served (e4m3 is)")
        self.ignore = tuple(config.texts("modules_to_not_convert", None, null=None) or ()) + \
            tuple(config.texts("ignored_layers", None, null=None) or ())

    def holds(self, checkpoint: Any, name: str) -> bool:
        module = module_of(name)
        if module is None or matches(module, self.ignore, linear=False):
            return False
        return checkpoint.has_stored(name) and check_scales_stored(checkpoint, name, "weight_scale_inv", self.method)

    def shape(self, checkpoint: Any, name: str) -> tuple[int, ...]:
        return checkpoint.info(name).shape

    def read(self, checkpoint: Any, name: str, rows: slice | None = None,
             columns: slice | None = None) -> QuantizedWeight:
        module = name[: -len(".weight")]
        info = checkpoint.info(name)
        if info.dtype != "F8_E4M3" or len(info.shape) != 2:
            raise UnsupportedQuantizationError(f"{checkpoint.path}: {name} is a {info.dtype} tensor of shape "
                                               f"{list(info.shape)}; block-wise FP8 weights are F8_E4M3 matrices")
        out, inner = info.shape
        per_row, per_column = self.block
        scale_name = f"{module}.weight_scale_inv"
        scales = float_tensor(checkpoint, scale_name)
        check_shape(scale_name, scales.shape, (-(-out // per_row), -(-inner // per_column)), "the block scale")
        codes = sliced(np.asarray(checkpoint.raw(name)), rows, columns)
        scales = sliced(scales, block_part(rows, out, per_row, "rows", name),
                        block_part(columns, inner, per_column, "columns", name))
        checkpoint.skip([scale_name, f"{module}.input_scale"])
        return QuantizedWeight("fp8", np.ascontiguousarray(codes), np.ascontiguousarray(scales, np.float32),
                               self.block, tuple(codes.shape), activations="fp8_group", activation_group=per_column,
                               source=f"fp8 block-wise {list(self.block)}")

    def describe(self) -> str:
        return f"block-wise FP8 {list(self.block)}"
