"""Batch-invariant CPU kernels: each row's result depends on that row's inputs alone (and, for
attention, on its own sequence's keys and values up to its position), never on the other rows of
the call or on how many there are. The engine binds them under ``batch_invariant=True``
(:func:`metrale.ops.selection.batch_invariant_kernels`); docs/serving.rst, "Batch-invariant mode".

Why the NumPy references are not invariant as they stand:

* a matrix product ``x @ W^T`` goes to BLAS, which takes another kernel (a GEMV, or other edge
  tiles) and so another order of the inner sums for one row than for many, and within one call
  computes rows at different positions of its register tiles differently (the tiles' sizes
  depend on the CPU OpenBLAS or MKL detects). Here every row of a product is a BLAS call of its
  own, of the same shape (one row by the matrix) whatever the batch: a row's sums are the same
  kernel's over that row alone;
* attention over a sequence's rows at once masks the keys past each row with padding, and the
  length of the softmax sum (NumPy's pairwise summation) and of the value product then follows the
  longest row. Here each query row attends over exactly its own keys;
* the Gated DeltaNet prompt kernels run a chunked form whose chunks follow the scheduler's prompt
  chunks, and the conv over a whole segment; here every token takes the decode step's arithmetic,
  so a token gives the same bits in a prompt, a prompt chunk or a decode step.

Row-wise reductions over a contiguous last axis (the norms, the softmax of the router and of
sampling) are already invariant: NumPy reduces each row on its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.kernels.activation import silu_and_mul_reference
from metrale.kernels.attention import gather_sequence_kv
from metrale.kernels.gated_delta import conv_update_reference, recurrent_step_reference
from metrale.kernels.lora_tiles import check_adapter_tiles
from metrale.kernels.moe import route_reference
from metrale.kernels.moe_clamped import _rows_product, clamped_swiglu_reference
from metrale.kernels.quantized import QuantizedWeight, dequantize, quantize_activations


def _as_float32(x: Any) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype == np.uint16:
        return (x.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(x, dtype=np.float32)


def rows_product(x: np.ndarray, matrix_t: np.ndarray) -> np.ndarray:
    """``x [N, in] @ matrix_t [in, out]`` float32, each row a product of its own (a stack of
    ``[1, in] @ [in, out]`` products, the same call for every row): row ``i`` of the result
    depends on ``x[i]`` alone."""
    x = _as_float32(x)
    matrix_t = np.asarray(matrix_t, dtype=np.float32)
    out = np.empty((x.shape[0], 1, matrix_t.shape[1]), dtype=np.float32)
    if x.shape[0]:
        np.matmul(np.ascontiguousarray(x)[:, None, :], matrix_t, out=out)
    return out[:, 0]


def linear(x: np.ndarray, weight: Any, bias: np.ndarray | None = None) -> np.ndarray:
    """``linear``: ``x W^T + b`` by :func:`rows_product`; a quantized weight's input is
    quantized per row (or by its static scale) first, as the reference does."""
    x = _as_float32(x)
    if isinstance(weight, QuantizedWeight):
        if weight.input_order is not None:
            x = x[:, np.asarray(weight.input_order)]
        y = rows_product(quantize_activations(x, weight), dequantize(weight, stored_order=True).T)
    else:
        y = rows_product(x, np.asarray(weight, dtype=np.float32).T)
    if bias is not None:
        y = y + np.asarray(bias, dtype=np.float32)
    return y.astype(np.float32, copy=False)


def linear_silu(x: np.ndarray, weight: Any, bias: np.ndarray | None = None) -> np.ndarray:
    """``linear_silu``: :func:`linear`, then SwiGLU's ``silu(gate) * up``."""
    y = linear(x, weight, bias)
    width = y.shape[1] // 2
    return silu_and_mul_reference(y[:, :width], y[:, width:])


