"""Routed experts of a decode batch over quantized stacked weights: the two GEMV kernels of
:mod:`metrale.kernels.moe_decode` reading the chosen experts' codes only and dequantizing them in
registers (CUDA C++, compiled by NVRTC through CuPy).

1. **gate_up** -- grid ``(ceil(I / 16), N * k)``: a block stages its pair's token row, quantized as
   the gate/up weights' activation scheme says (:func:`~metrale.kernels.quantized.quantize_activations`,
   the row or group maxima reduced by a warp each) and rounded to bf16; each warp computes two
   activation columns from gate row ``c`` and up row ``I + c`` of the pair's expert, each lane a
   chunk of 8 weights at a time (:data:`~metrale.kernels.quantized_gemv.DEVICE_FUNCTIONS`), and
   writes ``bf16(silu(gate) * up)``;
2. **down** -- grid ``(ceil(H / 8), N)``: a block stages its token's ``k`` activation rows, each
   quantized as the down weights' scheme says; a warp per output column walks the ``k`` slots'
   chunks as one sequence, weighting each by its slot.

Only the chosen experts' codes are read: a quarter (INT4, MXFP4) or half (FP8, INT8) of bf16's
bytes. ``H`` and ``I`` must be multiples of 8, the weights' column blocks of 8, and neither stack
act-ordered. :func:`quantized_decode_experts_reference` is the NumPy reference; ``tests/kernels``
runs the kernels on the host through the CUDA emulation header.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels._device import DeviceArray, check_array
from metrale.kernels._launch import launch
from metrale.kernels._words import HELPERS
from metrale.kernels.activation import sigmoid_denominator
from metrale.kernels.quantized import QuantizedWeight, dequantize, quantize_activations
from metrale.kernels.quantized_gemv import (
    ACTIVATIONS,
    CODES,
    DEVICE_FUNCTIONS,
    INSTRUCTIONS,
    activation_groups,
    check_weight,
    round_bf16,
)
from metrale.kernels.quantized_gemv import CONSTANTS as GEMV_CONSTANTS

MAX_TOKENS = 8
WARPS = 8
COLUMNS = 2
MAX_STAGE_BYTES = 200 * 1024

CONSTANTS = f"""
#define MOE_COLUMNS {COLUMNS}
"""

KERNELS = r"""
// row[k] = bf16(quantize(in[k])) for k < K, the ACT scheme's scales (a warp per group) in scales.
// Every thread of the block calls it.
template <int ACT>
__device__ void stage_quantized_row(const float* in, int K, float input_scale, int act_group,
                                    unsigned short* row, float* scales) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int group = ACT == ACT_FP8_GROUP ? act_group : K;
    if (ACT == ACT_FP8_TOKEN || ACT == ACT_INT8_TOKEN || ACT == ACT_FP8_GROUP) {
        const float limit = ACT == ACT_INT8_TOKEN ? INT8_MAX_VALUE : FP8_MAX;
        for (int j = warp; j < (K + group - 1) / group; j += WARPS) {
            float amax = 0.0f;
            for (int k = j * group + lane; k < min(K, (j + 1) * group); k += 32) amax = fmaxf(amax, fabsf(in[k]));
            amax = warp_max(amax);
            if (lane == 0) scales[j] = fmaxf(amax / limit, MIN_SCALE);
        }
        __syncthreads();
    }
    for (int k = tid; k < K; k += THREADS) {
        float value = in[k];
        if (ACT == ACT_FP8_TENSOR) {
            value = round_e4m3(value / input_scale) * input_scale;
        } else if (ACT == ACT_FP8_TOKEN || ACT == ACT_FP8_GROUP) {
            const float s = scales[k / group];
            value = round_e4m3(value / s) * s;
        } else if (ACT == ACT_INT8_TOKEN) {
            value = fminf(fmaxf(rintf(value / scales[0]), -INT8_MAX_VALUE), INT8_MAX_VALUE) * scales[0];
        }
        row[k] = to_bf16(value);
    }
}

