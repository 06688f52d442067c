"""The CUDA backend: CuPy arrays on one device, ``numba.cuda`` kernels, cuBLAS GEMMs.

Weights and the KV cache hold bf16 bits in ``uint16`` arrays; the residual stream and the GEMM
outputs are float32; the inputs of every GEMM are bf16. All work is queued on one engine stream,
which is CuPy's current stream on this thread and the stream every numba kernel and the cuBLAS
handle use. The ops are those of :mod:`metrale.ops`, served by :class:`metrale.ops.cuda.CudaKernels`;
decode steps are replayed from CUDA graphs (:mod:`metrale.runner.graphs`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from metrale.backends.base import Backend, with_device_arrays
from metrale.kernels.bf16 import float32_to_bf16


class CudaBackend(Backend):
    """CuPy + numba.cuda + cuBLAS on device ``device_id``."""

    name = "cuda"
    cache_dtype = np.uint16

    def __init__(self, device_id: int = 0, cuda_graphs: bool = True, environment: Any = None) -> None:
        import cupy

        from metrale.config import read_environment
        from metrale.kernels import _compile, _device, _launch
        from metrale.ops.builtin import builtin_registry
        from metrale.ops.cuda import CudaKernels

        #: The ``METRALE_*`` settings (read from the environment when not given): the op table binds
        #: the kernels they enable, and they say how kernels launch.
        self.environment = environment if environment is not None else read_environment()
        # How kernels launch, not which: process-wide settings of the kernel modules.
        _device.DIRECT_LAUNCH = not self.environment.numba_launch
        _launch.ENABLED = self.environment.dependent_launch
        if self.environment.kernel_cache is not None:
            _compile.CACHE_DIR = Path(self.environment.kernel_cache)
        self.xp = cupy
        self.device = cupy.cuda.Device(device_id)
        self.device.use()
        # Every CuPy call of the engine runs under ``activate()``; the stream is never made
        # current globally, so two backends (two models) in one process do not share it.
        self.stream = cupy.cuda.Stream(non_blocking=True)
        #: The built-in ops' CUDA implementations (the op table binds them).
        self.kernels = CudaKernels(self.stream)
        #: Private pool of what a graph capture allocates (the graph's intermediates), so eager work
        #: never reuses it. It hands the memory a finished capture freed to the next capture (graphs
        #: replay one at a time), so buffers that outlive a step (graph inputs, the sampler's) come
        #: from the default pool instead.
        self.graph_pool = cupy.cuda.MemoryPool()
        self.cuda_graphs = cuda_graphs
        #: The staging ring of :meth:`load_weight` while a model loads (:meth:`finish_loading` drops it).
        self._reader: Any = None
        self.ops = builtin_registry().table(self)

    # ------------------------------------------------------------------------------ arrays

    def load_weight(self, checkpoint: Any, *parts: tuple) -> Any:
        if self._quantizes_online(checkpoint, parts):
            return self._online_fp8_weight(checkpoint, parts)
        quantized = checkpoint.quantized_parts(parts)
        if quantized is not None:
            return self.quantized_weight(quantized)
        staged = self._staged_bf16_weight(checkpoint, parts)
        if staged is not None:
            return staged
        arrays, raw_names = [], []
        for part in parts:
            name, shape = part[0], part[1]
            rows, columns = (tuple(part[2:]) + (None, None))[:2]
            if checkpoint.info(name).dtype == "BF16":
                array = checkpoint.raw(name, shape)
                array = array[rows if rows is not None else slice(None)]
                arrays.append(array if columns is None else array[:, columns])
                raw_names.append(name)
            else:
                arrays.append(float32_to_bf16(checkpoint.tensor(*part)))  # checked on the host
        host = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        with self.stream:
            weight = self.xp.asarray(np.ascontiguousarray(host, dtype=np.uint16))
        if raw_names:
            self._check_bf16_finite(weight, checkpoint, raw_names)
        return weight

    def _staged_bf16_weight(self, checkpoint: Any, parts: Sequence[tuple]) -> Any:
        """``parts`` (bf16, whole or runs of rows) read from their files straight into one device
        array through the pinned staging ring (:mod:`metrale.loading.staged_read`), then checked
        for NaN and infinity on the device; None where a part needs the host (another dtype, a
        rank's columns, rows with a step) or the parts do not stack."""
        from metrale.loading.staged_read import ByteRange

        rows_of_parts, trailing = [], None
        for part in parts:
            rows, columns = (tuple(part[2:]) + (None, None))[:2]
            info = checkpoint.info(part[0])
            if (info.dtype != "BF16" or columns is not None or not info.shape
                    or (rows is not None and (not isinstance(rows, slice) or rows.step not in (None, 1)))):
                return None
            if trailing is not None and info.shape[1:] != trailing:
                return None
            trailing = info.shape[1:]
            rows_of_parts.append(len(range(*rows.indices(info.shape[0]))) if rows is not None else info.shape[0])
        assert trailing is not None  # load_weight takes at least one part
        ranges, target = [], 0
        for part in parts:
            rows = (tuple(part[2:]) + (None,))[0]
            found = checkpoint.stored_bytes(part[0], part[1], rows)
            assert found is not None  # rows are a plain slice (checked above)
            file, first, size = found
            ranges.append(ByteRange(file, first, size, target))
            target += size
        with self.stream:
            weight = self.xp.empty((sum(rows_of_parts), *trailing), dtype=np.uint16)
        destination, runtime = weight.data.ptr, self.xp.cuda.runtime
        stream = self.stream

        def copy(piece: ByteRange, filled: np.ndarray) -> Any:
            runtime.memcpyAsync(destination + piece.target, filled.ctypes.data, piece.size,
                                runtime.memcpyHostToDevice, stream.ptr)
            done = self.xp.cuda.Event(block=False, disable_timing=True)
            done.record(stream)
            return done

        self._weight_reader(checkpoint).read(ranges, copy)
        self._check_bf16_finite(weight, checkpoint, [part[0] for part in parts])  # waits for the copies
        return weight

    def _weight_reader(self, checkpoint: Any) -> Any:
        """The loading's staged reader, made at its first weight: a ring of ``2 * READ_WORKERS``
        pinned chunks, or fewer where the whole checkpoint fits in fewer (a small model's start
        does not wait for page-locking memory it would never fill)."""
        if self._reader is None:
            import cupyx

            from metrale.loading.staged_read import CHUNK_BYTES, READ_WORKERS, StagedReader

            stored = sum(info.end - info.begin for info in map(checkpoint.info, checkpoint.names()))
            count = max(1, min(2 * READ_WORKERS, -(-stored // CHUNK_BYTES)))
            buffers = [cupyx.empty_pinned((CHUNK_BYTES,), dtype=np.uint8) for _ in range(count)]
            self._reader = StagedReader(buffers, lambda done: done.synchronize(), READ_WORKERS)
        return self._reader

    def finish_loading(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
            self.xp.get_default_pinned_memory_pool().free_all_blocks()

    def _check_bf16_finite(self, weight: Any, checkpoint: Any, names: list[str]) -> None:
        """Refuse a bf16 weight holding NaN or infinity (all exponent bits set), counted on the
        device after the upload (:mod:`metrale.kernels.weight_check`): one small kernel and one read
        of the count per weight."""
        from metrale.kernels import weight_check

        with self.stream:
            found = self.xp.zeros((1,), dtype=np.uint64)
            weight_check.add_nonfinite_count(self.xp.ascontiguousarray(weight), found, self.stream)
            bad = int(found.get(stream=self.stream)[0])
        if bad:
            from metrale.errors import NonFiniteWeightError

            raise NonFiniteWeightError(
                f"{checkpoint.path}: {bad} NaN or infinite values in {' / '.join(repr(n) for n in names)}; "
                "the checkpoint is corrupt"
            )

    @staticmethod
    def _quantizes_online(checkpoint: Any, parts: Sequence[tuple]) -> bool:
        """Whether ``parts`` are bf16 matrices that ``quantization="fp8"`` quantizes at load: then
        the device quantizes them (the host's conversion takes seconds a matrix of an 8B model)."""
        weight_format = getattr(checkpoint, "weight_format", None)
        return (getattr(weight_format, "online", False) and getattr(weight_format, "codes_format", None) == "fp8"
                and all(checkpoint.is_quantized(part[0]) and checkpoint.info(part[0]).dtype == "BF16"
                        for part in parts))

    def _online_fp8_weight(self, checkpoint: Any, parts: Sequence[tuple]) -> Any:
        """``parts`` stacked along the rows and quantized to FP8 on the device as
        :func:`~metrale.kernels.quantized.quantize_fp8_per_channel` does on the host (the same codes
        and scales): whole rows first, then a rank's columns taken, so a row's scale is the same on
        every rank."""
        from metrale.kernels import quantized_gemv
        from metrale.kernels.quantized import QuantizedWeight

        stacked, columns = [], None
        for part in parts:
            name, shape = part[0], part[1]
            rows, columns = (tuple(part[2:]) + (None, None))[:2]
            array = checkpoint.raw(name, shape)
            stacked.append(array[rows if rows is not None else slice(None)])
        host = stacked[0] if len(stacked) == 1 else np.concatenate(stacked)
        xp = self.xp
        with self.stream:
            bits = xp.asarray(np.ascontiguousarray(host, dtype=np.uint16))
            self._check_bf16_finite(bits, checkpoint, [part[0] for part in parts])
            matrix = (bits.astype(np.uint32) << 16).view(np.float32)
            codes = xp.empty(matrix.shape, dtype=np.uint8)
            scales = xp.empty((matrix.shape[0],), dtype=np.float32)
            quantized_gemv.quantize_matrix_fp8(matrix, codes, scales, self.stream)
            del matrix, bits
            if columns is not None:
                codes = xp.ascontiguousarray(codes[:, columns])
        shape = (int(codes.shape[0]), int(codes.shape[1]))
        return QuantizedWeight("fp8", codes, scales.reshape(-1, 1), (1, shape[1]), shape, activations="fp8_token",
                               source="online fp8")

    def quantized_weight(self, host: Any) -> Any:
        """A :class:`~metrale.kernels.quantized.QuantizedWeight` of host arrays with its arrays on the
        device (codes uint8, scales and zero points float32, the act-order int32; a static input
        scale stays a host number, a kernel argument)."""
        from dataclasses import replace

        def upload(array: Any, dtype: Any) -> Any:
            return None if array is None else self.xp.asarray(np.ascontiguousarray(array, dtype=dtype))

        with self.stream:
            return replace(host, codes=upload(host.codes, np.uint8), scales=upload(host.scales, np.float32),
                           zeros=upload(host.zeros, np.float32), input_order=upload(host.input_order, np.int32))

    def constant(self, host: np.ndarray) -> Any:
        with self.stream:
            return self.xp.asarray(np.ascontiguousarray(host, dtype=np.float32))

    def weight(self, host: np.ndarray) -> Any:
        with self.stream:
            return self.xp.asarray(np.ascontiguousarray(float32_to_bf16(np.asarray(host, dtype=np.float32))))

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> Any:
        with self.stream:
            return self.xp.zeros(shape, dtype=dtype)

    def to_numpy(self, array: Any) -> np.ndarray:
        with self.stream:
            host = self.xp.asnumpy(array, stream=self.stream)
        self.stream.synchronize()
        return np.asarray(host, dtype=np.float32)

    def prepare_batch(self, batch: Any) -> Any:
        return with_device_arrays(batch, self.xp.asarray)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def activate(self) -> Any:
        return self.stream

    def default_cache_bytes(self) -> int:
        free, _ = self.xp.cuda.runtime.memGetInfo()
        return int(0.8 * free)

    def close(self) -> None:
        """Give every unused block of the memory pools back to the device (call once the models,
        caches and samplers of this backend are dropped)."""
        self.finish_loading()
        self.stream.synchronize()
        self.graph_pool.free_all_blocks()
        self.xp.get_default_memory_pool().free_all_blocks()
        self.xp.get_default_pinned_memory_pool().free_all_blocks()

    def available_memory_bytes(self) -> int | None:
        free, _ = self.xp.cuda.runtime.memGetInfo()
        # Blocks CuPy's pool holds but does not use can be handed out again.
        pool = self.xp.get_default_memory_pool()
        return int(free + pool.free_bytes())

    def end_graph_capture(self, stream: Any) -> None:
        """End and discard the capture open on the engine stream, if any."""
        if self.stream.is_capturing():
            self.stream.end_capture()
