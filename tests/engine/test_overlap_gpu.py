"""Overlap scheduling on the GPU (``-m gpu``): steps queued while the one before them runs, their
decode tokens fed on the device, give every request the tokens of the step-by-step engine.

One request at a time, so both engines run every row in batches of the same shape (the same
rounding): the tokens must be equal. Requests stop on a token taken from the middle of their
output, so a row planned ahead runs past the stop and is dropped; one samples with a seed.
"""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["dense", "mla", "gdn"])
def test_overlapped_steps_give_the_step_by_step_tokens(family_checkpoint_of, family):
    path = family_checkpoint_of(family, "qwen3" if family == "dense" else None)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 128, int(n)).tolist() for n in (5, 40, 2, 17, 9, 30)]
    options = dict(device="cuda", show_progress=False, max_num_seqs=1, max_num_batched_tokens=16)
    step_by_step = LLM(path, overlap_scheduling=False, **options)
    overlapped = LLM(path, **options)
    assert overlapped.engine.overlap and not step_by_step.engine.overlap
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = [o.token_ids for o in step_by_step.generate(prompts, greedy)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[tokens[5]])
              for tokens in first]
    params[1] = SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)
    expected = step_by_step.generate(prompts, params)
    got = overlapped.generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in expected]
    assert any(o.finish_reason == "stop" for o in got)
    assert overlapped.cache.holdings() == (0, 0) and overlapped.engine.check() == []
    # Most steps were queued while the one before them ran.
    assert overlapped.engine.overlapped_steps > sum(overlapped.engine.calls.values()) // 2
    assert step_by_step.engine.overlapped_steps == 0
