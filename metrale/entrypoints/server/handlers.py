"""The completions and chat completions handlers, streamed (server-sent events) and not."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from fastapi import Request
from starlette.responses import Response

from metrale.entrypoints.server import protocol as P
from metrale.entrypoints.server.checks import (
    _chat_prompt,
    _check_logprobs_count,
    _check_model,
    _check_n,
    _check_structured_output,
    _completion_prompts,
    _params_for_prompt,
    _parse,
    _sampling_options,
    _structured,
)
from metrale.entrypoints.server.jobs import _Choice, _ClientGone, _collect, _EventStream, _failure, _Job
from metrale.entrypoints.server.replies import _constrain, _Reply, _reply_format, _ReplyFormat
from metrale.entrypoints.server.state import COMPLETION_DEFAULT_MAX_TOKENS, _error_response, _json_response, _State, _unavailable
from metrale.errors import EngineBusyError, EngineClosedError, InvalidRequestError, MetraleError, QueueFullError
from metrale.params import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------ the handlers


def _stream_flags(req: P.SamplingRequest) -> tuple[bool, bool]:
    stream = bool(req.stream)
    include_usage = bool(req.stream_options is not None and req.stream_options.include_usage)
    if req.given("stream_options") and not stream:
        raise P.APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    return stream, include_usage


async def _completions(state: _State, request: Request) -> Response:
    req: P.CompletionRequest = await _parse(request, P.CompletionRequest)
    lora = _check_model(state, req)
    if req.given("suffix"):
        raise P.APIError(400, "suffix is not supported", param="suffix")
    n = _check_n(state, req)
    if req.given("best_of") and req.best_of != n:
        raise P.APIError(400, "best_of is not supported (other than equal to n)", param="best_of")
    stream, include_usage = _stream_flags(req)
    k = _check_logprobs_count(state, "logprobs", req.logprobs) if req.given("logprobs") else None
    echo = bool(req.echo)
    # OpenAI's prompt scoring: echo with max_tokens 0 returns the prompt (and its logprobs) alone.
    # The engine still runs one token, which the answer leaves out.
    prompt_only = echo and req.max_tokens == 0
    add_special_tokens = req.add_special_tokens if req.add_special_tokens is not None else True
    prompts = _completion_prompts(state, req.prompt, add_special_tokens)
    options = _sampling_options(state, req, n=n, logprobs=k, logprobs_param="logprobs")
    await _check_structured_output(state, req, options)
    asked_prompt_logprobs = options.get("prompt_logprobs")
    if echo and k is not None:
        options["prompt_logprobs"] = max(k, asked_prompt_logprobs or 0)
    default = state.llm.sampling_defaults.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    max_tokens = 1 if prompt_only else req.max_tokens
    params = [_params_for_prompt(state, options, len(ids), max_tokens, "max_tokens", default, "prompt")
              for _, ids in prompts]
    response_id, created = P.new_id("cmpl"), P.now()
    job = _Job(state, "/v1/completions", prompts, params, response_id, lora)
    job.submit()
    try:
        echo_texts = [text if text is not None else _decode(state, ids) for text, ids in prompts] if echo else []
        context = _CompletionContext(state, req.model, response_id, created, n, k, echo, echo_texts, asked_prompt_logprobs,
                                     include_usage, prompt_only)
        job.watch(request)
        if stream:
            return _EventStream(_events(job, context), job)
        try:
            outputs = await _collect(job)
        except _ClientGone:
            return Response(status_code=499)
        return _json_response(context.response(job, outputs))
    except BaseException:
        job.close()
        raise


def _decode(state: _State, ids: list[int]) -> str:
    try:
        return state.llm.decode(ids)
    except MetraleError:
        return ""


class _Context:
    """What a response is built from: the request's model, id, ``n``, logprobs count ``k`` and
    whether its stream ends with the usage. A subclass per endpoint; :func:`_events`, the one
    stream loop, asks it only for what differs between them: the chunk object, the choices sent
    before any output, what a choice's first piece starts with, the new tokens' logprobs, and
    the choice's JSON."""

    #: The endpoint, as the log names it.
    name = ""

    def __init__(self, state: _State, model: str, response_id: str, created: int, n: int, k: int | None,
                 include_usage: bool) -> None:
        self.state = state
        self.model = model
        self.id = response_id
        self.created = created
        self.n = n
        self.k = k
        self.include_usage = include_usage

    def chunk(self, choices: list[dict], used: dict | None = None) -> dict:
        """One chunk of the stream (``used``: the usage of its last one)."""
        raise NotImplementedError

    def opening(self) -> list[dict]:
        """The choices sent before any output, one chunk each."""
        return []

    def prefix(self, index: int) -> str:
        """The text a choice of prompt ``index`` starts with, before its first token."""
        return ""

    def prompt_logprobs_json(self, output: RequestOutput) -> list | None:
        """The prompt logprobs a choice's first piece carries, or None."""
        return None

    def shown(self, output: RequestOutput) -> RequestOutput:
        """``output`` as the answer shows it."""
        return output

    def new_logprobs(self, choice: _Choice, output: RequestOutput, completion: CompletionOutput,
                     first: bool) -> dict | None:
        """The logprobs of ``completion``'s tokens past the ``choice.tokens`` sent (None when
        none are asked for or none is new)."""
        raise NotImplementedError

    def payload(self, choice: _Choice, completion: CompletionOutput, delta: str) -> Any:
        """What a chunk of ``choice`` carries of its reply, from its new text ``delta`` and its
        latest ``completion``: the text itself by default; None when there is nothing new."""
        return delta or None

    def delta_choice(self, choice: _Choice, index: int, payload: Any, logprobs: dict | None, finish: str | None,
                     reason: str | int | None, prompt_logprobs: list | None) -> dict:
        """Choice ``index`` of a chunk: its new ``payload`` (:meth:`payload`), logprobs and finish."""
        raise NotImplementedError


