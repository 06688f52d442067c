"""The tokenizer's endpoints, as vLLM serves them (outside ``/v1``): ``POST /tokenize``,
``POST /detokenize`` and ``GET /tokenizer_info``.

They let a client that has only the server's address count and split tokens exactly as the
engine does -- an evaluation harness computing where a continuation starts in an echoed prompt,
a client fitting a prompt into ``max_model_len`` -- without the checkpoint's files.
``docs/serving.rst`` ("Tokenizer endpoints") lists their fields.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from starlette.responses import Response

from metrale.entrypoints.chat import read_special_tokens
from metrale.entrypoints.server import protocol as P
from metrale.entrypoints.server.checks import _chat_text, _check_model, _parse
from metrale.entrypoints.server.replies import _check_tools
from metrale.entrypoints.server.state import _json_response, _State
from metrale.errors import InvalidRequestError

#: ``tokenizer_config.json`` entries ``/tokenizer_info`` leaves out: file paths of the server's
#: machine, and the added-token table (as large as a vocabulary's special part; ``/tokenize``
#: answers for any token).
_PRIVATE_CONFIG_KEYS = frozenset({"vocab_file", "merges_file", "tokenizer_file", "name_or_path", "added_tokens_decoder"})


def _tokenizer(state: _State) -> Any:
    """The served tokenizer; a 400 when the checkpoint has none."""
    tokenizer = state.llm.tokenizer
    if tokenizer is None:
        raise P.APIError(400, f"this model has no tokenizer ({state.llm.tokenizer_path} has no tokenizer.json): "
                         "it takes and gives token ids only", code="tokenizer_missing")
    return tokenizer


def _served_model(state: _State, req: P.TokenizeRequest | P.DetokenizeRequest) -> None:
    """A ``model``, when given, must be the served model or one of its adapters (404 otherwise);
    they share the tokenizer."""
    if req.given("model"):
        _check_model(state, req)  # type: ignore[arg-type]


async def _tokenize(state: _State, request: Request) -> Response:
    """``POST /tokenize``: ``{"prompt"}`` or ``{"messages"}`` -> ``{"count", "max_model_len",
    "tokens", "token_strs"}``."""
    req: P.TokenizeRequest = await _parse(request, P.TokenizeRequest)  # type: ignore[arg-type]
    _served_model(state, req)
    given_prompt, given_messages = req.given("prompt"), req.given("messages")
    if given_prompt == given_messages:
        raise P.APIError(400, "give either prompt (a text) or messages (a conversation)" if not given_prompt
                         else "give prompt or messages, not both", param="messages" if given_prompt else "prompt")
    tokenizer = _tokenizer(state)
    if given_prompt:
        if not isinstance(req.prompt, str):
            raise P.APIError(400, f"prompt must be a string, got {P.clip(req.prompt)}", param="prompt")
        text, param = req.prompt, "prompt"
        add_special_tokens = req.add_special_tokens if req.add_special_tokens is not None else True
    else:
        _check_tools(req)  # type: ignore[arg-type]
        text, param = _chat_text(state, req), "messages"
        # The chat template writes the special tokens it wants; vLLM adds none by default either.
        add_special_tokens = req.add_special_tokens if req.add_special_tokens is not None else False
    try:
        if text:
            ids = state.llm.encode(text, add_special_tokens=add_special_tokens)
        else:  # nothing to encode but what the tokenizer adds around any text
            ids = list(tokenizer.encode("", add_special_tokens=add_special_tokens).ids)
    except InvalidRequestError as error:
        raise P.APIError(400, f"{param}: {error}", param=param) from None
    token_strs = [tokenizer.id_to_token(token) or "" for token in ids] if req.return_token_strs else None
    return _json_response({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                           "token_strs": token_strs})


async def _detokenize(state: _State, request: Request) -> Response:
    """``POST /detokenize``: ``{"tokens"}`` -> ``{"prompt"}``, the text with its special tokens
    (as vLLM decodes it, so that ``/tokenize`` of it gives the ids back)."""
    req: P.DetokenizeRequest = await _parse(request, P.DetokenizeRequest)  # type: ignore[arg-type]
    _served_model(state, req)
    tokenizer = _tokenizer(state)
    bad = [token for token in req.tokens if not 0 <= token < state.vocab_size]
    if bad:
        raise P.APIError(400, f"tokens holds token id {bad[0]}, outside the vocabulary [0, {state.vocab_size})",
                         param="tokens")
    return _json_response({"prompt": tokenizer.decode(list(req.tokens), skip_special_tokens=False)})


async def _tokenizer_info(state: _State, request: Request) -> Response:
    """``GET /tokenizer_info``: the tokenizer's settings (see :func:`tokenizer_info`)."""
    if state.llm.tokenizer is None:
        raise P.APIError(404, f"this model has no tokenizer ({state.llm.tokenizer_path} has no tokenizer.json)",
                         code="tokenizer_missing")
    if state.tokenizer_info is None:
        state.tokenizer_info = tokenizer_info(state)
    return _json_response(state.tokenizer_info)


def tokenizer_info(state: _State) -> dict[str, Any]:
    """What ``GET /tokenizer_info`` answers, as vLLM's: ``tokenizer_config.json``'s settings
    (without file paths and the added-token table), each special token as its string
    (``bos_token``, ``eos_token``, ``pad_token``, ...), ``tokenizer_class``, the chat template
    requests are rendered with (``chat_template``, absent when there is none) and
    ``model_max_length``, the served context (``max_model_len``)."""
    llm = state.llm
    config_path = llm.tokenizer_path / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        loaded = json.loads(config_path.read_text(encoding="utf-8"))
        if isinstance(loaded, dict):
            config = loaded
    info = {key: _plain_token(value) for key, value in config.items() if key not in _PRIVATE_CONFIG_KEYS}
    info.update(read_special_tokens(llm.tokenizer_path))
    tokenizer = llm.tokenizer
    for name, token_id in (("eos_token", llm.eos_token_ids[0] if llm.eos_token_ids else None),
                           ("bos_token", llm.bos_token_id)):
        if info.get(name) is None and token_id is not None:
            info[name] = tokenizer.id_to_token(token_id)
    info["tokenizer_class"] = info.get("tokenizer_class") or "PreTrainedTokenizerFast"
    info.pop("chat_template", None)
    if llm.chat_template is not None:
        info["chat_template"] = llm.chat_template.source
    info["model_max_length"] = state.max_model_len
    return info


def _plain_token(value: Any) -> Any:
    """A serialised ``AddedToken`` (``{"content": ..., "__type": "AddedToken"}``) as its string;
    any other value as it is."""
    if isinstance(value, dict) and value.get("__type") == "AddedToken" and isinstance(value.get("content"), str):
        return value["content"]
    return value
