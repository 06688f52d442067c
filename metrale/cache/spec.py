"""Cache specs: what each layer of a model keeps per token or per sequence.

A family returns a :class:`CacheSpec` from ``metrale_cache_spec``; the engine allocates the
storage (:class:`~metrale.cache.store.ModelCache`) from it. Three kinds of layer cache exist:

* :class:`PagedKVSpec` -- K and V per token, in paged blocks (dense attention);
* :class:`PagedLatentSpec` -- one compressed latent vector per token, in paged blocks (MLA);
* :class:`RecurrentStateSpec` -- a fixed-size conv state and recurrent state per sequence (GDN).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Union

from metrale.errors import ConfigError


def _positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{owner}.{name} must be a positive int, got {value!r}")


def _scale(owner: str, **values: float | None) -> None:
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < math.inf):
            raise ConfigError(f"{owner}.{name} must be a positive finite number or None, got {value!r}")


@dataclass(frozen=True)
class PagedKVSpec:
    """Per token: K ``[num_kv_heads, head_dim]`` and V ``[num_kv_heads, v_head_dim]``.

    ``sliding_window`` is informational (the attention masks; every position stays cached).
    ``k_scale`` / ``v_scale`` are the checkpoint's static FP8 scales of the keys and values (None:
    none); an FP8 cache (``kv_cache_dtype="fp8"``) quantizes with them, other caches ignore them.
    """

    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    sliding_window: int | None = None
    k_scale: float | None = None
    v_scale: float | None = None

    def validate(self) -> None:
        _positive("PagedKVSpec", num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        if self.v_head_dim is not None:
            _positive("PagedKVSpec", v_head_dim=self.v_head_dim)
        if self.sliding_window is not None:
            _positive("PagedKVSpec", sliding_window=self.sliding_window)
        _scale("PagedKVSpec", k_scale=self.k_scale, v_scale=self.v_scale)

    @property
    def values_per_token(self) -> int:
        return self.num_kv_heads * (self.head_dim + (self.v_head_dim or self.head_dim))

    @property
    def scales_per_token(self) -> int:
        """Scales an FP8 cache keeps per token: one per K head and one per V head."""
        return 2 * self.num_kv_heads


@dataclass(frozen=True)
class PagedLatentSpec:
    """Per token: one latent vector of ``width`` values (MLA: ``kv_lora_rank + qk_rope_head_dim``).
    ``scale`` is the checkpoint's static FP8 scale of the latents (None: none), as ``k_scale`` of
    :class:`PagedKVSpec`."""

    width: int
    scale: float | None = None

    def validate(self) -> None:
        _positive("PagedLatentSpec", width=self.width)
        _scale("PagedLatentSpec", scale=self.scale)

    @property
    def values_per_token(self) -> int:
        return self.width

    @property
    def scales_per_token(self) -> int:
        """Scales an FP8 cache keeps per token: one for the whole latent row."""
        return 1


@dataclass(frozen=True)
class RecurrentStateSpec:
    """Per sequence, of fixed size: a conv state ``conv_shape`` and a recurrent state
    ``state_shape``, both float32 (GDN: ``[C, K-1]`` and ``[H_v, d_k, d_v]``)."""

    conv_shape: tuple[int, ...]
    state_shape: tuple[int, ...]

    def validate(self) -> None:
        for name, shape in (("conv_shape", self.conv_shape), ("state_shape", self.state_shape)):
            if not shape or any(not isinstance(n, int) or n < 1 for n in shape):
                raise ConfigError(f"RecurrentStateSpec.{name} must hold positive ints, got {shape!r}")

    @property
    def values_per_token(self) -> int:
        return 0

    @property
    def scales_per_token(self) -> int:
        return 0


LayerCacheSpec = Union[PagedKVSpec, PagedLatentSpec, RecurrentStateSpec]


@dataclass(frozen=True)
class CacheSpec:
    """The cache of a whole model: one entry per layer (in layer order)."""

    layers: tuple[LayerCacheSpec, ...]

    def validate(self) -> None:
        if not self.layers:
            raise ConfigError("CacheSpec.layers is empty")
        for index, layer in enumerate(self.layers):
            if not isinstance(layer, (PagedKVSpec, PagedLatentSpec, RecurrentStateSpec)):
                raise ConfigError(f"CacheSpec.layers[{index}] is not a layer cache spec: {layer!r}")
            layer.validate()

    @functools.cached_property
    def uses_blocks(self) -> bool:
        return any(isinstance(layer, (PagedKVSpec, PagedLatentSpec)) for layer in self.layers)

    @functools.cached_property
    def uses_state_slots(self) -> bool:
        return any(isinstance(layer, RecurrentStateSpec) for layer in self.layers)

    def values_per_token(self) -> int:
        return sum(layer.values_per_token for layer in self.layers)

    def bytes_per_token(self, itemsize: int, scale_itemsize: int = 0) -> int:
        """Bytes of one token's paged cache over all layers: its values of ``itemsize`` bytes each
        and, for an FP8 cache, its scales of ``scale_itemsize`` bytes each (0: a cache without scales)."""
        return sum(layer.values_per_token * itemsize + layer.scales_per_token * scale_itemsize
                   for layer in self.layers)

    def state_bytes_per_slot(self) -> int:
        """Bytes of one recurrent-state slot over all layers (float32 conv and recurrent states)."""
        return sum(
            4 * (math.prod(layer.conv_shape) + math.prod(layer.state_shape))
            for layer in self.layers if isinstance(layer, RecurrentStateSpec)
        )
