"""compressed-tensors checkpoints (``quant_method: "compressed-tensors"``), as llm-compressor writes
them and vLLM loads them.

``config_groups`` give each group of modules (``targets``: ``"Linear"``, ``"re:…"`` patterns or
names; ``ignore`` leaves modules out) a ``weights`` scheme and optionally an ``input_activations``
one; ``format`` (of the config, or of a group) says how the weights are stored:

* ``float-quantized`` / ``naive-quantized`` with 8-bit floats -- ``{m}.weight`` FP8 E4M3 and
  ``{m}.weight_scale`` (``strategy`` tensor ``[1]``, channel ``[out, 1]``, block ``[out/b0, in/b1]``,
  group ``[out, in/g]``); static inputs add ``{m}.input_scale``;
* ``int-quantized`` / ``naive-quantized`` with integers -- ``{m}.weight`` int8, ``weight_scale``
  and, asymmetric, ``weight_zero_point``;
* ``pack-quantized`` -- ``{m}.weight_packed`` int32 (values plus ``2**(bits-1)``, packed densely
  along each row from bit 0), ``weight_scale`` ``[out, in/g]`` (or ``[out, 1]``), ``weight_shape``
  and, asymmetric, ``weight_zero_point`` packed the same way along the columns of its
  transpose; ``actorder`` adds ``weight_g_idx``.

A weight is dequantized as ``(q - zero_point) * scale``; inputs quantized dynamically per token
(``strategy: token``) or statically per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from metrale.errors import UnsupportedQuantizationError
from metrale.kernels.quantized import QuantizedWeight, pack_nibbles
from metrale.loading.config_fields import ConfigFields
from metrale.loading.quantization.base import (
    WeightFormat,
    act_order_columns,
    block_part,
    byte_columns,
    check_scales_stored,
    check_shape,
    float_tensor,
    matches,
    module_of,
    on_whole_bytes,
    register_format,
    sliced,
)

#: ``format`` values served, and those refused with a reason.
SERVED_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
WEIGHT_STRATEGIES = ("tensor", "channel", "group", "block")


@dataclass(frozen=True)
class Scheme:
    """One config group's scheme, checked."""

    targets: tuple[str, ...]
    kind: str  # "float" | "int"
    bits: int
    strategy: str
    symmetric: bool
    group_size: int | None
    block_structure: tuple[int, int] | None
    activations: str
    storage: str  # the group's format
    actorder: bool


def _parse_scheme(group: ConfigFields, name: str, default_format: str | None) -> Scheme:
    weights = group.section("weights")
    if weights is None:
        raise UnsupportedQuantizationError(f"{group.source}: config group {name!r} quantizes no weights; "
                                           "only weight quantization is served")
    storage = group.text("format", None) or default_format
    if storage is None or storage not in SERVED_FORMATS:
        raise UnsupportedQuantizationError(
            f"{group.source}: compressed-tensors format {storage!r} is not served; served: {', '.join(SERVED_FORMATS)}")
    kind = weights.text("type", "int")
    bits = weights.integer("num_bits", 8)
    strategy = weights.text("strategy", "tensor")
    if strategy not in WEIGHT_STRATEGIES:
        raise UnsupportedQuantizationError(f"{group.source}: weight strategy {strategy!r} is not served; served: "
                                           f"{', '.join(WEIGHT_STRATEGIES)}")
    if kind == "float" and bits != 8:
        raise UnsupportedQuantizationError(f"{group.source}: {bits}-bit float weights are not served "
                                           "(FP8 E4M3 is; MXFP4 as quant_method 'mxfp4')")
    if kind == "int" and bits not in (4, 8):
        raise UnsupportedQuantizationError(f"{group.source}: {bits}-bit integer weights are not served (4 and 8 are)")
    if kind not in ("float", "int"):
        raise UnsupportedQuantizationError(f"{group.source}: weight type {kind!r} is not served (float, int)")
    if weights.flag("dynamic", False) is not False:
        raise UnsupportedQuantizationError(f"{group.source}: dynamic weight quantization is not served")
    actorder = weights.values.get("actorder") not in (None, False, "static")
    block = weights.integers("block_structure", None)
    activations = _activations(group, kind, bits)
    return Scheme(
        targets=tuple(group.texts("targets", ["Linear"])),
        kind=kind, bits=bits, strategy=strategy, symmetric=weights.flag("symmetric", True),
        group_size=weights.integer("group_size", None, null=None) if strategy == "group" else None,
        block_structure=(int(block[0]), int(block[1])) if strategy == "block" and block else None,
        activations=activations, storage=storage, actorder=actorder,
    )


