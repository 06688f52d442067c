"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the official
``anthropic`` client: answers equal chat completions' for the same conversation, streams follow
Anthropic's event order and equal the whole answers, forced tools always validate, tool results
render, reasoning becomes thinking blocks, stop sequences, the API key and metrics."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from serverkit import API_KEY, MODEL, Stack, http_client, metric_values, wait_idle  # noqa: E402

from metrale.entrypoints.parsers import CallPiece, ReasoningParser, ReasoningSplit, ToolCallParse, ToolParser  # noqa: E402
from metrale.entrypoints.server.anthropic import _MessageContext  # noqa: E402
from metrale.params import CompletionOutput  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}, {"name": "add", "input_schema": ADD}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
              {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
PROMPT = "Open a file and"
MESSAGES = [{"role": "user", "content": PROMPT}]
GREEDY = {"temperature": 0}  # (sent as an extra field: newer clients dropped the sampling arguments)

# A template that shows the calls, the tool results' ids and the thinking switch in the prompt.
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] if m['content'] is not none else '' }}"
            "{% if m.tool_calls is defined %}{% for c in m.tool_calls %} call {{ c.function.name }}"
            "({{ c.function.arguments | tojson }}){% endfor %}{% endif %}"
            "{% if m.tool_call_id is defined %} [{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
            "{% if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
ARGUMENTS = '{"city": "Oslo", "days": 2}'


class FirstWordThinking(ReasoningParser):
    """The reply up to its first space is the reasoning, the rest the content; none with
    ``enable_thinking`` false. (The tiny model writes no thinking markers of its own.)"""

    def split(self, text, final):
        if self.chat_template_kwargs.get("enable_thinking", True) is False:
            return ReasoningSplit("", text)
        space = text.find(" ")
        if space < 0:
            return ReasoningSplit(text if final else "", "")
        return ReasoningSplit(text[:space], text[space + 1:])


class ScriptedCall(ToolParser):
    """The content's first word stays content, the rest is one call of get_weather whose
    arguments (always ARGUMENTS) arrive as the text grows. (The tiny model writes no call syntax.)"""

    def parse(self, text, final):
        space = text.find(" ", len(text) - len(text.lstrip()))  # (after the word: the content has one)
        if space < 0:
            return ToolCallParse(len(text) if final else 0)
        shown = ARGUMENTS if final else ARGUMENTS[:len(text) - space]
        return ToolCallParse(space, (CallPiece("get_weather", shown, final),))


@pytest.fixture(scope="module")
def plain():
    """The embedded model and its own template, no parsers."""
    stack = Stack(in_process=True)
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def parsed():
    """The scripted parsers over TEMPLATE, with auto tool choice."""
    stack = Stack(in_process=True, engine_options={"chat_template": TEMPLATE}, enable_auto_tool_choice=True,
                  tool_call_parser=ScriptedCall, reasoning_parser=FirstWordThinking)
    yield stack
    stack.close()


def client_of(stack, api_key="unused", **options):
    return anthropic.Anthropic(base_url=stack.url, api_key=api_key, max_retries=0, **options)


def create(stack, **fields):
    fields.setdefault("max_tokens", 24)
    extra = {**GREEDY, **fields.pop("extra_body", {})}
    return client_of(stack).messages.create(model=MODEL, messages=fields.pop("messages", MESSAGES), extra_body=extra,
                                            **fields)


def chat(stack, **fields):
    fields.setdefault("max_tokens", 24)
    return stack.client.chat.completions.create(model=MODEL, messages=fields.pop("messages", MESSAGES), temperature=0,
                                                **fields)


