"""Typed reading of ``config.json`` fields, shared by every model family.

Hugging Face writes ``config.json`` with JSON's own types: ints for sizes and counts, numbers for
epsilons and factors, ``true`` / ``false`` for flags, ``null`` for "not set". A field of any
other type is a broken checkpoint. :class:`ConfigFields` refuses it with a
:class:`~metrale.errors.CheckpointError` that names the file, the field, the value and what was
expected, rather than letting ``int("128")`` pass silently or a bare ``TypeError`` escape from
deep inside a loader. Bounds stop at what a field can mean (a size is at least 1); whether a size
is *right* is for the tensors to say (:meth:`metrale.loading.checkpoint.Checkpoint.expect_shape`).

A field may be absent, or present as ``null``, and the two need not mean the same: transformers'
config classes give an absent field the class default, while an explicit ``null`` keeps None
(which the class may then resolve: Llama's ``head_dim: null`` is ``hidden_size //
num_attention_heads``) or is refused (a field the class does not type as optional, such as
``rms_norm_eps``). Every reader takes ``null=``, what an explicit ``null`` gives:
:data:`AS_ABSENT` (the default: the same as a missing field), any value of the caller's (None, to
tell the two apart), or :data:`REFUSED` (an error naming the field). :meth:`ConfigFields.present`
and :meth:`ConfigFields.is_null` ask the same without reading.

Usage::

    fields = ConfigFields(checkpoint.config, "config.json")
    hidden = fields.size("hidden_size")                      # required, an int >= 1
    kv_heads = fields.size("num_key_value_heads", heads)     # optional: null or absent -> heads
    head_dim = fields.size("head_dim", 128, null=None)       # absent -> 128, null -> None
    eps = fields.number("rms_norm_eps", 1e-6, positive=True, null=REFUSED)  # absent -> 1e-6, null refused
    rope = fields.section("rope_scaling")                    # a nested object, or None
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Sequence

from metrale.errors import CheckpointError


class _Marker:
    """A named sentinel (its name is its repr, for the docs and for messages)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


#: Marks a field without a default: absent (or ``null``, unless ``null=`` says otherwise) is an error.
REQUIRED: Any = _Marker("REQUIRED")

#: ``null=`` of the readers: an explicit ``null`` reads as a missing field (the default).
AS_ABSENT: Any = _Marker("AS_ABSENT")

#: ``null=`` of the readers: an explicit ``null`` is refused with a
#: :class:`~metrale.errors.CheckpointError` naming the field.
REFUSED: Any = _Marker("REFUSED")

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
    section's place in it (``"rope_scaling."``). Every reader takes the field name, a default
    and ``null``: the default is returned when the field is absent, and :data:`REQUIRED` (the
    default of the default) makes that an error instead; ``null`` is what an explicit ``null``
    gives -- :data:`AS_ABSENT` (the default) reads it as absent, :data:`REFUSED` refuses it, and
    any other value is returned as it is.
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

    def present(self, name: str) -> bool:
        """Whether ``name`` is in the object at all, ``null`` included."""
        return name in self.values

    def is_null(self, name: str) -> bool:
        """Whether ``name`` is present as ``null``."""
        return name in self.values and self.values[name] is None

    def _get(self, name: str, default: Any, null: Any, expected: str) -> tuple[bool, Any]:
        """``(True, value)`` for a value the reader checks, ``(False, result)`` for the result of
        an absent or ``null`` field (``expected`` words the refusal of a null)."""
        if name not in self.values:
            if default is REQUIRED:
                raise self.error(f"{self.prefix}{name} is missing; it is required")
            return False, default
        value = self.values[name]
        if value is not None:
            return True, value
        if null is REFUSED:
            raise self._bad(name, None, f"{expected}; null is not accepted for this field")
        if null is AS_ABSENT:
            if default is REQUIRED:
                raise self.error(f"{self.prefix}{name} is null; it is required")
            return False, default
        return False, null

    def _bad(self, name: str, value: Any, expected: str) -> CheckpointError:
        return self.error(f"{self.prefix}{name} is {show(value)}; expected {expected}")

    # --------------------------------------------------------------------------------- scalars

    def integer(
        self, name: str, default: Any = REQUIRED, *, minimum: int = 0, maximum: int = MAX_INT, null: Any = AS_ABSENT,
    ) -> Any:
        """An int in ``[minimum, maximum]``; bools, floats (even ``4.0``) and strings are refused."""
        found, value = self._get(name, default, null, f"an int in [{minimum}, {maximum}]")
        if not found:
            return value
        if not _is_int(value):
            raise self._bad(name, value, f"an int (a JSON number without a fraction), not {json_kind(value)}")
        if not minimum <= value <= maximum:
            raise self._bad(name, value, f"an int in [{minimum}, {maximum}]")
        return value

    def size(self, name: str, default: Any = REQUIRED, *, null: Any = AS_ABSENT) -> Any:
        """A positive int: a dimension, a head or layer count."""
        return self.integer(name, default, minimum=1, null=null)

    def number(
        self, name: str, default: Any = REQUIRED, *, positive: bool = False, minimum: float | None = None,
        maximum: float | None = None, null: Any = AS_ABSENT,
    ) -> Any:
        """A finite number (an int is accepted and returned as a float); ``positive`` excludes 0."""
        found, value = self._get(name, default, null, "a number")
        if not found:
            return value
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

    def flag(self, name: str, default: Any = REQUIRED, *, null: Any = AS_ABSENT) -> Any:
        """``true`` or ``false``; 0, 1 and strings are refused."""
        found, value = self._get(name, default, null, "true or false")
        if not found:
            return value
        if not isinstance(value, bool):
            raise self._bad(name, value, f"true or false, not {json_kind(value)}")
        return value

    def text(
        self, name: str, default: Any = REQUIRED, *, choices: Sequence[str] | None = None, null: Any = AS_ABSENT,
    ) -> Any:
        """A string, one of ``choices`` when given."""
        found, value = self._get(name, default, null, "a string")
        if not found:
            return value
        if not isinstance(value, str):
            raise self._bad(name, value, f"a string, not {json_kind(value)}")
        if choices is not None and value not in choices:
            raise self._bad(name, value, "one of " + ", ".join(show(c) for c in choices))
        return value

    # ---------------------------------------------------------------------------------- arrays

    def _array(self, name: str, default: Any, null: Any) -> tuple[bool, Any]:
        found, value = self._get(name, default, null, "an array")
        if found and not isinstance(value, list):
            raise self._bad(name, value, f"an array, not {json_kind(value)}")
        return found, value

    def integers(
        self, name: str, default: Any = REQUIRED, *, minimum: int = 0, maximum: int = MAX_INT, null: Any = AS_ABSENT,
    ) -> Any:
        """An array of ints in ``[minimum, maximum]``."""
        found, value = self._array(name, default, null)
        if not found:
            return value
        for index, item in enumerate(value):
            if not _is_int(item) or not minimum <= item <= maximum:
                raise self._bad(f"{name}[{index}]", item, f"an int in [{minimum}, {maximum}]")
        return list(value)

    def texts(
        self, name: str, default: Any = REQUIRED, *, choices: Sequence[str] | None = None, null: Any = AS_ABSENT,
    ) -> Any:
        """An array of strings, each one of ``choices`` when given."""
        found, value = self._array(name, default, null)
        if not found:
            return value
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
