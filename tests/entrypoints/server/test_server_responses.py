"""The Responses API (``POST /v1/responses``) through the official ``openai`` client: responses
parse as the SDK's models, their text equals chat completions' for the same conversation, streams
follow OpenAI's event order and add up to the non-streamed response, forced calls always parse and
validate, the follow-up turn renders, reasoning becomes its own item, and the request key, limits,
metrics and disconnects work as for chat completions. (Malformed requests: test_server_errors.py.)"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402
from serverkit import API_KEY, MODEL, Stack, http_client, openai_client, wait_idle  # noqa: E402

from metrale.plugins.parsers.reasoning import Qwen3ReasoningParser  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "add", "parameters": ADD}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
              {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
QUESTION = "What is the weather in Paris?"
HERMES_REPLY = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
                '</tool_call>')

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: "
            "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}"
            "{{ m['content'] if m['content'] is not none else '' }}"
            "{% if m.tool_calls is defined %}{% for c in m.tool_calls %} call {{ c.function.name }}"
            "({{ c.function.arguments | tojson }}){% endfor %}{% endif %}"
            "{% if m.tool_call_id is defined %} [{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
            "{% if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")

EVENTS = TypeAdapter(ResponseStreamEvent)


class ScriptedThinking(Qwen3ReasoningParser):
    """Qwen3's split, without the structured-output prefix: a test's structured output then
    writes the whole reply, thinking included, so that the reply is known."""

    def structured_output_prefix(self):
        return None


@pytest.fixture(scope="module")
def plain():
    """The tiny model with its own template and no parsers."""
    stack = Stack(in_process=True)
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def tooled():
    """A template that writes calls and reasoning, the hermes and thinking parsers, and an API key."""
    stack = Stack(in_process=True, engine_options={"chat_template": TEMPLATE}, enable_auto_tool_choice=True,
                  tool_call_parser="hermes", reasoning_parser=ScriptedThinking, api_key=API_KEY)
    stack.client.close()
    stack.client = openai_client(stack.url, api_key=API_KEY)
    stack.http.headers["authorization"] = f"Bearer {API_KEY}"
    yield stack
    stack.close()


def validate(arguments: str, schema: dict) -> dict:
    data = json.loads(arguments)
    jsonschema.validate(data, schema)
    return data


def raw_events(stack: Stack, body: dict) -> list[dict]:
    """A streamed response's events, each checked: its ``event:`` line names its type, it
    validates as the SDK's event model, and the sequence numbers count up from 0."""
    events = []
    with stack.http.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name, (name, data)
                EVENTS.validate_python(data)
                events.append(data)
                name = None
            else:
                assert line == "", line
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def item_events(events: list[dict]) -> list[str]:
    """The event types, each output item's deltas collapsed into one."""
    kinds: list[str] = []
    for event in events:
        kind = event["type"]
        if kind.endswith(".delta") and kinds and kinds[-1] == kind:
            continue
        kinds.append(kind)
    return kinds


def post(stack: Stack, body: dict) -> dict:
    """A non-streamed response, validated as the SDK's ``Response`` model."""
    response = stack.http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    Response.model_validate(data)
    return data


def without_ids(items: list[dict]) -> list[dict]:
    """Output items less their ids (fresh in each response)."""
    return [{key: value for key, value in item.items() if key not in ("id", "call_id")} for item in items]


def message_text(data: dict) -> str:
    return "".join(part["text"] for item in data["output"] if item["type"] == "message" for part in item["content"])


# ----------------------------------------------------------------------------------- text


