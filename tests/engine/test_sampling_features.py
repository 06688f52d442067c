"""The sampling features against transformers' ``generate`` on the embedded tiny Llama: the
repetition penalty, logit bias, ``min_new_tokens`` and log probabilities as transformers computes
them; presence and frequency penalties by OpenAI's definition; ``n``, ``prompt_logprobs``,
``generation_config.json`` defaults, and the penalty counts across preemption and slot reuse."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.errors import InvalidRequestError
from metrale.models import embedded_model_path
from metrale.runner.sampling import PenaltySlots, RowExtras

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = ["Return the", "Open a file and read", "x"]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-dense", device="cpu", show_progress=False)


@pytest.fixture(scope="module")
def hf_model():
    model = transformers.AutoModelForCausalLM.from_pretrained(embedded_model_path("tiny-dense"), dtype=torch.float32)
    return model.eval()


def hf_generate(hf_model, ids, max_new_tokens, ignore_eos=False, **options):
    config = hf_model.generation_config
    saved, config.eos_token_id = config.eos_token_id, None if ignore_eos else 0
    try:
        with torch.no_grad():
            # (The mask is explicit: BOS is also the pad id, which transformers would mask out.)
            out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0,
                                    eos_token_id=config.eos_token_id, return_dict_in_generate=True, output_logits=True,
                                    **options)
    finally:
        config.eos_token_id = saved
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [logits[0].float().numpy() for logits in out.logits]


class PresenceFrequency(transformers.LogitsProcessor):
    """OpenAI's penalties: ``logit -= frequency * count + presence * (count > 0)`` over the
    generated tokens."""

    def __init__(self, prompt_len, presence, frequency):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        for row in range(scores.shape[0]):
            generated = input_ids[row, self.prompt_len:]
            counts = torch.bincount(generated, minlength=scores.shape[1]).to(scores.dtype)
            scores[row] -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


def test_repetition_penalty_matches_transformers(llm, hf_model):
    for prompt in PROMPTS:
        ids = llm.encode(prompt)
        expected, _ = hf_generate(hf_model, ids, 24, ignore_eos=True, repetition_penalty=1.8)
        plain, _ = hf_generate(hf_model, ids, 24, ignore_eos=True)
        params = SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.8, ignore_eos=True)
        assert llm.generate([ids], params)[0].token_ids == expected
        assert expected != plain  # the penalty changes the greedy continuation


def test_presence_and_frequency_penalties_match_openais_definition(llm, hf_model):
    ids = llm.encode(PROMPTS[1])
    processors = transformers.LogitsProcessorList([PresenceFrequency(len(ids), 0.7, 1.3)])
    expected, _ = hf_generate(hf_model, ids, 24, ignore_eos=True, logits_processor=processors)
    params = SamplingParams(max_tokens=24, temperature=0.0, presence_penalty=0.7, frequency_penalty=1.3, ignore_eos=True)
    got = llm.generate([ids], params)[0].token_ids
    assert got == expected
    assert got != llm.generate([ids], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].token_ids


def test_logit_bias_and_min_tokens_match_transformers(llm, hf_model):
    ids = llm.encode(PROMPTS[0])
    expected, _ = hf_generate(hf_model, ids, 12, sequence_bias={(300,): 6.0, (14,): -50.0})
    got = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, logit_bias={300: 6.0, "14": -50.0}))
    assert got[0].token_ids == expected and 300 in expected
    # Without min_tokens this prompt ends on EOS (token 0) early; with it, EOS waits.
    short = llm.generate([ids], SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 12
    expected, _ = hf_generate(hf_model, ids, 20, min_new_tokens=14)
    got = llm.generate([ids], SamplingParams(max_tokens=20, temperature=0.0, min_tokens=14))[0]
    cut = expected.index(0) + 1 if 0 in expected else len(expected)
    assert got.token_ids == expected[:cut] and 0 not in got.token_ids[:14]


def test_logprobs_are_transformers_log_softmax(llm, hf_model):
    ids = llm.encode(PROMPTS[1])
    expected, logits = hf_generate(hf_model, ids, 10, ignore_eos=True)
    out = llm.generate([ids], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3))[0]
    completion = out.outputs[0]
    assert completion.token_ids == expected
    total = 0.0
    for token, position, row in zip(completion.token_ids, completion.logprobs, logits):
        reference = torch.log_softmax(torch.tensor(row, dtype=torch.float64), -1).numpy()
        top = np.argsort(-reference, kind="stable")[:3]
        assert [t for t, lp in position.items() if lp.rank <= 3] == top.tolist()
        for t, entry in position.items():
            assert entry.logprob == pytest.approx(reference[t], abs=2e-4)
            assert entry.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
        assert position[token].rank == 1  # greedy picks the most likely
        total += reference[token]
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_prompt_logprobs_are_the_teacher_forced_log_softmax(llm):
    ids = llm.encode(PROMPTS[1])
    out = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))[0]
    reference = torch.log_softmax(torch.tensor(llm.score(ids), dtype=torch.float64), -1).numpy()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for position in range(1, len(ids)):
        entries = out.prompt_logprobs[position]
        assert entries[ids[position]].logprob == pytest.approx(reference[position - 1, ids[position]], abs=2e-4)
        ranked = sorted((e.rank, t) for t, e in entries.items() if t != ids[position] or e.rank <= 2)
        assert [t for rank, t in ranked if rank <= 2] == np.argsort(-reference[position - 1], kind="stable")[:2].tolist()
    assert llm.cache.holdings() == (0, 0)


def test_n_completions_have_their_own_streams_and_the_first_is_n_1s(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    single = llm.generate(["Return the"], params)[0]
    params.n = 4
    out = llm.generate(["Return the"], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert out.outputs[0].token_ids == single.token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.num_generated_tokens == 48 and out.finished
    greedy = llm.generate(["Return the"], SamplingParams(max_tokens=8, temperature=0.0, n=3))[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    streamed = list(llm.generate_stream(["Return the"], params))
    assert streamed[-1].finished and [c.token_ids for c in streamed[-1].outputs] == [c.token_ids for c in out.outputs]
    assert not any(o.finished for o in streamed[:-1])


def test_min_p_keeps_only_likely_tokens(llm):
    ids = llm.encode(PROMPTS[0])
    logits = llm.score(ids)[-1]
    probs = np.exp(logits - logits.max())
    allowed = set(np.nonzero(probs >= 0.5)[0].tolist())
    assert 1 <= len(allowed) < 10
    firsts = {llm.generate([ids], SamplingParams(max_tokens=1, temperature=1.5, min_p=0.5, seed=s))[0].token_ids[0]
              for s in range(40)}
    assert firsts <= allowed
    loose = {llm.generate([ids], SamplingParams(max_tokens=1, temperature=1.5, seed=s))[0].token_ids[0] for s in range(40)}
    assert not loose <= allowed


def test_penalties_survive_preemption(tmp_path):
    """A request preempted and recomputed keeps its counts: the same tokens as without preemption."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=0.5)
    prompts = [[5 + i, 6, 7, 8, 9, 10] for i in range(6)]
    roomy = LLM("tiny-dense", device="cpu", show_progress=False)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    tight = LLM("tiny-dense", device="cpu", show_progress=False, num_blocks=14, block_size=8, enable_prefix_caching=False)
    outputs = tight.generate(prompts, params)
    assert sum(o.num_preemptions for o in outputs) > 0
    assert [o.token_ids for o in outputs] == expected
    assert tight.engine.sampler.penalties.used == 0


