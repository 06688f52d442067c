"""The text of a generation: decoded incrementally, never shrinking while it streams, never
holding half a character, with stop strings held back until settled -- and equal, in the end,
to what ``generate`` returns and to the tokenizer's own decoding.

The model's choices are scripted (the sampler returns a fixed continuation), so the tests can
place multi-byte characters and stop strings across token boundaries at will.
"""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.engine import generation
from metrale.runner.sampling import SampledTokens, TokenSampler

TEXT = " Hello 你好, the wörld ends here. More text after the end, and 🙂 at last."


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-dense", device="cpu", show_progress=False)


@pytest.fixture
def scripted(llm, monkeypatch):
    """Make the model 'generate' TEXT, token by token; returns the scripted token ids."""
    script = llm.tokenizer.encode(TEXT, add_special_tokens=False).ids
    def scripted_tokens(self, logits, params, seeds, steps, extras=None):
        tokens = [script[s] for s in steps]
        return SampledTokens(np.array(tokens, np.int32), tokens=tokens)

    monkeypatch.setattr(TokenSampler, "sample_async", scripted_tokens)
    return script


def stream_texts(llm, params):
    outputs = list(llm.generate_stream(["Return the"], params))
    return [o.text for o in outputs], outputs[-1]


def test_the_script_splits_characters_across_tokens(llm, scripted):
    """(The premise of the tests below: some tokens end inside a character.)"""
    pieces = [llm.tokenizer.decode([t]) for t in scripted]
    assert any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("stop", [(), ("wörld",), ("ends here", "after"), ("你好",), ("🙂",), ("d e",)])
def test_streamed_text_only_grows_and_ends_as_generate_does(llm, scripted, stop):
    params = SamplingParams(max_tokens=len(scripted), temperature=0.0, ignore_eos=True, stop=list(stop))
    texts, final = stream_texts(llm, params)
    for before, after in zip(texts, texts[1:]):
        assert after.startswith(before), (before, after)
    assert not any("\ufffd" in text for text in texts)
    whole = llm.generate(["Return the"], params)[0]
    assert final.text == whole.text and final.token_ids == whole.token_ids
    hits = [TEXT.find(s) for s in stop if s in TEXT]
    expected = TEXT[: min(hits)] if hits else TEXT
    assert final.text == expected
    if hits:
        assert final.finish_reason == "stop" and final.stop_reason in stop
        # No unfinished output ever showed the start of the stop string that ended it.
        assert not any(final.stop_reason[0] in text[len(expected):] for text in texts[:-1])


def test_text_matches_the_tokenizer_when_the_last_character_is_complete(llm, scripted):
    params = SamplingParams(max_tokens=len(scripted), temperature=0.0, ignore_eos=True)
    output = llm.generate(["Return the"], params)[0]
    assert output.text == llm.tokenizer.decode(scripted, skip_special_tokens=True) == TEXT


def test_an_incomplete_last_character_is_left_out(llm, scripted):
    cut = next(n for n in range(1, len(scripted)) if llm.tokenizer.decode(scripted[:n]).endswith("\ufffd"))
    output = llm.generate(["Return the"], SamplingParams(max_tokens=cut, temperature=0.0, ignore_eos=True))[0]
    assert output.text == llm.tokenizer.decode(scripted[:cut]).rstrip("\ufffd")
    assert "\ufffd" not in output.text


def test_each_token_is_decoded_once(llm, scripted, monkeypatch):
    """Incremental decoding: the decoder steps once per generated token, whatever the output
    length, with or without stop strings to look for (a whole-text decode per token was O(n^2))."""
    steps = []
    original = generation.IncrementalText.advance

    def counting(self, generated):
        steps.append(len(generated) - self.num_tokens)
        return original(self, generated)

    monkeypatch.setattr(generation.IncrementalText, "advance", counting)
    for stop in ([], ["never in the text"]):
        steps.clear()
        params = SamplingParams(max_tokens=len(scripted), temperature=0.0, ignore_eos=True, stop=stop)
        list(llm.generate_stream(["Return the"], params))
        assert sum(steps) == len(scripted)
