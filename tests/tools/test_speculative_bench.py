"""tools/sweeps/speculative_bench.py on the CPU, at a tiny size: every part runs and its numbers hold
together (an oracle's drafts are all kept, n-gram speculation changes no output)."""

from __future__ import annotations

import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS / "checkpoints"))  # train_tiny_models.py, whose MTP module the mtp test trains
sys.path.insert(0, str(TOOLS / "sweeps"))

import speculative_bench  # noqa: E402


def test_every_part_runs_on_a_tiny_model(tmp_path):
    output = tmp_path / "spec.json"
    report = speculative_bench.main([
        "--device", "cpu", "--checkpoint", "tiny-dense", "--k", "1,3", "--context", "24", "--steps", "2",
        "--max-tokens", "12", "--tiny", "tiny-dense", "--prompts", "2", "--output", str(output)])
    assert output.exists()
    costs = report["verify_seconds"]
    assert set(costs) == {"decode", "verify_k1", "verify_k3"} and all(v > 0 for v in costs.values())
    oracle = report["oracle"]
    assert oracle["k"] == 3 and oracle["tokens_agreeing"] == 12
    assert oracle["accepted"] == oracle["drafted"] > 0  # every token of the oracle is the target's
    ngram = report["ngram"]["tiny-dense"]
    assert ngram["same_tokens"] == ngram["prompts"] == 2
    assert ngram["accepted"] <= ngram["drafted"]
    assert ngram["verify_steps"] == 0 or 1 <= ngram["tokens_per_verify"] <= 4  # K = 3: at most 3 kept, 1 added


def test_the_mtp_part_runs_on_tiny_mla_with_a_module(tmp_path):
    """The ``mtp`` part on a copy of tiny-mla given an (untrained, perturbed) MTP module."""
    import json
    import shutil

    import torch
    import train_tiny_models
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM

    from metrale.loading.model import resolve_model_path
    from metrale.testing.hf import perturb_weights

    folder = tmp_path / "tiny-mla-mtp"
    shutil.copytree(resolve_model_path("tiny-mla"), folder)
    model = DeepseekV3ForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    mtp = train_tiny_models.mtp_module(model).float()
    perturb_weights(mtp, 3)
    tensors = load_file(folder / "model.safetensors")
    tensors.update(train_tiny_models.mtp_tensors(mtp.to(torch.bfloat16), model.config))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    report = speculative_bench.main(["--device", "cpu", "--parts", "mtp", "--mtp-models", str(folder),
                                     "--max-tokens", "10", "--prompts", "2"])
    numbers = report["mtp"][str(folder)]
    assert numbers["same_tokens"] == numbers["prompts"] == 2
    assert numbers["drafted"] > 0 and numbers["accepted"] <= numbers["drafted"]
    assert numbers["verify_steps"] * 3 >= numbers["drafted"] and 1 <= numbers["tokens_per_verify"] <= 4
    assert "ngram" not in report and "verify_seconds" not in report


def test_a_recurrent_model_s_verify_is_timed_with_and_without_row_states():
    report = speculative_bench.main(["--device", "cpu", "--checkpoint", "tiny-gdn", "--parts", "verify", "--k", "2",
                                     "--context", "16", "--steps", "2"])
    costs = report["verify_seconds"]
    assert set(costs) == {"decode", "verify_k2", "prompt_rows_k2"} and all(v > 0 for v in costs.values())
