"""Embedding gather: ``out[t] = weight[ids[t]]``."""

from __future__ import annotations

import numpy as np


def embedding_reference(weight: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``weight [V, H]``, ``ids [T]`` int -> ``[T, H]`` float32."""
    return np.asarray(weight[np.asarray(ids, dtype=np.int64)], dtype=np.float32)