def _activations(group: ConfigFields, weight_kind: str, weight_bits: int) -> str:
    inputs = group.section("input_activations")
    if inputs is None:
        return "weight_only"
    kind, bits = inputs.text("type", "int"), inputs.integer("num_bits", 8)
    strategy, dynamic = inputs.text("strategy", "tensor"), inputs.values.get("dynamic", False)
    if bits != 8 or not inputs.flag("symmetric", True):
        raise UnsupportedQuantizationError(f"{group.source}: {bits}-bit or asymmetric input activations are not served "
                                           "(8-bit symmetric are)")
    if kind == "float" and strategy == "token" and dynamic is True:
        return "fp8_token"
    if kind == "float" and strategy == "tensor" and dynamic is False:
        return "fp8_tensor"
    if kind == "float" and strategy == "tensor" and dynamic is True:
        return "fp8_token"  # a dynamic per-tensor scale is served per token: at least as exact
    if kind == "float" and strategy == "group" and dynamic is True:
        return "fp8_group"
    if kind == "int" and strategy == "token" and dynamic is True:
        return "int8_token"
    raise UnsupportedQuantizationError(
        f"{group.source}: input activations {kind} strategy={strategy} dynamic={dynamic} are not served (served: "
        "float token dynamic, float tensor static, float group dynamic, int token dynamic)")


