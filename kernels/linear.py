"""Linear layer ``y = x W^T + b`` (cuBLAS on the GPU)."""

from __future__ import annotations

import numpy as np


def linear_reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """``x [T, in]``, ``weight [out, in]``, ``bias [out]`` -> ``[T, out]`` float32."""
    y = np.asarray(x, dtype=np.float32) @ weight.T
    if bias is not None:
        y = y + bias
    return y.astype(np.float32, copy=False)
