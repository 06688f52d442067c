"""Speculative decoding on the CPU: the configuration, the n-gram drafter, the acceptance rule,
and the engine's tokens with speculation equal to its tokens without (greedy and seeded sampling,
every family), every block free afterwards; the sampled distribution against the
target's (chi-square)."""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM, SamplingParams, hookimpl
from metrale.errors import CacheError, ConfigError
from metrale.model.plugin_manager import get_plugin_manager
from metrale.plugins.ngram import NgramDrafter
from metrale.speculative import MAX_SPECULATIVE_TOKENS, SpeculativeConfig, accepted_count

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize("value, match", [
    ("ngram", "must be a mapping"),
    ({"num_speculative_tokens": 2}, "needs a 'method'"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "above"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown keys"),
])
def test_bad_speculative_configs_are_refused(value, match):
    with pytest.raises(ConfigError, match=match):
        SpeculativeConfig.from_value(value)


def test_a_config_keeps_its_values():
    config = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 6})
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (
        "ngram", 4, 1, 6)
    assert SpeculativeConfig.from_value(None) is None
    assert SpeculativeConfig.from_value(config) is config


def test_an_unknown_drafter_and_a_family_without_verify_are_refused_at_load(monkeypatch):
    with pytest.raises(ConfigError, match="no drafter named 'medusa'; installed: mtp, ngram"):
        LLM("tiny-dense", device="cpu", show_progress=False, speculative_config={"method": "medusa",
                                                                                 "num_speculative_tokens": 2})
    from metrale.plugins.dense.model import DenseModel

    monkeypatch.setattr(DenseModel, "speculation_capable", False)
    with pytest.raises(ConfigError, match="does not serve speculative decoding"):
        LLM("tiny-dense", device="cpu", show_progress=False, speculative_config=NGRAM)


# ------------------------------------------------------------------------- drafter, acceptance


def drafter(low=1, high=3):
    return NgramDrafter(SpeculativeConfig("ngram", 4, low, high))


def test_the_ngram_drafter_continues_the_most_recent_longest_match():
    # Suffix (7, 8) occurs at 0 (followed by 1, 2) and at 5 (followed by 9, 9): the later one wins.
    assert drafter().continuation([7, 8, 1, 2, 3, 7, 8, 9, 9, 4, 7, 8], 3) == [9, 9, 4]
    # The 3-gram (1, 7, 8) matches once, before the longer-ago 2-gram continuation.
    assert drafter().continuation([1, 7, 8, 5, 6, 7, 8, 0, 1, 7, 8], 2) == [5, 6]
    assert drafter().continuation([1, 2, 3, 1, 2], 10) == [3, 1, 2]  # up to the end of the sequence
    assert drafter().continuation([1, 2, 3, 4], 3) == []  # no earlier occurrence
    assert drafter(low=2).continuation([5, 1, 2, 3, 1], 3) == []  # a 1-gram match is below the minimum
    assert drafter().continuation([5, 5], 0) == []


