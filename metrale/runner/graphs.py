"""CUDA-graph decode: one captured graph per padded batch size, replayed every step.

A decode step of ``n`` sequences is padded to the next rung (1, 2, 4, 8, 16, 24, 32, 48, 64, 96,
128). Each rung owns static device buffers for the step's row metadata (token ids, positions,
cache slots, block tables); the host packs one step's metadata into a pinned buffer and copies
it in with one transfer, then replays the rung's graph. Padding rows decode token 0 at position
0 into the reserved dummy block, so they never touch a real sequence.

The first step of a rung runs eagerly (its result is returned) and then records the graph; the
memory the graph uses comes from the backend's private pool. An error while recording ends and
discards the capture before it propagates; the next call records again. A model that runs an op
which cannot be captured (an op served by the host fallback of its reference) stops using graphs:
its decode steps run eagerly from then on, and a warning says which op.
"""

from __future__ import annotations

import ctypes
import logging
import math
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from metrale.batch import ForwardBatch
from metrale.errors import GraphCaptureError

logger = logging.getLogger(__name__)

DECODE_RUNGS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)

# Field order of the packed int32 metadata: six [B] vectors, then the [B, max_blocks] table.
_VECTORS = ("token_ids", "positions", "slot_mapping", "seq_index", "logits_rows", "state_slots")


@dataclass
class Rung:
    """Static buffers and the captured graph of one padded batch size."""

    size: int
    host: Any  # pinned int32 [6 B + B * max_blocks]
    device: Any  # device int32, same layout
    batch: ForwardBatch
    graph: Any = None
    output: Any = None
    uploaded: Any = None  # event recorded after the last host-to-device copy of ``host``


class CudaGraphRunner:
    """Replays ``model.forward_batch`` for decode-only batches from captured graphs."""

    def __init__(self, model: Any, backend: Any) -> None:
        # The model owns its runner; the runner refers back to it weakly (no reference cycle).
        self._model = weakref.ref(model)
        self.backend = backend
        self.block_size = model.cache.block_size
        # A sequence holds at most every block of the cache, however long max_model_len is.
        self.max_blocks = min(math.ceil(model.max_model_len / self.block_size), model.cache.num_blocks)
        self.rungs: dict[int, Rung] = {}
        #: Why graphs are off for this model (an op that cannot be captured), or None.
        self.disabled: str | None = None

    @property
    def model(self) -> Any:
        return self._model()

    def accepts(self, batch: ForwardBatch) -> bool:
        """Decode-only batches (one new token and its logits per sequence) that fit a rung."""
        count = len(batch.segments)
        fits = 0 < count <= DECODE_RUNGS[-1] and batch.num_rows == count and len(batch.logits_rows) == count
        return self.disabled is None and fits

    def rung_size(self, rows: int) -> int:
        return next(size for size in DECODE_RUNGS if size >= rows)

    def _rung(self, size: int) -> Rung:
        rung = self.rungs.get(size)
        if rung is not None:
            return rung
        import cupy
        import cupyx

        length = len(_VECTORS) * size + size * self.max_blocks
        host = cupyx.empty_pinned((length,), dtype=np.int32)
        host[:] = 0
        with cupy.cuda.using_allocator(self.backend.graph_pool.malloc):
            device = cupy.zeros(length, dtype=np.int32)
        views = {name: device[i * size : (i + 1) * size] for i, name in enumerate(_VECTORS)}
        table = device[len(_VECTORS) * size :].reshape(size, self.max_blocks)
        batch = ForwardBatch(
            segments=[], token_ids=views["token_ids"], positions=views["positions"], seq_index=views["seq_index"],
            slot_mapping=views["slot_mapping"], block_tables=table, row_starts=np.arange(size + 1),
            logits_rows=views["logits_rows"], max_context=self.model.max_model_len, state_slots=views["state_slots"],
        )
        rung = self.rungs[size] = Rung(size, host, device, batch)
        return rung

    def _fill(self, rung: Rung, batch: ForwardBatch | None) -> None:
        """Pack ``batch`` (or only padding rows) into the rung's pinned buffer and upload it."""
        import cupy

        size, host = rung.size, rung.host
        if rung.uploaded is not None:
            rung.uploaded.synchronize()  # the previous step's copy has read the pinned buffer
        host[:] = 0
        arange = np.arange(size, dtype=np.int32)
        host[3 * size : 4 * size] = arange  # seq_index: each row its own table row
        host[4 * size : 5 * size] = arange  # logits_rows: every row
        if batch is not None:
            rows = batch.num_rows
            host[0:rows] = batch.token_ids
            host[size : size + rows] = batch.positions
            host[2 * size : 2 * size + rows] = batch.slot_mapping
            if batch.state_slots is not None:
                host[5 * size : 5 * size + rows] = batch.state_slots  # padding rows: the dummy slot 0
            table = host[6 * size :].reshape(size, self.max_blocks)
            width = batch.block_tables.shape[1]
            table[:rows, :width] = batch.block_tables
        # (A raw copy: CuPy's ``set`` costs several times more host time.)
        rung.device.data.copy_from_host_async(host.ctypes.data_as(ctypes.c_void_p), host.nbytes, self.backend.stream)
        if rung.uploaded is None:
            rung.uploaded = cupy.cuda.Event(disable_timing=True)
        rung.uploaded.record(self.backend.stream)

    def run(self, batch: ForwardBatch) -> Any:
        """Logits ``[n, vocab]`` of a decode-only batch (a fresh array, not the graph's buffer)."""
        import cupy

        rung = self._rung(self.rung_size(batch.num_rows))
        self._fill(rung, batch)
        if rung.graph is None:
            logits = self._capture(rung)
        else:
            rung.graph.launch(stream=self.backend.stream)
            logits = rung.output
        # A copy the next replay cannot overwrite (a raw device copy: an elementwise CuPy copy
        # costs several times more host time).
        rows = logits[: batch.num_rows]
        result = cupy.empty(rows.shape, dtype=rows.dtype)
        result.data.copy_from_device_async(rows.data, rows.nbytes, self.backend.stream)
        return result

    def capture(self, sizes: tuple[int, ...] = DECODE_RUNGS) -> None:
        """Record the graphs of ``sizes`` ahead of time, on padding rows only."""
        for size in sizes:
            rung = self._rung(self.rung_size(size))
            if rung.graph is None:
                self._fill(rung, None)
                self._capture(rung)

    def _capture(self, rung: Rung) -> Any:
        import cupy

        stream = self.backend.stream
        with cupy.cuda.using_allocator(self.backend.graph_pool.malloc):
            # This eager run computes the step (and compiles what is not compiled yet); the
            # capture below only records the same launches.
            eager = self.model.forward_batch(rung.batch)
            stream.synchronize()
            # Relaxed mode: the pool may still cudaMalloc while recording (never inside the graph).
            stream.begin_capture(getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", 2))
            try:
                output = self.model.forward_batch(rung.batch)
            except GraphCaptureError as error:
                if stream.is_capturing():
                    stream.end_capture()
                self.disabled = str(error)
                logger.warning("decode steps of %s run without CUDA graphs: %s", type(self.model).__name__, error)
                return eager
            except BaseException:
                if stream.is_capturing():
                    stream.end_capture()
                raise
            rung.graph = stream.end_capture()
            rung.output = output
        return eager
