"""Multi-token-prediction modules as the ``mtp`` drafter (metrale/plugins/mtp.py), on the CPU, for
DeepSeek-V3 (MLA) and Qwen3-Next (GDN): the module's logits against a PyTorch reference built from
transformers' decoder layers (``tools/checkpoints/train_tiny_models.py``'s ``mtp_module``), its first drafts
the reference's greedy tokens, tokens with MTP speculation equal to those without (greedy and
seeded), every block and slot free after, and the configurations it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.batch import Segment
from metrale.errors import ConfigError
from metrale.sequence import SequenceState

MTP = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(params=["mla", "gdn"])
def mtp_checkpoint(request):
    """(folder, reference model, reference MTP module) of each family with an MTP module."""
    return request.getfixturevalue({"mla": "mla_mtp_checkpoint", "gdn": "gdn_mtp_checkpoint"}[request.param])


def test_the_module_matches_the_reference(mtp_checkpoint):
    import torch

    folder, model, mtp = mtp_checkpoint
    llm = LLM(folder, device="cpu", show_progress=False, block_size=4, speculative_config=MTP)
    assert llm.checkpoint.unconsumed() == []
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state
        expected = mtp(torch.tensor([ids[1:]]), hidden[:, :-1])[0].numpy()
    seq = SequenceState.from_prompt(ids)
    llm.forward.prefill_chunk(ids, seq, 0, len(ids) - 1, False)
    ours = np.asarray(llm.model.step_outputs["hidden"])
    np.testing.assert_allclose(ours, hidden[0, :-1].numpy(), rtol=1e-4, atol=1e-4)
    drafter = llm.model.mtp_rows
    logits, _ = drafter.run([Segment(seq, ids[1:], 0, "all")], llm.model.step_outputs["hidden"])
    logits = np.asarray(logits)
    assert np.abs(logits - expected).max() <= 1e-4 * np.abs(expected).max()


def test_the_first_draft_is_the_modules_greedy_token(mtp_checkpoint):
    import torch

    folder, model, mtp = mtp_checkpoint
    llm = LLM(folder, device="cpu", show_progress=False, block_size=4, speculative_config=MTP)
    ids = [7, 2, 9, 4, 4, 1, 8]
    seq = SequenceState.from_prompt(ids)
    llm.forward.prefill(seq.tokens, seq)  # the drafter stage catches up on rows 0 .. 5
    rows = llm.model.mtp_rows.rows[seq.seq_id]
    assert rows.filled == len(ids) - 1 and rows.states[0][0] == len(ids) - 1
    nxt = 11
    seq.tokens.append(nxt)
    drafts = llm.model.mtp_rows.propose([seq], [3])[0]
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state
        expected = mtp(torch.tensor([ids[1:] + [nxt]]), hidden)[0].argmax(-1)
    assert len(drafts) == 3 and drafts[0] == int(expected[-1])


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_mtp_speculation_keeps_every_token(mtp_checkpoint, sampling):
    folder = mtp_checkpoint[0]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 120, n).tolist() for n in (9, 23, 4, 1)]
    if sampling == "greedy":
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    else:
        params = [SamplingParams(max_tokens=16, temperature=0.9, seed=7 + i, ignore_eos=True) for i in range(len(prompts))]
    outputs = {}
    for name, config in (("plain", None), ("mtp", MTP)):
        llm = LLM(folder, device="cpu", show_progress=False, block_size=4, max_num_seqs=3, speculative_config=config)
        outputs[name] = llm.generate(prompts, params, use_tqdm=False)
        outputs[name] += llm.generate(prompts[:1], params[:1] if isinstance(params, list) else params,
                                      use_tqdm=False)  # a prefix hit
        assert llm.cache.allocator.num_free == llm.cache.allocator.num_blocks
        if llm.cache.state_slots is not None:
            assert llm.cache.state_slots.num_free == llm.cache.state_slots.num_slots
    for want, got in zip(outputs["plain"], outputs["mtp"]):
        assert got.error is None and got.token_ids == want.token_ids
    assert sum(o.num_draft_tokens for o in outputs["mtp"]) > 0
    assert all(o.num_accepted_tokens <= o.num_draft_tokens for o in outputs["mtp"])


def test_what_the_mtp_drafter_refuses(mla_checkpoints, gdn_checkpoint, dense_checkpoints):
    for path in (mla_checkpoints["deepseek_v3"], gdn_checkpoint):
        with pytest.raises(ConfigError, match="needs a multi-token-prediction module"):
            LLM(path, device="cpu", show_progress=False, speculative_config=MTP)
    with pytest.raises(ConfigError, match="mtp drafter needs"):
        LLM(dense_checkpoints["llama"], device="cpu", show_progress=False, speculative_config=MTP)


def test_a_sequence_keeps_a_bounded_number_of_states(mla_mtp_checkpoint, monkeypatch):
    """Past MAX_KEPT_STATES the module catches up at once (a long prompt, decode steps without
    drafts), and its drafts are those of a sequence that caught up only when asked."""
    from metrale.plugins import mtp as mtp_plugin

    monkeypatch.setattr(mtp_plugin, "MAX_KEPT_STATES", 4)
    ids = list(np.random.default_rng(3).integers(1, 120, 11))
    drafts = []
    for chunk in (len(ids), 3):  # one prompt call, then chunks of 3 rows (each past the bound with the rest)
        llm = LLM(mla_mtp_checkpoint[0], device="cpu", show_progress=False, block_size=4, speculative_config=MTP)
        seq = SequenceState.from_prompt([int(t) for t in ids])
        for start in range(0, len(ids), chunk):
            length = min(chunk, len(ids) - start)
            llm.forward.prefill_chunk(seq.tokens, seq, start, length, start + length == len(ids))
            kept = sum(r.shape[0] for _, r in llm.model.mtp_rows.rows[seq.seq_id].states)
            assert kept <= 4 + chunk
        seq.tokens.append(5)
        drafts.append(llm.model.mtp_rows.propose([seq], [3])[0])
    assert drafts[0] == drafts[1] and len(drafts[0]) == 3


@pytest.mark.parametrize("name", ["tiny-mla", "tiny-gdn"])
def test_the_shipped_models_carry_a_trained_mtp_module(name):
    """``speculative_config={"method": "mtp", ...}`` works on the embedded models as installed: the
    same greedy tokens as without speculation, and the trained module's drafts are kept often."""
    prompts = ["def read(path):\n    with open(", "import os\nimport sys\n\n", "class Reader:\n    def __init__(self"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain = LLM(name, device="cpu", show_progress=False).generate(prompts, params)
    llm = LLM(name, device="cpu", show_progress=False, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert llm.model.mtp is not None
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    drafted = sum(o.num_draft_tokens for o in outputs)
    assert drafted > 0 and sum(o.num_accepted_tokens for o in outputs) >= 0.15 * drafted