def test_a_string_input_answers_a_response(plain):
    body = {"model": MODEL, "input": "Return the", "max_output_tokens": 12, "temperature": 0}
    data = post(plain, body)
    assert data["object"] == "response" and data["id"].startswith("resp_") and data["model"] == MODEL
    assert data["status"] in ("completed", "incomplete")
    [item] = data["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["id"].startswith("msg_")
    assert item["content"][0]["type"] == "output_text" and item["content"][0]["annotations"] == []
    used = data["usage"]
    assert used["total_tokens"] == used["input_tokens"] + used["output_tokens"] and 1 <= used["output_tokens"] <= 12
    assert used["output_tokens_details"]["reasoning_tokens"] == 0
    assert data["store"] is False and data["tools"] == [] and data["text"] == {"format": {"type": "text"}}
    answer = plain.client.responses.create(model=MODEL, input="Return the", max_output_tokens=12, temperature=0)
    assert answer.output_text == message_text(data)
    assert answer.usage.input_tokens == used["input_tokens"]


@pytest.mark.parametrize("parts", [False, True])
def test_the_output_text_equals_chat_completions(plain, parts):
    turns = [("user", "Name a colour."), ("assistant", "Blue."), ("user", "Another one?")]
    if parts:
        items = [{"type": "message", "role": role, "content": [
            {"type": "input_text" if role == "user" else "output_text", "text": text}]} for role, text in turns]
        messages = [{"role": role, "content": [{"type": "text", "text": text}]} for role, text in turns]
    else:
        items = [{"role": role, "content": text} for role, text in turns]
        messages = [{"role": role, "content": text} for role, text in turns]
    answer = plain.client.responses.create(model=MODEL, instructions="Answer briefly.", input=items,
                                           max_output_tokens=24, temperature=0)
    chat = plain.client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Answer briefly."},
                                                                       *messages], max_tokens=24, temperature=0)
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.usage.output_tokens == chat.usage.completion_tokens
    assert answer.instructions == "Answer briefly."
    assert answer.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


def test_streamed_events_follow_the_documented_order(plain):
    body = {"model": MODEL, "input": "Return the", "max_output_tokens": 20, "temperature": 0}
    whole = post(plain, body)
    events = raw_events(plain, body)
    ending = "response.incomplete" if whole["status"] == "incomplete" else "response.completed"
    assert item_events(events) == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", ending]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    deltas = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    assert deltas == message_text(whole)
    final = events[-1]["response"]
    Response.model_validate(final)
    assert message_text(final) == message_text(whole) and final["usage"] == whole["usage"]
    item_id = events[2]["item"]["id"]
    assert all(event.get("item_id", item_id) == item_id for event in events[2:-1])
    assert final["output"][0]["id"] == item_id and final["id"] == events[0]["response"]["id"]

    # The SDK's stream helper gives a final response for a completed one only: a reply that ends.
    exact = {"structured_outputs": {"choice": ["Hello there, friend."]}}
    with plain.client.responses.stream(model=MODEL, input="Return the", temperature=0, extra_body=exact) as stream:
        kinds = [event.type for event in stream]
        final_response = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final_response.status == "completed" and final_response.output_text == "Hello there, friend."
    chunks = plain.client.responses.create(model=MODEL, input="Return the", max_output_tokens=20, temperature=0,
                                           stream=True)
    assert "".join(event.delta for event in chunks if event.type == "response.output_text.delta") == message_text(whole)


def test_max_output_tokens_makes_an_incomplete_response(plain):
    body = {"model": MODEL, "input": "Return the", "max_output_tokens": 3, "temperature": 0, "ignore_eos": True}
    data = post(plain, body)
    assert data["status"] == "incomplete" and data["incomplete_details"] == {"reason": "max_output_tokens"}
    assert data["usage"]["output_tokens"] == 3 and data["output"][0]["status"] == "incomplete"
    events = raw_events(plain, body)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"] == ["incomplete"]
    answer = plain.client.responses.create(model=MODEL, input="Return the", max_output_tokens=3,
                                           extra_body={"ignore_eos": True})
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"


def test_text_format_json_schema_output_validates(plain):
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    for seed in range(3):
        answer = plain.client.responses.create(model=MODEL, input=QUESTION, text={"format": fmt}, temperature=1.0,
                                               max_output_tokens=60, extra_body={"seed": seed})
        assert answer.status == "completed"
        validate(answer.output_text, WEATHER)
        assert answer.text.format.type == "json_schema"
    events = raw_events(plain, {"model": MODEL, "input": QUESTION, "text": {"format": fmt}, "temperature": 1.0,
                                "max_output_tokens": 60, "seed": 0})
    validate("".join(e["delta"] for e in events if e["type"] == "response.output_text.delta"), WEATHER)
    anything = plain.client.responses.create(model=MODEL, input=QUESTION, text={"format": {"type": "json_object"}},
                                             temperature=0, max_output_tokens=30)
    chat = plain.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                response_format={"type": "json_object"}, temperature=0, max_tokens=30)
    assert anything.output_text == chat.choices[0].message.content and anything.output_text.startswith("{")


