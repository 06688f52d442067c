"""MXFP4 (``quant_method: "mxfp4"``) checkpoints, as GPT-OSS stores its experts.

A quantized tensor ``{base}`` -- a matrix ``{m}.weight`` or a stack of experts'
matrices such as ``model.layers.0.mlp.experts.gate_up_proj`` -- is stored as two companions:

* ``{base}_blocks`` uint8 ``[..., out, in / 32, 16]``: FP4 E2M1 codes, two per byte, the even
  input column in the low nibble (a block of 32 columns per 16 bytes);
* ``{base}_scales`` uint8 ``[..., out, in / 32]``: each block's E8M0 scale, ``2**(code - 127)``.

A matrix ``{m}.weight`` is found as ``{m}.weight_blocks`` or ``{m}_blocks``. GPT-OSS's experts
are ``[experts, out, in]`` in this convention -- ``gate_up_proj`` ``[E, 2 * intermediate,
hidden]`` with the gate and up rows interleaved (even rows gate, odd rows up), ``down_proj`` ``[E,
hidden, intermediate]`` -- the transpose of the ``[E, in, out]`` tensors transformers' GptOss
computes with. :func:`read_experts` gives one ``[out, in]`` weight per expert; :meth:`read
<Mxfp4Format.read>` of a stack gives them stacked along the rows, ``[E * out, in]``.

The weights come out as ``mxfp4`` codes (the blocks, ``[out, in / 2]``) with float32 scales
``[out, in / 32]`` in blocks ``(1, 32)``; inputs stay at full precision.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import QuantizationError
from metrale.kernels.quantized import QuantizedWeight, concatenate_weights, e8m0_to_float32
from metrale.loading.config_fields import ConfigFields
from metrale.loading.quantization.base import WeightFormat, block_part, check_shape, module_of, register_format

#: Columns per MXFP4 block (one E8M0 scale each).
MXFP4_BLOCK = 32
#: Bytes of FP4 codes per block.
BLOCK_BYTES = MXFP4_BLOCK // 2


def stored_base(checkpoint: Any, name: str) -> str | None:
    """The stored base ``{base}`` of ``name`` (``{base}_blocks`` and ``{base}_scales`` both
    stored), or None when ``name`` is not stored as MXFP4."""
    candidates = [name]
    module = module_of(name)
    if module is not None:
        candidates.append(module)
    for base in candidates:
        if checkpoint.has_stored(f"{base}_blocks") and checkpoint.has_stored(f"{base}_scales"):
            return base
    return None


def _stored_shape(checkpoint: Any, base: str) -> tuple[int, ...]:
    """``(..., out, in)`` of ``{base}``, its companions' shapes checked."""
    blocks = checkpoint.info(f"{base}_blocks").shape
    scales = checkpoint.info(f"{base}_scales").shape
    if len(blocks) < 3 or blocks[-1] != BLOCK_BYTES:
        raise QuantizationError(f"{checkpoint.path}: {base}_blocks has shape {list(blocks)}, expected "
                                f"[..., out, in / {MXFP4_BLOCK}, {BLOCK_BYTES}]")
    check_shape(f"{base}_scales", scales, blocks[:-1], "the E8M0 scales")
    return tuple(blocks[:-2]) + (blocks[-2] * MXFP4_BLOCK,)


