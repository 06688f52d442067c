"""What users call: the offline :class:`~metrale.entrypoints.llm.LLM`, the asyncio
:class:`~metrale.entrypoints.async_llm.AsyncLLM`, the engine process behind the server, the
request front end (prompts, chat templates, streams), the ``metrale`` command and the
OpenAI-compatible server (:mod:`metrale.entrypoints.server`).

Nothing below this package imports it: the engine, the runner, the families, the ops and the
kernels know no entry point.
"""
