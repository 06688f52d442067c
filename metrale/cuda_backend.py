"""The CUDA backend: CuPy arrays on one device, ``numba.cuda`` kernels, cuBLAS GEMMs.

Weights and the KV cache hold bf16 bits in ``uint16`` arrays; the residual stream and the GEMM
outputs are float32; the inputs of every GEMM are bf16. All work is queued on one engine stream,
which is CuPy's current stream on this thread and the stream every numba kernel and the cuBLAS
handle use. Decode steps are replayed from CUDA graphs (:mod:`metrale.engine.cuda_graphs`).
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np

from metrale.backend import Backend, with_device_arrays
from metrale.checkpoint import float32_to_bf16


class CudaBackend(Backend):
    """CuPy + numba.cuda + cuBLAS on device ``device_id``."""

    name = "cuda"
    cache_dtype = np.uint16

    def __init__(self, device_id: int = 0, cuda_graphs: bool = True) -> None:
        import cupy

        from metrale.kernels import (
            activation,
            attention,
            attention_latent,
            attention_prefill,
            embedding,
            gated,
            gated_delta,
            gemv,
            head_linear,
            moe,
            rmsnorm,
            rope,
        )
        from metrale.kernels.linear import CublasGemm
        from metrale.kernels.sampling import sample

        self.xp = cupy
        self.device = cupy.cuda.Device(device_id)
        self.device.use()
        # Every CuPy call of the engine runs under ``activate()``; the stream is never made
        # current globally, so two backends (two models) in one process do not share it.
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.gemm = CublasGemm(self.stream)
        #: Private pool of the memory captured graphs use, so eager work never reuses it.
        self.graph_pool = cupy.cuda.MemoryPool()
        self.cuda_graphs = cuda_graphs
        #: Batches of up to this many rows use the numba GEMV kernels instead of cuBLAS (0: never).
        #: cuBLAS measured about twice as fast on the H200 (docs/benchmarks), so never by default.
        self.gemv_rows = 0
        self._sample = sample
        self._sampling: dict[tuple[int, int], Any] = {}
        self._count_nonfinite_bf16: Any = None
        cp, stream = cupy, self.stream
        f32, bf16 = np.float32, np.uint16

        def embed(weight, ids):
            out = cp.empty((ids.shape[0], weight.shape[1]), dtype=f32)
            return embedding.embedding(weight, ids, out, stream)

        def rmsnorm_residual(x, residual, weight, eps, offset=0.0):
            x = cp.ascontiguousarray(x)
            add = residual is not None
            residual = cp.ascontiguousarray(residual) if add else cp.empty_like(x)
            out = cp.empty(x.shape, dtype=bf16)
            rmsnorm.rmsnorm_residual(x, residual, weight, eps, offset, add, out, stream)
            return out, residual

        def rmsnorm_only(x, weight, eps, offset=0.0):
            return rmsnorm_residual(x, None, weight, eps, offset)[0]

        def to_bf16(x):
            x = cp.ascontiguousarray(x)
            return activation.to_bf16(x, cp.empty(x.shape, dtype=bf16), stream)

        def uses_gemv(x):
            return x.shape[0] <= self.gemv_rows and gemv.supports(x.shape[0], x.shape[1])

        def linear(x, weight, bias=None):
            x = to_bf16(x) if x.dtype == f32 else cp.ascontiguousarray(x)
            out = cp.empty((x.shape[0], weight.shape[0]), dtype=f32)
            if uses_gemv(x):
                gemv.gemv(x, weight, out, stream)
            else:
                self.gemm(x, weight, out)
            if bias is not None:
                out += bias
            return out

        def linear_silu(x, weight, bias=None):
            x = to_bf16(x) if x.dtype == f32 else cp.ascontiguousarray(x)
            if bias is None and uses_gemv(x):
                return gemv.gemv_silu(x, weight, cp.empty((x.shape[0], weight.shape[0] // 2), dtype=bf16), stream)
            return silu_and_mul(linear(x, weight, bias))

        def qkv_rope_cache(qkv, positions, slot_mapping, inv_freq, attention_factor, num_heads, num_kv_heads,
                           head_dim, k_cache, v_cache, q_norm=None, k_norm=None, eps=1e-6, norm_offset=0.0,
                           interleaved=False):
            q = cp.empty((qkv.shape[0], num_heads, head_dim), dtype=f32)
            return rope.qkv_rope_cache(
                qkv, positions, slot_mapping, inv_freq, attention_factor, num_heads, num_kv_heads, head_dim,
                k_cache, v_cache, q, q_norm, k_norm, eps, norm_offset, interleaved, stream,
            )

        def decode_attention(q, k_cache, v_cache, batch, rows, scale, sliding_window, out):
            # The first ``rows`` rows, one per segment, through the split-K decode kernel.
            heads, kv_heads, value_dim = q.shape[1], k_cache.shape[2], v_cache.shape[3]
            splits = attention.split_count(rows, heads, kv_heads, q.shape[2], value_dim, batch.max_context)
            workspace = (
                cp.empty((rows, heads, splits, value_dim), dtype=f32),
                cp.empty((rows, heads, splits), dtype=f32),
                cp.empty((rows, heads, splits), dtype=f32),
            )
            return attention.paged_attention(
                q[:rows], k_cache, v_cache, batch.block_tables, batch.seq_index[:rows], batch.positions[:rows],
                scale, sliding_window, batch.max_context, workspace, out[:rows], stream,
            )

        def paged_attention(q, k_cache, v_cache, batch, scale, sliding_window):
            rows, heads = q.shape[0], q.shape[1]
            kv_heads, value_dim = k_cache.shape[2], v_cache.shape[3]
            out = cp.empty((rows, heads * value_dim), dtype=bf16)
            starts = batch.row_starts
            # Leading one-row segments (the decode rows of a mixed step) go to the decode kernel;
            # the prefill kernel serves the rest.
            lengths = np.diff(starts)
            single = int(np.argmax(lengths != 1)) if (lengths != 1).any() else len(lengths)
            if single < len(lengths) and attention_prefill.supports(heads, kv_heads, q.shape[2], value_dim):
                if single:
                    decode_attention(q, k_cache, v_cache, batch, single, scale, sliding_window, out)
                tiles = attention_prefill.query_tiles(starts[single:], attention_prefill.rows_per_tile(heads, kv_heads))
                attention_prefill.paged_attention_prefill(
                    q, attention_prefill.as_words(k_cache), attention_prefill.as_words(v_cache), batch.block_tables,
                    batch.seq_index, batch.positions, cp.asarray(tiles), scale, sliding_window, out, stream,
                )
                return out
            return decode_attention(q, k_cache, v_cache, batch, rows, scale, sliding_window, out)

        def silu_and_mul(gate_up):
            out = cp.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=bf16)
            return activation.silu_and_mul(gate_up, out, stream)

        def as_bf16(x):
            return to_bf16(x) if x.dtype == f32 else cp.ascontiguousarray(x)

        def latent_attention(q, latent, batch, value_dim, scale):
            out = cp.empty((q.shape[0], q.shape[1] * value_dim), dtype=bf16)
            return attention_latent.latent_attention(
                cp.ascontiguousarray(q, dtype=f32), latent, batch.block_tables, batch.seq_index, batch.positions,
                value_dim, scale, batch.max_context, out, stream,
            )

        def head_linear_op(x, weight):
            rows, heads = x.shape[0], x.shape[1]
            out = cp.empty((rows, heads, weight.shape[0] // heads), dtype=f32)
            return head_linear.head_linear(as_bf16(x), weight, out, stream)

        def moe_route(x, gate, bias, method, n_group, topk_group, top_k, renormalise, scaling):
            x = as_bf16(x)
            logits = moe.router_logits(x, gate, cp.empty((x.shape[0], gate.shape[0]), dtype=f32), stream)
            chosen = cp.empty((x.shape[0], top_k), dtype=np.int32)
            weights = cp.empty((x.shape[0], top_k), dtype=f32)
            return moe.route(logits, bias, method, n_group, topk_group, top_k, renormalise, scaling, chosen, weights,
                             stream)

        def gdn_conv_update(inputs, weight, conv_state, slots):
            out = cp.empty(inputs.shape, dtype=f32)
            return gated_delta.conv_update(cp.ascontiguousarray(inputs, dtype=f32), weight, conv_state, slots, out,
                                           stream)

        def gdn_recurrent_step(q, k, v, g, beta, state, slots):
            out = cp.empty(v.shape, dtype=f32)
            contiguous = [cp.ascontiguousarray(a, dtype=f32) for a in (q, k, v, g, beta)]
            return gated_delta.recurrent_step(*contiguous, state, slots, out, stream)

        def latent_cache_write(kv_a, norm_weight, eps, positions, inv_freq, attention_factor, interleaved,
                               slot_mapping, latent):
            attention_latent.latent_cache_write(
                cp.ascontiguousarray(kv_a, dtype=f32), norm_weight, eps, positions, inv_freq, attention_factor,
                interleaved, slot_mapping, latent, stream,
            )

        def gdn_prompt_rule(q, k, v, g, beta, state, slots, starts):
            out = cp.empty(v.shape, dtype=f32)
            contiguous = [cp.ascontiguousarray(a, dtype=f32) for a in (q, k, v, g, beta)]
            return gated_delta.prompt_rule(*contiguous, state, cp.asarray(slots, dtype=np.int32),
                                           cp.asarray(starts, dtype=np.int32), out, stream)

        def gated_rmsnorm(x, z, weight, eps):
            width = x.shape[-1]
            flat_x = cp.ascontiguousarray(x, dtype=f32).reshape(-1, width)
            out = cp.empty(flat_x.shape, dtype=bf16)
            gated.gated_rmsnorm(flat_x, cp.ascontiguousarray(z, dtype=f32).reshape(-1, width), weight, eps, out, stream)
            return out.reshape(x.shape)

        def sigmoid_gate(x, gate):
            out = cp.empty(x.shape, dtype=bf16)
            return gated.sigmoid_gate(as_bf16(x), cp.ascontiguousarray(gate, dtype=f32), out, stream)

        def moe_experts(x, chosen, weights, gate_up, down):
            x = as_bf16(x)
            act = cp.empty((x.shape[0] * chosen.shape[1], down.shape[1]), dtype=bf16)
            out = cp.empty((x.shape[0], x.shape[1]), dtype=f32)
            return moe.experts(x, chosen, weights, gate_up, down, act, out, stream)

        self.ops = SimpleNamespace(
            embedding=embed,
            rmsnorm=rmsnorm_only,
            rmsnorm_residual=rmsnorm_residual,
            linear=linear,
            linear_silu=linear_silu,
            silu_and_mul=silu_and_mul,
            qkv_rope_cache=qkv_rope_cache,
            paged_attention=paged_attention,
            to_bf16=to_bf16,
            latent_attention=latent_attention,
            head_linear=head_linear_op,
            moe_route=moe_route,
            moe_experts=moe_experts,
            gdn_conv_update=gdn_conv_update,
            gdn_recurrent_step=gdn_recurrent_step,
            gdn_prompt_rule=gdn_prompt_rule,
            latent_cache_write=latent_cache_write,
            gated_rmsnorm=gated_rmsnorm,
            sigmoid_gate=sigmoid_gate,
        )

    # ------------------------------------------------------------------------------ arrays

    def load_weight(self, checkpoint: Any, *parts: tuple[str, Sequence[int]]) -> Any:
        arrays, raw_names = [], []
        for name, shape in parts:
            if checkpoint.info(name).dtype == "BF16":
                arrays.append(checkpoint.raw(name, shape))
                raw_names.append(name)
            else:
                arrays.append(float32_to_bf16(checkpoint.tensor(name, shape)))  # checked on the host
        host = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        with self.stream:
            weight = self.xp.asarray(np.ascontiguousarray(host, dtype=np.uint16))
        if raw_names:
            self._check_bf16_finite(weight, checkpoint, raw_names)
        return weight

    def _check_bf16_finite(self, weight: Any, checkpoint: Any, names: list[str]) -> None:
        """Refuse a bf16 weight holding NaN or infinity (all exponent bits set: ``bits & 0x7F80 ==
        0x7F80``), counted on the device after the upload: one reduction and one read of the count
        per weight."""
        if self._count_nonfinite_bf16 is None:
            self._count_nonfinite_bf16 = self.xp.ReductionKernel(
                # (CuPy renames parameters inside the expression text: no hex literals here.)
                "uint16 bits", "int64 count", "(bits & 32640) == 32640 ? 1 : 0", "a + b", "count = a", "0",
                "count_nonfinite_bf16",
            )
        with self.stream:
            bad = int(self._count_nonfinite_bf16(weight))
        if bad:
            from metrale.errors import NonFiniteWeightError

            raise NonFiniteWeightError(
                f"{checkpoint.path}: {bad} NaN or infinite values in {' / '.join(repr(n) for n in names)}; "
                "the checkpoint is corrupt"
            )

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

    # ------------------------------------------------------------------------------ graphs

    def graph_runner(self, model: Any) -> Any:
        if not self.cuda_graphs or not getattr(model, "graph_capturable", True):
            return None
        # Kept on the model (which owns its graphs), so dropping the model frees them.
        runner = getattr(model, "_cuda_graph_runner", None)
        if runner is None or runner.backend is not self:
            from metrale.engine.cuda_graphs import CudaGraphRunner

            runner = model._cuda_graph_runner = CudaGraphRunner(model, self)
        return runner

    def close(self) -> None:
        """Drop the sampler's buffers and graphs and give every unused block of the memory pools
        back to the device (call once the models and caches of this backend are dropped)."""
        self.stream.synchronize()
        self._sampling.clear()
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

    # ---------------------------------------------------------------------------- sampling

    def sample_tokens(self, logits: Any, params: Sequence[Any], seeds: Sequence[int], steps: Sequence[int]) -> list[int]:
        from metrale.engine.sampler import parameter_arrays

        cp = self.xp
        rows = len(params)
        with self.stream:
            logits = logits.reshape(rows, -1)
            if logits.dtype != np.float32 or not logits.flags.c_contiguous:
                logits = cp.ascontiguousarray(logits, dtype=np.float32)
        buffers = self._sampling_buffers(rows, logits.shape[1])
        temperature, top_k, top_p = parameter_arrays(params, logits.shape[1])
        host = buffers.host
        host.seeds[:] = np.asarray(seeds, dtype=np.uint64).view(np.int64)
        host.steps[:] = steps
        host.temperature[:] = temperature
        host.top_k[:] = top_k
        host.top_p[:] = top_p
        host.uniforms[:] = -1.0  # draw from (seed, step)
        with self.stream:
            # One upload of every row's parameters, the logits into the sampler's own buffer,
            # the kernel (replayed from a graph after its first run: a numba launch costs far
            # more host time), one download of the tokens.
            buffers.device.data.copy_from_host_async(
                host.packed.ctypes.data_as(ctypes.c_void_p), host.packed.nbytes, self.stream
            )
            buffers.logits.data.copy_from_device_async(logits.data, logits.nbytes, self.stream)
            if buffers.graph:
                buffers.graph.launch(stream=self.stream)
            else:
                self._run_sampler(buffers)
                if self.cuda_graphs and buffers.graph is None:
                    buffers.graph = self._record_sampler(buffers)
            tokens = buffers.views.tokens
            tokens.data.copy_to_host_async(host.tokens.ctypes.data_as(ctypes.c_void_p), host.tokens.nbytes, self.stream)
        self.stream.synchronize()
        return host.tokens.tolist()

    def _run_sampler(self, buffers: Any) -> None:
        device = buffers.views
        self._sample(
            buffers.logits, device.temperature, device.top_k, device.top_p, device.seeds, device.steps,
            device.uniforms, device.tokens, self.stream,
        )

    def _record_sampler(self, buffers: Any) -> Any:
        """A graph of the sampler kernel on ``buffers``, or False when recording fails (the
        sampler then stays eager for this shape; the capture is ended and discarded)."""
        self.stream.begin_capture(getattr(self.xp.cuda.runtime, "streamCaptureModeRelaxed", 2))
        try:
            self._run_sampler(buffers)
            return self.stream.end_capture()
        except Exception:
            if self.stream.is_capturing():
                self.stream.end_capture()
            return False

    def _sampling_buffers(self, rows: int, vocab: int) -> Any:
        """Pinned host and device buffers of ``rows`` rows of sampling parameters, logits and
        tokens, with the sampler's graph; kept per shape (each call synchronises before it
        returns, so reuse is safe)."""
        buffers = self._sampling.get((rows, vocab))
        if buffers is not None:
            return buffers
        import cupyx

        # Packed per row: seed and step (int64), temperature, top_k, top_p, uniform (32-bit).
        packed = cupyx.empty_pinned((rows * 32,), dtype=np.uint8)
        tokens = cupyx.empty_pinned((rows,), dtype=np.int32)
        with self.stream, self.xp.cuda.using_allocator(self.graph_pool.malloc):
            device = self.xp.empty(rows * 32, dtype=np.uint8)
            out = self.xp.empty(rows, dtype=np.int32)
            logits = self.xp.empty((rows, vocab), dtype=np.float32)

        def fields(array: Any) -> dict[str, Any]:
            return {
                "seeds": array[: 8 * rows].view(np.int64),
                "steps": array[8 * rows : 16 * rows].view(np.int64),
                "temperature": array[16 * rows : 20 * rows].view(np.float32),
                "top_k": array[20 * rows : 24 * rows].view(np.int32),
                "top_p": array[24 * rows : 28 * rows].view(np.float32),
                "uniforms": array[28 * rows : 32 * rows].view(np.float32),
            }

        buffers = self._sampling[(rows, vocab)] = SimpleNamespace(
            host=SimpleNamespace(packed=packed, tokens=tokens, **fields(packed)),
            device=device,
            logits=logits,
            views=SimpleNamespace(tokens=out, **fields(device)),
            graph=None,
        )
        return buffers
