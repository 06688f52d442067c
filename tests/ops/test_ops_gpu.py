"""Every built-in CUDA kernel against its op's reference, on the op's declared examples, and a
plugin kernel overriding a built-in op on the GPU."""

from __future__ import annotations

import pytest

from metrale.ops.builtin import builtin_registry
from metrale.ops.check import check_kernel

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backend():
    from metrale.backends.cuda import CudaBackend

    return CudaBackend()


@pytest.mark.parametrize("op", sorted(op.name for op in builtin_registry() if op.examples is not None))
def test_builtin_cuda_kernels_match_their_reference(backend, op):
    """Every CUDA kernel of the op: the conditional ones (on the examples they serve) and the one
    that serves the rest."""
    registry = builtin_registry()
    for kernel in registry.kernels_for(op, "cuda"):
        assert check_kernel(registry, kernel, backend) == [], kernel.name


def test_a_wrong_cuda_override_is_caught(backend):
    from metrale.ops import Kernel
    from metrale.ops.check import check_plugin_kernels

    registry = builtin_registry().copy()
    plugin = registry.from_plugin("test")

    def shifted(b):
        return lambda x, weight, eps, offset=0.0: b.kernels.rmsnorm_residual(x, None, weight, eps + 0.5, offset)[0]

    plugin.add_kernel(Kernel("rmsnorm", "cuda", "test.shifted", build=shifted))
    problems = check_plugin_kernels(registry, backend)
    assert problems and "test.shifted" in problems[0]


def test_the_gdn_decode_kernel_matches_the_reference(backend):
    from metrale.ops.builtin import gdn_decode_kernels

    registry = builtin_registry()
    for kernel in gdn_decode_kernels():
        assert check_kernel(registry, kernel, backend) == [], kernel.name


def test_the_decode_router_kernel_matches_the_reference(backend):
    from metrale.ops.builtin import moe_route_decode_kernels

    registry = builtin_registry()
    for kernel in moe_route_decode_kernels():
        assert check_kernel(registry, kernel, backend) == [], kernel.name


def test_the_decode_gemv_kernels_match_the_references(backend):
    from metrale.ops.builtin import decode_gemv_kernels

    registry = builtin_registry()
    for kernel in decode_gemv_kernels():
        assert check_kernel(registry, kernel, backend) == [], kernel.name


@pytest.mark.parametrize("method, experts, top_k, n_group, topk_group", [("greedy", 64, 6, 1, 1), ("noaux_tc", 256, 8, 8, 4)])
def test_a_prompts_routing_matches_the_reference(backend, method, experts, top_k, n_group, topk_group):
    """Prompt-sized batches take the float32 cuBLAS router product, decode-sized ones the kernel."""
    import cupy as cp
    import numpy as np

    from metrale.loading.checkpoint import bf16_to_float32, float32_to_bf16
    from metrale.ops import builtin

    rng = np.random.default_rng(7)
    for tokens in (300, 9):
        x = float32_to_bf16(rng.standard_normal((tokens, 2048)).astype(np.float32))
        gate = (0.05 * rng.standard_normal((experts, 2048))).astype(np.float32)
        bias = (0.1 * rng.standard_normal(experts)).astype(np.float32)
        arguments = (method, n_group, topk_group, top_k, method == "noaux_tc", 2.5)
        chosen, weights = backend.ops.moe_route(cp.asarray(x), cp.asarray(gate), cp.asarray(bias), *arguments)
        want_chosen, want_weights = builtin.moe_route(bf16_to_float32(x), gate, bias, *arguments)
        # Rows whose k-th and (k+1)-th logits are this close could order differently under another
        # summation order: left out (the comparison still covers nearly every row).
        scores = np.sort(bf16_to_float32(x) @ gate.T, axis=1)[:, ::-1]
        clear = scores[:, top_k - 1] - scores[:, top_k] > 1e-4
        assert clear.mean() > 0.95
        np.testing.assert_array_equal(cp.asnumpy(chosen)[clear], want_chosen[clear])
        np.testing.assert_allclose(cp.asnumpy(weights)[clear], want_weights[clear], rtol=1e-4, atol=1e-6)