def test_accepted_count_is_the_longest_equal_prefix():
    assert accepted_count([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted_count([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted_count([4], [3, 4]) == 0
    assert accepted_count([], [8]) == 0


def test_the_verdict_checks_its_counts():
    llm = LLM("tiny-dense", device="cpu", show_progress=False)
    from metrale.sequence import SequenceState

    seq = SequenceState.from_prompt([3, 4, 5])
    llm.forward.prefill(seq.tokens, seq)
    logits = llm.forward.verify([[5, 6, 7]], [seq])
    assert logits.shape[0] == 3 and seq.num_cached == 6
    with pytest.raises(CacheError, match="3 drafts kept of a verify of 3 rows"):
        llm.forward.verdict([seq], [3], [3])
    llm.forward.verdict([seq], [3], [1])
    assert seq.num_cached == 5
    llm.cache.release(seq)


# ---------------------------------------------------------------------------------- the engine


class ScriptedDrafter:
    """Proposes, for each sequence, the continuation of ``script`` after the sequence's tokens
    when they are a prefix of it (the target's own greedy tokens: an oracle), else ``fallback``."""

    def __init__(self, scripts, fallback=()):
        self.scripts = scripts
        self.fallback = list(fallback)

    def propose(self, seqs, limits):
        out = []
        for seq, limit in zip(seqs, limits):
            tokens = list(seq.tokens)
            match = next((s for s in self.scripts if s[: len(tokens)] == tokens), None)
            out.append((match[len(tokens):] if match is not None else self.fallback)[:limit])
        return out


def manager_with(drafter_object, name):
    class Plugin:
        METRALE_CONTRACT_VERSION = "1.2"

        @hookimpl
        def metrale_drafters(self):
            return {name: lambda config, model: drafter_object}

    manager = get_plugin_manager(entry_points=False)
    manager.register(Plugin(), name=f"drafter-{name}")
    return manager


def repetitive_prompts(seed, vocab):
    rng = np.random.default_rng(seed)
    motif = rng.integers(1, vocab, 6).tolist()
    return [motif * 4, rng.integers(1, vocab, 9).tolist() + motif * 2, rng.integers(1, vocab, 30).tolist(), [5]]


def run(path, prompts, params, **options):
    llm = LLM(path, device="cpu", show_progress=False, **options)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts[:1], params[:1] if isinstance(params, list) else params, use_tqdm=False)  # prefix hits
    allocator = llm.cache.allocator
    assert allocator.num_free == allocator.num_blocks, "every block is free after the requests"
    return outputs + again, llm


@pytest.mark.parametrize("family, variant", [("dense", "llama"), ("dense", "mistral"), ("mla", "deepseek_v2"),
                                             ("mla", "deepseek_v3"), ("gdn", None)])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_speculation_keeps_every_token(family_checkpoint_of, family, variant, sampling):
    path = family_checkpoint_of(family, variant)
    prompts = repetitive_prompts(7, 120)
    if sampling == "greedy":
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    else:
        params = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True, logprobs=2)
                  for i in range(len(prompts))]
    plain, _ = run(path, prompts, params, max_num_seqs=3)
    speculated, llm = run(path, prompts, params, max_num_seqs=3, speculative_config=NGRAM)
    for want, got in zip(plain, speculated):
        assert got.token_ids == want.token_ids
        assert got.error is None
        if sampling == "seeded":
            assert [sorted(d) for d in got.outputs[0].logprobs] == [sorted(d) for d in want.outputs[0].logprobs]
    assert llm.engine.calls.get("verify", 0) > 0
    assert sum(o.num_draft_tokens for o in speculated) > 0
    assert all(o.num_accepted_tokens <= o.num_draft_tokens for o in speculated)


def test_an_oracle_drafter_is_accepted_and_junk_drafts_change_nothing(dense_checkpoints):
    path = dense_checkpoints["llama"]
    prompts = repetitive_prompts(3, 120)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain, _ = run(path, prompts, params, max_num_seqs=4)
    scripts = [list(p) + o.token_ids for p, o in zip(prompts, plain)]
    oracle = ScriptedDrafter(scripts)
    speculated, llm = run(path, prompts, params, max_num_seqs=4, plugin_manager=manager_with(oracle, "oracle"),
                          speculative_config={"method": "oracle", "num_speculative_tokens": 4})
    assert [o.token_ids for o in speculated] == [o.token_ids for o in plain]
    first = speculated[: len(prompts)]
    # Every draft of the oracle is the target's token: all are kept, five tokens a verify.
    assert all(o.num_accepted_tokens == o.num_draft_tokens > 0 for o in first)
    assert llm.engine.calls["verify"] <= 4 * 2
    junk, llm = run(path, prompts, params, max_num_seqs=4,
                    plugin_manager=manager_with(ScriptedDrafter([], fallback=[0, 0, 0]), "junk"),
                    speculative_config={"method": "junk", "num_speculative_tokens": 3})
    assert [o.token_ids for o in junk] == [o.token_ids for o in plain]
    assert sum(o.num_draft_tokens for o in junk) > 0


class FailingDrafter:
    def __init__(self, answer):
        self.answer = answer

    def propose(self, seqs, limits):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer(seqs)


@pytest.mark.parametrize("answer", [
    RuntimeError("drafter bug"),
    lambda seqs: [[10_000]] * len(seqs),  # past the vocabulary
    lambda seqs: [["a"]] * len(seqs),
    lambda seqs: [[1]] * (len(seqs) + 1),  # one list too many
])
def test_a_failing_drafter_costs_only_its_drafts(dense_checkpoints, answer, caplog):
    path = dense_checkpoints["llama"]
    prompts = repetitive_prompts(3, 120)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain, _ = run(path, prompts, params, max_num_seqs=4)
    speculated, llm = run(path, prompts, params, max_num_seqs=4, plugin_manager=manager_with(FailingDrafter(answer), "bad"),
                          speculative_config={"method": "bad", "num_speculative_tokens": 2})
    assert [o.token_ids for o in speculated] == [o.token_ids for o in plain]
    assert all(o.error is None and o.num_draft_tokens == 0 for o in speculated)
    assert "verify" not in llm.engine.calls
    assert "the bad drafter failed" in caplog.text


def test_speculation_under_preemption_stops_and_limits(dense_checkpoints):
    path = dense_checkpoints["qwen3"]
    prompts = repetitive_prompts(11, 120) * 2
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=n != 12, stop_token_ids=[7]) for n in
              (12, 5, 9, 1, 14, 3, 8, 6)]
    options = dict(max_num_seqs=4, block_size=4, num_blocks=40, max_model_len=64)
    plain, _ = run(path, prompts, params, **options)
    speculated, llm = run(path, prompts, params, speculative_config={"method": "ngram", "num_speculative_tokens": 5},
                          **options)
    assert [o.token_ids for o in speculated] == [o.token_ids for o in plain]
    assert [o.outputs[0].finish_reason for o in speculated] == [o.outputs[0].finish_reason for o in plain]
    assert all(len(o.token_ids) <= p.max_tokens for o, p in zip(speculated, params + params[:1]))


