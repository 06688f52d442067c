"""The decode path is short: from ``LLM.generate`` to the attention op's implementation on a CPU
decode step, at most 13 Python frames (pluggy's three included) in at most 8 files (pluggy's
counted as one), and the architecture page states the path the code takes."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from metrale import LLM, SamplingParams

DOCS = Path(__file__).resolve().parents[2] / "docs" / "architecture.rst"
MAX_FRAMES, MAX_FILES = 13, 8


def _where(filename: str) -> str:
    """A frame's file as the architecture page names it: ``pluggy`` for pluggy's files, else
    the path from the package (``metrale/...``, ``plugins/...`` as installed)."""
    path = Path(filename)
    if "pluggy" in path.parts:
        return "pluggy"
    text = path.as_posix()
    # Installed, the repository's plugins/ and kernels/ are metrale/plugins/ and metrale/kernels/:
    # named here as the repository names them.
    for folder in ("/metrale/plugins/", "/metrale/kernels/", "/plugins/", "/kernels/", "/metrale/"):
        if folder in text:
            inside = text[text.rindex(folder) + 1:]
            return inside[len("metrale/"):] if folder.startswith("/metrale/") and folder != "/metrale/" else inside
    return path.name


@pytest.fixture(scope="module")
def decode_path():
    """``(file, function)`` of every frame from ``LLM.generate`` to the caller of the CPU
    ``paged_attention`` in a decode step."""
    llm = LLM("tiny-dense", device="cpu", show_progress=False)
    original = llm.backend.ops.paged_attention
    stacks: list[list[inspect.FrameInfo]] = []

    def recording(*args, **kwargs):
        stacks.append(inspect.stack()[1:])
        return original(*args, **kwargs)

    llm.backend.ops.paged_attention = recording
    try:
        llm.generate(["Return the"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    finally:
        llm.close()
    decode = [stack for stack in stacks if any(frame.function == "metrale_decode_batch" for frame in stack)]
    assert decode, "no decode step reached paged_attention"
    stack = decode[0]
    top = next(index for index, frame in enumerate(stack) if frame.function == "generate"
               and _where(frame.filename).endswith("entrypoints/llm.py"))
    return [(_where(frame.filename), frame.function) for frame in reversed(stack[: top + 1])]


def test_the_decode_path_is_at_most_13_frames_in_8_files(decode_path):
    files = {where for where, _ in decode_path}
    listing = "\n".join(f"{where} {function}" for where, function in decode_path)
    assert len(decode_path) <= MAX_FRAMES, f"{len(decode_path)} frames:\n{listing}"
    assert len(files) <= MAX_FILES, f"{len(files)} files: {sorted(files)}"


def test_the_architecture_page_states_the_path(decode_path):
    """The numbered list under "The path of a decode step" names each frame's file and function."""
    text = DOCS.read_text()
    section = text.split("The path of a decode step", 1)[1]
    stated = re.findall(r"^\s*\d+\.\s+``([^`]+)``\s+--\s+``([^`]+)``", section, flags=re.M)
    assert stated == decode_path
