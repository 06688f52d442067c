"""metrale/loading/config_fields.py: each reader takes exactly JSON's own type, within its bounds, and says
which file, field and value it refused."""

from __future__ import annotations

import math
import re

import pytest

from metrale.errors import CheckpointError
from metrale.loading import config_fields
from metrale.loading.config_fields import MAX_INT, REQUIRED, ConfigFields

# (reader, options, value, the value returned) for values each reader accepts.
ACCEPTED = [
    ("integer", {}, 0, 0),
    ("integer", {}, MAX_INT, MAX_INT),
    ("size", {}, 1, 1),
    ("number", {}, 3, 3.0),
    ("number", {}, -1.5e-6, -1.5e-6),
    ("number", {"positive": True}, 1e-12, 1e-12),
    ("number", {"maximum": 1.0}, 1, 1.0),
    ("flag", {}, False, False),
    ("text", {"choices": ("a", "b")}, "b", "b"),
    ("integers", {}, [], []),
    ("integers", {}, [0, 7], [0, 7]),
    ("texts", {}, ["x"], ["x"]),
]

# (reader, options, value, what the message expects) for values each reader refuses.
REFUSED = [
    ("integer", {}, True, "an int (a JSON number without a fraction), not a boolean"),
    ("integer", {}, 4.0, "an int (a JSON number without a fraction), not a number"),
    ("integer", {}, "4", "an int (a JSON number without a fraction), not a string"),
    ("integer", {}, [4], "an int (a JSON number without a fraction), not an array"),
    ("integer", {}, -1, f"an int in [0, {MAX_INT}]"),
    ("integer", {}, MAX_INT + 1, f"an int in [0, {MAX_INT}]"),
    ("integer", {"minimum": 2}, 1, f"an int in [2, {MAX_INT}]"),
    ("size", {}, 0, f"an int in [1, {MAX_INT}]"),
    ("number", {}, "1e-6", "a number, not a string"),
    ("number", {}, False, "a number, not a boolean"),
    ("number", {}, math.nan, "a finite number"),
    ("number", {}, -math.inf, "a finite number"),
    ("number", {}, 10**400, f"a number of magnitude at most {MAX_INT}"),
    ("number", {"positive": True}, 0, "a number > 0"),
    ("number", {"minimum": 0.0}, -0.5, "a number >= 0.0"),
    ("number", {"maximum": 1.0}, 1.5, "a number <= 1.0"),
    ("flag", {}, 1, "true or false, not a number"),
    ("flag", {}, "false", "true or false, not a string"),
    ("text", {}, 3, "a string, not a number"),
    ("text", {"choices": ("a", "b")}, "c", 'one of "a", "b"'),
    ("integers", {}, {"0": 1}, "an array, not an object"),
    ("integers", {}, [1, True], f"an int in [0, {MAX_INT}]"),
    ("texts", {}, ["x", 1], "a string"),
    ("texts", {"choices": ("x",)}, ["y"], 'one of "x"'),
]


@pytest.mark.parametrize("reader, options, value, expected", ACCEPTED)
def test_reader_accepts_json_of_its_type(reader, options, value, expected):
    got = getattr(ConfigFields({"f": value}), reader)("f", **options)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("reader, options, value, expected", REFUSED, ids=[f"{r}-{v!r}"[:40] for r, _, v, _ in REFUSED])
def test_reader_refuses_naming_file_field_value_and_expectation(reader, options, value, expected):
    fields = ConfigFields({"f": value}, "/ckpt/config.json")
    message = r"^/ckpt/config\.json: f(\[\d\])? is .*; expected " + re.escape(expected)
    with pytest.raises(CheckpointError, match=message):
        getattr(fields, reader)("f", **options)


READERS = ["integer", "size", "number", "flag", "text", "integers", "texts"]


@pytest.mark.parametrize("reader", READERS)
def test_absent_or_null_gives_the_default_or_fails_when_required(reader):
    for values, state in (({}, "missing"), ({"f": None}, "null")):
        fields = ConfigFields(values, "config.json")
        assert getattr(fields, reader)("f", "default") == "default"
        with pytest.raises(CheckpointError, match=rf"config\.json: f is {state}; it is required"):
            getattr(fields, reader)("f", REQUIRED)


@pytest.mark.parametrize("reader", READERS)
def test_a_null_can_mean_something_else_than_an_absent_field(reader):
    absent, null = ConfigFields({}, "config.json"), ConfigFields({"f": None}, "config.json")
    read = getattr(null, reader)
    # null= gives the null's own result; the default still serves an absent field.
    assert read("f", "default", null=None) is None
    assert read("f", "default", null="null") == "null"
    assert getattr(absent, reader)("f", "default", null=None) == "default"
    assert read("f", REQUIRED, null=None) is None
    with pytest.raises(CheckpointError, match=r"config\.json: f is missing; it is required"):
        getattr(absent, reader)("f", REQUIRED, null=None)
    # REFUSED: a null is an error naming the field; absent still takes the default.
    with pytest.raises(CheckpointError, match=r"^config\.json: f is null; expected .*; null is not accepted"):
        read("f", "default", null=config_fields.REFUSED)
    assert getattr(absent, reader)("f", "default", null=config_fields.REFUSED) == "default"
    # AS_ABSENT is the default of null=.
    assert read("f", "default", null=config_fields.AS_ABSENT) == "default"


def test_present_and_is_null_tell_null_from_absent():
    fields = ConfigFields({"a": None, "b": 0, "c": False}, "config.json")
    assert [fields.present(n) for n in "abcd"] == [True, True, True, False]
    assert [fields.is_null(n) for n in "abcd"] == [True, False, False, False]
    assert [fields.has(n) for n in "abcd"] == [False, True, True, False]


def test_sections_nest_their_names_and_refuse_non_objects():
    fields = ConfigFields({"rope_scaling": {"factor": "x"}, "rope_parameters": [1], "none": None}, "c.json")
    assert fields.section("none") is None and fields.section("absent") is None
    with pytest.raises(CheckpointError, match=re.escape('c.json: rope_scaling.factor is "x"; expected a number')):
        fields.section("rope_scaling").number("factor")
    with pytest.raises(CheckpointError, match=re.escape("c.json: rope_parameters is [1]; expected a JSON object")):
        fields.section("rope_parameters")


@pytest.mark.parametrize("value, kind", [([], "an array"), ("x", "a string"), (3, "a number"), (None, "null")])
def test_a_whole_file_must_be_an_object(value, kind):
    with pytest.raises(CheckpointError, match=f"^config.json holds {kind} "):
        ConfigFields(value, "config.json")


def test_long_values_are_cut_in_messages():
    with pytest.raises(CheckpointError) as info:
        ConfigFields({"f": list(range(10**5))}).integer("f")
    assert len(str(info.value)) < 200 and "..." in str(info.value)
