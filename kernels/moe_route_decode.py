"""The router of a decode batch (up to :data:`MAX_ROWS` tokens) as one kernel: the float32 router
product ``x @ gate.T`` and the choice of experts (CUDA C++, compiled by NVRTC through CuPy).

At decode sizes the router is two small kernels that wait on each other: the product (a warp per
token and expert) and the choice (a block per token, one block-wide reduction per chosen expert).
Here the blocks first compute the product for their experts (a block per expert, every token at
once, the threads across the hidden size, four float32 router weights a load, the first of them
issued before the kernel waits for the one ahead); the last block to
finish (an atomic ticket on ``counter``, reset by that block for the next launch) then chooses
each token's experts with one warp per token: the scores in shared memory, the group limits, and
``top_k`` rounds of a warp-wide arg-max (ties go to the smaller expert index), as
:func:`metrale.kernels.moe.route_reference` defines them: softmax scores with greedy or
group-limited selection (``greedy``, ``group_limited_greedy``), or sigmoid scores with the
correction bias and top-2-sum group limits (``noaux_tc``); optional renormalisation; times
``scaling``.

``counter`` is one int32 that is zero between launches; launches that share it must run one
after another (one stream). :func:`route_decode_reference` is the NumPy reference; ``tests/kernels``
runs the kernel on the host through the CUDA emulation header, ``tests/kernels``' GPU tests (``-m gpu``) on the GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metrale.errors import KernelArgumentError
from metrale.kernels._device import DeviceArray, check_array
from metrale.kernels._launch import DEPENDENT_LAUNCH, launch
from metrale.kernels._words import HELPERS
from metrale.kernels.moe import ROUTE_METHODS, route_reference

MAX_ROWS = 8  # a warp per token in the choice
MAX_EXPERTS = 256
MAX_TOP_K = 16
MAX_GROUPS = 32
WARPS = 8
THREADS = 32 * WARPS

CONSTANTS = f"""
#define WARPS {WARPS}
#define THREADS {THREADS}
#define MAX_ROWS {MAX_ROWS}
#define MAX_EXPERTS {MAX_EXPERTS}
#define MAX_GROUPS {MAX_GROUPS}
#define NEG_INF (__int_as_float(0xff800000))   // NVRTC has no <math.h>, so no INFINITY
"""

KERNEL = r"""
__device__ __forceinline__ float warp_max(float value) {
    for (int offset = 16; offset > 0; offset /= 2) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
    return value;
}

