"""The decode MoE kernels (``metrale.kernels.moe_decode``) against the NumPy reference on a real GPU:
DeepSeek-V2-Lite, DeepSeek-V3 and Qwen3-Next expert shapes at 1 to 8 tokens, an expert chosen by
every token, the conditional kernel of the ``moe_experts`` op, and a CUDA-graph replay with new
routing."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_helpers import bf16, rel_error  # noqa: E402

from metrale.loading.checkpoint import bf16_to_float32

pytestmark = pytest.mark.gpu

# (H, I, E, k)
SHAPES = {"deepseek-v2-lite": (2048, 1408, 64, 6), "deepseek-v3": (7168, 2048, 16, 8), "qwen3-next": (2048, 512, 128, 10)}

_weights: dict = {}


@pytest.fixture(scope="module")
def backend():
    from metrale.backends.cuda import CudaBackend

    backend = CudaBackend()
    yield backend
    backend.close()


def expert_weights(hidden, inter, num_experts):
    import cupy as cp

    key = (hidden, inter, num_experts)
    if key not in _weights:
        rng = np.random.default_rng(hidden + inter + num_experts)
        gate_up = bf16(rng, (num_experts * 2 * inter, hidden), scale=0.05)
        down = bf16(rng, (num_experts * hidden, inter), scale=0.05)
        _weights[key] = (bf16_to_float32(gate_up), bf16_to_float32(down), cp.asarray(gate_up), cp.asarray(down))
    return _weights[key]


def routing(rng, tokens, top_k, num_experts, shared_expert=False):
    chosen = np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :top_k].astype(np.int32)
    if shared_expert:
        chosen[:, 0] = 0
        for row in chosen:
            rest = [e for e in row[1:] if e != 0]
            row[1:] = (rest + [e for e in range(1, num_experts) if e not in rest])[: top_k - 1]
    return chosen, rng.random((tokens, top_k)).astype(np.float32)


@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_model_shapes_match_the_reference(name, tokens):
    import cupy as cp

    from metrale.kernels import moe_decode

    hidden, inter, num_experts, top_k = SHAPES[name]
    gate_up, down, gate_up_device, down_device = expert_weights(hidden, inter, num_experts)
    rng = np.random.default_rng(tokens)
    x = bf16(rng, (tokens, hidden))
    chosen, weights = routing(rng, tokens, top_k, num_experts, shared_expert=tokens == 3)
    act = cp.full((tokens * top_k, inter), 0x7FC0, np.uint16)
    out = cp.full((tokens, hidden), np.nan, np.float32)
    moe_decode.decode_experts(cp.asarray(x), cp.asarray(chosen), cp.asarray(weights), gate_up_device, down_device, act,
                              out, cp.cuda.get_current_stream())
    expected = moe_decode.decode_experts_reference(bf16_to_float32(x), chosen, weights, gate_up, down)
    got = cp.asnumpy(out)
    assert np.isfinite(got).all()
    assert rel_error(got, expected) <= 1e-3


def test_the_op_kernel_replays_from_a_graph_with_new_routing(backend):
    import cupy as cp

    from metrale.kernels import moe_decode
    from metrale.ops.builtin import moe_decode_kernels

    hidden, inter, num_experts, top_k = SHAPES["deepseek-v2-lite"]
    gate_up, down, gate_up_device, down_device = expert_weights(hidden, inter, num_experts)
    (kernel,) = moe_decode_kernels()
    function = kernel.build(backend)
    rng = np.random.default_rng(9)
    tokens = 4
    x = bf16(rng, (tokens, hidden))
    chosen, weights = routing(rng, tokens, top_k, num_experts)
    stream = backend.stream
    with cp.cuda.using_allocator(backend.graph_pool.malloc), backend.activate():
        x_device, chosen_device, weights_device = cp.asarray(x), cp.asarray(chosen), cp.asarray(weights)
        assert kernel.when(x_device, chosen_device, weights_device, gate_up_device, down_device)
        function(x_device, chosen_device, weights_device, gate_up_device, down_device)  # compiles
        stream.synchronize()
        stream.begin_capture(getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", 2))
        try:
            out = function(x_device, chosen_device, weights_device, gate_up_device, down_device)
        finally:
            graph = stream.end_capture()
    for seed in (1, 2):
        x = bf16(np.random.default_rng(seed), (tokens, hidden))
        chosen, weights = routing(np.random.default_rng(seed), tokens, top_k, num_experts)
        with backend.activate():
            x_device.set(x, stream=stream)
            chosen_device.set(chosen, stream=stream)
            weights_device.set(weights, stream=stream)
            out.fill(np.nan)
            graph.launch(stream=stream)
            stream.synchronize()
            got = cp.asnumpy(out)
        expected = moe_decode.decode_experts_reference(bf16_to_float32(x), chosen, weights, gate_up, down)
        per_token = np.abs(got - expected).max(axis=1) / np.abs(expected).max()
        assert rel_error(got, expected) <= 1e-3, f"seed {seed}: error per token {per_token}, routing {chosen.tolist()}"
