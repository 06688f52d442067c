"""Host time of one numba kernel launch, taken apart (diagnostic, GPU only).

    python tools/profiling/launch_overhead.py [--launches 2000]

The kernels launch through :class:`metrale.kernels._device.DirectKernel` (CuPy's launcher over
numba's compiled image); one row takes numba's own launcher for comparison.

Launches the RMSNorm kernel on one 2048-wide row (so the GPU work is negligible and the host is
the bottleneck) in several ways and prints the host microseconds per launch of each: the full
launcher as the engine runs it (argument checks, then the stream wrapper and device views that
:mod:`metrale.kernels._device` keeps and reuses, then dispatch); the kernel call with a fresh
stream wrapper and fresh views each time; with only the stream wrapper made once; with both
made once; and the compiled overload's ``launch`` called directly. Then the parts alone (one
fresh view, one reused view, one fresh stream wrapper, one ``check_array``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/timing.py is shared by the profiling tools and the sweeps

from timing import host_time  # noqa: E402


def per_call_us(function, launches: int, synchronize) -> float:
    """Host microseconds per call of ``function`` over ``launches`` calls (after a warm-up); the
    stream is synchronised before and after, outside the clock, so only the launches count."""
    return host_time(function, warmup=20, repeats=1, calls=launches, synchronize=synchronize).median_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=2000)
    args = parser.parse_args()

    import cupy as cp
    from numba import cuda

    from metrale.backends.cuda import CudaBackend
    from metrale.kernels import rmsnorm
    from metrale.kernels._device import check_array, device_view, new_device_view, numba_stream

    backend = CudaBackend()
    stream = backend.stream
    hidden = 2048
    x = cp.asarray(np.random.default_rng(0).standard_normal((1, hidden)).astype(np.float32))
    residual = cp.zeros_like(x)
    weight = cp.full(hidden, 0x3F80, dtype=np.uint16)  # bf16 1.0
    out = cp.zeros((1, hidden), dtype=np.uint16)
    kernel = rmsnorm.rmsnorm_residual_kernel
    grid, block = 1, rmsnorm.NORM_THREADS
    scalars = (np.float32(1e-6), np.float32(0.0), np.int32(1))

    def full_launcher():
        rmsnorm.rmsnorm_residual(x, residual, weight, 1e-6, 0.0, True, out, stream)

    def fresh_wrappers():
        kernel[grid, block, cuda.external_stream(stream.ptr)](
            new_device_view(x), new_device_view(residual), new_device_view(weight), *scalars, new_device_view(out)
        )

    numba_side = numba_stream(stream)

    def stream_made_once():
        kernel[grid, block, numba_side](
            new_device_view(x), new_device_view(residual), new_device_view(weight), *scalars, new_device_view(out)
        )

    views = (device_view(x), device_view(residual), device_view(weight))
    out_view = device_view(out)

    def views_made_once():
        kernel[grid, block, numba_side](*views, *scalars, out_view)

    # The kernels launch through metrale.kernels._device.DirectKernel; its dispatcher is numba's.
    numba_kernel = getattr(kernel, "dispatcher", kernel)

    def numba_launcher():
        numba_kernel[grid, block, numba_side](*views, *scalars, out_view)

    def cupy_arrays():
        kernel[grid, block, numba_side](x, residual, weight, *scalars, out)

    full_launcher()
    overload = next(iter(kernel.overloads.values()))
    arguments = (*views, *scalars, out_view)

    def overload_launch():
        overload.launch(arguments, (grid, 1, 1), (block, 1, 1), numba_side, 0)

    synchronize = stream.synchronize
    with backend.activate():
        rows = [
            ("full launcher (checks, reused views and stream)", full_launcher),
            ("kernel call, fresh views and stream wrapper", fresh_wrappers),
            ("... with the stream wrapper made once", stream_made_once),
            ("... and the device views made once", views_made_once),
            ("the same through numba's own launcher", numba_launcher),
            ("kernel call with the CuPy arrays themselves", cupy_arrays),
            ("compiled overload's launch, views made once", overload_launch),
            ("one fresh device view alone", lambda: new_device_view(x)),
            ("one reused device view alone", lambda: device_view(x)),
            ("one fresh stream wrapper alone", lambda: cuda.external_stream(stream.ptr)),
            ("one check_array alone", lambda: check_array("op", "x", x, np.float32, (1, hidden))),
        ]
        for label, function in rows:
            print(f"{label:52s} {per_call_us(function, args.launches, synchronize):8.1f} us")


if __name__ == "__main__":
    main()