def head_linear(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``head_linear``: ``[N, heads, out]``, each head's product by :func:`rows_product`."""
    x = _as_float32(x)
    heads = x.shape[1]
    w = _as_float32(weight).reshape(heads, -1, x.shape[2])
    out = np.empty((x.shape[0], heads, w.shape[1]), dtype=np.float32)
    for head in range(heads):
        out[:, head] = rows_product(np.ascontiguousarray(x[:, head]), w[head].T)
    return out


def moe_route(x, gate, bias, method, n_group, topk_group, top_k, renormalise, scaling):
    """``moe_route``: the router logits by :func:`rows_product`, then the reference's choice
    (row by row already)."""
    logits = rows_product(x, np.asarray(gate, dtype=np.float32).T)
    return route_reference(logits, bias, method, n_group, topk_group, top_k, renormalise, scaling)


def moe_experts_clamped(x, experts, weights, gate_up, down, alpha, limit, gate_up_bias=None, down_bias=None):
    """``moe_experts_clamped`` token by token, pair by pair (the reference groups each expert's
    tokens into one product)."""
    x = _as_float32(x)
    hidden, inter = x.shape[1], down.shape[1]
    out = np.zeros((x.shape[0], hidden), dtype=np.float32)
    for n in range(x.shape[0]):
        for s in range(experts.shape[1]):
            e = int(experts[n, s])
            gu = _rows_product(x[n : n + 1], gate_up, slice(2 * inter * e, 2 * inter * (e + 1)), gate_up_bias)
            act = clamped_swiglu_reference(gu[:, :inter], gu[:, inter:], alpha, limit)
            y = _rows_product(act, down, slice(hidden * e, hidden * (e + 1)), down_bias)
            out[n] += np.float32(weights[n, s]) * y[0]
    return out


def attention_rows(q: np.ndarray, k_cache: Any, v_cache: Any, block_tables: np.ndarray, seq_index: np.ndarray,
                   positions: np.ndarray, scale: float, sliding_window: int | None = None,
                   softcap: float | None = None, sinks: np.ndarray | None = None) -> np.ndarray:
    """:func:`~metrale.kernels.attention.paged_attention_reference`, each query row over exactly
    its visible keys (``[start, position]``, ``start`` after the sliding window): ``[N, n_heads, d_v]``."""
    n_rows, n_heads, _ = q.shape
    group = n_heads // k_cache.shape[2]
    out = np.empty((n_rows, n_heads, v_cache.shape[3]), dtype=np.float32)
    sink = None if sinks is None else np.asarray(sinks, dtype=np.float32).reshape(n_heads, 1, 1)
    q = _as_float32(q)
    for row in range(n_rows):
        seq, position = int(seq_index[row]), int(positions[row])
        start = 0 if sliding_window is None else max(0, position - int(sliding_window) + 1)
        keys = gather_sequence_kv(k_cache, block_tables[seq], position + 1)[start:]  # [L, n_kv, d]
        values = gather_sequence_kv(v_cache, block_tables[seq], position + 1)[start:]
        keys = np.ascontiguousarray(np.repeat(keys, group, axis=1).transpose(1, 2, 0))  # [n_heads, d, L]
        values = np.ascontiguousarray(np.repeat(values, group, axis=1).transpose(1, 0, 2))  # [n_heads, L, d_v]
        scores = (np.ascontiguousarray(q[row][:, None, :]) @ keys) * np.float32(scale)  # [n_heads, 1, L]
        if softcap:
            scores = np.float32(softcap) * np.tanh(scores / np.float32(softcap))
        scores = scores.astype(np.float32)
        best = scores.max(axis=-1, keepdims=True)
        if sink is not None:
            best = np.maximum(best, sink)
        weights = np.exp(scores - best)
        denominator = weights.sum(axis=-1, keepdims=True)
        if sink is not None:
            denominator += np.exp(sink - best)
        out[row] = ((weights / denominator) @ values)[:, 0]
    return out


def paged_attention(q, k_cache, v_cache, batch, scale, sliding_window, softcap=None, sinks=None):
    """``paged_attention``: every row, decode or prompt, by :func:`attention_rows`."""
    out = attention_rows(q, k_cache, v_cache, batch.block_tables, batch.seq_index, batch.positions, scale,
                         sliding_window, softcap, sinks)
    return out.reshape(out.shape[0], -1)


def gdn_conv_prompts(inputs, weight, conv_state, slots, starts):
    """``gdn_conv_prompts`` token by token through the decode step's conv
    (:func:`~metrale.kernels.gated_delta.conv_update_reference`). Rows outside every segment are zero."""
    mixed = np.zeros(inputs.shape, dtype=np.float32)
    for index, slot in enumerate(slots):
        for row in range(int(starts[index]), int(starts[index + 1])):
            mixed[row] = conv_update_reference(inputs[row : row + 1], weight, conv_state,
                                               np.array([slot], dtype=np.int32))[0]
    return mixed


def gdn_prompt_rule(q, k, v, g, beta, state, slots, starts):
    """``gdn_prompt_rule`` token by token through the decode step's recurrence
    (:func:`~metrale.kernels.gated_delta.recurrent_step_reference`)."""
    out = np.empty(v.shape, dtype=np.float32)
    for index, slot in enumerate(slots):
        one = np.array([slot], dtype=np.int32)
        for row in range(int(starts[index]), int(starts[index + 1])):
            rows = slice(row, row + 1)
            out[row] = recurrent_step_reference(q[rows], k[rows], v[rows], g[rows], beta[rows], state, one)[0]
    return out


def lora_linear(y, x, a, b, slots, route=None):
    """``lora_linear`` with both products by :func:`rows_product` over each slot's rows."""
    if isinstance(route, int) and not np.isin(slots, (0, route)).all():
        raise ValueError(f"lora_linear: route {route} but rows of other slots")
    x, a, b = _as_float32(x), _as_float32(a), _as_float32(b)
    width = a.shape[1]
    for slot in np.unique(slots):
        if slot == 0:
            continue
        rows = np.nonzero(slots == slot)[0]
        shrunk = rows_product(x[rows], a[slot - 1].T)
        y[rows] += rows_product(shrunk, b[:, (slot - 1) * width : slot * width].T)
    return y


def lora_expand(ext, b, slots, tiles, width, bias=None, swiglu=False):
    """``lora_expand`` with the update's product by :func:`rows_product` over each slot's rows."""
    check_adapter_tiles("lora_expand", slots, tiles)
    out = b.shape[0]
    ext, b = _as_float32(ext), _as_float32(b)
    y = np.array(ext[:, :out], dtype=np.float32)
    if bias is not None:
        y += _as_float32(bias)
    for slot in np.unique(slots):
        if slot == 0:
            continue
        rows = np.nonzero(slots == slot)[0]
        columns = slice(out + (slot - 1) * width, out + slot * width)
        y[rows] += rows_product(ext[rows][:, columns], b[:, (slot - 1) * width : slot * width].T)
    if not swiglu:
        return y
    half = y.shape[1] // 2
    return silu_and_mul_reference(y[:, :half], y[:, half:])
