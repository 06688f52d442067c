"""Anthropic's Messages API on the wire: the request models of ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``, the ids, the server-sent events, and the error shape
``{"type": "error", "error": {"type", "message"}}`` (``docs/serving.rst``, "Anthropic Messages
API").

Errors are made once, in the server's own shape (:class:`~metrale.entrypoints.server.protocol.APIError`),
wherever they arise -- the API-key and body-size gate, the router, the handlers -- and
:func:`anthropic_errors` translates those of the Anthropic paths as they are sent, so that no
error source answers an Anthropic client in OpenAI's shape.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.types import Message, Send

from metrale.entrypoints.server import protocol as P

#: The paths served in Anthropic's shape (the path itself and everything under it).
ANTHROPIC_PATH = "/v1/messages"

#: Anthropic's error type for each HTTP status this server answers with (other 4xx:
#: ``invalid_request_error``, other 5xx: ``api_error``).
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}
#: Anthropic's status for an overloaded server (the server answers 503 on its OpenAI paths).
OVERLOADED_STATUS = 529


def is_anthropic_path(path: str) -> bool:
    """Whether ``path`` is answered in Anthropic's shape."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


# ---------------------------------------------------------------------------------- requests


class _AnthropicModel(BaseModel):
    # As the OpenAI models: types checked strictly, fields not named accepted and ignored.
    model_config = ConfigDict(extra="allow", strict=True)

    def given(self, name: str) -> bool:
        """Whether the request set ``name`` to something other than null."""
        return name in self.model_fields_set and getattr(self, name) is not None


class CountTokensRequest(_AnthropicModel):
    """The body of ``/v1/messages/count_tokens``: what makes the prompt. The values' shapes are
    checked where they become chat messages and tools, so that a bad one is named by its
    place (``messages[1].content[0]``)."""

    model: str
    messages: Any
    system: Any = None
    tools: Any = None
    tool_choice: Any = None
    thinking: Any = None


class MessagesRequest(CountTokensRequest):
    """The body of ``/v1/messages``: the prompt's fields and the sampling ones."""

    max_tokens: int
    stop_sequences: Any = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    metadata: Any = None


# --------------------------------------------------------------------------------- responses


def new_message_id() -> str:
    """A fresh message id, ``msg_`` and 32 hex digits."""
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id(call_id: str) -> str:
    """The ``toolu_`` id of the tool call the server's parsers named ``call_...``."""
    return "toolu_" + call_id.removeprefix("call_")


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    """A message's ``usage``."""
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def message(message_id: str, model: str, content: list[dict[str, Any]], stop_reason: str | None,
            stop_sequence: str | None, used: dict[str, int]) -> dict[str, Any]:
    """A message object: the whole answer, or (content empty, no stop reason) the one a stream
    starts with."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": used}


def event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event as Anthropic sends it: ``event: NAME``, ``data: {json}`` (whose
    ``type`` is ``NAME``) and a blank line. Anthropic's SDKs skip events without the
    ``event:`` line."""
    return b"event: " + name.encode("ascii") + b"\ndata: " + P.dumps({"type": name, **data}) + b"\n\n"


# ------------------------------------------------------------------------------------ errors


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` for an error of ``status``."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def translate_error(error: P.APIError) -> tuple[int, dict[str, Any]]:
    """The status and the body an Anthropic client gets for ``error``: a 503 (the engine's queue
    is full, the server is shutting down) is Anthropic's 529 ``overloaded_error``, which its
    clients retry; every other status is kept."""
    status = OVERLOADED_STATUS if error.status == 503 else error.status
    return status, error_body(status, error.message)


def error_event(error: P.APIError) -> bytes:
    """The ``error`` event of a stream that fails once it has started."""
    _, body = translate_error(error)
    return event("error", {"error": body["error"]})


def _openai_error(status: int, raw: bytes) -> P.APIError | None:
    """The error an OpenAI-shaped error body holds, or None for any other body (an Anthropic
    one is left as it is)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    inner = data.get("error") if isinstance(data, dict) and "type" not in data else None
    if not isinstance(inner, dict) or not isinstance(inner.get("message"), str):
        return None
    return P.APIError(status, inner["message"])


def anthropic_errors(send: Send) -> Send:
    """``send`` for a request on an Anthropic path: an error response (status 400 and up, a JSON
    body) is held until its body is complete and sent in Anthropic's shape and status
    (:func:`translate_error`), its other headers kept; every other response passes as it is, a
    stream included."""
    held: Message | None = None
    body = bytearray()

    async def translated(message: Message) -> None:
        nonlocal held
        if message["type"] == "http.response.start":
            types = [bytes(v) for k, v in message.get("headers", []) if bytes(k).lower() == b"content-type"]
            if int(message["status"]) >= 400 and types and types[0].startswith(b"application/json"):
                held = message
                return
        elif message["type"] == "http.response.body" and held is not None:
            body.extend(message.get("body", b""))
            if message.get("more_body", False):
                return
            start, held = held, None
            status, raw = int(start["status"]), bytes(body)
            error = _openai_error(status, raw)
            if error is not None:
                status, data = translate_error(error)
                raw = P.dumps(data)
            headers = [(k, v) for k, v in start.get("headers", []) if bytes(k).lower() != b"content-length"]
            headers.append((b"content-length", str(len(raw)).encode("ascii")))
            await send({**start, "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": raw})
            return
        await send(message)

    return translated
