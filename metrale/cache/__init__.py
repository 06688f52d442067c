"""The cache layer: paged KV / latent blocks and recurrent-state slots, driven by a cache spec."""

from metrale.cache.blocks import BlockAllocator
from metrale.cache.spec import CacheSpec, PagedKVSpec, PagedLatentSpec, RecurrentStateSpec
from metrale.cache.store import ModelCache, StateSlotPool

__all__ = [
    "BlockAllocator",
    "CacheSpec",
    "ModelCache",
    "PagedKVSpec",
    "PagedLatentSpec",
    "RecurrentStateSpec",
    "StateSlotPool",
]