def _weight(blocks: np.ndarray, scales: np.ndarray, rows: slice | None, columns: slice | None,
            name: str) -> QuantizedWeight:
    """One ``[out, in]`` weight of ``blocks`` uint8 ``[out, in / 32, 16]`` and ``scales`` uint8
    ``[out, in / 32]``, its ``rows`` / ``columns`` only."""
    inner = scales.shape[1] * MXFP4_BLOCK  # a whole number of blocks: every part ends on a block edge
    row_part = rows if rows is not None else slice(None)
    column_blocks = block_part(columns, inner, MXFP4_BLOCK, "columns", name) or slice(None)
    blocks = blocks[row_part, column_blocks]
    codes = np.ascontiguousarray(blocks).reshape(blocks.shape[0], -1)  # [out, in / 2], low nibble first
    block_scales = e8m0_to_float32(np.ascontiguousarray(scales[row_part, column_blocks]))
    return QuantizedWeight("mxfp4", np.ascontiguousarray(codes), block_scales, (1, MXFP4_BLOCK),
                           (codes.shape[0], 2 * codes.shape[1]), activations="weight_only",
                           source="mxfp4 (E2M1, E8M0 blocks of 32)")


def _read_stored(checkpoint: Any, base: str) -> tuple[np.ndarray, np.ndarray]:
    _stored_shape(checkpoint, base)
    blocks = np.asarray(checkpoint.raw(f"{base}_blocks"))
    scales = np.asarray(checkpoint.raw(f"{base}_scales"))
    checkpoint.skip([f"{base}_blocks", f"{base}_scales"])
    return blocks, scales


def read_experts(checkpoint: Any, base: str, rows: slice | None = None,
                 columns: slice | None = None) -> list[QuantizedWeight]:
    """One ``[out, in]`` weight per expert of the stacked experts tensor ``base`` (stored as
    ``{base}_blocks`` ``[E, out, in / 32, 16]`` and ``{base}_scales``), each its ``rows`` /
    ``columns`` only when given."""
    stored = stored_base(checkpoint, base)
    if stored is None:
        raise QuantizationError(f"{checkpoint.path}: {base} is not stored as MXFP4 ({base}_blocks and {base}_scales)")
    if len(_stored_shape(checkpoint, stored)) != 3:
        raise QuantizationError(f"{checkpoint.path}: {stored}_blocks is not a stack of experts' matrices "
                                f"[experts, out, in / {MXFP4_BLOCK}, {BLOCK_BYTES}]")
    blocks, scales = _read_stored(checkpoint, stored)
    return [_weight(blocks[expert], scales[expert], rows, columns, base) for expert in range(blocks.shape[0])]


@register_format("mxfp4")
class Mxfp4Format(WeightFormat):
    """The MXFP4 reader (the module docstring). Which tensors are quantized is read from the
    checkpoint (the ``_blocks`` / ``_scales`` companions), so ``modules_to_not_convert`` needs no
    reading: the modules it lists are stored at full precision."""

    method = "mxfp4"

    def __init__(self, config: ConfigFields) -> None:
        self.source = config.source

    def holds(self, checkpoint: Any, name: str) -> bool:
        return stored_base(checkpoint, name) is not None

    def shape(self, checkpoint: Any, name: str) -> tuple[int, ...]:
        base = stored_base(checkpoint, name)
        assert base is not None
        return _stored_shape(checkpoint, base)

    def read(self, checkpoint: Any, name: str, rows: slice | None = None,
             columns: slice | None = None) -> QuantizedWeight:
        """The weight ``name``; a stack of experts comes as one ``[E * out, in]`` weight (``rows``
        / ``columns`` then taken from each expert's matrix)."""
        base = stored_base(checkpoint, name)
        assert base is not None
        dims = len(_stored_shape(checkpoint, base))
        if dims == 3:
            return concatenate_weights(read_experts(checkpoint, name, rows, columns))
        if dims != 2:
            raise QuantizationError(f"{checkpoint.path}: {base}_blocks holds a {dims}-dimensional tensor; MXFP4 is "
                                    "served for matrices and stacks of experts' matrices")
        blocks, scales = _read_stored(checkpoint, base)
        return _weight(blocks, scales, rows, columns, name)

    def describe(self) -> str:
        return "MXFP4 (FP4 E2M1, E8M0 scales per 32 columns)"


__all__ = ["MXFP4_BLOCK", "Mxfp4Format", "read_experts", "stored_base"]
