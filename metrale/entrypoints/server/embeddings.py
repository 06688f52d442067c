"""``POST /v1/embeddings``: OpenAI's embeddings endpoint, with vLLM's extensions.

Each input becomes one pooling request (:mod:`metrale.engine.pooling`) submitted to the same
engine as the generation requests, which batches them all; the answer waits for every vector.
The pooling is the model's default (last token, normalized, unless the checkpoint's
sentence-transformers configuration says otherwise: :func:`~metrale.entrypoints.frontend.pooling_defaults`)
or what ``pooling_type`` and ``normalize`` ask for. ``docs/serving.rst`` ("Embeddings") lists the
fields and statuses.
"""

from __future__ import annotations

import sys
from typing import Any

from fastapi import Request
from starlette.responses import Response

from metrale.entrypoints.server import protocol as P
from metrale.entrypoints.server.checks import _check_model, _completion_prompts, _parse
from metrale.entrypoints.server.jobs import _ClientGone, _collect, _PoolingJob
from metrale.entrypoints.server.state import MAX_EMBEDDING_INPUTS, _json_response, _State, _unavailable
from metrale.params import PoolingParams

#: ``encoding_format`` values served: JSON numbers, or the base64 of little-endian float32 bytes.
ENCODING_FORMATS = ("float", "base64")
#: ``pooling_type`` values served (vLLM's names, any case) and the pooling each selects.
POOLING_TYPES = {"last": "last", "mean": "mean"}


async def _embeddings(state: _State, request: Request) -> Response:
    """``POST /v1/embeddings``: ``{"model", "input", ...}`` -> ``{"object": "list", "data": [{"object":
    "embedding", "index", "embedding"}], "model", "usage"}``."""
    req: P.EmbeddingRequest = await _parse(request, P.EmbeddingRequest)  # type: ignore[arg-type]
    if _check_model(state, req) is not None:  # type: ignore[arg-type]
        raise P.APIError(400, f"embeddings are computed by the base model: the LoRA adapter {P.clip(req.model)} serves "
                         f"no /v1/embeddings (ask for {state.model_name!r})", param="model", code="adapter_not_supported")
    if state.llm.pooling_unavailable is not None:
        raise P.APIError(400, f"this server's model serves no embeddings: {state.llm.pooling_unavailable}", param="model",
                         code="embeddings_not_supported")
    encoding_format = _encoding_format(req)
    _check_dimensions(state, req)
    keep_last = _truncation(state, req)
    pooling = None
    if req.given("pooling_type"):
        pooling = POOLING_TYPES.get(req.pooling_type.lower())  # type: ignore[union-attr]
        if pooling is None:
            raise P.APIError(400, f"pooling_type must be LAST or MEAN, got {P.clip(req.pooling_type)}", param="pooling_type")
    params = PoolingParams(pooling, req.normalize)
    add_special_tokens = req.add_special_tokens if req.add_special_tokens is not None else True
    prompts = _completion_prompts(state, req.input, add_special_tokens, param="input", max_prompts=MAX_EMBEDDING_INPUTS,
                                  keep_last=keep_last)
    response_id, created = P.new_id("embd"), P.now()
    job = _PoolingJob(state, "/v1/embeddings", prompts, [params] * len(prompts), response_id)
    job.submit()
    try:
        job.watch(request)
        try:
            outputs: dict[int, Any] = await _collect(job)  # EmbeddingRequestOutputs, one per prompt
        except _ClientGone:
            return Response(status_code=499)
        data = []
        for index in range(len(prompts)):
            output = outputs[index]
            if output.error is not None:
                raise P.APIError(500, f"the request could not be completed: {output.error}", type="server_error",
                                 code="engine_error")
            if not output.outputs.embedding:
                raise _unavailable("the request was aborted: the server is shutting down", "service_unavailable")
            data.append(P.embedding_data(index, output.outputs.embedding, encoding_format))
        used = sum(len(ids) for _, ids in prompts)
        return _json_response(P.embedding_response(response_id, created, req.model, data, used))
    except BaseException:
        job.close()
        raise


def _encoding_format(req: P.EmbeddingRequest) -> str:
    """The request's ``encoding_format`` (default ``"float"``), its vLLM ``embed_dtype`` and
    ``endianness`` checked: the bytes of base64 are little-endian float32, nothing else."""
    encoding_format = req.encoding_format if req.given("encoding_format") else "float"
    if encoding_format not in ENCODING_FORMATS:
        raise P.APIError(400, f"encoding_format must be 'float' or 'base64', got {P.clip(encoding_format)}",
                         param="encoding_format")
    if req.given("embed_dtype") and req.embed_dtype != "float32":
        raise P.APIError(400, f"embed_dtype must be 'float32' (the only one served), got {P.clip(req.embed_dtype)}",
                         param="embed_dtype")
    little = ("little", "native") if sys.byteorder == "little" else ("little",)
    if req.given("endianness") and req.endianness not in little:
        raise P.APIError(400, f"endianness must be 'little' (base64 holds little-endian float32), got "
                         f"{P.clip(req.endianness)}", param="endianness")
    return encoding_format


def _check_dimensions(state: _State, req: P.EmbeddingRequest) -> None:
    """``dimensions`` is served only as the model's own size (no Matryoshka truncation)."""
    if not req.given("dimensions"):
        return
    size = state.llm.embedding_size
    if req.dimensions != size:
        raise P.APIError(400, f"dimensions must be this model's embedding size, {size} (shortened embeddings are not "
                         f"served), got {req.dimensions}", param="dimensions")


def _truncation(state: _State, req: P.EmbeddingRequest) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: each input keeps its last that many tokens (-1: the
    model's context); None when not given."""
    if not req.given("truncate_prompt_tokens"):
        return None
    value = req.truncate_prompt_tokens
    assert value is not None
    if value == -1:
        return state.max_model_len
    if not 1 <= value <= state.max_model_len:
        raise P.APIError(400, f"truncate_prompt_tokens must be -1 (the model's context) or between 1 and the model's "
                         f"context of {state.max_model_len}, got {value}", param="truncate_prompt_tokens")
    return value
