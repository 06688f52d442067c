"""Plugin CUDA kernels for the kernel-check tests: a right one, a wrong one, one numba cannot
compile, one the simulator cannot run, and conditional ones. Each ``*_manager`` function builds a
plugin manager holding one of them (the checks' child processes import them by name)."""

from __future__ import annotations

import numpy as np
from numba import cuda

from metrale import hookimpl
from metrale.model.plugin_manager import get_plugin_manager
from metrale.ops import Kernel, Op, Operand
from metrale.ops import plugin_kernels as pk


def squared_relu(x):
    return np.square(np.maximum(np.asarray(x, dtype=np.float32), 0))


SQUARED_RELU = Op(
    "sample_squared_relu", "``relu(x) ** 2``.",
    parameters=(Operand("x", "[N, H]", "activation"),),
    results=(Operand("y", "[N, H]", "matmul_input"),),
    reference=squared_relu,
    examples=lambda rng: [{"x": rng.standard_normal((3, 40)).astype(np.float32)}],
)

THREADS = 32


@pk.jit_kernel
def squared_relu_kernel(x, y):
    # One thread per element of the flattened x [n] f32; y [n] bf16 bits.
    i = cuda.grid(1)
    if i < x.shape[0]:
        value = max(x[i], np.float32(0.0))
        y[i] = pk.float_to_bf16(value * value)


@pk.jit_kernel
def shifted_kernel(x, y):
    i = cuda.grid(1)
    if i < x.shape[0]:
        value = max(x[i], np.float32(0.0))
        y[i] = pk.float_to_bf16(value * value + np.float32(0.25))


@pk.jit_kernel
def listing_kernel(x, y):
    # Runs under the simulator (Python), but numba cannot compile a list in a kernel.
    i = cuda.grid(1)
    if i < x.shape[0]:
        values = [max(x[i], np.float32(0.0))]
        y[i] = pk.float_to_bf16(values[0] * values[0])


def launcher(kernel):
    def build(backend):
        def run(x):
            pk.check_operand("sample_squared_relu", "x", x, "activation", ndim=2)
            y = backend.xp.empty(x.shape, dtype=np.uint16)
            pk.launch(kernel, pk.blocks(x.size, THREADS), THREADS, (x.reshape(-1), y.reshape(-1)), backend)
            return y

        return run

    return build


def cupy_build(backend):
    import cupy  # a CuPy RawKernel: nothing numba's simulator can run

    kernel = cupy.RawKernel("extern \"C\" __global__ void k() {}", "k")
    return lambda x: pk.launch(kernel, 1, 1, (x,), backend)


def wide_rows(x):
    return x.shape[1] >= 64


def wide_examples(rng):
    return [{"x": rng.standard_normal((2, 64)).astype(np.float32)}]


KERNELS = {
    "good": Kernel("sample_squared_relu", "cuda", "samples.squared_relu", build=launcher(squared_relu_kernel)),
    "wrong": Kernel("sample_squared_relu", "cuda", "samples.shifted", build=launcher(shifted_kernel)),
    "listing": Kernel("sample_squared_relu", "cuda", "samples.listing", build=launcher(listing_kernel)),
    "cupy": Kernel("sample_squared_relu", "cuda", "samples.cupy", build=cupy_build),
    "unreached": Kernel("sample_squared_relu", "cuda", "samples.wide", build=launcher(squared_relu_kernel),
                        when=wide_rows, condition="H >= 64"),
    "reached": Kernel("sample_squared_relu", "cuda", "samples.wide", build=launcher(squared_relu_kernel),
                      when=wide_rows, condition="H >= 64", examples=wide_examples),
}


class SamplePlugin:
    METRALE_CONTRACT_VERSION = "1.3"

    def __init__(self, *kernels):
        self.kernels = kernels

    @hookimpl
    def metrale_register_ops(self, registry):
        registry.declare(SQUARED_RELU)
        for name in self.kernels:
            registry.add_kernel(KERNELS[name])


def manager(*kernels):
    plugins = get_plugin_manager(entry_points=False)
    plugins.register(SamplePlugin(*kernels), name="samples")
    return plugins


def good_manager():
    return manager("good")


def wrong_manager():
    return manager("wrong")


def listing_manager():
    return manager("listing")


def mixed_manager():
    return manager("good", "cupy", "listing")