def read_events(stack, body):
    """The (event name, data) pairs of a raw stream of ``/v1/messages``."""
    events = []
    with stack.http.stream("POST", "/v1/messages", json={"model": MODEL, "stream": True, **GREEDY, **body}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append((name, data))
                name = None
    return events


def streamed(stack, **fields):
    """The final message of the client's stream helper, and the events it went through."""
    fields.setdefault("max_tokens", 24)
    extra = {**GREEDY, **fields.pop("extra_body", {})}
    with client_of(stack).messages.stream(model=MODEL, messages=fields.pop("messages", MESSAGES), extra_body=extra,
                                          **fields) as stream:
        events = [event.type for event in stream]
        return stream.get_final_message(), events


def blocks(message):
    return [block.model_dump(exclude_none=True) for block in message.content]


def validate(data, schema):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(data, schema)


# ------------------------------------------------------------------------------------- text


CONVERSATIONS = [
    (MESSAGES, None, MESSAGES),
    ([{"role": "user", "content": [{"type": "text", "text": "Open a "}, {"type": "text", "text": "file and"}]}],
     "You write code.", [{"role": "system", "content": "You write code."}, {"role": "user", "content": PROMPT}]),
    ([{"role": "user", "content": "Sort a list"}, {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
      {"role": "user", "content": "Again"}], [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort a list"},
      {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Again"}]),
]


@pytest.mark.parametrize(("messages", "system", "equivalent"), CONVERSATIONS, ids=["user", "blocks", "turns"])
def test_greedy_text_equals_chat_completions(plain, messages, system, equivalent):
    fields = {"system": system} if system is not None else {}
    message = create(plain, messages=messages, **fields)
    expected = chat(plain, messages=equivalent)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL
    assert blocks(message) == [{"type": "text", "text": expected.choices[0].message.content}]
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.input_tokens == expected.usage.prompt_tokens
    assert message.usage.output_tokens == expected.usage.completion_tokens == 24
    count = client_of(plain).messages.count_tokens(model=MODEL, messages=messages, **fields)
    assert count.input_tokens == expected.usage.prompt_tokens


def test_stream_events_come_in_order_and_equal_the_whole_answer(plain):
    whole = create(plain)
    events = read_events(plain, {"max_tokens": 24, "messages": MESSAGES})
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert start["usage"] == {"input_tokens": whole.usage.input_tokens, "output_tokens": 0}
    body = [name for name in names[1:-2] if name != "ping"]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"}
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    assert text == whole.content[0].text
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    final, seen = streamed(plain)
    assert seen[0] == "message_start" and seen[-1] == "message_stop"
    assert blocks(final) == blocks(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens and final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences(plain):
    full = create(plain, max_tokens=30).content[0].text
    stop = " " + full.split(" ")[3]
    cut = full[:full.index(stop)]
    message = create(plain, max_tokens=30, stop_sequences=[stop, "zzzz"])
    assert message.content[0].text == cut
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    final, _ = streamed(plain, max_tokens=30, stop_sequences=[stop])
    assert final.content[0].text == cut and (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_stop_reasons_of_finished_replies(plain):
    """end_turn for an end-of-sequence token (the tiny model rarely writes one on its own)."""
    context = _MessageContext(plain.app.state.metrale, MODEL, "msg_x", None, [1], ["END"], [])
    eos = plain.app.state.metrale.eos_token_ids[0]

    class Finished:
        def finish_reason(self, reason):
            return reason

    def stop(finish, reason):
        return context.stop(Finished(), CompletionOutput(0, "a", [5, eos], finish_reason=finish, stop_reason=reason))

    assert stop("stop", eos) == ("end_turn", None)
    assert stop("stop", "END") == ("stop_sequence", "END")
    assert stop("length", None) == ("max_tokens", None)


# ------------------------------------------------------------------------------------ tools


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "tool", "name": "add"},
                                    {"type": "any"}, {"type": "any", "disable_parallel_tool_use": True}],
                         ids=["tool weather", "tool add", "any", "any single"])
def test_forced_tools_always_give_valid_tool_use(plain, choice):
    called = 0
    for temperature in (1.0, 1.0, 0.7):
        for stream in (False, True):
            fields = {"tools": TOOLS, "tool_choice": choice, "max_tokens": 300, "extra_body": {"temperature": temperature}}
            message = streamed(plain, **fields)[0] if stream else create(plain, **fields)
            if message.stop_reason == "max_tokens":  # a long array of calls cut short: its text, or the calls streamed
                assert choice == {"type": "any"} and (stream or [b.type for b in message.content] == ["text"])
                continue
            called += 1
            assert message.stop_reason == "tool_use", message
            uses = [block for block in message.content if block.type == "tool_use"]
            assert uses and len(uses) == len(message.content)
            assert len(uses) == 1 or choice == {"type": "any"}
            assert len({use.id for use in uses}) == len(uses)
            for use in uses:
                assert use.id.startswith("toolu_") and isinstance(use.input, dict)
                if choice["type"] == "tool":
                    assert use.name == choice["name"]
                validate(use.input, SCHEMAS[use.name])
    assert called >= 2


def test_a_forced_stream_equals_the_whole_answer(plain):
    fields = {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "add"}, "max_tokens": 120}
    whole = create(plain, **fields)
    events = read_events(plain, {"messages": MESSAGES, **fields})
    [use] = whole.content
    pieces = [data["delta"]["partial_json"] for name, data in events if name == "content_block_delta"]
    assert json.loads("".join(pieces)) == use.input
    starts = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert starts == [{"type": "tool_use", "id": starts[0]["id"], "name": "add", "input": {}}]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    final, _ = streamed(plain, **fields)
    assert [(b.name, b.input) for b in final.content] == [("add", use.input)] and final.stop_reason == "tool_use"


def test_auto_calls_are_read_by_the_parser(parsed):
    message = create(parsed, tools=TOOLS)
    expected = chat(parsed, tools=CHAT_TOOLS).choices[0]
    assert expected.finish_reason == "tool_calls"
    kinds = [block.type for block in message.content]
    assert kinds == ["thinking", "text", "tool_use"]
    thinking, text, use = message.content
    assert thinking.thinking == expected.message.model_extra["reasoning_content"] and thinking.signature == ""
    assert text.text == expected.message.content
    assert (use.name, use.input) == ("get_weather", json.loads(ARGUMENTS)) and use.id.startswith("toolu_")
    assert message.stop_reason == "tool_use"
    final, events = streamed(parsed, tools=TOOLS)
    assert [{k: v for k, v in b.items() if k != "id"} for b in blocks(final)] == \
        [{k: v for k, v in b.items() if k != "id"} for b in blocks(message)]
    assert final.stop_reason == "tool_use" and events.count("content_block_start") == 3
    single = create(parsed, tools=TOOLS, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [block.type for block in single.content] == kinds


def test_tool_choice_none_reads_no_calls(parsed):
    message = create(parsed, tools=TOOLS, tool_choice={"type": "none"})
    expected = chat(parsed, tools=CHAT_TOOLS, tool_choice="none").choices[0].message
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[1].text == expected.content and message.stop_reason == "max_tokens"


def test_a_tool_result_turn_renders_and_answers(parsed):
    first = create(parsed, tools=TOOLS, tool_choice={"type": "tool", "name": "add"}, max_tokens=120,
                   extra_body={"thinking": {"type": "disabled"}})
    [use] = first.content
    validate(use.input, ADD)
    turn = [*MESSAGES, {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "41"},
                                         {"type": "text", "text": "Thanks."}]}]
    answer = create(parsed, messages=turn, tools=TOOLS, max_tokens=4, tool_choice={"type": "none"})
    assert answer.role == "assistant" and answer.content
    equivalent = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "add", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "41"}, {"role": "user", "content": "Thanks."}]
    expected = chat(parsed, messages=equivalent, tools=CHAT_TOOLS, max_tokens=4, tool_choice="none")
    assert answer.usage.input_tokens == expected.usage.prompt_tokens
    rendered = parsed.engine.llm.render_chat([*equivalent[:1], {**equivalent[1], "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "add", "arguments": use.input}}]}, *equivalent[2:]],
        tools=CHAT_TOOLS)
    assert f"call add({json.dumps(use.input)})" in rendered and f"[{use.id}]" in rendered
    count = client_of(parsed).messages.count_tokens(model=MODEL, messages=turn, tools=TOOLS)
    assert count.input_tokens == expected.usage.prompt_tokens
    failed = [*turn[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "is_error": True, "content": [{"type": "text", "text": "boom"}]}]}]
    assert create(parsed, messages=failed, tools=TOOLS, max_tokens=2).usage.input_tokens > 0


