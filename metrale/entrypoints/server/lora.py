"""vLLM's runtime LoRA endpoints: ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``.

They are served only when turned on (``build_app(..., allow_runtime_lora_updating=True)``,
``metrale serve --allow-runtime-lora-updating`` or vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``);
otherwise their paths are unknown (404), as in vLLM. A client that may call them makes the
server read any folder its process can read, so they are for trusted clients only.

Loading reads and checks the adapter in the engine before it answers (a bad folder is a 400
with :class:`~metrale.errors.AdapterError`'s reason), gives it a ``lora_int_id`` no adapter of
this server had, then adds its name to ``state.lora_modules``: requests may name it from then on.
Unloading takes the name out of ``state.lora_modules`` first (requests naming it get 404 from then
on), then asks the engine to forget the adapter once the requests already running with it have
finished. ``load_inplace`` replaces an adapter in the same two steps. Loads and unloads run one at
a time (``state.lora_lock``), each to its end even when its client goes away, so the served names
and the engine's adapters always agree. ``docs/serving.rst`` ("LoRA adapters at run time") gives
the bodies and answers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable

from fastapi import Request
from starlette.responses import Response

from metrale.entrypoints.server import protocol as P
from metrale.entrypoints.server.checks import _parse
from metrale.entrypoints.server.state import MAX_LORA_NAME, MAX_LORA_PATH, _State
from metrale.errors import AdapterError, ConfigError, EngineClosedError, InvalidRequestError
from metrale.loading.lora import LoRARequest

logger = logging.getLogger(__name__)


def _text(message: str) -> Response:
    """vLLM's answer to a load or unload that succeeded: the message as plain text."""
    return Response(message, status_code=200, media_type="text/plain")


def _check_name(name: str) -> str:
    """A ``lora_name`` requests can give as their ``model``: non-empty, at most
    :data:`~metrale.entrypoints.server.state.MAX_LORA_NAME` characters, valid Unicode, no control
    characters (400 naming ``lora_name`` otherwise)."""
    if not name:
        raise P.APIError(400, "lora_name must be a non-empty string", param="lora_name")
    if len(name) > MAX_LORA_NAME:
        raise P.APIError(400, f"lora_name may hold at most {MAX_LORA_NAME} characters, got {len(name)}",
                         param="lora_name")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise P.APIError(400, "lora_name is not valid Unicode text (it holds a lone surrogate)", param="lora_name") from None
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in name):
        raise P.APIError(400, f"lora_name must not hold control characters, got {P.clip(name)}", param="lora_name")
    return name


def _check_path(path: str) -> str:
    """A ``lora_path`` the file system can be asked about: non-empty, no NUL, valid Unicode, at
    most :data:`~metrale.entrypoints.server.state.MAX_LORA_PATH` bytes (400 naming ``lora_path``
    otherwise). Whether it is an adapter folder the engine checks."""
    if not path:
        raise P.APIError(400, "lora_path must be a non-empty string: the adapter's folder", param="lora_path")
    if "\x00" in path:
        raise P.APIError(400, "lora_path must not hold a NUL character", param="lora_path")
    try:
        size = len(path.encode("utf-8"))
    except UnicodeEncodeError:
        raise P.APIError(400, "lora_path is not valid Unicode text (it holds a lone surrogate)", param="lora_path") from None
    if size > MAX_LORA_PATH:
        raise P.APIError(400, f"lora_path may hold at most {MAX_LORA_PATH} bytes, got {size}", param="lora_path")
    return path


