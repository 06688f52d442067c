"""Which kernel serves each built-in op: every kernel of the built-in ops that is not simply the op's
one CUDA implementation, each with the condition under which it serves, in the order the registry
tries them (:func:`builtin_kernels`).

This is the one place kernels are chosen. A kernel's ``when`` looks at the call's arguments (shapes,
dtypes, alignment, options); its ``enabled`` at the backend's settings
(:class:`~metrale.config.EnvironmentConfig`); its ``condition`` says both in words, which is what
``metrale plugins`` and the op reference show. Below the registry, the launchers of
:mod:`metrale.kernels` and the methods of :class:`metrale.ops.cuda.CudaKernels` check arguments,
allocate and launch one kernel each; they never pick among kernels.

Where one call splits its rows between kernels -- a mixed batch's decode rows and prompt rows --
the split is a kernel of its own whose only logic is the split: it calls the internal ops
``paged_attention_decode`` and ``paged_attention_prompt`` through the backend's op table, and the
kernels of those are chosen here like any other.

The thresholds below come from measurements on the H200 (docs/notes/decode-kernels.rst, "The
registry's thresholds"; the current figures in docs/benchmarks.rst).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from metrale.kernels.kv_cache_fp8 import Fp8CacheArray
from metrale.kernels.quantized import QuantizedWeight
from metrale.ops.registry import Kernel

# ------------------------------------------------------------------------------ thresholds

# The measurements behind each threshold: docs/notes/decode-kernels.rst, "The registry's thresholds".

#: The largest MLP (gate/up and down weights, bytes) the fused decode MLP serves by default.
FUSED_MLP_MAX_BYTES = 128 * 1024 * 1024
#: Batches of at least this many tokens run their routed experts through the grouped tensor-core
#: kernels, each chosen expert's weights read once; smaller ones pair by pair.
GROUPED_EXPERTS_MIN_TOKENS = 9
#: Tokens from which GPT-OSS's weight-only quantized expert stacks (MXFP4) are dequantized into bf16
#: for the grouped kernels rather than read pair by pair: a layer's whole stacks dequantized and
#: read once (about 9x their codes' bytes: the codes read, the bf16 written and read back) cost
#: what N * k pairs reading one expert's codes each do at N * k ~ 9 E, 72 tokens for gpt-oss's
#: 32 experts of which 4 are chosen; twice that leaves room for the pairs' L2 hits.
GROUPED_DEQUANTIZED_EXPERTS_MIN_TOKENS = 128
#: Decode batches of at least this many rows multiply FP8 weights whose scales factor out of the
#: sums (:func:`metrale.kernels.quantized_gemv.fp8_tensor_core_path`) on FP8 tensor cores, as
#: prompts do; fewer rows take :mod:`metrale.kernels.fp8_gemv`. The threshold is where the
#: tensor-core product overtook the decode GEMVs on the Llama-8B projections (``tools/sweeps/quantized_gemv_sweep.py
#: --tensor-cores``; the figures in docs/benchmarks.rst).
FP8_TENSOR_CORE_MIN_ROWS = 8
#: Batches of up to this many rows take the router-logits kernel; larger ones a float32 cuBLAS
#: product.
ROUTER_KERNEL_ROWS = 64
#: MLA's per-head products of up to this many rows take the head_linear kernels; larger ones one
#: cuBLAS product per head.
HEAD_LINEAR_WORD_ROWS = 2
#: The staged decode attention serves a geometry of the grouped kernel while a block's share of
#: the keys (keys per split times head dims) is at most this; the grouped kernel longer shares.
STAGED_MAX_BLOCK_ELEMENTS = 4096


def builtin_kernels() -> list[Kernel]:
    """Every kernel of the built-in ops that this module chooses among, in the order tried (per op:
    the conditional kernels, then the one that serves every other call). The registry adds, for
    every other op, its :class:`~metrale.ops.cuda.CudaKernels` method of the same name."""
    return (batch_invariant_kernels() + quantized_kernels() + default_decode_kernels() + composite_kernels()
            + hopper_prompt_attention_kernels() + attention_kernels() + norm_kernels() + activation_kernels()
            + head_linear_kernels() + moe_kernels() + latent_attention_kernels() + gdn_prompt_kernels())


def _cuda_method(name: str) -> Any:
    def build(backend: Any) -> Any:
        return getattr(backend.kernels, name)

    return build


def _ops_of(backend: Any) -> Any:
    """A function returning ``backend.ops``, holding the backend weakly (its op table holds the
    kernels built here: a strong reference would keep the backend alive in a cycle)."""
    import weakref

    reference = weakref.ref(backend)

    def ops() -> Any:
        alive = reference()
        if alive is None:
            from metrale.errors import EngineClosedError

            raise EngineClosedError("the backend of this op table is gone")
        return alive.ops

    return ops


def _aligned(array: Any) -> bool:
    from metrale.kernels import _words

    return _words.aligned(array)


# ------------------------------------------------------------------------ batch-invariant mode


def _batch_invariant(environment: Any) -> bool:
    return bool(getattr(environment, "batch_invariant", False))


def _invariant_kernel(name: str) -> Any:
    def build(backend: Any) -> Any:
        from metrale.kernels import batch_invariant

        return getattr(batch_invariant, name)

    return build


#: The ops whose CPU kernels :mod:`metrale.kernels.batch_invariant` replaces under
#: ``batch_invariant=True``: those whose reference's result for a row depends on the other rows.
BATCH_INVARIANT_OPS = ("linear", "linear_silu", "head_linear", "moe_route", "moe_experts_clamped", "paged_attention",
                       "gdn_conv_prompts", "gdn_prompt_rule", "lora_linear", "lora_expand")


def _prompt_mma_sizes() -> str:
    """The (key, value) head sizes of the tensor-core prompt attention, as the conditions name them."""
    from metrale.kernels.attention_mma import HEAD_DIMS

    named = [f"({k}, {v})" for k, v in HEAD_DIMS]
    return ", ".join(named[:-1]) + " or " + named[-1]


def batch_invariant_kernels() -> list[Kernel]:
    """The CPU kernels of :mod:`metrale.kernels.batch_invariant`, bound (before every other kernel
    of their ops) on a backend whose settings ask for batch invariance (the engine's
    ``batch_invariant`` option): each computes a row from that row's inputs alone. ``paged_attention``
    then serves decode and prompt rows alike, not through the split of :func:`attention_kernels`.
    Then the CUDA kernels of the same mode (:func:`cuda_batch_invariant_kernels`)."""
    return [Kernel(op, "cpu", f"metrale.kernels.batch_invariant.{op}", build=_invariant_kernel(op),
                   enabled=_batch_invariant, condition="batch_invariant=True")
            for op in BATCH_INVARIANT_OPS] + cuda_batch_invariant_kernels()


#: The fewest blocks the batch-invariant attention's decode rows' form must get for decode rows to
#: take it rather than the prompt form (None: the device's multiprocessors). Either form gives a
#: row the same bits; the prompt form spreads few rows over more blocks.
INVARIANT_DECODE_ROWS_MIN_BLOCKS: int | None = None


def _invariant_attention(backend: Any) -> Any:
    kernels = backend.kernels

    def paged_attention(q, k_cache, v_cache, batch, scale, sliding_window, softcap=None, sinks=None):
        import cupy

        from metrale.kernels.attention_mma import decode_rows_blocks
        from metrale.kernels.decode_gemv import multiprocessor_count

        # The leading one-row segments (decode rows) in the kernel's decode rows' form, the rest in
        # its prompt form: a row gives the same bits through either. Decode rows too few for the
        # decode rows' form to give every multiprocessor a block take the prompt form too (a
        # block a row and query head, where the other takes a row's query heads of a KV head).
        out = cupy.empty((q.shape[0], q.shape[1] * v_cache.shape[3]), dtype=np.uint16)
        single, segments = leading_single_rows(batch.row_starts), len(batch.row_starts) - 1
        fewest = INVARIANT_DECODE_ROWS_MIN_BLOCKS or multiprocessor_count()
        if single and decode_rows_blocks(single, q.shape[1], k_cache.shape[2]) < fewest:
            single = 0
        if single:
            kernels.paged_attention_decode_rows_mma(q, k_cache, v_cache, batch, scale, sliding_window, out, single,
                                                    softcap, sinks)
        if single < segments:
            kernels.paged_attention_prompt_mma(q, k_cache, v_cache, batch, scale, sliding_window, out, single, softcap,
                                               sinks)
        return out

    return paged_attention


def _refused_under_batch_invariance(op: str, what: str) -> Any:
    def build(backend: Any) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            from metrale.errors import ConfigError

            raise ConfigError(f"batch_invariant=True on the GPU serves {op} for {what} only")

        return refuse

    return build


#: The ops whose GPU kernels take another order of sums for a row in another batch and that have
#: no batch-invariant GPU kernel yet: under ``batch_invariant=True`` on the GPU they are refused
#: (a model calling them fails to load with a typed error) rather than served variantly.
CUDA_BATCH_VARIANT_OPS = ("head_linear", "moe_route", "moe_experts", "moe_experts_clamped", "gdn_conv_prompts",
                          "gdn_prompt_rule", "latent_attention", "lora_linear", "lora_expand")


def cuda_batch_invariant_kernels() -> list[Kernel]:
    """The CUDA kernels bound under ``batch_invariant=True``: the products through
    :mod:`metrale.kernels.linear_invariant` (decode rows through the decode kernel's plain product,
    more rows through a tiled kernel summing in exactly its order; K split from the weight's shape
    and the device alone), the fused norm-and-product and gated products through
    their composites (the fused decode kernels sum otherwise than the prompts' products), and
    attention through the tensor-core prompt kernel (:mod:`metrale.kernels.attention_mma`), which
    steps through a row's keys from the same positions whatever segment or chunk the row is in --
    decode rows in its decode rows' form (a row's query heads of a KV head together), which
    computes every row as the prompt form does. What these do not serve (quantized
    weights, an FP8 cache, other geometries) is refused with a typed error rather than served
    by a kernel whose sums depend on the batch."""

    def bf16_product(x: Any, weight: Any, bias: Any = None) -> bool:
        from metrale.kernels import linear_invariant

        return (not _is_quantized(weight) and getattr(weight, "dtype", None) == np.uint16 and weight.ndim == 2
                and linear_invariant.supports(weight.shape[1]))

    def bf16_cache(q, k_cache, v_cache, batch, scale, sliding_window, softcap=None, sinks=None) -> bool:
        from metrale.kernels import attention_mma

        return not isinstance(k_cache, Fp8CacheArray) and attention_mma.supports(*_geometry(q, k_cache, v_cache))

    condition = "batch_invariant=True"
    refused = [Kernel(op, "cuda", "refused", build=_refused_under_batch_invariance(op, "no call yet: its GPU kernels "
                                                                                     "sum otherwise for other batches"),
                      enabled=_batch_invariant, condition=condition)
               for op in CUDA_BATCH_VARIANT_OPS]

    def bf16_decode_rows(x: Any, weight: Any, bias: Any = None) -> bool:
        from metrale.kernels import decode_gemv

        return bf16_product(x, weight, bias) and decode_gemv.supports(x.shape[0], weight.shape[1], decode_gemv.PLAIN)

    return refused + [
        Kernel("linear", "cuda", "metrale.kernels.decode_gemv (plain, the batch-invariant order)",
               build=_cuda_method("invariant_linear_decode_gemv"), when=bf16_decode_rows, enabled=_batch_invariant,
               condition=condition + ", bf16 weights, the inner size a multiple of 32, rows the decode kernel stages"),
        Kernel("linear", "cuda", "metrale.kernels.linear_invariant (tiled, the decode kernel's order)",
               build=_cuda_method("invariant_linear"), when=bf16_product, enabled=_batch_invariant,
               condition=condition + ", bf16 weights, the inner size a multiple of 32"),
        Kernel("linear", "cuda", "refused", build=_refused_under_batch_invariance(
            "linear", "bf16 weights whose inner size is a multiple of 32"), enabled=_batch_invariant,
               condition=condition + ", any other weight"),
        Kernel("linear_silu", "cuda", "linear, then silu_and_mul (their kernels)",
               build=_composed_linear_silu, enabled=_batch_invariant, condition=condition),
        Kernel("rmsnorm_linear", "cuda", "rmsnorm_residual, then linear (their kernels)",
               build=_composed_rmsnorm_linear, enabled=_batch_invariant, condition=condition),
        Kernel("rmsnorm_mlp", "cuda", "rmsnorm_residual, then linear_silu and linear (their kernels)",
               build=_composed_rmsnorm_mlp, enabled=_batch_invariant, condition=condition),
        Kernel("paged_attention", "cuda", "metrale.kernels.attention_mma (decode rows in its decode rows' form "
               "where they give it a block a multiprocessor, prompt rows and fewer decode rows in its prompt form: a "
               "row's bits the same through either)",
               build=_invariant_attention, when=bf16_cache, enabled=_batch_invariant,
               condition=condition + f", a bf16 cache, (K, V) head sizes {_prompt_mma_sizes()}"),
        Kernel("paged_attention", "cuda", "refused", build=_refused_under_batch_invariance(
            "paged_attention", "a bf16 cache of the tensor-core prompt kernel's head sizes"), enabled=_batch_invariant,
               condition=condition + ", any other cache or geometry"),
    ]


def _composed_linear_silu(backend: Any) -> Any:
    table = _ops_of(backend)

    def linear_silu(x, weight, bias=None):
        ops = table()
        return ops.silu_and_mul(ops.linear(x, weight, bias))

    return linear_silu


# ------------------------------------------------------------------------------ composites
# Fused ops served, where no kernel of their own applies, by the ops they fuse (called through the
# backend's op table, so whatever kernels serve those serve these too).


def _composed_rmsnorm_linear(backend: Any) -> Any:
    table = _ops_of(backend)

    def rmsnorm_linear(x, residual, norm_weight, eps, offset, weight, bias=None):
        ops = table()
        normed, summed = ops.rmsnorm_residual(x, residual, norm_weight, eps, offset)
        return ops.linear(normed, weight, bias), summed

    return rmsnorm_linear


def _composed_rmsnorm_mlp(backend: Any) -> Any:
    table = _ops_of(backend)

    def rmsnorm_mlp(x, residual, norm_weight, eps, offset, gate_up, down, gate_up_bias=None, down_bias=None):
        ops = table()
        normed, summed = ops.rmsnorm_residual(x, residual, norm_weight, eps, offset)
        return ops.linear(ops.linear_silu(normed, gate_up, gate_up_bias), down, down_bias), summed

    return rmsnorm_mlp


def _composed_gdn_decode(backend: Any) -> Any:
    table = _ops_of(backend)

    def gdn_decode(qkvz, ba, conv_weight, conv_state, a_log, dt_bias, state, slots, norm_weight, eps, key_heads,
                   value_heads, key_dim, value_dim):
        ops = table()
        inputs, z = ops.gdn_ungroup(qkvz, key_heads, value_heads, key_dim, value_dim)
        g, beta = ops.gdn_gates(ba, a_log, dt_bias, key_heads)
        mixed = ops.gdn_conv_update(inputs, conv_weight, conv_state, slots)
        q, k, v = ops.gdn_split_heads(mixed, key_heads, value_heads, key_dim, value_dim)
        out = ops.gdn_recurrent_step(q, k, v, g, beta, state, slots)
        return ops.gated_rmsnorm(out, z, norm_weight, eps)

    return gdn_decode


def composite_kernels() -> list[Kernel]:
    """The fused ops served, on both backends, by the ops they fuse."""
    composites: list[tuple[str, str, Callable[[Any], Any]]] = [
        ("rmsnorm_linear", "rmsnorm_residual, then linear (their kernels)", _composed_rmsnorm_linear),
        ("rmsnorm_mlp", "rmsnorm_residual, then linear_silu and linear (their kernels)", _composed_rmsnorm_mlp),
        ("gdn_decode", "gdn_ungroup, gdn_gates, gdn_conv_update, gdn_split_heads, gdn_recurrent_step, gated_rmsnorm "
         "(their kernels)", _composed_gdn_decode),
    ]
    return [Kernel(op, device, name, build=build) for op, name, build in composites for device in ("cpu", "cuda")]


# ------------------------------------------------------------------------- quantized weights


def _is_quantized(weight: Any) -> bool:
    return isinstance(weight, QuantizedWeight)


def quantized_kernels() -> list[Kernel]:
    """The CUDA kernels of products with a :class:`~metrale.kernels.quantized.QuantizedWeight`
    (:mod:`metrale.kernels.quantized_gemv`), tried before every other kernel of their ops: the
    quantized decode GEMV for ``linear`` up to its rows (FP8 weights whose scales factor out from
    :data:`FP8_TENSOR_CORE_MIN_ROWS` rows on FP8 tensor cores instead, fewer rows through
    :mod:`metrale.kernels.fp8_gemv`; 4-bit weight-only weights in groups of 128 columns through
    :mod:`metrale.kernels.int4_gemv`), the staged input with a bf16
    dequantization and cuBLAS past them; ``linear_silu`` as ``linear`` then ``silu_and_mul`` (FP8
    prompt rows: their product in bf16, the scales in its epilogue; FP8 and 4-bit decode rows: their
    GEMV with the gate in its epilogue); ``moe_experts`` of FP8 stacks through the FP8 decode
    GEMV a routed pair at a time up to 8 tokens, of others through the quantized decode experts up
    to 8 tokens, over the dequantized stacks past them.
    ``rmsnorm_linear`` and ``rmsnorm_mlp`` of FP8 decode rows that the prologue stages in shared
    memory take the norm into the FP8 GEMV's prologue; of FP8 prompt rows they write the norm
    straight as the FP8 input rows of the (gate/up) product, and ``rmsnorm_mlp`` the down product's
    FP8 input rows straight from the gate/up product (the SwiGLU gate and the rows' quantization in
    one pass); otherwise they reach the kernels above through their composites (the
    fused bf16 decode kernels take bf16 weights only)."""

    from metrale.kernels.fp8_gemv import MAX_EXPERT_TOKENS as FP8_EXPERT_TOKENS
    from metrale.kernels.quantized_gemv import NORM_FP8_MAX_WIDTH

    def quantized(x: Any, weight: Any, bias: Any = None) -> bool:
        return _is_quantized(weight)

    def decode_rows(x: Any, weight: Any, bias: Any = None) -> bool:
        from metrale.kernels import quantized_gemv

        return _is_quantized(weight) and quantized_gemv.supports(x.shape[0], weight)

    def fp8_decode_rows(x: Any, weight: Any, bias: Any = None) -> bool:
        from metrale.kernels import fp8_gemv

        return _is_quantized(weight) and fp8_gemv.serves(x.shape[0], weight)

    def fp8_decode_gate_up(x: Any, weight: Any, bias: Any = None) -> bool:
        return bias is None and weight.shape[0] % 2 == 0 and fp8_decode_rows(x, weight)

    def int4_decode_rows(x: Any, weight: Any, bias: Any = None) -> bool:
        from metrale.kernels import int4_gemv

        return _is_quantized(weight) and int4_gemv.serves(x.shape[0], weight)

    def fp8_norm_rows(x: Any, norm_weight: Any, weight: Any) -> bool:
        from metrale.kernels import fp8_gemv

        return (_is_quantized(weight) and fp8_gemv.serves_norm(x.shape[0], weight) and x.shape[1] == weight.shape[1]
                and getattr(norm_weight, "dtype", None) == np.uint16 and _aligned(norm_weight))

    def fp8_decode_norm_linear(x: Any, residual: Any, norm_weight: Any, eps: Any, offset: Any, weight: Any,
                               bias: Any = None) -> bool:
        return fp8_norm_rows(x, norm_weight, weight)

    def fp8_decode_norm_mlp(x: Any, residual: Any, norm_weight: Any, eps: Any, offset: Any, gate_up: Any, down: Any,
                            gate_up_bias: Any = None, down_bias: Any = None) -> bool:
        return (gate_up_bias is None and gate_up.shape[0] % 2 == 0 and fp8_norm_rows(x, norm_weight, gate_up)
                and fp8_decode_rows(x, down) and down.shape[1] == gate_up.shape[0] // 2)

    def int4_decode_gate_up(x: Any, weight: Any, bias: Any = None) -> bool:
        return bias is None and weight.shape[0] % 2 == 0 and int4_decode_rows(x, weight)

    def fp8_decode_batch(x: Any, weight: Any, bias: Any = None) -> bool:
        from metrale.kernels import quantized_gemv

        return (_is_quantized(weight) and x.shape[0] >= FP8_TENSOR_CORE_MIN_ROWS
                and quantized_gemv.fp8_tensor_core_path(weight))

    def quantized_experts(x: Any, experts: Any, weights: Any, gate_up: Any, down: Any) -> bool:
        return _is_quantized(gate_up) or _is_quantized(down)

    def fp8_decode_experts(x: Any, experts: Any, weights: Any, gate_up: Any, down: Any) -> bool:
        from metrale.kernels import fp8_gemv

        return (isinstance(gate_up, QuantizedWeight) and isinstance(down, QuantizedWeight)
                and fp8_gemv.serves_experts(x.shape[0], experts.shape[1], gate_up, down))

    def decode_experts(x: Any, experts: Any, weights: Any, gate_up: Any, down: Any) -> bool:
        from metrale.kernels import quantized_moe_decode

        return (_is_quantized(gate_up) and _is_quantized(down)
                and quantized_moe_decode.supports(x.shape[0], experts.shape[1], gate_up, down))

    def fp8_prompt_gate_up(x: Any, weight: Any, bias: Any = None) -> bool:
        return bias is None and fp8_decode_batch(x, weight)

    def fp8_prompt_norm_mlp(x: Any, residual: Any, norm_weight: Any, eps: Any, offset: Any, gate_up: Any, down: Any,
                            gate_up_bias: Any = None, down_bias: Any = None) -> bool:
        return (gate_up_bias is None and gate_up.shape[0] == 2 * down.shape[1] and fp8_decode_batch(x, gate_up)
                and fp8_decode_batch(x, down))

    def fp8_prompt_norm_linear(x: Any, residual: Any, norm_weight: Any, eps: Any, offset: Any, weight: Any,
                               bias: Any = None) -> bool:
        from metrale.kernels import quantized_gemv

        return fp8_decode_batch(x, weight) and quantized_gemv.serves_rmsnorm_fp8_rows(x, norm_weight, weight)

    def fp8_norm_then(ops: Any, kernels: Any, x: Any, residual: Any, norm_weight: Any, eps: Any, offset: Any,
                      weight: Any, bf16_out: bool, product: Any) -> tuple[Any, Any]:
        """``(linear(rmsnorm(s), weight), s)``: the norm written as the product's FP8 rows where
        ``fp8_norm_product`` serves them, else (or where cuBLASLt has no FP8 algorithm, after the
        sum) the norm's op, then ``product`` of its rows."""
        fused = kernels.fp8_norm_product(x, residual, norm_weight, eps, offset, weight, bf16_out)
        if fused is not None and fused[0] is not None:
            return fused
        if fused is not None:  # the sum is made: its norm alone
            normed, summed = ops.rmsnorm_residual(fused[1], None, norm_weight, eps, offset)
        else:
            normed, summed = ops.rmsnorm_residual(x, residual, norm_weight, eps, offset)
        return product(normed), summed

    def fp8_rmsnorm_linear(backend: Any) -> Any:
        table, kernels = _ops_of(backend), backend.kernels

        def rmsnorm_linear(x, residual, norm_weight, eps, offset, weight, bias=None):
            ops = table()
            out, summed = fp8_norm_then(ops, kernels, x, residual, norm_weight, eps, offset, weight, False,
                                        lambda normed: ops.linear(normed, weight))
            return (out if bias is None else out + bias), summed

        return rmsnorm_linear

    def fp8_rmsnorm_mlp(backend: Any) -> Any:
        table, kernels = _ops_of(backend), backend.kernels

        def rmsnorm_mlp(x, residual, norm_weight, eps, offset, gate_up, down, gate_up_bias=None, down_bias=None):
            ops = table()
            gated, summed = fp8_norm_then(ops, kernels, x, residual, norm_weight, eps, offset, gate_up, True,
                                          lambda normed: kernels.fp8_gate_up_product(normed, gate_up))
            out = kernels.fp8_silu_product(gated, down, down_bias) if gated.dtype == np.uint16 else None
            if out is None:  # the unfused ops
                out = ops.linear(ops.silu_and_mul(gated), down, down_bias)
            return out, summed

        return rmsnorm_mlp

    def fp8_linear_silu(backend: Any) -> Any:
        table, kernels = _ops_of(backend), backend.kernels

        def linear_silu(x, weight, bias=None):
            return table().silu_and_mul(kernels.fp8_gate_up_product(x, weight, bias))

        return linear_silu

    return [
        Kernel("linear", "cuda", "metrale.kernels.quantized_gemv (FP8 rows), cuBLASLt FP8 product (FP8 tensor cores)",
               build=_cuda_method("quantized_linear"), when=fp8_decode_batch,
               condition=f"FP8 weights and inputs whose scales factor out of the sums, N >= {FP8_TENSOR_CORE_MIN_ROWS}"),
        Kernel("linear", "cuda", "metrale.kernels.fp8_gemv (FP8 decode GEMV, the scales applied once a sum or a "
               "128-column block)", build=_cuda_method("fp8_linear_gemv"), when=fp8_decode_rows,
               condition="FP8 weights and inputs whose scales factor out of the sums, or block-wise FP8 (blocks of "
               "128 columns, inputs in groups of 128), at most 32 rows, the inner size a multiple of 16"),
        Kernel("linear", "cuda", "metrale.kernels.int4_gemv (4-bit decode GEMV, a group's sums scaled at once)",
               build=_cuda_method("int4_linear_gemv"), when=int4_decode_rows,
               condition="4-bit weight-only weights in groups of a multiple of 128 columns, at most 32 rows"),
        Kernel("linear", "cuda", "metrale.kernels.quantized_gemv (decode GEMV)", build=_cuda_method("quantized_linear_gemv"),
               when=decode_rows, condition="a quantized weight, at most 32 rows, the inner size a multiple of 32"),
        Kernel("linear", "cuda", "metrale.kernels.quantized_gemv (staged input, bf16 dequantization), cuBLAS GEMM",
               build=_cuda_method("quantized_linear"), when=quantized, condition="a quantized weight"),
        Kernel("linear_silu", "cuda", "cuBLASLt FP8 product (bf16 out, the scales in its epilogue), then silu_and_mul",
               build=fp8_linear_silu, when=fp8_prompt_gate_up,
               condition=f"FP8 weights and inputs whose scales factor out of the sums, N >= {FP8_TENSOR_CORE_MIN_ROWS}, "
               "no bias"),
        Kernel("linear_silu", "cuda", "metrale.kernels.fp8_gemv (FP8 decode GEMV, the gate in its epilogue)",
               build=_cuda_method("fp8_linear_silu_gemv"), when=fp8_decode_gate_up,
               condition="FP8 weights and inputs whose scales factor out of the sums, or block-wise FP8, at most 32 "
               "rows, the inner size a multiple of 16, no bias"),
        Kernel("linear_silu", "cuda", "metrale.kernels.int4_gemv (4-bit decode GEMV, the gate in its epilogue)",
               build=_cuda_method("int4_linear_silu_gemv"), when=int4_decode_gate_up,
               condition="4-bit weight-only weights in groups of a multiple of 128 columns, at most 32 rows, no bias"),
        Kernel("linear_silu", "cuda", "linear, then silu_and_mul (their kernels)", build=_composed_linear_silu,
               when=quantized, condition="a quantized weight"),
        Kernel("rmsnorm_linear", "cuda", "metrale.kernels.fp8_gemv (the norm in its prologue)",
               build=_cuda_method("fp8_rmsnorm_linear_gemv"), when=fp8_decode_norm_linear,
               condition="FP8 weights and inputs whose scales factor out of the sums, or block-wise FP8, rows the "
               "prologue stages in shared memory (up to 4), the inner size a multiple of 16, bf16 norm weights"),
        Kernel("rmsnorm_linear", "cuda", "metrale.kernels.quantized_gemv (the norm written as the product's FP8 "
               "input rows), the cuBLASLt FP8 product", build=fp8_rmsnorm_linear, when=fp8_prompt_norm_linear,
               condition=f"FP8 weights and inputs whose scales factor out of the sums, N >= {FP8_TENSOR_CORE_MIN_ROWS}, "
               f"float32 rows of a multiple of 4 values (at most {NORM_FP8_MAX_WIDTH:,}), bf16 norm weights"),
        Kernel("rmsnorm_mlp", "cuda", "metrale.kernels.fp8_gemv (the norm in the gated gate/up GEMV's prologue), "
               "then the down GEMV", build=_cuda_method("fp8_rmsnorm_mlp_gemv"), when=fp8_decode_norm_mlp,
               condition="FP8 weights and inputs whose scales factor out of the sums, or block-wise FP8, rows the "
               "prologue stages in shared memory (up to 4), inner sizes multiples of 16, bf16 norm weights, no gate_up "
               "bias"),
        Kernel("rmsnorm_mlp", "cuda", "metrale.kernels.quantized_gemv (the norm written as the gate/up product's "
               "FP8 input rows where it serves them; rmsnorm_residual otherwise), the cuBLASLt FP8 gate/up product (bf16 "
               "out, the scales in its epilogue), metrale.kernels.quantized_gemv (the SwiGLU gate and the down product's "
               "FP8 input rows in one pass), the cuBLASLt FP8 down product", build=fp8_rmsnorm_mlp,
               when=fp8_prompt_norm_mlp,
               condition=f"FP8 weights and inputs whose scales factor out of the sums, N >= {FP8_TENSOR_CORE_MIN_ROWS}, "
               "no gate_up bias"),
        Kernel("moe_experts", "cuda", "metrale.kernels.fp8_gemv (a routed pair a grid row, the codes multiplied as "
               "they are), then each token's pairs summed", build=_cuda_method("fp8_moe_experts_decode"),
               when=fp8_decode_experts,
               condition=f"FP8 stacked weights the FP8 decode GEMV serves, N <= {FP8_EXPERT_TOKENS}, H and I multiples "
               "of 16, each expert's rows whole scale blocks"),
        Kernel("moe_experts", "cuda", "metrale.kernels.quantized_moe_decode", build=_cuda_method("quantized_moe_experts_decode"),
               when=decode_experts, condition="quantized stacked weights, N <= 8, H and I multiples of 8, no act-order"),
        Kernel("moe_experts", "cuda", "metrale.kernels.quantized_gemv (bf16 dequantization), then the pairwise kernels",
               build=_cuda_method("quantized_moe_experts"), when=quantized_experts,
               condition="quantized stacked weights"),
    ]