# -------------------------------------------------------------------------------- thinking


def test_reasoning_becomes_a_thinking_block(parsed):
    message = create(parsed)
    expected = chat(parsed).choices[0].message
    assert blocks(message) == [{"type": "thinking", "thinking": expected.model_extra["reasoning_content"], "signature": ""},
                               {"type": "text", "text": expected.content}]
    events = read_events(parsed, {"max_tokens": 24, "messages": MESSAGES})
    kinds = [data["delta"]["type"] for name, data in events if name == "content_block_delta"]
    assert kinds[0] == "thinking_delta" and kinds[-1] == "text_delta"
    final, _ = streamed(parsed)
    assert blocks(final) == blocks(message)
    enabled = create(parsed, max_tokens=24, thinking={"type": "enabled", "budget_tokens": 16})
    assert blocks(enabled) == blocks(message) and enabled.usage.input_tokens == message.usage.input_tokens


def test_thinking_disabled_switches_the_template_off(parsed):
    message = create(parsed, thinking={"type": "disabled"})
    expected = chat(parsed, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert blocks(message) == [{"type": "text", "text": expected.choices[0].message.content}]
    assert message.usage.input_tokens == expected.usage.prompt_tokens > chat(parsed).usage.prompt_tokens
    count = client_of(parsed).messages.count_tokens(model=MODEL, messages=MESSAGES, thinking={"type": "disabled"})
    assert count.input_tokens == expected.usage.prompt_tokens


# ------------------------------------------------------------------------ key, metrics, aborts


def test_api_key_as_x_api_key_or_bearer():
    stack = Stack(in_process=True, api_key=API_KEY)
    try:
        body = {"model": MODEL, "max_tokens": 2, "messages": MESSAGES}
        with http_client(stack.url) as http:
            for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}):
                response = http.post("/v1/messages", json=body, headers=headers)
                assert response.status_code == 401 and API_KEY not in response.text
                assert response.json() == {"type": "error", "error": {"type": "authentication_error", "message": (
                    "missing or wrong API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'")}}
            assert http.post("/v1/messages", json=body, headers={"x-api-key": API_KEY}).status_code == 200
            assert http.post("/v1/messages", json=body, headers={"authorization": f"Bearer {API_KEY}"}).status_code == 200
            counted = http.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": API_KEY})
            assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
        with pytest.raises(anthropic.AuthenticationError) as raised:
            client_of(stack, api_key="wrong").messages.create(model=MODEL, max_tokens=2, messages=MESSAGES)
        assert raised.value.body["error"]["type"] == "authentication_error"
        keyed = client_of(stack, api_key=None, default_headers={"x-api-key": API_KEY})
        assert keyed.messages.create(model=MODEL, max_tokens=2, messages=MESSAGES).usage.output_tokens == 2
        assert client_of(stack, api_key=API_KEY).messages.create(model=MODEL, max_tokens=2, messages=MESSAGES).content
    finally:
        stack.close()


