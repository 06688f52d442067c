"""The pieces every quantized-checkpoint reader shares: the :class:`WeightFormat` protocol, the
registry of formats by ``quant_method``, online FP8, and helpers for names, blocks and parts."""

from __future__ import annotations

import re
import weakref
from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np

from metrale.errors import QuantizationError, UnsupportedQuantizationError
from metrale.kernels.quantized import QuantizedWeight, concatenate_weights, quantize_fp8_per_channel
from metrale.loading.config_fields import ConfigFields

#: Online quantization methods (``quantization=``), as vLLM names them.
ONLINE_METHODS = ("fp8",)


class WeightFormat:
    """How one checkpoint stores its quantized weights.

    A weight is named as a family reads it, ``{module}.weight``; a format answers for that name
    whatever tensors it stores it as (``weight_packed``, ``qweight``, ``_blocks``, ...)."""

    #: ``quant_method`` of ``config.json`` (or the online method).
    method: str = ""
    #: Whether the weights are stored at full precision and quantized at load (``quantization=``).
    online: bool = False

    def holds(self, checkpoint: Any, name: str) -> bool:
        """Whether ``name`` is stored quantized in this format."""
        raise NotImplementedError

    def shape(self, checkpoint: Any, name: str) -> tuple[int, ...]:
        """The shape of the matrix ``name`` stands for (a held weight)."""
        raise NotImplementedError

    def read(self, checkpoint: Any, name: str, rows: slice | None = None,
             columns: slice | None = None) -> QuantizedWeight:
        """The held weight ``name`` (its ``rows`` / ``columns`` only, when given) as host arrays."""
        raise NotImplementedError

    def describe(self) -> str:
        """The format in words, for messages and the benchmark's report."""
        return self.method


# ------------------------------------------------------------------------------ the registry

#: ``quant_method`` -> a builder taking the ``quantization_config`` fields.
FORMATS: dict[str, Callable[[ConfigFields], WeightFormat]] = {}


def register_format(method: str) -> Callable[[Callable[[ConfigFields], WeightFormat]], Callable[[ConfigFields], WeightFormat]]:
    """Register the builder of a checkpoint format under its ``quant_method``."""

    def register(builder: Callable[[ConfigFields], WeightFormat]) -> Callable[[ConfigFields], WeightFormat]:
        FORMATS[method] = builder
        return builder

    return register


# ------------------------------------------------------------------------- shared helpers


def module_of(name: str) -> str | None:
    """``{module}`` of a weight name ``{module}.weight`` (None for any other name)."""
    return name[: -len(".weight")] if name.endswith(".weight") else None


def matches(module: str, targets: Sequence[str], *, linear: bool = True) -> bool:
    """Whether ``module`` matches one of ``targets`` as compressed-tensors and the HF configs
    name modules: ``"Linear"`` (any linear layer), ``"re:PATTERN"`` (a regular expression matched
    from the start), or a name equal to the module's or to one of its trailing parts."""
    for target in targets:
        if target == "Linear" and linear:
            return True
        if target.startswith("re:"):
            if re.match(target[3:], module):
                return True
        elif module == target or module.endswith("." + target) or ("." + target + ".") in ("." + module + "."):
            return True
    return False


def float_tensor(checkpoint: Any, name: str, rows: slice | None = None, columns: slice | None = None) -> np.ndarray:
    """A companion tensor (a scale, a zero point) as float32, its ``rows``/``columns`` only."""
    return checkpoint.stored_tensor(name, rows=rows, columns=columns)


def sliced(array: np.ndarray, rows: slice | None, columns: slice | None) -> np.ndarray:
    """``array[rows][:, columns]`` (either None: all)."""
    array = array[rows if rows is not None else slice(None)]
    return array if columns is None else array[:, columns]


def on_whole_bytes(bits: int, columns: int, part: slice | None) -> bool:
    """Whether ``bits``-bit codes of rows of ``columns`` (a whole number of bytes), packed from
    bit 0 of each byte, split at ``part`` (a column range, None: all) on whole bytes."""
    if bits not in (4, 8) or columns * bits % 8:
        return False
    if part is None:
        return True
    first, last, step = part.indices(columns)
    return step == 1 and first * bits % 8 == 0 and last * bits % 8 == 0


