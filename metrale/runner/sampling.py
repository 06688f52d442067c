"""Token sampling: one token per logits row, on the host or on the device.

Both backends sample the same way (:mod:`metrale.kernels.sampling`): a request's ``seed`` and
the index of the token being drawn (``step``) fix the uniform draw, so a seed gives the same
tokens on the CPU and on the GPU wherever the two backends' logits agree. A row whose logits hold
NaN or +infinity, or only -infinity, gets token -1.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np

from metrale.params import SamplingParams

# metrale.kernels.sampling holds the kernel beside the reference (it imports numba), so it is
# imported on first use: ``import metrale`` stays free of numba.


def request_seed(seed: int | None, engine_seed: int, request_index: int) -> int:
    """The seed of one request: its own, or one derived from the engine seed and its index."""
    from metrale.kernels.sampling import _splitmix64

    if seed is not None:
        return int(seed)
    return _splitmix64((int(engine_seed) << 32) ^ int(request_index)) >> 1


def parameter_arrays(params: Sequence[SamplingParams], vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(temperature, top_k, top_p)`` arrays of the rows: a temperature below
    :data:`~metrale.params.MIN_TEMPERATURE` is stored as 0 (greedy), top_k -1 as 0 (off) and a
    top_k above the vocabulary as the vocabulary size (all tokens)."""
    temperature = np.array([0.0 if p.greedy else p.temperature for p in params], dtype=np.float32)
    top_k = np.array([min(max(p.top_k, 0), vocab_size) for p in params], dtype=np.int32)
    top_p = np.array([p.top_p for p in params], dtype=np.float32)
    return temperature, top_k, top_p


def sample_rows(logits: np.ndarray, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]) -> list[int]:
    """One token per row of ``logits [R, vocab]``."""
    from metrale.kernels.sampling import request_uniform, sample_reference

    logits = np.asarray(logits, dtype=np.float32).reshape(len(params), -1)
    temperature, top_k, top_p = parameter_arrays(params, logits.shape[1])
    uniforms = np.array([request_uniform(s, t) for s, t in zip(seeds, steps)], dtype=np.float32)
    return sample_reference(logits, temperature, top_k, top_p, uniforms).tolist()


def sample_token(logits: np.ndarray, params: SamplingParams, seed: int, step: int) -> int:
    """The token drawn from ``logits [vocab]`` by a request with ``seed`` at ``step``."""
    return sample_rows(np.asarray(logits).reshape(1, -1), [params], [seed], [step])[0]


class SampledTokens:
    """The tokens one step sampled, one per logits row: :attr:`device` holds them where the
    backend computes (int32 ``[R]``, what a later step's inputs can be fed from before they are
    read back, :meth:`metrale.runner.ModelRunner.run`), :meth:`tokens` on the host, waiting for
    them the first time it is called (-1 for a row with nothing to sample from)."""

    def __init__(self, device: Any, read: Any = None, tokens: list[int] | None = None) -> None:
        self.device = device
        self._read = read
        self._tokens = tokens

    def tokens(self) -> list[int]:
        if self._tokens is None:
            self._tokens, self._read = self._read(), None
        return self._tokens


