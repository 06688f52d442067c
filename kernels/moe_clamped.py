"""GPT-OSS's routed experts: the router's top-k softmax and the experts' clamped SwiGLU with biases.

* **routing** -- :func:`topk_softmax_reference`: per token the ``top_k`` largest router logits
  (ties to the smaller expert index) and the softmax over those ``k`` logits only.
* **experts** -- :func:`clamped_experts_reference`: every (token, chosen expert) pair runs that
  expert from the stacked weights, in the layout of :mod:`metrale.kernels.moe` (``gate_up [E *
  2I, H]``, expert ``e``'s gate rows at ``[2 I e, 2 I e + I)`` and its up rows after them; ``down
  [E * H, I]``), with the biases stacked the same way (``gate_up_bias [E * 2I]``, ``down_bias [E
  * H]``)::

      gate, up = gate_up_e x + gate_up_bias_e            (split into halves)
      gate = min(gate, limit);  up = clamp(up, -limit, limit)
      act = (up + 1) * gate * sigmoid(alpha * gate)
      y = sum_s weights[s] * (down_e act + down_bias_e)

  The stacks may be :class:`~metrale.kernels.quantized.QuantizedWeight`\\ s (MXFP4 experts): each
  chosen expert's rows are dequantized and the product computed as
  :func:`~metrale.kernels.quantized.quantized_linear_reference` does.

The references are the CPU implementations of the ops ``moe_topk_softmax`` and
``moe_experts_clamped`` (:mod:`metrale.ops.builtin`). On the GPU the router is the routing kernel
of :mod:`metrale.kernels.moe` (the softmax over every logit renormalised over the top k: the same
weights), and the experts are :func:`clamped_experts`: two kernels, a warp per output value, every
(token, chosen expert) pair reading its expert's rows straight from the stacks -- bf16 rows as
64-bit words, or MXFP4 rows (codes and their power-of-two scales, blocks of 32 columns) decoded in
registers -- the expert ids read on the device, no host synchronisation. The intermediate
activations stay float32.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
from numba import cuda, float32, uint32, uint64

from metrale.errors import KernelArgumentError
from metrale.kernels._device import DeviceArray, bits_to_float, check_array, device_view, jit_kernel, numba_stream
from metrale.kernels.activation import sigmoid_denominator
from metrale.kernels.bf16 import bf16_to_float32
from metrale.kernels.moe import MOE_WARPS, WARP, _lane_sum, _row_dot
from metrale.kernels.quantized import QuantizedWeight, quantized_linear_reference


def topk_softmax_reference(logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(experts ``[N, k]`` int32, weights ``[N, k]`` float32): each row's ``top_k`` largest
    ``logits [N, E]`` in descending order (ties to the smaller index) and their softmax."""
    logits = np.asarray(logits, dtype=np.float32)
    chosen = np.argsort(-logits, axis=1, kind="stable")[:, :top_k].astype(np.int32)
    top = np.take_along_axis(logits, chosen, axis=1)
    shifted = np.exp(top - top.max(axis=1, keepdims=True, initial=-np.inf))
    weights = shifted / shifted.sum(axis=1, keepdims=True)
    return chosen, weights.astype(np.float32)


