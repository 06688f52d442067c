"""Speculative decoding on the cuda backend (``-m gpu``): for every built-in family, greedy tokens
with n-gram speculation equal those without, up to near-ties, and with the MTP modules of
DeepSeek-V3 and Qwen3-Next too (whose logits match the PyTorch references); every block and slot
is free after.

A verify runs a sequence's rows in one forward, where plain decoding runs them one step at a time:
other GEMM shapes, other bf16 rounding. Two runs may part only right after a position whose top-2
logit margin (relative to the row's largest absolute logit) is below ``MARGIN`` in the plain run.
"""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM, SamplingParams

pytestmark = pytest.mark.gpu

MARGIN = 2e-2


def repetitive_prompts(seed, vocab=120):
    rng = np.random.default_rng(seed)
    motif = rng.integers(1, vocab, 6).tolist()
    return [motif * 4, rng.integers(1, vocab, 9).tolist() + motif * 2, rng.integers(1, vocab, 30).tolist(), [5]]


def first_difference(a, b):
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


@pytest.mark.parametrize("family", ["dense", "mla", "gdn"])
def test_speculation_keeps_greedy_tokens_up_to_near_ties(family_checkpoint_of, family):
    check_greedy_tokens(family_checkpoint_of(family), {"method": "ngram", "num_speculative_tokens": 3},
                        replays=family != "gdn")


@pytest.fixture(params=["mla", "gdn"])
def mtp_checkpoint(request):
    """(folder, reference model, reference MTP module) of each family with an MTP module."""
    return request.getfixturevalue({"mla": "mla_mtp_checkpoint", "gdn": "gdn_mtp_checkpoint"}[request.param])


def test_mtp_speculation_keeps_greedy_tokens_up_to_near_ties(mtp_checkpoint):
    folder = mtp_checkpoint[0]
    check_greedy_tokens(folder, {"method": "mtp", "num_speculative_tokens": 3}, replays=folder.name != "qwen3_next")


def test_the_mtp_module_matches_the_reference(mtp_checkpoint):
    import torch

    from metrale.batch import Segment
    from metrale.sequence import SequenceState

    folder, model, mtp = mtp_checkpoint
    llm = LLM(folder, device="cuda", show_progress=False, block_size=4,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state
        expected = mtp(torch.tensor([ids[1:]]), hidden[:, :-1])[0].numpy()
    seq = SequenceState.from_prompt(ids)
    llm.forward.prefill_chunk(ids, seq, 0, len(ids) - 1, False)
    with llm.backend.activate():
        logits, _ = llm.model.mtp_rows.run([Segment(seq, ids[1:], 0, "all")], llm.model.step_outputs["hidden"])
        llm.backend.stream.synchronize()
        logits = logits.get()
    # bf16 weights and activations against the float32 reference.
    assert np.abs(logits - expected).max() <= 3e-2 * np.abs(expected).max()


def check_greedy_tokens(path, config, replays):
    prompts = repetitive_prompts(7)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(path, device="cuda", show_progress=False, max_num_seqs=4, block_size=4)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(path, device="cuda", show_progress=False, max_num_seqs=4, block_size=4, speculative_config=config)
    graphs = llm.model.runner.graphs
    replayed = []
    run_verify = graphs.run_verify
    graphs.run_verify = lambda *args: replayed.append(1) or run_verify(*args)
    outputs = llm.generate(prompts, params)
    assert llm.engine.calls.get("verify", 0) > 0 and sum(o.num_draft_tokens for o in outputs) > 0
    # Attention-only models verify from the decode graphs; Gated DeltaNet steps its rows eagerly.
    assert (len(replayed) == llm.engine.calls["verify"]) if replays else not replayed
    parted = 0
    for prompt, want, got in zip(prompts, expected, outputs):
        assert got.error is None and got.num_accepted_tokens <= got.num_draft_tokens
        index = first_difference(want, got.token_ids)
        if index is None:
            continue
        logits = np.asarray(plain.score(prompt + want[:index])[-1])
        top2 = np.sort(logits)[-2:]
        margin = float(top2[1] - top2[0]) / float(np.abs(logits).max())
        assert margin < MARGIN, f"outputs part at token {index} although its top-2 margin is {margin:.3g}"
        parted += 1
    print(f"{config['method']} {path.name}: {parted} of {len(prompts)} requests parted at a near-tie; "
          f"calls {llm.engine.calls}; accepted {sum(o.num_accepted_tokens for o in outputs)} of "
          f"{sum(o.num_draft_tokens for o in outputs)}")
    allocator = llm.cache.allocator
    assert allocator.num_free == allocator.num_blocks
    if llm.cache.state_slots is not None:
        assert llm.cache.state_slots.num_free == llm.cache.state_slots.num_slots
