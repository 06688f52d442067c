"""The public API for model-family plugins.

A family plugin provides

* a :class:`FamilySpec` naming the ``architectures`` / ``model_type`` values it serves;
* a model class derived from :class:`FamilyModel` that implements :meth:`FamilyModel.cache_spec`
  and :meth:`FamilyModel.forward_batch` -- the base class derives every method of the forward
  contract (prefill, chunks, decode, batches, mixed steps, score) from those two;
* a plugin object, usually a :class:`FamilyPlugin` subclass, whose hook implementations route the
  contract to its model class.

The built-in families are written exactly this way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence, cast

import numpy as np

from metrale.batch import ForwardBatch, Segment
from metrale.errors import AdapterError, CacheError, ConfigError, UnsupportedModelError
from metrale.model.markers import hookimpl
from metrale.sequence import MixedForwardResult, PrefillSlice, SequenceState

if TYPE_CHECKING:  # pragma: no cover
    import pluggy

    from metrale.backends.base import Backend
    from metrale.cache.spec import CacheSpec
    from metrale.cache.store import ModelCache
    from metrale.config import EngineConfig
    from metrale.layers.lora_stacks import LoraLayout
    from metrale.loading.checkpoint import Checkpoint
    from metrale.runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FamilySpec:
    """A model family: its name and the ``config.json`` values it serves.

    The engine dispatches on ``model_type`` and checks ``architectures``.
    """

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    description: str = ""


class FamilyModel:
    """Base class of a family's model object.

    Subclasses implement :meth:`cache_spec` and :meth:`forward_batch`; everything else of the
    forward contract is derived here. ``self.cache`` is bound by the engine before the first
    forward call.
    """

    #: Whether decode steps may be recorded into CUDA graphs and replayed. A model whose forward
    #: synchronises with the host (data-dependent shapes, host loops) sets it False.
    graph_capturable: bool = True
    #: Whether mixed steps (decode rows plus one prompt chunk) may also be recorded into CUDA
    #: graphs, at padded shapes (:mod:`metrale.runner.graphs`). Only for a ``forward_batch`` that
    #: reads nothing of the batch but its device row metadata and ``row_starts``: padding rows are
    #: extra one-token segments and extra rows of the chunk, repeating its last position, whose
    #: keys and values go to the dummy block.
    mixed_graph_capturable: bool = False
    #: Whether :meth:`verify` and :meth:`verdict` serve this model (speculative decoding). The
    #: derived ones keep every row a verify ran in the paged KV cache and rewind the cached
    #: length, which is exact for attention; a model with recurrent state must keep its state
    #: as of the last kept row, so it overrides both (and :meth:`flush_pending`) or sets this
    #: False.
    speculation_capable: bool = True
    #: True while :meth:`verify` runs :meth:`forward_batch`: the rows are a verify's, each
    #: sequence's input token and drafts. A family whose decode rows take another path than prompt
    #: rows (MLA's absorbed attention, Gated DeltaNet's recurrent step) computes them as decode
    #: rows, so that a verify's logits are the decode steps' and speculation changes no token.
    verifying: bool = False
    #: Whether a verify may replay the decode graphs (:mod:`metrale.runner.graphs`), each of its
    #: rows a one-token decode row of its own that reads its sequence's blocks up to its position
    #: (the keys and values of the rows before it in the same verify are written first). Exact for
    #: a model whose rows meet only through the paged KV cache; a model with recurrent state
    #: (state slots) is never replayed so, and a model whose verify rows need more than that sets
    #: it False.
    verify_graph_capturable: bool = True
    #: Whether the model loads and runs as one rank of a tensor-parallel group
    #: (:mod:`metrale.backends.parallel`): a family that reads its shard of each weight from
    #: ``backend.shard`` and joins the ranks' partial results sets it True; a model of any other
    #: family is refused on a rank of a group of several.
    tensor_parallel_capable: bool = False
    #: Whether the model runs under ``batch_invariant=True`` (:class:`~metrale.config.EngineConfig`):
    #: a family that computes every row through ``backend.ops`` (whose kernels are then the
    #: batch-invariant ones) and takes the same path for a row whatever else is in the step --
    #: where its decode rows take another path than prompt rows, one of the two for every row
    #: while ``backend.batch_invariant`` -- sets it True; the engine refuses any other.
    batch_invariant_capable: bool = False

    @property
    def feeds_pending_tokens(self) -> bool:
        """Whether decode rows of this model may carry a placeholder for a token still on the
        device (overlap scheduling): true when its decode and mixed steps run through
        :meth:`run_segments` and the model runner, whose ``feed_tokens`` puts the real token in
        (:attr:`~metrale.sequence.SequenceState.pending_token`). A subclass that overrides
        those methods answers False unless it says otherwise."""
        cls = type(self)
        return all(getattr(cls, name) is getattr(FamilyModel, name)
                   for name in ("decode_batch", "mixed_forward", "run_segments"))

    def __init__(self, backend: "Backend", *, vocab_size: int, max_model_len: int) -> None:
        shard = getattr(backend, "shard", None)
        if shard is not None and shard.sharded and not self.tensor_parallel_capable:
            raise ConfigError(f"{type(self).__name__} does not run tensor-parallel yet "
                              f"(tensor_parallel_size={shard.size}); use tensor_parallel_size=1")
        self.backend = backend
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.cache: ModelCache | None = None
        self.runner: ModelRunner | None = None
        self._row_buffer: Any = None
        #: Arrays a :meth:`forward_batch` leaves for after the call, by name (a drafter's inputs,
        #: such as the MLA family's final states for its MTP drafter). The CUDA graph runner keeps
        #: what each recording left and puts it back after each replay (:mod:`metrale.runner.graphs`).
        self.step_outputs: dict[str, Any] = {}
        #: What :meth:`enable_lora` built, once the engine serves LoRA (None: it does not).
        self.lora_layout: LoraLayout | None = None

    # -------------------------------------------------------------- what a family implements

    def cache_spec(self) -> "CacheSpec":
        """Per-layer cache needs of this model."""
        raise NotImplementedError

    def forward_batch(self, batch: ForwardBatch) -> Any:
        """Run the rows of ``batch``, writing their KV/state into ``self.cache``.

        Returns float32 logits ``[len(batch.logits_rows), vocab]`` of the listed rows, in order.
        """
        raise NotImplementedError

    # ------------------------------------------------------------- optional contract queries

    def is_mla(self) -> bool:
        return False

    def hc_mult(self) -> int:
        return 0

    def kv_block_size(self) -> int | None:
        return None

    def prefill_tail_split(self, tokens: Sequence[int]) -> int | None:
        return None

    def normalize_ssm_states(self, seq: SequenceState, stream: Any) -> None:
        return None

    # --------------------------------------------------------------------------- machinery

    def bind_cache(self, cache: "ModelCache", runner: "ModelRunner | None" = None) -> None:
        """Bind the engine's cache and the :class:`~metrale.runner.ModelRunner` that runs every
        forward call of this model against it (the engine builds it and hands it over; a new one
        when ``runner`` is None, for a model used on its own)."""
        if runner is None:
            from metrale.runner import ModelRunner

            runner = ModelRunner(self, cache)
        self.cache = cache
        self.runner = runner

    def _require_cache(self) -> "ModelCache":
        if self.cache is None:
            raise CacheError(f"{type(self).__name__} has no cache bound; call bind_cache() first")
        return self.cache

    def _require_runner(self) -> "ModelRunner":
        if self.runner is None:
            raise CacheError(f"{type(self).__name__} has no cache bound; call bind_cache() first")
        return self.runner

    def run_segments(self, segments: list[Segment]) -> Any:
        """Reserve cache for ``segments`` (all or nothing), run them, advance each sequence's
        cached length (:meth:`metrale.runner.ModelRunner.run`)."""
        return self._require_runner().run(segments)

    # -------------------------------------------------------------------- forward contract

    def prefill(self, tokens: Sequence[int], seq: SequenceState, stream: Any) -> Any:
        start = seq.num_cached
        if start >= len(tokens):
            raise CacheError(f"sequence {seq.seq_id} already caches all {len(tokens)} prompt tokens")
        return self.run_segments([Segment(seq, tokens[start:], start, "last")])

    def prefill_chunk(
        self,
        tokens: Sequence[int],
        seq: SequenceState,
        chunk_start: int,
        chunk_len: int,
        is_last_chunk: bool,
        stream: Any,
    ) -> Any:
        chunk = tokens[chunk_start : chunk_start + chunk_len]
        if chunk_len < 1 or len(chunk) != chunk_len:
            raise CacheError(
                f"chunk [{chunk_start}, {chunk_start + chunk_len}) does not fit a prompt of {len(tokens)} tokens"
            )
        logits = self.run_segments([Segment(seq, chunk, chunk_start, "last" if is_last_chunk else "none")])
        return logits if is_last_chunk else None

    def prefill_twophase(self, tokens: Sequence[int], seq: SequenceState, chunk_size: int, stream: Any) -> Any:
        if chunk_size < 1:
            raise CacheError(f"chunk_size must be >= 1, got {chunk_size}")
        start = seq.num_cached
        logits = None
        while start < len(tokens):
            length = min(chunk_size, len(tokens) - start)
            last = start + length == len(tokens)
            logits = self.prefill_chunk(tokens, seq, start, length, last, stream)
            if not last:
                self.normalize_ssm_states(seq, stream)
            start += length
        if logits is None:
            raise CacheError(f"sequence {seq.seq_id} already caches all {len(tokens)} prompt tokens")
        return logits

    def decode(self, token: int, seq: SequenceState, stream: Any) -> Any:
        return self.decode_batch([token], [seq], stream)

    def decode_batch(self, tokens: Sequence[int], seqs: Sequence[SequenceState], stream: Any) -> Any:
        if len(tokens) != len(seqs) or not seqs:
            raise CacheError(f"decode_batch got {len(tokens)} tokens for {len(seqs)} sequences")
        return self.run_segments([Segment(s, [t], s.num_cached, "last") for t, s in zip(tokens, seqs)])

    def mixed_forward(
        self,
        decode_tokens: Sequence[int],
        decode_seqs: Sequence[SequenceState],
        prefill_tokens: Sequence[int],
        prefill_seq: SequenceState,
        chunk_start: int,
        chunk_len: int,
        is_last: bool,
        stream: Any,
    ) -> MixedForwardResult:
        if len(decode_tokens) != len(decode_seqs):
            raise CacheError(f"mixed_forward got {len(decode_tokens)} decode tokens for {len(decode_seqs)} sequences")
        chunk = prefill_tokens[chunk_start : chunk_start + chunk_len]
        if chunk_len < 1 or len(chunk) != chunk_len:
            raise CacheError(f"chunk [{chunk_start}, {chunk_start + chunk_len}) does not fit the prompt")
        segments = [Segment(s, [t], s.num_cached, "last") for t, s in zip(decode_tokens, decode_seqs)]
        segments.append(Segment(prefill_seq, chunk, chunk_start, "last" if is_last else "none"))
        logits = self.run_segments(segments)
        count = len(decode_seqs)
        return MixedForwardResult(
            decode_logits=logits[:count],
            prefill_logits=logits[count : count + 1] if is_last else None,
        )

    def batch_admissible(self, slices: Sequence[PrefillSlice]) -> bool:
        """Whether ``slices`` can run as one batch: distinct sequences, contiguous chunks, and
        room in the cache for all of them. Decided before any sequence is touched."""
        segments = [Segment(s.seq, s.tokens[s.chunk_start : s.chunk_start + s.chunk_len], s.chunk_start) for s in slices]
        if len({s.seq.seq_id for s in slices}) != len(slices):
            return False
        if any(len(seg.token_ids) != sl.chunk_len or sl.chunk_len < 1 for seg, sl in zip(segments, slices)):
            return False
        if any(seg.start != seg.seq.num_cached or seg.end > self.max_model_len for seg in segments):
            return False
        return self._require_runner().blocks_needed(segments) <= self._require_runner().cache.num_free_blocks

    def prefill_batch_chunk(self, slices: Sequence[PrefillSlice], stream: Any) -> list[Any]:
        slices = list(slices)
        if not slices:
            return []
        if not self.batch_admissible(slices):
            return [
                self.prefill_chunk(s.tokens, s.seq, s.chunk_start, s.chunk_len, s.is_last_chunk, stream)
                for s in slices
            ]
        segments = [
            Segment(s.seq, s.tokens[s.chunk_start : s.chunk_start + s.chunk_len], s.chunk_start,
                    "last" if s.is_last_chunk else "none")
            for s in slices
        ]
        logits = self.run_segments(segments)
        results: list[Any] = []
        row = 0
        for s in slices:
            if s.is_last_chunk:
                results.append(logits[row : row + 1])
                row += 1
            else:
                results.append(None)
        return results

    def prefill_batch_chunk_rows(self, slices: Sequence[PrefillSlice], stream: Any, row_base: int) -> list[Any]:
        results = self.prefill_batch_chunk(slices, stream)
        rows_needed = row_base + len(results)
        if self._row_buffer is None or self._row_buffer.shape[0] < rows_needed:
            self._row_buffer = self.backend.zeros((max(rows_needed, 1), self.vocab_size), np.float32)
        out: list[Any] = []
        for index, logits in enumerate(results):
            if logits is None:
                out.append(None)
                continue
            row = row_base + index
            self._row_buffer[row] = logits[0]
            out.append(self._row_buffer[row : row + 1])
        return out

    def verify(self, tokens: Sequence[Sequence[int]], seqs: Sequence[SequenceState], stream: Any) -> Any:
        """Logits of every row of ``tokens[i]`` (``seqs[i]``'s input token, then its drafts) at
        positions from each sequence's cached length on, ``[sum(len(tokens[i])), vocab]``."""
        if not self.speculation_capable:
            raise UnsupportedModelError(f"{type(self).__name__} does not serve speculative decoding (verify)")
        if len(tokens) != len(seqs) or not seqs or any(len(rows) < 1 for rows in tokens):
            raise CacheError(f"verify got {len(tokens)} token lists for {len(seqs)} sequences "
                             "(each needs its input token)")
        segments = [Segment(s, list(rows), s.num_cached, "all") for rows, s in zip(tokens, seqs)]
        self.begin_verify(segments)
        self.verifying = True
        try:
            return self.run_segments(segments)
        finally:
            self.verifying = False

    def begin_verify(self, segments: list[Segment]) -> None:
        """Called before a verify's forward over ``segments`` (each a sequence's input token and
        its drafts) on every rank of the model -- on a worker rank of a tensor-parallel group with
        the segments' sequences as stubs holding ``seq_id`` and ``state_slot`` only: a family
        that keeps per-row state of a verify for :meth:`verdict` sets it up here. Nothing by
        default."""

    def verdict(self, seqs: Sequence[SequenceState], rows: Sequence[int], accepted: Sequence[int],
                stream: Any) -> bool:
        """After :meth:`verify`: ``seqs[i]`` keeps its first ``accepted[i] + 1`` of ``rows[i]`` rows
        (its cached length rewound past the rest, whose keys and values later steps overwrite)."""
        if not (len(seqs) == len(rows) == len(accepted)):
            raise CacheError(f"verdict got {len(rows)} row counts and {len(accepted)} acceptances for "
                             f"{len(seqs)} sequences")
        for seq, count, kept in zip(seqs, rows, accepted):
            if not 0 <= kept < count or seq.num_cached < count:
                raise CacheError(f"sequence {seq.seq_id}: {kept} drafts kept of a verify of {count} rows")
        for seq, count, kept in zip(seqs, rows, accepted):
            seq.num_cached -= count - kept - 1
        return True

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> "LoraLayout | None":
        """Build the adapter slots of the model's projections (``max_loras`` adapters of rank up
        to ``max_lora_rank``; :mod:`metrale.layers.lora` builds them for the shared blocks) and
        return their :class:`~metrale.layers.lora_stacks.LoraLayout`; called once, before the cache is built,
        when the engine serves LoRA. None (the default): the family serves no LoRA, and
        ``LLM(enable_lora=True)`` is refused with a :class:`~metrale.errors.ConfigError`."""
        return None

    def check_adapters(self, step: Any) -> None:
        """The stamp stage's check of a step's adapter route (``step.stamps["adapter_route"]``,
        :func:`~metrale.model.hookspecs.metrale_stamp`) before anything runs: raises
        :class:`~metrale.errors.AdapterError` when a sequence asks for an adapter slot the model
        does not hold."""
        route = step.stamps.get("adapter_route")
        if route is None:
            return
        layout = getattr(self, "lora_layout", None)
        if layout is None:
            raise AdapterError(f"a sequence asks for adapter slot {route!r}, but LoRA is not enabled for this model "
                               "(LLM(enable_lora=True))")
        count = layout.num_slots
        for seq in step.seqs:
            if seq.adapter_slot is not None and not 0 < seq.adapter_slot < count:
                raise AdapterError(f"sequence {seq.seq_id} asks for adapter slot {seq.adapter_slot}; the model holds "
                                   f"slots 1..{count - 1}")

    def prepare_speculation(self, config: Any) -> None:
        """Called with the engine's :class:`~metrale.speculative.SpeculativeConfig` before the
        cache is built: a model whose drafter needs cache layers of its own (an MTP module)
        adds them to :meth:`cache_spec` here, or raises :class:`~metrale.errors.ConfigError` when
        it cannot serve the method. Does nothing by default."""
        return None

    def after_run(self, segments: list[Segment], batch: ForwardBatch) -> None:
        """Called by the model runner after each forward call of ``segments`` (``batch``, their
        layout) returned, :attr:`step_outputs` filled: where a drafter reads the rows it needs
        (the MLA family's MTP drafter keeps the final states). Does nothing by default."""
        return None

    def prime_drafter(self, seqs: list[SequenceState]) -> None:
        """The eager drafter prefill: called by the built-in drafter stage after a prompt's last
        chunk ran successfully (:func:`~metrale.model.hookspecs.metrale_drafter`), so a drafter model
        catches up on the prompt's rows. Does nothing by default."""
        return None

    def flush_pending(self) -> None:
        """Fold whatever a :meth:`verdict` left pending into the model's state; the built-in
        flush stage calls it before every forward, and a model calls it before it reads that
        state outside a forward. Nothing is pending for the derived verdict."""
        return None

    def final_states(self, segments: list[Segment]) -> Any:
        """The final normed states of the rows ``segments`` ask for, ``[rows, hidden_size]``
        float32 (:func:`~metrale.model.hookspecs.metrale_final_states`): the segments run through
        the model runner as a step whose :attr:`~metrale.batch.ForwardBatch.final_states` is set,
        which :meth:`~metrale.layers.loading.DecoderEnds.logits` answers with the states. A model
        that keeps no :class:`~metrale.layers.loading.DecoderEnds` (``self.ends``) raises
        :class:`~metrale.errors.UnsupportedModelError`."""
        from metrale.layers.loading import DecoderEnds

        if not isinstance(getattr(self, "ends", None), DecoderEnds):
            raise UnsupportedModelError(f"{type(self).__name__} keeps no DecoderEnds (self.ends) whose final states "
                                        "pooling reads; it serves no embeddings")
        return self._require_runner().run(segments, final_states=True)

    def score(self, tokens: Sequence[int], seq: SequenceState, stream: Any) -> Any:
        start = seq.num_cached
        if start >= len(tokens):
            raise CacheError(f"sequence {seq.seq_id} already caches all {len(tokens)} tokens")
        return self.run_segments([Segment(seq, tokens[start:], start, "all")])


class FamilyPlugin:
    """Hook implementations routing the contract to one :class:`FamilyModel` subclass.

    Subclass it, set ``family``, ``model_class`` and ``METRALE_CONTRACT_VERSION``, and register
    an instance (entry point group ``metrale``). Either implement :meth:`load_model`, or set
    ``config_class`` and let the default build the model.
    """

    family: FamilySpec
    model_class: type = FamilyModel
    #: The family's config reader: ``config_class.from_dict(config_json, source=...)`` returns an
    #: object with ``max_position_embeddings``; ``model_class(family_config, checkpoint, backend,
    #: max_model_len)`` then builds the model. Used by the default :meth:`load_model`.
    config_class: Any = None

    def load_model(self, checkpoint: "Checkpoint", backend: "Backend", config: "EngineConfig") -> FamilyModel:
        """Read the family's config, settle the context length (the engine's ``max_model_len``,
        at most the checkpoint's ``max_position_embeddings``), build the model and warn about
        tensors it did not read."""
        if self.config_class is None:
            raise NotImplementedError(f"{type(self).__name__} sets no config_class: implement load_model()")
        family_config = self.config_class.from_dict(checkpoint.config, source=checkpoint.fields.source)
        limit = family_config.max_position_embeddings
        max_model_len = config.max_model_len or limit
        if max_model_len > limit:
            raise ConfigError(f"max_model_len={max_model_len} exceeds the checkpoint's max_position_embeddings={limit}")
        model = self.model_class(family_config, checkpoint, backend, max_model_len)
        unused = checkpoint.unconsumed()
        shard = getattr(backend, "shard", None)
        # (A rank of several leaves the other ranks' experts unread: the warning is one rank's.)
        if unused and not (shard is not None and shard.expert_parallel and shard.sharded):
            logger.warning("%s: %d tensors are not used by the %s family: %s", checkpoint.path, len(unused),
                           self.family.name, unused[:8])
        return model

    def _owns(self, model: Any) -> bool:
        """Whether ``model`` is this plugin's (every other family's hooks answer None for it)."""
        return isinstance(model, self.model_class)

    @staticmethod
    def _runs_planned(model: Any, method: str, segments: Any) -> bool:
        """Whether the engine's planned ``segments`` go straight to the model's runner: the
        engine planned them, the model has its runner, and its class keeps
        :class:`FamilyModel`'s ``method`` (a family that overrides it is called through it)."""
        return (segments is not None and model.runner is not None
                and getattr(type(model), method) is getattr(FamilyModel, method))

    @hookimpl
    def metrale_families(self) -> list[FamilySpec]:
        return [self.family]

    @hookimpl
    def metrale_load_model(self, family: FamilySpec, checkpoint: Any, backend: Any, config: Any) -> Any:
        if family.name != self.family.name:
            return None
        return self.load_model(checkpoint, backend, config)

    @hookimpl
    def metrale_cache_spec(self, model: Any) -> Any:
        return model.cache_spec() if self._owns(model) else None

    @hookimpl
    def metrale_prefill(self, model, tokens, seq, stream):
        return model.prefill(tokens=tokens, seq=seq, stream=stream) if self._owns(model) else None

    @hookimpl
    def metrale_prefill_chunk(self, model, tokens, seq, chunk_start, chunk_len, is_last_chunk, stream, segments):
        if not self._owns(model):
            return None
        if self._runs_planned(model, "prefill_chunk", segments):
            logits = model.runner.run(segments)
            return logits if is_last_chunk else None
        return model.prefill_chunk(tokens, seq, chunk_start, chunk_len, is_last_chunk, stream)

    @hookimpl
    def metrale_prefill_twophase(self, model, tokens, seq, chunk_size, stream):
        return model.prefill_twophase(tokens, seq, chunk_size, stream) if self._owns(model) else None

    @hookimpl
    def metrale_decode(self, model, token, seq, stream):
        return model.decode(token=token, seq=seq, stream=stream) if self._owns(model) else None

    @hookimpl
    def metrale_decode_batch(self, model, tokens, seqs, stream, segments):
        if not self._owns(model):
            return None
        if self._runs_planned(model, "decode_batch", segments):
            return model.runner.run(segments)
        return model.decode_batch(tokens=tokens, seqs=seqs, stream=stream)

    @hookimpl
    def metrale_mixed_forward(
        self, model, decode_tokens, decode_seqs, prefill_tokens, prefill_seq, chunk_start, chunk_len, is_last, stream,
        segments,
    ):
        if not self._owns(model):
            return None
        if self._runs_planned(model, "mixed_forward", segments):
            logits = model.runner.run(segments)
            count = len(decode_seqs)
            return MixedForwardResult(logits[:count], logits[count : count + 1] if is_last else None)
        return model.mixed_forward(
            decode_tokens, decode_seqs, prefill_tokens, prefill_seq, chunk_start, chunk_len, is_last, stream
        )

    @hookimpl
    def metrale_prefill_batch_chunk(self, model, slices, stream):
        return model.prefill_batch_chunk(slices=slices, stream=stream) if self._owns(model) else None

    @hookimpl
    def metrale_prefill_batch_chunk_rows(self, model, slices, stream, row_base):
        return model.prefill_batch_chunk_rows(slices, stream, row_base) if self._owns(model) else None

    @hookimpl
    def metrale_final_states(self, model, segments, stream):
        return model.final_states(segments) if self._owns(model) else None

    @hookimpl
    def metrale_score(self, model, tokens, seq, stream):
        return model.score(tokens=tokens, seq=seq, stream=stream) if self._owns(model) else None

    @hookimpl
    def metrale_verify(self, model, tokens, seqs, stream):
        return model.verify(tokens=tokens, seqs=seqs, stream=stream) if self._owns(model) else None

    @hookimpl
    def metrale_verdict(self, model, seqs, rows, accepted, stream):
        return model.verdict(seqs=seqs, rows=rows, accepted=accepted, stream=stream) if self._owns(model) else None

    @hookimpl
    def metrale_normalize_ssm_states(self, model, seq, stream):
        return model.normalize_ssm_states(seq=seq, stream=stream) if self._owns(model) else None

    @hookimpl
    def metrale_hc_mult(self, model):
        return model.hc_mult() if self._owns(model) else None

    @hookimpl
    def metrale_is_mla(self, model):
        return model.is_mla() if self._owns(model) else None

    @hookimpl
    def metrale_kv_block_size(self, model):
        return model.kv_block_size() if self._owns(model) else None

    @hookimpl
    def metrale_prefill_tail_split(self, model, tokens):
        return model.prefill_tail_split(tokens=tokens) if self._owns(model) else None


# ------------------------------------------------------------------------------ resolution


def installed_families(plugin_manager: "pluggy.PluginManager") -> list[tuple[FamilySpec, str]]:
    """Every family declared by a registered plugin, with that plugin's name."""
    found: list[tuple[FamilySpec, str]] = []
    for impl in plugin_manager.hook.metrale_families.get_hookimpls():
        specs = cast("list[FamilySpec]", impl.function() or [])
        for spec in specs:
            found.append((spec, impl.plugin_name))
    return found


def resolve_family(plugin_manager: "pluggy.PluginManager", config: dict[str, Any]) -> FamilySpec:
    """The family serving a checkpoint whose ``config.json`` is ``config``.

    Dispatches on ``model_type`` (falling back to ``architectures``) and checks that the
    checkpoint's ``architectures`` are ones the family serves.
    """
    families = installed_families(plugin_manager)
    model_type = config.get("model_type")
    architectures = list(config.get("architectures") or [])
    by_type = [(spec, plugin) for spec, plugin in families if model_type in spec.model_types]
    if len(by_type) > 1:
        from metrale.errors import PluginError

        owners = ", ".join(f"{spec.name} (plugin {plugin})" for spec, plugin in by_type)
        raise PluginError(
            f"several families serve model_type {model_type!r}: {owners}; block all but one with "
            "METRALE_BLOCKED_PLUGINS"
        )
    if by_type:
        spec = by_type[0][0]
        if architectures and not set(architectures) & set(spec.architectures):
            raise UnsupportedModelError(
                f"model_type {model_type!r} belongs to family {spec.name!r}, which serves "
                f"{list(spec.architectures)}, not {architectures}"
            )
        return spec
    by_arch = [spec for spec, _ in families if set(architectures) & set(spec.architectures)]
    if by_arch:
        return by_arch[0]
    known = sorted({a for spec, _ in families for a in spec.architectures})
    plugins = sorted({plugin for _, plugin in families})
    raise UnsupportedModelError(
        f"no installed family serves architectures={architectures} model_type={model_type!r}. "
        f"Known architectures: {', '.join(known) or 'none'}. Installed family plugins: "
        f"{', '.join(plugins) or 'none'}"
    )
