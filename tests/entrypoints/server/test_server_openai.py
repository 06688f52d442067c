"""The OpenAI-compatible endpoints driven by the official ``openai`` client: results equal the
Python API's (greedy and seeded), streams equal non-streamed answers, logprobs, prompt scoring
(``echo`` with ``max_tokens: 0``) against :meth:`metrale.LLM.score`, ``text_offset`` indexing the
returned text, stop strings, structured output, usage, /v1/models, /health and /metrics."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")
pytest.importorskip("openai")

from serverkit import MODEL, Stack, http_client, metric_values, new_llm  # noqa: E402

from metrale import SamplingParams  # noqa: E402
from metrale.structured import StructuredOutputParams  # noqa: E402

PROMPTS = ["Return the", "Open a file and", "The number of items in the list"]
CONVERSATION = [{"role": "system", "content": "You write code."}, {"role": "user", "content": "Sort a list"}]


@pytest.fixture(scope="module")
def stack():
    stack = Stack()
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def reference():
    """A second LLM on the same checkpoint: the results the server must reproduce."""
    llm = new_llm()
    yield llm
    llm.close()


@pytest.fixture
def client(stack):
    return stack.client


@pytest.fixture
def http(stack):
    return stack.http


def greedy(**options):
    return SamplingParams(temperature=0, **options)


def test_completion_greedy_equals_llm_generate(client, reference):
    for prompt in PROMPTS:
        expected = reference.generate(prompt, greedy(max_tokens=16), use_tqdm=False)[0]
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert answer.object == "text_completion" and answer.id.startswith("cmpl-") and answer.model == MODEL
        assert len(answer.choices) == 1
        assert answer.choices[0].text == expected.text
        assert answer.choices[0].finish_reason == expected.finish_reason
        assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert answer.usage.completion_tokens == len(expected.token_ids)
        assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_multi_prompt_completion_keeps_the_prompt_order(client, reference):
    expected = reference.generate(PROMPTS, greedy(max_tokens=12), use_tqdm=False)
    answer = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.text for c in answer.choices] == [e.text for e in expected]
    assert answer.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert answer.usage.completion_tokens == sum(len(e.token_ids) for e in expected)


def test_token_id_prompts_equal_text_prompts(client, reference):
    ids = [reference.encode(p) for p in PROMPTS[:2]]
    expected = reference.generate(PROMPTS[:2], greedy(max_tokens=10), use_tqdm=False)
    single = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=10, temperature=0)
    assert single.choices[0].text == expected[0].text
    several = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert [c.text for c in several.choices] == [e.text for e in expected]


def test_chat_greedy_equals_llm_chat(client, reference):
    expected = reference.chat(CONVERSATION, greedy(max_tokens=20), use_tqdm=False)[0]
    answer = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=20, temperature=0)
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    message = answer.choices[0].message
    assert message.role == "assistant"
    assert message.content == expected.text
    assert answer.choices[0].finish_reason == expected.finish_reason
    assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert answer.usage.completion_tokens == len(expected.token_ids)
    # max_completion_tokens is the newer name of max_tokens
    newer = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_completion_tokens=20, temperature=0)
    assert newer.choices[0].message.content == expected.text


def test_chat_text_parts_and_template_options(client, reference):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Sort "}, {"type": "text", "text": "a list"}]}]
    expected = reference.chat([{"role": "user", "content": "Sort a list"}], greedy(max_tokens=8), use_tqdm=False)[0]
    answer = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=8, temperature=0)
    assert answer.choices[0].message.content == expected.text
    no_prompt = reference.chat(CONVERSATION, greedy(max_tokens=8), add_generation_prompt=False, use_tqdm=False)[0]
    answer = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=8, temperature=0,
                                            extra_body={"add_generation_prompt": False})
    assert answer.choices[0].message.content == no_prompt.text


def test_streamed_completion_equals_the_non_streamed_one(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == \
        whole.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
    body = chunks[:-1]
    assert len(body) > 2, "the text must come in several chunks"
    assert all(chunk.usage is None for chunk in body)
    assert all(chunk.id == chunks[0].id for chunk in chunks)
    assert "".join(chunk.choices[0].text for chunk in body) == whole.choices[0].text
    assert [chunk.choices[0].finish_reason for chunk in body][-1] == whole.choices[0].finish_reason == "length"
    assert all(chunk.choices[0].finish_reason is None for chunk in body[:-1])


def test_streamed_chat_equals_the_non_streamed_one(client):
    whole = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    first = chunks[0]
    assert first.object == "chat.completion.chunk"
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks[:-1])
    assert text == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stream_without_include_usage_has_no_usage(http):
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Return the", "max_tokens": 4,
                                                      "temperature": 0, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        assert event.startswith("data: ")
        chunk = json.loads(event[len("data: "):])
        assert "usage" not in chunk and len(chunk["choices"]) == 1


def test_n_completions_are_those_of_llm_generate(client, reference):
    params = SamplingParams(n=2, temperature=0.9, seed=1234, max_tokens=12)
    expected = reference.generate(PROMPTS[:2], params, use_tqdm=False)
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, temperature=0.9, seed=1234, max_tokens=12)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    # choice index = prompt index * n + completion index, as OpenAI numbers them
    assert [c.text for c in answer.choices] == [o.text for e in expected for o in e.outputs]
    assert answer.choices[0].text != answer.choices[1].text, "the two completions must differ when sampled"
    stream = list(client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, temperature=0.9, seed=1234,
                                            max_tokens=12, stream=True))
    texts = {i: "" for i in range(4)}
    finished = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(4)] == [c.text for c in answer.choices]
    assert sorted(finished) == [0, 1, 2, 3]
    chat = client.chat.completions.create(model=MODEL, messages=CONVERSATION, n=2, max_tokens=8, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: equal


def test_completion_logprobs(client, reference):
    expected = reference.generate(PROMPTS[0], greedy(max_tokens=8, logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2,
                                       extra_body={"ignore_eos": True})
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    # (ignore_eos: the end-of-sequence token is among the tokens, and not in the text)
    assert "".join(t for t in logprobs.tokens if t != "<|endoftext|>") == answer.choices[0].text
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    for position, (token, value, top) in enumerate(zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs)):
        chosen = expected.outputs[0].logprobs[position][expected.token_ids[position]]
        assert value <= 0 and value == pytest.approx(chosen.logprob, abs=1e-4)
        assert token in top and top[token] == pytest.approx(value)
        assert 2 <= len(top) <= 3 and all(v <= 0 for v in top.values())
        assert max(top.values()) == pytest.approx(value), "greedy: the chosen token is the most likely"
    stream = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2,
                                            stream=True, extra_body={"ignore_eos": True}))
    tokens = [t for chunk in stream for t in chunk.choices[0].logprobs.tokens]
    offsets = [t for chunk in stream for t in chunk.choices[0].logprobs.text_offset]
    assert tokens == logprobs.tokens and offsets == logprobs.text_offset


def test_echo_with_logprobs_covers_the_prompt(client):
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True, logprobs=1)
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    choice = answer.choices[0]
    assert choice.text == PROMPTS[0] + plain.choices[0].text
    prompt_tokens = answer.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == prompt_tokens + answer.usage.completion_tokens
    assert choice.logprobs.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in choice.logprobs.token_logprobs[1:])


def log_softmax(logits):
    """Row-wise log-softmax in float64: the reference the server's logprobs are held to."""
    shifted = np.asarray(logits, dtype=np.float64)
    shifted = shifted - shifted.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def streamed_choice(http, body):
    """The text and logprobs of a streamed completion's one choice, its chunks joined."""
    response = http.post("/v1/completions", json={**body, "stream": True})
    assert response.status_code == 200, response.text
    chunks = [json.loads(line[len("data: "):]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
    logprobs = {key: [v for choice in choices for v in (choice["logprobs"] or {}).get(key, [])]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    return "".join(choice["text"] for choice in choices), logprobs, choices[-1]["finish_reason"]


def test_echo_with_max_tokens_0_scores_the_prompt(client, http, reference):
    def token_text(token):
        return reference.tokenizer.decode([token], skip_special_tokens=False)

    for prompt in (PROMPTS[2], reference.encode(PROMPTS[1], add_special_tokens=False)):
        ids = reference.encode(prompt) if isinstance(prompt, str) else prompt
        expected = log_softmax(reference.score(ids))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert {key: answer["usage"][key] for key in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
            "prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
        [choice] = answer["choices"]
        assert choice["text"] == (prompt if isinstance(prompt, str) else reference.decode(ids))
        assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [token_text(token) for token in ids]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        for position in range(1, len(ids)):
            row, token = expected[position - 1], ids[position]
            assert logprobs["token_logprobs"][position] == pytest.approx(row[token], abs=1e-5)
            best = {token_text(t): row[t] for t in np.argsort(row)[::-1][:2]}
            best.setdefault(token_text(token), row[token])
            top = logprobs["top_logprobs"][position]
            assert top.keys() == best.keys()
            assert all(top[name] == pytest.approx(value, abs=1e-5) for name, value in best.items())
        assert streamed_choice(http, body) == (choice["text"], logprobs, "length")
    # Several prompts, and the openai client, which sends max_tokens 0 as it is.
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=0, echo=True, logprobs=0)
    assert [c.text for c in answer.choices] == PROMPTS[:2] and answer.usage.completion_tokens == 0
    for choice, prompt in zip(answer.choices, PROMPTS[:2]):
        ids = reference.encode(prompt)
        values = log_softmax(reference.score(ids))
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(
            [values[position - 1, ids[position]] for position in range(1, len(ids))], abs=1e-5)


def check_offsets(text, logprobs):
    """``text[text_offset[i]:]`` starts with ``tokens[i]`` for every token the text holds (not a
    special token, not a piece of a split character, not past a stop string's cut, where the
    offsets go on past the text's end); the offsets never go back."""
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] >= 0
    checked = 0
    for token, offset in zip(logprobs["tokens"], offsets):
        if token == "<|endoftext|>" or "\ufffd" in token or offset + len(token) > len(text):
            continue
        assert text.startswith(token, offset), (token, offset, text)
        checked += 1
    return checked


def test_text_offset_indexes_into_the_returned_text(http, reference):
    bos = reference.bos_token_id
    twice = [bos, *reference.encode("Return the", add_special_tokens=False), bos,
             *reference.encode(" café ☕", add_special_tokens=False)]
    bodies = [
        {"prompt": "Return the", "max_tokens": 0, "echo": True},
        {"prompt": twice, "max_tokens": 6, "echo": True, "ignore_eos": True},
        {"prompt": "Le café ☕ naïve — 日本語 ok", "max_tokens": 4, "echo": True},
        {"prompt": "Return the", "max_tokens": 30, "guided_choice": ["café ☕ naïve — 日本語 ok"], "stop": ["ok"]},
        {"prompt": "Return the", "max_tokens": 30, "echo": True, "guided_choice": ["café ☕ — 日本語 ok"]},
    ]
    for body in bodies:
        body = {"model": MODEL, "temperature": 0, "logprobs": 1, **body}
        answer = http.post("/v1/completions", json=body).json()
        choice = answer["choices"][0]
        assert check_offsets(choice["text"], choice["logprobs"]) >= 2
        text, logprobs, _ = streamed_choice(http, body)
        assert (text, logprobs["tokens"], logprobs["text_offset"]) == (
            choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"])
    # The BOS the echoed text leaves out takes no room in it.
    answer = http.post("/v1/completions", json={"model": MODEL, "prompt": "Return the", "max_tokens": 0, "echo": True,
                                                "logprobs": 0}).json()
    logprobs = answer["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["<|endoftext|>", "Return", " the"] and logprobs["text_offset"] == [0, 0, 6]


def test_add_special_tokens_on_completions(http, reference):
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 0, "echo": True, "logprobs": 0}
    with_bos = http.post("/v1/completions", json=body).json()
    assert with_bos["usage"]["prompt_tokens"] == len(reference.encode(PROMPTS[1]))
    assert with_bos["choices"][0]["logprobs"]["tokens"][0] == "<|endoftext|>"
    plain_ids = reference.encode(PROMPTS[1], add_special_tokens=False)
    without = http.post("/v1/completions", json={**body, "add_special_tokens": False}).json()
    by_ids = http.post("/v1/completions", json={**body, "prompt": plain_ids}).json()
    assert without["usage"]["prompt_tokens"] == len(plain_ids)
    assert without["choices"][0]["logprobs"] == by_ids["choices"][0]["logprobs"]
    assert without["choices"][0]["text"] == by_ids["choices"][0]["text"] == PROMPTS[1]
    generated = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0,
                                                   "add_special_tokens": False}).json()
    expected = reference.generate([plain_ids], greedy(max_tokens=8), use_tqdm=False)[0]
    assert generated["choices"][0]["text"] == expected.text


def test_chat_logprobs(client, reference):
    expected = reference.chat(CONVERSATION, greedy(max_tokens=8, logprobs=2), use_tqdm=False)[0]
    answer = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == len(expected.token_ids)
    for position, entry in enumerate(content):
        chosen = expected.outputs[0].logprobs[position][expected.token_ids[position]]
        assert entry.logprob <= 0 and entry.logprob == pytest.approx(chosen.logprob, abs=1e-4)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 2
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert entry.top_logprobs[0].token == entry.token and values[0] == pytest.approx(entry.logprob)
    bare = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=4, temperature=0, logprobs=True)
    assert all(entry.top_logprobs == [] for entry in bare.choices[0].logprobs.content)
    none = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=4, temperature=0)
    assert none.choices[0].logprobs is None