# ---------------------------------------------------------------------------- decode kernels


def default_decode_kernels() -> list[Kernel]:
    """The decode kernels the CUDA backend uses by default, each where it measured faster on the
    H200 than the kernels it replaces (``tools/sweeps/gemv_sweep.py`` and ``tools/sweeps/decode_ab.py``;
    the numbers are in the benchmarks page): the decode GEMV for ``linear`` and ``linear_silu`` (the
    gate in its epilogue) up to 8 rows and, with the norm fused, for ``rmsnorm_linear`` up to 2
    rows and for ``rmsnorm_mlp`` at one row of an MLP of at most :data:`FUSED_MLP_MAX_BYTES`; the
    decode MoE kernels for ``moe_experts`` and the decode router for ``moe_route``, both up to 8
    tokens; the fused Gated DeltaNet step."""
    projections = [kernel for kernel in decode_gemv_kernels(max_rows=8) if kernel.op in ("linear", "linear_silu")]
    norm_linear = [kernel for kernel in decode_gemv_kernels(max_rows=2) if kernel.op == "rmsnorm_linear"]
    mlp = [kernel for kernel in decode_gemv_kernels(max_rows=1, max_mlp_bytes=FUSED_MLP_MAX_BYTES)
           if kernel.op == "rmsnorm_mlp"]
    return (projections + norm_linear + mlp + moe_decode_kernels(max_tokens=8) + moe_route_decode_kernels(max_tokens=8)
            + gdn_decode_kernels())


