"""Checking plugin CUDA kernels without a GPU: under numba's CUDA simulator (here, and in a child
process for a suite that imported numba without it), and compiled for sm_90 with NVVM; a kernel
that could not be checked at all is a problem named like a wrong one."""

from __future__ import annotations

import pytest
from kernel_samples import manager

from metrale.errors import KernelMismatchError
from metrale.ops import build_op_registry
from metrale.testing import kernel_check
from metrale.testing.kernel_check import SimulatedCudaBackend, run_check, simulate_kernels

pytestmark = pytest.mark.skipif(not kernel_check.simulator_enabled(), reason="the CPU suite runs kernels simulated")


def simulated(*kernels, skip=()):
    return simulate_kernels(build_op_registry(manager(*kernels)), skip)


def test_a_right_kernel_passes_and_a_wrong_one_is_named():
    report = simulated("good")
    assert report.checked == ["samples.squared_relu"] and report.problems == []
    [problem] = simulated("wrong").problems
    assert problem.startswith("kernel 'samples.shifted' (samples, cuda): sample_squared_relu example 0 result 0: "
                              "relative error")


def test_a_kernel_the_simulator_cannot_run_fails_loudly_unless_left_out():
    [problem] = simulated("good", "cupy").problems
    assert problem.startswith("kernel 'samples.cupy' (samples, cuda): ") and "raised" in problem
    report = simulated("good", "cupy", skip=("samples.cupy",))
    assert report.problems == [] and report.skipped == ["samples.cupy"]


def test_a_kernel_no_example_reaches_is_not_passed_silently():
    [problem] = simulated("unreached").problems
    assert "samples.wide" in problem and "its condition (H >= 64) accepts none of the examples" in problem
    assert simulated("reached").problems == []


def test_the_simulated_backend_holds_what_the_cuda_backend_holds():
    import numpy as np

    backend = SimulatedCudaBackend()
    weight = backend.weight(np.array([[1.0, -2.5]], np.float32))
    assert backend.name == "cuda" and weight.dtype == np.uint16 and weight.tolist() == [[0x3F80, 0xC020]]
    assert backend.constant(np.array([1], np.float64)).dtype == np.float32
    assert backend.xp.asnumpy(weight) is not None and not backend.stream.is_capturing()
    with pytest.raises(Exception, match="no built-in CUDA kernels"):
        backend.kernels


def test_the_check_runs_in_a_child_where_numba_runs_no_simulator(monkeypatch):
    monkeypatch.setattr(kernel_check, "simulator_enabled", lambda: False)
    report = run_check("simulated", source="kernel_samples:wrong_manager")
    assert report.checked == ["samples.shifted"]
    assert len(report.problems) == 1 and "relative error" in report.problems[0]
    missing = run_check("simulated", source="kernel_samples:good_manager", expect=["samples.squared_relu", "other.k"])
    assert [p for p in missing.problems] == [
        "kernel 'other.k' was not checked: the simulated check found no such plugin CUDA kernel (the check builds the "
        "installed plugins' registry; is the plugin installed, with its entry point?)"
    ]


def test_a_child_that_cannot_report_is_a_problem():
    report = run_check("compiled", source="no_such_module:registry")
    assert len(report.problems) == 1 and "did not report" in report.problems[0]
    assert "ModuleNotFoundError" in report.problems[0]


def test_kernels_are_compiled_for_sm_90_and_a_construct_numba_cannot_compile_is_named():
    good = run_check("compiled", source="kernel_samples:good_manager")
    if good.unavailable is not None:
        pytest.skip(good.unavailable)
    assert good.checked == ["samples.squared_relu"] and good.problems == []
    # The simulator runs the listing kernel (Python lists work there); numba cannot compile it.
    assert simulated("listing").problems == []
    [problem] = run_check("compiled", source="kernel_samples:listing_manager").problems
    assert problem.startswith("kernel 'samples.listing' (samples, compiled for sm_90): sample_squared_relu example 0: "
                              "raised")
    assert "listing_kernel" in problem or "build_list" in problem


def test_the_conformance_kit_runs_cuda_only_kernels_without_a_gpu(monkeypatch):
    from metrale.model import plugin_manager
    from metrale.testing.conformance import FamilyConformance

    monkeypatch.setattr(plugin_manager, "get_plugin_manager", lambda: manager("wrong"))
    with pytest.raises(KernelMismatchError, match=r"samples\.shifted.*relative error(.|\n)*unchecked_kernels"):
        FamilyConformance().test_plugin_kernels_match_their_references()
    monkeypatch.setattr(plugin_manager, "get_plugin_manager", lambda: manager("good", "cupy"))
    with pytest.raises(KernelMismatchError, match=r"samples\.cupy"):
        FamilyConformance().test_plugin_kernels_match_their_references()

    class LeavesCupyOut(FamilyConformance):
        unchecked_kernels = {"samples.cupy": "a CuPy RawKernel"}

    LeavesCupyOut().test_plugin_kernels_match_their_references()

    class Stale(FamilyConformance):
        unchecked_kernels = {"samples.gone": "renamed"}

    with pytest.raises(AssertionError, match=r"unchecked_kernels names \['samples.gone'\], which no plugin registers"):
        Stale().test_plugin_kernels_match_their_references()
    # The compile check runs in a child, which finds only installed plugins: a kernel it cannot
    # find fails, named, rather than passing unchecked.
    with pytest.raises(AssertionError, match=r"kernel 'samples.squared_relu' was not checked"):
        LeavesCupyOut().test_plugin_cuda_kernels_compile()