def test_requests_whose_rows_need_more_than_their_params_take_no_drafts(dense_checkpoints):
    path = dense_checkpoints["llama"]
    prompts = repetitive_prompts(5, 120)[:2]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    plain, _ = run(path, prompts, params)
    speculated, llm = run(path, prompts, params, speculative_config=NGRAM)
    assert [o.token_ids for o in speculated] == [o.token_ids for o in plain]
    assert all(o.num_draft_tokens == 0 for o in speculated) and "verify" not in llm.engine.calls


def chi_square_p_value(observed, expected):
    """The chi-square test's p-value (``torch.special.gammaincc``: the survival function of the
    chi-square distribution with ``len - 1`` degrees of freedom)."""
    import torch

    statistic = float(((observed - expected) ** 2 / expected).sum())
    freedom = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(freedom / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def small_vocabulary_checkpoint(tmp_path_factory):
    """A tiny Llama of 16 tokens: joint distributions of two tokens fit a chi-square test."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from metrale.testing.hf import build_hf_checkpoint

    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return build_hf_checkpoint(LlamaForCausalLM, config, tmp_path_factory.mktemp("vocab16") / "llama", seed=4)


def test_the_sampled_distribution_is_the_targets(small_vocabulary_checkpoint):
    """The second and third generated tokens, drawn through verifies of two fixed drafts (each
    kept with the target's probability, else redrawn from the rest), over 6,000 seeds, against
    the target's joint distribution of those two tokens (from the model's scores, summed over
    the first token): chi-square over the 256 pairs, the rare ones pooled."""
    path = small_vocabulary_checkpoint
    prompt = [3, 9, 2, 11]
    temperature = 1.3
    llm = LLM(path, device="cpu", show_progress=False)

    def distribution(tokens):
        logits = np.asarray(llm.score(tokens)[-1], dtype=np.float64) / temperature
        weights = np.exp(logits - logits.max())
        return weights / weights.sum()

    first = distribution(prompt)
    joint = np.zeros((16, 16))
    for t1 in range(16):
        second = distribution(prompt + [t1])
        for t2 in range(16):
            joint[t2] += first[t1] * second[t2] * distribution(prompt + [t1, t2])
    drafts = [int(np.argmax(joint.sum(axis=1))), int(np.argmax(joint.sum(axis=0)))]
    # 500 requests a call, all prefilled in the first step, so the second is a verify of all.
    spec = LLM(path, device="cpu", show_progress=False, max_num_seqs=500, max_num_batched_tokens=4096,
               plugin_manager=manager_with(ScriptedDrafter([], fallback=drafts), "fixed"),
               speculative_config={"method": "fixed", "num_speculative_tokens": 2})
    draws = 6000
    outputs = []
    for start in range(0, draws, 500):
        params = [SamplingParams(max_tokens=4, temperature=temperature, seed=seed, ignore_eos=True)
                  for seed in range(start, start + 500)]
        outputs += spec.generate([prompt] * 500, params, use_tqdm=False)
    assert sum(o.num_draft_tokens for o in outputs) >= 2 * draws  # every second token came from a verify
    kept = np.mean([o.token_ids[1] == drafts[0] for o in outputs])
    p_kept = joint.sum(axis=1)[drafts[0]]
    assert abs(kept - p_kept) < 4 * np.sqrt(p_kept * (1 - p_kept) / draws)
    counts = np.zeros((16, 16))
    for o in outputs:
        counts[o.token_ids[1], o.token_ids[2]] += 1
    counts, expected = counts.ravel(), joint.ravel() * draws
    big = np.flatnonzero(expected >= 5)
    observed, wanted = counts[big], expected[big]
    if draws - wanted.sum() >= 5:  # the rarer pairs as one bin
        observed, wanted = np.append(observed, draws - observed.sum()), np.append(wanted, draws - wanted.sum())
    assert chi_square_p_value(observed, wanted) > 1e-3


# --------------------------------------------------------------------- Gated DeltaNet verdicts


def test_a_gdn_verdict_leaves_the_state_of_the_last_kept_row(gdn_checkpoint):
    """After a verify of four rows that keeps two, the next decode step's logits equal those of
    a sequence that decoded the two kept tokens one by one; the state as of the kept rows is
    folded into the slot by the next forward (the flush stage), not by the verdict."""
    from metrale.sequence import SequenceState

    llm = LLM(gdn_checkpoint, device="cpu", show_progress=False, enable_prefix_caching=False)
    forward, model = llm.forward, llm.model
    prompt = [5, 9, 14, 3, 22, 7, 31]
    reference = SequenceState.from_prompt(prompt)
    forward.prefill(reference.tokens, reference)
    for token in (11, 12):
        forward.decode(token, reference)
    want = np.asarray(forward.decode(40, reference))

    seq = SequenceState.from_prompt(prompt)
    forward.prefill(seq.tokens, seq)
    verified = np.asarray(forward.verify([[11, 12, 13, 14]], [seq]))
    assert verified.shape[0] == 4
    forward.verdict([seq], [4], [1])  # keeps 11 and 12
    assert seq.num_cached == len(prompt) + 2 and model._pending
    assert model._verify_states is None  # the row states live on only through what is pending
    got = np.asarray(forward.decode(40, seq))
    assert not model._pending
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The verify's rows are the logits plain decoding gives at those positions.
    np.testing.assert_allclose(verified[1], np.asarray(forward.score(prompt + [11, 12], SequenceState.from_prompt(
        prompt + [11, 12])))[-1], rtol=1e-4, atol=1e-4)
    for s in (reference, seq):
        llm.cache.release(s)


def test_a_gdn_slots_next_owner_never_sees_pending_rows(gdn_checkpoint):
    from metrale.sequence import SequenceState

    llm = LLM(gdn_checkpoint, device="cpu", show_progress=False, enable_prefix_caching=False)
    forward, model, cache = llm.forward, llm.model, llm.cache
    seq = SequenceState.from_prompt([5, 9, 14, 3])
    forward.prefill(seq.tokens, seq)
    forward.verify([[11, 12, 13]], [seq])
    forward.verdict([seq], [3], [0])
    slot = seq.state_slot
    assert slot in model._pending
    cache.release(seq)
    successor = SequenceState.from_prompt([1, 2, 3])
    cache.state_slots.allocate(successor)
    assert successor.state_slot == slot
    layers = [layer for layer in cache.layers if hasattr(layer, "state")]
    for layer in layers:  # the successor's own state (a prefix hit would have restored one)
        layer.state[slot] = 0.25
        layer.conv[slot] = -0.5
    model.flush_pending()
    assert not model._pending
    assert all((layer.state[slot] == 0.25).all() and (layer.conv[slot] == -0.5).all() for layer in layers)
    cache.state_slots.release(successor)


def test_a_gdn_verdict_for_a_sequence_the_verify_did_not_run_is_refused(gdn_checkpoint):
    from metrale.sequence import SequenceState

    llm = LLM(gdn_checkpoint, device="cpu", show_progress=False, enable_prefix_caching=False)
    first, second = SequenceState.from_prompt([5, 9, 14]), SequenceState.from_prompt([6, 2])
    for seq in (first, second):
        llm.forward.prefill(seq.tokens, seq)
    llm.forward.verify([[3, 4]], [first])
    with pytest.raises(CacheError, match="the last verify did not run"):
        llm.forward.verdict([second], [2], [0])
    assert second.num_cached == 2


def test_an_mla_verify_computes_its_rows_as_decode_rows(mla_checkpoints, monkeypatch):
    """A verify's rows take the absorbed form decode rows take (on the GPU the expanded form
    rounds otherwise, which would change tokens), each row seeing its sequence up to itself: the
    rows' logits equal the decode steps'."""
    from metrale.plugins.mla.model import LatentAttention
    from metrale.sequence import SequenceState

    llm = LLM(mla_checkpoints["deepseek_v2"], device="cpu", show_progress=False, enable_prefix_caching=False)
    forward = llm.forward
    prompt = [5, 9, 14, 3, 22, 7, 31]
    reference = SequenceState.from_prompt(prompt)
    forward.prefill(reference.tokens, reference)
    want = [np.asarray(forward.decode(token, reference))[0] for token in (11, 12, 13)]
    forms = []
    for name in ("_absorbed", "_expanded"):
        original = getattr(LatentAttention, name)
        monkeypatch.setattr(LatentAttention, name, lambda self, *a, _f=original, _n=name: forms.append(_n) or _f(self, *a))
    seq = SequenceState.from_prompt(prompt)
    forward.prefill(seq.tokens, seq)
    forms.clear()
    got = np.asarray(forward.verify([[11, 12, 13]], [seq]))
    assert forms and set(forms) == {"_absorbed"}
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-5, atol=1e-5)
    for s in (reference, seq):
        llm.cache.release(s)


def test_a_verify_keeps_to_the_step_token_budget(dense_checkpoints, monkeypatch):
    path = dense_checkpoints["llama"]
    prompts = repetitive_prompts(3, 120)[:3]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    options = dict(max_num_seqs=3, block_size=4, max_num_batched_tokens=8)
    plain, _ = run(path, prompts, params, **options)
    scripts = [list(p) + o.token_ids for p, o in zip(prompts, plain)]
    rows = []
    from metrale.model.forward import ModelForward

    original = ModelForward.verify
    monkeypatch.setattr(ModelForward, "verify", lambda self, tokens, seqs, stream=None: rows.append(
        sum(len(t) for t in tokens)) or original(self, tokens, seqs, stream))
    speculated, llm = run(path, prompts, params, plugin_manager=manager_with(ScriptedDrafter(scripts), "oracle"),
                          speculative_config={"method": "oracle", "num_speculative_tokens": 6}, **options)
    assert [o.token_ids for o in speculated] == [o.token_ids for o in plain]
    assert rows and max(rows) == 8  # three sequences would take 21 rows: cut to the budget


@pytest.mark.parametrize("family", ["dense", "gdn"])
def test_aborts_between_speculative_steps_free_everything(family_checkpoint_of, family):
    """Requests aborted mid-generation, some right after a verdict left a recurrent state pending:
    their blocks and slots go back, and the requests left finish as they would alone."""
    from metrale.engine.generation import make_request

    path = family_checkpoint_of(family)
    prompts = repetitive_prompts(5, 120)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone, _ = run(path, prompts[2:], params)
    llm = LLM(path, device="cpu", show_progress=False, speculative_config=NGRAM, block_size=4)
    engine = llm.engine
    requests = [make_request(i, None, p, params, 0) for i, p in enumerate(prompts)]
    for request in requests:
        engine.add_request(request)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 4:
            engine.abort(requests[:2])
    assert engine.calls.get("verify", 0) > 0
    assert [r.finish_reason for r in requests[:2]] == ["abort", "abort"]
    assert [r.generated for r in requests[2:]] == [o.token_ids for o in alone[: len(prompts) - 2]]
    allocator = llm.cache.allocator
    assert allocator.num_free == allocator.num_blocks
    if llm.cache.state_slots is not None:
        assert llm.cache.state_slots.num_free == llm.cache.state_slots.num_slots
    assert not getattr(llm.model, "_pending", {}) or all(
        seq.state_slot != slot for slot, (seq, _, _) in llm.model._pending.items())