def decode_gemv_kernels(max_rows: int = 8, max_mlp_bytes: int | None = None,
                        swiglu_epilogue: bool = False) -> list[Kernel]:
    """The decode GEMV kernels (:mod:`metrale.kernels.decode_gemv`) as conditional kernels of
    ``linear``, ``linear_silu``, ``rmsnorm_linear`` and ``rmsnorm_mlp`` for batches of at most ``max_rows`` rows
    (bf16 weights, inner sizes a multiple of 32 whose staged rows fit a block, 16-byte aligned
    arrays; for ``rmsnorm_mlp``, weights of at most ``max_mlp_bytes`` bytes when given).
    :func:`default_decode_kernels` registers some of them by default; a registry may add them all
    (``registry.add_kernel``), for other limits too. With ``swiglu_epilogue`` the ``rmsnorm_mlp``
    kernel applies the SwiGLU gate in the gate/up kernel's epilogue (gate and up rows a multiple of
    16) rather than in the down kernel's prologue: half the intermediate written and read, no
    activation in every block of the down kernel; not a default until it is timed on a GPU
    (``tools/sweeps/decode_ab.py --swiglu-epilogue``)."""

    def served(rows: int, inner: int, mode: int, *arrays: Any) -> bool:
        from metrale.kernels import decode_gemv

        return (rows <= max_rows and decode_gemv.supports(rows, inner, mode)
                and getattr(arrays[0], "dtype", None) == np.uint16 and all(_aligned(a) for a in arrays))

    def small_linear(x: Any, weight: Any, bias: Any = None) -> bool:
        return served(x.shape[0], x.shape[1], 0, weight, x)

    def small_float_linear(x: Any, weight: Any, bias: Any = None) -> bool:
        return x.dtype == np.float32 and x.flags.c_contiguous and small_linear(x, weight, bias)

    def small_linear_silu(x: Any, weight: Any, bias: Any = None) -> bool:
        return bias is None and weight.shape[0] % 16 == 0 and served(x.shape[0], x.shape[1], 4, weight, x)  # PLAIN_SWIGLU

    def small_norm_linear(x: Any, residual: Any, norm_weight: Any, eps: Any, offset: Any, weight: Any,
                          bias: Any = None) -> bool:
        return served(x.shape[0], x.shape[1], 1, weight, norm_weight, x)

    def small_norm_mlp(x: Any, residual: Any, norm_weight: Any, eps: Any, offset: Any, gate_up: Any, down: Any,
                       gate_up_bias: Any = None, down_bias: Any = None) -> bool:
        return (gate_up_bias is None and served(x.shape[0], x.shape[1], 1, gate_up, norm_weight, x)
                and served(x.shape[0], down.shape[1], 2, down)
                and (max_mlp_bytes is None or gate_up.nbytes + down.nbytes <= max_mlp_bytes)
                and (not swiglu_epilogue or gate_up.shape[0] % 16 == 0))

    condition = f"N <= {max_rows}, bf16 weights, inner sizes a multiple of 32"
    mlp_condition = (condition + ", no gate_up bias"
                     + (f", weights of at most {max_mlp_bytes / 2**20:g} MiB" if max_mlp_bytes is not None else "")
                     + (", gate and up rows a multiple of 16" if swiglu_epilogue else ""))
    if swiglu_epilogue:
        mlp = Kernel("rmsnorm_mlp", "cuda", "metrale.kernels.decode_gemv (the norm fused, the gate in the gate/up "
                     "epilogue)", build=_cuda_method("rmsnorm_mlp_decode_gemv_epilogue"), when=small_norm_mlp,
                     condition=mlp_condition)
    else:
        mlp = Kernel("rmsnorm_mlp", "cuda", "metrale.kernels.decode_gemv (the norm and the gate fused)",
                     build=_cuda_method("rmsnorm_mlp_decode_gemv"), when=small_norm_mlp, condition=mlp_condition)
    return [
        Kernel("linear", "cuda", "metrale.kernels.decode_gemv (float32 rows, rounded as they are staged)",
               build=_cuda_method("linear_decode_gemv_f32"), when=small_float_linear,
               condition=condition + ", contiguous float32 rows"),
        Kernel("linear", "cuda", "metrale.kernels.decode_gemv", build=_cuda_method("linear_decode_gemv"),
               when=small_linear, condition=condition),
        Kernel("linear_silu", "cuda", "metrale.kernels.decode_gemv (the gate in the epilogue)",
               build=_cuda_method("linear_silu_decode_gemv"), when=small_linear_silu,
               condition=condition + ", no bias, gate and up rows a multiple of 16"),
        Kernel("rmsnorm_linear", "cuda", "metrale.kernels.decode_gemv (the norm fused)",
               build=_cuda_method("rmsnorm_linear_decode_gemv"), when=small_norm_linear, condition=condition),
        mlp,
    ]