def clamped_swiglu_reference(gate: np.ndarray, up: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """float32 ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate,
    limit)``; ``gate`` and ``up`` have the same shape."""
    limit32 = np.float32(limit)
    gate = np.minimum(np.asarray(gate, dtype=np.float32), limit32)
    up = np.clip(np.asarray(up, dtype=np.float32), -limit32, limit32)
    return ((up + np.float32(1.0)) * (gate / sigmoid_denominator(np.float32(alpha) * gate))).astype(np.float32)


def _host(array: Any) -> np.ndarray:
    """``array`` as a NumPy array (a CuPy one copied to the host)."""
    return array if isinstance(array, np.ndarray) else array.get()


def _host_quantized(weight: QuantizedWeight) -> QuantizedWeight:
    """``weight`` with its arrays on the host (the GPU's quantized stacks reach a host run as they
    are)."""
    if isinstance(weight.codes, np.ndarray):
        return weight

    def host(array: Any) -> Any:
        return None if array is None or isinstance(array, (int, float, np.generic)) else _host(array)

    return replace(weight, codes=host(weight.codes), scales=host(weight.scales), zeros=host(weight.zeros),
                   input_order=host(weight.input_order), input_scale=host(weight.input_scale))


def _rows_product(x: np.ndarray, weight: Any, rows: slice, bias: Any) -> np.ndarray:
    """float32 ``x @ weight[rows].T + bias[rows]`` (``bias`` None: none) for a float32, bf16-bits
    or quantized ``weight``."""
    if isinstance(weight, QuantizedWeight):
        y = quantized_linear_reference(x, _host_quantized(weight[rows]))
    else:
        part = _host(weight[rows])
        part = bf16_to_float32(part) if part.dtype == np.uint16 else np.asarray(part, dtype=np.float32)
        y = x @ part.T
    if bias is not None:
        y = y + np.asarray(_host(bias)[rows], dtype=np.float32)
    return y.astype(np.float32)


def clamped_experts_reference(
    x: np.ndarray, experts: np.ndarray, weights: np.ndarray, gate_up: Any, down: Any, alpha: float, limit: float,
    gate_up_bias: np.ndarray | None = None, down_bias: np.ndarray | None = None,
) -> np.ndarray:
    """``[N, H]`` float32: ``sum_s weights[n, s] * Expert_{experts[n, s]}(x[n])`` with the clamped
    SwiGLU and the biases of the module docstring. Pairs are grouped by expert: one product chain
    per chosen expert over its tokens."""
    x = np.asarray(x, dtype=np.float32)
    tokens, hidden = x.shape
    inter = down.shape[1]
    top_k = experts.shape[1]
    flat = np.asarray(experts, dtype=np.int64).reshape(-1)
    owners = np.repeat(np.arange(tokens), top_k)  # the token of pair n * k + s
    scale = np.asarray(weights, dtype=np.float32).reshape(-1)
    out = np.zeros((tokens, hidden), dtype=np.float32)
    for expert in np.unique(flat):
        pairs = np.flatnonzero(flat == expert)
        e = int(expert)
        gate_up_rows = _rows_product(x[owners[pairs]], gate_up, slice(2 * inter * e, 2 * inter * (e + 1)), gate_up_bias)
        act = clamped_swiglu_reference(gate_up_rows[:, :inter], gate_up_rows[:, inter:], alpha, limit)
        y = _rows_product(act, down, slice(hidden * e, hidden * (e + 1)), down_bias)
        np.add.at(out, owners[pairs], scale[pairs, None] * y)
    return out


# --------------------------------------------------------------------------------- kernels


@cuda.jit(device=True)
def _clamped_swiglu(gate, up, alpha, limit):
    gate = min(gate, limit)
    up = min(max(up, -limit), limit)
    return (up + float32(1.0)) * gate / (float32(1.0) + math.exp(-alpha * gate))


@cuda.jit(device=True)
def _e2m1(code):
    # The value of a 4-bit E2M1 code: bit 3 the sign, bits 2..1 the exponent, bit 0 the mantissa.
    exponent = (code >> uint32(1)) & uint32(3)
    mantissa = float32(code & uint32(1))
    if exponent == 0:
        value = float32(0.5) * mantissa
    else:
        value = (float32(1.0) + float32(0.5) * mantissa) * float32(uint32(1) << (exponent - uint32(1)))
    return -value if code & uint32(8) else value


@cuda.jit(device=True)
def _mxfp4_row_dot(x, x_row, code_words, scales, w_row, lane):
    # x [*, K] f32; code_words [R, K / 8] u32: eight E2M1 codes a word, the lowest nibble the first
    # column; scales [R, K / 32] f32, one per block of 32 columns (four words).
    acc = float32(0.0)
    for index in range(lane, code_words.shape[1], WARP):
        word = code_words[w_row, index]
        column = 8 * index
        part = float32(0.0)
        for nibble in range(8):
            part += _e2m1((word >> uint32(4 * nibble)) & uint32(15)) * x[x_row, column + nibble]
        acc += part * scales[w_row, index // 4]
    return _lane_sum(acc)


@cuda.jit(device=True)
def _bf16_float_row_dot(x, x_row, w_words, w_row, lane):
    # x [*, K] f32 against bf16 rows w_words [R, K / 4] u64 (four values a word, the lowest first).
    acc = float32(0.0)
    for index in range(lane, w_words.shape[1], WARP):
        word = w_words[w_row, index]
        low = uint32(word & uint64(0xFFFFFFFF))
        high = uint32(word >> uint64(32))
        column = 4 * index
        acc += (bits_to_float(low << uint32(16)) * x[x_row, column]
                + bits_to_float(low & uint32(0xFFFF0000)) * x[x_row, column + 1]
                + bits_to_float(high << uint32(16)) * x[x_row, column + 2]
                + bits_to_float(high & uint32(0xFFFF0000)) * x[x_row, column + 3])
    return _lane_sum(acc)


@jit_kernel
def clamped_gate_up_kernel(x_words, gate_up_words, gate_up_bias, biased, experts, alpha, limit, act):
    # Grid: (N * k pairs, ceil(I / MOE_WARPS)); MOE_WARPS * WARP threads, a warp per output value.
    # x_words [N, H / 4] u64 (bf16); gate_up_words [E * 2I, H / 4]; gate_up_bias [E * 2I] f32 (read
    # when biased); experts [N, k] i32; act [N * k, I] f32: the clamped SwiGLU of pair n * k + s.
    pair = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    lane = tid % WARP
    column = cuda.blockIdx.y * MOE_WARPS + tid // WARP
    top_k = experts.shape[1]
    inter = act.shape[1]
    token = pair // top_k
    if column >= inter:
        return
    base = 2 * inter * experts[token, pair % top_k]
    gate = _row_dot(x_words, token, gate_up_words, base + column, lane)
    up = _row_dot(x_words, token, gate_up_words, base + inter + column, lane)
    if lane == 0:
        if biased:
            gate += gate_up_bias[base + column]
            up += gate_up_bias[base + inter + column]
        act[pair, column] = _clamped_swiglu(gate, up, alpha, limit)


@jit_kernel
def clamped_gate_up_mxfp4_kernel(x, code_words, scales, gate_up_bias, biased, experts, alpha, limit, act):
    # clamped_gate_up_kernel for MXFP4 stacks: x [N, H] f32; code_words [E * 2I, H / 8] u32;
    # scales [E * 2I, H / 32] f32.
    pair = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    lane = tid % WARP
    column = cuda.blockIdx.y * MOE_WARPS + tid // WARP
    top_k = experts.shape[1]
    inter = act.shape[1]
    token = pair // top_k
    if column >= inter:
        return
    base = 2 * inter * experts[token, pair % top_k]
    gate = _mxfp4_row_dot(x, token, code_words, scales, base + column, lane)
    up = _mxfp4_row_dot(x, token, code_words, scales, base + inter + column, lane)
    if lane == 0:
        if biased:
            gate += gate_up_bias[base + column]
            up += gate_up_bias[base + inter + column]
        act[pair, column] = _clamped_swiglu(gate, up, alpha, limit)


@jit_kernel
def clamped_down_kernel(act, down_words, down_bias, biased, experts, weights, out):
    # Grid: (N tokens, ceil(H / MOE_WARPS)); a warp per output value. act [N * k, I] f32;
    # down_words [E * H, I / 4] u64 (bf16); down_bias [E * H] f32 (read when biased); weights
    # [N, k] f32; out [N, H] f32 (written, not added to).
    token = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    lane = tid % WARP
    column = cuda.blockIdx.y * MOE_WARPS + tid // WARP
    hidden = out.shape[1]
    top_k = experts.shape[1]
    if column >= hidden:
        return
    total = float32(0.0)
    for slot in range(top_k):
        row = experts[token, slot] * hidden + column
        value = _bf16_float_row_dot(act, token * top_k + slot, down_words, row, lane)
        if biased:
            value += down_bias[row]
        total += weights[token, slot] * value
    if lane == 0:
        out[token, column] = total


@jit_kernel
def clamped_down_mxfp4_kernel(act, code_words, scales, down_bias, biased, experts, weights, out):
    # clamped_down_kernel for MXFP4 stacks: code_words [E * H, I / 8] u32; scales [E * H, I / 32] f32.
    token = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    lane = tid % WARP
    column = cuda.blockIdx.y * MOE_WARPS + tid // WARP
    hidden = out.shape[1]
    top_k = experts.shape[1]
    if column >= hidden:
        return
    total = float32(0.0)
    for slot in range(top_k):
        row = experts[token, slot] * hidden + column
        value = _mxfp4_row_dot(act, token * top_k + slot, code_words, scales, row, lane)
        if biased:
            value += down_bias[row]
        total += weights[token, slot] * value
    if lane == 0:
        out[token, column] = total


# ------------------------------------------------------------------------------- launchers


def is_plain_mxfp4(weight: Any) -> bool:
    """Whether ``weight`` is an MXFP4 weight the kernels read as stored: scales per row and block
    of 32 columns, no zero points, no act-order, the inputs at full precision."""
    return (isinstance(weight, QuantizedWeight) and weight.codes_format == "mxfp4" and weight.block == (1, 32)
            and weight.zeros is None and weight.input_order is None and weight.activations == "weight_only")


def _stack_operands(op: str, name: str, weight: Any, rows: int, inner: int) -> tuple[bool, tuple[Any, ...]]:
    """``(mxfp4, device views)`` of a stack ``[rows, inner]``: bf16 bits as 64-bit words, or an
    MXFP4 weight's codes as 32-bit words and its scales."""
    if is_plain_mxfp4(weight):
        if tuple(weight.shape) != (rows, inner) or inner % 32:
            raise KernelArgumentError(f"{op}: {name} has shape {list(weight.shape)}, expected [{rows}, {inner}] "
                                      "(a multiple of 32 columns)")
        check_array(op, f"{name} codes", weight.codes, np.uint8, (rows, inner // 2))
        check_array(op, f"{name} scales", weight.scales, np.float32, (rows, inner // 32))
        return True, (device_view(weight.codes.view(np.uint32)), device_view(weight.scales))
    if isinstance(weight, QuantizedWeight):
        raise KernelArgumentError(f"{op}: {name} is quantized as {weight.codes_format}/{weight.activations}, "
                                  "which the kernels do not read (bf16 bits or plain MXFP4)")
    check_array(op, name, weight, np.uint16, (rows, inner))
    if inner % 4:
        raise KernelArgumentError(f"{op}: {name} has {inner} columns, not a multiple of 4")
    return False, (device_view(weight.view(np.uint64)),)


def _check_call(op: str, x: Any, expert_ids: Any, weights: Any, act: Any, out: Any, gate_up_rows: int,
                down_rows: int, gate_up_bias: Any, down_bias: Any) -> None:
    tokens, hidden = out.shape
    check_array(op, "experts", expert_ids, np.int32, (tokens, None))
    check_array(op, "weights", weights, np.float32, (tokens, expert_ids.shape[1]))
    check_array(op, "act", act, np.float32, (tokens * expert_ids.shape[1], None))
    check_array(op, "out", out, np.float32, (tokens, hidden))
    for name, bias, rows in (("gate_up_bias", gate_up_bias, gate_up_rows), ("down_bias", down_bias, down_rows)):
        if bias is not None:
            check_array(op, name, bias, np.float32, (rows,))


def clamped_experts_bf16(x: DeviceArray, expert_ids: DeviceArray, weights: DeviceArray, gate_up: DeviceArray,
                         down: DeviceArray, alpha: float, limit: float, gate_up_bias: DeviceArray | None,
                         down_bias: DeviceArray | None, act: DeviceArray, out: DeviceArray,
                         stream: object = None) -> DeviceArray:
    """Launch the two expert kernels over bf16 stacks: ``out [N, H]`` float32 (``act``: ``[N * k,
    I]`` float32 scratch) from ``x [N, H]`` bf16 bits; the biases may be None."""
    op = "moe_experts_clamped"
    tokens, hidden = out.shape
    top_k, inter = expert_ids.shape[1], act.shape[1]
    count = down.shape[0] // hidden if hidden else 0
    _check_call(op, x, expert_ids, weights, act, out, count * 2 * inter, count * hidden, gate_up_bias, down_bias)
    mxfp4_gate_up, gate_up_views = _stack_operands(op, "gate_up", gate_up, count * 2 * inter, hidden)
    mxfp4_down, down_views = _stack_operands(op, "down", down, count * hidden, inter)
    if mxfp4_gate_up or mxfp4_down:
        raise KernelArgumentError(f"{op}: the bf16 kernels take bf16 stacks; an MXFP4 stack takes the MXFP4 kernels")
    check_array(op, "x", x, np.uint16, (tokens, hidden))
    if not tokens:
        return out
    unused = out[0]  # the bias operand of a call without one, never read
    launch = numba_stream(stream)
    clamped_gate_up_kernel[(tokens * top_k, -(-inter // MOE_WARPS)), MOE_WARPS * WARP, launch](
        device_view(x.view(np.uint64)), *gate_up_views,
        device_view(gate_up_bias if gate_up_bias is not None else unused), gate_up_bias is not None,
        device_view(expert_ids), np.float32(alpha), np.float32(limit), device_view(act),
    )
    clamped_down_kernel[(tokens, -(-hidden // MOE_WARPS)), MOE_WARPS * WARP, launch](
        device_view(act), *down_views, device_view(down_bias if down_bias is not None else unused),
        down_bias is not None, device_view(expert_ids), device_view(weights), device_view(out),
    )
    return out


def clamped_experts_mxfp4(x: DeviceArray, expert_ids: DeviceArray, weights: DeviceArray, gate_up: Any, down: Any,
                          alpha: float, limit: float, gate_up_bias: DeviceArray | None, down_bias: DeviceArray | None,
                          act: DeviceArray, out: DeviceArray, stream: object = None) -> DeviceArray:
    """Launch the two expert kernels over plain MXFP4 stacks (:func:`is_plain_mxfp4`), their codes
    decoded in registers: ``out [N, H]`` float32 from ``x [N, H]`` float32."""
    op = "moe_experts_clamped"
    tokens, hidden = out.shape
    top_k, inter = expert_ids.shape[1], act.shape[1]
    count = down.shape[0] // hidden if hidden else 0
    _check_call(op, x, expert_ids, weights, act, out, count * 2 * inter, count * hidden, gate_up_bias, down_bias)
    mxfp4_gate_up, gate_up_views = _stack_operands(op, "gate_up", gate_up, count * 2 * inter, hidden)
    mxfp4_down, down_views = _stack_operands(op, "down", down, count * hidden, inter)
    if not (mxfp4_gate_up and mxfp4_down):
        raise KernelArgumentError(f"{op}: the MXFP4 kernels take two plain MXFP4 stacks")
    check_array(op, "x", x, np.float32, (tokens, hidden))
    if not tokens:
        return out
    unused = out[0]  # the bias operand of a call without one, never read
    launch = numba_stream(stream)
    clamped_gate_up_mxfp4_kernel[(tokens * top_k, -(-inter // MOE_WARPS)), MOE_WARPS * WARP, launch](
        device_view(x), *gate_up_views, device_view(gate_up_bias if gate_up_bias is not None else unused),
        gate_up_bias is not None, device_view(expert_ids), np.float32(alpha), np.float32(limit), device_view(act),
    )
    clamped_down_mxfp4_kernel[(tokens, -(-hidden // MOE_WARPS)), MOE_WARPS * WARP, launch](
        device_view(act), *down_views, device_view(down_bias if down_bias is not None else unused),
        down_bias is not None, device_view(expert_ids), device_view(weights), device_view(out),
    )
    return out
