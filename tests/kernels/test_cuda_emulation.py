"""The CUDA emulation itself (``cuda_emulation.h``): barriers order the threads of a block, and a
block whose threads all wait for something that never comes fails at once, saying what they wait
for, where the GPU would hang."""

from __future__ import annotations

import subprocess

import pytest
from emulation import build_emulated

PROGRAM = r"""
#include <string>

// Block sum through shared memory: every thread writes its value, waits, then thread 0 adds them.
__global__ void block_sum(const int* values, int* out) {
    __shared__ int slots[256];
    slots[threadIdx.x] = values[blockIdx.x * blockDim.x + threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) {
        int sum = 0;
        for (unsigned t = 0; t < blockDim.x; ++t) sum += slots[t];
        out[blockIdx.x] = sum;
    }
}

// Thread 5 leaves before the barrier the others wait at.
__global__ void missing_arrival() {
    if (threadIdx.x == 5) return;
    __syncthreads();
}

// The second warpgroup asks for registers that the first never releases (no setmaxnreg.dec).
__global__ void registers_never_released() {
    if (threadIdx.x >= 128) registers_increase<232>();
}

// The first warpgroup releases them: both go on (384 threads start with 168 registers each; 128
// threads giving 128 each cover 256 threads taking 64 each).
__global__ void registers_released() {
    if (threadIdx.x < 128) registers_decrease<40>();
    else registers_increase<232>();
}

int main(int argc, char** argv) {
    const std::string which = argv[1];
    if (which == "sum") {
        std::vector<int> values(3 * 256), out(3, -1);
        for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<int>(i % 7) - 3 + static_cast<int>(i / 256);
        emu::launch({3, 1, 1}, {256, 1, 1}, [&] { block_sum(values.data(), out.data()); });
        std::printf("%d %d %d\n", out[0], out[1], out[2]);
    } else if (which == "missing") {
        emu::launch({1, 1, 1}, {64, 1, 1}, [&] { missing_arrival(); });
    } else if (which == "never") {
        emu::launch({1, 1, 1}, {384, 1, 1}, [&] { registers_never_released(); });
    } else if (which == "released") {
        emu::launch({1, 1, 1}, {384, 1, 1}, [&] { registers_released(); });
        std::printf("done\n");
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    return build_emulated(tmp_path_factory.mktemp("emulation") / "emulation.cpp", PROGRAM)


def run(program, which):
    return subprocess.run([str(program), which], capture_output=True, text=True, timeout=60)


def test_a_barrier_orders_the_threads_of_each_block(program):
    result = run(program, "sum")
    assert result.returncode == 0, result.stderr
    values = [(i % 7) - 3 + i // 256 for i in range(3 * 256)]
    assert result.stdout.split() == [str(sum(values[256 * b:256 * (b + 1)])) for b in range(3)]


def test_a_barrier_some_threads_never_reach_fails_at_once(program):
    result = run(program, "missing")
    assert result.returncode != 0
    assert "every thread of the block waits" in result.stderr and "barrier" in result.stderr


def test_registers_never_released_fail_at_once_and_released_ones_are_taken(program):
    result = run(program, "never")
    assert result.returncode != 0
    assert "setmaxnreg.inc" in result.stderr and "every thread of the block waits" in result.stderr
    result = run(program, "released")
    assert result.returncode == 0 and result.stdout.strip() == "done", result.stderr