// act[p, c] = bf16(silu(gate_e[c] . xq[t]) * (up_e[c] . xq[t])) for pair p = t * k + s, e = experts[t, s],
// xq the token's row staged by stage_quantized_row. x float32 [N, H]; the weight [E * 2I, H].
// Grid (ceil(I / (WARPS * MOE_COLUMNS)), N * k); dynamic shared memory: H * 2 bytes (padded to 16), then
// the row's activation scales.
template <int CODES, int ACT>
__global__ void __launch_bounds__(THREADS) quantized_moe_gate_up(
    const float* __restrict__ x, const int* __restrict__ experts, float input_scale, int act_group,
    const unsigned char* __restrict__ codes, const float* __restrict__ scales, const float* __restrict__ zeros,
    int block_rows, int block_columns, int scale_columns, unsigned short* __restrict__ act, int top_k, int H, int I) {
    DYNAMIC_SHARED;
    const QuantizedOperand w = {codes, scales, zeros, block_rows, block_columns, scale_columns};
    unsigned short* row = reinterpret_cast<unsigned short*>(dynamic_shared);
    float* row_scales = reinterpret_cast<float*>(dynamic_shared + ((size_t)H * 2 + 15) / 16 * 16);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int pair = blockIdx.y, token = pair / top_k;
    const int expert = experts[pair];
    stage_quantized_row<ACT>(x + (size_t)token * H, H, input_scale, act_group, row, row_scales);
    __syncthreads();
    const uint4* staged = reinterpret_cast<const uint4*>(row);
    const int c0 = (blockIdx.x * WARPS + warp) * MOE_COLUMNS;
    if (c0 >= I) return;   // whole warps only: no barrier follows
    const size_t base_row = (size_t)expert * 2 * I;
    float gate[MOE_COLUMNS], up[MOE_COLUMNS];
    #pragma unroll
    for (int c = 0; c < MOE_COLUMNS; ++c) gate[c] = up[c] = 0.0f;
    for (int chunk = lane; chunk < H / 8; chunk += 32) {
        const uint4 input = staged[chunk];
        #pragma unroll
        for (int c = 0; c < MOE_COLUMNS; ++c) {
            const size_t column = (size_t)min(c0 + c, I - 1);
            gate[c] += dot8(weight_chunk<CODES>(w, base_row + column, chunk, H, true), input);
            up[c] += dot8(weight_chunk<CODES>(w, base_row + I + column, chunk, H, true), input);
        }
    }
    #pragma unroll
    for (int c = 0; c < MOE_COLUMNS; ++c) {
        const float g_total = warp_sum(gate[c]), u_total = warp_sum(up[c]);
        if (lane == c && c0 + c < I) act[(size_t)pair * I + c0 + c] = to_bf16(g_total / (1.0f + expf(-g_total)) * u_total);
    }
}