// Grid: E blocks of THREADS threads; block b computes expert b, its threads across the hidden size
// (four float32 router weights a load), the warps' partial sums added in shared memory.
// x: bf16 bits [rows, H] (H a multiple of 4, rows <= MAX_ROWS); gate: float32 [E, H]; bias:
// float32 [E] (noaux_tc) or null; logits: float32 [rows, E] scratch; counter: one int, zero
// between launches; out_experts: int32 [rows, top_k]; out_weights: float32 [rows, top_k].
extern "C" __global__ void __launch_bounds__(THREADS) moe_route_decode(
    const unsigned short* __restrict__ x, const float* __restrict__ gate, const float* __restrict__ bias,
    float* __restrict__ logits, int* __restrict__ counter, int* __restrict__ out_experts,
    float* __restrict__ out_weights, int rows, int H, int E, int method, int n_group, int topk_group, int top_k,
    int renormalise, float scaling) {
    __shared__ float scores[WARPS][MAX_EXPERTS];
    __shared__ float choice[WARPS][MAX_EXPERTS];
    __shared__ float group_scores[WARPS][MAX_GROUPS];
    __shared__ float partial[WARPS][MAX_ROWS];
    __shared__ int last;
    allow_dependents();
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int expert = blockIdx.x;
    const float4* row = reinterpret_cast<const float4*>(gate + (size_t)expert * H);
    float4 first_weights = {0.f, 0.f, 0.f, 0.f};
    if (tid < H / 4) first_weights = row[tid];   // the router's weights: in flight while the kernel ahead ends
    wait_for_producers();   // x comes from the kernels ahead

    // 1. The router product of this block's expert for every token.
    float acc[MAX_ROWS];
    #pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r) acc[r] = 0.0f;
    #pragma unroll 4
    for (int k = tid; k < H / 4; k += THREADS) {
        const float4 g = k == tid ? first_weights : row[k];
        #pragma unroll
        for (int r = 0; r < MAX_ROWS; ++r) {
            if (r < rows) {
                const uint2 v = *reinterpret_cast<const uint2*>(x + (size_t)r * H + 4 * k);
                acc[r] += g.x * bf16_low(v.x) + g.y * bf16_high(v.x) + g.z * bf16_low(v.y) + g.w * bf16_high(v.y);
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r) {
        if (r < rows) {
            const float total = warp_sum(acc[r]);
            if (lane == 0) partial[warp][r] = total;
        }
    }
    __syncthreads();
    if (tid < rows) {
        float total = 0.0f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) total += partial[w][tid];
        logits[(size_t)tid * E + expert] = total;
    }

    // 2. The last block to finish chooses the experts, a warp per token.
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(counter, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();   // the other blocks' logits are visible
    if (tid == 0) *counter = 0;   // for the next launch
    if (warp >= rows) return;
    const int r = warp;
    float* my_scores = scores[warp];
    float* my_choice = choice[warp];
    const float* my_logits = logits + (size_t)r * E;
    if (method == 2) {
        for (int e = lane; e < E; e += 32) {
            const float score = 1.0f / (1.0f + expf(-my_logits[e]));
            my_scores[e] = score;
            my_choice[e] = score + bias[e];
        }
    } else {
        float largest = NEG_INF;
        for (int e = lane; e < E; e += 32) largest = fmaxf(largest, my_logits[e]);
        largest = warp_max(largest);
        float total = 0.0f;
        for (int e = lane; e < E; e += 32) total += expf(my_logits[e] - largest);
        total = warp_sum(total);
        for (int e = lane; e < E; e += 32) {
            const float score = expf(my_logits[e] - largest) / total;
            my_scores[e] = score;
            my_choice[e] = score;
        }
    }
    __syncwarp();
    if (method != 0 && topk_group < n_group) {
        // Keep the topk_group best groups: a group is dropped when topk_group others beat it.
        const int per_group = E / n_group;
        if (lane < n_group) {
            float first = NEG_INF, second = NEG_INF;
            for (int e = lane * per_group; e < (lane + 1) * per_group; ++e) {
                const float value = my_choice[e];
                if (value > first) {
                    second = first;
                    first = value;
                } else if (value > second) {
                    second = value;
                }
            }
            group_scores[warp][lane] = method == 2 && per_group > 1 ? first + second : first;
        }
        __syncwarp();
        for (int e = lane; e < E; e += 32) {
            const int group = e / per_group;
            const float mine = group_scores[warp][group];
            int better = 0;
            for (int other = 0; other < n_group; ++other) {
                const float score = group_scores[warp][other];
                better += score > mine || (score == mine && other < group);
            }
            if (better >= topk_group) my_choice[e] = method == 2 ? NEG_INF : 0.0f;
        }
        __syncwarp();
    }
    int picked = 0;   // lane s holds the s-th choice
    float total = 0.0f;
    for (int slot = 0; slot < top_k; ++slot) {
        float best = NEG_INF;
        int best_index = E;
        for (int e = lane; e < E; e += 32) {
            const float value = my_choice[e];
            if (value > best || best_index == E) {
                best = value;
                best_index = e;
            }
        }
        for (int offset = 16; offset > 0; offset /= 2) {
            const float other = __shfl_xor_sync(0xffffffffu, best, offset);
            const int other_index = (int)__shfl_xor_sync(0xffffffffu, (float)best_index, offset);
            if (other > best || (other == best && other_index < best_index)) {
                best = other;
                best_index = other_index;
            }
        }
        if (lane == slot) picked = best_index;
        total += my_scores[best_index];
        __syncwarp();
        if (lane == 0) my_choice[best_index] = NEG_INF;
        __syncwarp();
    }
    if (lane < top_k) {
        float weight = my_scores[picked];
        if (renormalise) weight = weight / (total + 1e-20f);
        out_experts[(size_t)r * top_k + lane] = picked;
        out_weights[(size_t)r * top_k + lane] = weight * scaling;
    }
}
"""


def source() -> str:
    """The CUDA C++ source NVRTC compiles."""
    return DEPENDENT_LAUNCH + CONSTANTS + HELPERS + KERNEL


KERNEL_NAMES = ("moe_route_decode",)


def supports(tokens: int, hidden: int, experts: int, n_group: int, top_k: int) -> bool:
    """Whether a batch of ``tokens`` tokens routed over ``experts`` experts is served."""
    return (0 < tokens <= MAX_ROWS and hidden > 0 and hidden % 4 == 0 and 0 < experts <= MAX_EXPERTS
            and 0 < n_group <= MAX_GROUPS and experts % n_group == 0 and 0 < top_k <= min(MAX_TOP_K, experts, 32))


def route_decode_reference(
    x: np.ndarray, gate: np.ndarray, bias: np.ndarray | None, method: str, n_group: int, topk_group: int, top_k: int,
    renormalise: bool, scaling: float,
) -> tuple[np.ndarray, np.ndarray]:
    """What a launch computes, from float32 ``x [N, H]`` (bf16 values) and ``gate [E, H]``: the
    logits ``x @ gate.T`` in float32, then :func:`~metrale.kernels.moe.route_reference`."""
    logits = np.asarray(x, dtype=np.float32) @ np.asarray(gate, dtype=np.float32).T
    return route_reference(logits, bias, method, n_group, topk_group, top_k, renormalise, scaling)


_kernels: dict[str, Any] = {}


def _kernel() -> Any:
    if "route" not in _kernels:
        import cupy

        _kernels["route"] = cupy.RawModule(code=source(), options=("--std=c++17",)).get_function(KERNEL_NAMES[0])
    return _kernels["route"]


def route_decode(
    x: DeviceArray, gate: DeviceArray, bias: DeviceArray | None, method: str, n_group: int, topk_group: int,
    top_k: int, renormalise: bool, scaling: float, logits: DeviceArray, counter: DeviceArray,
    out_experts: DeviceArray, out_weights: DeviceArray, stream: Any = None,
) -> tuple[DeviceArray, DeviceArray]:
    """Launch :data:`KERNEL` (see the module docstring): ``out_experts [N, k]`` int32 and
    ``out_weights [N, k]`` float32 for bf16 ``x [N, H]`` and float32 ``gate [E, H]``; ``logits
    [N, E]`` float32 scratch; ``counter`` an int32 array of one zero. Raises
    :class:`~metrale.errors.KernelArgumentError` for what it does not serve (:func:`supports`)."""
    op = "moe_route_decode"
    check_array(op, "x", x, np.uint16, ndim=2)
    tokens, hidden = x.shape
    check_array(op, "gate", gate, np.float32, (None, hidden))
    experts = gate.shape[0]
    if method not in ROUTE_METHODS:
        raise KernelArgumentError(f"{op}: unknown routing method {method!r}; known: {', '.join(ROUTE_METHODS)}")
    if not supports(tokens, hidden, experts, n_group, top_k):
        raise KernelArgumentError(
            f"{op}: {tokens} tokens of hidden size {hidden} over {experts} experts in {n_group} groups, top-{top_k}, "
            f"are not served (at most {MAX_ROWS} tokens, {MAX_EXPERTS} experts in {MAX_GROUPS} equal groups, "
            f"top-{MAX_TOP_K}; the hidden size a multiple of 4)")
    if method == "noaux_tc":
        if bias is None:
            raise KernelArgumentError(f"{op}: method 'noaux_tc' needs the correction bias")
        check_array(op, "bias", bias, np.float32, (experts,))
    check_array(op, "logits", logits, np.float32, (tokens, experts))
    check_array(op, "counter", counter, np.int32, (1,))
    check_array(op, "out_experts", out_experts, np.int32, (tokens, top_k))
    check_array(op, "out_weights", out_weights, np.float32, (tokens, top_k))
    null = np.uint64(0)
    launch(_kernel(), (experts,), (THREADS,), (
        x, gate, bias if bias is not None and method == "noaux_tc" else null, logits, counter, out_experts,
        out_weights, np.int32(tokens), np.int32(hidden), np.int32(experts), np.int32(ROUTE_METHODS[method]),
        np.int32(n_group), np.int32(topk_group), np.int32(top_k), np.int32(bool(renormalise)), np.float32(scaling),
    ), 0, stream, dependent=True)
    return out_experts, out_weights
