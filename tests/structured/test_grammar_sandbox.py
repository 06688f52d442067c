"""A structured output can cost only its own request: constraints that crash llguidance (a
grammar of thousands of chained rules overflows its stack), that are over the size or time limit,
or that admit no output are refused with a typed error before the serving process compiles them,
and the process goes on serving, structured outputs included."""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("llguidance")

from metrale import LLM, SamplingParams  # noqa: E402
from metrale.errors import InvalidRequestError  # noqa: E402
from metrale.structured import StructuredOutputParams  # noqa: E402
from metrale.structured.sandbox import MAX_CONSTRAINT_BYTES  # noqa: E402


def chained_rules(count: int) -> str:
    """A Lark grammar of ``count`` rules, each calling the next: llguidance recurses once per rule."""
    rules = ["start: r0"] + [f'r{i}: r{i + 1} "a"' for i in range(count)] + [f'r{count}: "b"']
    return "\n".join(rules)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-dense", device="cpu", show_progress=False) as llm:
        yield llm


def constrained(**constraint):
    return SamplingParams(max_tokens=8, temperature=0.0, structured_output=StructuredOutputParams(**constraint))


def test_a_grammar_that_crashes_the_compiler_is_refused_and_the_process_lives(llm):
    compiler = llm.grammar_compiler()
    for count in (3000, 6000):
        with pytest.raises(InvalidRequestError, match="crashed the structured-output compiler.*SIGSEGV"):
            llm.generate("Return the", constrained(grammar=chained_rules(count)))
    assert compiler.sandbox.restarts == 2
    # The same process serves, structured outputs included (a new compiler worker).
    out = llm.generate("Return the", constrained(choice=["yes", "no"]))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert llm.generate("Return the", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0].token_ids


def test_a_grammar_the_sandbox_accepts_is_served(llm):
    out = llm.generate("Return the", constrained(grammar=chained_rules(200)))[0]
    assert out.text and ("b" + "a" * 200).startswith(out.text)  # the only sentence, cut by max_tokens


def test_a_constraint_over_the_size_limit_is_refused_naming_it(llm):
    long_regex = "a" * (MAX_CONSTRAINT_BYTES + 1)
    with pytest.raises(InvalidRequestError, match=f"over the limit of {MAX_CONSTRAINT_BYTES} bytes"):
        llm.generate("Return the", constrained(regex=long_regex))


def test_a_compile_over_the_time_limit_is_refused_naming_it(llm):
    compiler = llm.grammar_compiler()
    compiler.check(StructuredOutputParams(regex="[0-9]+"))  # the worker runs
    before, worker = compiler.sandbox.restarts, compiler.sandbox._process
    os.kill(worker.pid, signal.SIGSTOP)  # a compile that never ends, as the worker sees it
    compiler.sandbox.timeout = 0.5
    try:
        with pytest.raises(InvalidRequestError, match="took longer than the limit of 0.5 s"):
            llm.generate("Return the", constrained(regex="[a-z]{3,7} and [0-9]+"))
    finally:
        compiler.sandbox.timeout = 10.0
    assert compiler.sandbox.restarts == before + 1 and worker.poll() is not None  # stopped for good
    assert llm.generate("Return the", constrained(regex="[a-z]{3,7} and [0-9]+"))[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("constraint", [
    {"json": {"$ref": "#"}},
    {"grammar": 'start: x\nx: x "a"'},
    {"regex": "a[^\\s\\S]"},
], ids=["self-referencing schema", "grammar without a sentence", "regex without a match"])
def test_a_constraint_that_admits_no_output_is_refused_before_the_engine(llm, constraint):
    with pytest.raises(InvalidRequestError, match="admits no output"):
        llm.generate("Return the", constrained(**constraint))
    assert llm.engine.check() == [] and llm.cache.holdings() == (0, 0)


def test_a_checked_constraint_is_not_checked_again(llm):
    compiler = llm.grammar_compiler()
    params = StructuredOutputParams(regex="[0-9]{2}")
    compiler.check(params)
    process = compiler.sandbox._process
    compiler.sandbox._stop_worker()  # a second check of the same constraint needs no worker
    compiler.check(params)
    assert compiler.sandbox._process is None and process is not None


def test_closing_the_llm_stops_the_compiler_worker():
    llm = LLM("tiny-dense", device="cpu", show_progress=False)
    llm.generate("Return the", constrained(choice=["a", "b"]))
    process = llm.grammar_compiler().sandbox._process
    assert process is not None and process.poll() is None
    llm.close()
    assert process.poll() is not None
