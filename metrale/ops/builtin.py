"""The built-in op set: each op declared once, with its NumPy reference (the CPU implementation)
and the CUDA kernel module that serves it on the GPU (:class:`metrale.ops.cuda.CudaKernels`).

Kernel modules are imported when an op first runs on the CPU (its reference) or when the CUDA
backend is built, never by importing this module: ``import metrale`` stays free of numba.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from metrale.errors import OpRegistrationError
from metrale.kernels.lora_tiles import adapter_tiles, check_adapter_tiles
from metrale.kernels.quantized import QuantizedWeight, quantized_linear_reference
from metrale.ops.registry import Kernel, Op, OpRegistry
from metrale.ops.registry import Operand as P
from metrale.ops.selection import (  # noqa: F401 (the kernel lists were defined here; they keep importing)
    FUSED_MLP_MAX_BYTES,
    _cuda_method,
    builtin_kernels,
    decode_gemv_kernels,
    default_decode_kernels,
    gdn_decode_kernels,
    moe_decode_kernels,
    moe_route_decode_kernels,
)

if TYPE_CHECKING:
    import pluggy

# ---------------------------------------------------------------------------- references


def _kernels(module: str) -> Any:
    import importlib

    return importlib.import_module(f"metrale.kernels.{module}")


def embedding(weight, ids):
    return _kernels("embedding").embedding_reference(weight, ids)


def rmsnorm(x, weight, eps, offset=0.0):
    return _kernels("rmsnorm").rmsnorm_reference(x, weight, eps, offset)


def rmsnorm_residual(x, residual, weight, eps, offset=0.0):
    return _kernels("rmsnorm").rmsnorm_residual_reference(x, residual, weight, eps, offset)


def linear(x, weight, bias=None):
    if isinstance(weight, QuantizedWeight):
        return quantized_linear_reference(to_float32(x), weight, bias)
    return _kernels("linear").linear_reference(x, weight, bias)


def silu_and_mul(gate_up):
    width = gate_up.shape[1] // 2
    return _kernels("activation").silu_and_mul_reference(gate_up[:, :width], gate_up[:, width:])


def linear_silu(x, weight, bias=None):
    return silu_and_mul(linear(x, weight, bias))


def rmsnorm_linear(x, residual, norm_weight, eps, offset, weight, bias=None):
    normed, summed = rmsnorm_residual(x, residual, norm_weight, eps, offset)
    return linear(normed, weight, bias), summed


def rmsnorm_mlp(x, residual, norm_weight, eps, offset, gate_up, down, gate_up_bias=None, down_bias=None):
    normed, summed = rmsnorm_residual(x, residual, norm_weight, eps, offset)
    return linear(linear_silu(normed, gate_up, gate_up_bias), down, down_bias), summed


def lora_linear(y, x, a, b, slots, route=None):
    # Rows grouped by slot: one product per adapter present (the GPU takes every row at once).
    if isinstance(route, int) and not np.isin(slots, (0, route)).all():
        raise ValueError(f"lora_linear: route {route} but rows of other slots")
    x = to_float32(x)
    a, b = to_float32(a), to_float32(b)
    width = a.shape[1]
    for slot in np.unique(slots):
        if slot == 0:
            continue
        rows = np.nonzero(slots == slot)[0]
        y[rows] += (x[rows] @ a[slot - 1].T) @ b[:, (slot - 1) * width : slot * width].T
    return y


def lora_expand(ext, b, slots, tiles, width, bias=None, swiglu=False):
    check_adapter_tiles("lora_expand", slots, tiles)
    out = b.shape[0]
    ext, b = to_float32(ext), to_float32(b)
    y = np.array(ext[:, :out], dtype=np.float32)
    if bias is not None:
        y += to_float32(bias)
    products = ext[:, out:]
    for slot in np.unique(slots):
        if slot == 0:
            continue
        rows = np.nonzero(slots == slot)[0]
        columns = slice((slot - 1) * width, slot * width)
        y[rows] += products[rows, columns] @ b[:, columns].T
    return silu_and_mul(y) if swiglu else y


def lora_token_rows(x, ids, slots, tokens, rows):
    for row in np.nonzero(slots)[0]:
        match = np.nonzero(tokens[slots[row]] == ids[row])[0]
        if match.size:
            x[row] = rows[slots[row], match[0]]
    return x


def lora_logit_rows(logits, h, slots, tokens, rows):
    h = to_float32(h)
    for row in np.nonzero(slots)[0]:
        replaced = tokens[slots[row]] >= 0
        logits[row, tokens[slots[row]][replaced]] = rows[slots[row]][replaced] @ h[row]
    return logits


def to_bf16(x):
    # On the CPU a matrix-product input stays float32.
    return np.array(x, dtype=np.float32)


def to_float32(x):
    x = np.asarray(x)
    if x.dtype == np.uint16:
        return (x.astype(np.uint32) << 16).view(np.float32)
    return np.array(x, dtype=np.float32)


def qkv_rope_cache(qkv, positions, slot_mapping, inv_freq, attention_factor, num_heads, num_kv_heads, head_dim,
                   k_cache, v_cache, q_norm=None, k_norm=None, eps=1e-6, norm_offset=0.0, interleaved=False,
                   rotary_dim=None):
    return _kernels("qkv_rope").qkv_rope_cache_reference(
        qkv, positions, slot_mapping, inv_freq, attention_factor, num_heads, num_kv_heads, head_dim, k_cache, v_cache,
        q_norm, k_norm, eps, norm_offset, interleaved, rotary_dim=rotary_dim,
    )


def feed_tokens(token_ids, source, rows, indices):
    return _kernels("token_feed").feed_tokens_reference(token_ids, source, rows, indices)


def layernorm(x, weight, bias, eps):
    return _kernels("layernorm").layernorm_reference(x, weight, bias, eps)


def layernorm_residual(x, residual, weight, bias, eps):
    return _kernels("layernorm").layernorm_residual_reference(x, residual, weight, bias, eps)


def gelu(x, approximate="none"):
    return _kernels("activation").gelu_reference(x, approximate)


def gelu_and_mul(gate_up, approximate="none"):
    width = gate_up.shape[1] // 2
    return _kernels("activation").gelu_and_mul_reference(gate_up[:, :width], gate_up[:, width:], approximate)


def paged_attention(q, k_cache, v_cache, batch, scale, sliding_window, softcap=None, sinks=None):
    out = _kernels("attention").paged_attention_reference(
        q, k_cache, v_cache, batch.block_tables, batch.seq_index, batch.positions, scale, sliding_window, softcap, sinks
    )
    return out.reshape(out.shape[0], -1)


def paged_attention_decode(q, k_cache, v_cache, batch, scale, sliding_window, out, first_row, softcap=None, sinks=None):
    rows = slice(int(first_row), int(first_row) + q.shape[0])
    out[...] = _kernels("attention").paged_attention_reference(
        q, k_cache, v_cache, batch.block_tables, batch.seq_index[rows], batch.positions[rows], scale, sliding_window,
        softcap, sinks,
    ).reshape(q.shape[0], -1)
    return out


def paged_attention_prompt(q, k_cache, v_cache, batch, scale, sliding_window, out, first_segment, softcap=None,
                           sinks=None):
    first = int(batch.row_starts[first_segment])
    out[first:] = _kernels("attention").paged_attention_reference(
        q[first:], k_cache, v_cache, batch.block_tables, batch.seq_index[first:], batch.positions[first:], scale,
        sliding_window, softcap, sinks,
    ).reshape(q.shape[0] - first, -1)
    return out


def latent_attention(q, latent, batch, value_dim, scale):
    out = _kernels("attention_latent").latent_attention_reference(
        q, latent, batch.block_tables, batch.seq_index, batch.positions, value_dim, scale
    )
    return out.reshape(out.shape[0], -1)


def latent_cache_write(kv_a, norm_weight, eps, positions, inv_freq, attention_factor, interleaved, slot_mapping, latent):
    _kernels("attention_latent").latent_cache_write_reference(
        kv_a, norm_weight, eps, positions, inv_freq, attention_factor, interleaved, slot_mapping, latent
    )


def head_linear(x, weight):
    return _kernels("head_linear").head_linear_reference(x, weight)


def moe_route(x, gate, bias, method, n_group, topk_group, top_k, renormalise, scaling):
    logits = to_float32(x) @ np.asarray(gate, dtype=np.float32).T
    return _kernels("moe").route_reference(logits, bias, method, n_group, topk_group, top_k, renormalise, scaling)


def moe_experts(x, experts, weights, gate_up, down):
    if isinstance(gate_up, QuantizedWeight) or isinstance(down, QuantizedWeight):
        return _quantized_experts(to_float32(x), experts, weights, gate_up, down)
    return _kernels("moe").experts_reference(x, experts, weights, gate_up, down)


def moe_topk_softmax(logits, top_k):
    return _kernels("moe_clamped").topk_softmax_reference(logits, top_k)


def moe_experts_clamped(x, experts, weights, gate_up, down, alpha, limit, gate_up_bias=None, down_bias=None):
    return _kernels("moe_clamped").clamped_experts_reference(x, experts, weights, gate_up, down, alpha, limit,
                                                             gate_up_bias, down_bias)


def _quantized_experts(x, experts, weights, gate_up, down):
    """:func:`moe_experts` over quantized stacked weights: each chosen expert's rows of ``gate_up``
    and ``down`` as a quantized product (the activations quantized as each weight says)."""
    hidden, inter = x.shape[1], down.shape[1]
    out = np.zeros((x.shape[0], hidden), dtype=np.float32)
    for n in range(x.shape[0]):
        for s in range(experts.shape[1]):
            e = int(experts[n, s])
            act = silu_and_mul(linear(x[n : n + 1], gate_up[2 * inter * e : 2 * inter * (e + 1)]))
            out[n] += weights[n, s] * linear(act, down[hidden * e : hidden * (e + 1)])[0]
    return out


def gdn_conv_update(inputs, weight, conv_state, slots):
    return _kernels("gated_delta").conv_update_reference(inputs, weight, conv_state, slots)


def gdn_recurrent_step(q, k, v, g, beta, state, slots):
    return _kernels("gated_delta").recurrent_step_reference(q, k, v, g, beta, state, slots)


def gdn_prompt_rule(q, k, v, g, beta, state, slots, starts):
    return _kernels("gated_delta").prompt_rule_reference(q, k, v, g, beta, state, slots, starts)


def gated_rmsnorm(x, z, weight, eps):
    return _kernels("gated").gated_rmsnorm_reference(x, z, weight, eps)


def sigmoid_gate(x, gate):
    return _kernels("gated").sigmoid_gate_reference(x, gate)


def gdn_ungroup(qkvz, key_heads, value_heads, key_dim, value_dim):
    return _kernels("gated_delta").ungroup_reference(qkvz, key_heads, value_heads, key_dim, value_dim)


def gdn_gates(ba, a_log, dt_bias, key_heads):
    return _kernels("gated_delta").gates_reference(ba, a_log, dt_bias, key_heads)


def gdn_split_heads(mixed, key_heads, value_heads, key_dim, value_dim):
    return _kernels("gated_delta").split_heads_reference(mixed, key_heads, value_heads, key_dim, value_dim)


def gdn_decode(qkvz, ba, conv_weight, conv_state, a_log, dt_bias, state, slots, norm_weight, eps, key_heads,
               value_heads, key_dim, value_dim):
    return _kernels("gdn_decode").decode_reference(qkvz, ba, conv_weight, conv_state, a_log, dt_bias, state, slots,
                                                   norm_weight, eps, key_heads, value_heads, key_dim, value_dim)


def gdn_conv_prompts(inputs, weight, conv_state, slots, starts):
    return _kernels("gated_delta").conv_prompts_reference(inputs, weight, conv_state, slots, starts)


def gated_add(x, y, gate):
    return _kernels("gated").gated_add_reference(x, y, gate)


def latent_query(q_latent, q, positions, inv_freq, attention_factor, interleaved):
    return _kernels("attention_latent").latent_query_reference(q_latent, q, positions, inv_freq, attention_factor,
                                                                interleaved)


# ------------------------------------------------------------------------------ examples


def _rows(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _norm_examples(rng: np.random.Generator, residual: bool) -> list[dict[str, Any]]:
    cases = []
    for rows, hidden, offset in ((1, 64, 0.0), (5, 96, 1.0), (3, 200, 0.0)):
        case = {"x": _rows(rng, rows, hidden), "weight": _rows(rng, hidden, scale=0.5) + 1.0, "eps": 1e-6, "offset": offset}
        if residual:
            case = {"x": case["x"], "residual": _rows(rng, rows, hidden), **{k: case[k] for k in ("weight", "eps", "offset")}}
        cases.append(case)
    if residual:
        cases.append({"x": _rows(rng, 2, 64), "residual": None, "weight": _rows(rng, 64) + 1.0, "eps": 1e-5, "offset": 0.0})
    return cases


def _layernorm_examples(rng: np.random.Generator, residual: bool) -> list[dict[str, Any]]:
    cases = []
    for rows, hidden, with_bias in ((1, 64, True), (5, 96, False), (3, 200, True)):
        x = _rows(rng, rows, hidden) + np.float32(0.5)
        case = {"x": x, "weight": _rows(rng, hidden, scale=0.5) + 1.0, "bias": _rows(rng, hidden) if with_bias else None,
                "eps": 1e-5}
        if residual:
            case = {"x": x, "residual": _rows(rng, rows, hidden), **{k: case[k] for k in ("weight", "bias", "eps")}}
        cases.append(case)
    return cases


def _gelu_examples(rng: np.random.Generator, gated: bool) -> list[dict[str, Any]]:
    key = "gate_up" if gated else "x"
    return [{key: _rows(rng, rows, 2 * width if gated else width, scale=2.0), "approximate": approximate}
            for rows, width, approximate in ((1, 64, "none"), (4, 96, "tanh"), (3, 40, "none"))]


def _linear_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    return [
        {"x": _rows(rng, rows, width), "weight": _rows(rng, out, width, scale=0.1), "bias": bias}
        for rows, width, out, bias in ((1, 64, 48, None), (7, 128, 32, _rows(rng, 32)))
    ]


def _silu_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    return [{"gate_up": _rows(rng, rows, 2 * width)} for rows, width in ((1, 64), (4, 96))]


def _rmsnorm_linear_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    return [
        {"x": _rows(rng, rows, hidden, scale=2.0), "residual": _rows(rng, rows, hidden) if residual else None,
         "norm_weight": _rows(rng, hidden, scale=0.5) + 1.0, "eps": 1e-6, "offset": offset,
         "weight": _rows(rng, out, hidden, scale=0.1), "bias": _rows(rng, out) if bias else None}
        for rows, hidden, out, residual, offset, bias in ((1, 64, 48, True, 0.0, False), (5, 96, 40, False, 1.0, True),
                                                          (9, 128, 24, True, 0.0, False))
    ]


def _rmsnorm_mlp_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    return [
        {"x": _rows(rng, rows, hidden, scale=2.0), "residual": _rows(rng, rows, hidden), "norm_weight": _rows(rng, hidden) + 1.0,
         "eps": 1e-5, "offset": 0.0, "gate_up": _rows(rng, 2 * inter, hidden, scale=0.1),
         "down": _rows(rng, hidden, inter, scale=0.1), "gate_up_bias": None, "down_bias": _rows(rng, hidden) if bias else None}
        for rows, hidden, inter, bias in ((1, 64, 96, False), (4, 128, 72, True), (10, 64, 40, False))
    ]


def _linear_silu_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    return [{"x": _rows(rng, rows, 64), "weight": _rows(rng, 96, 64, scale=0.1), "bias": None} for rows in (1, 6)]


def _embedding_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    return [{"weight": _rows(rng, 50, 64), "ids": rng.integers(0, 50, size=rows).astype(np.int32)} for rows in (1, 9)]


def _feed_tokens_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    examples = []
    for rows, fed in ((1, 1), (9, 5)):
        source = rng.integers(1, 1000, size=7).astype(np.int32)
        source[3] = -1  # a row with nothing to sample from
        examples.append({"token_ids": rng.integers(1, 1000, size=rows).astype(np.int32), "source": source,
                         "rows": rng.permutation(rows)[:fed].astype(np.int32),
                         "indices": rng.integers(0, 7, size=fed).astype(np.int32)})
    return examples


def _lora_slots(rng: np.random.Generator, rows: int, slots: int) -> np.ndarray:
    return rng.integers(0, slots + 1, size=rows).astype(np.int32)


def _lora_stack_example(rng: np.random.Generator, inner: int, outs: tuple[int, ...], rank: int,
                        slots: int) -> tuple[np.ndarray, np.ndarray]:
    """``(a [S, G R, in], b [out, S G R])`` of a :class:`~metrale.layers.lora_stacks.LoraStack` (``b``
    block-diagonal per slot)."""
    width = len(outs) * rank
    a = _rows(rng, slots, width, inner, scale=0.2)
    b = np.zeros((sum(outs), slots * width), np.float32)
    start = 0
    for group, out in enumerate(outs):
        for slot in range(slots):
            column = slot * width + group * rank
            b[start : start + out, column : column + rank] = _rows(rng, out, rank, scale=0.2)
        start += out
    return a, b


# (rows, in, the fused projections' outputs, rank, slots)
_LORA_SHAPES = ((1, 64, (48,), 8, 1), (7, 96, (64, 32, 32), 16, 3), (33, 128, (80, 80), 4, 4))


def _lora_linear_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    examples = []
    for rows, inner, outs, rank, slots in _LORA_SHAPES:
        a, b = _lora_stack_example(rng, inner, outs, rank, slots)
        examples.append({"y": _rows(rng, rows, sum(outs)), "x": _rows(rng, rows, inner), "a": a, "b": b,
                         "slots": _lora_slots(rng, rows, slots)})
    return examples


def _lora_expand_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    examples = []
    for (rows, inner, outs, rank, slots), bias, swiglu in zip(_LORA_SHAPES, (False, True, True), (False, False, True)):
        a, b = _lora_stack_example(rng, inner, outs, rank, slots)
        # A product with the stack's extended weight: the projection's columns, then every slot's shrunk products.
        ext = np.concatenate([_rows(rng, rows, sum(outs)), _rows(rng, rows, inner) @ a.reshape(-1, inner).T], axis=1)
        row_slots = _lora_slots(rng, rows, slots)
        examples.append({"ext": ext.astype(np.float32), "b": b, "slots": row_slots, "tiles": adapter_tiles(row_slots),
                         "width": len(outs) * rank, "bias": _rows(rng, sum(outs)) if bias else None,
                         "swiglu": swiglu})
    return examples


def _token_table(rng: np.random.Generator, slots: int, width: int, vocab: int, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.full((slots + 1, width), -1, np.int32)
    for slot in range(1, slots + 1):
        count = int(rng.integers(1, width + 1))
        tokens[slot, :count] = rng.choice(vocab, size=count, replace=False)
    return tokens, _rows(rng, slots + 1, width, hidden)


def _lora_token_rows_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    examples = []
    for rows, slots in ((1, 1), (12, 3)):
        tokens, table = _token_table(rng, slots, 4, 16, 64)
        examples.append({"x": _rows(rng, rows, 64), "ids": rng.integers(0, 16, size=rows).astype(np.int32),
                         "slots": _lora_slots(rng, rows, slots), "tokens": tokens, "rows": table})
    return examples


def _lora_logit_rows_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    examples = []
    for rows, slots in ((1, 1), (9, 3)):
        tokens, table = _token_table(rng, slots, 5, 40, 64)
        examples.append({"logits": _rows(rng, rows, 40), "h": _rows(rng, rows, 64),
                         "slots": _lora_slots(rng, rows, slots), "tokens": tokens, "rows": table})
    return examples


def _sigmoid_gate_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    return [{"x": _rows(rng, rows, 64), "gate": _rows(rng, rows, 64)} for rows in (1, 5)]


def _gated_rmsnorm_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    return [{"x": _rows(rng, 4, 3, 64), "z": _rows(rng, 4, 3, 64), "weight": _rows(rng, 64) + 1.0, "eps": 1e-6}]


def _gdn_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    return [{"key_heads": hk, "value_heads": hv, "key_dim": 8, "value_dim": 12} for hk, hv in ((2, 2), (2, 4))]


def _gdn_ungroup_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    return [{"qkvz": _rows(rng, 3, g["key_heads"] * (2 * g["key_dim"]) + 2 * g["value_heads"] * g["value_dim"]), **g}
            for g in _gdn_examples(rng)]


def _gdn_split_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    return [{"mixed": _rows(rng, 5, 2 * g["key_heads"] * g["key_dim"] + g["value_heads"] * g["value_dim"]), **g}
            for g in _gdn_examples(rng)]


def _gdn_gates_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    return [{"ba": _rows(rng, 3, 2 * hv), "a_log": _rows(rng, hv, scale=0.3), "dt_bias": _rows(rng, hv), "key_heads": hk}
            for hk, hv in ((2, 2), (2, 6))]


def _gdn_decode_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    examples = []
    for hk, hv, dk, dv, rows in ((2, 2, 32, 32, 1), (2, 4, 32, 48, 3)):
        channels, slots = 2 * hk * dk + hv * dv, rows + 2
        examples.append({
            "qkvz": _rows(rng, rows, hk * (2 * dk) + 2 * hv * dv), "ba": _rows(rng, rows, 2 * hv),
            "conv_weight": _rows(rng, channels, 4, scale=0.5), "conv_state": _rows(rng, slots, channels, 3),
            "a_log": _rows(rng, hv, scale=0.3), "dt_bias": _rows(rng, hv), "state": _rows(rng, slots, hv, dk, dv, scale=0.3),
            "slots": rng.permutation(slots)[:rows].astype(np.int32), "norm_weight": _rows(rng, dv, scale=0.3) + 1.0,
            "eps": 1e-6, "key_heads": hk, "value_heads": hv, "key_dim": dk, "value_dim": dv,
        })
    return examples


def _gated_add_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    return [{"x": _rows(rng, rows, 48), "y": _rows(rng, rows, 48), "gate": _rows(rng, rows, 1)} for rows in (1, 4)]


def _latent_query_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    return [{"q_latent": _rows(rng, 3, 2, 16), "q": _rows(rng, 3, 2, 24), "positions": np.array([0, 5, 17], np.int32),
             "inv_freq": (1.0 / 10000 ** (np.arange(0, 8, 2) / 8)).astype(np.float32), "attention_factor": 1.2,
             "interleaved": interleaved} for interleaved in (False, True)]


def _moe_route_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    cases = []
    # rows, hidden, experts, method, n_group, topk_group, top_k, renormalise, scaling
    for rows, hidden, experts, method, n_group, topk_group, top_k, renormalise, scaling in (
        (1, 128, 64, "greedy", 1, 1, 6, False, 1.0), (3, 256, 128, "greedy", 1, 1, 10, True, 1.0),
        (4, 128, 64, "group_limited_greedy", 8, 3, 6, False, 16.0), (2, 256, 256, "noaux_tc", 8, 4, 8, True, 2.5),
    ):
        cases.append({"x": _rows(rng, rows, hidden), "gate": _rows(rng, experts, hidden, scale=hidden**-0.5),
                      "bias": _rows(rng, experts, scale=0.05) if method == "noaux_tc" else None, "method": method,
                      "n_group": n_group, "topk_group": topk_group, "top_k": top_k, "renormalise": renormalise,
                      "scaling": scaling})
    return cases


def _moe_experts_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    cases = []
    for rows, hidden, inter, experts, top_k in ((1, 64, 32, 8, 2), (3, 128, 48, 16, 4)):
        chosen = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(rows)]).astype(np.int32)
        weights = rng.random((rows, top_k)).astype(np.float32)
        cases.append({"x": _rows(rng, rows, hidden), "experts": chosen, "weights": weights,
                      "gate_up": _rows(rng, experts * 2 * inter, hidden, scale=0.1),
                      "down": _rows(rng, experts * hidden, inter, scale=0.1)})
    return cases


def _moe_topk_softmax_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    return [{"logits": _rows(rng, rows, experts, scale=2.0), "top_k": top_k}
            for rows, experts, top_k in ((1, 32, 4), (5, 128, 4), (3, 8, 2))]


def _moe_experts_clamped_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    cases = []
    for rows, hidden, inter, experts, top_k, limit, biased in ((1, 64, 32, 8, 2, 7.0, True), (3, 128, 48, 16, 4, 0.5, True),
                                                               (2, 64, 32, 4, 2, 1.0, False)):
        chosen = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(rows)]).astype(np.int32)
        weights = rng.random((rows, top_k)).astype(np.float32)
        cases.append({"x": _rows(rng, rows, hidden), "experts": chosen, "weights": weights,
                      "gate_up": _rows(rng, experts * 2 * inter, hidden, scale=0.1),
                      "down": _rows(rng, experts * hidden, inter, scale=0.1), "alpha": 1.702, "limit": limit,
                      "gate_up_bias": _rows(rng, experts * 2 * inter, scale=0.5) if biased else None,
                      "down_bias": _rows(rng, experts * hidden, scale=0.5) if biased else None})
    return cases


def _head_linear_examples(rng: np.random.Generator) -> list[dict[str, Any]]:
    return [{"x": _rows(rng, rows, 4, 64), "weight": _rows(rng, 4 * 32, 64, scale=0.1)} for rows in (1, 3)]


# --------------------------------------------------------------------------- declarations

X = P("x", "[N, H]", "activation")
ATTENTION_OPERANDS = (P("q", "[N, nh, d]", "activation"), P("k_cache", "[blocks, block, nkv, d]", "cache"),
                      P("v_cache", "[blocks, block, nkv, dv]", "cache"), P("batch", kind="batch"),
                      P("scale", kind="scalar"), P("sliding_window", kind="scalar", optional=True))
WINDOW = P("sliding_window", kind="scalar", doc="the window (None: none)")
ATTENTION_OPTIONS = (
    P("softcap", kind="scalar", optional=True, doc="the logits' soft cap: ``softcap * tanh(logit / softcap)`` (None: off)"),
    P("sinks", "[nh]", "constant", optional=True,
      doc="one logit per query head added to its softmax's denominator, never attended (None: off)"),
)
NORMED = P("normed", "[N, H]", "matmul_input", "the normed rows, an input of a matrix product")


def _declarations() -> list[tuple[Op, str]]:
    """Every built-in op with what serves it on the GPU (a module of :mod:`metrale.kernels`, or
    the words shown when it is not one)."""
    return [
        (Op("embedding", "Rows of an embedding table.",
            (P("weight", "[V, H]", "weight"), P("ids", "[N]", "index")),
            (P("rows", "[N, H]", "activation"),), embedding, examples=_embedding_examples, cuda_tolerance=1e-2),
         "embedding"),
        (Op("feed_tokens", "A step's input tokens fed on the device from the tokens a step before it sampled: "
            "``token_ids[rows[i]] = max(source[indices[i]], 0)`` (updated in place and returned).",
            (P("token_ids", "[N]", "index"), P("source", "[S]", "index", "the sampled tokens (-1: none)"),
             P("rows", "[F]", "index", "distinct rows of token_ids"), P("indices", "[F]", "index")),
            (P("token_ids", "[N]", "index"),), feed_tokens, examples=_feed_tokens_examples, cpu_tolerance=0.0,
            cuda_tolerance=0.0),
         "token_feed"),
        (Op("rmsnorm", "RMSNorm over the last axis: ``x / sqrt(mean(x^2) + eps) * (offset + weight)``.",
            (X, P("weight", "[H]", "weight"), P("eps", kind="scalar"),
             P("offset", kind="scalar", doc="1.0 for zero-centred norms (Qwen3-Next), else 0.0")),
            (NORMED,), rmsnorm, examples=functools.partial(_norm_examples, residual=False)),
         "rmsnorm"),
        (Op("rmsnorm_residual", "The residual add fused with RMSNorm: ``s = x + residual``; returns "
            "``(rmsnorm(s), s)``. With ``residual`` None the sum is ``x`` (the first layer).",
            (X, P("residual", "[N, H]", "activation", optional=True), P("weight", "[H]", "weight"),
             P("eps", kind="scalar"), P("offset", kind="scalar")),
            (NORMED, P("summed", "[N, H]", "activation", "the new residual stream")),
            rmsnorm_residual, examples=functools.partial(_norm_examples, residual=True)),
         "rmsnorm"),
        (Op("layernorm", "LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * weight + bias`` (biased "
            "variance, as ``torch.nn.LayerNorm``).",
            (X, P("weight", "[H]", "weight"), P("bias", "[H]", "constant", optional=True), P("eps", kind="scalar")),
            (NORMED,), layernorm, examples=functools.partial(_layernorm_examples, residual=False)),
         "layernorm"),
        (Op("layernorm_residual", "The residual add fused with LayerNorm: ``s = x + residual``; returns "
            "``(layernorm(s), s)``. With ``residual`` None the sum is ``x``.",
            (X, P("residual", "[N, H]", "activation", optional=True), P("weight", "[H]", "weight"),
             P("bias", "[H]", "constant", optional=True), P("eps", kind="scalar")),
            (NORMED, P("summed", "[N, H]", "activation", "the new residual stream")),
            layernorm_residual, examples=functools.partial(_layernorm_examples, residual=True)),
         "layernorm"),
        (Op("gelu", "GELU: the erf form (``approximate='none'``) or the tanh form (``'tanh'``), as torch.",
            (X, P("approximate", kind="option", doc="'none' or 'tanh'")),
            (P("act", "[N, H]", "matmul_input"),), gelu, examples=functools.partial(_gelu_examples, gated=False)),
         "activation"),
        (Op("gelu_and_mul", "GeGLU's activation: ``gelu(gate) * up`` of ``gate_up = [gate | up]``.",
            (P("gate_up", "[N, 2 I]", "activation"), P("approximate", kind="option", doc="'none' or 'tanh'")),
            (P("act", "[N, I]", "matmul_input"),), gelu_and_mul, examples=functools.partial(_gelu_examples, gated=True)),
         "activation"),
        (Op("linear", "``x @ weight.T + bias`` (cuBLAS on the GPU).",
            (P("x", "[N, in]", "matmul_input"), P("weight", "[out, in]", "weight"),
             P("bias", "[out]", "constant", optional=True)),
            (P("y", "[N, out]", "activation"),), linear, examples=_linear_examples),
         "cuBLAS GEMM (metrale.kernels.linear)"),
        (Op("silu_and_mul", "SwiGLU's activation: ``silu(gate) * up`` of ``gate_up = [gate | up]``.",
            (P("gate_up", "[N, 2 I]", "activation"),), (P("act", "[N, I]", "matmul_input"),),
            silu_and_mul, examples=_silu_examples),
         "activation"),
        (Op("linear_silu", "``silu_and_mul(linear(x, weight, bias))`` (one decode GEMV kernel, the gate in its "
            "epilogue, for small batches).",
            (P("x", "[N, in]", "matmul_input"), P("weight", "[2 I, in]", "weight"),
             P("bias", "[2 I]", "constant", optional=True)),
            (P("act", "[N, I]", "matmul_input"),), linear_silu, examples=_linear_silu_examples),
         "cuBLAS GEMM and metrale.kernels.activation"),
        (Op("rmsnorm_linear", "A norm and the projection after it: ``(linear(rmsnorm(s)), s)`` with ``s = x + "
            "residual`` (``x`` with ``residual`` None); one decode GEMV kernel for small batches when "
            ":func:`~metrale.ops.selection.decode_gemv_kernels` are registered.",
            (X, P("residual", "[N, H]", "activation", optional=True), P("norm_weight", "[H]", "weight"),
             P("eps", kind="scalar"), P("offset", kind="scalar"), P("weight", "[out, H]", "weight"),
             P("bias", "[out]", "constant", optional=True)),
            (P("y", "[N, out]", "activation"), P("summed", "[N, H]", "activation", "the new residual stream")),
            rmsnorm_linear, examples=_rmsnorm_linear_examples),
         "rmsnorm_residual, then linear (their kernels)"),
        (Op("rmsnorm_mlp", "A norm and the SwiGLU MLP after it: ``(down(silu_and_mul(gate_up(rmsnorm(s)))), s)`` with "
            "``s = x + residual``; two decode GEMV kernels for small batches when "
            ":func:`~metrale.ops.selection.decode_gemv_kernels` are registered.",
            (X, P("residual", "[N, H]", "activation", optional=True), P("norm_weight", "[H]", "weight"),
             P("eps", kind="scalar"), P("offset", kind="scalar"), P("gate_up", "[2 I, H]", "weight"),
             P("down", "[H, I]", "weight"), P("gate_up_bias", "[2 I]", "constant", optional=True),
             P("down_bias", "[H]", "constant", optional=True)),
            (P("y", "[N, H]", "activation"), P("summed", "[N, H]", "activation", "the new residual stream")),
            rmsnorm_mlp, examples=_rmsnorm_mlp_examples),
         "rmsnorm_residual, then linear_silu and linear (their kernels)"),
        (Op("to_bf16", "``x`` as a matrix-product input: bf16 bits on the GPU, a float32 copy on the CPU.",
            (X,), (P("y", "[N, H]", "matmul_input"),), to_bf16),
         "activation"),
        (Op("to_float32", "``x`` as float32: bf16 bits widened, float32 copied.",
            (P("x", "[...]", "matmul_input"),), (P("y", "[...]", "activation"),), to_float32),
         "CuPy widening copy"),
        (Op("qkv_rope_cache", "Split ``qkv`` into heads, apply the optional per-head q/k RMSNorm and RoPE (half-split "
            "pairs, or adjacent pairs when ``interleaved``), write K and V at ``slot_mapping`` into the paged cache; "
            "returns the rotated queries.",
            (P("qkv", "[N, (nh + 2 nkv) d]", "activation"), P("positions", "[N]", "index"),
             P("slot_mapping", "[N]", "index"), P("inv_freq", "[d / 2]", "constant"), P("attention_factor", kind="scalar"),
             P("num_heads", kind="scalar"), P("num_kv_heads", kind="scalar"), P("head_dim", kind="scalar"),
             P("k_cache", "[blocks, block, nkv, d]", "cache"), P("v_cache", "[blocks, block, nkv, d]", "cache"),
             P("q_norm", "[d]", "weight", optional=True), P("k_norm", "[d]", "weight", optional=True),
             P("eps", kind="scalar"), P("norm_offset", kind="scalar"), P("interleaved", kind="option"),
             P("rotary_dim", kind="scalar", optional=True,
               doc="dims of each head RoPE rotates (partial rotary); the rest pass through. None: all of "
               "``2 * len(inv_freq)``")),
            (P("q", "[N, nh, d]", "activation"),), qkv_rope_cache),
         "qkv_rope"),
        (Op("paged_attention", "Causal GQA attention of each row over its sequence's paged K/V (optionally a sliding "
            "window, a soft cap of the logits, sinks); decode rows and prompt rows in one call. Query head ``h`` reads "
            "KV head ``h // (nh / nkv)``; the logits ``scale * q . k`` are soft-capped to ``softcap * tanh(logit / "
            "softcap)`` when ``softcap`` is given (Gemma-2), and with ``sinks`` each head's softmax has one more "
            "logit in its denominator, ``sinks[h]``, whose value is never attended (GPT-OSS).",
            ATTENTION_OPERANDS + ATTENTION_OPTIONS, (P("out", "[N, nh * dv]", "matmul_input"),), paged_attention),
         "attention"),
        (Op("paged_attention_decode", "``paged_attention`` of the rows ``first_row .. first_row + R`` of the batch, "
            "each attending as a row of its own (a step's decode rows, or prompt rows one at a time), written into "
            "``out`` in place and returned. ``paged_attention`` calls it for a step's leading one-row segments.",
            (P("q", "[R, nh, d]", "activation", "the queries of those rows"), *ATTENTION_OPERANDS[1:5], WINDOW,
             P("out", "[R, nh * dv]", "matmul_input", "where the rows' outputs go"),
             P("first_row", kind="scalar", doc="the batch row of q's first row"), *ATTENTION_OPTIONS),
            (P("out", "[R, nh * dv]", "matmul_input"),), paged_attention_decode),
         "attention"),
        (Op("paged_attention_prompt", "``paged_attention`` of the rows of the batch's segments from ``first_segment`` "
            "on (each segment's rows consecutive positions of one sequence: prompt rows), written into those rows "
            "of ``out`` in place; ``out`` returned. ``paged_attention`` calls it for the segments after a step's "
            "decode rows.",
            (*ATTENTION_OPERANDS[:5], WINDOW,
             P("out", "[N, nh * dv]", "matmul_input", "the step's output; only those rows written"),
             P("first_segment", kind="scalar", doc="the first segment served"), *ATTENTION_OPTIONS),
            (P("out", "[N, nh * dv]", "matmul_input"),), paged_attention_prompt),
         "attention"),
        (Op("latent_attention", "MLA's absorbed decode attention of one-row segments over the paged latent cache.",
            (P("q", "[N, nh, r + d_r]", "activation"), P("latent", "[blocks, block, r + d_r]", "cache"),
             P("batch", kind="batch"), P("value_dim", kind="scalar"), P("scale", kind="scalar")),
            (P("out", "[N, nh * value_dim]", "matmul_input"),), latent_attention),
         "attention_latent"),
        (Op("latent_cache_write", "MLA's cache write: ``[rmsnorm(kv_a[:, :r]) | rope(kv_a[:, r:])]`` at each row's slot.",
            (P("kv_a", "[N, r + d_r]", "activation"), P("norm_weight", "[r]", "weight"), P("eps", kind="scalar"),
             P("positions", "[N]", "index"), P("inv_freq", "[d_r / 2]", "constant"), P("attention_factor", kind="scalar"),
             P("interleaved", kind="option"), P("slot_mapping", "[N]", "index"),
             P("latent", "[blocks, block, r + d_r]", "cache")),
            (), latent_cache_write),
         "attention_latent"),
        (Op("head_linear", "A matrix product per head: ``weight[h] @ x[n, h]``, ``weight`` stacked ``[nh * out, in]``.",
            (P("x", "[N, nh, in]", "matmul_input"), P("weight", "[nh * out, in]", "weight")),
            (P("y", "[N, nh, out]", "activation"),), head_linear, examples=_head_linear_examples),
         "head_linear"),
        (Op("moe_route", "Router logits ``x @ gate.T`` (float32) and the chosen experts with their weights: softmax "
            "(``greedy``, ``group_limited_greedy``) or sigmoid with a correction bias (``noaux_tc``).",
            (P("x", "[N, H]", "matmul_input"), P("gate", "[E, H]", "constant"), P("bias", "[E]", "constant", optional=True),
             P("method", kind="option"), P("n_group", kind="scalar"), P("topk_group", kind="scalar"),
             P("top_k", kind="scalar"), P("renormalise", kind="option"), P("scaling", kind="scalar")),
            (P("experts", "[N, k]", "index"), P("weights", "[N, k]", "activation")), moe_route,
            examples=_moe_route_examples),
         "moe"),
        (Op("moe_experts", "The chosen experts' SwiGLU from stacked expert weights, weighted and summed.",
            (P("x", "[N, H]", "matmul_input"), P("experts", "[N, k]", "index"), P("weights", "[N, k]", "activation"),
             P("gate_up", "[E * 2 I, H]", "weight", "the experts' gate and up projections, stacked"),
             P("down", "[E * H, I]", "weight", "the experts' down projections, stacked")),
            (P("y", "[N, H]", "activation"),), moe_experts, examples=_moe_experts_examples),
         "moe"),
        (Op("moe_topk_softmax", "The chosen experts of router logits computed apart (GPT-OSS's biased router): each "
            "row's ``top_k`` largest logits, in descending order (ties to the smaller expert), weighted by the softmax "
            "over those ``k`` logits only.",
            (P("logits", "[N, E]", "activation"), P("top_k", kind="scalar")),
            (P("experts", "[N, k]", "index"), P("weights", "[N, k]", "activation")), moe_topk_softmax,
            examples=_moe_topk_softmax_examples),
         "moe"),
        (Op("moe_experts_clamped", "The chosen experts with biases and GPT-OSS's clamped SwiGLU, from stacked expert "
            "weights, weighted and summed: per pair ``[gate | up] = gate_up_e x + gate_up_bias_e``, ``g = min(gate, "
            "limit)``, ``act = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``y += weight * (down_e act "
            "+ down_bias_e)``.",
            (P("x", "[N, H]", "matmul_input"), P("experts", "[N, k]", "index"), P("weights", "[N, k]", "activation"),
             P("gate_up", "[E * 2 I, H]", "weight", "the experts' gate and up projections, stacked (gate rows of each "
               "expert first); MXFP4 stacks are read as stored"),
             P("down", "[E * H, I]", "weight", "the experts' down projections, stacked; MXFP4 stacks are read as stored"),
             P("alpha", kind="scalar", doc="the sigmoid's gain (GPT-OSS: 1.702)"),
             P("limit", kind="scalar", doc="the clamp of gate (above) and up (both sides)"),
             P("gate_up_bias", "[E * 2 I]", "constant", optional=True, doc="stacked as gate_up's rows (None: none)"),
             P("down_bias", "[E * H]", "constant", optional=True, doc="stacked as down's rows (None: none)")),
            (P("y", "[N, H]", "activation"),), moe_experts_clamped, examples=_moe_experts_clamped_examples),
         "moe_clamped"),
        (Op("gdn_conv_update", "One token per row through a Gated DeltaNet layer's causal depthwise conv + SiLU; the "
            "rows' conv states (at ``slots``) updated in place.",
            (P("inputs", "[N, C]", "activation"), P("weight", "[C, K]", "constant"),
             P("conv_state", "[slots, C, K - 1]", "cache"), P("slots", "[N]", "index")),
            (P("mixed", "[N, C]", "activation"),), gdn_conv_update),
         "gated_delta"),
        (Op("gdn_decode", "A Gated DeltaNet layer's decode step between its input projections and out_proj, one "
            "token per row: ``gdn_ungroup``, ``gdn_gates``, ``gdn_conv_update``, ``gdn_split_heads``, "
            "``gdn_recurrent_step`` and ``gated_rmsnorm`` (two kernels when "
            ":func:`~metrale.ops.builtin.gdn_decode_kernels` are registered); the conv histories and states move "
            "on in place.",
            (P("qkvz", "[N, H_k (2 d_k + 2 G d_v)]", "activation"), P("ba", "[N, 2 H_v]", "activation"),
             P("conv_weight", "[C, K]", "constant"), P("conv_state", "[slots, C, K - 1]", "cache"),
             P("a_log", "[H_v]", "constant"), P("dt_bias", "[H_v]", "constant"),
             P("state", "[slots, H_v, d_k, d_v]", "cache"), P("slots", "[N]", "index"),
             P("norm_weight", "[d_v]", "constant"), P("eps", kind="scalar"), P("key_heads", kind="scalar"),
             P("value_heads", kind="scalar"), P("key_dim", kind="scalar"), P("value_dim", kind="scalar")),
            (P("gated", "[N, H_v, d_v]", "matmul_input"),), gdn_decode, examples=_gdn_decode_examples),
         "gdn_ungroup, gdn_gates, gdn_conv_update, gdn_split_heads, gdn_recurrent_step, gated_rmsnorm (their kernels)"),
        (Op("gdn_recurrent_step", "One token per row of the gated delta rule; the rows' states updated in place.",
            (P("q", "[N, H, d_k]", "activation"), P("k", "[N, H, d_k]", "activation"), P("v", "[N, H, d_v]", "activation"),
             P("g", "[N, H]", "activation"), P("beta", "[N, H]", "activation"),
             P("state", "[slots, H, d_k, d_v]", "cache"), P("slots", "[N]", "index")),
            (P("out", "[N, H, d_v]", "activation"),), gdn_recurrent_step),
         "gated_delta"),
        (Op("gdn_prompt_rule", "The gated delta rule over each segment's rows ``starts[s]:starts[s + 1]`` from slot "
            "``slots[s]`` (the chunked form on the CPU, and on tensor cores for heads of 64 or 128 dims).",
            (P("q", "[T, H, d_k]", "activation"), P("k", "[T, H, d_k]", "activation"), P("v", "[T, H, d_v]", "activation"),
             P("g", "[T, H]", "activation"), P("beta", "[T, H]", "activation"),
             P("state", "[slots, H, d_k, d_v]", "cache"), P("slots", "[S]", "index"), P("starts", "[S + 1]", "index")),
            (P("out", "[T, H, d_v]", "activation"),), gdn_prompt_rule, graph_safe=False),
         "gated_delta"),
        (Op("gated_rmsnorm", "``rmsnorm(x; weight) * silu(z)`` over the last axis.",
            (P("x", "[..., d]", "activation"), P("z", "[..., d]", "activation"), P("weight", "[d]", "constant"),
             P("eps", kind="scalar")),
            (P("y", "[..., d]", "matmul_input"),), gated_rmsnorm, examples=_gated_rmsnorm_examples),
         "gated"),
        (Op("gdn_ungroup", "A Gated DeltaNet layer's ``in_proj_qkvz`` output, grouped per key head as "
            "``[q | k | v | z]``, as the conv input ``[all q | all k | all v]`` and the output gate ``z``.",
            (P("qkvz", "[N, hk (2 dk + 2 r dv)]", "activation"), P("key_heads", kind="scalar"),
             P("value_heads", kind="scalar"), P("key_dim", kind="scalar"), P("value_dim", kind="scalar")),
            (P("inputs", "[N, 2 hk dk + hv dv]", "activation"), P("z", "[N, hv, dv]", "activation")),
            gdn_ungroup, examples=_gdn_ungroup_examples, cuda_tolerance=1e-6),
         "gated_delta"),
        (Op("gdn_gates", "A Gated DeltaNet layer's gates from ``in_proj_ba`` (grouped per key head as ``[b | a]``): "
            "``beta = sigmoid(b)``, ``g = -exp(a_log) * softplus(a + dt_bias)``.",
            (P("ba", "[N, 2 hv]", "activation"), P("a_log", "[hv]", "constant"), P("dt_bias", "[hv]", "constant"),
             P("key_heads", kind="scalar")),
            (P("g", "[N, hv]", "activation"), P("beta", "[N, hv]", "activation")),
            gdn_gates, examples=_gdn_gates_examples, cuda_tolerance=1e-5),
         "gated_delta"),
        (Op("gdn_split_heads", "Conv outputs split into heads: q and k L2-normalised (q scaled by ``dk ** -0.5``) "
            "and repeated to the value heads, v.",
            (P("mixed", "[T, 2 hk dk + hv dv]", "activation"), P("key_heads", kind="scalar"),
             P("value_heads", kind="scalar"), P("key_dim", kind="scalar"), P("value_dim", kind="scalar")),
            (P("q", "[T, hv, dk]", "activation"), P("k", "[T, hv, dk]", "activation"), P("v", "[T, hv, dv]", "activation")),
            gdn_split_heads, examples=_gdn_split_examples, cuda_tolerance=1e-5),
         "gated_delta"),
        (Op("gdn_conv_prompts", "Each segment's rows ``starts[s]:starts[s + 1]`` through the causal depthwise conv + "
            "SiLU after slot ``slots[s]``'s conv state, which keeps the segment's last ``K - 1`` inputs.",
            (P("inputs", "[T, C]", "activation"), P("weight", "[C, K]", "constant"),
             P("conv_state", "[slots, C, K - 1]", "cache"), P("slots", "[S]", "index"), P("starts", "[S + 1]", "index")),
            (P("mixed", "[T, C]", "activation"),), gdn_conv_prompts),
         "gated_delta"),
        (Op("gated_add", "``x + y * sigmoid(gate)``, one gate per row (the shared expert's gate).",
            (P("x", "[N, H]", "activation"), P("y", "[N, H]", "activation"), P("gate", "[N, 1]", "activation")),
            (P("out", "[N, H]", "activation"),), gated_add, examples=_gated_add_examples, cuda_tolerance=1e-5),
         "gated"),
        (Op("latent_query", "MLA's absorbed decode query: ``[q_latent | rope(q[..., -d_r:])]``.",
            (P("q_latent", "[N, nh, r]", "activation"), P("q", "[N, nh, d_n + d_r]", "activation"),
             P("positions", "[N]", "index"), P("inv_freq", "[d_r / 2]", "constant"), P("attention_factor", kind="scalar"),
             P("interleaved", kind="option")),
            (P("out", "[N, nh, r + d_r]", "activation"),), latent_query, examples=_latent_query_examples,
            cuda_tolerance=1e-5),
         "attention_latent"),
        (Op("lora_linear", "Each row's LoRA update added to a projection's output (in place, returned): for a row of "
            "adapter slot ``s = slots[i]`` (0: the base model, no update), ``y[i] += (x[i] a[s - 1]^T) "
            "b[:, (s - 1) W : s W]^T`` with ``W = G R`` (:class:`~metrale.layers.lora_stacks.LoraStack`: ``b`` "
            "block-diagonal over a fused weight's ``G`` projections, the scale folded in). For steps of many rows; a few "
            "rows take ``lora_expand``.",
            (P("y", "[N, out]", "activation"), P("x", "[N, in]", "matmul_input"), P("a", "[S, G R, in]", "weight"),
             P("b", "[out, S G R]", "weight"), P("slots", "[N]", "index"),
             P("route", kind="option", optional=True,
               doc="the step's adapter route (metrale.batch.adapter_route): a slot when every adapter row is of that "
               "slot (the GPU then shrinks with that slot's A only), else None or mixed")),
            (P("y", "[N, out]", "activation"),), lora_linear, examples=_lora_linear_examples),
         "lora"),
        (Op("lora_expand", "A projection with each row's LoRA update from a product with the stack's extended weight "
            "(:attr:`metrale.layers.lora_stacks.LoraStack.weight`: the projection's ``out`` rows, then every slot's ``A``): "
            "``y[i] = ext[i, :out] + bias + ext[i, out + (s - 1) W : out + s W] b[:, (s - 1) W : s W]^T`` for a row "
            "of slot ``s = slots[i]`` (0: no update); with ``swiglu`` (``out = 2 I``, gate rows then up rows) "
            "``silu(y[:, :I]) * y[:, I:]``.",
            (P("ext", "[N, out + S G R]", "activation"), P("b", "[out, S G R]", "weight"), P("slots", "[N]", "index"),
             P("tiles", "[T, 10]", "index",
               doc="the rows grouped by slot (metrale.kernels.lora_tiles.adapter_tiles(slots), ForwardBatch.adapter_tiles): a "
               "kernel may read the rows' slots from it alone"),
             P("width", kind="scalar", doc="``W = G R``, a slot's columns"),
             P("bias", "[out]", "constant", optional=True),
             P("swiglu", kind="option", optional=True, doc="SwiGLU's activation of the result")),
            (P("y", "[N, out] or [N, out / 2]", "activation"),), lora_expand, examples=_lora_expand_examples),
         "lora"),
        (Op("lora_token_rows", "Embedding rows an adapter replaces (in place, returned): ``x[i] = rows[s, k]`` where "
            "``tokens[s, k] == ids[i]`` for the row's adapter slot ``s = slots[i]`` (0: none); -1 pads ``tokens``.",
            (P("x", "[N, H]", "activation"), P("ids", "[N]", "index"), P("slots", "[N]", "index"),
             P("tokens", "[S, T]", "index"), P("rows", "[S, T, H]", "activation")),
            (P("x", "[N, H]", "activation"),), lora_token_rows, examples=_lora_token_rows_examples, cuda_tolerance=1e-6),
         "lora"),
        (Op("lora_logit_rows", "LM-head rows an adapter replaces (in place, returned): ``logits[i, tokens[s, k]] = "
            "rows[s, k] . h[i]`` for the row's adapter slot ``s = slots[i]`` (0: none) and every ``tokens[s, k] >= 0``.",
            (P("logits", "[N, V]", "activation"), P("h", "[N, H]", "matmul_input"), P("slots", "[N]", "index"),
             P("tokens", "[S, T]", "index"), P("rows", "[S, T, H]", "activation")),
            (P("logits", "[N, V]", "activation"),), lora_logit_rows, examples=_lora_logit_rows_examples),
         "lora"),
        (Op("sigmoid_gate", "``x * sigmoid(gate)``.",
            (P("x", "[N, W]", "matmul_input"), P("gate", "[N, W]", "activation")),
            (P("y", "[N, W]", "matmul_input"),), sigmoid_gate, examples=_sigmoid_gate_examples),
         "gated"),
    ]


@functools.lru_cache(maxsize=1)
def builtin_registry() -> OpRegistry:
    """The built-in ops and their kernels (shared; :func:`~metrale.ops.build_op_registry` copies
    it before plugins add to it): the kernels :mod:`metrale.ops.selection` chooses among, in
    order, and for every other op its :class:`~metrale.ops.cuda.CudaKernels` method."""
    registry = OpRegistry()
    declarations = _declarations()
    for op, _ in declarations:
        registry.declare(op)
    chosen = builtin_kernels()
    for kernel in chosen:
        registry.add_kernel(kernel)
    covered = {kernel.op for kernel in chosen if kernel.backend == "cuda" and kernel.unconditional}
    for op, module in declarations:
        if op.name not in covered:
            name = module if " " in module else f"metrale.kernels.{module}"
            registry.add_kernel(Kernel(op.name, "cuda", name, build=_cuda_method(op.name)))
    return registry


def build_op_registry(plugin_manager: "pluggy.PluginManager | None" = None) -> OpRegistry:
    """The built-in ops and kernels, plus what every plugin of ``plugin_manager`` registers
    through ``metrale_register_ops`` (in registration order)."""
    registry = builtin_registry().copy()
    if plugin_manager is None:
        return registry
    caller = getattr(plugin_manager.hook, "metrale_register_ops", None)
    if caller is None:
        return registry
    distributions = getattr(plugin_manager, "distributions", {})
    for impl in reversed(caller.get_hookimpls()):  # pluggy lists the last registered first
        try:
            impl.function(registry=registry.from_plugin(impl.plugin_name, distributions.get(impl.plugin_name)))
        except OpRegistrationError:
            raise
        except Exception as error:
            raise OpRegistrationError(f"plugin {impl.plugin_name!r}: metrale_register_ops failed: {error!r}") from error
    return registry
