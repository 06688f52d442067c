"""``metrale chat``: each reply, local or from a server at ``--url``, is the model's greedy reply
to the conversation so far as ``LLM.chat`` and the chat-completions endpoint give it; ``/reset``
forgets the conversation; ``/exit`` and the end of the input end it; a failed reply is reported
and the conversation goes on."""

from __future__ import annotations

import io

import pytest
from serverkit import MODEL, Stack

from metrale import LLM, SamplingParams
from metrale.entrypoints.chat_cli import run_chat
from metrale.entrypoints.cli import build_parser

TURNS = ["Hello there", "What does a list hold?", "And a dict?"]


def chat(argv, lines):
    args = build_parser().parse_args(["chat", *argv])
    out = io.StringIO()
    status = run_chat(args, stdin=io.StringIO("".join(line + "\n" for line in lines)), stdout=out)
    return status, out.getvalue()


def expected_replies(turns, max_tokens, system=None):
    """The greedy reply to each turn of the conversation, each through ``LLM.chat``."""
    llm = LLM(MODEL, device="cpu", show_progress=False)
    messages = [{"role": "system", "content": system}] if system else []
    replies = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        reply = llm.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)[0].text
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return replies


def test_local_replies_are_the_conversation_s(monkeypatch):
    status, printed = chat(["--model", MODEL, "--device", "cpu", "--max-tokens", "8", "--temperature", "0",
                            "--system", "Be brief."], TURNS)
    assert status == 0
    assert printed == "".join(reply + "\n" for reply in expected_replies(TURNS, 8, system="Be brief."))


def test_reset_forgets_and_exit_ends():
    status, printed = chat(["--model", MODEL, "--device", "cpu", "--max-tokens", "8", "--temperature", "0"],
                           [TURNS[0], "", "/reset", TURNS[1], "/exit", TURNS[2]])
    assert status == 0
    # The second turn answered as a first turn; nothing after /exit.
    assert printed == expected_replies([TURNS[0]], 8)[0] + "\n" + expected_replies([TURNS[1]], 8)[0] + "\n"


@pytest.fixture(scope="module")
def stack():
    served = Stack(in_process=True)
    yield served
    served.close()


def test_replies_from_a_server_are_its_chat_completions(stack):
    status, printed = chat(["--url", stack.url, "--max-tokens", "8", "--temperature", "0"], TURNS[:2])
    assert status == 0
    messages, replies = [], []
    for turn in TURNS[:2]:
        messages.append({"role": "user", "content": turn})
        reply = stack.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                     temperature=0).choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
    assert printed == "".join(reply + "\n" for reply in replies)


def test_a_refused_reply_is_reported_and_the_conversation_goes_on(stack, capsys):
    status, _ = chat(["--url", stack.url, "--served-model-name", "no-such-model", "--max-tokens", "4"], TURNS[:2])
    assert status == 0
    assert capsys.readouterr().err.count("metrale: error:") == 2


def test_an_unreachable_server_is_a_typed_error():
    from metrale.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot reach"):
        chat(["--url", "http://127.0.0.1:9"], TURNS[:1])