def test_a_client_that_leaves_a_stream_has_its_request_aborted(plain):
    body = {"model": MODEL, "input": "Return the", "max_output_tokens": 800, "ignore_eos": True, "stream": True}
    with http_client(plain.url) as http:
        with http.stream("POST", "/v1/responses", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("event: response.output_text.delta"):
                    break
    values = wait_idle(plain.http)
    assert values["metrale_requests_active"] == 0 and values["metrale_kv_cache_blocks_used"] == 0
    text = plain.http.get("/metrics").text
    assert 'metrale_requests_total{endpoint="/v1/responses",status="200"}' in text
    assert 'metrale_request_finish_total{endpoint="/v1/responses",finish_reason="abort"}' in text


def test_a_request_aborted_mid_stream_ends_with_response_failed(plain):
    body = {"model": MODEL, "input": "Return the", "max_output_tokens": 800, "ignore_eos": True, "stream": True}
    events = []
    with plain.http.stream("POST", "/v1/responses", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(json.loads(line[len("data: "):]))
            EVENTS.validate_python(events[-1])
            if events[-1]["type"] == "response.output_text.delta" and len(events) == 5:
                plain.engine.abort(events[0]["response"]["id"] + "-0")  # as a shutdown aborts it
    error, failed = events[-2:]
    assert error["type"] == "error" and error["code"] == "service_unavailable"
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error" and failed["response"]["output"]
    Response.model_validate(failed["response"])


# ----------------------------------------------------------------------------------- tools


@pytest.mark.parametrize("name", ["get_weather", "add"])
def test_a_named_tool_choice_always_calls_that_function(tooled, name):
    choice = {"type": "function", "name": name}
    for seed in range(2):
        body = {"model": MODEL, "input": QUESTION, "tools": TOOLS, "tool_choice": choice, "temperature": 1.0,
                "max_output_tokens": 120, "seed": seed}
        data = post(tooled, body)
        assert data["status"] == "completed" and data["tool_choice"] == choice
        [call] = data["output"]
        assert call["type"] == "function_call" and call["name"] == name and call["status"] == "completed"
        assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
        validate(call["arguments"], SCHEMAS[name])
        events = raw_events(tooled, body)
        assert item_events(events) == [
            "response.created", "response.in_progress", "response.output_item.added",
            "response.function_call_arguments.delta", "response.function_call_arguments.done",
            "response.output_item.done", "response.completed"]
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
        assert deltas == done["arguments"] == call["arguments"] and done["name"] == name
        [streamed] = events[-1]["response"]["output"]
        assert (streamed["name"], streamed["arguments"]) == (name, call["arguments"])
    answer = tooled.client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, tool_choice=choice, temperature=0)
    [call] = answer.output
    assert call.type == "function_call" and answer.output_text == ""
    validate(call.arguments, SCHEMAS[name])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_one_of_the_tools(tooled, parallel):
    called = 0
    for seed in range(3):
        body = {"model": MODEL, "input": QUESTION, "tools": TOOLS, "tool_choice": "required", "temperature": 1.0,
                "parallel_tool_calls": parallel, "max_output_tokens": 400, "seed": seed}
        data = post(tooled, body)
        if data["status"] == "incomplete":  # (a long array of calls cut by max_output_tokens: its text, no call)
            assert parallel and [item["type"] for item in data["output"]] == ["message"]
            continue
        called += 1
        calls = data["output"]
        assert calls and all(item["type"] == "function_call" for item in calls) and (parallel or len(calls) == 1)
        assert len({call["call_id"] for call in calls}) == len(calls)
        for call in calls:
            validate(call["arguments"], SCHEMAS[call["name"]])
        events = raw_events(tooled, body)
        streamed = events[-1]["response"]["output"]
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in calls]
        added = [e["item"]["call_id"] for e in events if e["type"] == "response.output_item.added"]
        assert added == [c["call_id"] for c in streamed]
    assert called >= 1


