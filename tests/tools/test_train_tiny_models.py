"""The tiny-model training script is reproducible from its seed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train_tiny_models.py"


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus") / "corpus.json"


def train(out: Path, corpus: Path, seed: int) -> dict:
    subprocess.run(
        [sys.executable, str(SCRIPT), "--models", "tiny-dense", "--steps", "6", "--batch", "2", "--seq-len", "32",
         "--eval-every", "3", "--vocab-size", "400", "--max-docs", "300", "--seed", str(seed),
         "--out-dir", str(out), "--corpus-file", str(corpus)],
        check=True, capture_output=True, text=True,
    )
    return json.loads((out / "tiny-dense" / "training.json").read_text())


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, corpus_file):
    """(output folder, training record) of one run with seed 3, shared by the tests below."""
    out = tmp_path_factory.mktemp("first")
    return out, train(out, corpus_file, seed=3)


def test_same_seed_reproduces_the_loss_curve_and_weights(tmp_path, corpus_file, first_run):
    first_out, first = first_run
    second = train(tmp_path / "b", corpus_file, seed=3)
    other = train(tmp_path / "c", corpus_file, seed=4)
    assert len(first["loss_curve"]) == 6
    assert first["loss_curve"] == second["loss_curve"]
    assert first["held_out_evals"] == second["held_out_evals"]
    assert first["loss_curve"] != other["loss_curve"]
    weights = [(out / "tiny-dense" / "model.safetensors").read_bytes() for out in (first_out, tmp_path / "b")]
    assert weights[0] == weights[1]


def test_checkpoint_is_complete_and_loads(first_run):
    from metrale import LLM

    folder = first_run[0] / "tiny-dense"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md"):
        assert (folder / name).is_file(), name
    llm = LLM(folder, device="cpu", show_progress=False)
    assert llm.encode("Return the")[0] == llm.eos_token_ids[0]
    assert "unigram baseline perplexity" in (folder / "README.md").read_text()