def test_stop_string_cuts_the_text(client, reference):
    full = reference.generate(PROMPTS[0], greedy(max_tokens=16, ignore_eos=True), use_tqdm=False)[0].text
    words = full.split(" ")
    stop = " " + words[3]  # a word from the middle of the continuation
    cut = full[: full.index(stop)]
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop, "zzzz"],
                                       extra_body={"ignore_eos": True})
    assert answer.choices[0].text == cut
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_ignore_eos_and_min_tokens_fix_the_length(client):
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=21, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 21 and answer.choices[0].finish_reason == "length"
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=21, temperature=0,
                                       extra_body={"min_tokens": 21})
    assert answer.usage.completion_tokens == 21


SCHEMA = {
    "type": "object",
    "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                   "count": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["color", "count"],
    "additionalProperties": False,
}


def test_response_format_json_schema(client, reference):
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    answer = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=40, temperature=0,
                                            response_format=response_format)
    data = json.loads(answer.choices[0].message.content)
    assert set(data) == {"color", "count"}
    assert data["color"] in ("red", "green", "blue")
    assert isinstance(data["count"], int) and 0 <= data["count"] <= 99
    assert answer.choices[0].finish_reason == "stop"
    expected = reference.chat(CONVERSATION, greedy(max_tokens=40, structured_output=StructuredOutputParams(json=SCHEMA)),
                              use_tqdm=False)[0]
    assert answer.choices[0].message.content == expected.text
    # the same through the completions endpoint and vLLM's guided_json
    completion = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                           extra_body={"guided_json": SCHEMA})
    assert set(json.loads(completion.choices[0].text)) == {"color", "count"}


