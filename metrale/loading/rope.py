"""RoPE parameters read from ``config.json`` (both transformers 4.x and 5.x styles).

:func:`rope_parameters` normalises the config, :meth:`RopeParameters.inverse_frequencies`
computes ``inv_freq`` exactly as transformers does (float32), including the ``linear``,
``llama3`` and ``yarn`` scalings. Length-dependent variants (``dynamic``, ``longrope``) are
refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from metrale.errors import CheckpointError
from metrale.loading.config_fields import ConfigFields

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeParameters:
    """Normalised RoPE settings of one model.

    ``rotary_dim`` dims of each head rotate (the rest pass through); ``scaling`` holds the raw
    scaling fields (factor, ...) of the non-default types.
    """

    rope_type: str
    theta: float
    rotary_dim: int
    scaling: Mapping[str, Any]
    max_position_embeddings: int | None = None

    def inverse_frequencies(self) -> np.ndarray:
        """``inv_freq`` ``[rotary_dim / 2]`` float32, scaled as ``rope_type`` says."""
        d = self.rotary_dim
        exponents = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
        base = (np.float32(self.theta) ** exponents).astype(np.float32)
        inv_freq = (np.float32(1.0) / base).astype(np.float32)
        if self.rope_type == "linear":
            return (inv_freq / np.float32(self.scaling["factor"])).astype(np.float32)
        if self.rope_type == "llama3":
            return _llama3(inv_freq, self.scaling)
        if self.rope_type == "yarn":
            return _yarn(base, d, self.theta, self._yarn_factor(), self.scaling)
        return inv_freq

    def attention_factor(self) -> float:
        """Multiplier of cos and sin (1 except for YaRN)."""
        if self.rope_type != "yarn":
            return 1.0
        given = self.scaling.get("attention_factor")
        if given is not None:
            return float(given)
        factor = self._yarn_factor()
        mscale = self.scaling.get("mscale")
        mscale_all_dim = self.scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        return yarn_mscale(factor)

    def _yarn_factor(self) -> float:
        factor = self.scaling.get("factor")
        if factor is None:
            original = self.scaling.get("original_max_position_embeddings")
            if not original or not self.max_position_embeddings:
                raise CheckpointError("yarn RoPE needs 'factor' or both max position fields")
            factor = self.max_position_embeddings / original
        return float(factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """``m(s, mu)`` of YaRN: 1 when ``s <= 1``, else ``0.1 * mu * ln(s) + 1``."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _llama3(inv_freq: np.ndarray, scaling: Mapping[str, Any]) -> np.ndarray:
    factor = np.float32(scaling["factor"])
    low = np.float32(scaling["low_freq_factor"])
    high = np.float32(scaling["high_freq_factor"])
    original = np.float32(scaling["original_max_position_embeddings"])
    low_wavelen = original / low
    high_wavelen = original / high
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = ((original / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(base: np.ndarray, d: int, theta: float, factor: float, scaling: Mapping[str, Any]) -> np.ndarray:
    original = scaling.get("original_max_position_embeddings")
    if not original:
        raise CheckpointError("yarn RoPE needs 'original_max_position_embeddings'")
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    truncate = scaling.get("truncate", True)

    def correction_dim(rotations: float) -> float:
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = correction_dim(beta_fast)
    high = correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_weight = (1 - ramp).astype(np.float32)
    extrapolation = (np.float32(1.0) / base).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(factor) * base)).astype(np.float32)
    return (interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight).astype(np.float32)


#: The numeric fields of a RoPE scaling section and their bounds (ConfigFields.number options),
#: checked whenever present, whatever the RoPE type: an unused field of the wrong type is still a
#: broken file.
_SCALING_NUMBERS: dict[str, dict[str, Any]] = {
    "factor": dict(positive=True),
    "low_freq_factor": dict(positive=True),
    "high_freq_factor": dict(positive=True),
    "attention_factor": dict(positive=True),
    "mscale": dict(minimum=0.0),
    "mscale_all_dim": dict(minimum=0.0),
    "beta_fast": dict(minimum=0.0),
    "beta_slow": dict(minimum=0.0),
}


def rope_parameters(
    config: Mapping[str, Any], head_dim: int, *, default_partial_factor: float = 1.0, source: str = "config.json"
) -> RopeParameters:
    """Normalise the RoPE fields of ``config`` (the rule of :ref:`families-rope-config`).

    The legacy GPT-NeoX names ``rotary_emb_base`` (theta) and ``rotary_pct`` (the partial
    rotary factor) are read too, after the current ones. Every field is type-checked
    (:class:`~metrale.loading.config_fields.ConfigFields`): a
    ``rope_parameters`` / ``rope_scaling`` that is not an object, a factor that is not a finite
    positive number, ... raise :class:`~metrale.errors.CheckpointError` naming ``source``, the
    field and its value.
    """
    fields = ConfigFields(config, source)
    section = fields.section("rope_parameters")
    legacy = fields.section("rope_scaling")
    if section is None or not section.values:
        section = legacy if legacy is not None else ConfigFields({}, source, "rope_parameters.")
    # Both places are read (and so checked) before one wins.
    # GPT-NeoX-style configs (Pythia, ...) name them ``rotary_emb_base`` and ``rotary_pct``.
    thetas = [where.number("rope_theta", None, positive=True) for where in (section, fields)]
    thetas.append(fields.number("rotary_emb_base", None, positive=True))
    theta = thetas[0] or thetas[1] or thetas[2] or 10000.0
    if theta <= 1:
        # inv_freq = theta^(-2i/d) needs theta > 1 (YaRN divides by log(theta)).
        raise fields.error(f"rope_theta is {theta}; expected a number > 1")
    types = [section.text("rope_type", None), section.text("type", None)]
    rope_type = types[0] or types[1] or "default"
    partials = [where.number("partial_rotary_factor", None, positive=True, maximum=1.0) for where in (section, fields)]
    partials.append(fields.number("rotary_pct", None, positive=True, maximum=1.0))
    partial = partials[0] or partials[1] or partials[2] or default_partial_factor
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise fields.error(
            f"RoPE type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    rotary_dim = int(head_dim * partial)
    if rotary_dim < 2 or rotary_dim % 2:
        raise fields.error(
            f"rotary dimension {rotary_dim} (head_dim {head_dim} x partial_rotary_factor {partial}) must be even "
            "and >= 2"
        )
    scaling = dict(section.values)
    for name, options in _SCALING_NUMBERS.items():
        if section.has(name):
            scaling[name] = section.number(name, **options)
    if section.has("truncate"):
        scaling["truncate"] = section.flag("truncate")
    original = section.size("original_max_position_embeddings", None)
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    max_positions = fields.size("max_position_embeddings", None)
    top_original = fields.size("original_max_position_embeddings", None)
    if rope_type in ("llama3", "yarn"):
        # transformers: a top-level original_max_position_embeddings wins; else the model's own.
        if top_original:
            scaling["original_max_position_embeddings"] = top_original
        elif not scaling.get("original_max_position_embeddings") and max_positions:
            scaling["original_max_position_embeddings"] = max_positions
    if rope_type in ("linear", "llama3") and scaling.get("factor") is None:
        raise fields.error(f"{rope_type} RoPE scaling needs a 'factor'")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if scaling.get(key) is None:
                raise fields.error(f"llama3 RoPE scaling needs {key!r}")
    return RopeParameters(
        rope_type=rope_type,
        theta=theta,
        rotary_dim=rotary_dim,
        scaling=scaling,
        max_position_embeddings=max_positions,
    )
