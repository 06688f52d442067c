"""The ``ModelForward`` facade: the forward contract, run through the plugin stages.

Every forward method runs four stages, each a hook (see :mod:`metrale.model.hookspecs`):

1. ``metrale_flush``  -- fold pending per-sequence state into the real state;
2. ``metrale_stamp``  -- record per-step routing (adapter route, MoE-adapter route);
3. dispatch           -- the family's forward (``metrale_<method>``, firstresult);
4. ``metrale_drafter`` -- only after a successful prefill-like call whose chunk is the last.

Error rules: a raising dispatch skips the drafter; a raising drafter is logged and never fails
the call; an error in ``decode_batch`` or ``mixed_forward`` first goes through
``metrale_end_graph_capture`` so that an open CUDA-graph capture is ended before it propagates.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import pluggy

from metrale.config import EnvironmentConfig
from metrale.errors import PluginError
from metrale.sequence import ForwardStep, MixedForwardResult, PrefillSlice, Segment, SequenceState

logger = logging.getLogger(__name__)

#: Methods whose dispatch errors must end an open graph capture before propagating.
GRAPH_CAPTURED_METHODS = frozenset({"decode_batch", "mixed_forward"})
#: Methods whose dispatch hook takes the step's planned rows, ``segments`` (contract 1.3).
SEGMENT_METHODS = frozenset({"decode_batch", "mixed_forward", "prefill_chunk"})


class ModelForward:
    """The forward contract of one loaded model, with the plugin stages around each call.

    ``model`` is the object a family's ``metrale_load_model`` returned; ``plugin_manager`` the
    manager that loaded it. Sequences are :class:`~metrale.sequence.SequenceState` objects whose
    cache blocks the model reserves as it goes.
    """

    def __init__(
        self,
        model: Any,
        plugin_manager: pluggy.PluginManager,
        environment: EnvironmentConfig | None = None,
    ) -> None:
        self.model = model
        self.plugin_manager = plugin_manager
        self.hook = plugin_manager.hook
        self.environment = environment or EnvironmentConfig()

    # -------------------------------------------------------------------------------- stages

    def run(self, method: str, step: ForwardStep, **arguments: Any) -> Any:
        """The contract method ``method`` with ``arguments`` (its parameters but ``model``),
        through the four stages. The engine calls it with a ``step`` carrying its planned
        ``segments``; the methods below call it with ``step.segments`` None."""
        hook = self.hook
        hook.metrale_flush(model=self.model, step=step)
        hook.metrale_stamp(model=self.model, step=step)
        if method in SEGMENT_METHODS:
            arguments["segments"] = step.segments
        dispatch = getattr(hook, f"metrale_{method}")
        try:
            result = dispatch(model=self.model, **arguments)
        except BaseException as error:
            if method in GRAPH_CAPTURED_METHODS:
                self._end_graph_capture(step, error)
            raise
        if step.runs_drafter and not self.environment.no_mtp_eager_drafter:
            try:
                hook.metrale_drafter(model=self.model, step=step, result=result)
            except Exception:  # the drafter never fails the forward
                logger.warning("the eager drafter failed after %s; continuing", method, exc_info=True)
        return result

    def _end_graph_capture(self, step: ForwardStep, error: BaseException) -> None:
        try:
            self.hook.metrale_end_graph_capture(model=self.model, step=step, error=error)
        except Exception as secondary:  # keep the original error; report the second one
            logger.error("ending the graph capture after %r failed: %r", error, secondary)
            if hasattr(error, "add_note"):
                error.add_note(f"while ending the graph capture: {secondary!r}")

    # ------------------------------------------------------------------------ forward methods

    def prefill(self, tokens: Sequence[int], seq: SequenceState, stream: Any = None) -> Any:
        """Whole-prompt prefill; returns the last position's ``[1, vocab]`` logits."""
        step = ForwardStep("prefill", [seq], stream, is_last_chunk=True)
        return self.run("prefill", step, tokens=list(tokens), seq=seq, stream=stream)

    def prefill_chunk(
        self,
        tokens: Sequence[int],
        seq: SequenceState,
        chunk_start: int,
        chunk_len: int,
        is_last_chunk: bool,
        stream: Any = None,
    ) -> Any:
        """One chunk of a prompt; logits ``[1, vocab]`` on the last chunk, else None."""
        step = ForwardStep("prefill_chunk", [seq], stream, is_last_chunk=is_last_chunk)
        return self.run(
            "prefill_chunk",
            step,
            tokens=list(tokens),
            seq=seq,
            chunk_start=chunk_start,
            chunk_len=chunk_len,
            is_last_chunk=is_last_chunk,
            stream=stream,
        )

    def prefill_twophase(
        self, tokens: Sequence[int], seq: SequenceState, chunk_size: int, stream: Any = None
    ) -> Any:
        """Whole-prompt prefill split internally into chunks of ``chunk_size``."""
        step = ForwardStep("prefill_twophase", [seq], stream, is_last_chunk=True)
        return self.run(
            "prefill_twophase", step, tokens=list(tokens), seq=seq, chunk_size=chunk_size, stream=stream
        )

    def decode(self, token: int, seq: SequenceState, stream: Any = None) -> Any:
        """One decode step of one sequence; returns ``[1, vocab]``."""
        step = ForwardStep("decode", [seq], stream)
        return self.run("decode", step, token=int(token), seq=seq, stream=stream)

    def decode_batch(self, tokens: Sequence[int], seqs: Sequence[SequenceState], stream: Any = None) -> Any:
        """One decode step of several sequences; returns ``[n, vocab]``, row i for ``seqs[i]``."""
        step = ForwardStep("decode_batch", list(seqs), stream)
        return self.run("decode_batch", step, tokens=[int(t) for t in tokens], seqs=list(seqs), stream=stream)

    def mixed_forward(
        self,
        decode_tokens: Sequence[int],
        decode_seqs: Sequence[SequenceState],
        prefill_tokens: Sequence[int],
        prefill_seq: SequenceState,
        chunk_start: int,
        chunk_len: int,
        is_last: bool,
        stream: Any = None,
    ) -> MixedForwardResult:
        """Decode rows plus one prefill chunk in one step."""
        step = ForwardStep("mixed_forward", [*decode_seqs, prefill_seq], stream, is_last_chunk=is_last)
        return self.run(
            "mixed_forward",
            step,
            decode_tokens=[int(t) for t in decode_tokens],
            decode_seqs=list(decode_seqs),
            prefill_tokens=list(prefill_tokens),
            prefill_seq=prefill_seq,
            chunk_start=chunk_start,
            chunk_len=chunk_len,
            is_last=is_last,
            stream=stream,
        )

    def prefill_batch_chunk(self, slices: Sequence[PrefillSlice], stream: Any = None) -> list[Any]:
        """One chunk of each of several prompts; one entry per slice (logits or None)."""
        step = ForwardStep("prefill_batch_chunk", [s.seq for s in slices], stream)
        return self.run("prefill_batch_chunk", step, slices=list(slices), stream=stream)

    def prefill_batch_chunk_rows(
        self, slices: Sequence[PrefillSlice], stream: Any = None, row_base: int = 0
    ) -> list[Any]:
        """Like :meth:`prefill_batch_chunk`; finishing slice i's logits sit at ``row_base + i``."""
        step = ForwardStep("prefill_batch_chunk_rows", [s.seq for s in slices], stream)
        return self.run(
            "prefill_batch_chunk_rows", step, slices=list(slices), stream=stream, row_base=row_base
        )

    def score(self, tokens: Sequence[int], seq: SequenceState, stream: Any = None) -> Any:
        """Teacher-forced logits for every position, ``[len(tokens), vocab]``."""
        step = ForwardStep("score", [seq], stream)
        return self.run("score", step, tokens=list(tokens), seq=seq, stream=stream)

    def final_states(self, segments: Sequence[Segment], stream: Any = None) -> Any:
        """The final normed states ``[rows, hidden_size]`` (float32) of the rows ``segments``
        ask for (:func:`~metrale.model.hookspecs.metrale_final_states`): the pooling requests'
        chunks of an engine step."""
        segments = list(segments)
        step = ForwardStep("final_states", [s.seq for s in segments], stream, segments=segments)
        result = self.run("final_states", step, segments=segments, stream=stream)
        if result is None:
            raise PluginError(f"no installed plugin gives the final states of the model object "
                              f"{type(self.model).__qualname__}")
        return result

    def verify(self, tokens: Sequence[Sequence[int]], seqs: Sequence[SequenceState], stream: Any = None) -> Any:
        """A speculative verify: each sequence's input token and drafts in one forward; returns
        ``[sum(len(tokens[i])), vocab]`` (:func:`~metrale.model.hookspecs.metrale_verify`)."""
        step = ForwardStep("verify", list(seqs), stream)
        result = self.run("verify", step, tokens=[[int(t) for t in rows] for rows in tokens], seqs=list(seqs),
                           stream=stream)
        if result is None:
            raise PluginError(f"no installed plugin verifies the model object {type(self.model).__qualname__}")
        return result

    # ---------------------------------------------------------------------- direct dispatches

    def verdict(self, seqs: Sequence[SequenceState], rows: Sequence[int], accepted: Sequence[int],
                stream: Any = None) -> None:
        """After :meth:`verify`: how many drafts each sequence kept
        (:func:`~metrale.model.hookspecs.metrale_verdict`)."""
        ranks = getattr(getattr(self.model, "runner", None), "ranks", None)
        if ranks is not None:
            ranks.verdict(list(seqs), list(rows), list(accepted))  # (the lengths before this rank rewinds them)
        answered = self.hook.metrale_verdict(model=self.model, seqs=list(seqs), rows=[int(r) for r in rows],
                                             accepted=[int(a) for a in accepted], stream=stream)
        if answered is None:
            raise PluginError(f"no installed plugin took the verdict for {type(self.model).__qualname__}")

    def drafter(self, config: Any) -> Any:
        """The drafter ``config.method`` names, from the plugins' ``metrale_drafters``; raises
        :class:`~metrale.errors.ConfigError` for a name no plugin offers."""
        from metrale.errors import ConfigError

        offered: dict[str, Any] = {}
        for mapping in self.hook.metrale_drafters():
            offered.update(mapping or {})
        if config.method not in offered:
            raise ConfigError(f"no drafter named {config.method!r}; installed: {', '.join(sorted(offered)) or 'none'}")
        return offered[config.method](config, self.model)

    def normalize_ssm_states(self, seq: SequenceState, stream: Any = None) -> None:
        """Check the recurrent state of ``seq`` between prefill chunks (never rescales)."""
        self.hook.metrale_normalize_ssm_states(model=self.model, seq=seq, stream=stream)

    def hc_mult(self) -> int:
        """Hyper-connection streams; 0 means none."""
        value = self.hook.metrale_hc_mult(model=self.model)
        return 0 if value is None else int(value)

    def is_mla(self) -> bool:
        """Whether chunked prefill must run as one chunk."""
        return bool(self.hook.metrale_is_mla(model=self.model))

    def kv_block_size(self) -> int | None:
        """Tokens per paged-KV block the model asks for; None means the engine default."""
        value = self.hook.metrale_kv_block_size(model=self.model)
        return None if value is None else int(value)

    def prefill_tail_split(self, tokens: Sequence[int]) -> int | None:
        """Where to split a prompt so a state snapshot lands at its tail; None for no split."""
        value = self.hook.metrale_prefill_tail_split(model=self.model, tokens=list(tokens))
        return None if value is None else int(value)

    def cache_spec(self) -> Any:
        """The model's cache spec; raises :class:`PluginError` when no family owns the model."""
        spec = self.hook.metrale_cache_spec(model=self.model)
        if spec is None:
            raise PluginError(
                f"no installed plugin claims the model object {type(self.model).__qualname__}: "
                "its family's metrale_cache_spec returned None"
            )
        return spec