def test_penalty_slots_evict_the_least_recently_used_and_rebuild():
    slots = PenaltySlots(np, 2, 10)
    penalized = SamplingParams(repetition_penalty=1.2)
    a, b, c = (RowExtras(key=k, tokens=[1, 2, 2, 3], prompt_len=1) for k in (1, 2, 3))
    assert slots.slots([a, b], [penalized] * 2).tolist() == [0, 1]
    assert slots.counts[0].tolist() == [0, 1 << 30, 2, 1, 0, 0, 0, 0, 0, 0]
    slots.counts[0, 5] = 9  # would be the device's count of a later token
    assert slots.slots([b], [penalized]).tolist() == [1]
    assert slots.slots([c], [penalized]).tolist() == [0]  # a was used least recently
    assert slots.slots([a], [penalized]).tolist() == [1]  # b lost its slot; a's counts rebuilt
    assert slots.counts[1, 5] == 0 and slots.counts[1, 2] == 2
    slots.release(3)
    assert slots.used == 1


def test_generation_config_supplies_the_defaults(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(embedded_model_path("tiny-dense"), folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(do_sample=False, max_new_tokens=5, repetition_penalty=1.6, top_k="bad")
    (folder / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(folder, device="cpu", show_progress=False)
    assert llm.sampling_defaults == {"temperature": 0.0, "max_tokens": 5, "repetition_penalty": 1.6}
    out = llm.generate(["Open a file and read"], SamplingParams(ignore_eos=True))[0]
    reference = LLM("tiny-dense", device="cpu", show_progress=False)
    assert out.token_ids == reference.generate(["Open a file and read"], SamplingParams(
        max_tokens=5, temperature=0.0, repetition_penalty=1.6, ignore_eos=True))[0].token_ids
    # Explicit values win over the defaults.
    out = llm.generate(["Open a file and read"], SamplingParams(max_tokens=3, repetition_penalty=1.0, temperature=0.0))[0]
    assert len(out.token_ids) <= 3


@pytest.mark.parametrize("options, match", [
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
])
def test_options_checked_against_the_model(llm, options, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(["Return the"], SamplingParams(**options))
    assert llm.cache.holdings() == (0, 0)


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 129), ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("repetition_penalty", -1.0), ("min_p", 1.5), ("min_p", -0.1), ("logit_bias", {"a": 1}), ("logit_bias", {1: 101}),
    ("logit_bias", [1, 2]), ("min_tokens", -1), ("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 30),
    ("structured_output", {"json": {}}),
])
def test_new_fields_refuse_bad_values(field, value):
    with pytest.raises(InvalidRequestError, match=field.split("_")[0]):
        SamplingParams(**{field: value})
