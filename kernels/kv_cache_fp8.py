"""A paged cache array held as FP8 E4M3 codes, with one float32 scale per token slot and head.

An :class:`Fp8CacheArray` stands where a float cache array would (``k_cache``, ``v_cache``,
``latent``): ``codes`` has the float array's shape (``[blocks, block, heads, d]`` for keys and
values, ``[blocks, block, width]`` for MLA's latents), ``scales`` that shape less its last axis.
A row written at a slot is quantized on its own: ``scale = amax(|row|) / 448`` (the largest E4M3
magnitude), or the checkpoint's static scale when the cache has one (``static_scale``; values
beyond ``448 * scale`` saturate). A row reads back as ``code * scale``. Since the scale lives
with the slot, a block shared by a prefix-cache hit or copied with its sequence carries its
scales, and a row's value never depends on which other rows were written.

The ``*_reference`` functions of the attention ops accept one wherever they accept a float cache
(:func:`cache_rows`, :func:`write_cache_rows`); on the GPU the FP8 attention kernels read its codes
and scales (:mod:`metrale.kernels.attention_fp8`, :mod:`metrale.kernels.attention_decode_mma`,
:mod:`metrale.kernels.attention_latent`), and :func:`cache_rows` gathers and dequantizes rows there too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from metrale.kernels.quantized import FP8_E4M3_MAX, float32_to_fp8_e4m3, fp8_e4m3_table, fp8_e4m3_to_float32

#: Names of the cache dtypes the engine's ``kv_cache_dtype`` option accepts for an FP8 E4M3 cache.
FP8_E4M3_NAMES = ("fp8", "fp8_e4m3")


@dataclass
class Fp8CacheArray:
    """FP8 E4M3 ``codes`` (uint8) and their float32 ``scales`` (one per row of the last axis);
    ``static_scale`` (a positive float or None) replaces the per-row amax scale when set."""

    codes: Any
    scales: Any
    static_scale: float | None = None

    @classmethod
    def zeros(cls, shape: tuple[int, ...], static_scale: float | None = None) -> "Fp8CacheArray":
        """An empty cache of ``shape`` (every code 0, every scale 1)."""
        return cls(np.zeros(shape, dtype=np.uint8), np.ones(shape[:-1], dtype=np.float32), static_scale)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.codes.dtype

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.scales.nbytes)

    def quantize(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(codes, scales)`` of float ``rows [..., width]``: one scale per row."""
        rows = np.asarray(rows, dtype=np.float32)
        if self.static_scale is not None:
            scales = np.full(rows.shape[:-1], self.static_scale, dtype=np.float32)
        else:
            amax = np.abs(rows).max(axis=-1) if rows.shape[-1] else np.zeros(rows.shape[:-1], np.float32)
            # An all-zero row keeps scale 1: its codes are 0 whatever the scale.
            # (Floored at the smallest normal float32, so a tiny row's quotient stays finite.)
            scaled = np.maximum(amax / np.float32(FP8_E4M3_MAX), np.finfo(np.float32).tiny)
            scales = np.where(amax > 0, scaled, np.float32(1.0)).astype(np.float32)
        return float32_to_fp8_e4m3(rows / scales[..., None]), scales

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Store ``rows [N, *shape[2:]]`` at the flat slots ``slots [N]``; slot -1 is skipped."""
        slots = np.asarray(slots, dtype=np.int64)
        kept = slots >= 0
        codes, scales = self.quantize(np.asarray(rows)[kept])
        flat = self.shape[0] * self.shape[1]
        self.codes.reshape(flat, *self.shape[2:])[slots[kept]] = codes
        self.scales.reshape(flat, *self.shape[2:-1])[slots[kept]] = scales

    def rows(self, slots: np.ndarray) -> np.ndarray:
        """float32 ``[N, *shape[2:]]``: the dequantized rows at the flat slots ``slots [N]`` (in the
        cache's array module: a GPU cache takes device slots and gives device rows)."""
        if isinstance(self.codes, np.ndarray):
            slots = np.asarray(slots, dtype=np.int64)
        flat = self.shape[0] * self.shape[1]
        codes = self.codes.reshape(flat, *self.shape[2:])[slots]
        scales = self.scales.reshape(flat, *self.shape[2:-1])[slots]
        return _decoded(codes) * scales[..., None]

    def blocks(self, block_ids: np.ndarray) -> np.ndarray:
        """float32 ``[n, block, *shape[2:]]``: the dequantized blocks ``block_ids [n]``."""
        block_ids = np.asarray(block_ids, dtype=np.int64)
        return fp8_e4m3_to_float32(self.codes[block_ids]) * self.scales[block_ids][..., None]

    def dequantize(self) -> np.ndarray:
        """The whole cache as float32, ``shape``."""
        return _decoded(self.codes) * self.scales[..., None]


def _decoded(codes: Any) -> Any:
    """float32 values of E4M3 codes in their own array module (NumPy, or CuPy on the GPU)."""
    if isinstance(codes, np.ndarray):
        return fp8_e4m3_to_float32(codes)
    import cupy

    table = _DEVICE_TABLES.get(cupy.cuda.Device().id)
    if table is None:
        table = _DEVICE_TABLES[cupy.cuda.Device().id] = cupy.asarray(fp8_e4m3_table())
    return table[codes]


#: The E4M3 value table on each GPU that has decoded codes (:func:`_decoded`).
_DEVICE_TABLES: dict[int, Any] = {}


def is_fp8_cache(cache: Any) -> bool:
    """Whether ``cache`` is an :class:`Fp8CacheArray` (else a float or bf16 cache array)."""
    return isinstance(cache, Fp8CacheArray)


def cache_rows(cache: Any, slots: Any) -> Any:
    """The rows of ``cache`` at the flat slots ``slots [N]`` -> ``[N, *shape[2:]]``: dequantized
    (float32) for an FP8 cache, as stored otherwise (any array module)."""
    if is_fp8_cache(cache):
        return cache.rows(slots)
    return cache.reshape(cache.shape[0] * cache.shape[1], *cache.shape[2:])[slots]


def cache_blocks(cache: Any, block_ids: np.ndarray) -> np.ndarray:
    """The blocks ``block_ids`` of a host cache -> ``[n, block, *shape[2:]]`` (float32 for an FP8 cache)."""
    if is_fp8_cache(cache):
        return cache.blocks(block_ids)
    return cache[np.asarray(block_ids, dtype=np.int64)]


def write_cache_rows(cache: Any, slots: np.ndarray, rows: np.ndarray) -> None:
    """Store ``rows [N, *shape[2:]]`` at the flat slots ``slots [N]`` of a host cache (quantized
    for an FP8 cache); a row of slot -1 (padding) is not stored."""
    if is_fp8_cache(cache):
        cache.write(slots, rows)
        return
    slots = np.asarray(slots, dtype=np.int64)
    kept = slots >= 0
    cache.reshape(cache.shape[0] * cache.shape[1], *cache.shape[2:])[slots[kept]] = np.asarray(rows)[kept]
