"""The OpenAI-compatible HTTP server (``metrale serve``; ``docs/serving.rst``).

:func:`build_app` makes the FastAPI app around an :class:`~metrale.AsyncLLM`; :func:`serve` runs
it with uvicorn. Both need the ``serve`` extra (fastapi, uvicorn, prometheus_client), imported
on first use: ``import metrale.entrypoints.server`` (and the command-line parser of
:mod:`metrale.entrypoints.server.main`) works without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_app", "serve"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from metrale.entrypoints.server.app import build_app

        return build_app
    if name == "serve":
        from metrale.entrypoints.server.main import serve

        return serve
    raise AttributeError(f"module 'metrale.entrypoints.server' has no attribute {name!r}")