class _CompletionContext(_Context):
    """What the completions responses are built from."""

    name = "completions"

    def __init__(self, state: _State, model: str, response_id: str, created: int, n: int, k: int | None, echo: bool,
                 echo_texts: list[str], prompt_logprobs: int | None, include_usage: bool, prompt_only: bool = False) -> None:
        super().__init__(state, model, response_id, created, n, k, include_usage)
        self.echo = echo
        self.echo_texts = echo_texts
        self.prompt_logprobs = prompt_logprobs
        #: ``max_tokens: 0`` with ``echo``: the answer holds the prompt alone.
        self.prompt_only = prompt_only

    def shown(self, output: RequestOutput) -> RequestOutput:
        """``output`` without its generated token when the request asked for the prompt alone:
        no text, no tokens, and (once finished) ``finish_reason`` ``"length"``, the 0 tokens
        asked for; an ``error`` or ``abort`` stays."""
        if not self.prompt_only:
            return output
        completions = [dataclasses.replace(completion, text="", token_ids=[], logprobs=[], cumulative_logprob=None,
                                           finish_reason="length" if completion.finish_reason in ("stop", "length")
                                           else completion.finish_reason,
                                           stop_reason=None)
                       for completion in output.outputs]
        return dataclasses.replace(output, outputs=completions)

    def chunk(self, choices: list[dict], used: dict | None = None) -> dict:
        return P.completion_chunk(self.id, self.created, self.model, choices, used=used, include_usage=self.include_usage)

    def prefix(self, index: int) -> str:
        return self.echo_texts[index] if self.echo else ""

    def new_logprobs(self, choice: _Choice, output: RequestOutput, completion: CompletionOutput,
                     first: bool) -> dict | None:
        if self.k is None:
            return None
        if choice.logprobs is None:
            choice.logprobs = P.CompletionLogprobs(self.k, self.state.token_text)
        parts = []
        if self.echo and first:
            parts.append(self.echo_logprobs(choice.logprobs, output, choice.prefix))
        new_ids = completion.token_ids[choice.tokens:]
        if new_ids:
            entries = list(completion.logprobs or [])[choice.tokens:len(completion.token_ids)]
            parts.append(choice.logprobs.piece(new_ids, entries, text=choice.prefix + (completion.text or "")))
        if not parts:
            return None
        return {key: [v for part in parts for v in part[key]] for key in parts[0]}

    def delta_choice(self, choice: _Choice, index: int, payload: Any, logprobs: dict | None, finish: str | None,
                     reason: str | int | None, prompt_logprobs: list | None) -> dict:
        return P.completion_choice(index, payload or "", logprobs, finish, reason, prompt_logprobs)

    def echo_logprobs(self, builder: P.CompletionLogprobs, output: RequestOutput, echo_text: str) -> dict:
        """The prompt's logprobs, placed in ``echo_text`` (the text the choice starts with); the
        generated tokens' offsets go on from its end."""
        ids = output.prompt_token_ids
        entries = list(output.prompt_logprobs or [None] * len(ids))
        piece = builder.piece(ids, entries, first_is_prompt_start=True, text=echo_text)
        builder.continue_at(len(echo_text))
        return piece

    def prompt_logprobs_json(self, output: RequestOutput) -> list | None:
        if self.prompt_logprobs is None or output.prompt_logprobs is None:
            return None
        keep = self.prompt_logprobs
        trimmed: list = []
        for position, entry in enumerate(output.prompt_logprobs):
            if entry is None:
                trimmed.append(None)
                continue
            actual = output.prompt_token_ids[position]
            trimmed.append({t: lp for t, lp in entry.items() if t == actual or (lp.rank is not None and lp.rank <= keep)})
        return P.prompt_logprobs_json(trimmed, self.state.token_text)

    def response(self, job: _Job, outputs: dict[int, RequestOutput]) -> dict:
        state = self.state
        choices = []
        completion_tokens = 0
        prompt_tokens = sum(len(ids) for _, ids in job.prompts)
        for index in range(len(job.prompts)):
            output = self.shown(outputs[index])
            prefix = self.prefix(index)
            for completion in output.outputs:
                failure = _failure(output, completion.finish_reason)
                if failure is not None:
                    raise failure
                completion_tokens += len(completion.token_ids)
                text = prefix + (completion.text or "")
                logprobs = None
                if self.k is not None:
                    builder = P.CompletionLogprobs(self.k, state.token_text)
                    parts = [self.echo_logprobs(builder, output, prefix)] if self.echo else []
                    parts.append(builder.piece(completion.token_ids, list(completion.logprobs or []), text=text))
                    logprobs = {key: [v for part in parts for v in part[key]] for key in parts[0]}
                reason = P.stop_reason(completion, state.eos_token_ids, job.params[index].stop_token_ids)
                choices.append(P.completion_choice(index * self.n + completion.index, text, logprobs,
                                                   completion.finish_reason, reason, self.prompt_logprobs_json(output)))
        cached = sum(outputs[index].cached_tokens for index in range(len(job.prompts)))
        return P.completion_response(self.id, self.created, self.model, choices,
                                     P.usage(prompt_tokens, completion_tokens, cached))


