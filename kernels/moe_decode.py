"""Routed experts of a decode batch (up to :data:`MAX_TOKENS` tokens) as two GEMV kernels over the
chosen experts' weights only (CUDA C++, compiled by NVRTC through CuPy; 128-bit weight loads).

The same sum as :func:`metrale.kernels.moe.experts_reference`, with the SwiGLU activation
rounded to bf16 between the two products (:func:`decode_experts_reference`). Every (token,
chosen expert) pair is one row of the first product; no alignment, no padding, no host
synchronisation (CUDA-graph safe):

1. **gate_up** -- grid ``(ceil(I / 16), N * k)``: a block stages its pair's token row of ``x``
   (bf16) in shared memory; each warp computes two activation columns ``c``, reading gate row
   ``c`` and up row ``I + c`` of the pair's expert as 16-byte words (four words per row and lane
   in flight), and writes ``bf16(silu(gate) * up)`` into ``act [N * k, I]``;
2. **down** -- grid ``(ceil(H / 8), N)``: a block stages the ``k`` activation rows of its token;
   each warp computes one output column ``n`` as ``sum_s weights[t, s] * dot(down_e(s)[n],
   act[t, s])``, its lanes walking the ``k`` slots' weight words as one sequence (each word's
   product weighted by its slot, eight words a lane in flight), and writes float32 ``out [N, H]``
   -- the weighting and the sum over slots in the same kernel, with no float32 round trip
   through memory.

``H`` and ``I`` must be multiples of 8. The kernels read the weights of every pair, a shared
expert once per pair that chose it (prompt-sized batches, where experts repeat, take the grouped
tensor-core kernels of :mod:`metrale.kernels.moe_grouped`). ``tests/kernels`` runs them on the
host through the CUDA emulation header; ``tests/kernels``' GPU tests (``-m gpu``) on the GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels._device import DeviceArray, check_array
from metrale.kernels._launch import DEPENDENT_LAUNCH, launch
from metrale.kernels._words import HELPERS
from metrale.kernels.activation import sigmoid_denominator
from metrale.kernels.decode_gemv import INSTRUCTIONS as DYNAMIC_SHARED_MEMORY

MAX_TOKENS = 8
WARPS = 8
THREADS = 32 * WARPS
COLUMNS = 2  # activation columns of a gate_up warp
UNROLL = 4  # weight words of a gate_up lane in flight per row
DOWN_UNROLL = 8  # weight words of a down lane in flight
#: Largest staged input of a block (the down kernel's, :func:`down_shared_bytes`).
MAX_STAGE_BYTES = 200 * 1024

CONSTANTS = f"""
#define WARPS {WARPS}
#define THREADS {THREADS}
#define COLUMNS {COLUMNS}
#define UNROLL {UNROLL}
#define DOWN_UNROLL {DOWN_UNROLL}
"""

KERNELS = r"""
// act[p, c] = bf16(silu(gate_e[c] . x[t]) * (up_e[c] . x[t])) for pair p = t * k + s, e = experts[t, s].
// Grid (ceil(I / (WARPS * COLUMNS)), N * k); dynamic shared memory H * 2 bytes.
extern "C" __global__ void __launch_bounds__(THREADS) moe_decode_gate_up(
    const unsigned short* __restrict__ x, const uint4* __restrict__ gate_up, const int* __restrict__ experts,
    unsigned short* __restrict__ act, int top_k, int H, int I) {
    DYNAMIC_SHARED;
    allow_dependents();
    wait_for_producers();   // the routing and the inputs come from the kernels ahead
    unsigned short* row = reinterpret_cast<unsigned short*>(dynamic_shared);
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int pair = blockIdx.y, token = pair / top_k;
    const int expert = experts[pair];
    for (int i = tid; i < H; i += THREADS) row[i] = x[(size_t)token * H + i];
    __syncthreads();
    const int words = H / 8;
    const uint4* staged = reinterpret_cast<const uint4*>(row);
    const int c0 = (blockIdx.x * WARPS + warp) * COLUMNS;
    if (c0 >= I) return;   // whole warps only: no barrier follows
    const size_t base_row = (size_t)expert * 2 * I;
    float gate[COLUMNS], up[COLUMNS];
#pragma unroll
    for (int c = 0; c < COLUMNS; ++c) gate[c] = up[c] = 0.0f;
    for (int base = lane; base < words; base += 32 * UNROLL) {
        uint4 g[COLUMNS][UNROLL], u[COLUMNS][UNROLL];
#pragma unroll
        for (int c = 0; c < COLUMNS; ++c) {
            const int column = min(c0 + c, I - 1);
#pragma unroll
            for (int k = 0; k < UNROLL; ++k) {
                const int index = base + 32 * k;
                if (index < words) {
                    g[c][k] = __ldg(gate_up + (base_row + column) * words + index);
                    u[c][k] = __ldg(gate_up + (base_row + I + column) * words + index);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const int index = base + 32 * k;
            if (index < words) {
                const uint4 input = staged[index];
#pragma unroll
                for (int c = 0; c < COLUMNS; ++c) {
                    gate[c] += dot8(g[c][k], input);
                    up[c] += dot8(u[c][k], input);
                }
            }
        }
    }
#pragma unroll
    for (int c = 0; c < COLUMNS; ++c) {
        const float g_total = warp_sum(gate[c]), u_total = warp_sum(up[c]);
        if (lane == c && c0 + c < I) {
            const float silu = g_total / (1.0f + expf(-g_total));
            act[(size_t)pair * I + c0 + c] = to_bf16(silu * u_total);
        }
    }
}

// out[t, n] = sum_s weights[t, s] * (down_e[n] . act[t * k + s]), e = experts[t, s].
// Grid (ceil(H / WARPS), N): a warp per output column; dynamic shared memory k * I * 2 bytes (the
// token's activations, [k][I]) plus k slots' row offsets and weights. A lane walks the k slots'
// words as one sequence (word i: slot i / (I / 8)), DOWN_UNROLL loads in flight, weighting each
// word's dot product by its slot: k rows of I are one long row, not k short ones each ending in a
// wait for its loads and a warp sum.
extern "C" __global__ void __launch_bounds__(THREADS) moe_decode_down(
    const unsigned short* __restrict__ act, const uint4* __restrict__ down, const int* __restrict__ experts,
    const float* __restrict__ weights, float* __restrict__ out, int top_k, int H, int I) {
    DYNAMIC_SHARED;
    allow_dependents();
    wait_for_producers();   // the routing and the inputs come from the kernels ahead
    unsigned short* rows = reinterpret_cast<unsigned short*>(dynamic_shared);   // [k][I]
    size_t* slot_row = reinterpret_cast<size_t*>(dynamic_shared + ((size_t)top_k * I * 2 + 15) / 16 * 16);   // [k]
    float* slot_weight = reinterpret_cast<float*>(slot_row + top_k);   // [k]
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int token = blockIdx.y, words = I / 8, total_words = top_k * words;
    const int n = blockIdx.x * WARPS + warp;
    for (int i = tid; i < top_k * I; i += THREADS) rows[i] = act[(size_t)token * top_k * I + i];
    for (int s = tid; s < top_k; s += THREADS) {
        slot_row[s] = (size_t)experts[token * top_k + s] * H * words;   // the expert's first down row, in words
        slot_weight[s] = weights[token * top_k + s];
    }
    __syncthreads();
    if (n >= H) return;   // whole warps only: no barrier follows
    const uint4* staged = reinterpret_cast<const uint4*>(rows);
    float acc = 0.0f;
    for (int base = lane; base < total_words; base += 32 * DOWN_UNROLL) {
        uint4 w[DOWN_UNROLL];
        int slot[DOWN_UNROLL];
#pragma unroll
        for (int u = 0; u < DOWN_UNROLL; ++u) {
            const int index = base + 32 * u;
            slot[u] = index < total_words ? index / words : 0;
            if (index < total_words)
                w[u] = __ldg(down + slot_row[slot[u]] + (size_t)n * words + (index - slot[u] * words));
        }
#pragma unroll
        for (int u = 0; u < DOWN_UNROLL; ++u) {
            const int index = base + 32 * u;
            if (index < total_words) acc += slot_weight[slot[u]] * dot8(w[u], staged[index]);
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) out[(size_t)token * H + n] = acc;
}
"""

KERNEL_NAMES = ("moe_decode_gate_up", "moe_decode_down")


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return DYNAMIC_SHARED_MEMORY + DEPENDENT_LAUNCH + CONSTANTS + HELPERS + KERNELS


def supports(tokens: int, top_k: int, hidden: int, inter: int) -> bool:
    """Whether a batch of ``tokens`` tokens with ``top_k`` experts each, of hidden size ``hidden``
    and expert width ``inter``, is served."""
    return (0 < tokens <= MAX_TOKENS and top_k > 0 and hidden > 0 and inter > 0 and hidden % 8 == 0 and inter % 8 == 0
            and down_shared_bytes(top_k, inter) <= MAX_STAGE_BYTES and hidden * 2 <= MAX_STAGE_BYTES)


def down_shared_bytes(top_k: int, inter: int) -> int:
    """Dynamic shared memory of a down block: the token's ``k`` activation rows (padded to 16
    bytes), then each slot's row offset (8 bytes) and weight (4 bytes)."""
    return -(-top_k * inter * 2 // 16) * 16 + 12 * top_k


def decode_experts_reference(
    x: np.ndarray, experts: np.ndarray, weights: np.ndarray, gate_up: np.ndarray, down: np.ndarray
) -> np.ndarray:
    """:func:`metrale.kernels.moe.experts_reference` with the activation rounded to bf16 (as the
    kernels store it between the products), from float32 arrays holding bf16 values."""
    from metrale.kernels.bf16 import bf16_to_float32, float32_to_bf16

    x = np.asarray(x, dtype=np.float32)
    hidden, inter = x.shape[1], down.shape[1]
    out = np.zeros((x.shape[0], hidden), dtype=np.float32)
    for n in range(x.shape[0]):
        for s in range(experts.shape[1]):
            e = int(experts[n, s])
            gu = gate_up[2 * inter * e : 2 * inter * (e + 1)] @ x[n]
            gate, up = gu[:inter], gu[inter:]
            act = bf16_to_float32(float32_to_bf16((gate / sigmoid_denominator(gate) * up).astype(np.float32)))
            out[n] += np.float32(weights[n, s]) * (down[hidden * e : hidden * (e + 1)] @ act)
    return out


_kernels: dict[str, Any] = {}


def _kernel(name: str) -> Any:
    kernel = _kernels.get(name)
    if kernel is None:
        import cupy

        module = cupy.RawModule(code=source(), options=("--std=c++17",))
        for each in KERNEL_NAMES:
            _kernels[each] = module.get_function(each)
        kernel = _kernels[name]
    return kernel


def decode_experts(
    x: DeviceArray, experts: DeviceArray, weights: DeviceArray, gate_up: DeviceArray, down: DeviceArray,
    act: DeviceArray, out: DeviceArray, stream: Any = None,
) -> DeviceArray:
    """Launch the two kernels (see the module docstring): ``out [N, H]`` float32 from bf16 ``x
    [N, H]``, int32 ``experts [N, k]``, float32 ``weights [N, k]``, bf16 ``gate_up [E * 2I, H]``
    and ``down [E * H, I]``; ``act [N * k, I]`` bf16 scratch."""
    op = "moe_decode"
    check_array(op, "x", x, np.uint16, ndim=2)
    tokens, hidden = x.shape
    check_array(op, "experts", experts, np.int32, (tokens, None))
    top_k = experts.shape[1]
    check_array(op, "weights", weights, np.float32, (tokens, top_k))
    check_array(op, "down", down, np.uint16, ndim=2)
    inter = down.shape[1]
    num_experts = down.shape[0] // hidden if hidden else 0
    check_array(op, "down", down, np.uint16, (num_experts * hidden, inter))
    check_array(op, "gate_up", gate_up, np.uint16, (num_experts * 2 * inter, hidden))
    check_array(op, "act", act, np.uint16, (tokens * top_k, inter))
    check_array(op, "out", out, np.float32, (tokens, hidden))
    if not supports(tokens, top_k, hidden, inter):
        raise KernelArgumentError(f"{op}: {tokens} tokens of {top_k} experts, hidden size {hidden} and expert width "
                                  f"{inter} are not served (at most {MAX_TOKENS} tokens; sizes multiples of 8)")
    for name, array in (("gate_up", gate_up), ("down", down), ("act", act)):
        pointer = getattr(getattr(array, "data", None), "ptr", None)
        if pointer is not None and pointer % 16:
            raise KernelArgumentError(f"{op}: {name} does not start at a 16-byte boundary")
    columns = WARPS * COLUMNS
    gate_up_kernel, down_kernel = _kernel("moe_decode_gate_up"), _kernel("moe_decode_down")
    stage = down_shared_bytes(top_k, inter)
    if stage > 48 * 1024:
        down_kernel.max_dynamic_shared_size_bytes = stage
    if hidden * 2 > 48 * 1024:
        gate_up_kernel.max_dynamic_shared_size_bytes = hidden * 2
    launch(gate_up_kernel, (-(-inter // columns), tokens * top_k), (THREADS,),
           (x, gate_up, experts, act, np.int32(top_k), np.int32(hidden), np.int32(inter)), hidden * 2, stream,
           dependent=True)
    launch(down_kernel, (-(-hidden // WARPS), tokens), (THREADS,),
           (act, down, experts, weights, out, np.int32(top_k), np.int32(hidden), np.int32(inter)), stage, stream,
           dependent=True)
    return out