async def _to_the_end(work: Awaitable[Response]) -> Response:
    """Await ``work`` in a task of its own, which goes on to its end when this request is
    cancelled (its client went away): a load or unload is never left half done."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(lambda done: done.cancelled() or done.exception())  # (its error is this request's)
    return await asyncio.shield(task)


# ------------------------------------------------------------------------------------- load


async def _load_lora_adapter(state: _State, request: Request) -> Response:
    """``POST /v1/load_lora_adapter``: ``{"lora_name", "lora_path", "load_inplace"?}`` -> 200
    ``Success: LoRA adapter 'NAME' added successfully.`` (plain text)."""
    req: P.LoadLoRAAdapterRequest = await _parse(request, P.LoadLoRAAdapterRequest)  # type: ignore[arg-type]
    name, path = _check_name(req.lora_name), _check_path(req.lora_path)
    if not state.engine.serves_lora:
        raise P.APIError(400, "LoRA is not enabled in this server's engine, so no adapter can be loaded: start it with "
                         "--enable-lora (or --lora-modules), or build its engine with enable_lora=True",
                         code="lora_not_enabled")
    return await _to_the_end(_load(state, name, path, bool(req.load_inplace)))


async def _load(state: _State, name: str, path: str, inplace: bool) -> Response:
    async with state.lora_lock:
        if name == state.model_name:
            raise P.APIError(400, f"The lora adapter '{name}' has already been loaded: it is the base model's served "
                             "name; choose another", param="lora_name", code="lora_adapter_exists")
        replaced = state.lora_modules.get(name)
        if replaced is not None and not inplace:
            raise P.APIError(400, f"The lora adapter '{name}' has already been loaded (unload it first, or give "
                             "load_inplace: true to replace it)", param="lora_name", code="lora_adapter_exists")
        lora = LoRARequest(name, _fresh_id(state), path)
        try:
            await state.engine.add_lora(lora)
        except EngineClosedError:
            raise
        except (AdapterError, ConfigError, InvalidRequestError) as error:
            raise P.APIError(400, f"the LoRA adapter '{name}' cannot be loaded: {error}", param="lora_path",
                             code="invalid_lora_adapter") from None
        except Exception as error:  # reading a hostile folder failed in a way the reader does not name
            logger.warning("reading LoRA adapter %r at %r failed", name, path, exc_info=error)
            raise P.APIError(400, f"the LoRA adapter '{name}' cannot be loaded: {type(error).__name__}: {error}",
                             param="lora_path", code="invalid_lora_adapter") from None
        state.lora_modules[name] = lora
        logger.info("LoRA adapter %r loaded from %s (lora_int_id %d)%s", name, path, lora.lora_int_id,
                    " in place of the one before" if replaced is not None else "")
        if replaced is not None:
            await _forget(state, replaced)
    return _text(f"Success: LoRA adapter '{name}' added successfully.")


def _fresh_id(state: _State) -> int:
    """A ``lora_int_id`` above every one this server gave out and every one its engine serves
    (``--lora-modules`` take 1, 2, ...), so that a loaded adapter never shares one."""
    taken = [lora.lora_int_id for lora in state.lora_modules.values()]
    taken += [lora.lora_int_id for lora in state.engine.list_loras()]
    fresh = max([state.next_lora_id, *(int_id + 1 for int_id in taken)])
    state.next_lora_id = fresh + 1
    return fresh


async def _forget(state: _State, lora: LoRARequest) -> None:
    """Have the engine forget ``lora`` (no longer served under its name) once the requests running
    with it have finished."""
    try:
        await state.engine.remove_lora(lora.lora_int_id)
    except (AdapterError, EngineClosedError) as error:  # gone from the engine already (a restart, a shutdown)
        logger.warning("LoRA adapter %r (lora_int_id %d) is no longer served; the engine did not hold it: %s",
                       lora.lora_name, lora.lora_int_id, error)


# ----------------------------------------------------------------------------------- unload


async def _unload_lora_adapter(state: _State, request: Request) -> Response:
    """``POST /v1/unload_lora_adapter``: ``{"lora_name", "lora_int_id"?}`` -> 200
    ``Success: LoRA adapter 'NAME' removed successfully.`` (plain text); 404 for a name no adapter
    is served under (or served under another ``lora_int_id``)."""
    req: P.UnloadLoRAAdapterRequest = await _parse(request, P.UnloadLoRAAdapterRequest)  # type: ignore[arg-type]
    if not req.lora_name:
        raise P.APIError(400, "lora_name must be a non-empty string", param="lora_name")
    int_id = req.lora_int_id if req.given("lora_int_id") else None
    return await _to_the_end(_unload(state, req.lora_name, int_id))


async def _unload(state: _State, name: str, int_id: int | None) -> Response:
    async with state.lora_lock:
        lora: Any = state.lora_modules.get(name)
        if lora is None or (int_id is not None and int_id != lora.lora_int_id):
            which = P.clip(name) + (f" with lora_int_id {int_id}" if int_id is not None else "")
            raise P.APIError(404, f"The lora adapter {which} cannot be found.", param="lora_name",
                             code="lora_adapter_not_found")
        del state.lora_modules[name]
        logger.info("LoRA adapter %r unloaded (lora_int_id %d)", name, lora.lora_int_id)
        await _forget(state, lora)
    return _text(f"Success: LoRA adapter '{name}' removed successfully.")
