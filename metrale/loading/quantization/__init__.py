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

import re
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from metrale.errors import CheckpointError, QuantizationError, UnsupportedQuantizationError
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

    def holds(self, checkpoint: Any, name: str) -> bool:
        module = module_of(name)
        if module is None or not checkpoint.has_stored(name) or len(checkpoint.info(name).shape) != 2:
            return False
        return not any(module == s or module.endswith("." + s) for s in ONLINE_SKIPPED)

    def shape(self, checkpoint: Any, name: str) -> tuple[int, ...]:
        return checkpoint.info(name).shape

    def read(self, checkpoint: Any, name: str, rows: slice | None = None,
             columns: slice | None = None) -> QuantizedWeight:
        return quantize_fp8_per_channel(checkpoint.stored_tensor(name, rows=rows, columns=columns))

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


__all__ = [
    "FORMATS", "ONLINE_METHODS", "OnlineFp8", "WeightFormat", "check_shape", "float_tensor", "matches", "module_of",
    "read_parts", "register_format", "served_methods", "weight_format", "block_part", "sliced", "CheckpointError",
    "check_scales_stored",
]
