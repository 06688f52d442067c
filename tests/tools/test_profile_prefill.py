"""tools/profiling/profile_prefill.py: an op that calls others through the op table holds their
time, and only the outermost calls leave gaps between them."""

from __future__ import annotations

import pytest
from tool_module import load_tool


@pytest.fixture(scope="module")
def profile_prefill():
    return load_tool("profiling/profile_prefill.py", "metrale_tools_profile_prefill")


def test_nested_calls_are_charged_to_their_op_and_leave_no_gap(profile_prefill):
    # (call, name, outer call, start ms, stop ms) in the order the calls ended: a fused op whose
    # norm and product are op calls of their own and whose 0.5 ms between them is its own work.
    calls = [
        (0, "embedding", None, 1.0, 1.5),
        (2, "rmsnorm_residual", 1, 2.0, 2.5),
        (3, "linear", 1, 2.5, 4.5),
        (1, "rmsnorm_linear", None, 2.0, 5.0),
        (4, "linear", None, 5.5, 6.0),
    ]
    lines = {label if label.startswith("gap") else label.split(" (")[0]: (ms, label)
             for ms, label in profile_prefill.op_lines(calls, 7.0, {"rmsnorm_linear": 0.3})}
    assert lines["gap after (start)"][0] == pytest.approx(1.0)
    assert lines["gap after embedding"][0] == pytest.approx(0.5)
    assert lines["gap after rmsnorm_linear"][0] == pytest.approx(0.5)
    assert lines["gap after linear"][0] == pytest.approx(1.0)
    assert "gap after rmsnorm_residual" not in lines  # a nested call's end is inside its op
    assert lines["rmsnorm_linear"][0] == pytest.approx(3.0)
    assert "0.50 ms outside the ops it calls" in lines["rmsnorm_linear"][1]
    assert "host 0.30 ms" in lines["rmsnorm_linear"][1]
    assert lines["linear in rmsnorm_linear"][0] == pytest.approx(2.0)
    assert lines["linear"][0] == pytest.approx(0.5) and "outside" not in lines["linear"][1]
    # The outermost calls and the gaps add up to the traced run.
    top = sum(ms for name, (ms, _) in lines.items() if " in " not in name)
    assert top == pytest.approx(7.0)
