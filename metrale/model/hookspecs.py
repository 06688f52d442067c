"""Hook specifications: the contract between the engine and its plugins.

A plugin is any object (usually a module or a class instance) whose functions are marked with
:data:`metrale.hookimpl` and named after one of the specs below. Plugins state the contract
version they target in an attribute ``METRALE_CONTRACT_VERSION`` (a ``"major.minor"`` string);
the plugin manager refuses a plugin whose major version differs from :data:`CONTRACT_VERSION`
or whose minor version is newer.

Version 1.1 added ``metrale_register_ops``; version 1.2 added speculative decoding's
``metrale_verify``, ``metrale_verdict`` and ``metrale_drafters``; version 1.3 passes the step's
planned rows (``segments``) to ``metrale_decode_batch``, ``metrale_mixed_forward`` and
``metrale_prefill_chunk``; version 1.4 added the OpenAI server's ``metrale_tool_parsers`` and
``metrale_reasoning_parsers``; version 1.5 added ``metrale_final_states``, the final normed
states that pooling requests (embeddings) read. Every 1.0 to 1.4 plugin works unchanged: a
:class:`~metrale.model.family.FamilyPlugin` derives the verify, the verdict and the final
states, pluggy calls an implementation with only the arguments it names, and a hook a plugin
does not implement is not called on it.

The hooks fall into these groups:

* **family registration** -- which checkpoints a family serves, how it builds a model, what cache
  it needs;
* **dispatch** -- one hook per method of the forward contract (``firstresult``: the family that
  owns ``model`` answers, every other family returns None);
* **stages** -- flush, stamp and drafter, which run around every forward call, plus the
  error hook that ends an open CUDA-graph capture;
* **speculation** -- the drafters a plugin offers (``metrale_drafters``) and the verdict after a
  verify;
* **ops** -- ops and kernels a plugin adds to the op layer (``metrale_register_ops``);
* **serving** -- the parsers the OpenAI server reads tool calls and reasoning with
  (``metrale_tool_parsers``, ``metrale_reasoning_parsers``);
* **queries** -- small questions the scheduler asks a model (``is_mla``, ``kv_block_size``...).

This module imports nothing heavy: reading it must not import NumPy, CuPy or numba.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from metrale.model.markers import PROJECT_NAME, hookimpl, hookspec

if TYPE_CHECKING:  # pragma: no cover
    from metrale.backends.base import Backend
    from metrale.cache.spec import CacheSpec
    from metrale.config import EngineConfig
    from metrale.loading.checkpoint import Checkpoint
    from metrale.model.family import FamilySpec
    from metrale.model.parsers import ReasoningParser, ToolParser
    from metrale.ops import PluginOps
    from metrale.sequence import ForwardStep, MixedForwardResult, PrefillSlice, Segment, SequenceState

#: Version of the forward contract these specs describe, as ``"major.minor"``.
CONTRACT_VERSION = "1.5"

__all__ = ["CONTRACT_VERSION", "PROJECT_NAME", "hookimpl", "hookspec"]


# --------------------------------------------------------------------------- family registration


@hookspec
def metrale_families() -> "list[FamilySpec]":
    """Declare the model families this plugin serves.

    Called by :func:`metrale.model.family.resolve_family` whenever a checkpoint is opened, once per
    plugin. Returns a list of :class:`~metrale.model.family.FamilySpec`, each naming the
    ``architectures`` and ``model_type`` values of ``config.json`` the family serves. Plugins
    that serve no family do not implement it.
    """


@hookspec(firstresult=True)
def metrale_load_model(
    family: "FamilySpec", checkpoint: "Checkpoint", backend: "Backend", config: "EngineConfig"
) -> Any:
    """Build a model object from a checkpoint.

    Called once by :class:`metrale.LLM` (and by the conformance kit) after the checkpoint was
    resolved to ``family``. The plugin that owns ``family`` (``family.name``) reads its tensors
    from ``checkpoint`` and places them with ``backend``. Returns its model object; every other
    plugin returns None. Missing or mis-shaped tensors raise
    :class:`~metrale.errors.CheckpointError`.
    """


@hookspec(firstresult=True)
def metrale_cache_spec(model: Any) -> "CacheSpec":
    """Declare the per-layer cache a loaded model needs.

    Called once after :func:`metrale_load_model`, before the cache is allocated. Returns a
    :class:`~metrale.cache.spec.CacheSpec` (paged K/V, paged latent, or fixed-size recurrent
    state per layer) from the family that owns ``model``; None from every other plugin.
    """


# --------------------------------------------------------------------------------- dispatch


@hookspec(firstresult=True)
def metrale_prefill(model: Any, tokens: list[int], seq: "SequenceState", stream: Any) -> Any:
    """Run the whole prompt ``tokens`` of ``seq`` through the model.

    Called by :meth:`metrale.model.forward.ModelForward.prefill` in the dispatch stage, on the prefill
    path. Writes the prompt's KV (or state) into the cache and advances ``seq.num_cached`` to
    ``len(tokens)``. Returns the last position's logits, ``[1, vocab]`` float32.
    """


@hookspec(firstresult=True)
def metrale_prefill_chunk(
    model: Any,
    tokens: list[int],
    seq: "SequenceState",
    chunk_start: int,
    chunk_len: int,
    is_last_chunk: bool,
    stream: Any,
    segments: "list[Segment] | None",
) -> Any:
    """Run one chunk ``tokens[chunk_start:chunk_start+chunk_len]`` of a prompt.

    Called by :meth:`~metrale.model.forward.ModelForward.prefill_chunk` in the dispatch stage, on the
    chunked-prefill path. ``tokens`` is the full prompt; the chunk attends to every cached
    position before it. Advances ``seq.num_cached`` to ``chunk_start + chunk_len``. Returns the
    chunk's last-position logits ``[1, vocab]`` when ``is_last_chunk``, else None.

    ``segments`` (contract 1.3): the step's planned rows, as for :func:`metrale_decode_batch`.
    """


@hookspec(firstresult=True)
def metrale_prefill_twophase(
    model: Any, tokens: list[int], seq: "SequenceState", chunk_size: int, stream: Any
) -> Any:
    """Prefill the whole prompt, internally split into chunks of at most ``chunk_size``.

    Called by :meth:`~metrale.model.forward.ModelForward.prefill_twophase` in the dispatch stage.
    Returns the last-position logits ``[1, vocab]``, equal to :func:`metrale_prefill`'s.
    """


@hookspec(firstresult=True)
def metrale_decode(model: Any, token: int, seq: "SequenceState", stream: Any) -> Any:
    """Append one token to ``seq`` and compute the next-token logits.

    Called by :meth:`~metrale.model.forward.ModelForward.decode` in the dispatch stage, on the
    single-sequence decode path. ``token`` sits at position ``seq.num_cached``; afterwards
    ``seq.num_cached`` is one larger. Returns ``[1, vocab]`` float32 logits.
    """


@hookspec(firstresult=True)
def metrale_decode_batch(model: Any, tokens: list[int], seqs: "list[SequenceState]", stream: Any,
                         segments: "list[Segment] | None") -> Any:
    """Decode one token for each of several sequences in one step.

    Called by :meth:`~metrale.model.forward.ModelForward.decode_batch` in the dispatch stage, on the
    batched decode path (replayed from a CUDA graph on the GPU). ``tokens[i]`` belongs to
    ``seqs[i]``; with overlap scheduling it is the placeholder 0 when ``seqs[i].pending_token`` is
    set (the token is still on the device; the model runner feeds it). Returns ``[n, vocab]``
    logits, row i for ``seqs[i]``.

    ``segments`` (contract 1.3) are the step's rows as the engine planned them (a list of
    :class:`~metrale.sequence.Segment`, in the order of the arguments), or None for a call made
    through the contract method directly: a plugin may run them as they are (the built-in
    families hand them to their model runner) instead of deriving its own; one that leaves the
    parameter out of its implementation is called without it.
    """


@hookspec(firstresult=True)
def metrale_mixed_forward(
    model: Any,
    decode_tokens: list[int],
    decode_seqs: "list[SequenceState]",
    prefill_tokens: list[int],
    prefill_seq: "SequenceState",
    chunk_start: int,
    chunk_len: int,
    is_last: bool,
    stream: Any,
    segments: "list[Segment] | None",
) -> "MixedForwardResult":
    """Run decode rows and one prefill chunk in a single step.

    Called by :meth:`~metrale.model.forward.ModelForward.mixed_forward` in the dispatch stage, on the
    mixed path of the scheduler. ``prefill_tokens`` is the full prompt of ``prefill_seq``; decode
    tokens are placeholders where their sequence has a ``pending_token``, as in
    ``metrale_decode_batch``. Returns
    a :class:`~metrale.sequence.MixedForwardResult` whose decode rows come first and are never
    overwritten by the prefill's logits (present only when ``is_last``).

    ``segments`` (contract 1.3): the step's planned rows, as for :func:`metrale_decode_batch`.
    """


@hookspec(firstresult=True)
def metrale_prefill_batch_chunk(model: Any, slices: "list[PrefillSlice]", stream: Any) -> "list[Any]":
    """Prefill one chunk of each of several sequences.

    Called by :meth:`~metrale.model.forward.ModelForward.prefill_batch_chunk` in the dispatch stage, on
    the batched-prefill path. Admission (same geometry, capacity) is decided before any sequence
    is touched; an ineligible batch runs slice by slice. Returns one entry per slice: ``[1,
    vocab]`` logits for a slice whose chunk is the last, None otherwise.
    """


@hookspec(firstresult=True)
def metrale_prefill_batch_chunk_rows(
    model: Any, slices: "list[PrefillSlice]", stream: Any, row_base: int
) -> "list[Any]":
    """Like :func:`metrale_prefill_batch_chunk`, for a caller that owns a logits buffer.

    Called by :meth:`~metrale.model.forward.ModelForward.prefill_batch_chunk_rows`. A finishing slice
    ``i`` has its logits at row ``row_base + i`` of the step's logits buffer. Returns a list
    holding, per slice, that row (``[1, vocab]``) or None.
    """


@hookspec(firstresult=True)
def metrale_score(model: Any, tokens: list[int], seq: "SequenceState", stream: Any) -> Any:
    """Teacher-forced forward: logits for every position of ``tokens``.

    An extension of the forward contract used by :meth:`metrale.LLM.score` and by the
    conformance kit. Called by :meth:`~metrale.model.forward.ModelForward.score` in the dispatch stage.
    Fills the cache like :func:`metrale_prefill`. Returns ``[len(tokens), vocab]`` float32.
    """


@hookspec(firstresult=True)
def metrale_final_states(model: Any, segments: "list[Segment]", stream: Any) -> Any:
    """Run ``segments`` (prompt chunks of pooling requests) and return their rows' final normed
    states instead of logits (contract 1.5).

    Called by :meth:`~metrale.model.forward.ModelForward.final_states` in the dispatch stage of an
    engine step that holds pooling chunks (:mod:`metrale.engine.pooling`: embeddings). Each
    :class:`~metrale.sequence.Segment` is a chunk of a sequence from its cached length on; its
    ``logits`` field says which rows' states it wants (``"all"``, ``"last"`` or ``"none"``). Fills
    the cache as :func:`metrale_prefill_chunk` does. Returns float32 ``[rows, hidden_size]``: the
    state after the model's final norm (the LM head's input) of each row asked for, in order.
    :class:`~metrale.model.family.FamilyPlugin` derives it for a model that keeps
    :class:`~metrale.layers.loading.DecoderEnds` (every built-in family); for any other it raises
    :class:`~metrale.errors.UnsupportedModelError`.
    """


@hookspec(firstresult=True)
def metrale_verify(model: Any, tokens: "list[list[int]]", seqs: "list[SequenceState]", stream: Any) -> Any:
    """Run each sequence's last accepted token and its draft tokens in one forward (contract 1.2).

    Called by :meth:`~metrale.model.forward.ModelForward.verify` in the dispatch stage of a
    speculative decode step. ``tokens[i]`` is ``seqs[i]``'s input token followed by its ``K_i``
    drafts, at positions from its cached length on. Attention layers write the keys and values of
    every row; the caller then states, through :func:`metrale_verdict`, how many rows each
    sequence keeps. Returns logits ``[sum(K_i + 1), vocab]``, the rows of ``seqs[0]`` first.
    :class:`~metrale.model.family.FamilyPlugin` derives it from ``forward_batch``; a family with
    recurrent state overrides it (the Gated DeltaNet family keeps the state after every row), and
    one that cannot verify (its model sets ``speculation_capable = False``) raises
    :class:`~metrale.errors.UnsupportedModelError`.
    """


@hookspec(firstresult=True)
def metrale_verdict(model: Any, seqs: "list[SequenceState]", rows: "list[int]", accepted: "list[int]",
                    stream: Any) -> bool:
    """Keep the first ``accepted[i] + 1`` of the ``rows[i]`` rows ``seqs[i]`` ran in the last verify.

    Called by :meth:`~metrale.model.forward.ModelForward.verdict` right after a verify whose tokens were
    sampled, before any other forward call. ``accepted[i]`` counts the drafts kept (0 to
    ``rows[i] - 1``); the cached length goes back to the position after the last kept row, and
    what the rejected rows wrote is overwritten by later steps. A family with recurrent state
    records what is pending for the flush stage. Returns True (the family that owns ``model``
    answered).
    """


@hookspec(firstresult=True)
def metrale_normalize_ssm_states(model: Any, seq: "SequenceState", stream: Any) -> None:
    """Check (never rescale) ``seq``'s recurrent state between prefill chunks.

    Called by the scheduler through :meth:`~metrale.model.forward.ModelForward.normalize_ssm_states`
    between two chunks of one prompt. Families with a recurrent state raise
    :class:`~metrale.errors.NonFiniteStateError` on NaN or infinity; others do not implement it.
    Returns None.
    """


# ----------------------------------------------------------------------------------- queries


@hookspec(firstresult=True)
def metrale_hc_mult(model: Any) -> int:
    """Number of hyper-connection residual streams of ``model``.

    Called by the engine when it sizes activation buffers. Returns an int; 0 (the default when
    no family answers) means none.
    """


@hookspec(firstresult=True)
def metrale_is_mla(model: Any) -> bool:
    """Whether a chunked prefill of ``model`` must run as a single chunk.

    Called by the scheduler before it plans prefill chunks. Returns True for MLA families; the
    default, when no family answers, is False.
    """


@hookspec(firstresult=True)
def metrale_kv_block_size(model: Any) -> int:
    """Tokens per paged-KV block that ``model`` wants.

    Called once when the cache is built. Returns an int; None (no family answers) means the
    engine's configured block size (16 by default).
    """


@hookspec(firstresult=True)
def metrale_prefill_tail_split(model: Any, tokens: list[int]) -> int:
    """Where to split the prompt ``tokens`` so that a recurrent-state snapshot lands at its tail.

    Called by the scheduler before it plans a prompt's chunks when the prefix cache is on.
    Returns a token index, or None (the default) for no split.
    """


# ------------------------------------------------------------------------------------- stages


@hookspec
def metrale_flush(model: Any, step: "ForwardStep") -> None:
    """Fold pending per-sequence state into the real state before anything reads it.

    Called by :class:`~metrale.model.forward.ModelForward` first, before every forward call, for every
    plugin. ``step.seqs`` lists the sequences of the call. For example a speculative verify may
    leave rows accepted but not yet folded into a recurrent state. Returns None.
    """


@hookspec
def metrale_stamp(model: Any, step: "ForwardStep") -> None:
    """Record per-step routing that deep layer code reads.

    Called by :class:`~metrale.model.forward.ModelForward` after the flush stage and before dispatch,
    for every plugin. Plugins write into ``step.stamps`` (the built-in stamp plugin writes the
    adapter route: None for the base model, one adapter slot, or
    :data:`~metrale.sequence.MIXED_ADAPTERS` when the rows disagree; see
    :func:`metrale.batch.adapter_route`). A plugin may raise to refuse the step (the built-in one
    raises :class:`~metrale.errors.AdapterError` for an adapter the model cannot serve); the
    dispatch then does not run. Returns None.
    """


@hookspec
def metrale_drafter(model: Any, step: "ForwardStep", result: Any) -> None:
    """Run the eager speculative drafter after a successful prefill.

    Called by :class:`~metrale.model.forward.ModelForward` last, only after a prefill-like call
    (``prefill``, ``prefill_twophase``, or ``prefill_chunk`` / ``mixed_forward`` whose chunk is
    the last) returned successfully; never after ``prefill_batch_chunk*``, ``score`` or a
    decode, and never when ``METRALE_NO_MTP_EAGER_DRAFTER`` is set. ``result``
    is the dispatch result. An exception raised here is logged and swallowed: the drafter never
    fails the forward. Returns None.
    """


@hookspec
def metrale_end_graph_capture(model: Any, step: "ForwardStep", error: BaseException) -> None:
    """End and discard an open CUDA-graph capture after a failed batched forward.

    Called by :class:`~metrale.model.forward.ModelForward` when the dispatch of ``decode_batch`` or
    ``mixed_forward`` raises, before the error propagates, so that the next call can run
    eagerly. The built-in backend plugin ends the capture on the step's stream (a no-op on the
    CPU). Returns None.
    """


# ------------------------------------------------------------------------------- speculation


@hookspec
def metrale_drafters() -> "dict[str, Any]":
    """Declare the speculative drafters this plugin offers (contract 1.2).

    Called when an engine is built with a ``speculative_config``. Returns a mapping from a
    ``method`` name to a factory ``factory(config, model)`` that returns a
    :class:`~metrale.speculative.Drafter` for the loaded ``model`` (or raises
    :class:`~metrale.errors.ConfigError` when it cannot serve it). The built-in ``"ngram"``
    drafter is one. Plugins that offer none do not implement it.
    """


# ---------------------------------------------------------------------------------------- ops


@hookspec
def metrale_register_ops(registry: "PluginOps") -> None:
    """Add ops, and kernels for ops, to the op layer (contract 1.1).

    Called once per plugin whenever an op registry is built (:func:`metrale.ops.build_op_registry`:
    by :class:`metrale.LLM` before the model loads, and by the conformance kit), after the
    built-in ops are declared and in plugin registration order. ``registry.declare(Op(...))``
    declares a new op with its NumPy reference (which the CPU backend runs; on the GPU the
    reference runs on the host unless a CUDA kernel is registered); ``registry.add_kernel(
    Kernel(...))`` adds a kernel for a declared op -- built-in or not -- on one backend,
    optionally only under a condition, tried before the built-in kernels. Family code then calls
    the op as ``backend.ops.<name>``. Declaring a name that Metrale or another plugin declared
    raises :class:`~metrale.errors.OpNameClashError` naming the op and both declarers. Returns
    None.
    """


# ------------------------------------------------------------------------------------ serving


@hookspec
def metrale_tool_parsers() -> "dict[str, type[ToolParser]]":
    """Declare the tool-call parsers this plugin offers (contract 1.4).

    Called once when the OpenAI server starts (:func:`metrale.entrypoints.parsers.tool_parsers`,
    for ``--tool-call-parser``) and by ``metrale plugins``. Returns a mapping from a parser name
    (``"hermes"``, ``"llama3_json"``, ...) to a subclass of
    :class:`~metrale.model.parsers.ToolParser`, which the server instantiates per reply with
    the request's ``tools``. A name that two plugins declare is an error
    (:class:`~metrale.errors.PluginError`). Plugins that offer none do not implement it.
    """


@hookspec
def metrale_reasoning_parsers() -> "dict[str, type[ReasoningParser]]":
    """Declare the reasoning parsers this plugin offers (contract 1.4).

    Called once when the OpenAI server starts (:func:`metrale.entrypoints.parsers.reasoning_parsers`,
    for ``--reasoning-parser``) and by ``metrale plugins``. Returns a mapping from a parser name
    (``"deepseek_r1"``, ``"qwen3"``, ...) to a subclass of
    :class:`~metrale.model.parsers.ReasoningParser`, which the server instantiates per reply
    with the request's ``chat_template_kwargs``. A name that two plugins declare is an error
    (:class:`~metrale.errors.PluginError`). Plugins that offer none do not implement it.
    """
