"""The decode router kernel (``metrale.kernels.moe_route_decode``) on a real GPU against its NumPy
reference: DeepSeek-V2-Lite's, Qwen3-Next's and DeepSeek-V3's routing at 1 to 8 tokens, the
conditional kernel of ``moe_route`` against the unconditional one, and a CUDA-graph replay with
new inputs (the counter ready again after every launch)."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16

pytestmark = pytest.mark.gpu

# hidden, experts, method, n_group, topk_group, top_k, renormalise, scaling
ROUTINGS = {
    "deepseek-v2-lite": (2048, 64, "greedy", 1, 1, 6, False, 1.0),
    "qwen3-next": (2048, 128, "greedy", 1, 1, 10, True, 1.0),
    "deepseek-v3": (7168, 256, "noaux_tc", 8, 4, 8, True, 2.5),
}


@pytest.fixture(scope="module")
def backend():
    from metrale.backends.cuda import CudaBackend

    backend = CudaBackend()
    yield backend
    backend.close()


def inputs(rng, tokens, hidden, experts, method):
    x = float32_to_bf16(rng.standard_normal((tokens, hidden)).astype(np.float32))
    gate = (rng.standard_normal((experts, hidden)) / np.sqrt(hidden)).astype(np.float32)
    bias = (0.05 * rng.standard_normal(experts)).astype(np.float32) if method == "noaux_tc" else None
    return x, gate, bias


@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_routings_match_the_reference(backend, name, tokens):
    import cupy as cp

    hidden, experts, method, n_group, topk_group, top_k, renormalise, scaling = ROUTINGS[name]
    x, gate, bias = inputs(np.random.default_rng(tokens), tokens, hidden, experts, method)
    with backend.activate():
        chosen, weights = backend.kernels.moe_route_decode(
            cp.asarray(x), cp.asarray(gate), None if bias is None else cp.asarray(bias), method, n_group, topk_group,
            top_k, renormalise, scaling)
        unconditional = backend.kernels.moe_route(
            cp.asarray(x), cp.asarray(gate), None if bias is None else cp.asarray(bias), method, n_group, topk_group,
            top_k, renormalise, scaling)
    # The backend's stream does not wait on the null stream's copies below, nor they on it.
    backend.stream.synchronize()
    from metrale.kernels.moe_route_decode import route_decode_reference

    expected_chosen, expected_weights = route_decode_reference(bf16_to_float32(x), gate, bias, method, n_group,
                                                               topk_group, top_k, renormalise, scaling)
    np.testing.assert_array_equal(cp.asnumpy(chosen), expected_chosen)
    np.testing.assert_allclose(cp.asnumpy(weights), expected_weights, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(cp.asnumpy(unconditional[0]), expected_chosen)


def test_a_graph_replays_with_new_inputs(backend):
    import cupy as cp

    from metrale.kernels.moe_route_decode import route_decode_reference

    hidden, experts, method, n_group, topk_group, top_k, renormalise, scaling = ROUTINGS["deepseek-v3"]
    tokens = 4
    x, gate, bias = inputs(np.random.default_rng(5), tokens, hidden, experts, method)
    stream = backend.stream
    with cp.cuda.using_allocator(backend.graph_pool.malloc), backend.activate():
        x_device, gate_device, bias_device = cp.asarray(x), cp.asarray(gate), cp.asarray(bias)

        def route():
            return backend.kernels.moe_route_decode(x_device, gate_device, bias_device, method, n_group, topk_group,
                                                    top_k, renormalise, scaling)

        route()  # compiles, makes the counter
        stream.synchronize()
        stream.begin_capture(getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", 2))
        try:
            chosen, weights = route()
        finally:
            graph = stream.end_capture()
    for seed in (1, 2, 3):
        new = float32_to_bf16(np.random.default_rng(seed).standard_normal((tokens, hidden)).astype(np.float32))
        with backend.activate():
            x_device.set(new, stream=stream)
            graph.launch(stream=stream)
            stream.synchronize()
        expected_chosen, expected_weights = route_decode_reference(bf16_to_float32(new), gate, bias, method, n_group,
                                                                   topk_group, top_k, renormalise, scaling)
        np.testing.assert_array_equal(cp.asnumpy(chosen), expected_chosen)
        np.testing.assert_allclose(cp.asnumpy(weights), expected_weights, rtol=1e-4, atol=1e-6)
    assert int(cp.asnumpy(backend.kernels._route_counter)[0]) == 0