def test_auto_tool_calls_follow_the_text(tooled):
    body = {"model": MODEL, "input": QUESTION, "tools": TOOLS, "temperature": 0,
            "structured_outputs": {"choice": [HERMES_REPLY]}}
    data = post(tooled, body)
    message, call = data["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "I will check.\n"
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert validate(call["arguments"], WEATHER) == {"city": "Oslo", "days": 2}
    events = raw_events(tooled, body)
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"] == ["message", "function_call"]
    assert [(i["type"], i.get("name")) for i in events[-1]["response"]["output"]] == [("message", None),
                                                                                       ("function_call", "get_weather")]
    none = post(tooled, {**body, "tool_choice": "none"})
    assert [item["type"] for item in none["output"]] == ["message"] and message_text(none) == HERMES_REPLY


def test_the_follow_up_turn_renders_and_answers(tooled):
    first = tooled.client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, temperature=0,
                                           tool_choice={"type": "function", "name": "add"})
    [call] = first.output
    turn = [{"role": "user", "content": QUESTION}, *[item.model_dump(exclude_none=True) for item in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "41"}]
    answer = tooled.client.responses.create(model=MODEL, input=turn, tools=TOOLS, temperature=0, max_output_tokens=4)
    assert answer.output[-1].type in ("message", "function_call")
    arguments = json.loads(call.arguments)
    expected = tooled.engine.llm.render_chat(
        [{"role": "user", "content": QUESTION},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": call.call_id, "type": "function", "function": {"name": "add", "arguments": arguments}}]},
         {"role": "tool", "tool_call_id": call.call_id, "content": "41"}], tools=CHAT_TOOLS)
    assert f"call add({json.dumps(arguments)})" in expected and f"[{call.call_id}]" in expected
    assert answer.usage.input_tokens == len(tooled.engine.llm.encode(expected, add_special_tokens=False))


# ------------------------------------------------------------------------------- reasoning


def test_reasoning_becomes_its_own_item(tooled):
    reply = "<think>The user greets me.</think>Hello!"
    body = {"model": MODEL, "input": "Hi", "temperature": 0, "structured_outputs": {"choice": [reply]},
            "reasoning": {"effort": "low"}}
    data = post(tooled, body)
    reasoning, message = data["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "The user greets me."}]
    assert message["content"][0]["text"] == "Hello!"
    assert 0 < data["usage"]["output_tokens_details"]["reasoning_tokens"] < data["usage"]["output_tokens"]
    assert data["reasoning"] == {"effort": "low", "summary": None}
    events = raw_events(tooled, body)
    assert item_events(events) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == "The user greets me."
    assert without_ids(events[-1]["response"]["output"]) == without_ids(data["output"])
    answer = tooled.client.responses.create(model=MODEL, input="Hi", temperature=0,
                                            extra_body={"structured_outputs": {"choice": [reply]}})
    assert answer.output_text == "Hello!" and answer.output[0].content[0].text == "The user greets me."


def test_reasoning_items_given_back_reach_the_template(tooled):
    items = [{"role": "user", "content": "Hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Greet."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!",
                                                                   "annotations": []}]},
             {"role": "user", "content": "Bye"}]
    answer = tooled.client.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=2)
    expected = tooled.engine.llm.render_chat([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}], "reasoning_content": "Greet."},
        {"role": "user", "content": "Bye"}])
    assert "<think>Greet.</think>" in expected
    assert answer.usage.input_tokens == len(tooled.engine.llm.encode(expected, add_special_tokens=False))


def test_the_api_key_is_required(tooled):
    with http_client(tooled.url) as http:
        response = http.post("/v1/responses", json={"model": MODEL, "input": "Hi"})
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai_client(tooled.url, api_key="wrong").responses.create(model=MODEL, input="Hi")
