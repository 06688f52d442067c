"""The tiny-model training script is reproducible from its seed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "checkpoints" / "train_tiny_models.py"


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
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "README.md"):
        assert (folder / name).is_file(), name
    llm = LLM(folder, device="cpu", show_progress=False)
    assert llm.encode("Return the")[0] == llm.eos_token_ids[0]
    assert "unigram baseline perplexity" in (folder / "README.md").read_text()


def test_an_mtp_module_trains_and_ships_in_the_checkpoint(tmp_path, corpus_file):
    """``--mtp-steps``: a DeepSeek-V3 multi-token-prediction layer trained on the frozen tiny-mla,
    saved as ``model.layers.{num_hidden_layers}.*`` (experts one by one, as the decoder's), its
    held-out numbers recorded; the checkpoint loads."""
    from safetensors import safe_open

    from metrale import LLM

    subprocess.run(
        [sys.executable, str(SCRIPT), "--models", "tiny-mla", "--steps", "4", "--batch", "2", "--seq-len", "32",
         "--eval-every", "2", "--vocab-size", "400", "--max-docs", "300", "--seed", "3", "--mtp-steps", "3",
         "--out-dir", str(tmp_path), "--corpus-file", str(corpus_file)],
        check=True, capture_output=True, text=True,
    )
    folder = tmp_path / "tiny-mla"
    record = json.loads((folder / "training.json").read_text())
    assert record["mtp_steps"] == 3 and len(record["mtp_loss_curve"]) == 3
    assert record["mtp_held_out_perplexity"] > 1 and 0 <= record["mtp_held_out_top1"] <= 1
    layer = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    with safe_open(str(folder / "model.safetensors"), "np") as tensors:
        names = set(tensors.keys())
    prefix = f"model.layers.{layer}."
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.kv_b_proj.weight", "mlp.experts.7.up_proj.weight", "mlp.shared_experts.down_proj.weight"):
        assert prefix + name in names, name
    assert not any(n.startswith(prefix + "mlp.experts.gate_up") for n in names)
    llm = LLM(folder, device="cpu", show_progress=False)
    assert llm.model.mtp is not None and llm.checkpoint.unconsumed() == []


@pytest.mark.parametrize("name, prefix, part", [("tiny-mla", "model.layers.3.", "eh_proj.weight"),
                                                ("tiny-gdn", "mtp.", "fc.weight")])
def test_mtp_for_an_existing_checkpoint_keeps_its_weights(tmp_path, corpus_file, first_run, name, prefix, part):
    """``--mtp-for``: the MTP layer added to a copy of a shipped model, every other tensor
    unchanged, the record and the card extended (twice: the second replaces the first); the
    checkpoint still loads."""
    import shutil

    from safetensors.torch import load_file

    from metrale import LLM
    from metrale.models import embedded_model_path

    folder = tmp_path / name
    shutil.copytree(embedded_model_path(name), folder)
    before = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if not k.startswith(prefix)}
    for _ in range(2):
        subprocess.run(
            [sys.executable, str(SCRIPT), "--mtp-for", str(folder), "--mtp-steps", "2", "--batch", "2", "--seq-len", "32",
             "--max-docs", "300", "--seed", "3", "--corpus-file", str(corpus_file)],
            check=True, capture_output=True, text=True,
        )
    after = load_file(str(folder / "model.safetensors"))
    assert all(after[k].equal(v) for k, v in before.items())
    assert prefix + part in after and any(k.startswith(prefix) and ".experts.7.down_proj" in k for k in after)
    assert json.loads((folder / "training.json").read_text())["mtp_steps"] == 2
    assert (folder / "README.md").read_text().count("## Multi-token prediction") == 1
    LLM(folder, device="cpu", show_progress=False)
