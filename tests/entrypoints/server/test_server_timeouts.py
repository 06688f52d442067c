"""Slow and silent clients hold nothing for long: a request head that does not arrive closes its
connection (``header_timeout``), a body that stalls gets 408 (``body_timeout``), a stream whose
client stops reading is cut and its engine requests aborted (``stream_idle_timeout``); the
server goes on serving and holds no request afterwards. Raw sockets play the clients."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")

from serverkit import MODEL, Stack, idle_report, wait_idle  # noqa: E402

HEADER_TIMEOUT = 0.5
BODY_TIMEOUT = 0.5
STREAM_IDLE_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def stack():
    stack = Stack(body_timeout=BODY_TIMEOUT,
                  server_options={"header_timeout": HEADER_TIMEOUT, "stream_idle_timeout": STREAM_IDLE_TIMEOUT})
    yield stack
    stack.close()


def connect(stack: Stack, receive_buffer: int | None = None) -> socket.socket:
    sock = socket.socket()
    if receive_buffer is not None:  # set before connecting: it bounds the window the server may fill
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", stack.thread.port))
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    data = bytearray()
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return bytes(data)


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One response of a kept-alive connection: its status line and its body (by its Content-Length)."""
    data = bytearray()
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed mid-response: {bytes(data)!r}"
        data += chunk
    top, _, body = bytes(data).partition(b"\r\n\r\n")
    length = int(re.search(rb"(?im)^content-length: *(\d+)", top).group(1))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed mid-body"
        body += chunk
    return top.split(b"\r\n")[0], body


def head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def assert_still_serving(stack: Stack) -> None:
    answer = stack.http.post("/v1/completions", json={"model": MODEL, "prompt": "Return the", "max_tokens": 3})
    assert answer.status_code == 200, answer.text
    values = wait_idle(stack.http)
    assert all(values.get(name) == 0 for name in idle_report(values)), idle_report(values)


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Le"],
                         ids=["nothing", "half a head"])
def test_a_request_head_that_does_not_arrive_closes_the_connection(stack, sent):
    with connect(stack) as sock:
        start = time.monotonic()
        sock.sendall(sent)
        assert read_until_closed(sock) == b""
        elapsed = time.monotonic() - start
    assert HEADER_TIMEOUT * 0.8 <= elapsed < HEADER_TIMEOUT + 2, elapsed
    assert_still_serving(stack)


def test_a_kept_alive_connection_outlives_the_header_timeout(stack):
    """The head timer counts from each head's first byte: a connection that sends whole
    requests, each answered, stays usable past the header timeout."""
    body = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 1}).encode()
    with connect(stack) as sock:
        for _ in range(3):
            sock.sendall(head("/v1/completions", len(body)) + body)
            status, answer = read_response(sock)
            assert status.startswith(b"HTTP/1.1 200"), (status, answer)
            time.sleep(HEADER_TIMEOUT * 0.6)


def test_a_body_that_stalls_gets_408_and_its_connection_closed(stack):
    body = json.dumps({"model": MODEL, "prompt": "Return the", "max_tokens": 3}).encode()
    with connect(stack) as sock:
        start = time.monotonic()
        sock.sendall(head("/v1/completions", len(body)) + body[:10])
        answer = read_until_closed(sock)
        elapsed = time.monotonic() - start
    assert BODY_TIMEOUT * 0.8 <= elapsed < BODY_TIMEOUT + 2, elapsed
    status, _, rest = answer.partition(b"\r\n")
    headers, _, payload = rest.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"connection: close" in headers.lower()
    error = json.loads(payload)["error"]
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
    assert "did not arrive within 0.5 s (10 bytes came)" in error["message"]
    assert_still_serving(stack)


def aborted(stack: Stack) -> float:
    text = stack.http.get("/metrics").text
    match = re.search(r'^metrale_request_finish_total\{endpoint="/v1/completions",finish_reason="abort"\} (\S+)$', text,
                      re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_a_stream_whose_client_stops_reading_is_cut_and_its_requests_aborted(stack):
    # Small buffers on both ends (the server's accepted sockets inherit its listening socket's),
    # so that the server's writes block after a few kilobytes instead of the system's megabytes.
    for listening in stack.thread.sockets:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    prompts = 8
    body = json.dumps({"model": MODEL, "prompt": ["Return the"] * prompts, "max_tokens": 1000, "ignore_eos": True,
                       "logprobs": 5, "stream": True}).encode()
    before = aborted(stack)
    with connect(stack, receive_buffer=4096) as sock:
        start = time.monotonic()
        sock.sendall(head("/v1/completions", len(body)) + body)
        deadline = start + 20
        while aborted(stack) < before + prompts and time.monotonic() < deadline:
            time.sleep(0.05)
        elapsed = time.monotonic() - start
        received = read_until_closed(sock)  # the connection is closed: what was sent, then the end
    assert aborted(stack) == before + prompts
    # The server blocked within a second; 8,000 tokens would take far longer than the idle timeout.
    assert STREAM_IDLE_TIMEOUT <= elapsed < STREAM_IDLE_TIMEOUT + 4, elapsed
    assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
    assert_still_serving(stack)
