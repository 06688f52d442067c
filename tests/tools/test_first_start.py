"""tools/profiling/first_start.py's start probe, its processes stood in for: each cold run starts
from empty compilation caches (all moved under the scratch folder), the warm run follows it with
what the cold run left, and a failed run is reported."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "profiling" / "first_start.py"


@pytest.fixture(scope="module")
def first_start():
    spec = importlib.util.spec_from_file_location("metrale_tools_first_start", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cold_runs_start_from_empty_caches_and_warm_runs_reuse_them(first_start, monkeypatch, tmp_path):
    scratch = tmp_path / "caches"
    seen = []

    def run(command, env, capture_output, text):
        folders = {variable: Path(env[variable]) for variable in first_start.CACHES}
        assert all(folder.parent == scratch for folder in folders.values())
        # What this process finds, then a cache file it leaves.
        seen.append(sorted(p.name for folder in folders.values() if folder.exists() for p in folder.iterdir()))
        for variable, folder in folders.items():
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{variable}-{len(seen)}").write_text("compiled")
        assert command[command.index("generate") + 1:command.index("generate") + 5] == [
            "--model", "tiny-dense", "--device", "cuda"]
        return types.SimpleNamespace(returncode=0, stdout="Return the w1", stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    times = first_start.time_starts("tiny-dense", 2, scratch, None)
    assert [len(times["cold"]), len(times["warm"])] == [2, 2]
    # cold 1 finds nothing; warm 1 finds cold 1's files; cold 2 nothing again; warm 2 cold 2's.
    assert [len(found) for found in seen] == [0, 3, 0, 3]
    assert all(name.endswith("-3") for name in seen[3])


def test_a_failed_run_is_reported(first_start, monkeypatch, tmp_path):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=1, stdout="",
                                                                                   stderr="no CUDA device"))
    with pytest.raises(SystemExit, match="failed \\(cold\\):\nno CUDA device"):
        first_start.time_starts("tiny-dense", 1, tmp_path / "caches", None)


def test_a_profiled_run_goes_through_cprofile(first_start, tmp_path):
    command = first_start.generate_command("tiny-dense", tmp_path / "cold-0.prof")
    assert command[:5] == [sys.executable, "-m", "cProfile", "-o", str(tmp_path / "cold-0.prof")]
    assert command[5:8] == ["-m", "metrale", "generate"]
