"""The rows of a step grouped by LoRA adapter slot, in tiles of one slot each: the layout the op
``lora_expand`` and its kernel read (a block of the kernel takes a tile, one slot's ``B`` for all
of its rows). Host NumPy only."""

from __future__ import annotations

import numpy as np

#: Rows of one tile of :func:`adapter_tiles`.
ADAPTER_TILE_ROWS = 8


def adapter_tile_capacity(rows: int) -> int:
    """Tiles :func:`adapter_tiles` needs at most for ``rows`` rows, whatever their slots: each of
    ``k`` slots present rounds its rows up to whole tiles, ``ceil(rows / 8) + k - 1`` tiles at
    most, and ``k <= rows``."""
    return -(-rows // ADAPTER_TILE_ROWS) + max(rows, 1) - 1


def adapter_tiles(slots: np.ndarray, capacity: int | None = None) -> np.ndarray:
    """The rows of a step grouped by adapter slot, in tiles of at most :data:`ADAPTER_TILE_ROWS`
    rows of one slot: ``[T, 2 + 8]`` int32, each tile its slot, its row count, then its rows in
    batch order (-1 pads). Every row of ``slots`` (base-model rows too, slot 0) is in exactly one
    tile; the used tiles come first, the ``capacity - used`` after them (at least
    :func:`adapter_tile_capacity`, for a table of fixed size, e.g. a CUDA graph's) count no row.
    The op ``lora_expand`` reads it: a block of its kernel takes a tile, one slot's ``B`` for all
    of its rows."""
    slots = np.asarray(slots)
    rows = int(slots.shape[0])
    needed = adapter_tile_capacity(rows)
    capacity = needed if capacity is None else capacity
    if capacity < needed:
        raise ValueError(f"adapter_tiles: {capacity} tiles cannot hold {rows} rows of any slots (need {needed})")
    tiles = np.full((capacity, 2 + ADAPTER_TILE_ROWS), -1, dtype=np.int32)
    tiles[:, :2] = 0
    used = 0
    for slot in np.unique(slots):
        members = np.nonzero(slots == slot)[0]
        for start in range(0, members.size, ADAPTER_TILE_ROWS):
            chunk = members[start : start + ADAPTER_TILE_ROWS]
            tiles[used, 0], tiles[used, 1] = slot, chunk.size
            tiles[used, 2 : 2 + chunk.size] = chunk
            used += 1
    return tiles


def padded_adapter_tiles(tiles: np.ndarray, rows: int, size: int, capacity: int) -> np.ndarray:
    """:func:`adapter_tiles` of ``rows`` rows (``tiles``) extended to ``size`` rows: rows
    ``rows .. size - 1`` (padding, the base model's) in tiles of their own after the used ones,
    in a table of ``capacity`` tiles (at least :func:`adapter_tile_capacity` of ``size``)."""
    tiles = np.asarray(tiles)
    used = int((tiles[:, 1] > 0).sum())
    padding = np.arange(rows, size, dtype=np.int32)
    needed = used + -(-padding.size // ADAPTER_TILE_ROWS)
    if capacity < needed:
        raise ValueError(f"padded_adapter_tiles: {capacity} tiles cannot hold {size} rows (need {needed})")
    padded = np.full((capacity, 2 + ADAPTER_TILE_ROWS), -1, dtype=np.int32)
    padded[:, :2] = 0
    padded[:used] = tiles[:used]
    for index, start in enumerate(range(0, padding.size, ADAPTER_TILE_ROWS)):
        chunk = padding[start : start + ADAPTER_TILE_ROWS]
        padded[used + index, 0], padded[used + index, 1] = 0, chunk.size
        padded[used + index, 2 : 2 + chunk.size] = chunk
    return padded


def check_adapter_tiles(op: str, slots: np.ndarray, tiles: np.ndarray) -> None:
    """Raise :class:`ValueError` unless ``tiles`` (:func:`adapter_tiles`) lists every row of
    ``slots`` exactly once, in a tile of its own slot, the used tiles first."""
    tiles = np.asarray(tiles)
    if tiles.ndim != 2 or tiles.shape[1] != 2 + ADAPTER_TILE_ROWS:
        raise ValueError(f"{op}: tiles must be [T, {2 + ADAPTER_TILE_ROWS}], got {list(tiles.shape)}")
    counts = tiles[:, 1]
    used = int(np.argmin(counts > 0)) if (counts <= 0).any() else len(counts)
    if (counts[used:] > 0).any() or (counts[:used] > ADAPTER_TILE_ROWS).any():
        raise ValueError(f"{op}: tiles must count 1 to {ADAPTER_TILE_ROWS} rows each, the used ones first")
    listed = np.concatenate([tiles[t, 2 : 2 + counts[t]] for t in range(used)]) if used else np.zeros(0, np.int32)
    listed_slots = np.repeat(tiles[:used, 0], counts[:used])
    rows = len(slots)
    if len(listed) != rows or (np.sort(listed) != np.arange(rows)).any():
        raise ValueError(f"{op}: tiles must list each of the {rows} rows once")
    if (np.asarray(slots)[listed] != listed_slots).any():
        raise ValueError(f"{op}: a tile lists a row of another adapter slot")