def test_json_object_and_choice(client):
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                       extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(answer.choices[0].text), dict) and answer.choices[0].finish_reason == "stop"
    choice = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert choice.choices[0].text in ("alpha", "beta")
    regex = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                      extra_body={"guided_regex": "[0-9]{3}"})
    assert len(regex.choices[0].text) == 3 and regex.choices[0].text.isdigit()


def test_prompt_logprobs_extension(http):
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0,
                                                  "prompt_logprobs": 1})
    assert response.status_code == 200
    choice = response.json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == response.json()["usage"]["prompt_tokens"]
    for entry in entries[1:]:
        assert entry and all(v["logprob"] <= 0 for v in entry.values())


def test_models_health_and_metrics(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = models.data[0]
    assert card.object == "model" and card.owned_by == "metrale" and card.model_extra["max_model_len"] == 1024
    assert client.models.retrieve(MODEL).id == MODEL
    health = http.get("/health")
    assert health.status_code == 200
    # (A completion of its own: the module's other tests may have run on another test worker.)
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0)
    text = http.get("/metrics").text
    for name in ("metrale_requests_total", "metrale_prompt_tokens_total", "metrale_generation_tokens_total",
                 "metrale_time_to_first_token_seconds_bucket", "metrale_inter_token_latency_seconds_bucket",
                 "metrale_e2e_request_latency_seconds_count", "metrale_requests_running", "metrale_requests_waiting",
                 "metrale_kv_cache_usage_ratio", "metrale_kv_cache_blocks_used", "metrale_kv_cache_blocks_total",
                 "metrale_state_slots_used", "metrale_prefix_cache_queries_total", "metrale_prefix_cache_hits_total",
                 "metrale_preemptions_total", "metrale_requests_active", "metrale_request_finish_total"):
        assert name in text, name
    assert 'metrale_requests_total{endpoint="/v1/completions",status="200"}' in text
    before = metric_values(http)
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    after = metric_values(http)
    assert after["metrale_generation_tokens_total"] - before["metrale_generation_tokens_total"] == 5
    assert after["metrale_prompt_tokens_total"] > before["metrale_prompt_tokens_total"]
    assert after["metrale_kv_cache_blocks_total"] > 0


