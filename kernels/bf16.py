"""bf16 on the host: widening bf16 bits (``uint16``) to float32 and rounding float32 to bf16
bits, exactly as the kernels do on the device. NumPy only."""

from __future__ import annotations

import numpy as np


def bf16_to_float32(raw: np.ndarray) -> np.ndarray:
    """Widen bf16 values stored as ``uint16`` to float32 (exact: bf16 is fp32's top half)."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 (nearest, ties to even), returned as ``uint16``."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    rounded = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = np.uint16(0x7FC0)
    return rounded
