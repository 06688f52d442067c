"""RoPE parameters read from ``config.json`` (both transformers 4.x and 5.x styles).

:func:`rope_parameters` normalises the config, :meth:`RopeParameters.inverse_frequencies`
computes ``inv_freq`` exactly as transformers does (float32). Supported types:

* ``default``, ``linear``, ``llama3`` and ``yarn`` (:data:`SUPPORTED_ROPE_TYPES`), for every
  family;
* ``longrope`` (Phi-3, Phi-4), for a family that asks for it (``rope_parameters(...,
  longrope=True)``): transformers switches between its short and long factors with the length of
  each forward, the engine keeps one table per model and chooses it by the engine's
  ``max_model_len`` (:meth:`RopeParameters.uses_long_factors`).

``dynamic`` (which rescales with the sequence length) and ``longrope`` for the other families are
refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from metrale.errors import CheckpointError, ConfigError
from metrale.loading.config_fields import MAX_INT, ConfigFields, show

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: The RoPE type whose table depends on the longest sequence a model serves: accepted only by
#: ``rope_parameters(..., longrope=True)``, whose caller passes its ``max_model_len`` to
#: :meth:`RopeParameters.inverse_frequencies`.
LONGROPE = "longrope"


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

    def inverse_frequencies(self, max_model_len: int | None = None) -> np.ndarray:
        """``inv_freq`` ``[rotary_dim / 2]`` float32, scaled as ``rope_type`` says.

        ``max_model_len`` (the longest sequence the model serves) chooses ``longrope``'s factors
        (:meth:`uses_long_factors`) and is required for that type; the other types ignore it."""
        d = self.rotary_dim
        exponents = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
        # theta ** (2i / d) in float64, rounded once to float32: transformers' own values, to the
        # bit. A float32 power can be an ulp or two off, and each angle, position * inv_freq,
        # carries that error times the position.
        base = (np.float64(self.theta) ** exponents.astype(np.float64)).astype(np.float32)
        if self.rope_type == LONGROPE:
            if max_model_len is None:
                raise ConfigError("longrope RoPE chooses its factors by the longest sequence served: pass "
                                  "max_model_len to inverse_frequencies()")
            name = "long_factor" if self.uses_long_factors(max_model_len) else "short_factor"
            factors = np.asarray(self.scaling[name], dtype=np.float32)
            return (np.float32(1.0) / (factors * base).astype(np.float32)).astype(np.float32)
        inv_freq = (np.float32(1.0) / base).astype(np.float32)
        if self.rope_type == "linear":
            return (inv_freq / np.float32(self.scaling["factor"])).astype(np.float32)
        if self.rope_type == "llama3":
            return _llama3(inv_freq, self.scaling)
        if self.rope_type == "yarn":
            return _yarn(base, d, self.theta, self._yarn_factor(), self.scaling)
        return inv_freq

    def uses_long_factors(self, max_model_len: int) -> bool:
        """Whether a ``longrope`` table for sequences up to ``max_model_len`` tokens takes the
        ``long_factor`` (``max_model_len > original_max_position_embeddings``) rather than the
        ``short_factor``; False for the other types.

        transformers makes the choice per forward, by that forward's last position; one table per
        model makes it by the longest sequence the engine serves, so a short prompt served with a
        long ``max_model_len`` is rotated with the long factors."""
        return self.rope_type == LONGROPE and max_model_len > self.scaling["original_max_position_embeddings"]

    def attention_factor(self) -> float:
        """Multiplier of cos and sin (1 except for YaRN and LongRoPE)."""
        if self.rope_type == LONGROPE:
            return _longrope_attention_factor(self.scaling, self.max_position_embeddings)
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


def _longrope_attention_factor(scaling: Mapping[str, Any], max_position_embeddings: int | None) -> float:
    """LongRoPE's multiplier of cos and sin, the same for both sets of factors:
    ``attention_factor`` when given, else ``sqrt(1 + ln f / ln L0)`` for ``f`` = ``factor`` (or
    ``max_position_embeddings / L0`` without one) above 1, and 1 for ``f <= 1``."""
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        if not max_position_embeddings:
            raise CheckpointError("longrope RoPE needs 'factor', 'attention_factor' or max_position_embeddings")
        factor = max_position_embeddings / original
    if factor <= 1.0:
        return 1.0
    if original < 2:
        raise CheckpointError(f"longrope RoPE with factor {factor} needs original_max_position_embeddings >= 2 "
                              f"(its attention factor divides by ln of it), got {original}")
    return math.sqrt(1 + math.log(factor) / math.log(original))


def _longrope_factors(section: ConfigFields, name: str, count: int, where: str) -> tuple[float, ...]:
    """The ``count`` positive numbers of the LongRoPE factor list ``name`` of ``section``;
    ``where`` says where ``count`` comes from."""
    field = f"{section.prefix}{name}"
    if not section.has(name):
        raise section.error(f"{field} is missing; longrope RoPE scaling needs {count} factors ({where})")
    values = section.values[name]
    if not isinstance(values, list):
        raise section.error(f"{field} is {show(values)}; expected an array of {count} numbers ({where})")
    if len(values) != count:
        raise section.error(f"{field} has {len(values)} entries; expected {count} ({where})")
    for index, value in enumerate(values):
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or abs(value) > MAX_INT
                or not math.isfinite(value) or value <= 0):
            raise section.error(f"{field}[{index}] is {show(value)}; expected a number > 0")
    return tuple(float(value) for value in values)


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
    config: Mapping[str, Any], head_dim: int, *, default_partial_factor: float = 1.0, source: str = "config.json",
    longrope: bool = False,
) -> RopeParameters:
    """Normalise the RoPE fields of ``config`` (the rule of :ref:`families-rope-config`).

    The legacy GPT-NeoX names ``rotary_emb_base`` (theta) and ``rotary_pct`` (the partial
    rotary factor) are read too, after the current ones. With ``longrope`` the type ``longrope``
    is accepted too (its ``short_factor`` and ``long_factor`` must hold ``rotary_dim / 2``
    positive numbers each); the caller then passes its ``max_model_len`` to
    :meth:`RopeParameters.inverse_frequencies`. Every field is type-checked
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
    supported = SUPPORTED_ROPE_TYPES + ((LONGROPE,) if longrope else ())
    if rope_type not in supported:
        raise fields.error(
            f"RoPE type {rope_type!r} is not supported (supported: {', '.join(supported)})"
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
    if rope_type in ("llama3", "yarn", LONGROPE):
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
    if rope_type == LONGROPE:
        if scaling.get("original_max_position_embeddings") is None:
            raise fields.error("longrope RoPE scaling needs 'original_max_position_embeddings'")
        where = f"rotary_dim / 2: head_dim {head_dim} x partial_rotary_factor {partial} = {rotary_dim} rotary dims"
        for name in ("short_factor", "long_factor"):
            scaling[name] = _longrope_factors(section, name, rotary_dim // 2, where)
    parameters = RopeParameters(
        rope_type=rope_type,
        theta=theta,
        rotary_dim=rotary_dim,
        scaling=scaling,
        max_position_embeddings=max_positions,
    )
    if rope_type == LONGROPE:
        try:
            parameters.attention_factor()  # refused now, not when the model is built
        except CheckpointError as error:
            raise fields.error(str(error)) from None
    return parameters