// out[t, n] = sum_s weights[t, s] * (down_e[n] . actq[t * k + s]), e = experts[t, s], actq each slot's
// activation row quantized as ACT says. The weight [E * H, I]. Grid (ceil(H / WARPS), N); dynamic shared
// memory: k * I float32 rows as read, then k * I bf16 staged rows (each padded to 16 bytes), the slots' row
// offsets and weights, and the slots' activation scales.
template <int CODES, int ACT>
__global__ void __launch_bounds__(THREADS) quantized_moe_down(
    const unsigned short* __restrict__ act, const int* __restrict__ experts, const float* __restrict__ weights,
    float input_scale, int act_group, const unsigned char* __restrict__ codes, const float* __restrict__ scales,
    const float* __restrict__ zeros, int block_rows, int block_columns, int scale_columns, float* __restrict__ out,
    int top_k, int H, int I) {
    DYNAMIC_SHARED;
    const QuantizedOperand w = {codes, scales, zeros, block_rows, block_columns, scale_columns};
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int token = blockIdx.y, chunks = I / 8, total = top_k * chunks;
    float* raw = reinterpret_cast<float*>(dynamic_shared);   // [k][I]
    unsigned short* rows = reinterpret_cast<unsigned short*>(dynamic_shared + (size_t)top_k * I * 4);   // [k][I]
    size_t* slot_row = reinterpret_cast<size_t*>(dynamic_shared + (size_t)top_k * I * 4
                                                 + ((size_t)top_k * I * 2 + 15) / 16 * 16);   // [k]
    float* slot_weight = reinterpret_cast<float*>(slot_row + top_k);   // [k]
    const int groups = ACT == ACT_FP8_GROUP ? (I + act_group - 1) / act_group : 1;
    float* slot_scales = slot_weight + top_k;   // [k][groups]
    for (int i = tid; i < top_k * I; i += THREADS) raw[i] = bf16_bits(act[(size_t)token * top_k * I + i]);
    for (int s = tid; s < top_k; s += THREADS) {
        slot_row[s] = (size_t)experts[token * top_k + s] * H;
        slot_weight[s] = weights[token * top_k + s];
    }
    __syncthreads();
    for (int s = 0; s < top_k; ++s) {
        stage_quantized_row<ACT>(raw + (size_t)s * I, I, input_scale, act_group, rows + (size_t)s * I,
                                 slot_scales + s * groups);
        __syncthreads();
    }
    const int n = blockIdx.x * WARPS + warp;
    if (n >= H) return;   // whole warps only: no barrier follows
    const uint4* staged = reinterpret_cast<const uint4*>(rows);
    float acc = 0.0f;
    for (int index = lane; index < total; index += 32) {
        const int s = index / chunks, chunk = index - s * chunks;
        acc += slot_weight[s] * dot8(weight_chunk<CODES>(w, slot_row[s] + n, chunk, I, true), staged[index]);
    }
    acc = warp_sum(acc);
    if (lane == 0) out[(size_t)token * H + n] = acc;
}
"""


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return INSTRUCTIONS + GEMV_CONSTANTS + CONSTANTS + HELPERS + DEVICE_FUNCTIONS + KERNELS


def gate_up_shared_bytes(hidden: int, gate_up: QuantizedWeight) -> int:
    return -(-hidden * 2 // 16) * 16 + 4 * activation_groups(gate_up)


def down_shared_bytes(top_k: int, inter: int, down: QuantizedWeight) -> int:
    return top_k * inter * 4 + -(-top_k * inter * 2 // 16) * 16 + 12 * top_k + 4 * top_k * activation_groups(down)


def supports(tokens: int, top_k: int, gate_up: QuantizedWeight, down: QuantizedWeight) -> bool:
    """Whether a decode batch of ``tokens`` tokens choosing ``top_k`` experts each is served over
    these stacks (hidden and expert widths multiples of 8, column blocks of whole chunks, neither
    act-ordered, the staged rows within a block's shared memory)."""
    hidden, inter = gate_up.shape[1], down.shape[1]
    return (0 < tokens <= MAX_TOKENS and top_k > 0 and hidden % 8 == 0 and inter % 8 == 0
            and gate_up.block[1] % 8 == 0 and down.block[1] % 8 == 0
            and gate_up.input_order is None and down.input_order is None
            and gate_up_shared_bytes(hidden, gate_up) <= MAX_STAGE_BYTES
            and down_shared_bytes(top_k, inter, down) <= MAX_STAGE_BYTES)


def quantized_decode_experts_reference(x: np.ndarray, experts: np.ndarray, weights: np.ndarray,
                                       gate_up: QuantizedWeight, down: QuantizedWeight) -> np.ndarray:
    """``[N, H]`` float32: what the kernels compute, from host arrays: each staged input quantized
    as its weights' scheme says and rounded to bf16, the dequantized weights rounded to bf16, the
    activation rounded to bf16 between the products."""
    x = np.asarray(x, dtype=np.float32)
    hidden, inter = x.shape[1], down.shape[1]
    dense_gate_up = round_bf16(dequantize(gate_up))
    dense_down = round_bf16(dequantize(down))
    out = np.zeros((x.shape[0], hidden), dtype=np.float32)
    for n in range(x.shape[0]):
        staged = round_bf16(quantize_activations(x[n : n + 1], gate_up))[0]
        for s in range(experts.shape[1]):
            e = int(experts[n, s])
            gu = dense_gate_up[2 * inter * e : 2 * inter * (e + 1)] @ staged
            gate, up = gu[:inter], gu[inter:]
            act = round_bf16((gate / sigmoid_denominator(gate) * up).astype(np.float32))
            act = round_bf16(quantize_activations(act[None], down))[0]
            out[n] += np.float32(weights[n, s]) * (dense_down[hidden * e : hidden * (e + 1)] @ act)
    return out


_functions: dict[str, Any] = {}


def _function(name: str) -> Any:
    function = _functions.get(name)
    if function is None:
        import cupy

        module = cupy.RawModule(code=source(), options=("--std=c++17",), name_expressions=(name,))
        function = _functions[name] = module.get_function(name)
    return function


def _weight_arguments(weight: QuantizedWeight) -> tuple:
    null = np.uint64(0)
    input_scale = float(weight.input_scale) if weight.input_scale is not None else 1.0
    return (np.float32(input_scale), np.int32(weight.activation_group), weight.codes, weight.scales,
            weight.zeros if weight.zeros is not None else null, np.int32(weight.block[0]), np.int32(weight.block[1]),
            np.int32(weight.scales.shape[1]))


def quantized_decode_experts(x: DeviceArray, experts: DeviceArray, weights: DeviceArray, gate_up: QuantizedWeight,
                             down: QuantizedWeight, act: DeviceArray, out: DeviceArray,
                             stream: Any = None) -> DeviceArray:
    """Launch the two kernels (the module docstring): ``out [N, H]`` float32 from float32 ``x [N,
    H]``, int32 ``experts [N, k]``, float32 ``weights [N, k]``, quantized ``gate_up [E * 2I, H]`` and
    ``down [E * H, I]``; ``act [N * k, I]`` bf16 scratch."""
    op = "quantized_moe_decode"
    check_weight(op, gate_up)
    check_weight(op, down)
    check_array(op, "x", x, np.float32, ndim=2)
    tokens, hidden = x.shape
    check_array(op, "experts", experts, np.int32, (tokens, None))
    top_k = experts.shape[1]
    check_array(op, "weights", weights, np.float32, (tokens, top_k))
    inter = down.shape[1]
    num_experts = down.shape[0] // hidden if hidden else 0
    if gate_up.shape != (num_experts * 2 * inter, hidden) or down.shape != (num_experts * hidden, inter):
        raise KernelArgumentError(f"{op}: gate_up {list(gate_up.shape)} and down {list(down.shape)} are not the stacks "
                                  f"of {num_experts} experts of hidden size {hidden} and width {inter}")
    check_array(op, "act", act, np.uint16, (tokens * top_k, inter))
    check_array(op, "out", out, np.float32, (tokens, hidden))
    if not supports(tokens, top_k, gate_up, down):
        raise KernelArgumentError(f"{op}: {tokens} tokens of {top_k} experts, hidden size {hidden}, width {inter} are "
                                  f"not served (at most {MAX_TOKENS} tokens; sizes multiples of 8; no act-order)")
    first = _function(f"quantized_moe_gate_up<{CODES[gate_up.codes_format]}, {ACTIVATIONS[gate_up.activations]}>")
    second = _function(f"quantized_moe_down<{CODES[down.codes_format]}, {ACTIVATIONS[down.activations]}>")
    first_stage, second_stage = gate_up_shared_bytes(hidden, gate_up), down_shared_bytes(top_k, inter, down)
    if first_stage > 48 * 1024:
        first.max_dynamic_shared_size_bytes = first_stage
    if second_stage > 48 * 1024:
        second.max_dynamic_shared_size_bytes = second_stage
    launch(first, (-(-inter // (WARPS * COLUMNS)), tokens * top_k), (32 * WARPS,),
           (x, experts, *_weight_arguments(gate_up), act, np.int32(top_k), np.int32(hidden), np.int32(inter)),
           first_stage, stream, dependent=False)
    launch(second, (-(-hidden // WARPS), tokens), (32 * WARPS,),
           (act, experts, weights, *_weight_arguments(down), out, np.int32(top_k), np.int32(hidden), np.int32(inter)),
           second_stage, stream, dependent=False)
    return out