@register_format("compressed-tensors")
class CompressedTensorsFormat(WeightFormat):
    """The compressed-tensors reader (the module docstring)."""

    method = "compressed-tensors"

    def __init__(self, config: ConfigFields) -> None:
        default_format = config.text("format", None)
        if default_format == "dense":
            default_format = None
        groups = config.section("config_groups")
        if groups is None or not groups.values:
            raise UnsupportedQuantizationError(f"{config.source}: compressed-tensors config has no config_groups")
        self.schemes = []
        for name in groups.values:
            group = groups.section(name)
            if group is None:
                raise UnsupportedQuantizationError(f"{config.source}: config_groups.{name} is not an object")
            self.schemes.append(_parse_scheme(group, name, default_format))
        self.ignore = tuple(config.texts("ignore", []))
        status = config.text("quantization_status", "compressed")
        if status not in ("compressed", "frozen"):
            raise UnsupportedQuantizationError(f"{config.source}: quantization_status {status!r} is not served "
                                               "(a checkpoint saved compressed is)")
        self.kv_cache_scheme = config.section("kv_cache_scheme")
        self.source = config.source

    def scheme_of(self, module: str) -> Scheme | None:
        if matches(module, self.ignore, linear=False):
            return None
        for scheme in self.schemes:
            if matches(module, scheme.targets):
                return scheme
        return None

    def holds(self, checkpoint: Any, name: str) -> bool:
        module = module_of(name)
        if module is None or self.scheme_of(module) is None:
            return False
        return check_scales_stored(checkpoint, name, "weight_scale", self.method)

    def shape(self, checkpoint: Any, name: str) -> tuple[int, ...]:
        module = name[: -len(".weight")]
        if checkpoint.has_stored(f"{module}.weight_shape"):
            return tuple(int(v) for v in np.asarray(checkpoint.raw(f"{module}.weight_shape")).reshape(-1))
        return checkpoint.info(name).shape

    def read(self, checkpoint: Any, name: str, rows: slice | None = None,
             columns: slice | None = None) -> QuantizedWeight:
        module = name[: -len(".weight")]
        scheme = self.scheme_of(module)
        assert scheme is not None
        out, inner = self.shape(checkpoint, name)
        per_row, per_column = _block(scheme, out, inner)
        g_idx_name = f"{module}.weight_g_idx"
        # The stored bytes already as the kernels take them (8-bit codes, or pack_nibbles' bytes).
        as_stored = False
        if scheme.storage == "pack-quantized":
            words = checkpoint.raw(f"{module}.weight_packed")
            offset = 1 << (scheme.bits - 1)  # the packer stored q + 2**(bits-1)
            if _bytes_are_codes(words, scheme.bits, out, inner, columns) and not checkpoint.has_stored(g_idx_name):
                codes, as_stored = _code_bytes(words, scheme.bits, inner), True
            else:
                codes = _unpack_rows(words, scheme.bits, inner)
        else:
            info = checkpoint.info(name)
            raw = np.asarray(checkpoint.raw(name))
            if scheme.kind == "float":
                if info.dtype != "F8_E4M3":
                    raise UnsupportedQuantizationError(f"{checkpoint.path}: {name} is {info.dtype}; FP8 weights "
                                                       "are served as F8_E4M3")
                codes, offset = raw, 0
            else:
                if info.dtype != "I8":
                    raise UnsupportedQuantizationError(f"{checkpoint.path}: {name} is {info.dtype}; integer weights "
                                                       "are served as I8")
                codes, offset = (raw.astype(np.int16) + 128).astype(np.uint8), 128
        if not as_stored:
            check_shape(name, codes.shape, (out, inner), "the unpacked weight")
        scale_name = f"{module}.weight_scale"
        scales = float_tensor(checkpoint, scale_name)
        if per_row == out and per_column == inner:
            scales = scales.reshape(1, 1)  # one scale, stored as [1] or []
        expected = (-(-out // per_row), -(-inner // per_column))
        check_shape(scale_name, scales.shape, expected, "the weight scale")
        zeros = None
        zero_name = f"{module}.weight_zero_point"
        if scheme.kind == "int" and checkpoint.has_stored(zero_name):
            stored_zero = np.asarray(checkpoint.raw(zero_name))
            if scheme.storage == "pack-quantized" and not scheme.symmetric:
                zero = _unpack_rows(stored_zero.T, scheme.bits, expected[0]).T.astype(np.int32) - offset
            else:
                zero = stored_zero.astype(np.int32).reshape(expected) if stored_zero.size == expected[0] * expected[1] \
                    else np.broadcast_to(stored_zero.astype(np.int32).reshape(-1, 1), expected)
            if np.any(zero != 0):
                zeros = (zero + (offset if scheme.kind == "int" else 0)).astype(np.float32)
        order = None
        if checkpoint.has_stored(g_idx_name):
            g_idx = np.asarray(checkpoint.raw(g_idx_name)).astype(np.int64).reshape(-1)
            codes, scales, zeros, order = act_order_columns(g_idx, codes, scales, zeros, per_column, name)
        row_blocks = block_part(rows, out, per_row, "rows", name) if per_row < out else None
        column_blocks = block_part(columns, inner, per_column, "columns", name) if per_column < inner else None
        if order is not None and columns is not None:
            raise UnsupportedQuantizationError(f"{name}: act-order (g_idx) weights are not split by columns over ranks")
        scales = sliced(scales, row_blocks, column_blocks)
        zeros = None if zeros is None else sliced(zeros, row_blocks, column_blocks)
        if as_stored:
            codes, count = byte_columns(sliced(codes, rows, None), scheme.bits, inner, columns)
            shape = (codes.shape[0], count)
        else:
            codes = sliced(codes, rows, columns)
            shape = codes.shape
            if scheme.kind == "int" and scheme.bits == 4:
                codes = pack_nibbles(codes)
        codes_format = "fp8" if scheme.kind == "float" else f"int{scheme.bits}"
        input_scale = None
        if scheme.activations == "fp8_tensor":
            input_scale = np.asarray(float_tensor(checkpoint, f"{module}.input_scale").max(), np.float32)
        for companion in ("weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape", "weight_packed",
                          "input_scale", "input_zero_point"):
            checkpoint.skip([f"{module}.{companion}"])
        checkpoint.skip([name])
        return QuantizedWeight(
            codes_format, np.ascontiguousarray(codes), np.ascontiguousarray(scales, np.float32),
            (per_row if per_row < out else shape[0], per_column if per_column < inner else shape[1]),
            (shape[0], shape[1]), zeros=None if zeros is None else np.ascontiguousarray(zeros),
            input_order=order, activations=scheme.activations, input_scale=input_scale,
            source=f"compressed-tensors {scheme.storage} ({scheme.kind}{scheme.bits}, {scheme.strategy})")

    def describe(self) -> str:
        return "compressed-tensors"


def _block(scheme: Scheme, out: int, inner: int) -> tuple[int, int]:
    """Rows and columns one scale covers."""
    if scheme.strategy == "tensor":
        return out, inner
    if scheme.strategy == "channel":
        return 1, inner
    if scheme.strategy == "group":
        if not scheme.group_size:
            raise UnsupportedQuantizationError("a group strategy needs a group_size")
        return 1, scheme.group_size
    if scheme.block_structure is None:
        raise UnsupportedQuantizationError("a block strategy needs a block_structure")
    return scheme.block_structure


def _bytes_are_codes(words: Any, bits: int, rows: int, columns: int, part: slice | None) -> bool:
    """Whether the little-endian bytes of ``pack-quantized`` words (``[rows, ceil(columns /
    (32 / bits))]``, values from bit 0) are the codes as the kernels take them: 8-bit codes one a
    byte, 4-bit ones two a byte with the even column in the low nibble (:func:`pack_nibbles`), a
    column range ``part`` on whole bytes."""
    return tuple(np.shape(words)) == (rows, -(-columns // (32 // bits))) and on_whole_bytes(bits, columns, part)


def _code_bytes(words: Any, bits: int, columns: int) -> np.ndarray:
    """uint8 ``[rows, ceil(columns bits / 8)]``: the bytes of :func:`_bytes_are_codes`' words."""
    stored = np.ascontiguousarray(words).view(np.uint8).reshape(np.shape(words)[0], -1)
    return stored[:, : -(-columns * bits // 8)]


def _unpack_rows(words: np.ndarray, bits: int, columns: int) -> np.ndarray:
    """uint8 ``[rows, columns]``: the ``bits``-bit values packed densely from bit 0 of each
    row's int32 words."""
    words = np.ascontiguousarray(words).view(np.uint32)
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)
    values = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return values.reshape(words.shape[0], -1)[:, :columns].astype(np.uint8)
