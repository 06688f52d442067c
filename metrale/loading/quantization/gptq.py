"""GPTQ (``quant_method: "gptq"``) and AWQ (``quant_method: "awq"``) checkpoints: integer weights
in groups of input columns, one scale and one zero point per output row and group.

GPTQ, as AutoGPTQ and GPTQModel store it -- each quantized module ``{m}`` holds:

* ``{m}.qweight`` int32 ``[in * bits / 32, out]``: packed along the input dimension, value ``k``
  of a word (input column ``32 / bits * word + k``) at bits ``k * bits``;
* ``{m}.qzeros`` int32 ``[groups, out * bits / 32]``: the zero points, packed along the output
  dimension the same way;
* ``{m}.scales`` float16 ``[groups, out]``;
* ``{m}.g_idx`` int32 ``[in]``: each input column's group (``c // group_size`` unless
  ``desc_act`` reordered the columns; older checkpoints may leave it out).

``bits`` 4 or 8; ``group_size`` (-1: one group over all columns); ``sym``; ``desc_act``.
``checkpoint_format`` (or ``format``, also under ``meta``) ``"gptq"`` stores each zero point minus
one (the real zero is ``qzeros + 1``); GPTQModel's ``"gptq_v2"`` stores it as it is.
``modules_to_not_convert`` lists full-precision modules; GPTQModel's ``dynamic`` maps module
patterns to overrides: ``"-:pattern"`` leaves matching modules at full precision, any other key
(``"+:pattern"`` or a bare pattern) overrides ``bits``, ``group_size``, ``desc_act`` or ``sym``.

AWQ, as AutoAWQ stores it (``version: "gemm"``, 4 bits, ``zero_point: true``):

* ``{m}.qweight`` int32 ``[in, out / 8]``: packed along the output dimension, the eight nibbles
  of a word (from bit 0) holding output columns ``8 * word + [0, 2, 4, 6, 1, 3, 5, 7]``;
* ``{m}.qzeros`` int32 ``[groups, out / 8]``, interleaved the same way;
* ``{m}.scales`` float16 ``[groups, out]``.

Either way a weight is ``(q - zero) * scale``; the weight comes out as ``int4`` / ``int8`` codes
``[out, in]`` with scales and zero points ``[out, groups]`` in blocks ``(1, group)``, the columns
of an act-order weight sorted by group (``input_order``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
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
    check_shape,
    float_tensor,
    matches,
    module_of,
    on_whole_bytes,
    register_format,
    sliced,
)

#: Bits per weight served (the engine's ``int4`` and ``int8`` codes).
SERVED_BITS = (4, 8)
#: GPTQ ``checkpoint_format`` values served, and the offset each adds to the stored zero points.
GPTQ_ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}
#: AutoAWQ's GEMM packing: nibble ``i`` of a word holds output column ``AWQ_PACK_ORDER[i]`` of its eight.
AWQ_PACK_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
#: The nibble holding each of a word's eight output columns (the inverse of :data:`AWQ_PACK_ORDER`).
AWQ_UNPACK_ORDER = np.argsort(AWQ_PACK_ORDER)
#: The ``dynamic`` override fields that change how a module is stored.
DYNAMIC_STORAGE_FIELDS = ("bits", "group_size", "desc_act", "sym")


@dataclass(frozen=True)
class IntegerScheme:
    """How one module's integer weights are stored."""

    bits: int
    group_size: int  # -1: one group over all input columns
    desc_act: bool
    symmetric: bool


def _check_bits(bits: Any, source: str, what: str) -> int:
    if bits not in SERVED_BITS:
        raise UnsupportedQuantizationError(f"{source}: {what} {bits}-bit weights are not served "
                                           f"(bits: {', '.join(map(str, SERVED_BITS))})")
    return int(bits)


def _check_group(group_size: Any, source: str) -> int:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or (group_size < 1 and group_size != -1):
        raise UnsupportedQuantizationError(f"{source}: group_size {group_size!r} is not served "
                                           "(a positive int, or -1 for one group over all columns)")
    return group_size


