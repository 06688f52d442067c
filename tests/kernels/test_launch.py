"""Dependent launches (``metrale.kernels._launch``) without a GPU: the driver structures have the
layout of ``cuda.h``, arguments become the C values a kernel takes, and a launch that is not
dependent goes through the kernel's own call on the given stream."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from metrale.errors import KernelArgumentError
from metrale.kernels import _launch


def test_the_driver_structures_have_the_layout_of_cuda_h():
    # CUlaunchAttribute: an int id padded to 8 bytes, then a 64-byte union.
    assert ctypes.sizeof(_launch.LaunchAttribute) == 72
    assert _launch.LaunchAttribute.value.offset == 8
    # CUlaunchConfig: seven unsigned ints, the stream at 32, the attributes at 40, their count at 48.
    assert ctypes.sizeof(_launch.LaunchConfig) == 56
    assert _launch.LaunchConfig.stream.offset == 32
    assert _launch.LaunchConfig.attributes.offset == 40
    assert _launch.LaunchConfig.attribute_count.offset == 48


class FakeDeviceArray:
    class data:  # noqa: N801 (the shape of a CuPy array's ``data``)
        ptr = 0x7F0000001000


def test_arguments_become_c_values():
    pointer = _launch.kernel_argument(FakeDeviceArray())
    assert isinstance(pointer, ctypes.c_void_p) and pointer.value == 0x7F0000001000
    assert ctypes.sizeof(_launch.kernel_argument(np.int32(-3))) == 4
    assert _launch.kernel_argument(np.int32(-3)).value == -3
    assert _launch.kernel_argument(np.float32(0.5)).value == 0.5
    assert _launch.kernel_argument(np.uint64(0)).value == 0
    with pytest.raises(KernelArgumentError, match="got int"):
        _launch.kernel_argument(3)  # a Python int has no C type of its own


def test_a_launch_that_is_not_dependent_calls_the_kernel_on_the_stream():
    calls = []

    class Stream:
        def __enter__(self):
            calls.append("enter")

        def __exit__(self, *exc):
            calls.append("exit")

    def kernel(grid, block, args, shared_mem=0):
        calls.append((grid, block, args, shared_mem))

    _launch.launch(kernel, (3,), (64,), (np.int32(1),), 128, Stream(), dependent=False)
    assert calls == ["enter", ((3,), (64,), (np.int32(1),), 128), "exit"]


def test_a_kernel_named_independent_is_launched_in_stream_order(monkeypatch):
    calls = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __call__(self, grid, block, args, shared_mem=0):
            calls.append(self.name)

    def driver_launch():
        calls.append("driver")
        raise RuntimeError("a dependent launch")

    monkeypatch.setattr(_launch, "dependent_launch_available", lambda: True)
    monkeypatch.setattr(_launch, "_launch_function", driver_launch)
    monkeypatch.setattr(_launch, "INDEPENDENT", frozenset({"norm"}))
    _launch.launch(Kernel("norm"), (1,), (32,), (), 0, None, dependent=True)
    assert calls == ["norm"]  # not the driver's dependent launch
    monkeypatch.setattr(_launch, "INDEPENDENT", frozenset({"gemv"}))
    _launch.launch(Kernel("gemv<0, true, 4, 8>"), (1,), (32,), (), 0, None, dependent=True)
    assert calls == ["norm", "gemv<0, true, 4, 8>"]  # a template instance goes by its template's name


def test_a_dependent_launch_sets_the_shared_carveout_once(monkeypatch):
    import sys
    import types

    class Stream:
        ptr = 0

    fake_cupy = types.ModuleType("cupy")
    fake_cupy.cuda = types.SimpleNamespace(get_current_stream=lambda: Stream())
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    launched = []

    def driver_launch():
        return lambda config, function, arguments, extra: launched.append(function) or 0

    class Kernel:
        name = "gemv"
        kernel = types.SimpleNamespace(ptr=1234)

        def __init__(self):
            self.carveouts = []

        def __setattr__(self, key, value):
            if key == "preferred_shared_memory_carveout":
                self.carveouts.append(value)
            object.__setattr__(self, key, value)

    monkeypatch.setattr(_launch, "dependent_launch_available", lambda: True)
    monkeypatch.setattr(_launch, "_launch_function", driver_launch)
    monkeypatch.setattr(_launch, "SHARED_CARVEOUT", 100)
    monkeypatch.setattr(_launch, "_carveouts", {})
    kernel = Kernel()
    for _ in range(2):
        _launch.launch(kernel, (2,), (128,), (np.int32(1),), 0, None, dependent=True)
    assert launched == [1234, 1234] and kernel.carveouts == [100]
    monkeypatch.setattr(_launch, "SHARED_CARVEOUT", 50)
    _launch.launch(kernel, (2,), (128,), (np.int32(1),), 0, None, dependent=True)
    assert kernel.carveouts == [100, 50]