def moe_decode_kernels(max_tokens: int = 8) -> list[Kernel]:
    """The decode MoE kernels (:mod:`metrale.kernels.moe_decode`: two GEMV kernels over the chosen
    experts' weights, the weighting and the sum over slots in the second) as a conditional kernel
    of ``moe_experts`` for batches of at most ``max_tokens`` tokens (registered by default with 8,
    :func:`default_decode_kernels`)."""

    def small(x: Any, experts: Any, weights: Any, gate_up: Any, down: Any) -> bool:
        from metrale.kernels import moe_decode

        return (x.shape[0] <= max_tokens and getattr(down, "dtype", None) == np.uint16
                and getattr(gate_up, "dtype", None) == np.uint16
                and moe_decode.supports(x.shape[0], experts.shape[1], x.shape[1], down.shape[1]))

    return [Kernel("moe_experts", "cuda", "metrale.kernels.moe_decode", build=_cuda_method("moe_experts_decode"),
                   when=small, condition=f"N <= {max_tokens}, bf16 weights, H and I multiples of 8")]


def moe_route_decode_kernels(max_tokens: int = 8) -> list[Kernel]:
    """The decode router kernel (:mod:`metrale.kernels.moe_route_decode`: the router product and
    the choice of experts in one launch) as a conditional kernel of ``moe_route`` for batches of
    at most ``max_tokens`` tokens (registered by default with 8, :func:`default_decode_kernels`;
    docs/notes/decode-kernels.rst has its decode steps against the default router)."""

    def small(x: Any, gate: Any, bias: Any, method: str, n_group: int, topk_group: int, top_k: int,
              renormalise: Any, scaling: Any) -> bool:
        from metrale.kernels import moe_route_decode

        return (x.shape[0] <= max_tokens and getattr(gate, "dtype", None) == np.float32
                and moe_route_decode.supports(x.shape[0], x.shape[1], gate.shape[0], n_group, top_k))

    return [Kernel("moe_route", "cuda", "metrale.kernels.moe_route_decode", build=_cuda_method("moe_route_decode"),
                   when=small, condition=f"N <= {max_tokens}, float32 router, E <= 256 in equal groups, k <= 16")]