def test_vllm_metric_names_carry_the_model_name_and_metrale_s_values(client, http):
    """Dashboards written for vLLM read its names, labelled with the served model's name; each
    holds the value of Metrale's own metric."""
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    samples = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    model = (("model_name", MODEL),)
    pairs = {"vllm:prompt_tokens_total": "metrale_prompt_tokens_total",
             "vllm:generation_tokens_total": "metrale_generation_tokens_total",
             "vllm:time_to_first_token_seconds_count": "metrale_time_to_first_token_seconds_count",
             "vllm:e2e_request_latency_seconds_count": "metrale_e2e_request_latency_seconds_count",
             "vllm:num_requests_running": "metrale_requests_running",
             "vllm:kv_cache_usage_perc": "metrale_kv_cache_usage_ratio",
             "vllm:num_preemptions_total": "metrale_preemptions_total"}
    for vllm_name, own in pairs.items():
        assert samples[(vllm_name, model)] == samples[(own, ())], vllm_name
    finished = sum(value for (name, labels), value in samples.items()
                   if name == "metrale_request_finish_total" and ("finish_reason", "length") in labels)
    assert samples[("vllm:request_success_total", (("finished_reason", "length"), *model))] == finished > 0


def _samples(http):
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_request_phases_step_sizes_and_cache_settings_in_metrics(client, http):
    """Each finished request adds one sample to each phase histogram (queue, prefill, decode,
    inference), the inference time is the prefill's plus the decode's, and the server's own
    end-to-end latency covers them; each step's computed tokens are counted; the cache's settings
    are labels. vLLM's names hold the same values."""
    phases = ("queue", "prefill", "decode", "inference")
    before = _samples(http)
    prompt = "Seven violet umbrellas drift over quiet harbours at dawn"  # (no prefix cache hit)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
    after = _samples(http)

    def delta(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    for phase in phases:
        assert delta(f"metrale_request_{phase}_time_seconds_count") == 1, phase
        assert delta(f"metrale_request_{phase}_time_seconds_sum") >= 0, phase
    prefill, decode = delta("metrale_request_prefill_time_seconds_sum"), delta("metrale_request_decode_time_seconds_sum")
    assert decode > 0
    assert delta("metrale_request_inference_time_seconds_sum") == pytest.approx(prefill + decode, abs=1e-6)
    assert delta("metrale_e2e_request_latency_seconds_sum") >= delta("metrale_request_inference_time_seconds_sum")
    # One prompt step and four decode steps of one row each.
    assert delta("metrale_iteration_tokens_count") == 5
    assert delta("metrale_iteration_tokens_sum") == response.usage.prompt_tokens + 4
    assert delta("metrale_iteration_tokens_bucket", (("le", "1.0"),)) == 4
    model = (("model_name", MODEL),)
    for phase in phases:
        for suffix in ("count", "sum"):
            own = f"metrale_request_{phase}_time_seconds_{suffix}"
            assert after[(f"vllm:request_{phase}_time_seconds_{suffix}", model)] == after[(own, ())]
    assert after[("vllm:iteration_tokens_total_count", model)] == after[("metrale_iteration_tokens_count", ())]
    (labels,) = [dict(labels) for name, labels in after if name == "metrale_cache_config_info"]
    assert labels["num_gpu_blocks"] == str(int(after[("metrale_kv_cache_blocks_total", ())]))
    assert labels["block_size"] == "16" and labels["cache_dtype"] == "auto" and labels["enable_prefix_caching"] == "True"
    assert after[("vllm:cache_config_info", tuple(sorted({**labels, "model_name": MODEL}.items())))] == 1.0


def test_health_is_503_once_the_engine_is_down():
    own = Stack()
    try:
        with http_client(own.url) as http:
            assert http.get("/health").status_code == 200
            own.engine.shutdown()
            down = http.get("/health")
            assert down.status_code == 503 and down.json()["error"]["message"]
            refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "Return the", "max_tokens": 2})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert http.get("/metrics").status_code == 200
    finally:
        own.close()


TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}{% if flavor is defined %}flavor: {{ flavor }}\n{% endif %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def test_tools_and_template_kwargs_reach_the_chat_template():
    """Tools and chat_template_kwargs are rendered by the template (without a tool-call parser the
    reply is text: no call is read)."""
    templated = Stack(engine_options={"chat_template": TEMPLATE})
    reference = new_llm(chat_template=TEMPLATE)
    try:
        tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
        messages = [{"role": "user", "content": "Find it"}]
        plain = templated.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
        answer = templated.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                          tools=tools, extra_body={"chat_template_kwargs": {"flavor": "x"}})
        ids = reference.apply_chat_template(messages, tools=tools, flavor="x")
        assert answer.usage.prompt_tokens == len(ids) > plain.usage.prompt_tokens
        expected = reference.generate({"prompt_token_ids": ids}, greedy(max_tokens=6), use_tqdm=False)[0]
        assert answer.choices[0].message.content == expected.text
        assert answer.choices[0].message.tool_calls == []
    finally:
        reference.close()
        templated.close()


def test_serve_arguments_cover_every_engine_option():
    import argparse
    from dataclasses import fields

    from metrale.config import CacheConfig, EngineConfig, read_environment
    from metrale.entrypoints.server.main import add_serve_arguments, engine_options

    parser = add_serve_arguments(argparse.ArgumentParser())
    assert engine_options(parser.parse_args(["m"])) == {"device": "auto", "show_progress": True}
    args = parser.parse_args(["m", "--device", "cpu", "--max-model-len", "512", "--max-num-seqs", "8",
                              "--max-num-batched-tokens", "256", "--no-prefix-caching", "--seed", "3", "--no-cuda-graphs",
                              "--no-overlap-scheduling", "--block-size", "32", "--num-blocks", "100", "--memory-bytes",
                              "1000000", "--num-state-slots", "9", "--num-state-snapshots", "2", "--chat-template", "t.jinja",
                              "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--no-progress",
                              "--lora-modules", "sql=/a/b", "chat=/c", "--max-loras", "2", "--max-lora-rank", "32",
                              "--tensor-parallel-size", "2", "--expert-parallel", "--distributed-executor-backend", "ray",
                              "--quantization", "fp8", "--kv-cache-dtype", "fp8", "--revision", "v1", "--download-dir",
                              "/cache", "--tokenizer", "org/tok", "--tokenizer-revision", "v2", "--batch-invariant"])
    options = engine_options(args)
    assert options == {"device": "cpu", "show_progress": False, "max_model_len": 512, "max_num_seqs": 8,
                       "max_num_batched_tokens": 256, "enable_prefix_caching": False, "seed": 3, "cuda_graphs": False,
                       "overlap_scheduling": False, "block_size": 32, "num_blocks": 100, "memory_bytes": 1000000,
                       "num_state_slots": 9, "num_state_snapshots": 2, "chat_template": "t.jinja",
                       "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}, "enable_lora": True,
                       "max_loras": 2, "max_lora_rank": 32, "tensor_parallel_size": 2, "expert_parallel": True,
                       "distributed_executor_backend": "ray", "quantization": "fp8", "kv_cache_dtype": "fp8",
                       "revision": "v1", "download_dir": "/cache", "tokenizer": "org/tok", "tokenizer_revision": "v2",
                       "batch_invariant": True}
    from metrale.entrypoints.server.main import lora_modules

    assert [(r.lora_name, r.lora_int_id, str(r.lora_path)) for r in lora_modules(args)] == [("sql", 1, "/a/b"),
                                                                                         ("chat", 2, "/c")]
    engine_names = {f.name for f in fields(EngineConfig)} - {"cache", "environment"}
    cache_names = {f.name for f in fields(CacheConfig)}
    assert engine_names | cache_names <= set(options), "an engine option has no flag"
    config = EngineConfig.from_options({k: v for k, v in options.items() if k in engine_names | cache_names},
                                       read_environment({}))
    assert config.max_num_seqs == 8 and config.cache.block_size == 32 and not config.enable_prefix_caching


