"""Tool calls and reasoning through the official ``openai`` client: forced calls (named,
``required``, parallel or not) always parse and validate against their schemas, streamed and not;
``auto`` calls and reasoning read end to end from replies a structured output makes exact; the
follow-up turn renders; the parsers' names are checked at start."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from serverkit import MODEL, Stack, new_engine  # noqa: E402

from metrale.entrypoints.server import build_app  # noqa: E402
from metrale.errors import ConfigError  # noqa: E402
from metrale.plugins.parsers.reasoning import Qwen3ReasoningParser  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "boolean"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] if m['content'] is not none else '' }}"
            "{% if m.tool_calls is defined %}{% for c in m.tool_calls %} call {{ c.function.name }}"
            "({{ c.function.arguments | tojson }}){% endfor %}{% endif %}"
            "{% if m.tool_call_id is defined %} [{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
            "{% if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


class ScriptedThinking(Qwen3ReasoningParser):
    """Qwen3's split, without the structured-output prefix: a test's structured output then
    writes the whole reply, thinking included, so that the reply is known."""

    def structured_output_prefix(self):
        return None


def validate(arguments: str, schema: dict) -> dict:
    data = json.loads(arguments)
    try:
        import jsonschema
    except ImportError:
        assert set(data) == set(schema["required"])
        for key, value in data.items():
            expected = {"string": str, "integer": int, "boolean": bool}[schema["properties"][key]["type"]]
            assert isinstance(value, expected)
    else:
        jsonschema.validate(data, schema)
    return data


def reassemble(chunks) -> tuple[str, str, list[dict], str | None]:
    """A streamed chat answer put back together: content, reasoning, calls and finish reason."""
    content = reasoning = ""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for item in delta.tool_calls or []:
            if item.id is not None:
                assert item.index not in calls and item.type == "function" and item.id.startswith("call_")
                calls[item.index] = {"id": item.id, "name": item.function.name, "arguments": item.function.arguments or ""}
            else:
                assert item.function.name is None
                calls[item.index]["arguments"] += item.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


@pytest.fixture(scope="module")
def stack():
    stack = Stack(in_process=True, engine_options={"chat_template": TEMPLATE}, enable_auto_tool_choice=True,
                  tool_call_parser="hermes", reasoning_parser=ScriptedThinking)
    yield stack
    stack.close()


@pytest.fixture
def client(stack):
    return stack.client


def create(client, **fields):
    fields.setdefault("max_tokens", 120)
    return client.chat.completions.create(model=MODEL, messages=fields.pop("messages", MESSAGES), **fields)


@pytest.mark.parametrize("name", ["get_weather", "add"])
def test_a_named_tool_choice_always_calls_that_function(client, name):
    for seed in range(3):
        answer = create(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}}, temperature=1.0,
                        seed=seed)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == name
        validate(call.function.arguments, SCHEMAS[name])
        chunks = list(create(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}},
                             temperature=1.0, seed=seed, stream=True))
        content, _, calls, finish = reassemble(chunks)
        assert content == "" and finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls] == [(name, call.function.arguments)]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_one_of_the_tools(client, parallel):
    called = 0
    for seed in range(5):
        answer = create(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                        parallel_tool_calls=parallel, max_tokens=400)
        choice = answer.choices[0]
        if choice.finish_reason == "length":  # (a long array of calls cut by max_tokens: its text, no call)
            assert parallel and choice.message.tool_calls == [] and choice.message.content.startswith("[")
            continue
        called += 1
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        assert len({call.id for call in calls}) == len(calls)
        for call in calls:
            validate(call.function.arguments, SCHEMAS[call.function.name])
        chunks = list(create(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                             parallel_tool_calls=parallel, max_tokens=400, stream=True))
        _, _, streamed, finish = reassemble(chunks)
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments) for c in calls]
    assert called >= 1


HERMES_REPLY = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
                '</tool_call>')


def test_auto_tool_calls_are_parsed_end_to_end(client):
    exact = {"structured_outputs": {"choice": [HERMES_REPLY]}}
    answer = create(client, tools=TOOLS, temperature=0, extra_body=exact)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will check.\n"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert validate(call.function.arguments, WEATHER) == {"city": "Oslo", "days": 2}
    content, reasoning, calls, finish = reassemble(create(client, tools=TOOLS, temperature=0, extra_body=exact,
                                                          stream=True, tool_choice="auto"))
    assert (content, reasoning, finish) == ("I will check.\n", "", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]


def test_tool_choice_none_reads_no_calls(client):
    answer = create(client, tools=TOOLS, tool_choice="none", temperature=0,
                    extra_body={"structured_outputs": {"choice": [HERMES_REPLY]}})
    assert answer.choices[0].message.content == HERMES_REPLY and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "stop"


def test_reasoning_is_split_from_the_content(client):
    reply = "<think>The user greets me.</think>Hello!"
    exact = {"structured_outputs": {"choice": [reply]}}
    message = create(client, temperature=0, extra_body=exact).choices[0].message
    assert message.model_extra["reasoning_content"] == "The user greets me."
    assert message.content == "Hello!"
    content, reasoning, calls, finish = reassemble(create(client, temperature=0, extra_body=exact, stream=True))
    assert (content, reasoning, calls, finish) == ("Hello!", "The user greets me.", [], "stop")
    plain = create(client, temperature=0, extra_body={"structured_outputs": {"choice": ["Hi"]}}).choices[0].message
    assert plain.content == "Hi" and plain.model_extra["reasoning_content"] is None


def test_tool_calls_are_read_after_the_reasoning(client):
    reply = "<think>Weather needs a call.</think>" + HERMES_REPLY
    exact = {"structured_outputs": {"choice": [reply]}}
    choice = create(client, tools=TOOLS, temperature=0, extra_body=exact).choices[0]
    assert choice.message.model_extra["reasoning_content"] == "Weather needs a call."
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    content, reasoning, calls, finish = reassemble(create(client, tools=TOOLS, temperature=0, extra_body=exact,
                                                          stream=True))
    assert (content, reasoning, finish) == ("I will check.\n", "Weather needs a call.", "tool_calls")
    assert calls[0]["arguments"] == choice.message.tool_calls[0].function.arguments


def test_the_follow_up_turn_renders(client, stack):
    first = create(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    turn = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
            {"role": "tool", "tool_call_id": call.id, "content": "41"}]
    answer = create(client, messages=turn, tools=TOOLS, temperature=0, max_tokens=4)
    assert answer.choices[0].message.role == "assistant"
    arguments = json.loads(call.function.arguments)
    expected = stack.engine.llm.render_chat(
        [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "add", "arguments": arguments}}]},
         {"role": "tool", "tool_call_id": call.id, "content": "41"}], tools=TOOLS)
    assert f"call add({json.dumps(arguments)})" in expected and f"[{call.id}]" in expected
    assert answer.usage.prompt_tokens == len(stack.engine.llm.encode(expected, add_special_tokens=False))


def test_qwen3_forced_calls_and_structured_output_follow_the_thinking():
    own = Stack(in_process=True, reasoning_parser="qwen3")
    try:
        tokenizer = own.engine.llm.tokenizer
        no_think = {str(i): -100 for i in range(tokenizer.get_vocab_size()) if tokenizer.id_to_token(i).startswith("<")}
        for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"logit_bias": no_think}):
            choice = create(own.client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                            temperature=0, extra_body=extra).choices[0]
            assert choice.finish_reason == "tool_calls"
            validate(choice.message.tool_calls[0].function.arguments, ADD)
            assert choice.message.model_extra["reasoning_content"] is None
        formatted = create(own.client, temperature=0, extra_body={"logit_bias": no_think}, response_format={
            "type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}).choices[0]
        validate(formatted.message.content, WEATHER)
    finally:
        own.close()


def test_auto_without_the_flag_answers_text():
    own = Stack(in_process=True, tool_call_parser="hermes")
    try:
        answer = create(own.client, tools=TOOLS, temperature=0,
                        extra_body={"structured_outputs": {"choice": [HERMES_REPLY]}})
        assert answer.choices[0].message.content == HERMES_REPLY and answer.choices[0].message.tool_calls == []
        assert "reasoning_content" not in answer.choices[0].message.model_extra
    finally:
        own.close()


def test_parser_names_are_checked_when_the_app_is_built():
    engine = new_engine(True)
    try:
        with pytest.raises(ConfigError, match="unknown tool-call parser 'nope'.*hermes"):
            build_app(engine, model_name=MODEL, tool_call_parser="nope", owns_engine=False)
        with pytest.raises(ConfigError, match="unknown reasoning parser 'nope'.*deepseek_r1.*qwen3"):
            build_app(engine, model_name=MODEL, reasoning_parser="nope", owns_engine=False)
        with pytest.raises(ConfigError, match="tool_call_parser"):
            build_app(engine, model_name=MODEL, enable_auto_tool_choice=True, owns_engine=False)
    finally:
        engine.shutdown()


def test_metrale_serve_refuses_an_unknown_parser_before_loading(capsys):
    from metrale.entrypoints.cli import main

    assert main(["serve", "tiny-dense", "--port", "0", "--tool-call-parser", "nope"]) == 2
    assert "unknown tool-call parser 'nope'" in capsys.readouterr().err
    assert main(["serve", "tiny-dense", "--port", "0", "--enable-auto-tool-choice"]) == 2
    assert "--tool-call-parser" in capsys.readouterr().err
    assert main(["serve", "tiny-dense", "--port", "0", "--reasoning-parser", "nope"]) == 2
    assert "openai_gptoss" in capsys.readouterr().err
