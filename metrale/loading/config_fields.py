"""Typed reading of ``config.json`` fields, shared by every model family.

Hugging Face writes ``config.json`` with JSON's own types: ints for sizes and counts, numbers for
epsilons and factors, ``true`` / ``false`` for flags, ``null`` for "not set". A field of any
other type is a broken checkpoint. :class:`ConfigFields` refuses it with a
:class:`~metrale.errors.CheckpointError` that names the file, the field, the value and what was
expected, rather than letting ``int("128")`` pass silently or a bare ``TypeError`` escape from
deep inside a loader. Bounds stop at what a field can mean (a size is at least 1); whether a size
is *right* is for the tensors to say (:meth:`metrale.loading.checkpoint.Checkpoint.expect_shape`).

Usage::

    fields = ConfigFields(checkpoint.config, "config.json")
    hidden = fields.size("hidden_size")                      # required, an int >= 1
    kv_heads = fields.size("num_key_value_heads", heads)     # optional: null or absent -> heads
    eps = fields.number("rms_norm_eps", 1e-6, positive=True)
    rope = fields.section("rope_scaling")                    # a nested object, or None
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Sequence

from metrale.errors import CheckpointError

#: Marks a field without a default: absent or ``null`` is an error.
REQUIRED: Any = object()

#: The largest int any field may hold. JSON readers lose integer precision beyond 2**53, and no
#: real size, count or position comes near it; the bound also keeps float arithmetic on sizes
#: (``head_dim * partial_rotary_factor``) from overflowing.
MAX_INT = 2**53


def json_kind(value: Any) -> str:
    """What ``value`` is in JSON terms, with its article: "an object", "a string", "null", ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    return "an array" if isinstance(value, (list, tuple)) else f"a {type(value).__name__}"


def show(value: Any, limit: int = 60) -> str:
    """``value`` as it reads in the JSON file, cut to ``limit`` characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ConfigFields:
    """Typed, bounded reads of one JSON object: a whole ``config.json``, or a section of it.

    ``source`` names the file in error messages (a path or ``"config.json"``); ``prefix`` is the
    section's place in it (``"rope_scaling."``). Every reader takes the field name and a
    default; the default is returned when the field is absent or ``null``, and
    :data:`REQUIRED` (the default of the default) makes that an error instead.
    """

    def __init__(self, values: Any, source: str = "config.json", prefix: str = "") -> None:
        if not isinstance(values, Mapping):
            where = f"{source}: {prefix.rstrip('.')}" if prefix else source
            raise CheckpointError(f"{where} holds {json_kind(values)} ({show(values)}), not a JSON object")
        self.values = values
        self.source = source
        self.prefix = prefix

    def error(self, message: str) -> CheckpointError:
        """A :class:`CheckpointError` about this file: ``"{source}: {message}"``."""
        return CheckpointError(f"{self.source}: {message}")

    def has(self, name: str) -> bool:
        """Whether ``name`` is present and not ``null``."""
        return self.values.get(name) is not None

    def _get(self, name: str, default: Any) -> Any:
        value = self.values.get(name)
        if value is None and default is REQUIRED:
            raise self.error(f"{self.prefix}{name} is missing (or null); it is required")
        return value

    def _bad(self, name: str, value: Any, expected: str) -> CheckpointError:
        return self.error(f"{self.prefix}{name} is {show(value)}; expected {expected}")

    # --------------------------------------------------------------------------------- scalars

    def integer(self, name: str, default: Any = REQUIRED, *, minimum: int = 0, maximum: int = MAX_INT) -> Any:
        """An int in ``[minimum, maximum]``; bools, floats (even ``4.0``) and strings are refused."""
        value = self._get(name, default)
        if value is None:
            return default
        if not _is_int(value):
            raise self._bad(name, value, f"an int (a JSON number without a fraction), not {json_kind(value)}")
        if not minimum <= value <= maximum:
            raise self._bad(name, value, f"an int in [{minimum}, {maximum}]")
        return value

    def size(self, name: str, default: Any = REQUIRED) -> Any:
        """A positive int: a dimension, a head or layer count."""
        return self.integer(name, default, minimum=1)

    def number(
        self, name: str, default: Any = REQUIRED, *, positive: bool = False, minimum: float | None = None,
        maximum: float | None = None,
    ) -> Any:
        """A finite number (an int is accepted and returned as a float); ``positive`` excludes 0."""
        value = self._get(name, default)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self._bad(name, value, f"a number, not {json_kind(value)}")
        if _is_int(value) and abs(value) > MAX_INT:
            raise self._bad(name, value, f"a number of magnitude at most {MAX_INT}")
        number = float(value)
        if not math.isfinite(number):
            raise self._bad(name, value, "a finite number")
        if positive and number <= 0:
            raise self._bad(name, value, "a number > 0")
        if minimum is not None and number < minimum:
            raise self._bad(name, value, f"a number >= {minimum}")
        if maximum is not None and number > maximum:
            raise self._bad(name, value, f"a number <= {maximum}")
        return number

    def flag(self, name: str, default: Any = REQUIRED) -> Any:
        """``true`` or ``false``; 0, 1 and strings are refused."""
        value = self._get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(name, value, f"true or false, not {json_kind(value)}")
        return value

    def text(self, name: str, default: Any = REQUIRED, *, choices: Sequence[str] | None = None) -> Any:
        """A string, one of ``choices`` when given."""
        value = self._get(name, default)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self._bad(name, value, f"a string, not {json_kind(value)}")
        if choices is not None and value not in choices:
            raise self._bad(name, value, "one of " + ", ".join(show(c) for c in choices))
        return value

    # ---------------------------------------------------------------------------------- arrays

    def _array(self, name: str, default: Any) -> list[Any] | None:
        value = self._get(name, default)
        if value is None:
            return None
        if not isinstance(value, list):
            raise self._bad(name, value, f"an array, not {json_kind(value)}")
        return value

    def integers(self, name: str, default: Any = REQUIRED, *, minimum: int = 0, maximum: int = MAX_INT) -> Any:
        """An array of ints in ``[minimum, maximum]``."""
        value = self._array(name, default)
        if value is None:
            return default
        for index, item in enumerate(value):
            if not _is_int(item) or not minimum <= item <= maximum:
                raise self._bad(f"{name}[{index}]", item, f"an int in [{minimum}, {maximum}]")
        return list(value)

    def texts(self, name: str, default: Any = REQUIRED, *, choices: Sequence[str] | None = None) -> Any:
        """An array of strings, each one of ``choices`` when given."""
        value = self._array(name, default)
        if value is None:
            return default
        for index, item in enumerate(value):
            if not isinstance(item, str) or (choices is not None and item not in choices):
                expected = "one of " + ", ".join(show(c) for c in choices) if choices is not None else "a string"
                raise self._bad(f"{name}[{index}]", item, expected)
        return list(value)

    # -------------------------------------------------------------------------------- sections

    def section(self, name: str) -> ConfigFields | None:
        """The nested object ``name`` as :class:`ConfigFields`, or None when absent or ``null``."""
        value = self.values.get(name)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise self._bad(name, value, f"a JSON object, not {json_kind(value)}")
        return ConfigFields(value, self.source, f"{self.prefix}{name}.")