async def _events(job: _Job, context: _Context) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed response: each choice's new text and logprobs as
    they come, its finish, the usage when asked, then ``[DONE]``; an engine failure or abort as
    an error event; nothing more once the client went away."""
    state = context.state
    sent: dict[int, _Choice] = {}
    completion_tokens = 0
    cached: dict[int, int] = {}  # prompt index -> the prompt tokens the prefix cache supplied
    try:
        for opening in context.opening():
            yield P.sse(context.chunk([opening]))
        while (item := await job.next()) is not None:
            index, output = item
            cached[index] = output.cached_tokens
            output = context.shown(output)
            for completion in output.outputs:
                choice_index = index * context.n + completion.index
                choice = sent.setdefault(choice_index, _Choice())
                if choice.finished:
                    continue
                failure = _failure(output, completion.finish_reason)
                if failure is not None:
                    yield P.sse(failure.body())
                    yield P.SSE_DONE
                    return
                first = not choice.started
                if first:
                    choice.prefix = context.prefix(index)
                text = completion.text or ""
                delta = text[choice.text:] if len(text) > choice.text else ""
                choice.text = max(choice.text, len(text))
                logprobs = context.new_logprobs(choice, output, completion, first)
                choice.tokens = len(completion.token_ids)
                if first:
                    delta = context.prefix(index) + delta
                prompt_logprobs = context.prompt_logprobs_json(output) if first else None
                finish = completion.finish_reason
                payload = context.payload(choice, completion, delta)
                if payload is None and logprobs is None and finish is None and prompt_logprobs is None:
                    continue  # (then no echo piece was made either: with logprobs it is never empty)
                choice.started = True
                if finish is not None:
                    choice.finished = True
                    completion_tokens += len(completion.token_ids)
                reason = P.stop_reason(completion, state.eos_token_ids, job.params[index].stop_token_ids) if finish else None
                yield P.sse(context.chunk([context.delta_choice(choice, choice_index, payload, logprobs, finish, reason,
                                                                prompt_logprobs)]))
        if job.closed and len(job.done) < len(job.request_ids):
            return  # the client went away
        if context.include_usage:
            yield P.sse(context.chunk([], P.usage(sum(len(ids) for _, ids in job.prompts), completion_tokens,
                                                  sum(cached.values()))))
        yield P.SSE_DONE
    except Exception:
        logger.exception("a %s stream failed", context.name)
        yield P.sse(P.error_body("the server failed while answering this request", "server_error", None, "internal_error"))
        yield P.SSE_DONE
    finally:
        job.close()


async def _chat(state: _State, request: Request) -> Response:
    req: P.ChatCompletionRequest = await _parse(request, P.ChatCompletionRequest)
    lora = _check_model(state, req)
    n = _check_n(state, req)
    stream, include_usage = _stream_flags(req)
    k = None
    if req.logprobs:
        k = _check_logprobs_count(state, "top_logprobs", req.top_logprobs) if req.given("top_logprobs") else 0
    elif req.given("top_logprobs") and req.top_logprobs != 0:
        raise P.APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    reply_format = _reply_format(state, req)
    text, ids = _chat_prompt(state, req)
    options = _sampling_options(state, req, n=n, logprobs=k, logprobs_param="top_logprobs")
    source = _constrain(reply_format, options, req, _structured(req)[1])
    await _check_structured_output(state, req, options, source)
    if req.given("max_completion_tokens"):
        max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_param = req.max_tokens, "max_tokens"
    default = state.llm.sampling_defaults.get("max_tokens")
    params = [_params_for_prompt(state, options, len(ids), max_tokens, max_param, default, "messages")]
    response_id, created = P.new_id("chatcmpl"), P.now()
    job = _Job(state, "/v1/chat/completions", [(text, ids)], params, response_id, lora)
    job.submit()
    try:
        context = _ChatContext(state, req.model, response_id, created, n, k, include_usage,
                               reply_format if reply_format.active else None, ids, params[0].stop)
        job.watch(request)
        if stream:
            return _EventStream(_events(job, context), job)
        try:
            outputs = await _collect(job)
        except _ClientGone:
            return Response(status_code=499)
        return _json_response(context.response(job, outputs[0]))
    except BaseException:
        job.close()
        raise


class _ChatContext(_Context):
    """What the chat completions responses are built from; with a ``reply_format``
    (:mod:`metrale.entrypoints.server.replies`), each choice's text is read into content, reasoning
    and tool calls."""

    name = "chat completions"

    def __init__(self, state: _State, model: str, response_id: str, created: int, n: int, k: int | None,
                 include_usage: bool, reply_format: _ReplyFormat | None = None, prompt_token_ids: Sequence[int] = (),
                 stops: Sequence[str] = ()) -> None:
        super().__init__(state, model, response_id, created, n, k, include_usage)
        self.reply_format = reply_format
        self.prompt_token_ids = list(prompt_token_ids)
        self.stops = tuple(stops)

    def new_reply(self) -> _Reply:
        """The reader of one choice's reply."""
        assert self.reply_format is not None
        return _Reply(self.reply_format, self.state.llm.tokenizer, self.prompt_token_ids, self.stops)

    def payload(self, choice: _Choice, completion: CompletionOutput, delta: str) -> Any:
        if self.reply_format is None:
            return delta or None
        if choice.reply is None:
            choice.reply = self.new_reply()
        return choice.reply.feed(completion.text or "", completion.token_ids, completion.finish_reason,
                                 completion.stop_reason) or None

    def chunk(self, choices: list[dict], used: dict | None = None) -> dict:
        return P.chat_chunk(self.id, self.created, self.model, choices, used=used, include_usage=self.include_usage)

    def opening(self) -> list[dict]:
        """Each choice's role."""
        return [P.chat_delta_choice(index, {"role": "assistant", "content": ""}, None, None, None)
                for index in range(self.n)]

    def new_logprobs(self, choice: _Choice, output: RequestOutput, completion: CompletionOutput,
                     first: bool) -> dict | None:
        new_ids = completion.token_ids[choice.tokens:]
        if self.k is None or not new_ids:
            return None
        entries = list(completion.logprobs or [])[choice.tokens:len(completion.token_ids)]
        return P.chat_logprobs(new_ids, entries, self.k, self.state.token_text)

    def delta_choice(self, choice: _Choice, index: int, payload: Any, logprobs: dict | None, finish: str | None,
                     reason: str | int | None, prompt_logprobs: list | None) -> dict:
        if self.reply_format is not None:
            if choice.reply is not None:
                finish = choice.reply.finish_reason(finish)
            return P.chat_delta_choice(index, payload or {}, logprobs, finish, reason)
        content = {"content": payload or ""} if payload or finish is None else {}
        return P.chat_delta_choice(index, content, logprobs, finish, reason)

    def response(self, job: _Job, output: RequestOutput) -> dict:
        state = self.state
        choices = []
        for completion in output.outputs:
            failure = _failure(output, completion.finish_reason)
            if failure is not None:
                raise failure
            logprobs = None
            if self.k is not None:
                logprobs = P.chat_logprobs(completion.token_ids, list(completion.logprobs or []), self.k, state.token_text)
            reason = P.stop_reason(completion, state.eos_token_ids, job.params[0].stop_token_ids)
            if self.reply_format is None:
                choices.append(P.chat_choice(completion.index, completion.text or "", logprobs, completion.finish_reason,
                                             reason))
                continue
            reply = self.new_reply()
            reply.feed(completion.text or "", completion.token_ids, completion.finish_reason, completion.stop_reason)
            choices.append(P.chat_choice(completion.index, "", logprobs, reply.finish_reason(completion.finish_reason), reason,
                                         reply.message()))
        used = P.usage(len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs), output.cached_tokens)
        return P.chat_response(self.id, self.created, self.model, choices, used)


async def _answer(state: _State, request: Request, handler: Callable[[_State, Request], Awaitable[Response]]) -> Response:
    """Run a handler; every failure becomes an OpenAI-shaped error response."""
    try:
        return await handler(state, request)
    except P.APIError as error:
        return _error_response(error)
    except QueueFullError as error:
        return _error_response(_unavailable(str(error), "queue_full"))
    except EngineClosedError as error:
        return _error_response(_unavailable(str(error), "service_unavailable"))
    except EngineBusyError as error:
        return _error_response(_unavailable(str(error), "engine_busy"))
    except InvalidRequestError as error:
        return _error_response(P.APIError(400, str(error)))
    except Exception:
        logger.exception("%s %s failed", request.method, request.url.path)
        return _error_response(P.APIError(500, "the server failed while answering this request (the failure is logged)",
                                          type="server_error", code="internal_error"))


