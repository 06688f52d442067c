"""No structured output can take the server down or stall it: a ~100 KB chat request whose
``guided_grammar`` chains thousands of Lark rules (which crashes llguidance), a constraint over
the size limit, and schemas or grammars that admit no output all get a 400 naming the field,
``/health`` answers 200 all the while, and the server then serves, structured outputs included.
Through the engine process ``metrale serve`` runs and with the engine in the server's process."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")

from serverkit import MODEL, Stack, async_http_client  # noqa: E402

from metrale.structured.sandbox import MAX_CONSTRAINT_BYTES  # noqa: E402

pytestmark = pytest.mark.slow


def chained_rules(count: int) -> str:
    rules = ["start: r0"] + [f'r{i}: r{i + 1} "a"' for i in range(count)] + [f'r{count}: "b"']
    return "\n".join(rules)


def chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Name a sort."}], "max_tokens": 8,
            "temperature": 0, **extra}


BAD = [
    ("3,000 chained rules", chat(guided_grammar=chained_rules(3000)), "guided_grammar", "crashed the structured-output compiler"),
    ("6,000 chained rules", chat(guided_grammar=chained_rules(6000)), "guided_grammar", "crashed the structured-output compiler"),
    ("over the size limit", chat(guided_regex="a" * (MAX_CONSTRAINT_BYTES + 1)), "guided_regex",
     f"over the limit of {MAX_CONSTRAINT_BYTES} bytes"),
    ("a schema that refers to itself", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "loop", "schema": {"$ref": "#"}}}), "response_format", "admits no output"),
    ("a grammar without a sentence", chat(guided_grammar='start: x\nx: x "a"'), "guided_grammar", "admits no output"),
]


@pytest.fixture(scope="module", params=["engine process", "in process"])
def stack(request):
    stack = Stack(in_process=request.param == "in process")
    yield stack
    stack.close()


def test_no_structured_output_takes_the_server_down(stack):
    assert len(BAD[0][1]["guided_grammar"]) > 40_000

    async def run():
        async with async_http_client(stack.url) as client:
            health: list[int] = []
            done = asyncio.Event()

            async def watch_health():
                while not done.is_set():
                    health.append((await client.get("/health", timeout=5)).status_code)
                    await asyncio.sleep(0.02)

            watcher = asyncio.create_task(watch_health())
            try:
                answers = [await client.post("/v1/chat/completions", json=body) for _, body, _, _ in BAD]
            finally:
                done.set()
                await watcher
            return answers, health

    answers, health = asyncio.run(run())
    for (name, _, field, message), answer in zip(BAD, answers):
        assert answer.status_code == 400, (name, answer.text)
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == field, (name, error)
        assert message in error["message"], (name, error["message"])
    assert health and set(health) == {200}, health
    good = stack.http.post("/v1/chat/completions", json=chat(guided_choice=["quick", "merge"]))
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"] in ("quick", "merge")
    assert stack.http.get("/health").status_code == 200
