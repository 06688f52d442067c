"""Malformed and hostile requests: each gets its exact status and an OpenAI-shaped error body
naming the offending field, and the server goes on serving."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from serverkit import API_KEY, MODEL, Stack, http_client, openai_client, wait_idle  # noqa: E402

COMPLETION = {"model": MODEL, "prompt": "Return the", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": SCHEMA}}]


@pytest.fixture(scope="module")
def stack():
    """The app on an engine thread of this process (the other server tests use an engine process)."""
    stack = Stack(in_process=True)
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def auth_stack():
    """A second app, built with an API key."""
    stack = Stack(api_key=API_KEY)
    yield stack
    stack.close()


def completion(**fields):
    body = dict(COMPLETION)
    for name, value in fields.items():
        if value is _DROP:
            body.pop(name, None)
        else:
            body[name] = value
    return body


def chat(**fields):
    body = dict(CHAT)
    for name, value in fields.items():
        if value is _DROP:
            body.pop(name, None)
        else:
            body[name] = value
    return body


def embedding(**fields):
    return {"model": MODEL, "input": "hi", **fields}


_DROP = object()
C, CH = "/v1/completions", "/v1/chat/completions"
TOK, DETOK = "/tokenize", "/detokenize"
E = "/v1/embeddings"

# (case, endpoint, body: a dict sent as JSON or raw bytes, status, param)
CASES = [
    ("bad JSON", C, b'{"model": "tiny-dense", "prompt": ', 400, None),
    ("body not an object", C, b"[1, 2, 3]", 400, None),
    ("body a string", CH, b'"hello"', 400, None),
    ("empty body", C, b"", 400, None),
    ("NaN literal", C, b'{"model": "tiny-dense", "prompt": "a", "temperature": NaN}', 400, None),
    ("not UTF-8", C, b'{"model": "tiny-dense", "prompt": "\xff\xfe"}', 400, None),
    ("nested too deeply", C, b'{"model": "tiny-dense", "prompt": "a", "user": ' + b"[" * 200 + b"]" * 200 + b"}", 400, None),
    ("nested past the parser's recursion", C, b'{"model": "tiny-dense", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     400, None),
    ("missing model", C, completion(model=_DROP), 400, "model"),
    ("model not a string", C, completion(model=5), 400, "model"),
    ("unknown model", C, completion(model="gpt-9"), 404, "model"),
    ("unknown model (chat)", CH, chat(model="gpt-9"), 404, "model"),
    ("model with a lone surrogate", C, b'{"model": "\\ud800", "prompt": "a"}', 404, "model"),
    ("missing prompt", C, completion(prompt=_DROP), 400, "prompt"),
    ("prompt a number", C, completion(prompt=5), 400, "prompt"),
    ("prompt an object", C, completion(prompt={"text": "a"}), 400, "prompt"),
    ("empty prompt string", C, completion(prompt=""), 400, "prompt"),
    ("empty prompt list", C, completion(prompt=[]), 400, "prompt"),
    ("prompt mixing strings and ints", C, completion(prompt=["a", 1]), 400, "prompt"),
    ("prompt with bools", C, completion(prompt=[True, 2]), 400, "prompt"),
    ("token id outside the vocabulary", C, completion(prompt=[1, 99999]), 400, "prompt"),
    ("negative token id", C, completion(prompt=[-1, 2]), 400, "prompt"),
    ("an empty token list among prompts", C, completion(prompt=[[1, 2], []]), 400, "prompt"),
    ("prompt longer than the context", C, completion(prompt=[5] * 2000), 400, "prompt"),
    ("too many prompts", C, completion(prompt=["a"] * 300), 400, "prompt"),
    ("prompt with a lone surrogate", C, b'{"model": "tiny-dense", "prompt": "a\\ud800"}', 400, "prompt"),
    ("max_tokens 0", C, completion(max_tokens=0), 400, "max_tokens"),
    ("max_tokens 0 with echo false", C, completion(max_tokens=0, echo=False), 400, "max_tokens"),
    ("max_tokens 0 with echo, the prompt filling the context", C, completion(prompt=[5] * 1024, max_tokens=0, echo=True),
     400, "prompt"),
    ("add_special_tokens a string", C, completion(add_special_tokens="no"), 400, "add_special_tokens"),
    ("max_tokens -1", C, completion(max_tokens=-1), 400, "max_tokens"),
    ("max_tokens a string", C, completion(max_tokens="5"), 400, "max_tokens"),
    ("max_tokens a float", C, completion(max_tokens=5.0), 400, "max_tokens"),
    ("max_tokens a bool", C, completion(max_tokens=True), 400, "max_tokens"),
    ("max_tokens beyond the context", C, completion(max_tokens=1_000_000), 400, "max_tokens"),
    ("max_tokens filling the context exactly plus one", C, completion(prompt=[5] * 1000, max_tokens=25), 400, "max_tokens"),
    ("max_completion_tokens beyond the context", CH, chat(max_completion_tokens=5000), 400, "max_completion_tokens"),
    ("temperature -1", C, completion(temperature=-1), 400, "temperature"),
    ("temperature a word", C, completion(temperature="hot"), 400, "temperature"),
    ("temperature huge", C, b'{"model": "tiny-dense", "prompt": "a", "temperature": 1e400}', 400, "temperature"),
    ("top_p 0", C, completion(top_p=0), 400, "top_p"),
    ("top_p 2", C, completion(top_p=2), 400, "top_p"),
    ("n 0", C, completion(n=0), 400, "n"),
    ("n above max_n", C, completion(n=17), 400, "n"),
    ("n huge", CH, chat(n=10**9), 400, "n"),
    ("presence_penalty 5", C, completion(presence_penalty=5), 400, "presence_penalty"),
    ("frequency_penalty -3", CH, chat(frequency_penalty=-3), 400, "frequency_penalty"),
    ("repetition_penalty -1", C, completion(repetition_penalty=-1), 400, "repetition_penalty"),
    ("repetition_penalty 0", C, completion(repetition_penalty=0), 400, "repetition_penalty"),
    ("top_k -5", C, completion(top_k=-5), 400, "top_k"),
    ("min_p 2", C, completion(min_p=2), 400, "min_p"),
    ("min_tokens above max_tokens", C, completion(min_tokens=10), 400, "min_tokens"),
    ("logit_bias non-numeric key", C, completion(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit_bias value 1000", C, completion(logit_bias={"5": 1000}), 400, "logit_bias"),
    ("logit_bias value a string", C, completion(logit_bias={"5": "up"}), 400, "logit_bias.5"),
    ("logit_bias token outside the vocabulary", C, completion(logit_bias={"99999": 1}), 400, "logit_bias"),
    ("logit_bias a list", C, completion(logit_bias=[1, 2]), 400, "logit_bias"),
    ("logprobs 99", C, completion(logprobs=99), 400, "logprobs"),
    ("logprobs -1", C, completion(logprobs=-1), 400, "logprobs"),
    ("logprobs true on completions", C, completion(logprobs=True), 400, "logprobs"),
    ("top_logprobs 50", CH, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("top_logprobs without logprobs", CH, chat(top_logprobs=2), 400, "top_logprobs"),
    ("chat logprobs an int", CH, chat(logprobs=3), 400, "logprobs"),
    ("prompt_logprobs 99", C, completion(prompt_logprobs=99), 400, "prompt_logprobs"),
    ("stop a number", C, completion(stop=5), 400, "stop"),
    ("stop list of 50 strings", C, completion(stop=[f"s{i}" for i in range(50)]), 400, "stop"),
    ("stop an empty string", C, completion(stop=[""]), 400, "stop"),
    ("stop holding a number", CH, chat(stop=["a", 1]), 400, "stop"),
    ("stop string too long", C, completion(stop="x" * 1000), 400, "stop"),
    ("stop_token_ids outside the vocabulary", C, completion(stop_token_ids=[99999]), 400, "stop_token_ids"),
    ("stop_token_ids a string", C, completion(stop_token_ids="0"), 400, "stop_token_ids"),
    ("seed -1", C, completion(seed=-1), 400, "seed"),
    ("seed 2**64", C, completion(seed=2**64), 400, "seed"),
    ("seed a string", C, completion(seed="x"), 400, "seed"),
    ("ignore_eos a string", C, completion(ignore_eos="true"), 400, "ignore_eos"),
    ("stream 'yes'", C, completion(stream="yes"), 400, "stream"),
    ("stream 1", CH, chat(stream=1), 400, "stream"),
    ("stream_options without stream", C, completion(stream_options={"include_usage": True}), 400, "stream_options"),
    ("include_usage a string", C, completion(stream=True, stream_options={"include_usage": "yes"}), 400,
     "stream_options.include_usage"),
    ("suffix", C, completion(suffix=" end"), 400, "suffix"),
    ("best_of above n", C, completion(best_of=3), 400, "best_of"),
    ("echo a string", C, completion(echo="yes"), 400, "echo"),
    ("guided_regex invalid", C, completion(guided_regex="(unclosed"), 400, "guided_regex"),
    ("guided_regex past the lexer's limits", C, completion(guided_regex="a{1000000000}"), 400, "guided_regex"),
    ("guided_json invalid schema", C, completion(guided_json={"type": "no-such-type"}), 400, "guided_json"),
    ("guided_json not a schema", C, completion(guided_json=5), 400, "guided_json"),
    ("guided_choice empty", C, completion(guided_choice=[]), 400, "guided_choice"),
    ("guided_grammar invalid", C, completion(guided_grammar="start: ???"), 400, "guided_grammar"),
    ("two structured outputs", C, completion(guided_regex="a+", guided_choice=["a"]), 400, "guided_choice"),
    ("structured_outputs unknown key", C, completion(structured_outputs={"xml": "<a/>"}), 400, "structured_outputs.xml"),
    ("messages missing", CH, chat(messages=_DROP), 400, "messages"),
    ("messages empty", CH, chat(messages=[]), 400, "messages"),
    ("messages not a list", CH, chat(messages="hi"), 400, "messages"),
    ("message not an object", CH, chat(messages=["hi"]), 400, "messages[0]"),
    ("message without role", CH, chat(messages=[{"content": "hi"}]), 400, "messages[0].role"),
    ("unknown role", CH, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    ("role not a string", CH, chat(messages=[{"role": 1, "content": "hi"}]), 400, "messages[0].role"),
    ("content a number", CH, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("content missing", CH, chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    ("content part an image", CH, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.invalid/a.png"}}]}]), 400, "messages[0].content[0]"),
    ("second message bad", CH, chat(messages=[{"role": "user", "content": "hi"}, {"role": "user", "content": {"a": 1}}]),
     400, "messages[1].content"),
    ("content with a lone surrogate", CH, b'{"model": "tiny-dense", "messages": [{"role": "user", "content": "\\udc00"}]}',
     400, "messages"),
    ("response_format invalid schema", CH, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}), 400, "response_format"),
    ("response_format schema not an object", CH, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": "nope"}}), 400, "response_format.json_schema.schema"),
    ("response_format json_schema missing", CH, chat(response_format={"type": "json_schema"}), 400,
     "response_format.json_schema"),
    ("response_format unknown type", CH, chat(response_format={"type": "yaml"}), 400, "response_format.type"),
    ("response_format a string", CH, chat(response_format="json"), 400, "response_format"),
    ("response_format and guided_json", CH, chat(response_format={"type": "json_object"}, guided_json=SCHEMA), 400,
     "response_format"),
    ("chat_template_kwargs reserved key", CH, chat(chat_template_kwargs={"messages": []}), 400, "chat_template_kwargs"),
    ("chat_template_kwargs not an object", CH, chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs"),
    ("tools not a list", CH, chat(tools={"type": "function"}), 400, "tools"),
    ("tool_choice required", CH, chat(tool_choice="required"), 400, "tool_choice"),
    ("tool_choice naming an unknown function", CH, chat(tools=TOOLS, tool_choice={"type": "function", "function": {
        "name": "nope"}}), 400, "tool_choice"),
    ("tool_choice an unknown word", CH, chat(tools=TOOLS, tool_choice="always"), 400, "tool_choice"),
    ("tool_choice a function without tools", CH, chat(tool_choice={"type": "function", "function": {"name": "f"}}), 400,
     "tool_choice"),
    ("tool_choice without a name", CH, chat(tools=TOOLS, tool_choice={"type": "function"}), 400, "tool_choice"),
    ("tool_choice a number", CH, chat(tools=TOOLS, tool_choice=3), 400, "tool_choice"),
    ("a tool without a name", CH, chat(tools=[{"type": "function", "function": {}}]), 400, "tools[0].function.name"),
    ("a tool of another type", CH, chat(tools=[{"type": "retrieval"}]), 400, "tools[0].type"),
    ("a tool whose function is a string", CH, chat(tools=[{"type": "function", "function": "f"}]), 400, "tools[0].function"),
    ("tool parameters not an object", CH, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
     400, "tools[0].function.parameters"),
    ("two tools of one name", CH, chat(tools=TOOLS * 2), 400, "tools[1].function.name"),
    ("too many tools", CH, chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(200)]), 400,
     "tools"),
    ("a forced tool with an invalid schema", CH, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "no-such-type"}}}], tool_choice="required"), 400, "tools"),
    ("a named tool with an unsatisfiable schema", CH, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "integer", "minimum": 5, "maximum": 1}}}],
        tool_choice={"type": "function", "function": {"name": "f"}}), 400, "tools"),
    ("a huge tool schema", CH, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(1500)}}}}],
        tool_choice={"type": "function", "function": {"name": "f"}}), 400, "tools"),
    ("a forced tool and response_format", CH, chat(tools=TOOLS, tool_choice="required",
                                                   response_format={"type": "json_object"}), 400, "tool_choice"),
    ("parallel_tool_calls a string", CH, chat(tools=TOOLS, parallel_tool_calls="yes"), 400, "parallel_tool_calls"),
    ("assistant tool_calls malformed", CH, chat(messages=[{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]), 400, "messages[1].tool_calls[0]"),
    ("assistant tool_calls not a list", CH, chat(messages=[{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": None, "tool_calls": {"id": "x"}}]), 400, "messages[1].tool_calls"),
    ("tool call arguments not JSON", CH, chat(messages=[{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": None, "tool_calls": [{"id": "x", "type": "function", "function": {
            "name": "f", "arguments": "{oops"}}]}]), 400, "messages[1].tool_calls[0].function.arguments"),
    ("tool_call_id a number", CH, chat(messages=[{"role": "user", "content": "hi"}, {
        "role": "tool", "tool_call_id": 5, "content": "41"}]), 400, "messages[1].tool_call_id"),
    ("add_generation_prompt a string", CH, chat(add_generation_prompt="no"), 400, "add_generation_prompt"),
    ("continue_final_message", CH, chat(continue_final_message=True), 400, "continue_final_message"),
    ("tokenize without prompt or messages", TOK, {}, 400, "prompt"),
    ("tokenize with prompt and messages", TOK, {"prompt": "a", "messages": CHAT["messages"]}, 400, "messages"),
    ("tokenize a prompt of token ids", TOK, {"prompt": [1, 2]}, 400, "prompt"),
    ("tokenize a prompt with a lone surrogate", TOK, b'{"prompt": "a\\ud800"}', 400, "prompt"),
    ("tokenize for an unknown model", TOK, {"model": "gpt-9", "prompt": "a"}, 404, "model"),
    ("tokenize add_special_tokens a string", TOK, {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("tokenize return_token_strs a number", TOK, {"prompt": "a", "return_token_strs": 1}, 400, "return_token_strs"),
    ("tokenize messages not a list", TOK, {"messages": "hi"}, 400, "messages"),
    ("tokenize a message without role", TOK, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("tokenize chat_template_kwargs reserved key", TOK, {"messages": CHAT["messages"], "chat_template_kwargs": {
        "messages": []}}, 400, "chat_template_kwargs"),
    ("tokenize a tool without a name", TOK, {"messages": CHAT["messages"], "tools": [{"type": "function", "function": {}}]},
     400, "tools[0].function.name"),
    ("tokenize continue_final_message", TOK, {"messages": CHAT["messages"], "continue_final_message": True}, 400,
     "continue_final_message"),
    ("tokenize a body not an object", TOK, b"[1]", 400, None),
    ("detokenize without tokens", DETOK, {}, 400, "tokens"),
    ("detokenize tokens not a list", DETOK, {"tokens": "1 2"}, 400, "tokens"),
    ("detokenize a token id outside the vocabulary", DETOK, {"tokens": [1, 99999]}, 400, "tokens"),
    ("detokenize a negative token id", DETOK, {"tokens": [-1]}, 400, "tokens"),
    ("detokenize a huge token id", DETOK, {"tokens": [2**70]}, 400, "tokens"),
    ("detokenize a token id as a string", DETOK, {"tokens": ["5"]}, 400, "tokens[0]"),
    ("detokenize a token id as a bool", DETOK, {"tokens": [True]}, 400, "tokens[0]"),
    ("detokenize a token id as a float", DETOK, {"tokens": [5.0]}, 400, "tokens[0]"),
    ("detokenize for an unknown model", DETOK, {"model": "gpt-9", "tokens": [1]}, 404, "model"),
    ("embeddings without input", E, {"model": MODEL}, 400, "input"),
    ("embeddings without model", E, {"input": "a"}, 400, "model"),
    ("embeddings for an unknown model", E, {"model": "gpt-9", "input": "a"}, 404, "model"),
    ("embeddings model not a string", E, embedding(model=7), 400, "model"),
    ("embeddings an empty input list", E, embedding(input=[]), 400, "input"),
    ("embeddings an empty string", E, embedding(input=""), 400, "input"),
    ("embeddings an empty string among others", E, embedding(input=["a", ""]), 400, "input"),
    ("embeddings an empty token list", E, embedding(input=[[]]), 400, "input"),
    ("embeddings input null", E, embedding(input=None), 400, "input"),
    ("embeddings input a number", E, embedding(input=5), 400, "input"),
    ("embeddings input an object", E, embedding(input={"text": "a"}), 400, "input"),
    ("embeddings input mixing text and ids", E, embedding(input=["a", 1]), 400, "input"),
    ("embeddings input mixing ids and lists", E, embedding(input=[1, [2]]), 400, "input"),
    ("embeddings input nested too deep", E, embedding(input=[[[1]]]), 400, "input"),
    ("embeddings a token id outside the vocabulary", E, embedding(input=[1, 99999]), 400, "input"),
    ("embeddings a negative token id", E, embedding(input=[[1], [-1]]), 400, "input"),
    ("embeddings a token id as a bool", E, embedding(input=[True]), 400, "input"),
    ("embeddings a token id as a float", E, embedding(input=[5.0]), 400, "input"),
    ("embeddings a huge token id", E, embedding(input=[2**70]), 400, "input"),
    ("embeddings a prompt longer than the context", E, embedding(input=[1] * 1025), 400, "input"),
    ("embeddings too many inputs", E, embedding(input=["a"] * 2049), 400, "input"),
    ("embeddings encoding_format unknown", E, embedding(encoding_format="float16"), 400, "encoding_format"),
    ("embeddings encoding_format a number", E, embedding(encoding_format=1), 400, "encoding_format"),
    ("embeddings dimensions not the model's", E, embedding(dimensions=64), 400, "dimensions"),
    ("embeddings dimensions zero", E, embedding(dimensions=0), 400, "dimensions"),
    ("embeddings dimensions a string", E, embedding(dimensions="128"), 400, "dimensions"),
    ("embeddings pooling_type unknown", E, embedding(pooling_type="CLS"), 400, "pooling_type"),
    ("embeddings pooling_type a list", E, embedding(pooling_type=["MEAN"]), 400, "pooling_type"),
    ("embeddings normalize a string", E, embedding(normalize="yes"), 400, "normalize"),
    ("embeddings truncate_prompt_tokens zero", E, embedding(truncate_prompt_tokens=0), 400, "truncate_prompt_tokens"),
    ("embeddings truncate_prompt_tokens below -1", E, embedding(truncate_prompt_tokens=-2), 400, "truncate_prompt_tokens"),
    ("embeddings truncate_prompt_tokens past the context", E, embedding(truncate_prompt_tokens=10**9), 400,
     "truncate_prompt_tokens"),
    ("embeddings truncate_prompt_tokens a float", E, embedding(truncate_prompt_tokens=5.0), 400, "truncate_prompt_tokens"),
    ("embeddings add_special_tokens a string", E, embedding(add_special_tokens="no"), 400, "add_special_tokens"),
    ("embeddings embed_dtype float16", E, embedding(embed_dtype="float16"), 400, "embed_dtype"),
    ("embeddings endianness big", E, embedding(endianness="big"), 400, "endianness"),
    ("embeddings a body not an object", E, b'["a"]', 400, None),
    ("embeddings bad JSON", E, b'{"model": "tiny-dense", "input": [1, 2', 400, None),
]

# ------------------------------------------------------------------- OpenAI's Responses API

R = "/v1/responses"
RESPONSE = {"model": MODEL, "input": "hi", "max_output_tokens": 4}
FLAT_TOOLS = [{"type": "function", "name": "lookup", "parameters": SCHEMA}]
CALL = {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"a": 1}'}


def response(**fields):
    body = dict(RESPONSE)
    for name, value in fields.items():
        if value is _DROP:
            body.pop(name, None)
        else:
            body[name] = value
    return body


CASES += [
    ("responses: bad JSON", R, b'{"model": "tiny-dense", "input": ', 400, None),
    ("responses: body not an object", R, b"[1]", 400, None),
    ("responses: unknown model", R, response(model="gpt-9"), 404, "model"),
    ("responses: missing input", R, response(input=_DROP), 400, "input"),
    ("responses: input a number", R, response(input=5), 400, "input"),
    ("responses: input an object", R, response(input={"role": "user", "content": "hi"}), 400, "input"),
    ("responses: input an empty list", R, response(input=[]), 400, "input"),
    ("responses: input with a lone surrogate", R, b'{"model": "tiny-dense", "input": "\\udc00"}', 400, "input"),
    ("responses: an item not an object", R, response(input=["hi"]), 400, "input[0]"),
    ("responses: an item of an unknown type", R, response(input=[{"type": "web_search_call", "id": "ws_1"}]), 400,
     "input[0].type"),
    ("responses: an item without type or role", R, response(input=[{"content": "hi"}]), 400, "input[0].type"),
    ("responses: an item_reference", R, response(input=[{"type": "item_reference", "id": "msg_1"}]), 400,
     "input[0].type"),
    ("responses: a message of an unknown role", R, response(input=[{"role": "tool", "content": "hi"}]), 400,
     "input[0].role"),
    ("responses: a message without content", R, response(input=[{"role": "user"}]), 400, "input[0].content"),
    ("responses: content a number", R, response(input=[{"role": "user", "content": 5}]), 400, "input[0].content"),
    ("responses: an image part", R, response(input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://example.invalid/a.png"}]}]), 400, "input[0].content[0]"),
    ("responses: a file part", R, response(input=[{"role": "user", "content": [
        {"type": "input_file", "file_id": "file_1"}]}]), 400, "input[0].content[0]"),
    ("responses: chat's text part", R, response(input=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
     400, "input[0].content[0]"),
    ("responses: a function_call without a name", R, response(input=[{**CALL, "name": ""}]), 400, "input[0].name"),
    ("responses: function_call arguments not JSON", R, response(input=[{**CALL, "arguments": "{oops"}]), 400,
     "input[0].arguments"),
    ("responses: function_call arguments an object", R, response(input=[{**CALL, "arguments": {"a": 1}}]), 400,
     "input[0].arguments"),
    ("responses: a function_call_output answering no call", R, response(input=[
        {"type": "function_call_output", "call_id": "call_9", "output": "41"}]), 400, "input[0].call_id"),
    ("responses: a function_call_output holding an image", R, response(input=[CALL, {
        "type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_image", "image_url": "x"}]}]),
     400, "input[1].output[0]"),
    ("responses: a reasoning item with bad content", R, response(input=[{"type": "reasoning", "summary": [],
                                                                         "content": "thought"}]), 400,
     "input[0].content"),
    ("responses: instructions a number", R, response(instructions=5), 400, "instructions"),
    ("responses: max_output_tokens 0", R, response(max_output_tokens=0), 400, "max_output_tokens"),
    ("responses: max_output_tokens a string", R, response(max_output_tokens="4"), 400, "max_output_tokens"),
    ("responses: max_output_tokens beyond the context", R, response(max_output_tokens=1_000_000), 400,
     "max_output_tokens"),
    ("responses: temperature -1", R, response(temperature=-1), 400, "temperature"),
    ("responses: top_p 2", R, response(top_p=2), 400, "top_p"),
    ("responses: stream 'yes'", R, response(stream="yes"), 400, "stream"),
    ("responses: tools not a list", R, response(tools={"type": "function"}), 400, "tools"),
    ("responses: a web_search tool", R, response(tools=[{"type": "web_search"}]), 400, "tools[0].type"),
    ("responses: a tool in chat's nested shape", R, response(tools=TOOLS), 400, "tools[0].name"),
    ("responses: tool parameters not an object", R, response(tools=[{"type": "function", "name": "f",
                                                                     "parameters": "x"}]), 400, "tools[0].parameters"),
    ("responses: two tools of one name", R, response(tools=FLAT_TOOLS * 2), 400, "tools[1].name"),
    ("responses: too many tools", R, response(tools=[{"type": "function", "name": f"f{i}"} for i in range(200)]), 400,
     "tools"),
    ("responses: tool_choice naming an unknown function", R, response(tools=FLAT_TOOLS, tool_choice={
        "type": "function", "name": "nope"}), 400, "tool_choice"),
    ("responses: tool_choice in chat's nested shape", R, response(tools=FLAT_TOOLS, tool_choice={
        "type": "function", "function": {"name": "lookup"}}), 400, "tool_choice"),
    ("responses: tool_choice a hosted tool", R, response(tools=FLAT_TOOLS, tool_choice={"type": "file_search"}), 400,
     "tool_choice"),
    ("responses: tool_choice an unknown word", R, response(tools=FLAT_TOOLS, tool_choice="always"), 400, "tool_choice"),
    ("responses: tool_choice required without tools", R, response(tool_choice="required"), 400, "tool_choice"),
    ("responses: a forced tool with an invalid schema", R, response(tools=[{"type": "function", "name": "f", "parameters": {
        "type": "no-such-type"}}], tool_choice="required"), 400, "tools"),
    ("responses: a forced tool and text.format", R, response(tools=FLAT_TOOLS, tool_choice="required", text={
        "format": {"type": "json_object"}}), 400, "tool_choice"),
    ("responses: max_tool_calls 0", R, response(max_tool_calls=0), 400, "max_tool_calls"),
    ("responses: text not an object", R, response(text="json"), 400, "text"),
    ("responses: text.format of an unknown type", R, response(text={"format": {"type": "yaml"}}), 400,
     "text.format.type"),
    ("responses: text.format json_schema without a schema", R, response(text={"format": {
        "type": "json_schema", "name": "x"}}), 400, "text.format.schema"),
    ("responses: text.format json_schema without a name", R, response(text={"format": {
        "type": "json_schema", "schema": SCHEMA}}), 400, "text.format.name"),
    ("responses: text.format with an invalid schema", R, response(text={"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}), 400, "text.format"),
    ("responses: text.format and structured_outputs", R, response(text={"format": {"type": "json_object"}},
                                                                  structured_outputs={"regex": "a+"}), 400, "text.format"),
    ("responses: reasoning effort unknown", R, response(reasoning={"effort": "extreme"}), 400, "reasoning.effort"),
    ("responses: reasoning not an object", R, response(reasoning="high"), 400, "reasoning"),
    ("responses: previous_response_id (stateless)", R, response(previous_response_id="resp_1"), 400,
     "previous_response_id"),
    ("responses: conversation (stateless)", R, response(conversation="conv_1"), 400, "conversation"),
    ("responses: background", R, response(background=True), 400, "background"),
    ("responses: a stored prompt", R, response(prompt={"id": "pmpt_1"}), 400, "prompt"),
    ("responses: truncation auto", R, response(truncation="auto"), 400, "truncation"),
    ("responses: top_logprobs", R, response(top_logprobs=5), 400, "top_logprobs"),
    ("responses: metadata values not strings", R, response(metadata={"k": 1}), 400, "metadata.k"),
    ("responses: seed a string", R, response(seed="x"), 400, "seed"),
    ("responses: chat_template_kwargs reserved key", R, response(chat_template_kwargs={"tools": []}), 400,
     "chat_template_kwargs"),
]


# ---------------------------------------------------------- vLLM's runtime LoRA endpoints

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
#: A folder that exists and holds no adapter, and a file.
NOT_AN_ADAPTER, A_FILE = str(Path(__file__).parent), __file__

# (case, endpoint, body: a dict sent as JSON or raw bytes, status, param)
LORA_CASES = [
    ("load: bad JSON", LOAD, b'{"lora_name": "a", "lora_path": ', 400, None),
    ("load: body not an object", LOAD, b'["a", "/x"]', 400, None),
    ("load: empty body", LOAD, b"", 400, None),
    ("load: nested too deeply", LOAD, b'{"lora_name": "a", "lora_path": "/x", "x": ' + b"[" * 200 + b"]" * 200 + b"}",
     400, None),
    ("load: lora_name missing", LOAD, {"lora_path": NOT_AN_ADAPTER}, 400, "lora_name"),
    ("load: lora_path missing", LOAD, {"lora_name": "a"}, 400, "lora_path"),
    ("load: lora_name a number", LOAD, {"lora_name": 5, "lora_path": NOT_AN_ADAPTER}, 400, "lora_name"),
    ("load: lora_name null", LOAD, {"lora_name": None, "lora_path": NOT_AN_ADAPTER}, 400, "lora_name"),
    ("load: lora_path a list", LOAD, {"lora_name": "a", "lora_path": [NOT_AN_ADAPTER]}, 400, "lora_path"),
    ("load: lora_path an object", LOAD, {"lora_name": "a", "lora_path": {"path": "/x"}}, 400, "lora_path"),
    ("load: lora_name empty", LOAD, {"lora_name": "", "lora_path": NOT_AN_ADAPTER}, 400, "lora_name"),
    ("load: lora_path empty", LOAD, {"lora_name": "a", "lora_path": ""}, 400, "lora_path"),
    ("load: lora_name huge", LOAD, {"lora_name": "a" * 100_000, "lora_path": NOT_AN_ADAPTER}, 400, "lora_name"),
    ("load: lora_path huge", LOAD, {"lora_name": "a", "lora_path": "/a" * 200_000}, 400, "lora_path"),
    ("load: lora_path with NUL", LOAD, {"lora_name": "a", "lora_path": NOT_AN_ADAPTER + "\x00/x"}, 400, "lora_path"),
    ("load: lora_name with NUL", LOAD, {"lora_name": "a\x00b", "lora_path": NOT_AN_ADAPTER}, 400, "lora_name"),
    ("load: lora_name with a newline", LOAD, {"lora_name": "a\nb", "lora_path": NOT_AN_ADAPTER}, 400, "lora_name"),
    ("load: lora_name with a lone surrogate", LOAD, b'{"lora_name": "\\ud800", "lora_path": "/x"}', 400, "lora_name"),
    ("load: lora_path with a lone surrogate", LOAD, b'{"lora_name": "a", "lora_path": "/x\\udc00"}', 400, "lora_path"),
    ("load: load_inplace a string", LOAD, {"lora_name": "a", "lora_path": NOT_AN_ADAPTER, "load_inplace": "yes"}, 400,
     "load_inplace"),
    ("load: load_inplace 1", LOAD, {"lora_name": "a", "lora_path": NOT_AN_ADAPTER, "load_inplace": 1}, 400,
     "load_inplace"),
    ("load: the base model's name", LOAD, {"lora_name": MODEL, "lora_path": NOT_AN_ADAPTER}, 400, "lora_name"),
    ("load: a folder without an adapter", LOAD, {"lora_name": "a", "lora_path": NOT_AN_ADAPTER}, 400, "lora_path"),
    ("load: a file, not a folder", LOAD, {"lora_name": "a", "lora_path": A_FILE}, 400, "lora_path"),
    ("load: no such folder", LOAD, {"lora_name": "a", "lora_path": "/nonexistent/adapter"}, 400, "lora_path"),
    ("load: a relative path out of the tree", LOAD, {"lora_name": "a", "lora_path": "../" * 40 + "etc"}, 400,
     "lora_path"),
    ("load: a device", LOAD, {"lora_name": "a", "lora_path": "/dev/null"}, 400, "lora_path"),
    ("load: the root folder", LOAD, {"lora_name": "a", "lora_path": "/"}, 400, "lora_path"),
    ("unload: bad JSON", UNLOAD, b'{"lora_name": ', 400, None),
    ("unload: body not an object", UNLOAD, b'"a"', 400, None),
    ("unload: lora_name missing", UNLOAD, {"lora_int_id": 1}, 400, "lora_name"),
    ("unload: lora_name a number", UNLOAD, {"lora_name": 1}, 400, "lora_name"),
    ("unload: lora_name empty", UNLOAD, {"lora_name": ""}, 400, "lora_name"),
    ("unload: lora_int_id a string", UNLOAD, {"lora_name": "a", "lora_int_id": "1"}, 400, "lora_int_id"),
    ("unload: lora_int_id a bool", UNLOAD, {"lora_name": "a", "lora_int_id": True}, 400, "lora_int_id"),
    ("unload: lora_int_id a float", UNLOAD, {"lora_name": "a", "lora_int_id": 1.0}, 400, "lora_int_id"),
    ("unload: an unknown name", UNLOAD, {"lora_name": "nobody"}, 404, "lora_name"),
    ("unload: the base model", UNLOAD, {"lora_name": MODEL}, 404, "lora_name"),
    ("unload: a huge name", UNLOAD, {"lora_name": "a" * 100_000}, 404, "lora_name"),
    ("unload: a huge lora_int_id", UNLOAD, {"lora_name": "nobody", "lora_int_id": 2**80}, 404, "lora_name"),
    ("unload: a name with NUL", UNLOAD, {"lora_name": "a\x00"}, 404, "lora_name"),
]


@pytest.fixture(scope="module")
def lora_stack():
    """An app serving LoRA with the runtime LoRA endpoints on (on an engine thread of this process)."""
    stack = Stack(in_process=True, engine_options={"enable_lora": True}, allow_runtime_lora_updating=True)
    yield stack
    stack.close()


@pytest.mark.parametrize(("endpoint", "body", "status", "param"), [case[1:] for case in LORA_CASES],
                         ids=[case[0] for case in LORA_CASES])
def test_bad_lora_load_or_unload_gets_an_openai_error(lora_stack, endpoint, body, status, param):
    if isinstance(body, bytes):
        response = lora_stack.http.post(endpoint, content=body, headers={"content-type": "application/json"})
    else:
        response = lora_stack.http.post(endpoint, json=body)
    error = check_error(response, status, param)
    assert error["type"] == "invalid_request_error"
    assert len(error["message"]) < 2000  # a huge value is quoted clipped
    assert [card["id"] for card in lora_stack.http.get("/v1/models").json()["data"]] == [MODEL]
    assert lora_stack.http.get("/health").status_code == 200


def test_the_lora_endpoints_take_post_only_and_are_404_when_off(lora_stack, stack):
    check_error(lora_stack.http.get(LOAD), 405, code="method_not_allowed")
    check_error(lora_stack.http.get(UNLOAD), 405, code="method_not_allowed")
    if not stack.app.state.metrale.allow_runtime_lora_updating:  # (the other app follows VLLM_ALLOW_RUNTIME_LORA_UPDATING)
        check_error(stack.http.post(LOAD, json={"lora_name": "a", "lora_path": NOT_AN_ADAPTER}), 404, code="not_found")
    # A refused load of its own: the counter's line does not hang on other tests having run first.
    check_error(lora_stack.http.post(LOAD, json={"lora_path": NOT_AN_ADAPTER}), 400, "lora_name")
    text = lora_stack.http.get("/metrics").text
    assert 'metrale_requests_total{endpoint="/v1/load_lora_adapter",status="400"}' in text
    assert 'status="500"' not in text


def check_error(response, status, param=None, code=None):
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert "param" in error and "code" in error
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


@pytest.mark.parametrize(("endpoint", "body", "status", "param"), [case[1:] for case in CASES], ids=[c[0] for c in CASES])
def test_bad_request_gets_an_openai_error(stack, endpoint, body, status, param):
    if isinstance(body, bytes):
        response = stack.http.post(endpoint, content=body, headers={"content-type": "application/json"})
    else:
        response = stack.http.post(endpoint, json=body)
    error = check_error(response, status, param)
    assert error["type"] == "invalid_request_error"
    if status == 404:
        assert error["code"] == "model_not_found"
    assert stack.http.get("/health").status_code == 200


def test_the_server_still_serves_after_the_bad_requests(stack):
    # (One bad request of its own: the parametrized ones may have run on another test worker.)
    check_error(stack.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1}), 400)
    answer = stack.client.completions.create(model=MODEL, prompt="Return the", max_tokens=4, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 4
    chat_answer = stack.client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=3)
    assert chat_answer.usage.completion_tokens >= 1
    values = wait_idle(stack.http)
    assert values["metrale_kv_cache_blocks_used"] == 0 and values["metrale_requests_active"] == 0
    text = stack.http.get("/metrics").text
    assert 'metrale_requests_total{endpoint="/v1/completions",status="400"}' in text
    assert 'status="500"' not in text


def test_openai_client_raises_its_typed_errors(stack):
    with pytest.raises(openai.BadRequestError) as raised:
        stack.client.completions.create(model=MODEL, prompt="a", max_tokens=4, temperature=-1)
    assert raised.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        stack.client.chat.completions.create(model="nope", messages=CHAT["messages"])


def test_unknown_routes_and_wrong_methods(stack):
    http = stack.http
    for path in ("/nope", "/v1/nope", "/v2/completions"):
        check_error(http.get(path), 404, code="not_found")
    check_error(http.post("/v1/audio/speech", json={}), 404)
    wrong = http.get("/v1/completions")
    check_error(wrong, 405, code="method_not_allowed")
    assert "POST" in wrong.headers["allow"]
    check_error(http.post("/v1/models", json={}), 405)
    check_error(http.delete("/v1/chat/completions"), 405)
    check_error(http.get("/v1/models/gpt-9"), 404, param="model", code="model_not_found")


def test_oversized_bodies_get_413(stack):
    http = stack.http
    big = json.dumps(completion(prompt="a " * 600_000)).encode()
    assert len(big) > 1 << 20
    check_error(http.post(C, content=big, headers={"content-type": "application/json"}), 413, code="request_too_large")

    def chunks():  # no Content-Length: a chunked upload, counted as it arrives
        yield b'{"model": "tiny-dense", "prompt": "'
        for _ in range(40):
            yield b"a " * 16384
        yield b'"}'

    check_error(http.post(C, content=chunks(), headers={"content-type": "application/json"}), 413)
    # a declared length over the limit is answered without waiting for the body
    with socket.create_connection(("127.0.0.1", stack.thread.port), timeout=10) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1000000000000\r\n\r\n{\"model\": ")
        answer = b""
        while b"request_too_large" not in answer:
            data = raw.recv(65536)
            if not data:
                break
            answer += data
    assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer
    # just under the limit is read (and refused for what it holds, not its size)
    fits = json.dumps(completion(prompt=[5] * 150_000)).encode()
    assert len(fits) < 1 << 20
    check_error(http.post(C, content=fits, headers={"content-type": "application/json"}), 400, param="prompt")
    assert http.get("/health").status_code == 200


def test_api_key(auth_stack):
    url = auth_stack.url
    with http_client(url) as http:
        body = {"model": MODEL, "prompt": "Return the", "max_tokens": 2}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {API_KEY}"},
                        {"authorization": API_KEY}, {"authorization": "Bearer " + API_KEY + "x"},
                        {"authorization": b"Bearer \xe9\xff"}, {"x-api-key": "wrong"}):
            for path in (C, "/v1/models"):
                response = http.post(path, json=body, headers=headers) if path == C else http.get(path, headers=headers)
                error = check_error(response, 401, code="invalid_api_key")
                assert error["type"] == "authentication_error"
                assert API_KEY not in response.text
        check_error(http.get("/v1/nope"), 401)
        # /health and /metrics need no key
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
        ok = http.post(C, json=body, headers={"authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        assert http.post(C, json=body, headers={"x-api-key": API_KEY}).status_code == 200
        assert http.post(C, json=body, headers={"authorization": f"bearer   {API_KEY}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai_client(url, api_key="wrong").models.list()
    client = openai_client(url, api_key=API_KEY)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2).choices


def test_a_full_queue_gets_503_with_retry_after():
    # 2 requests may run and none wait: a third is refused
    full = Stack(max_waiting_requests=0, engine_options={"max_num_seqs": 2})
    try:
        # a request of three prompts is refused as a whole: the two it submitted are aborted
        response = full.http.post(C, json=completion(prompt=["a", "b", "c"]))
        error = check_error(response, 503, code="queue_full")
        assert response.headers["retry-after"] == "1"
        assert error["type"] == "server_error"
        values = wait_idle(full.http)
        assert values["metrale_requests_active"] == 0 and values["metrale_kv_cache_blocks_used"] == 0
        long = {"model": MODEL, "prompt": "Return the", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with http_client(full.url) as first, http_client(full.url) as second:
            with first.stream("POST", C, json=long) as one, second.stream("POST", C, json=long) as two:
                assert one.status_code == two.status_code == 200
                refused = full.http.post(C, json=COMPLETION)
                check_error(refused, 503, code="queue_full")
                assert refused.headers["retry-after"] == "1"
                with pytest.raises(openai.InternalServerError):
                    full.client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2)
                overloaded = full.http.post(M, json=MESSAGE)  # Anthropic's status for it
                check_anthropic_error(overloaded, 529, "overloaded_error")
                assert overloaded.headers["retry-after"] == "1"
        values = wait_idle(full.http)
        assert values["metrale_requests_active"] == 0 and values["metrale_kv_cache_blocks_used"] == 0
        assert full.http.post(C, json=COMPLETION).status_code == 200
    finally:
        full.close()


def test_a_draining_server_refuses_new_requests():
    draining = Stack()
    try:
        assert draining.http.get("/health").status_code == 200
        draining.app.state.metrale.begin_drain()
        response = draining.http.post(C, json=COMPLETION)
        check_error(response, 503, code="service_unavailable")
        assert response.headers["retry-after"] == "1"
        assert draining.http.get("/health").status_code == 503
        check_anthropic_error(draining.http.post(M, json=MESSAGE), 529, "overloaded_error")
        assert draining.http.get("/metrics").status_code == 200
    finally:
        draining.close()


# ------------------------------------------------------------------ Anthropic's Messages API

M, COUNT = "/v1/messages", "/v1/messages/count_tokens"
MESSAGE = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
ANTHROPIC_TOOLS = [{"name": "lookup", "input_schema": SCHEMA}]


def message(**fields):
    body = dict(MESSAGE)
    for name, value in fields.items():
        if value is _DROP:
            body.pop(name, None)
        else:
            body[name] = value
    return body


def turns(*content):
    """A conversation whose user turns hold ``content`` (an assistant turn between two)."""
    messages = [{"role": "user", "content": content[0]}]
    for item in content[1:]:
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": item}]
    return messages


def assistant_turn(*blocks):
    """A conversation whose assistant turn holds ``blocks``."""
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": list(blocks)},
            {"role": "user", "content": "hi"}]


IMAGE = {"type": "image", "source": {"type": "url", "url": "http://example.invalid/a.png"}}
TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"a": 1}}

# (case, endpoint, body: a dict sent as JSON or raw bytes, status, Anthropic's error type)
ANTHROPIC_CASES = [
    ("bad JSON", M, b'{"model": "tiny-dense", "max_tokens": ', 400, "invalid_request_error"),
    ("body not an object", M, b"[1, 2]", 400, "invalid_request_error"),
    ("empty body", COUNT, b"", 400, "invalid_request_error"),
    ("nested too deeply", M, b'{"model": "tiny-dense", "metadata": ' + b"[" * 200 + b"]" * 200 + b"}", 400,
     "invalid_request_error"),
    ("unknown model", M, message(model="no-such-model"), 404, "not_found_error"),
    ("unknown model (count_tokens)", COUNT, message(model="no-such-model"), 404, "not_found_error"),
    ("model not a string", M, message(model=5), 400, "invalid_request_error"),
    ("missing max_tokens", M, message(max_tokens=_DROP), 400, "invalid_request_error"),
    ("max_tokens a string", M, message(max_tokens="4"), 400, "invalid_request_error"),
    ("max_tokens 0", M, message(max_tokens=0), 400, "invalid_request_error"),
    ("max_tokens beyond the context", M, message(max_tokens=1_000_000), 400, "invalid_request_error"),
    ("missing messages", M, message(messages=_DROP), 400, "invalid_request_error"),
    ("messages empty", M, message(messages=[]), 400, "invalid_request_error"),
    ("messages not a list", COUNT, message(messages="hi"), 400, "invalid_request_error"),
    ("message not an object", M, message(messages=["hi"]), 400, "invalid_request_error"),
    ("a system role in messages", M, message(messages=[{"role": "system", "content": "hi"}]), 400,
     "invalid_request_error"),
    ("message without content", M, message(messages=[{"role": "user"}]), 400, "invalid_request_error"),
    ("content a number", M, message(messages=turns(5)), 400, "invalid_request_error"),
    ("content an empty list", M, message(messages=turns([])), 400, "invalid_request_error"),
    ("a block without a type", M, message(messages=turns([{"text": "hi"}])), 400, "invalid_request_error"),
    ("a text block without text", M, message(messages=turns([{"type": "text"}])), 400, "invalid_request_error"),
    ("an unknown block type", M, message(messages=turns([{"type": "audio"}])), 400, "invalid_request_error"),
    ("an image block", M, message(messages=turns([IMAGE])), 400, "invalid_request_error"),
    ("an image block (count_tokens)", COUNT, message(messages=turns([IMAGE])), 400, "invalid_request_error"),
    ("a document block", M, message(messages=turns([{"type": "document", "source": {"type": "text", "data": "x"}}])), 400,
     "invalid_request_error"),
    ("an image in a tool result", M, message(messages=turns("hi", [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                                    "content": [IMAGE]}])), 400, "invalid_request_error"),
    ("tool_use on a user turn", M, message(messages=turns([TOOL_USE])), 400, "invalid_request_error"),
    ("tool_result on an assistant turn", M, message(messages=assistant_turn(
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"})), 400, "invalid_request_error"),
    ("tool_use input not an object", M, message(messages=assistant_turn({**TOOL_USE, "input": "a=1"})), 400,
     "invalid_request_error"),
    ("tool_use without an id", M, message(messages=assistant_turn({**TOOL_USE, "id": ""})), 400, "invalid_request_error"),
    ("tool_result without tool_use_id", M, message(messages=turns([{"type": "tool_result", "content": "1"}])), 400,
     "invalid_request_error"),
    ("tool_result is_error a string", M, message(messages=turns([{"type": "tool_result", "tool_use_id": "toolu_1",
                                                                   "is_error": "yes"}])), 400, "invalid_request_error"),
    ("a final assistant turn (prefill)", M, message(messages=[{"role": "user", "content": "hi"},
                                                              {"role": "assistant", "content": "The"}]), 400,
     "invalid_request_error"),
    ("system a number", M, message(system=5), 400, "invalid_request_error"),
    ("system holding an image", M, message(system=[IMAGE]), 400, "invalid_request_error"),
    ("content with a lone surrogate", M, b'{"model": "tiny-dense", "max_tokens": 4, "messages": [{"role": "user", '
     b'"content": "\\udc00"}]}', 400, "invalid_request_error"),
    ("stop_sequences a string", M, message(stop_sequences="end"), 400, "invalid_request_error"),
    ("stop_sequences holding an empty string", M, message(stop_sequences=[""]), 400, "invalid_request_error"),
    ("stop_sequences of 50 strings", M, message(stop_sequences=[f"s{i}" for i in range(50)]), 400, "invalid_request_error"),
    ("temperature -1", M, message(temperature=-1), 400, "invalid_request_error"),
    ("temperature a word", M, message(temperature="hot"), 400, "invalid_request_error"),
    ("top_p 2", M, message(top_p=2), 400, "invalid_request_error"),
    ("top_k -5", M, message(top_k=-5), 400, "invalid_request_error"),
    ("stream 'yes'", M, message(stream="yes"), 400, "invalid_request_error"),
    ("tools not a list", M, message(tools={"name": "lookup"}), 400, "invalid_request_error"),
    ("a tool without a name", M, message(tools=[{"input_schema": SCHEMA}]), 400, "invalid_request_error"),
    ("a tool without input_schema", M, message(tools=[{"name": "lookup"}]), 400, "invalid_request_error"),
    ("input_schema not of type object", M, message(tools=[{"name": "lookup", "input_schema": {"type": "no-such-type"}}]),
     400, "invalid_request_error"),
    ("an invalid input_schema, forced", M, message(tools=[{"name": "f", "input_schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}], tool_choice={"type": "tool", "name": "f"}), 400,
     "invalid_request_error"),
    ("an unsatisfiable input_schema, forced", M, message(tools=[{"name": "f", "input_schema": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["a"]}}],
        tool_choice={"type": "any"}), 400, "invalid_request_error"),
    ("a server tool", M, message(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400,
     "invalid_request_error"),
    ("two tools of one name", M, message(tools=ANTHROPIC_TOOLS * 2), 400, "invalid_request_error"),
    ("too many tools", COUNT, message(tools=[{"name": f"f{i}", "input_schema": SCHEMA} for i in range(200)]), 400,
     "invalid_request_error"),
    ("tool_choice naming an unknown tool", M, message(tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "nope"}),
     400, "invalid_request_error"),
    ("tool_choice tool without a name", M, message(tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool"}), 400,
     "invalid_request_error"),
    ("tool_choice an OpenAI word", M, message(tools=ANTHROPIC_TOOLS, tool_choice="required"), 400, "invalid_request_error"),
    ("tool_choice any without tools", M, message(tool_choice={"type": "any"}), 400, "invalid_request_error"),
    ("disable_parallel_tool_use a string", M, message(tools=ANTHROPIC_TOOLS, tool_choice={
        "type": "auto", "disable_parallel_tool_use": "yes"}), 400, "invalid_request_error"),
    ("thinking budget at max_tokens", M, message(thinking={"type": "enabled", "budget_tokens": 4}), 400,
     "invalid_request_error"),
    ("thinking budget a string", M, message(thinking={"type": "enabled", "budget_tokens": "16"}), 400,
     "invalid_request_error"),
    ("thinking of an unknown type", M, message(thinking={"type": "deep"}), 400, "invalid_request_error"),
]


def check_anthropic_error(response, status, error_type):
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == error_type, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(("endpoint", "body", "status", "error_type"), [case[1:] for case in ANTHROPIC_CASES],
                         ids=[case[0] for case in ANTHROPIC_CASES])
def test_bad_messages_request_gets_an_anthropic_error(stack, endpoint, body, status, error_type):
    if isinstance(body, bytes):
        response = stack.http.post(endpoint, content=body, headers={"content-type": "application/json"})
    else:
        response = stack.http.post(endpoint, json=body)
    check_anthropic_error(response, status, error_type)
    assert stack.http.get("/health").status_code == 200


def test_messages_routes_sizes_and_the_anthropic_client(stack):
    http = stack.http
    check_anthropic_error(http.get(M), 405, "invalid_request_error")
    check_anthropic_error(http.post(f"{M}/nope", json=MESSAGE), 404, "not_found_error")
    big = json.dumps(message(messages=[{"role": "user", "content": "a " * 600_000}])).encode()
    check_anthropic_error(http.post(M, content=big, headers={"content-type": "application/json"}), 413, "request_too_large")
    # the OpenAI endpoints keep their own shape
    check_error(http.post(CH, json=chat(max_tokens=0)), 400, "max_tokens")
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [IMAGE]}])
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=4, messages=MESSAGE["messages"])
    assert client.messages.create(model=MODEL, max_tokens=2, messages=MESSAGE["messages"]).usage.output_tokens == 2
