"""A checkpoint without tokenizer.json served (in an engine process and in process): token-id
prompts run; stop strings, which are looked for in the decoded text and so would never fire, are
a 400 naming them, streamed or not; the server goes on serving."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from serverkit import ServerThread, http_client  # noqa: E402

from metrale.entrypoints.async_llm import AsyncLLM  # noqa: E402
from metrale.entrypoints.engine_process import EngineProcess  # noqa: E402
from metrale.entrypoints.server import build_app  # noqa: E402

NAME = "llama-without-tokenizer"


@pytest.fixture(scope="module", params=[False, True], ids=["engine-process", "in-process"])
def served(request, dense_checkpoints):
    path = dense_checkpoints["llama"]
    assert not (path / "tokenizer.json").exists()
    options = dict(device="cpu", show_progress=False)
    engine = AsyncLLM(path, **options) if request.param else EngineProcess(path, **options)
    try:
        server = ServerThread(build_app(engine, model_name=NAME)).start()
    except BaseException:
        engine.shutdown()
        raise
    http = http_client(server.url)
    yield http
    http.close()
    try:
        server.stop()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_are_a_400_naming_them(served, stream):
    body = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 3, "stream": stream}
    response = served.post("/v1/completions", json={**body, "stop": ["x", "yz"]})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "stop=['x', 'yz']" in message and "tokenizer.json" in message
    answer = served.post("/v1/completions", json={**body, "stream": False, "stop_token_ids": [7]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == 3


def test_the_tokenizer_endpoints_say_there_is_none(served):
    for method, path, body, status in (("POST", "/tokenize", {"prompt": "a"}, 400),
                                       ("POST", "/tokenize", {"messages": [{"role": "user", "content": "a"}]}, 400),
                                       ("POST", "/detokenize", {"tokens": [1, 2]}, 400),
                                       ("GET", "/tokenizer_info", None, 404)):
        response = served.request(method, path, json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["code"] == "tokenizer_missing" and "tokenizer.json" in error["message"]


def test_token_id_prompts_are_scored(served):
    body = {"model": NAME, "prompt": [1, 2, 3, 4], "max_tokens": 0, "echo": True, "logprobs": 0}
    answer = served.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    answer = answer.json()
    assert answer["usage"]["completion_tokens"] == 0
    logprobs = answer["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["token_id:1", "token_id:2", "token_id:3", "token_id:4"]
    assert logprobs["token_logprobs"][0] is None and all(v <= 0 for v in logprobs["token_logprobs"][1:])
