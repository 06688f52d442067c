"""NVRTC compilation for sm_90a (metrale.kernels._compile): a kernel's cubin, an error with
NVRTC's log for a source that does not compile, and the on-disk cache (a second compilation of the
same source reads the cubin back; another architecture, option or source compiles anew; a damaged
entry is compiled again)."""

from __future__ import annotations

import pytest

from metrale.errors import KernelArgumentError
from metrale.kernels import _compile, attention_hopper


@pytest.fixture
def nvrtc():
    try:
        _compile.nvrtc_library()
    except KernelArgumentError:
        pytest.skip("no NVRTC library in this environment")


def test_a_kernel_compiles_to_an_sm_90a_cubin(nvrtc, tmp_path):
    cubin = _compile.compile_cubin(attention_hopper.kernel_source(64, 64), "sm_90a", cache=tmp_path)
    assert cubin[:4] == b"\x7fELF"
    assert b"prefill_attention_wgmma" in cubin


def test_a_source_that_does_not_compile_raises_with_the_log(nvrtc, tmp_path):
    with pytest.raises(KernelArgumentError, match="expected a declaration"):
        _compile.compile_cubin("this is not C++", "sm_90a", cache=tmp_path)
    assert not list(tmp_path.iterdir())


def test_the_cache_serves_a_second_compilation(nvrtc, tmp_path, monkeypatch):
    source = 'extern "C" __global__ void scale_by_two(float* x) { x[threadIdx.x] *= 2.0f; }'
    first = _compile.compile_cubin(source, "sm_90a", cache=tmp_path)
    assert len(list(tmp_path.glob("*.cubin"))) == 1

    def no_compiler(*arguments):
        raise AssertionError("compiled although the cache holds the cubin")

    monkeypatch.setattr(_compile, "_compile", no_compiler)
    assert _compile.compile_cubin(source, "sm_90a", cache=tmp_path) == first
    monkeypatch.undo()
    # Another architecture, other options, another source: entries of their own.
    _compile.compile_cubin(source, "sm_90", cache=tmp_path)
    _compile.compile_cubin(source, "sm_90a", ("--std=c++17",), cache=tmp_path)
    _compile.compile_cubin(source.replace("2.0f", "3.0f"), "sm_90a", cache=tmp_path)
    assert len(list(tmp_path.glob("*.cubin"))) == 4
    assert not list(tmp_path.glob("*.part"))


def test_a_damaged_entry_is_compiled_again(nvrtc, tmp_path):
    source = 'extern "C" __global__ void add_one(float* x) { x[threadIdx.x] += 1.0f; }'
    first = _compile.compile_cubin(source, "sm_90a", cache=tmp_path)
    (entry,) = tmp_path.glob("*.cubin")
    entry.write_bytes(b"garbage")
    assert _compile.compile_cubin(source, "sm_90a", cache=tmp_path) == first
    assert entry.read_bytes() == first


def test_the_cache_folder_follows_the_environment(tmp_path):
    from metrale.config import kernel_cache_folder, read_environment

    assert kernel_cache_folder({"METRALE_KERNEL_CACHE": str(tmp_path / "kernels")}) == str(tmp_path / "kernels")
    assert kernel_cache_folder({"XDG_CACHE_HOME": str(tmp_path / "xdg")}) == str(tmp_path / "xdg" / "metrale" / "kernels")
    assert kernel_cache_folder({"HOME": str(tmp_path)}).endswith("/.cache/metrale/kernels")
    assert read_environment({"METRALE_KERNEL_CACHE": "/k"}).kernel_cache == "/k"


def test_without_a_cache_folder_nothing_is_kept(nvrtc, tmp_path, monkeypatch):
    monkeypatch.setattr(_compile, "CACHE_DIR", None)
    monkeypatch.chdir(tmp_path)
    cubin = _compile.compile_cubin('extern "C" __global__ void noop() {}', "sm_90a")
    assert cubin[:4] == b"\x7fELF"
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(_compile, "CACHE_DIR", tmp_path / "kept")
    _compile.compile_cubin('extern "C" __global__ void noop() {}', "sm_90a")
    assert len(list((tmp_path / "kept").glob("*.cubin"))) == 1