def _excluded(config: ConfigFields) -> tuple[str, ...]:
    return tuple(config.texts("modules_to_not_convert", None, null=None) or ())


def _unpack_words(words: np.ndarray, bits: int) -> np.ndarray:
    """uint8 ``[..., words, 32 / bits]``: the ``bits``-bit values of int32 ``words``, value ``k``
    of a word from bit ``k * bits``."""
    words = np.ascontiguousarray(words).view(np.uint32)
    shifts = np.arange(32 // bits, dtype=np.uint32) * np.uint32(bits)
    return ((words[..., None] >> shifts) & np.uint32((1 << bits) - 1)).astype(np.uint8)


def _zero_points(zeros: np.ndarray, bits: int) -> np.ndarray | None:
    """float32 zero points, or None when each is the implied ``2**(bits - 1)``."""
    if np.all(zeros == 1 << (bits - 1)):
        return None
    return np.ascontiguousarray(zeros, dtype=np.float32)


class _GroupedIntegerFormat(WeightFormat):
    """What GPTQ and AWQ share: which modules are quantized, the output, its slicing."""

    source = ""

    def scheme_of(self, module: str) -> IntegerScheme | None:
        raise NotImplementedError

    def holds(self, checkpoint: Any, name: str) -> bool:
        module = module_of(name)
        if module is None or self.scheme_of(module) is None:
            return False
        return checkpoint.has_stored(f"{module}.qweight") and checkpoint.has_stored(f"{module}.scales")

    def _finish(self, checkpoint: Any, name: str, scheme: IntegerScheme, codes: np.ndarray, scales: np.ndarray,
                zeros: np.ndarray | None, g_idx: np.ndarray | None, inner: int, rows: slice | None,
                columns: slice | None, source: str, as_stored: bool = False) -> QuantizedWeight:
        """The weight of ``codes`` uint8 ``[rows, in]`` and ``scales`` / ``zeros`` float32
        ``[rows, groups]`` (the rows already taken), its columns sorted by group (``g_idx``, None
        when already in order) and taken. ``as_stored``: ``codes`` are already the kernels' bytes
        (8-bit codes, or :func:`pack_nibbles`' bytes), in group order, ``columns`` on whole bytes."""
        group = scheme.group_size if scheme.group_size > 0 else inner
        if as_stored:
            if columns is not None:
                column_blocks = block_part(columns, inner, group, "columns", name) if group < inner else None
                scales = sliced(scales, None, column_blocks)
                zeros = None if zeros is None else sliced(zeros, None, column_blocks)
            codes, count = byte_columns(codes, scheme.bits, inner, columns)
            module = name[: -len(".weight")]
            checkpoint.skip([f"{module}.{companion}" for companion in ("qweight", "qzeros", "scales", "g_idx")])
            return QuantizedWeight(
                f"int{scheme.bits}", np.ascontiguousarray(codes), np.ascontiguousarray(scales, np.float32),
                (1, min(group, count) if count else group), (codes.shape[0], count),
                zeros=None if zeros is None else np.ascontiguousarray(zeros, np.float32),
                activations="weight_only", source=source)
        order = None
        if g_idx is not None:
            if columns is not None:
                raise UnsupportedQuantizationError(f"{name}: act-order (g_idx) weights are not split by columns "
                                                   "over ranks")
            codes, scales, zeros, order = act_order_columns(g_idx, codes, scales, zeros, group, name)
        if columns is not None:
            column_blocks = block_part(columns, inner, group, "columns", name) if group < inner else None
            codes = codes[:, columns]
            scales = sliced(scales, None, column_blocks)
            zeros = None if zeros is None else sliced(zeros, None, column_blocks)
        shape = codes.shape
        if scheme.bits == 4:
            codes = pack_nibbles(codes)
        module = name[: -len(".weight")]
        checkpoint.skip([f"{module}.{companion}" for companion in ("qweight", "qzeros", "scales", "g_idx")])
        return QuantizedWeight(
            f"int{scheme.bits}", np.ascontiguousarray(codes), np.ascontiguousarray(scales, np.float32),
            (1, min(group, shape[1]) if shape[1] else group), (shape[0], shape[1]),
            zeros=None if zeros is None else np.ascontiguousarray(zeros, np.float32),
            input_order=order, activations="weight_only", source=source)


# ------------------------------------------------------------------------------------- GPTQ


@register_format("gptq")
class GptqFormat(_GroupedIntegerFormat):
    """The GPTQ reader (the module docstring)."""

    method = "gptq"

    def __init__(self, config: ConfigFields) -> None:
        self.source = config.source
        self.scheme = IntegerScheme(
            bits=_check_bits(config.integer("bits", 4), config.source, "GPTQ"),
            group_size=_check_group(config.integer("group_size", 128, minimum=-1), config.source),
            desc_act=config.flag("desc_act", False),
            symmetric=config.flag("sym", True),
        )
        if config.flag("is_marlin_format", False):
            raise UnsupportedQuantizationError(f"{config.source}: GPTQ checkpoints saved in the Marlin layout are not "
                                               f"served (checkpoint formats: {', '.join(GPTQ_ZERO_OFFSETS)})")
        self.checkpoint_format = _gptq_checkpoint_format(config)
        self.zero_offset = GPTQ_ZERO_OFFSETS[self.checkpoint_format]
        pack_dtype = config.text("pack_dtype", "int32")
        if pack_dtype not in ("int32", "torch.int32"):
            raise UnsupportedQuantizationError(f"{config.source}: GPTQ pack_dtype {pack_dtype!r} is not served "
                                               "(int32 is)")
        self.ignore = _excluded(config)
        self.overrides = _dynamic_overrides(config, self.scheme)

    def scheme_of(self, module: str) -> IntegerScheme | None:
        if matches(module, self.ignore, linear=False):
            return None
        for pattern, override in self.overrides:
            if re.match(pattern, module):
                return override
        return self.scheme

    def shape(self, checkpoint: Any, name: str) -> tuple[int, ...]:
        module = name[: -len(".weight")]
        scheme = self.scheme_of(module)
        assert scheme is not None
        packed_rows, out = checkpoint.info(f"{module}.qweight").shape
        g_idx_name = f"{module}.g_idx"
        if checkpoint.has_stored(g_idx_name):
            return out, checkpoint.info(g_idx_name).shape[0]
        return out, packed_rows * (32 // scheme.bits)

    def read(self, checkpoint: Any, name: str, rows: slice | None = None,
             columns: slice | None = None) -> QuantizedWeight:
        module = name[: -len(".weight")]
        scheme = self.scheme_of(module)
        assert scheme is not None
        bits, per_word = scheme.bits, 32 // scheme.bits
        out, inner = self.shape(checkpoint, name)
        group = scheme.group_size if scheme.group_size > 0 else inner
        groups = -(-inner // group)
        qweight_name, qzeros_name, scales_name = (f"{module}.{part}" for part in ("qweight", "qzeros", "scales"))
        qweight = np.asarray(checkpoint.raw(qweight_name))
        check_shape(qweight_name, qweight.shape, (-(-inner // per_word), out), f"the {bits}-bit packed weight")
        scales = float_tensor(checkpoint, scales_name)
        check_shape(scales_name, scales.shape, (groups, out), "the scales")
        qzeros = np.asarray(checkpoint.raw(qzeros_name))
        check_shape(qzeros_name, qzeros.shape, (groups, -(-out // per_word)), f"the {bits}-bit packed zero points")
        g_idx = None
        if checkpoint.has_stored(f"{module}.g_idx"):
            g_idx = np.asarray(checkpoint.raw(f"{module}.g_idx")).astype(np.int64).reshape(-1)
            if np.array_equal(g_idx, np.arange(inner) // group):
                g_idx = None  # columns already in group order
        # Only the rank's rows (output columns of the stored tensors) are unpacked.
        row_part = rows if rows is not None else slice(None)
        as_stored = g_idx is None and inner % (32 // bits) == 0 and on_whole_bytes(bits, inner, columns)
        if as_stored:
            # [in / per_word, rows] words -> [rows, in / per_word] words, whose little-endian bytes
            # are the codes (8-bit) or pack_nibbles' bytes (4-bit: value k of a word from bit 4k).
            codes = np.ascontiguousarray(qweight[:, row_part].T).view(np.uint8)
        else:
            # [in / per_word, rows] words -> [in, rows] values -> [rows, in]
            codes = _unpack_words(qweight[:, row_part], bits).transpose(0, 2, 1).reshape(-1,
                                                                                          qweight[:, row_part].shape[1])
            codes = np.ascontiguousarray(codes[:inner].T)
        stored_zeros = _unpack_words(qzeros, bits).reshape(groups, -1)[:, :out][:, row_part].astype(np.int32)
        zeros = _zero_points((stored_zeros + self.zero_offset).T, bits)
        scales = np.ascontiguousarray(scales[:, row_part].T)
        return self._finish(checkpoint, name, scheme, codes, scales, zeros, g_idx, inner, rows, columns,
                            f"gptq {self.checkpoint_format} (int{bits}, group {scheme.group_size}"
                            f"{', act-order' if g_idx is not None else ''})", as_stored=as_stored)

    def describe(self) -> str:
        return f"GPTQ ({self.checkpoint_format}, {self.scheme.bits}-bit, group {self.scheme.group_size})"


def _gptq_checkpoint_format(config: ConfigFields) -> str:
    """``checkpoint_format`` of the config (``format`` as GPTQModel also names it, at the top or
    under ``meta``), checked; ``"gptq"`` when none is given."""
    meta = config.section("meta")
    for fields in (config, meta):
        if fields is None:
            continue
        for key in ("checkpoint_format", "format"):
            value = fields.text(key, None)
            if value is not None:
                if value not in GPTQ_ZERO_OFFSETS:
                    raise UnsupportedQuantizationError(
                        f"{config.source}: GPTQ {fields.prefix}{key} {value!r} is not served; served: "
                        f"{', '.join(GPTQ_ZERO_OFFSETS)}")
                return value
    return "gptq"


def _dynamic_overrides(config: ConfigFields, base: IntegerScheme) -> list[tuple[str, IntegerScheme | None]]:
    """GPTQModel's ``dynamic`` as ``(pattern, scheme)`` in the config's order (None: the module
    is left at full precision)."""
    dynamic = config.section("dynamic")
    if dynamic is None:
        return []
    overrides: list[tuple[str, IntegerScheme | None]] = []
    for key in dynamic.values:
        if key.startswith("-:"):
            overrides.append((key[2:], None))
            continue
        fields = dynamic.section(key)
        if fields is None:
            raise UnsupportedQuantizationError(f"{config.source}: dynamic[{key!r}] is not an object of overrides")
        changes: dict[str, Any] = {}
        if fields.present("bits"):
            changes["bits"] = _check_bits(fields.integer("bits"), config.source, f"dynamic[{key!r}]")
        if fields.present("group_size"):
            changes["group_size"] = _check_group(fields.integer("group_size", minimum=-1), config.source)
        if fields.present("desc_act"):
            changes["desc_act"] = fields.flag("desc_act")
        if fields.present("sym"):
            changes["symmetric"] = fields.flag("sym")
        if fields.text("pack_dtype", "int32") not in ("int32", "torch.int32"):
            raise UnsupportedQuantizationError(f"{config.source}: dynamic[{key!r}] pack_dtype is not served "
                                               "(int32 is)")
        overrides.append((key[2:] if key.startswith("+:") else key, replace(base, **changes)))
    return overrides


# -------------------------------------------------------------------------------------- AWQ


@register_format("awq")
class AwqFormat(_GroupedIntegerFormat):
    """The AWQ reader (the module docstring)."""

    method = "awq"

    def __init__(self, config: ConfigFields) -> None:
        self.source = config.source
        version = config.text("version", "gemm")
        if version.lower() != "gemm":
            raise UnsupportedQuantizationError(f"{config.source}: AWQ version {version!r} is not served (gemm is)")
        backend = config.text("backend", "autoawq")
        if backend != "autoawq":
            raise UnsupportedQuantizationError(f"{config.source}: AWQ backend {backend!r} is not served "
                                               "(autoawq's GEMM layout is)")
        bits = config.integer("bits", None) if config.present("bits") else config.integer("w_bit", 4)
        if bits != 4:
            raise UnsupportedQuantizationError(f"{config.source}: AWQ {bits}-bit weights are not served (4-bit are)")
        group_size = config.integer("group_size", None, minimum=-1) if config.present("group_size") \
            else config.integer("q_group_size", 128, minimum=-1)
        if not config.flag("zero_point", True):
            raise UnsupportedQuantizationError(f"{config.source}: AWQ without zero points is not served "
                                               "(zero_point: true is)")
        self.scheme = IntegerScheme(bits=4, group_size=_check_group(group_size, config.source), desc_act=False,
                                    symmetric=False)
        self.ignore = _excluded(config)

    def scheme_of(self, module: str) -> IntegerScheme | None:
        return None if matches(module, self.ignore, linear=False) else self.scheme

    def shape(self, checkpoint: Any, name: str) -> tuple[int, ...]:
        module = name[: -len(".weight")]
        inner = checkpoint.info(f"{module}.qweight").shape[0]
        return checkpoint.info(f"{module}.scales").shape[1], inner

    def read(self, checkpoint: Any, name: str, rows: slice | None = None,
             columns: slice | None = None) -> QuantizedWeight:
        module = name[: -len(".weight")]
        out, inner = self.shape(checkpoint, name)
        group = self.scheme.group_size if self.scheme.group_size > 0 else inner
        groups = -(-inner // group)
        qweight_name, qzeros_name, scales_name = (f"{module}.{part}" for part in ("qweight", "qzeros", "scales"))
        qweight = np.asarray(checkpoint.raw(qweight_name))
        check_shape(qweight_name, qweight.shape, (inner, -(-out // 8)), "the 4-bit packed weight")
        scales = float_tensor(checkpoint, scales_name)
        check_shape(scales_name, scales.shape, (groups, out), "the scales")
        qzeros = np.asarray(checkpoint.raw(qzeros_name))
        check_shape(qzeros_name, qzeros.shape, (groups, -(-out // 8)), "the 4-bit packed zero points")
        start, stop, _ = (rows or slice(None)).indices(out)
        stop = max(start, stop)
        # Only the words holding the rank's rows are unpacked: words [start // 8, ceil(stop / 8)).
        words = slice(start // 8, -(-stop // 8))
        part = slice(start - 8 * words.start, stop - 8 * words.start)
        codes = _awq_unpack(qweight[:, words])[:, part].T  # [in, rows] -> [rows, in]
        zeros = _zero_points(_awq_unpack(qzeros[:, words])[:, part].T, 4)
        scales = np.ascontiguousarray(scales[:, start:stop].T)
        return self._finish(checkpoint, name, self.scheme, np.ascontiguousarray(codes), scales, zeros, None, inner,
                            rows, columns, f"awq gemm (int4, group {self.scheme.group_size})")

    def describe(self) -> str:
        return f"AWQ (gemm, 4-bit, group {self.scheme.group_size})"


def _awq_unpack(words: np.ndarray) -> np.ndarray:
    """uint8 ``[rows, 8 * words]``: AutoAWQ's interleaved nibbles of int32 ``[rows, words]`` in
    column order."""
    nibbles = _unpack_words(words, 4)  # [rows, words, 8], in packing order
    return nibbles[..., AWQ_UNPACK_ORDER].reshape(words.shape[0], -1)


__all__ = ["AwqFormat", "GptqFormat", "IntegerScheme"]
