"""Typed checks of user-supplied values: engine options, sampling parameters, CLI flags.

Every check returns the value in its canonical type (``int``, ``float``, ``bool``) or raises the
given :class:`~metrale.errors.MetraleError` subclass with the option's name and the offending
value. ``bool`` is never accepted where a number is expected, nor a number where a ``bool`` is
(``ignore_eos="false"`` must not become True); NumPy scalars of the right kind are accepted.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from metrale.errors import InvalidRequestError, MetraleError

#: Upper end (exclusive) of every seed: seeds are 64-bit unsigned integers.
SEED_LIMIT = 1 << 64


def _is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    error: type[MetraleError] = InvalidRequestError,
) -> int:
    """``value`` as an ``int`` within ``[minimum, maximum]`` (both inclusive, None: open)."""
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        raise error(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise error(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise error(f"{name} must be <= {maximum}, got {value}")
    return value


def check_optional_int(name: str, value: Any, **bounds: Any) -> int | None:
    """Like :func:`check_int`, but None passes through."""
    return None if value is None else check_int(name, value, **bounds)


def check_float(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    minimum_exclusive: bool = False,
    error: type[MetraleError] = InvalidRequestError,
) -> float:
    """``value`` as a finite ``float`` within the bounds (``minimum_exclusive``: ``> minimum``)."""
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise error(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise error(f"{name} must be finite, got {value!r}")
    if minimum is not None and (number <= minimum if minimum_exclusive else number < minimum):
        raise error(f"{name} must be {'>' if minimum_exclusive else '>='} {minimum}, got {value!r}")
    if maximum is not None and number > maximum:
        raise error(f"{name} must be <= {maximum}, got {value!r}")
    return number


def check_bool(name: str, value: Any, *, error: type[MetraleError] = InvalidRequestError) -> bool:
    """``value`` as a ``bool``; only ``True`` / ``False`` (or NumPy bools) pass."""
    if not _is_bool(value):
        raise error(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_seed(name: str, value: Any, *, error: type[MetraleError] = InvalidRequestError) -> int:
    """A seed: an int in ``[0, 2**64)``."""
    return check_int(name, value, minimum=0, maximum=SEED_LIMIT - 1, error=error)