class TokenSampler:
    """Samples one token per row of a step's logits (see the module docstring)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def sample(self, logits: Any, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]) -> list[int]:
        """One token per row of ``logits [R, vocab]`` (-1 for a row with nothing to sample from)."""
        return self.sample_async([logits], params, seeds, steps).tokens()

    def sample_async(self, logits: Sequence[Any], params: Sequence[SamplingParams], seeds: Sequence[int],
                     steps: Sequence[int]) -> SampledTokens:
        """One token per row of the row blocks ``logits`` (each ``[r, vocab]``, taken in order),
        queued on the backend without waiting for it (on the CPU it is computed at once)."""
        parts = [np.asarray(self.backend.to_numpy(part), dtype=np.float32) for part in logits]
        tokens = sample_rows(np.concatenate([p.reshape(len(p), -1) for p in parts]), params, seeds, steps) if parts else []
        return SampledTokens(np.asarray(tokens, dtype=np.int32), tokens=tokens)

    def close(self) -> None:
        """Drop device buffers (none on the host)."""


def new_sampler(backend: Any) -> TokenSampler:
    """The sampler of ``backend``: the sampling kernel on the GPU, the reference on the CPU."""
    if backend.name == "cuda":
        return CudaSampler(backend)
    return TokenSampler(backend)


class CudaSampler(TokenSampler):
    """The sampling kernel on the backend's stream, replayed from a graph per batch shape.

    Two sets of buffers per shape, used in turn: the tokens of one call stay on the device (and
    are read back) while the next call samples, as overlap scheduling needs. Before a set is
    used again, the call that used it last is read back."""

    def __init__(self, backend: Any) -> None:
        super().__init__(backend)
        from metrale.kernels.sampling import sample

        self._sample = sample
        self._buffers: dict[tuple[int, int, int], Any] = {}
        self._turn = 0

    def close(self) -> None:
        self._buffers.clear()

    def sample_async(self, logits: Sequence[Any], params: Sequence[SamplingParams], seeds: Sequence[int],
                     steps: Sequence[int]) -> SampledTokens:
        backend = self.backend
        cp, stream = backend.xp, backend.stream
        rows = len(params)
        with stream:
            parts = []
            for part in logits:
                part = part.reshape(len(part), -1)
                if part.dtype != np.float32 or not part.flags.c_contiguous:
                    part = cp.ascontiguousarray(part, dtype=np.float32)
                parts.append(part)
        if sum(len(part) for part in parts) != rows:
            from metrale.errors import KernelArgumentError

            raise KernelArgumentError(f"sampling: {sum(len(p) for p in parts)} logits rows for {rows} requests")
        vocab = parts[0].shape[1]
        self._turn ^= 1
        buffers = self._buffers_for(rows, vocab, self._turn)
        if buffers.last is not None:
            buffers.last.tokens()  # its tokens are read before the buffers are written again
        temperature, top_k, top_p = parameter_arrays(params, vocab)
        host = buffers.host
        host.seeds[:] = np.asarray(seeds, dtype=np.uint64).view(np.int64)
        host.steps[:] = steps
        host.temperature[:] = temperature
        host.top_k[:] = top_k
        host.top_p[:] = top_p
        host.uniforms[:] = -1.0  # draw from (seed, step)
        with stream:
            # One upload of every row's parameters, the logits into the sampler's own buffer,
            # the kernel (replayed from a graph after its first run: a numba launch costs far
            # more host time), one download of the tokens.
            buffers.device.data.copy_from_host_async(host.packed.ctypes.data_as(ctypes.c_void_p), host.packed.nbytes, stream)
            offset = 0
            for part in parts:
                buffers.logits[offset:].data.copy_from_device_async(part.data, part.nbytes, stream)
                offset += len(part)
            if buffers.graph:
                buffers.graph.launch(stream=stream)
            else:
                self._run(buffers)
                if backend.cuda_graphs and buffers.graph is None:
                    buffers.graph = self._record(buffers)
            tokens = buffers.views.tokens
            tokens.data.copy_to_host_async(host.tokens.ctypes.data_as(ctypes.c_void_p), host.tokens.nbytes, stream)
            buffers.done.record(stream)

        def read() -> list[int]:
            buffers.done.synchronize()
            return host.tokens.tolist()

        sampled = buffers.last = SampledTokens(tokens, read)
        return sampled

    def _run(self, buffers: Any) -> None:
        device = buffers.views
        self._sample(
            buffers.logits, device.temperature, device.top_k, device.top_p, device.seeds, device.steps,
            device.uniforms, device.tokens, self.backend.stream,
        )

    def _record(self, buffers: Any) -> Any:
        """A graph of the sampler kernel on ``buffers``, or False when recording fails (the
        sampler then stays eager for this shape; the capture is ended and discarded)."""
        stream = self.backend.stream
        stream.begin_capture(getattr(self.backend.xp.cuda.runtime, "streamCaptureModeRelaxed", 2))
        try:
            self._run(buffers)
            return stream.end_capture()
        except Exception:
            if stream.is_capturing():
                stream.end_capture()
            return False

    def _buffers_for(self, rows: int, vocab: int, turn: int) -> Any:
        """Pinned host and device buffers of ``rows`` rows of sampling parameters, logits and
        tokens, with the sampler's graph; kept per shape and turn."""
        buffers = self._buffers.get((rows, vocab, turn))
        if buffers is not None:
            return buffers
        import cupyx

        backend = self.backend
        # Packed per row: seed and step (int64), temperature, top_k, top_p, uniform (32-bit).
        packed = cupyx.empty_pinned((rows * 32,), dtype=np.uint8)
        tokens = cupyx.empty_pinned((rows,), dtype=np.int32)
        with backend.stream, backend.xp.cuda.using_allocator(backend.graph_pool.malloc):
            device = backend.xp.empty(rows * 32, dtype=np.uint8)
            out = backend.xp.empty(rows, dtype=np.int32)
            logits = backend.xp.empty((rows, vocab), dtype=np.float32)

        def fields(array: Any) -> dict[str, Any]:
            return {
                "seeds": array[: 8 * rows].view(np.int64),
                "steps": array[8 * rows : 16 * rows].view(np.int64),
                "temperature": array[16 * rows : 20 * rows].view(np.float32),
                "top_k": array[20 * rows : 24 * rows].view(np.int32),
                "top_p": array[24 * rows : 28 * rows].view(np.float32),
                "uniforms": array[28 * rows : 32 * rows].view(np.float32),
            }

        buffers = self._buffers[(rows, vocab, turn)] = SimpleNamespace(
            host=SimpleNamespace(packed=packed, tokens=tokens, **fields(packed)),
            device=device,
            logits=logits,
            views=SimpleNamespace(tokens=out, **fields(device)),
            graph=None,
            done=backend.xp.cuda.Event(disable_timing=True),
            last=None,
        )
        return buffers
