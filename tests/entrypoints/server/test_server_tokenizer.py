"""vLLM's tokenizer endpoints -- ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``
-- give the ids, text and settings of the Python API's tokenizer and chat template; the served
context length (here below the checkpoint's) is reported wherever clients read it; the API key
guards the three paths. Also ``text_offset`` placed in a text that a decoder of single tokens
does not reproduce (dropped leading spaces, a character split across tokens)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("openai")

from serverkit import API_KEY, MODEL, Stack, http_client, new_llm  # noqa: E402

#: The served context, below the checkpoint's 1024 (its tokenizer_config.json's model_max_length).
SERVED_CONTEXT = 512
PROMPTS = ["Return the", "Le café ☕ naïve — 日本語", "<|endoftext|>Return the", " leading space", "a\n\nb"]
CONVERSATION = [{"role": "system", "content": "You write code."}, {"role": "user", "content": "Sort a list"}]


@pytest.fixture(scope="module")
def stack():
    stack = Stack(engine_options={"max_model_len": SERVED_CONTEXT})
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def reference():
    llm = new_llm(max_model_len=SERVED_CONTEXT)
    yield llm
    llm.close()


def tokenize(stack, **body):
    response = stack.http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def detokenize(stack, tokens):
    response = stack.http.post("/detokenize", json={"tokens": tokens})
    assert response.status_code == 200, response.text
    return response.json()["prompt"]


def test_tokenize_a_prompt_as_the_engine_encodes_it(stack, reference):
    for prompt in PROMPTS:
        answer = tokenize(stack, prompt=prompt)
        assert answer == {"count": len(answer["tokens"]), "max_model_len": SERVED_CONTEXT,
                          "tokens": reference.encode(prompt), "token_strs": None}
        for add_special_tokens in (True, False):
            answer = tokenize(stack, model=MODEL, prompt=prompt, add_special_tokens=add_special_tokens,
                              return_token_strs=True)
            ids = reference.encode(prompt, add_special_tokens=add_special_tokens)
            assert answer["tokens"] == ids and answer["count"] == len(ids)
            assert answer["token_strs"] == [reference.tokenizer.id_to_token(token) for token in ids]
    assert reference.encode("Return the")[0] == reference.bos_token_id
    assert tokenize(stack, prompt="Return the", add_special_tokens=False)["tokens"][0] != reference.bos_token_id
    assert tokenize(stack, prompt="")["tokens"] == [reference.bos_token_id]
    assert tokenize(stack, prompt="", add_special_tokens=False) == {"count": 0, "max_model_len": SERVED_CONTEXT,
                                                                   "tokens": [], "token_strs": None}


def test_tokenize_counts_a_prompt_longer_than_the_context(stack, reference):
    prompt = "Return the value " * 200
    answer = tokenize(stack, prompt=prompt)
    assert answer["count"] == len(reference.encode(prompt)) > SERVED_CONTEXT
    assert answer["max_model_len"] == SERVED_CONTEXT


def test_tokenize_messages_as_chat_completions_render_them(stack, reference):
    answer = tokenize(stack, messages=CONVERSATION)
    ids = reference.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert answer["tokens"] == ids and answer["count"] == len(ids)
    chat = stack.client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=1)
    assert chat.usage.prompt_tokens == len(ids)
    without = tokenize(stack, messages=CONVERSATION, add_generation_prompt=False)["tokens"]
    assert without == reference.apply_chat_template(CONVERSATION, add_generation_prompt=False) and without != ids
    # The template writes its own BOS: add_special_tokens adds none on top of it.
    text = reference.render_chat(CONVERSATION, add_generation_prompt=True)
    assert tokenize(stack, messages=CONVERSATION, add_special_tokens=True)["tokens"] == reference.encode(text)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Sort "}, {"type": "text", "text": "a list"}]}]
    assert tokenize(stack, messages=parts)["tokens"] == reference.apply_chat_template(parts)


def test_detokenize_gives_the_text_with_its_special_tokens(stack, reference):
    bos_text = reference.tokenizer.id_to_token(reference.bos_token_id)
    for prompt in PROMPTS:
        ids = reference.encode(prompt)
        text = detokenize(stack, ids)
        expected = prompt if prompt.startswith(bos_text) else bos_text + prompt
        assert text == expected
        # /tokenize of the text gives the ids back (its BOS is not doubled)
        assert tokenize(stack, prompt=text)["tokens"] == ids
        assert tokenize(stack, prompt=text, add_special_tokens=False)["tokens"] == ids
        assert detokenize(stack, reference.encode(prompt, add_special_tokens=False)) == prompt
    assert detokenize(stack, []) == ""


def test_tokenizer_info_has_what_clients_read(stack, reference):
    response = stack.http.get("/tokenizer_info")
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/json")
    info = response.json()
    assert info["eos_token"] == info["bos_token"] == info["pad_token"] == "<|endoftext|>"
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["chat_template"] == reference.chat_template.source
    assert info["model_max_length"] == SERVED_CONTEXT
    assert info["clean_up_tokenization_spaces"] is False
    assert str(reference.tokenizer_path) not in json.dumps(info)
    # The eos token's id, as a remote-tokenizer client finds it: /tokenize of its string.
    assert tokenize(stack, prompt=info["eos_token"], add_special_tokens=False)["tokens"] == list(reference.eos_token_ids)[:1]


def test_the_context_length_where_clients_read_it(stack):
    models = stack.http.get("/v1/models").json()
    assert [card["max_model_len"] for card in models["data"]] == [SERVED_CONTEXT]
    assert stack.http.get(f"/v1/models/{MODEL}").json()["max_model_len"] == SERVED_CONTEXT
    assert stack.client.models.list().data[0].model_extra["max_model_len"] == SERVED_CONTEXT
    assert tokenize(stack, prompt="a")["max_model_len"] == SERVED_CONTEXT
    assert stack.http.get("/tokenizer_info").json()["model_max_length"] == SERVED_CONTEXT


def test_tokenizer_paths_are_counted_and_refuse_other_methods(stack):
    tokenize(stack, prompt="a")
    text = stack.http.get("/metrics").text
    assert 'metrale_requests_total{endpoint="/tokenize",status="200"}' in text
    for method, path in (("GET", "/tokenize"), ("GET", "/detokenize"), ("POST", "/tokenizer_info")):
        response = stack.http.request(method, path)
        assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"


def test_the_api_key_guards_the_tokenizer_paths():
    stack = Stack(in_process=True, api_key=API_KEY)
    try:
        with http_client(stack.url) as http:
            calls = [("POST", "/tokenize", {"prompt": "a"}), ("POST", "/detokenize", {"tokens": [1]}),
                     ("GET", "/tokenizer_info", None)]
            for method, path, body in calls:
                refused = http.request(method, path, json=body)
                assert refused.status_code == 401, refused.text
                assert refused.json()["error"]["code"] == "invalid_api_key"
                for headers in ({"authorization": f"Bearer {API_KEY}"}, {"x-api-key": API_KEY}):
                    assert http.request(method, path, json=body, headers=headers).status_code == 200
    finally:
        stack.close()


def test_text_offset_when_tokens_decode_otherwise_alone():
    """``text_offset`` with a SentencePiece-like decoder, which drops a token's leading space
    when it decodes the token alone, and a character split over two tokens."""
    from metrale.entrypoints.server import protocol as P
    from metrale.params import Logprob

    # The bytes of "▁The", "▁caf", "<0xC3>", "<0xA9>" (é split in two), "▁is" and "</s>" (special).
    raw = {1: b" The", 2: b" caf", 3: b"\xc3", 4: b"\xa9", 5: b" is", 6: b""}

    def decode(ids, skip_special_tokens):
        data = b"".join(raw[token] for token in ids if skip_special_tokens is False or token != 6)
        text = data.decode("utf-8", errors="replace")
        if not skip_special_tokens and 6 in ids:
            text += "</s>"
        return text.removeprefix(" ")  # the decoder drops the first token's space

    token_text = P.TokenText(lambda token: decode([token], False), lambda ids: decode(ids, True))
    ids = [1, 2, 3, 4, 5, 6]
    text = " The café is"
    entries = [{token: Logprob(-1.0, 1, None)} for token in ids]
    builder = P.CompletionLogprobs(0, token_text)
    logprobs = builder.piece(ids, entries, text=text)
    assert logprobs["tokens"] == ["The", "caf", "\ufffd", "\ufffd", "is", "</s>"]
    assert logprobs["text_offset"] == [1, 5, 8, 8, 10, 12]
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"]):
        if token not in ("\ufffd", "</s>"):
            assert text.startswith(token, offset)
    # One token at a time, as a stream sends them, its text growing (an incomplete character held
    # back, as the engine holds it): the same offsets.
    streamed = P.CompletionLogprobs(0, token_text)
    offsets = []
    for count, token in enumerate(ids, start=1):
        so_far = decode(ids[:count], True).removesuffix("\ufffd")
        offsets += streamed.piece([token], [entries[count - 1]], text=" " + so_far)["text_offset"]
    assert offsets == logprobs["text_offset"]
