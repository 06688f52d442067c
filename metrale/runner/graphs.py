"""CUDA graphs: one captured graph per padded batch shape, replayed every step.

A decode step of ``n`` sequences is padded to the next rung (1, 2, 4, 8, 16, 24, 32, 48, 64, 96,
128). Each rung owns static device buffers for the step's row metadata (token ids, positions,
cache slots, block tables); the host packs one step's metadata into a pinned buffer and copies
it in with one transfer, then replays the rung's graph. Padding rows decode token 0 at position
0 into the reserved dummy block, so they never touch a real sequence. The block table a bucket's
graph reads is as wide as the bucket needs (:func:`table_width`), so a step packs and uploads
the blocks its contexts can reach, not ``max_model_len``'s.

A rung holds one graph per live-context bucket (:func:`context_buckets`: 512 tokens, then four
times more each, up to ``max_model_len``): a step replays the graph of the smallest bucket that
holds its longest sequence, so the attention kernels, whose key splits and kernel choice are
fixed when a graph is recorded, are sized for the contexts the step has rather than for the
longest the model allows.

The first step of a rung (and bucket) runs eagerly (its result is returned) and then records the graph; the
memory the graph uses comes from the backend's private pool. An error while recording ends and
discards the capture before it propagates; the next call records again. A model that runs an op
which cannot be captured (an op served by the host fallback of its reference) stops using graphs:
its decode steps run eagerly from then on, and a warning says which op.

Mixed steps (decode rows plus one prompt chunk, ``mixed_forward``) of a model that sets
``mixed_graph_capturable`` are replayed the same way at padded shapes: the decode rows padded to
the next of :data:`MIXED_DECODE_RUNGS`, the chunk to the next of :data:`MIXED_PROMPT_BUCKETS`.
The chunk's padding rows repeat its last position with token 0 and write their keys and values
into the dummy block, so attention, which reads keys by position, never sees them; the graph's logits rows are the
decode rows and the chunk's last real row. Each shape keeps its graph and its own logits buffer
(36 shapes at most). A family whose layers depend on more of the batch than
its row metadata (per-segment host loops, recurrent states) leaves ``mixed_graph_capturable``
off and its mixed steps run eagerly.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from metrale.batch import ForwardBatch
from metrale.errors import GraphCaptureError
from metrale.kernels.lora_tiles import ADAPTER_TILE_ROWS, adapter_tile_capacity, adapter_tiles, padded_adapter_tiles
from metrale.sequence import MIXED_ADAPTERS

logger = logging.getLogger(__name__)

DECODE_RUNGS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)

#: Padded decode rows and prompt-chunk lengths of a mixed step replayed from a graph. The decode
#: rungs are coarser than decode steps': a mixed step's cost is mostly its chunk, and fewer shapes
#: mean fewer graphs to record while a batch fills up.
MIXED_DECODE_RUNGS = (16, 32, 64, 128)
MIXED_PROMPT_BUCKETS = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048)


#: The smallest live-context bucket of the decode graphs; each next one is four times larger.
CONTEXT_BUCKET_START = 512

# Field order of the packed int32 metadata: seven [B] vectors, then the pending tokens' feed (its
# rows and its indices, [B] each), then the adapter tiles of the B rows, then the [B, width] table.
_VECTORS = ("token_ids", "positions", "slot_mapping", "seq_index", "logits_rows", "state_slots", "adapter_slots")
_FEED_VECTORS = 2
_TILES_START = len(_VECTORS) + _FEED_VECTORS  # in [B] vectors


def _tile_values(size: int) -> int:
    """int32 values of the adapter tiles of ``size`` rows (:func:`metrale.kernels.lora_tiles.adapter_tiles`)."""
    return adapter_tile_capacity(size) * (2 + ADAPTER_TILE_ROWS)


def _table_start(size: int) -> int:
    return _TILES_START * size + _tile_values(size)


def persistent_zeros(length: int) -> Any:
    """A zeroed device int32 array for metadata that outlives a step, from CuPy's default pool:
    the backend's graph pool hands the memory a finished capture freed (that graph's intermediates)
    to later allocations while the graph still writes it at every replay."""
    import cupy

    with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
        return cupy.zeros(length, dtype=np.int32)


def table_width(bucket: int, block_size: int, max_blocks: int) -> int:
    """Columns of the block table a graph of context bucket ``bucket`` reads: the blocks that
    many tokens fill, at most ``max_blocks``."""
    return min(max_blocks, -(-bucket // block_size))


def decode_buffer_length(size: int, width: int) -> int:
    """int32 values of a rung's packed metadata for tables ``width`` wide: seven ``[size]`` vectors
    (token ids, positions, cache slots, sequence index, logits rows, state slots, adapter slots),
    two more (the rows and indices of the pending tokens fed in, :func:`pack_decode`), the rows'
    adapter tiles (:func:`metrale.kernels.lora_tiles.adapter_tiles`, as many as ``size`` rows may need), then
    the ``[size, width]`` block table."""
    return _table_start(size) + size * width


def pack_decode(host: np.ndarray, size: int, width: int, batch: ForwardBatch | None,
                feed: tuple[list[int], list[int]] | None = None) -> int:
    """Write the padded metadata of a decode ``batch`` (or of padding rows only, for None) into
    the start of ``host`` as :func:`decode_buffer_length` lays it out for tables ``width`` wide;
    returns the values written. Each row its own table row and logits row; padding rows decode
    token 0 at position 0 into slot 0 of the dummy block 0, with state slot 0 and adapter slot 0
    (the base model). ``feed``, the rows and the indices of one sampler call's pending tokens (at
    most ``size`` each), goes to the two vectors after the seven."""
    used = decode_buffer_length(size, width)
    packed = host[:used]
    packed[:] = 0
    arange = np.arange(size, dtype=np.int32)
    packed[3 * size : 4 * size] = arange  # seq_index: each row its own table row
    packed[4 * size : 5 * size] = arange  # logits_rows: every row
    if batch is not None:
        rows = batch.num_rows
        packed[0:rows] = batch.token_ids
        packed[size : size + rows] = batch.positions
        packed[2 * size : 2 * size + rows] = batch.slot_mapping
        if batch.state_slots is not None:
            packed[5 * size : 5 * size + rows] = batch.state_slots  # padding rows: the dummy slot 0
        if batch.adapter_slots is not None:
            packed[6 * size : 6 * size + rows] = batch.adapter_slots
            # Every row's tile, padding rows' too (slot 0: their outputs written like the rest);
            # the step's own tiles, grouped when its batch was built, kept.
            capacity = adapter_tile_capacity(size)
            tiles = (adapter_tiles(packed[6 * size : 7 * size], capacity) if batch.adapter_tiles is None
                     else padded_adapter_tiles(batch.adapter_tiles, rows, size, capacity))
            packed[_TILES_START * size : _table_start(size)] = tiles.reshape(-1)
        table = packed[_table_start(size) :].reshape(size, width)
        # (A step's sequences hold no more blocks than its bucket's tokens fill; the columns past
        # ``width`` are never read by the bucket's graph.)
        columns = min(width, batch.block_tables.shape[1])
        table[:rows, :columns] = batch.block_tables[:, :columns]
    if feed is not None:
        feed_rows, feed_indices = feed
        start = len(_VECTORS) * size
        packed[start : start + len(feed_rows)] = feed_rows
        packed[start + size : start + size + len(feed_indices)] = feed_indices
    return used


def as_decode_rows(batch: ForwardBatch) -> ForwardBatch:
    """``batch`` (a verify: segments of several rows, every row's logits) as a decode batch whose
    rows are segments of their own: the same tokens, positions and cache slots, each row's block
    table its sequence's. Row ``j`` of a sequence then attends to its cache up to its own position,
    where the rows before it wrote their keys and values in the same forward: the causal attention
    of the verify, through the decode kernels."""
    rows = np.arange(batch.num_rows, dtype=np.int64)
    return ForwardBatch(
        segments=batch.segments, token_ids=batch.token_ids, positions=batch.positions, seq_index=rows,
        slot_mapping=batch.slot_mapping, block_tables=batch.block_tables[batch.seq_index],
        row_starts=np.arange(batch.num_rows + 1, dtype=np.int64), logits_rows=rows, max_context=batch.max_context,
        state_slots=None, every_row_logits=True, adapter_slots=batch.adapter_slots, adapter_route=batch.adapter_route,
        adapter_tiles=batch.adapter_tiles,
    )


def decode_rung_batch(buffer: Any, size: int, max_blocks: int, max_model_len: int) -> ForwardBatch:
    """The batch a decode rung of ``size`` rows records its graphs over: views of ``buffer``, its
    metadata as :func:`pack_decode` lays it out (the table ``max_blocks`` wide; a graph of a
    context bucket reads a narrower one, :meth:`Rung.bucket_batch`). Its adapter slots are None:
    the base model's graphs (:meth:`Rung.bucket_batch` gives the adapters' graphs theirs)."""
    views = {name: buffer[i * size : (i + 1) * size] for i, name in enumerate(_VECTORS)}
    return ForwardBatch(
        segments=[], token_ids=views["token_ids"], positions=views["positions"], seq_index=views["seq_index"],
        slot_mapping=views["slot_mapping"], block_tables=buffer[_table_start(size) :].reshape(size, max_blocks),
        row_starts=np.arange(size + 1), logits_rows=views["logits_rows"], max_context=max_model_len,
        state_slots=views["state_slots"], every_row_logits=True,  # pack_decode packs 0 .. size - 1
    )


def context_buckets(max_model_len: int) -> tuple[int, ...]:
    """The live-context buckets of the decode graphs: 512, 2,048, 8,192, ... below
    ``max_model_len``, then ``max_model_len``."""
    buckets = []
    size = CONTEXT_BUCKET_START
    while size < max_model_len:
        buckets.append(size)
        size *= 4
    return (*buckets, max_model_len)


@dataclass
class Rung:
    """Static buffers of one padded batch size and its captured graphs, one per context bucket and
    adapter path (``(bucket, lora)``: the base model's steps, and steps with adapter rows, whose
    graphs read every row's adapter slot)."""

    size: int
    host: Any  # pinned int32, decode_buffer_length(B, max_blocks)
    device: Any  # device int32, same layout
    batch: ForwardBatch  # over ``device``; its max_context is max_model_len
    graphs: dict[tuple[int, bool], Any] = field(default_factory=dict)  # by (context bucket, lora)
    outputs: dict[tuple[int, bool], Any] = field(default_factory=dict)  # the logits buffer of each graph
    step_outputs: dict[tuple[int, bool], dict[str, Any]] = field(default_factory=dict)  # the model's, each graph's
    #: The batch each graph was recorded with: what the ops made once for it (``extras``: the
    #: attention's tile lists) lives on device memory the graph reads at every replay.
    recorded_batches: dict[tuple[int, bool], ForwardBatch] = field(default_factory=dict)
    uploaded: Any = None  # event recorded after the last host-to-device copy of ``host``

    def bucket_batch(self, bucket: int, width: int, lora: bool = False) -> ForwardBatch:
        """The rung's batch as a graph of ``bucket`` records it: the same device buffers, the block
        table ``width`` columns wide (:func:`table_width`) at the start of the table's space; with
        ``lora``, every row's adapter slot (the mixed route: the kernels read each row's)."""
        start = _table_start(self.size)
        table = self.device[start : start + self.size * width].reshape(self.size, width)
        adapters = {}
        if lora:
            slots = _VECTORS.index("adapter_slots") * self.size
            tiles = self.device[_TILES_START * self.size : start].reshape(-1, 2 + ADAPTER_TILE_ROWS)
            adapters = {"adapter_slots": self.device[slots : slots + self.size], "adapter_route": MIXED_ADAPTERS,
                        "adapter_tiles": tiles}
        return dataclasses.replace(self.batch, max_context=bucket, block_tables=table, extras={}, **adapters)


@dataclass
class MixedRung:
    """Static buffers and the captured graphs of one padded mixed-step shape: ``decode`` decode
    rows then ``prompt`` rows of one chunk (``decode + prompt`` rows, ``decode + 1`` segments);
    the base model's graph, and the adapters' (``lora_*``: its batch reads every row's adapter
    slot) for a model that serves LoRA."""

    decode: int
    prompt: int
    host: Any  # pinned int32 [5 R + 2 S + S * max_blocks], R rows, S segments
    device: Any  # device int32, same layout
    batch: ForwardBatch
    graph: Any = None
    output: Any = None
    step_outputs: dict[str, Any] = field(default_factory=dict)  # what the model left, recorded
    uploaded: Any = None
    lora_batch: Any = None
    lora_graph: Any = None
    lora_output: Any = None
    lora_step_outputs: dict[str, Any] = field(default_factory=dict)


def mixed_buffer_length(decode: int, prompt: int, max_blocks: int) -> int:
    """int32 values of a mixed shape's packed metadata: four ``[R]`` row vectors (token ids,
    positions, cache slots, segment index), two ``[S]`` segment vectors (logits rows, state
    slots), the ``[S, max_blocks]`` block table, then the rows' adapter slots ``[R]``;
    ``R = decode + prompt``, ``S = decode + 1``."""
    segments, rows = decode + 1, decode + prompt
    return 4 * rows + 2 * segments + segments * max_blocks + rows


def _mixed_table_end(decode: int, prompt: int, max_blocks: int) -> int:
    return 4 * (decode + prompt) + 2 * (decode + 1) + (decode + 1) * max_blocks


def mixed_batch(buffer: Any, decode: int, prompt: int, max_blocks: int, max_context: int,
                lora: bool = False) -> ForwardBatch:
    """The :class:`ForwardBatch` of a padded mixed shape, as views of its packed ``buffer``
    (:func:`mixed_buffer_length`; a device array for a graph, a NumPy array on the host); with
    ``lora``, the rows' adapter slots too (the mixed route)."""
    rows, segments = decode + prompt, decode + 1
    vectors = [buffer[i * rows : (i + 1) * rows] for i in range(4)]
    tail = buffer[4 * rows :]
    end = _mixed_table_end(decode, prompt, max_blocks)
    adapters = {"adapter_slots": buffer[end : end + rows], "adapter_route": MIXED_ADAPTERS} if lora else {}
    return ForwardBatch(
        segments=[], token_ids=vectors[0], positions=vectors[1], slot_mapping=vectors[2], seq_index=vectors[3],
        block_tables=tail[2 * segments : 2 * segments + segments * max_blocks].reshape(segments, max_blocks),
        row_starts=np.append(np.arange(segments), rows), logits_rows=tail[:segments],
        max_context=max_context, state_slots=tail[segments : 2 * segments], **adapters,
    )


def pack_mixed(host: np.ndarray, decode: int, prompt: int, max_blocks: int, batch: ForwardBatch | None) -> None:
    """Write the padded metadata of a mixed ``batch`` (``n`` one-token segments, then one chunk of
    ``c`` rows; or, for None, padding rows only) into ``host``, laid out as :func:`mixed_batch`
    reads it: the decode rows first, padded to ``decode`` rows that decode token 0 at position 0
    into the dummy block 0, each with its own (zero) table row; then the chunk's rows, padded to
    ``prompt`` rows that repeat its last position and write into the dummy block. Logits rows:
    every decode row, then the chunk's last real row. Adapter slots: each real row's (padding
    rows: 0, the base model)."""
    rows, segments = decode + prompt, decode + 1
    host[:] = 0
    token_ids, positions, slot_mapping, seq_index = (host[i * rows : (i + 1) * rows] for i in range(4))
    logits_rows = host[4 * rows : 4 * rows + segments]
    state_slots = host[4 * rows + segments : 4 * rows + 2 * segments]
    end = _mixed_table_end(decode, prompt, max_blocks)
    table = host[4 * rows + 2 * segments : end].reshape(segments, max_blocks)
    adapter_slots = host[end : end + rows]
    seq_index[:decode] = np.arange(decode, dtype=np.int32)
    seq_index[decode:] = decode
    logits_rows[:decode] = np.arange(decode, dtype=np.int32)
    logits_rows[decode] = rows - 1
    if batch is None:
        return
    real = len(batch.segments) - 1
    chunk = batch.num_rows - real
    vectors = [(token_ids, batch.token_ids), (positions, batch.positions), (slot_mapping, batch.slot_mapping)]
    if batch.adapter_slots is not None:
        vectors.append((adapter_slots, batch.adapter_slots))
    for vector, values in vectors:
        vector[:real] = values[:real]
        vector[decode : decode + chunk] = values[real:]
    positions[decode + chunk :] = batch.positions[-1]
    logits_rows[decode] = decode + chunk - 1
    if batch.state_slots is not None:
        state_slots[:real] = batch.state_slots[:real]
        state_slots[decode] = batch.state_slots[-1]
    width = batch.block_tables.shape[1]
    table[:real, :width] = batch.block_tables[:real]
    table[decode, :width] = batch.block_tables[-1]


def mixed_logits_rows(batch: ForwardBatch, decode: int) -> list[int]:
    """Which rows of a padded mixed shape's logits (``decode`` decode rows, then the chunk's) are
    the logits ``batch`` asks for: its decode rows', then the chunk's last row's if it asked."""
    real = len(batch.segments) - 1
    return list(range(real)) + [decode] * (len(batch.logits_rows) - real)


class CudaGraphRunner:
    """Replays ``model.forward_batch`` for decode-only batches from captured graphs (and a
    verify's rows as decode rows, :meth:`run_verify`)."""

    def __init__(self, model: Any, backend: Any, cache: Any = None) -> None:
        # The model owns its runner; the runner refers back to it weakly (no reference cycle).
        self._model = weakref.ref(model)
        self.backend = backend
        #: The cache the steps run over (the model's own when none is given).
        self.cache = cache if cache is not None else model.cache
        self.block_size = self.cache.block_size
        # A sequence holds at most every block of the cache, however long max_model_len is.
        self.max_blocks = min(math.ceil(model.max_model_len / self.block_size), self.cache.num_blocks)
        self.buckets = context_buckets(model.max_model_len)
        self.rungs: dict[int, Rung] = {}
        #: Mixed-step graphs by (decode rung, prompt bucket).
        self.mixed_rungs: dict[tuple[int, int], MixedRung] = {}
        #: Why graphs are off for this model (an op that cannot be captured), or None.
        self.disabled: str | None = None
        #: When a list, every replay appends ``(start, end, rows)``: the CUDA events recorded on the
        #: stream around the launch and the graph's padded decode rows (0 for a mixed step), so a
        #: tool can measure replays and the gaps between them; None (the default): no events.
        self.replay_events: list[tuple[Any, Any, int]] | None = None
        #: Why mixed-step graphs are off for this model, or None.
        self.mixed_disabled: str | None = None if getattr(model, "mixed_graph_capturable", False) else (
            f"{type(model).__name__} does not set mixed_graph_capturable")

    @property
    def model(self) -> Any:
        return self._model()

    def accepts(self, batch: ForwardBatch) -> bool:
        """Decode-only batches (one new token and its logits per sequence) that fit a rung."""
        count = len(batch.segments)
        fits = 0 < count <= DECODE_RUNGS[-1] and batch.num_rows == count and len(batch.logits_rows) == count
        return self.disabled is None and fits

    def accepts_verify(self, batch: ForwardBatch) -> bool:
        """A verify (every row's logits, the model :attr:`~metrale.model.family.FamilyModel.verifying`)
        whose rows fit a decode rung, of a model that lets its verify replay the decode graphs
        (:attr:`~metrale.model.family.FamilyModel.verify_graph_capturable`, no recurrent state): run as
        :func:`as_decode_rows` through :meth:`run`."""
        model = self.model
        return (self.disabled is None and getattr(model, "verifying", False)
                and getattr(model, "verify_graph_capturable", False) and self.cache.state_slots is None
                and batch.every_row_logits and 0 < batch.num_rows <= DECODE_RUNGS[-1])

    def run_verify(self, batch: ForwardBatch, feed: Any = None) -> Any:
        """Logits of every row of a verify :meth:`accepts_verify` accepts, from the decode graph of
        its padded row count (recorded on first use, as a decode step, with the model not
        :attr:`~metrale.model.family.FamilyModel.verifying`: the graphs serve decode steps too)."""
        model = self.model
        model.verifying = False
        try:
            return self.run(as_decode_rows(batch), feed)
        finally:
            model.verifying = True

    def rung_size(self, rows: int) -> int:
        return next(size for size in DECODE_RUNGS if size >= rows)

    def table_width(self, bucket: int) -> int:
        """Columns of the block table the graphs of ``bucket`` read (:func:`table_width`)."""
        return table_width(bucket, self.block_size, self.max_blocks)

    def context_bucket(self, context: int) -> int:
        """The bucket whose graph replays a step whose longest sequence holds ``context`` tokens."""
        return next((bucket for bucket in self.buckets if bucket >= context), self.buckets[-1])

    def mixed_shape(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """The padded (decode rows, prompt rows) of a mixed step these graphs replay, or None:
        one or more one-token segments with their logits, then one prompt chunk of more than one
        row whose logits are its last row's or none, each within the largest rung and bucket."""
        if self.disabled is not None or self.mixed_disabled is not None:
            return None
        segments = batch.segments
        decode = len(segments) - 1
        if not 0 < decode <= MIXED_DECODE_RUNGS[-1] or segments[-1].logits == "all":
            return None
        prompt = batch.num_rows - decode
        if not 1 < prompt <= MIXED_PROMPT_BUCKETS[-1] or int(batch.row_starts[decode]) != decode:
            return None
        if len(batch.logits_rows) != decode + (segments[-1].logits == "last"):
            return None  # a decode row without its logits
        return (next(size for size in MIXED_DECODE_RUNGS if size >= decode),
                next(size for size in MIXED_PROMPT_BUCKETS if size >= prompt))

    def _mixed_rung(self, decode: int, prompt: int) -> MixedRung:
        rung = self.mixed_rungs.get((decode, prompt))
        if rung is None:
            rung = self.mixed_rungs[(decode, prompt)] = self._new_mixed_rung(decode, prompt)
        return rung

    def _new_mixed_rung(self, decode: int, prompt: int) -> MixedRung:
        import cupyx

        length = mixed_buffer_length(decode, prompt, self.max_blocks)
        host = cupyx.empty_pinned((length,), dtype=np.int32)
        host[:] = 0
        device = persistent_zeros(length)
        max_context = self.model.max_model_len
        return MixedRung(decode, prompt, host, device, mixed_batch(device, decode, prompt, self.max_blocks, max_context),
                         lora_batch=mixed_batch(device, decode, prompt, self.max_blocks, max_context, lora=True))

    def _fill_mixed(self, rung: MixedRung, batch: ForwardBatch | None) -> None:
        """Pack a mixed ``batch`` (or only padding rows) into the rung's pinned buffer and upload it."""
        import cupy

        if rung.uploaded is not None:
            rung.uploaded.synchronize()  # the previous step's copy has read the pinned buffer
        pack_mixed(rung.host, rung.decode, rung.prompt, self.max_blocks, batch)
        rung.device.data.copy_from_host_async(
            rung.host.ctypes.data_as(ctypes.c_void_p), rung.host.nbytes, self.backend.stream)
        if rung.uploaded is None:
            rung.uploaded = cupy.cuda.Event(disable_timing=True)
        rung.uploaded.record(self.backend.stream)

    def run_mixed(self, batch: ForwardBatch, feed: Any = None) -> Any:
        """Logits of a mixed batch :meth:`mixed_shape` accepts, as an eager run returns them: the
        decode rows', then the chunk's last row's when it asked (a fresh array). ``feed``, when
        given, is applied to the rung's device token ids once they are uploaded (pending tokens,
        :class:`~metrale.runner.runner.TokenFeed`; the decode rows keep their rows)."""
        import cupy

        shape = self.mixed_shape(batch)
        if shape is None:
            raise GraphCaptureError("run_mixed got a batch that mixed_shape does not accept")
        rung = self._mixed_rung(*shape)
        self._fill_mixed(rung, batch)
        if feed is not None:
            feed(rung.batch.token_ids)
        if batch.adapter_slots is not None:
            if rung.lora_graph is None:
                rung.lora_graph, rung.lora_output, logits, rung.lora_step_outputs = self._record(rung.lora_batch,
                                                                                                 mixed=True)
            else:
                self._launch(rung.lora_graph, 0)
                logits = rung.lora_output
                self.model.step_outputs = rung.lora_step_outputs
        elif rung.graph is None:
            rung.graph, rung.output, logits, rung.step_outputs = self._record(rung.batch, mixed=True)
        else:
            self._launch(rung.graph, 0)
            logits = rung.output
            self.model.step_outputs = rung.step_outputs
        rows = mixed_logits_rows(batch, rung.decode)
        result = cupy.empty((len(rows), logits.shape[1]), dtype=logits.dtype)
        stream, row_bytes = self.backend.stream, logits.shape[1] * logits.itemsize
        decode = len(batch.segments) - 1  # rows[:decode] is range(decode): one copy
        result.data.copy_from_device_async(logits.data, decode * row_bytes, stream)
        for index in range(decode, len(rows)):
            result[index:].data.copy_from_device_async(logits[rows[index]:].data, row_bytes, stream)
        return result

    def capture_mixed(self, decode_rows: int, max_prompt: int) -> None:
        """Record ahead of time the mixed-step graphs of every decode rung up to the one that holds
        ``decode_rows`` rows, each with every prompt bucket up to the one that holds ``max_prompt``
        (and the adapters' graphs of a model that serves LoRA)."""
        if self.disabled is not None or self.mixed_disabled is not None:
            return
        lora = getattr(self.model, "lora_layout", None) is not None
        top = min(max(decode_rows, 1), MIXED_DECODE_RUNGS[-1])
        last = next((size for size in MIXED_PROMPT_BUCKETS if size >= max_prompt), MIXED_PROMPT_BUCKETS[-1])
        for decode in MIXED_DECODE_RUNGS[: next(i for i, size in enumerate(MIXED_DECODE_RUNGS) if size >= top) + 1]:
            for prompt in MIXED_PROMPT_BUCKETS[: MIXED_PROMPT_BUCKETS.index(last) + 1]:
                rung = self._mixed_rung(decode, prompt)
                if rung.graph is None:
                    self._fill_mixed(rung, None)
                    rung.graph, rung.output, _, rung.step_outputs = self._record(rung.batch, mixed=True)
                    if self.mixed_disabled is not None:
                        return
                if lora and rung.lora_graph is None:
                    self._fill_mixed(rung, None)
                    rung.lora_graph, rung.lora_output, _, rung.lora_step_outputs = self._record(rung.lora_batch,
                                                                                                mixed=True)
                    if self.mixed_disabled is not None:
                        return

    def _rung(self, size: int) -> Rung:
        rung = self.rungs.get(size)
        if rung is not None:
            return rung
        import cupyx

        length = decode_buffer_length(size, self.max_blocks)
        host = cupyx.empty_pinned((length,), dtype=np.int32)
        host[:] = 0
        device = persistent_zeros(length)
        batch = decode_rung_batch(device, size, self.max_blocks, self.model.max_model_len)
        rung = self.rungs[size] = Rung(size, host, device, batch)
        return rung

    def _fill(self, rung: Rung, batch: ForwardBatch | None, bucket: int,
              feed: tuple[list[int], list[int]] | None = None) -> None:
        """Pack ``batch`` (or only padding rows) into the rung's pinned buffer as the graph of
        ``bucket`` reads it (:func:`pack_decode`, with ``feed``'s rows and indices) and upload
        what was packed."""
        import cupy

        if rung.uploaded is not None:
            rung.uploaded.synchronize()  # the previous step's copy has read the pinned buffer
        used = pack_decode(rung.host, rung.size, self.table_width(bucket), batch, feed)
        # (A raw copy: CuPy's ``set`` costs several times more host time.)
        rung.device.data.copy_from_host_async(rung.host.ctypes.data_as(ctypes.c_void_p), 4 * used, self.backend.stream)
        if rung.uploaded is None:
            rung.uploaded = cupy.cuda.Event(disable_timing=True)
        rung.uploaded.record(self.backend.stream)

    def run(self, batch: ForwardBatch, feed: Any = None) -> Any:
        """Logits ``[n, vocab]`` of a decode-only batch (a fresh array, not the graph's buffer);
        ``feed`` as :meth:`run_mixed`'s."""
        import cupy

        rung = self._rung(self.rung_size(batch.num_rows))
        bucket = self.context_bucket(batch.max_context)
        # The pending tokens of one sampler call (the usual case) travel in the metadata's upload.
        single = feed is not None and len(feed.groups) == 1
        self._fill(rung, batch, bucket, feed.groups[0][1:] if single else None)
        if single:
            source, rows, _ = feed.groups[0]
            start, count = len(_VECTORS) * rung.size, len(rows)
            self.backend.ops.feed_tokens(rung.batch.token_ids, source, rung.device[start : start + count],
                                         rung.device[start + rung.size : start + rung.size + count])
        elif feed is not None:
            feed(rung.batch.token_ids)
        key = (bucket, batch.adapter_slots is not None)
        if key not in rung.graphs:
            logits = self._record_decode(rung, *key)
        else:
            self._launch(rung.graphs[key], rung.size)
            logits = rung.outputs[key]
            self.model.step_outputs = rung.step_outputs[key]
        # A copy the next replay cannot overwrite (a raw device copy: an elementwise CuPy copy
        # costs several times more host time).
        rows = logits[: batch.num_rows]
        result = cupy.empty(rows.shape, dtype=rows.dtype)
        result.data.copy_from_device_async(rows.data, rows.nbytes, self.backend.stream)
        return result

    def _launch(self, graph: Any, rows: int) -> None:
        """Replay ``graph`` (of ``rows`` padded decode rows, 0 for a mixed step) on the stream,
        between CUDA events when :attr:`replay_events` is a list."""
        stream = self.backend.stream
        if self.replay_events is None:
            graph.launch(stream=stream)
            return
        import cupy

        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        graph.launch(stream=stream)
        end.record(stream)
        self.replay_events.append((start, end, rows))

    def capture(self, sizes: tuple[int, ...] = DECODE_RUNGS) -> None:
        """Record the graphs of ``sizes`` (every context bucket of each, and for a model that serves
        LoRA the adapters' graphs too) ahead of time, on padding rows only."""
        paths = (False, True) if getattr(self.model, "lora_layout", None) is not None else (False,)
        for size in sizes:
            rung = self._rung(self.rung_size(size))
            for bucket in self.buckets:
                for lora in paths:
                    if self.disabled is not None:
                        return
                    if (bucket, lora) not in rung.graphs:
                        self._fill(rung, None, bucket)
                        self._record_decode(rung, bucket, lora)

    def _record_decode(self, rung: Rung, bucket: int, lora: bool = False) -> Any:
        """Record ``rung``'s graph of ``bucket`` (the adapters' with ``lora``), unless graphs are
        turned off meanwhile; the eager run's logits."""
        batch = rung.bucket_batch(bucket, self.table_width(bucket), lora)
        graph, output, eager, outputs = self._record(batch)
        if graph is not None:
            key = (bucket, lora)
            rung.graphs[key], rung.outputs[key], rung.step_outputs[key] = graph, output, outputs
            rung.recorded_batches[key] = batch
        return eager

    def _record(self, batch: ForwardBatch, mixed: bool = False) -> tuple[Any, Any, Any, dict[str, Any]]:
        """``(graph, output, eager, step_outputs)``: the graph of ``model.forward_batch(batch)``,
        the logits buffer it writes, the logits of the eager run before it, and the model's
        :attr:`~metrale.model.family.FamilyModel.step_outputs` as the graph writes them (the eager run's
        stay the model's). ``graph`` and ``output`` are None when an op cannot be captured
        (graphs are then turned off for such steps)."""
        import cupy

        stream = self.backend.stream
        # This eager run computes the step (and compiles what is not compiled yet); the capture
        # below only records the same launches. It allocates from the default pool: what it keeps
        # for the batch (the attention's tile lists, made once per batch) must not share memory
        # with another graph's intermediates, which the graph pool hands out again once a capture
        # ends.
        eager = self.model.forward_batch(batch)
        eager_outputs = dict(self.model.step_outputs)
        stream.synchronize()
        with cupy.cuda.using_allocator(self.backend.graph_pool.malloc):
            # Relaxed mode: the pool may still cudaMalloc while recording (never inside the graph).
            stream.begin_capture(getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", 2))
            try:
                output = self.model.forward_batch(batch)
            except GraphCaptureError as error:
                if stream.is_capturing():
                    stream.end_capture()
                if mixed:
                    self.mixed_disabled = str(error)
                    self.mixed_rungs.clear()
                else:
                    self.disabled = str(error)
                logger.warning("%s steps of %s run without CUDA graphs: %s", "mixed" if mixed else "decode",
                               type(self.model).__name__, error)
                self.model.step_outputs = eager_outputs
                return None, None, eager, {}
            except BaseException:
                if stream.is_capturing():
                    stream.end_capture()
                raise
            graph = stream.end_capture()
        recorded, self.model.step_outputs = dict(self.model.step_outputs), eager_outputs
        return graph, output, eager, recorded