def byte_columns(codes: np.ndarray, bits: int, columns: int, part: slice | None) -> tuple[np.ndarray, int]:
    """``(bytes, count)``: the byte columns of packed ``codes`` holding the column range ``part``
    of ``columns`` (on whole bytes, :func:`on_whole_bytes`), and how many columns that is."""
    first, last, _ = (part or slice(None)).indices(columns)
    if part is not None:
        codes = codes[:, first * bits // 8 : last * bits // 8]
    return codes, last - first


def block_part(part: slice | None, size: int, per: int, what: str, name: str) -> slice | None:
    """The blocks of ``per`` that the element range ``part`` of ``size`` covers, refused unless
    the range starts on a block edge and ends on one (or at the end)."""
    if part is None:
        return None
    start, stop, _ = part.indices(size)
    if start % per or (stop % per and stop != size):
        raise QuantizationError(
            f"{name}: a rank's {what} [{start}, {stop}) does not fall on the quantization blocks of {per}; "
            "use a tensor_parallel_size whose parts are multiples of the block")
    return slice(start // per, -(-stop // per))


def check_scales_stored(checkpoint: Any, name: str, scale_suffix: str, method: str) -> bool:
    """Whether ``name``'s module stores its ``scale_suffix`` tensor; refused
    (:class:`~metrale.errors.QuantizationError`) when the checkpoint stores no such tensor at all
    (a ``quantization_config`` over full-precision tensors) or stores ``name`` as 8-bit codes
    without it: such weights are never read as if they were not quantized."""
    module = name[: -len(".weight")]
    if checkpoint.has_stored(f"{module}.{scale_suffix}"):
        return True
    if not _stores_any(checkpoint, scale_suffix):
        raise QuantizationError(
            f"{checkpoint.path}: config.json's quantization_config says {method}, but no tensor stores a "
            f"{scale_suffix}: the checkpoint's weights are not quantized as its config says")
    if checkpoint.has_stored(name) and checkpoint.info(name).dtype in ("F8_E4M3", "I8", "U8"):
        raise QuantizationError(f"{checkpoint.path}: {name} is stored as {checkpoint.info(name).dtype} codes "
                                f"without its {module}.{scale_suffix}")
    return False


_SCALES_STORED: "weakref.WeakKeyDictionary[Any, dict[str, bool]]" = weakref.WeakKeyDictionary()


def _stores_any(checkpoint: Any, suffix: str) -> bool:
    """Whether any tensor of ``checkpoint`` is named ``*.{suffix}`` (looked up once per checkpoint)."""
    found = _SCALES_STORED.setdefault(checkpoint, {})
    if suffix not in found:
        found[suffix] = any(stored.endswith("." + suffix) for stored in checkpoint.names())
    return found[suffix]


def check_shape(name: str, got: Sequence[int], expected: Sequence[int], what: str) -> None:
    if tuple(got) != tuple(expected):
        raise QuantizationError(f"{name}: {what} has shape {list(got)}, expected {list(expected)}")


# ------------------------------------------------------------------------------ online fp8

#: Weights online quantization leaves at full precision: the embedding, the LM head, routers.
ONLINE_SKIPPED = ("embed_tokens", "lm_head", "mlp.gate", "shared_expert_gate")


class OnlineFp8(WeightFormat):
    """``quantization="fp8"``: every linear layer's matrix of a full-precision checkpoint quantized
    at load to FP8 E4M3 with one scale per output channel, inputs quantized per token at run time
    (vLLM's online FP8 with channel-wise weight scales)."""

    method = "fp8 (online)"
    online = True
    #: The codes it writes (a backend may quantize on its device instead, to the same codes).
    codes_format = "fp8"

    def holds(self, checkpoint: Any, name: str) -> bool:
        module = module_of(name)
        if module is None or not checkpoint.has_stored(name) or len(checkpoint.info(name).shape) != 2:
            return False
        return not any(module == s or module.endswith("." + s) for s in ONLINE_SKIPPED)

    def shape(self, checkpoint: Any, name: str) -> tuple[int, ...]:
        return checkpoint.info(name).shape

    def read(self, checkpoint: Any, name: str, rows: slice | None = None,
             columns: slice | None = None) -> QuantizedWeight:
        # Whole rows are quantized, then a rank's columns taken: a row's scale is the same on every
        # rank of a tensor-parallel group as on one GPU, so the split changes no value.
        weight = quantize_fp8_per_channel(checkpoint.stored_tensor(name, rows=rows))
        if columns is None:
            return weight
        codes = np.ascontiguousarray(weight.codes[:, columns])
        return replace(weight, codes=codes, shape=(codes.shape[0], codes.shape[1]), block=(1, codes.shape[1]))

    def describe(self) -> str:
        return "online FP8 (E4M3, per-channel weight scales, dynamic per-token activations)"


def read_parts(checkpoint: Any, parts: Sequence[tuple]) -> QuantizedWeight | None:
    """The weight ``parts`` (``(name, shape[, rows, columns])``, as ``backend.load_weight`` takes
    them) stacked along the rows, quantized, when every part is held quantized; None when none is.
    A mix is refused: one product cannot take both."""
    held = [checkpoint.is_quantized(part[0]) for part in parts]
    if not any(held):
        return None
    if not all(held):
        plain = [part[0] for part, quantized in zip(parts, held) if not quantized]
        raise QuantizationError(f"{checkpoint.path}: {', '.join(plain)} are stored at full precision but fused "
                                "with quantized weights into one product")
    return concatenate_weights([checkpoint.quantized(*part) for part in parts])


def act_order_columns(g_idx: np.ndarray, codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, group: int,
               name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Columns sorted by group (``g_idx[c]`` is column ``c``'s group): the codes in that order, the
    permutation the product gathers its input by; None when ``g_idx`` is already in order."""
    inner = codes.shape[1]
    if g_idx.shape != (inner,) or g_idx.min(initial=0) < 0 or g_idx.max(initial=0) >= scales.shape[1]:
        raise UnsupportedQuantizationError(f"{name}: g_idx must give each of the {inner} columns a group below "
                                           f"{scales.shape[1]}")
    order = np.argsort(g_idx, kind="stable")
    counts = np.bincount(g_idx, minlength=scales.shape[1])
    if np.any(counts[:-1] != group) or counts[-1] > group:
        # Groups of unequal size cannot be stored contiguously in blocks of one width.
        raise UnsupportedQuantizationError(f"{name}: g_idx groups of unequal size are not served")
    if np.array_equal(order, np.arange(inner)):
        return codes, scales, zeros, None
    return np.ascontiguousarray(codes[:, order]), scales, zeros, order.astype(np.int32)