def test_speculation_counters_in_metrics():
    own = Stack(in_process=True, engine_options={"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}})
    try:
        before = metric_values(own.http)
        assert before["metrale_spec_decode_verify_steps_total"] == 0
        prompt = "one two three four one two three four one two three four one two three"
        response = own.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                 extra_body={"ignore_eos": True})
        assert response.usage.completion_tokens == 12
        after = metric_values(own.http)
        drafted, kept = after["metrale_spec_decode_draft_tokens_total"], after["metrale_spec_decode_accepted_tokens_total"]
        assert after["metrale_spec_decode_verify_steps_total"] > 0 and drafted > 0 and 0 <= kept <= drafted
    finally:
        own.close()


def test_usage_reports_the_prompt_tokens_the_prefix_cache_supplied(client, reference):
    """A second request sharing a long prefix with the first: its usage says how many prompt
    tokens the prefix cache gave it (whole cache blocks, less than the prompt), in chat and
    completions, streamed and not; a first request reports 0."""
    block = reference.cache.block_size
    shared = " ".join(f"word{i}" for i in range(6 * block))
    first = client.completions.create(model=MODEL, prompt=shared + " one", max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=MODEL, prompt=shared + " two", max_tokens=2, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % block == 0 and cached < second.usage.prompt_tokens
    streamed = client.completions.create(model=MODEL, prompt=shared + " three", max_tokens=2, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in streamed if chunk.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens == cached
    messages = [{"role": "user", "content": shared + " four"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= cached