def gdn_decode_kernels() -> list[Kernel]:
    """The fused Gated DeltaNet decode kernels (:mod:`metrale.kernels.gdn_decode`) as a
    conditional kernel of ``gdn_decode`` (registered by default, :func:`default_decode_kernels`)."""

    def served(qkvz: Any, ba: Any, conv_weight: Any, conv_state: Any, a_log: Any, dt_bias: Any, state: Any, slots: Any,
               norm_weight: Any, eps: Any, key_heads: int, value_heads: int, key_dim: int, value_dim: int) -> bool:
        from metrale.kernels import gdn_decode

        return gdn_decode.supports(key_heads, value_heads, key_dim, value_dim)

    return [Kernel("gdn_decode", "cuda", "metrale.kernels.gdn_decode", build=_cuda_method("gdn_decode_fused"),
                   when=served, condition="d_k, d_v <= 1024, H_v a multiple of H_k")]


# --------------------------------------------------------------------------------- attention


def leading_single_rows(row_starts: Any) -> int:
    """How many of the batch's segments, from the first, are one row each (the decode rows of a
    step; a mixed step's prompt chunk follows them)."""
    lengths = np.diff(np.asarray(row_starts))
    longer = np.nonzero(lengths != 1)[0]
    return int(longer[0]) if longer.size else len(lengths)


