"""tools/profiling/kernel_times.py: reading Nsight Compute's CSV report (units scaled, kernels in launch
order, a missing metric as zero) and the tables it prints."""

from __future__ import annotations

import io

import pytest
from tool_module import load_tool

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def row(kernel_id, name, metric, unit, value, grid="(132, 1, 1)"):
    return (f'"{kernel_id}","1","python3","host","{name}","1","13","(256, 1, 1)","{grid}","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


@pytest.fixture(scope="module")
def kernel_times():
    return load_tool("profiling/kernel_times.py", "metrale_tools_kernel_times")


def test_the_report_is_read_in_launch_order_with_units_scaled(kernel_times):
    text = "\n".join([
        "==PROF== Connected to process 1",  # ncu's own lines are not CSV rows
        HEADER,
        row(10, "decode_attention_mma", "gpu__time_duration.sum", "usecond", "10.5", "(1, 8, 12)"),
        row(2, "void decode_gemv<0, false, 8, 4>(const void *)", "dram__bytes_read.sum", "Mbyte", "8.4"),
        row(2, "void decode_gemv<0, false, 8, 4>(const void *)", "gpu__time_duration.sum", "nsecond", "4,200"),
        row(2, "void decode_gemv<0, false, 8, 4>(const void *)", "dram__bytes_write.sum", "byte", "8,192"),
    ])
    kernels = kernel_times.parse_report(text)
    assert [k["name"].split("<")[0] for k in kernels] == ["void decode_gemv", "decode_attention_mma"]  # by ID
    gemv, attention = kernels
    assert gemv["seconds"] == pytest.approx(4.2e-6) and gemv["read"] == pytest.approx(8.4e6)
    assert gemv["written"] == pytest.approx(8192)
    assert attention["seconds"] == pytest.approx(10.5e-6) and attention["read"] == 0.0  # no bytes reported
    assert attention["grid"] == "(1, 8, 12)"


def test_the_tables_group_kernels_by_name(kernel_times):
    kernels = [dict(name="void decode_gemv<1, true, 2, 4>(int)", seconds=20e-6, read=60e6, written=0.0, grid="(256, 1, 1)",
                    block="(256, 1, 1)"),
               dict(name="void decode_gemv<0, false, 8, 4>(int)", seconds=10e-6, read=20e6, written=0.0, grid="(128, 1, 1)",
                    block="(256, 1, 1)"),
               dict(name="rmsnorm_residual_words", seconds=2e-6, read=0.0, written=0.0, grid="(1, 1, 1)",
                    block="(256, 1, 1)")]
    out = io.StringIO()
    kernel_times.report(kernels, out)
    text = out.getvalue()
    assert text.startswith("3 kernels, 0.032 ms in all, 0.080 GB moved (2500 GB/s)")
    grouped = text.split("\n\n")[1].splitlines()
    assert grouped[1].split()[:6] == ["void", "decode_gemv", "2", "15.0", "30.0", "93.8%"]
    assert grouped[1].split()[6] == "2667"  # 80 MB over 30 us
