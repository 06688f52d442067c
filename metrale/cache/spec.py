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


@dataclass(frozen=True)
class PagedKVSpec:
    """Per token: K ``[num_kv_heads, head_dim]`` and V ``[num_kv_heads, v_head_dim]``.

    ``sliding_window`` is informational (the attention masks; every position stays cached).
    """

    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    sliding_window: int | None = None

    def validate(self) -> None:
        _positive("PagedKVSpec", num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        if self.v_head_dim is not None:
            _positive("PagedKVSpec", v_head_dim=self.v_head_dim)
        if self.sliding_window is not None:
            _positive("PagedKVSpec", sliding_window=self.sliding_window)

    @property
    def values_per_token(self) -> int:
        return self.num_kv_heads * (self.head_dim + (self.v_head_dim or self.head_dim))


@dataclass(frozen=True)
class PagedLatentSpec:
    """Per token: one latent vector of ``width`` values (MLA: ``kv_lora_rank + qk_rope_head_dim``)."""

    width: int

    def validate(self) -> None:
        _positive("PagedLatentSpec", width=self.width)

    @property
    def values_per_token(self) -> int:
        return self.width


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

    def state_bytes_per_slot(self) -> int:
        """Bytes of one recurrent-state slot over all layers (float32 conv and recurrent states)."""
        return sum(
            4 * (math.prod(layer.conv_shape) + math.prod(layer.state_shape))
            for layer in self.layers if isinstance(layer, RecurrentStateSpec)
        )