def _split_paged_attention(backend: Any) -> Any:
    table = _ops_of(backend)
    # The output of the backend (bf16 bits on the GPU, float32 on the CPU); the closure holds its
    # array module, not the backend (the backend's op table holds this kernel).
    xp, dtype = backend.xp, np.uint16 if backend.name == "cuda" else np.float32

    def paged_attention(q, k_cache, v_cache, batch, scale, sliding_window, softcap=None, sinks=None):
        # The leading one-row segments (a step's decode rows) to paged_attention_decode, the
        # segments after them (prompt rows) to paged_attention_prompt, both writing into one out.
        ops = table()
        out = xp.empty((q.shape[0], q.shape[1] * v_cache.shape[3]), dtype=dtype)
        single, segments = leading_single_rows(batch.row_starts), len(batch.row_starts) - 1
        if single:
            ops.paged_attention_decode(q[:single], k_cache, v_cache, batch, scale, sliding_window, out[:single], 0,
                                       softcap, sinks)
        if single < segments:
            ops.paged_attention_prompt(q, k_cache, v_cache, batch, scale, sliding_window, out, single, softcap, sinks)
        return out

    return paged_attention


def _prompt_rows_as_decode_rows(backend: Any) -> Any:
    table = _ops_of(backend)

    def paged_attention_prompt(q, k_cache, v_cache, batch, scale, sliding_window, out, first_segment, softcap=None,
                               sinks=None):
        # Each prompt row on its own, as the decode kernels take rows.
        first = int(batch.row_starts[first_segment])
        table().paged_attention_decode(q[first:], k_cache, v_cache, batch, scale, sliding_window, out[first:], first,
                                       softcap, sinks)
        return out

    return paged_attention_prompt


def _geometry(q: Any, k_cache: Any, v_cache: Any) -> tuple[int, int, int, int]:
    """``(heads, kv_heads, head_dim, value_dim)`` of an attention call."""
    return q.shape[1], k_cache.shape[2], q.shape[2], v_cache.shape[3]


def _plain(softcap: Any, sinks: Any) -> bool:
    """Whether a call asks for neither a logit soft cap nor sinks."""
    return not softcap and sinks is None


