"""Structured output through the engine: every output parses against its constraint, greedy
and sampled, with overlap scheduling on and off, beside unconstrained requests in one batch."""

from __future__ import annotations

import json
import re

import pytest

from metrale import LLM, SamplingParams
from metrale.errors import InvalidRequestError
from metrale.structured import StructuredOutputParams

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 200},
                   "kind": {"enum": ["cat", "dog"]}},
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "step-by-step"])
def llm(request):
    return LLM("tiny-dense", device="cpu", show_progress=False, overlap_scheduling=request.param)


def check_schema(text):
    value = json.loads(text)
    assert set(value) == {"name", "age", "kind"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 10
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 200 and value["kind"] in ("cat", "dog")


def test_json_schema_outputs_parse_greedy_and_sampled(llm):
    constraint = StructuredOutputParams(json=SCHEMA)
    params = [SamplingParams(max_tokens=80, temperature=t, seed=s, structured_output=constraint)
              for t, s in [(0.0, 0), (0.8, 1), (1.0, 2), (1.2, 3)]]
    plain = SamplingParams(max_tokens=20, temperature=0.0)
    prompts = ["Return the", "Open a file", "x", "y", "Return the"]
    outputs = llm.generate(prompts, [*params, plain])
    for output in outputs[:4]:
        assert output.finish_reason == "stop", output.text
        check_schema(output.text)
    assert outputs[4].token_ids == llm.generate(["Return the"], plain)[0].token_ids
    assert llm.cache.holdings() == (0, 0)


def test_choice_regex_and_json_object(llm):
    choice = llm.generate(["Return the"], SamplingParams(max_tokens=20, temperature=0.9, seed=4, n=6,
                                                        structured_output=StructuredOutputParams(choice=["alpha", "beta"])))[0]
    assert {c.text for c in choice.outputs} <= {"alpha", "beta"} and all(c.finish_reason == "stop" for c in choice.outputs)
    pattern = r"[0-9]{3}-[a-z]{2}"
    regex = llm.generate(["Open a file"], SamplingParams(max_tokens=20, temperature=0.7, seed=5,
                                                          structured_output=StructuredOutputParams(regex=pattern)))[0]
    assert re.fullmatch(pattern, regex.text)
    anything = llm.generate(["x"], SamplingParams(max_tokens=40, temperature=0.8, seed=1,
                                                 structured_output=StructuredOutputParams(json_object=True)))[0]
    assert anything.finish_reason == "stop" and isinstance(json.loads(anything.text), dict)


def test_an_invalid_schema_is_refused_before_anything_runs(llm):
    with pytest.raises(InvalidRequestError, match="json"):
        llm.generate(["x"], SamplingParams(structured_output=StructuredOutputParams(json={"type": "no-such-type"})))
    assert not llm.engine.has_unfinished() and llm.cache.holdings() == (0, 0)
