"""The ASGI middleware in front of every route (:class:`_Gate`): the API key, checked in constant
time, the body-size limit, from ``Content-Length`` and from the bytes that arrive, and the time
the body may take to arrive."""

from __future__ import annotations

import asyncio
import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metrale.entrypoints.server import protocol as P
from metrale.entrypoints.server.anthropic_protocol import anthropic_errors, is_anthropic_path
from metrale.entrypoints.server.state import TOKENIZER_PATHS, _endpoint, _State, _unavailable

# ------------------------------------------------------------------------------- middleware


class _Gate:
    """Pure ASGI middleware in front of every HTTP request: counts it
    (``metrale_requests_total``), checks the API key on ``/v1`` paths and the tokenizer's
    (``/tokenize``, ``/detokenize``, ``/tokenizer_info``), refuses new requests to them while the
    server drains, and reads the whole body with a size limit (the declared
    ``Content-Length`` first, then the bytes actually received, so a chunked upload cannot
    pass it) and a time limit (``body_timeout``: 408, and the connection closed, for a body
    still incomplete then) before the app sees it."""

    def __init__(self, app: ASGIApp, state: _State) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = self.state
        status: int | None = None

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        state.in_progress += 1
        try:
            await self._handle(scope, receive, counted)
        except BaseException:
            if status is None:
                status = 500
            raise
        finally:
            state.in_progress -= 1
            state.metrics.requests.labels(_endpoint(scope.get("path", "")), str(status if status is not None else 499)).inc()

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        path = scope.get("path", "")
        if is_anthropic_path(path):
            send = anthropic_errors(send)  # every error of these paths, the gate's included, in Anthropic's shape
        headers = _headers(scope)
        if path == "/v1" or path.startswith("/v1/") or path in TOKENIZER_PATHS:
            if state.api_key is not None and not _authorized(headers, state.api_key):
                await _send_error(send, P.APIError(
                    401, "missing or wrong API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                    type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
                return
            if state.draining:
                await _send_error(send, _unavailable("the server is shutting down; it takes no new requests",
                                                     "service_unavailable"))
                return
        declared = headers.get(b"content-length")
        too_big = False
        if declared is not None:
            if not declared.strip().isdigit():
                await _send_error(send, P.APIError(400, "the Content-Length header is not a number"))
                return
            too_big = int(declared) > state.max_body_bytes
        body = bytearray()
        received = 0
        # A body over the limit is read (and dropped) up to a bound, so that the client can
        # finish sending and read the 413; a body declared past that bound is answered at once
        # (and the connection closed after the answer).
        discard_limit = 4 * state.max_body_bytes
        loop = asyncio.get_running_loop()
        deadline = loop.time() + state.body_timeout
        while not (too_big and declared is not None and int(declared) > discard_limit):
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                await _send_error(send, P.APIError(
                    408, f"the request body did not arrive within {state.body_timeout:g} s ({received} bytes came)",
                    code="request_timeout", headers={"Connection": "close"}))
                return
            if message["type"] == "http.disconnect":
                return
            if message["type"] != "http.request":
                continue
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > state.max_body_bytes:
                too_big = True
            if not too_big:
                body += chunk
            if not message.get("more_body", False) or received > discard_limit:
                break
        if too_big:
            await _send_error(send, P.APIError(
                413, f"the request body is larger than this server accepts ({state.max_body_bytes} bytes)",
                code="request_too_large"))
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _headers(scope: Scope) -> dict[bytes, bytes]:
    found: dict[bytes, bytes] = {}
    for name, value in scope.get("headers", []):
        found.setdefault(bytes(name).lower(), bytes(value))
    return found


def _authorized(headers: dict[bytes, bytes], key: bytes) -> bool:
    """Whether the request carries the key (``Authorization: Bearer KEY`` or ``x-api-key: KEY``),
    compared in constant time."""
    given = []
    authorization = headers.get(b"authorization")
    if authorization is not None:
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() == b"bearer":
            given.append(token.strip())
    if b"x-api-key" in headers:
        given.append(headers[b"x-api-key"].strip())
    ok = False
    for token in given:
        ok |= hmac.compare_digest(token, key)
    return ok


async def _send_error(send: Send, error: P.APIError) -> None:
    body = P.dumps(error.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