def test_metrics_count_the_messages_requests(plain):
    create(plain, max_tokens=3)
    streamed(plain, max_tokens=3)
    plain.http.post("/v1/messages", json={"model": MODEL, "messages": MESSAGES})
    text = plain.http.get("/metrics").text
    assert 'metrale_requests_total{endpoint="/v1/messages",status="200"}' in text
    assert 'metrale_requests_total{endpoint="/v1/messages",status="400"}' in text
    assert 'metrale_request_finish_total{endpoint="/v1/messages",finish_reason="length"}' in text


def test_a_client_that_leaves_a_stream_aborts_its_request(plain):
    before = _finished(plain, "abort")
    with plain.http.stream("POST", "/v1/messages", json={"model": MODEL, "max_tokens": 900, "stream": True, **GREEDY,
                                                        "messages": [{"role": "user", "content": "Sort a list"}]}) as response:
        lines = response.iter_lines()
        while "content_block_delta" not in next(lines):
            pass
    values = wait_idle(plain.http)
    assert values["metrale_requests_active"] == 0 and values["metrale_kv_cache_blocks_used"] == 0
    assert _finished(plain, "abort") == before + 1
    assert metric_values(plain.http)["metrale_requests_active"] == 0


def _finished(stack, reason):
    text = stack.http.get("/metrics").text
    key = f'metrale_request_finish_total{{endpoint="/v1/messages",finish_reason="{reason}"}} '
    line = next((line for line in text.splitlines() if line.startswith(key)), None)
    return float(line.split()[-1]) if line else 0.0


def test_a_stream_that_fails_once_started_ends_with_an_error_event(plain):
    state = plain.app.state.metrale
    events = []
    with plain.http.stream("POST", "/v1/messages", json={"model": MODEL, "max_tokens": 900, "stream": True, **GREEDY,
                                                        "messages": [{"role": "user", "content": "Sort a list"}]}) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("event: "):
                events.append(line[len("event: "):])
            if events[-1:] == ["content_block_delta"]:
                break
        for job in list(state.jobs):
            job.abort()  # as a shutdown aborts what is still running
        rest = [line for line in lines if line]
    assert rest[-2:] == ["event: error", 'data: {"type":"error","error":{"type":"overloaded_error","message":'
                         '"the request was aborted: the server is shutting down"}}']
    assert wait_idle(plain.http)["metrale_requests_active"] == 0


def test_errors_translate_to_anthropic_types():
    from metrale.entrypoints.server import protocol as P
    from metrale.entrypoints.server.anthropic_protocol import translate_error

    for status, expected in ((400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
                             (405, "invalid_request_error"), (413, "request_too_large"), (500, "api_error")):
        assert translate_error(P.APIError(status, "why")) == (status, {"type": "error", "error": {
            "type": expected, "message": "why"}})
    assert translate_error(P.APIError(503, "full"))[0] == 529
