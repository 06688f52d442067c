"""Every built-in CUDA kernel against its op's reference, on the op's declared examples, and a
plugin kernel overriding a built-in op on the GPU."""

from __future__ import annotations

import pytest

from metrale.ops.builtin import builtin_registry
from metrale.ops.check import check_kernel

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backend():
    from metrale.cuda_backend import CudaBackend

    return CudaBackend()


@pytest.mark.parametrize("op", sorted(op.name for op in builtin_registry() if op.examples is not None))
def test_builtin_cuda_kernel_matches_its_reference(backend, op):
    registry = builtin_registry()
    (kernel,) = registry.kernels_for(op, "cuda")
    assert check_kernel(registry, kernel, backend) == []


def test_a_wrong_cuda_override_is_caught(backend):
    from metrale.ops import Kernel
    from metrale.ops.check import check_plugin_kernels

    registry = builtin_registry().copy()
    plugin = registry.from_plugin("test")

    def shifted(b):
        return lambda x, weight, eps, offset=0.0: b.kernels.rmsnorm(x, weight, eps + 0.5, offset)

    plugin.add_kernel(Kernel("rmsnorm", "cuda", "test.shifted", build=shifted))
    problems = check_plugin_kernels(registry, backend)
    assert problems and "test.shifted" in problems[0]


def test_the_gemv_kernels_match_the_references(backend):
    from metrale.ops.builtin import gemv_kernels

    registry = builtin_registry()
    for kernel in gemv_kernels():
        assert check_kernel(registry, kernel, backend) == []