def attention_kernels() -> list[Kernel]:
    """``paged_attention`` (the split of a step's rows, on both backends) and the kernels of its
    decode rows (``paged_attention_decode``) and prompt rows (``paged_attention_prompt``)."""

    def decode_mma(q, k_cache, v_cache, batch, scale, sliding_window, out, first_row, softcap=None, sinks=None):
        from metrale.kernels import attention_decode_mma

        return attention_decode_mma.supports(*_geometry(q, k_cache, v_cache))

    def grouped(q, k_cache, v_cache, batch, scale, sliding_window, out, first_row, softcap=None, sinks=None):
        from metrale.kernels import attention_grouped

        return _plain(softcap, sinks) and attention_grouped.supports(*_geometry(q, k_cache, v_cache))

    def staged(q, k_cache, v_cache, batch, scale, sliding_window, out, first_row, softcap=None, sinks=None):
        from metrale.kernels import attention_grouped, attention_staged

        if not grouped(q, k_cache, v_cache, batch, scale, sliding_window, out, first_row, softcap, sinks):
            return False
        heads, kv_heads, head_dim, value_dim = _geometry(q, k_cache, v_cache)
        if not attention_staged.supports(heads, kv_heads, head_dim, value_dim):
            return False
        splits = attention_grouped.split_count(q.shape[0], heads, kv_heads, batch.max_context)
        return -(-int(batch.max_context) // splits) * head_dim <= STAGED_MAX_BLOCK_ELEMENTS

    def prompt_mma(q, k_cache, v_cache, batch, scale, sliding_window, out, first_segment, softcap=None, sinks=None):
        from metrale.kernels import attention_mma

        return attention_mma.supports(*_geometry(q, k_cache, v_cache))

    def prompt_cores(q, k_cache, v_cache, batch, scale, sliding_window, out, first_segment, softcap=None, sinks=None):
        from metrale.kernels import attention_prefill

        return attention_prefill.supports(*_geometry(q, k_cache, v_cache))

    def fp8_cache(q, k_cache, *rest, **options):
        return isinstance(k_cache, Fp8CacheArray)

    def fp8_prompt_mma(q, k_cache, v_cache, batch, scale, sliding_window, out, first_segment, softcap=None,
                       sinks=None):
        return (isinstance(k_cache, Fp8CacheArray) and isinstance(v_cache, Fp8CacheArray)
                and prompt_mma(q, k_cache, v_cache, batch, scale, sliding_window, out, first_segment, softcap, sinks))

    def fp8_decode_mma(q, k_cache, v_cache, batch, scale, sliding_window, out, first_row, softcap=None, sinks=None):
        return (isinstance(k_cache, Fp8CacheArray) and isinstance(v_cache, Fp8CacheArray)
                and decode_mma(q, k_cache, v_cache, batch, scale, sliding_window, out, first_row, softcap, sinks))

    def fp8_write(qkv, positions, slot_mapping, inv_freq, attention_factor, num_heads, num_kv_heads, head_dim,
                  k_cache, *rest, **options):
        return isinstance(k_cache, Fp8CacheArray)

    def fp8_write_fused(qkv, positions, slot_mapping, inv_freq, attention_factor, num_heads, num_kv_heads, head_dim,
                        k_cache, *rest, **options):
        from metrale.kernels import qkv_rope

        return (isinstance(k_cache, Fp8CacheArray) and head_dim % 2 == 0
                and 0 < head_dim <= qkv_rope.FP8_MAX_HEAD_DIM)

    split = ("paged_attention_decode for the leading one-row segments, paged_attention_prompt for the rest "
             "(their kernels)")
    return [
        *(Kernel("paged_attention", device, split, build=_split_paged_attention) for device in ("cpu", "cuda")),
        Kernel("qkv_rope_cache", "cuda", "metrale.kernels.qkv_rope (each key and value row quantized as it is "
               "written)", build=_cuda_method("qkv_rope_cache_fp8"), when=fp8_write_fused,
               condition="an FP8 cache, heads of an even size up to 512"),
        Kernel("qkv_rope_cache", "cuda", "metrale.kernels.qkv_rope into rows of their own, then "
               "metrale.kernels.attention_fp8's quantized write", build=_cuda_method("qkv_rope_cache_fp8_rows"),
               when=fp8_write, condition="an FP8 cache"),
        Kernel("paged_attention_decode", "cuda", "metrale.kernels.attention_decode_mma (tensor cores, the codes as "
               "f16 operands, the scales in float32)", build=_cuda_method("paged_attention_decode_mma"),
               when=fp8_decode_mma, enabled=_decode_mma_enabled,
               condition="METRALE_DECODE_MMA is not 0, an FP8 cache, K and V heads of 32, 64, 128 or 256 dims, whole "
               "query-head groups"),
        Kernel("paged_attention_decode", "cuda", "metrale.kernels.attention_fp8 (CUDA cores, a block per query head)",
               build=_cuda_method("paged_attention_decode_fp8"), when=fp8_cache, condition="an FP8 cache"),
        Kernel("paged_attention_prompt", "cuda", "metrale.kernels.attention_mma (tensor cores, each step's codes "
               "scaled into bf16 in shared memory)", build=_cuda_method("paged_attention_prompt_mma"),
               when=fp8_prompt_mma, condition=f"an FP8 cache, (K, V) head sizes {_prompt_mma_sizes()}, whole query-head "
               "groups"),
        Kernel("paged_attention_prompt", "cuda", "paged_attention_decode, a row at a time (its kernels)",
               build=_prompt_rows_as_decode_rows, when=fp8_cache, condition="an FP8 cache"),
        Kernel("paged_attention_decode", "cuda", "metrale.kernels.attention_decode_mma (tensor cores)",
               build=_cuda_method("paged_attention_decode_mma"), when=decode_mma, enabled=_decode_mma_enabled,
               condition="METRALE_DECODE_MMA is not 0, K and V heads of 32, 64, 128 or 256 dims, whole query-head groups"),
        Kernel("paged_attention_decode", "cuda", "metrale.kernels.attention_staged (CUDA cores, keys staged in shared "
               "memory)", build=_cuda_method("paged_attention_decode_staged"), when=staged,
               condition=f"K and V heads of 16 to 128 dims, a power of two; a block's share of the keys times d <= "
               f"{STAGED_MAX_BLOCK_ELEMENTS}; no softcap, no sinks"),
        Kernel("paged_attention_decode", "cuda", "metrale.kernels.attention_grouped (CUDA cores, a block per KV head's "
               "query heads)", build=_cuda_method("paged_attention_decode_grouped"), when=grouped,
               condition="K and V heads of 16 to 128 dims, a power of two; no softcap, no sinks"),
        Kernel("paged_attention_decode", "cuda", "metrale.kernels.attention (CUDA cores, a block per query head)",
               build=_cuda_method("paged_attention_decode_split")),
        Kernel("paged_attention_prompt", "cuda", "metrale.kernels.attention_mma (tensor cores)",
               build=_cuda_method("paged_attention_prompt_mma"), when=prompt_mma,
               condition=f"(K, V) heads of {_prompt_mma_sizes()} dims"),
        Kernel("paged_attention_prompt", "cuda", "metrale.kernels.attention_prefill (CUDA cores)",
               build=_cuda_method("paged_attention_prompt_prefill"), when=prompt_cores,
               condition="K and V heads of at most 128 dims, even; at most 32 query heads a KV head"),
        Kernel("paged_attention_prompt", "cuda", "paged_attention_decode, a row at a time (its kernels)",
               build=_prompt_rows_as_decode_rows),
    ]


def _decode_mma_enabled(environment: Any) -> bool:
    return bool(environment.decode_mma)


def merged_decode_attention_kernels() -> list[Kernel]:
    """The tensor-core decode attention merging its own splits (the last split of each row and
    head block to finish, :func:`metrale.kernels.attention_decode_mma.decode_attention` with
    counters) instead of the combine kernel after it, as a conditional kernel of
    ``paged_attention_decode`` where a block's partials are small enough
    (:func:`~metrale.kernels.attention_decode_mma.merges_itself`). Not registered by default: the
    combine kernel, launched dependently, measured faster; a registry may add
    it (``tools/sweeps/decode_ab.py --merge-splits`` does; docs/notes/decode-kernels.rst)."""

    def merges(q, k_cache, v_cache, batch, scale, sliding_window, out, first_row, softcap=None, sinks=None):
        from metrale.kernels import attention_decode_mma

        heads, kv_heads, head_dim, value_dim = _geometry(q, k_cache, v_cache)
        if not attention_decode_mma.supports(heads, kv_heads, head_dim, value_dim):
            return False
        splits = attention_decode_mma.device_split_count(q.shape[0], heads, kv_heads, head_dim, batch.max_context)
        return splits > 1 and attention_decode_mma.merges_itself(heads, kv_heads, head_dim, splits)

    return [Kernel("paged_attention_decode", "cuda", "metrale.kernels.attention_decode_mma (tensor cores, the splits "
                   "merged in the kernel)", build=_cuda_method("paged_attention_decode_mma_merged"), when=merges,
                   enabled=_decode_mma_enabled,
                   condition="METRALE_DECODE_MMA is not 0, the tensor-core geometries, several splits of at most "
                   "32 KiB of partials a block")]


def hopper_prompt_attention_kernels() -> list[Kernel]:
    """The warp-specialised prompt attention on ``wgmma`` with TMA loads
    (:mod:`metrale.kernels.attention_hopper`) as a kernel of ``paged_attention_prompt`` on
    compute capability 9.0 devices, for bf16 caches of the geometries it serves, tried before the
    ``mma.sync`` kernel (``tools/sweeps/prompt_attention_sweep.py`` times both)."""

    def hopper(q, k_cache, v_cache, batch, scale, sliding_window, out, first_segment, softcap=None, sinks=None):
        from metrale.kernels import attention_hopper

        if isinstance(k_cache, Fp8CacheArray) or isinstance(v_cache, Fp8CacheArray):
            return False
        heads, kv_heads, head_dim, value_dim = _geometry(q, k_cache, v_cache)
        return (attention_hopper.supports(heads, kv_heads, head_dim, value_dim, k_cache.shape[1])
                and attention_hopper.available())

    return [Kernel("paged_attention_prompt", "cuda", "metrale.kernels.attention_hopper (wgmma, TMA loads, "
                   "warp-specialised)", build=_cuda_method("paged_attention_prompt_wgmma"), when=hopper,
                   condition="a compute capability 9.0 device, a bf16 cache in pages of a power of two of at least 8 "
                   "rows, (K, V) heads of (64, 64), (128, 128), (192, 128) or (256, 256) dims")]


# -------------------------------------------------------------------------- norms, activations


def norm_kernels() -> list[Kernel]:
    """``rmsnorm_residual``: the CUDA C++ kernel (float4 loads) where it serves, else the numba one;
    ``rmsnorm``: ``rmsnorm_residual`` without a residual."""

    def words(x, residual, weight, eps, offset=0.0):
        from metrale.kernels import rmsnorm

        # A non-contiguous input is copied first, to a fresh (aligned) array.
        return (x.dtype == np.float32 and x.ndim == 2 and rmsnorm.words_supported(x.shape[1])
                and (not x.flags.c_contiguous or _aligned(x))
                and (residual is None or not residual.flags.c_contiguous or _aligned(residual)) and _aligned(weight))

    def composed_rmsnorm(backend: Any) -> Any:
        table = _ops_of(backend)

        def rmsnorm(x, weight, eps, offset=0.0):
            return table().rmsnorm_residual(x, None, weight, eps, offset)[0]

        return rmsnorm

    return [
        Kernel("rmsnorm_residual", "cuda", "metrale.kernels.rmsnorm (CUDA C++)",
               build=_cuda_method("rmsnorm_residual_words"), when=words,
               condition="float32 rows of H values, H a multiple of 4 up to 8192, 16-byte aligned arrays"),
        Kernel("rmsnorm_residual", "cuda", "metrale.kernels.rmsnorm", build=_cuda_method("rmsnorm_residual")),
        Kernel("rmsnorm", "cuda", "rmsnorm_residual without a residual (its kernels)", build=composed_rmsnorm),
    ]


def activation_kernels() -> list[Kernel]:
    """``silu_and_mul``: the CUDA C++ kernel for bf16 products it serves, else the numba one for the
    input's dtype;
    ``linear_silu`` (where the decode GEMV does not serve it): a cuBLAS product, then
    ``silu_and_mul``."""

    def words(gate_up):
        from metrale.kernels import activation

        return activation.words_supported(gate_up)

    def bits(gate_up):
        return gate_up.dtype == np.uint16

    def composed_linear_silu(backend: Any) -> Any:
        table, kernels = _ops_of(backend), backend.kernels

        def linear_silu(x, weight, bias=None):
            return table().silu_and_mul(kernels.gate_up_product(x, weight, bias))

        return linear_silu

    return [
        Kernel("silu_and_mul", "cuda", "metrale.kernels.activation (CUDA C++)", build=_cuda_method("silu_and_mul_words"),
               when=words, condition="bf16 bits, I a multiple of 8, contiguous, 16-byte aligned"),
        Kernel("silu_and_mul", "cuda", "metrale.kernels.activation (bf16 bits)", build=_cuda_method("silu_and_mul_bits"),
               when=bits, condition="bf16 bits"),
        Kernel("silu_and_mul", "cuda", "metrale.kernels.activation (float32)", build=_cuda_method("silu_and_mul")),
        Kernel("linear_silu", "cuda", "cuBLAS GEMM (bf16 out; float32 with a bias), then silu_and_mul (its kernels)",
               build=composed_linear_silu),
    ]


# ------------------------------------------------------------------------------- MLA and MoE


def head_linear_kernels(word_rows: int = HEAD_LINEAR_WORD_ROWS) -> list[Kernel]:
    """``head_linear``: the kernels of :mod:`metrale.kernels.head_linear` (a warp per output value,
    the rows in turn) for batches of up to ``word_rows`` rows -- the CUDA C++ one where it serves
    the layout, else the numba one -- and one cuBLAS product per head for larger batches."""

    def words(x, weight):
        from metrale.kernels import head_linear

        return x.shape[0] <= word_rows and head_linear.words_supported(x, weight)

    def few_rows(x, weight):
        return x.shape[0] <= word_rows

    return [
        Kernel("head_linear", "cuda", "metrale.kernels.head_linear (CUDA C++)", build=_cuda_method("head_linear_words"),
               when=words, condition=f"N <= {word_rows}, bf16 weights, in a multiple of 8 up to 2048, 16-byte aligned "
               "head rows"),
        Kernel("head_linear", "cuda", "metrale.kernels.head_linear", build=_cuda_method("head_linear"), when=few_rows,
               condition=f"N <= {word_rows}"),
        Kernel("head_linear", "cuda", "cuBLAS GEMM per head (metrale.kernels.linear)",
               build=_cuda_method("head_linear_per_head")),
    ]


def moe_kernels() -> list[Kernel]:
    """After the decode kernels (:func:`default_decode_kernels`): ``moe_route`` with the router
    kernel up to :data:`ROUTER_KERNEL_ROWS` rows, else a cuBLAS product; ``moe_experts`` with the
    grouped tensor-core kernels from :data:`GROUPED_EXPERTS_MIN_TOKENS` tokens, else pair by pair."""

    def router_kernel(x, gate, bias, method, n_group, topk_group, top_k, renormalise, scaling):
        return x.shape[0] <= ROUTER_KERNEL_ROWS

    def grouped(x, experts, weights, gate_up, down):
        from metrale.kernels import moe_grouped

        hidden, inter = x.shape[1], down.shape[1]
        return x.shape[0] >= GROUPED_EXPERTS_MIN_TOKENS and moe_grouped.supports(hidden, inter, down.shape[0] // hidden)

    return [
        Kernel("moe_route", "cuda", "metrale.kernels.moe (router-logits kernel)", build=_cuda_method("moe_route"),
               when=router_kernel, condition=f"N <= {ROUTER_KERNEL_ROWS}"),
        Kernel("moe_route", "cuda", "metrale.kernels.moe (router logits by cuBLAS)", build=_cuda_method("moe_route_gemm")),
        Kernel("moe_experts", "cuda", "metrale.kernels.moe_grouped (tensor cores, the pairs grouped by expert)",
               build=_cuda_method("moe_experts_grouped"), when=grouped,
               condition=f"N >= {GROUPED_EXPERTS_MIN_TOKENS}, H and I multiples of 8, E <= 1024"),
        Kernel("moe_experts", "cuda", "metrale.kernels.moe (pair by pair)", build=_cuda_method("moe_experts")),
        *clamped_experts_kernels(),
    ]


def clamped_experts_kernels() -> list[Kernel]:
    """``moe_experts_clamped`` (GPT-OSS's experts): the grouped tensor-core kernels for bf16 stacks
    from :data:`GROUPED_EXPERTS_MIN_TOKENS` tokens and for weight-only quantized stacks (MXFP4),
    dequantized into bf16 for the call, from :data:`GROUPED_DEQUANTIZED_EXPERTS_MIN_TOKENS`; else
    the MXFP4 kernels where both stacks are plain MXFP4 (codes decoded in registers, pair by pair);
    else the bf16 kernels pair by pair (a quantized stack dequantized into bf16 first)."""

    def mxfp4(x, experts, weights, gate_up, down, alpha, limit, gate_up_bias=None, down_bias=None):
        from metrale.kernels import moe_clamped

        return moe_clamped.is_plain_mxfp4(gate_up) and moe_clamped.is_plain_mxfp4(down)

    def grouped(x, experts, weights, gate_up, down, alpha, limit, gate_up_bias=None, down_bias=None):
        from metrale.kernels import moe_grouped

        stacks = (gate_up, down)
        if all(getattr(stack, "dtype", None) == np.uint16 for stack in stacks):
            least = GROUPED_EXPERTS_MIN_TOKENS
        elif all(isinstance(stack, QuantizedWeight) and stack.activations == "weight_only" for stack in stacks):
            least = GROUPED_DEQUANTIZED_EXPERTS_MIN_TOKENS
        else:
            return False
        hidden, inter = x.shape[1], down.shape[1]
        return x.shape[0] >= least and moe_grouped.supports(hidden, inter, down.shape[0] // hidden)

    return [
        Kernel("moe_experts_clamped", "cuda", "metrale.kernels.moe_grouped (tensor cores, the pairs grouped by expert)",
               build=_cuda_method("moe_experts_clamped_grouped"), when=grouped,
               condition=f"bf16 stacks and N >= {GROUPED_EXPERTS_MIN_TOKENS}, or weight-only quantized stacks "
               f"(dequantized for the call) and N >= {GROUPED_DEQUANTIZED_EXPERTS_MIN_TOKENS}; H and I multiples of 8, "
               "E <= 1024"),
        Kernel("moe_experts_clamped", "cuda", "metrale.kernels.moe_clamped (MXFP4 codes decoded in registers)",
               build=_cuda_method("moe_experts_clamped_mxfp4"), when=mxfp4,
               condition="both stacks plain MXFP4 (scales per 32 columns, no zero points, inputs unquantized)"),
        Kernel("moe_experts_clamped", "cuda", "metrale.kernels.moe_clamped (bf16 stacks)",
               build=_cuda_method("moe_experts_clamped_bf16")),
    ]


def latent_attention_kernels() -> list[Kernel]:
    """``latent_attention``: tensor cores for DeepSeek's geometry (over a bf16 or an FP8 cache),
    CUDA cores for any other geometry; ``latent_cache_write`` into an FP8 cache."""

    def mma(q, latent, batch, value_dim, scale):
        from metrale.kernels import attention_latent_mma

        return attention_latent_mma.supports(q.shape[1], q.shape[2], value_dim)

    def fp8_write(kv_a, norm_weight, eps, positions, inv_freq, attention_factor, interleaved, slot_mapping, latent):
        return isinstance(latent, Fp8CacheArray)

    return [
        Kernel("latent_attention", "cuda", "metrale.kernels.attention_latent_mma (tensor cores)",
               build=_cuda_method("latent_attention_mma"), when=mma,
               condition="heads a multiple of 16, rows of 512 + 64 values, values of 512 (over an FP8 cache "
                         "the codes converted to bf16 a step at a time, each key's scale on its scores and "
                         "probabilities)"),
        Kernel("latent_attention", "cuda", "metrale.kernels.attention_latent (CUDA cores; over an FP8 cache the "
               "codes as exact bf16 values, each key's scale on its scores and probabilities)",
               build=_cuda_method("latent_attention")),
        Kernel("latent_cache_write", "cuda", "metrale.kernels.attention_latent into rows of their own, then "
               "metrale.kernels.attention_fp8's quantized write", build=_cuda_method("latent_cache_write_fp8"),
               when=fp8_write, condition="an FP8 cache"),
    ]


def gdn_prompt_kernels() -> list[Kernel]:
    """``gdn_prompt_rule``: the chunked form on tensor cores where it serves the head sizes, else
    the recurrence."""

    def chunked(q, k, v, g, beta, state, slots, starts):
        from metrale.kernels import gated_delta_chunked

        return gated_delta_chunked.supports(q.shape[2], v.shape[2])

    return [
        Kernel("gdn_prompt_rule", "cuda", "metrale.kernels.gated_delta_chunked (tensor cores)",
               build=_cuda_method("gdn_prompt_rule_chunked"), when=chunked, condition="d_k and d_v each 64 or 128"),
        Kernel("gdn_prompt_rule", "cuda", "metrale.kernels.gated_delta (the recurrence)",
               build=_cuda_method("gdn_prompt_rule")),
    ]
