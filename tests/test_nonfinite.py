"""NaN and infinity: refused in weights at load; a request whose logits are not finite finishes
with an error while the others go on; the sampler never indexes out of range."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.entrypoints.cli import main
from metrale.errors import CheckpointError, NonFiniteWeightError
from metrale.kernels.sampling import sample_reference
from metrale.loading.checkpoint import read_safetensors_header
from metrale.models import embedded_model_path

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def poison(folder, name, value_bits, index=7):
    """Overwrite element ``index`` of tensor ``name`` in ``folder``'s model.safetensors with raw
    bits (``uint16`` for bf16, ``float32`` otherwise)."""
    file = folder / "model.safetensors"
    info = read_safetensors_header(file)[name]
    data = bytearray(file.read_bytes())
    raw = np.asarray([value_bits]).astype(np.uint16 if info.dtype == "BF16" else np.float32).tobytes()
    offset = info.begin + index * len(raw)
    data[offset : offset + len(raw)] = raw
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("bits, what", [(0x7FC0, "NaN"), (0x7F80, "+inf"), (0xFF80, "-inf")])
def test_a_non_finite_bf16_weight_is_refused_at_load(tmp_path, bits, what):
    folder = tmp_path / "model"
    shutil.copytree(embedded_model_path("tiny-dense"), folder)
    name = "model.layers.2.mlp.down_proj.weight"
    poison(folder, name, bits)
    with pytest.raises(NonFiniteWeightError, match=r"down_proj.*1 NaN or infinite value") as info:
        LLM(folder, device="cpu", show_progress=False)
    assert isinstance(info.value, CheckpointError) and "layers.2" in str(info.value)


def test_a_non_finite_float32_weight_is_refused_at_load(tmp_path, dense_checkpoints):
    folder = tmp_path / "model"
    shutil.copytree(dense_checkpoints["qwen2"], folder)
    poison(folder, "model.layers.0.self_attn.q_proj.bias", np.inf, index=3)
    with pytest.raises(NonFiniteWeightError, match=r"q_proj\.bias.*index \(3,\)"):
        LLM(folder, device="cpu", show_progress=False)


def test_the_cli_refuses_a_corrupt_checkpoint_with_one_line(tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(embedded_model_path("tiny-dense"), folder)
    poison(folder, "model.embed_tokens.weight", 0x7FC0)
    assert main(["generate", "--model", str(folder), "--no-progress", "Return the"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "embed_tokens" in err


@pytest.mark.parametrize("row", [
    [0.0, np.nan, 1.0, 2.0],
    [0.0, np.inf, 1.0, 2.0],
    [-np.inf, -np.inf, -np.inf, -np.inf],
])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_sampler_marks_rows_without_a_distribution(row, temperature):
    logits = np.array([[0.5, 3.0, 1.0, -1.0], row, [1.0, -np.inf, 0.0, 4.0]], dtype=np.float32)
    rows = len(logits)
    tokens = sample_reference(
        logits, np.full(rows, temperature, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32),
        np.full(rows, 0.5, np.float32),
    )
    assert tokens[1] == -1
    if temperature == 0.0:
        assert tokens[0] == 1 and tokens[2] == 3
    assert tokens[2] != 1  # a -inf logit is never drawn


def test_non_finite_logits_fail_one_request_and_the_others_go_on(dense_checkpoints):
    prompts = [[1, 2, 3, 4], [9, 8, 7], [5, 5, 5, 5, 5]]
    reference_llm = LLM(dense_checkpoints["llama"], device="cpu", show_progress=False, block_size=4)
    reference = [o.token_ids for o in reference_llm.generate(prompts, GREEDY)]
    llm = LLM(dense_checkpoints["llama"], device="cpu", show_progress=False, block_size=4)
    victim = prompts[1]
    forward = llm.model.forward_batch
    calls = {"decode": 0}

    def poisoned(batch):
        logits = forward(batch)
        rows = [s for s in batch.segments if s.logits != "none"]
        for index, segment in enumerate(rows):
            # At one generated token the victim's forward completes its first 4-token block (with
            # overlap scheduling that token may still be pending, fed on the device).
            sampled = segment.seq.num_generated + (segment.seq.pending_token is not None)
            if segment.seq.tokens[: len(victim)] == victim and sampled == 1:
                calls["decode"] += 1
                logits[index, 17] = np.nan
        return logits

    llm.model.forward_batch = poisoned
    outputs = llm.generate(prompts, GREEDY)
    assert calls["decode"] == 1
    failed = outputs[1]
    assert failed.finish_reason == "error" and "not finite" in failed.error
    assert failed.token_ids == reference[1][:1]
    assert [outputs[0].token_ids, outputs[2].token_ids] == [reference[0], reference[2]]
    assert llm.cache.holdings() == (0, 0)
    # The block completed by the failing step was not published: a prompt sharing it recomputes it.
    hits = llm.engine.prefix_cache.hit_blocks
    llm.generate([victim + reference[1][:1] + [1, 1, 1]], SamplingParams(max_tokens=1, temperature=0.0))
    assert llm.engine.prefix_cache.hit_blocks == hits
    del llm.model.forward_batch
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference


def test_the_cli_exits_non_zero_when_a_request_fails(monkeypatch, capsys):
    import numpy as np

    from metrale.runner.sampling import SampledTokens, TokenSampler

    monkeypatch.setattr(TokenSampler, "sample_async", lambda self, logits, params, seeds, steps, extras=None: SampledTokens(
        np.full(len(params), -1, np.int32), tokens=[-1] * len(params)))
    assert main(["generate", "--no-progress", "--device", "cpu", "Return the"]) == 1
    err = capsys.readouterr().err
    assert "prompt 0 failed" in err and "not finite" in err
