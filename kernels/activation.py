"""SiLU-and-mul: the SwiGLU gate, ``silu(gate) * up``."""

from __future__ import annotations

import numpy as np


def silu_and_mul_reference(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``gate * sigmoid(gate) * up``, float32, same shape as the inputs."""
    gate = np.asarray(gate, dtype=np.float32)
    return (gate / (np.float32(1.0) + np.exp(-gate)) * up).astype(np.float32)
