"""Structured output through llguidance (metrale.structured) on the shipped tiny-dense tokenizer:
parameter checks, compile errors and the cache, and matchers driven token by token -- each step
a random allowed token taken from the bitmask -- whose decoded text must satisfy the constraint."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from metrale.errors import ConfigError, InvalidRequestError, KernelArgumentError
from metrale.structured import GrammarCompiler, StructuredOutputParams

pytest.importorskip("llguidance")
tokenizers = pytest.importorskip("tokenizers")

MODEL = Path(__file__).resolve().parents[2] / "metrale" / "models" / "tiny-dense"
VOCAB = json.loads((MODEL / "config.json").read_text())["vocab_size"]
EOS = 0
#: Logits wider than the tokenizer (as checkpoints pad their vocabulary), not a multiple of 32.
PADDED_VOCAB = VOCAB + 45

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"
ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
TOKENIZER = tokenizers.Tokenizer.from_file(str(MODEL / "tokenizer.json"))
#: Per token id: whether its text holds a character that closes a JSON string, object or array.
CLOSING = np.array([any(c in TOKENIZER.decode([t]) for c in '"}]') for t in range(VOCAB)] + [False] * (PADDED_VOCAB - VOCAB))
CHOICES = ["yes", "no", "maybe not", 'a "quoted" \\ choice', "émoji 😀"]


@pytest.fixture(scope="module")
def tokenizer():
    return TOKENIZER


@pytest.fixture(scope="module")
def compiler(tokenizer):
    assert tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB
    return GrammarCompiler(tokenizer, PADDED_VOCAB, [EOS])


def allowed_tokens(row):
    """The token ids whose bit is set (bit i of word w: token 32 w + i)."""
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def generate(matcher, rng, eos_ids=(EOS,), min_steps=4, patience=40, max_steps=600):
    """Drive ``matcher`` with random allowed tokens until it accepts an end-of-sequence token or is
    finished; returns the tokens before the end. Checks at every step that the mask never allows a
    token past the tokenizer and allows the end-of-sequence tokens exactly when accepting.

    End-of-sequence is taken once allowed after ``min_steps``; after ``patience`` steps, tokens
    holding a closing character are preferred, so JSON walks end."""
    row = np.zeros(matcher.words, np.int32)
    tokens = []
    for step in range(max_steps):
        if matcher.is_finished:
            return tokens
        matcher.fill_bitmask(row)
        allowed = allowed_tokens(row)
        assert allowed.size, f"nothing allowed after {tokens}"
        assert allowed.max() < VOCAB, f"tokens past the tokenizer allowed: {allowed[allowed >= VOCAB][:5]}"
        eos_allowed = [eos in allowed for eos in eos_ids]
        assert all(a == matcher.is_accepting for a in eos_allowed), (step, eos_allowed, matcher.is_accepting)
        if eos_allowed[0] and step >= min_steps:
            assert matcher.accept(eos_ids[0])
            return tokens
        others = allowed[~np.isin(allowed, eos_ids)]
        if not others.size:
            token = eos_ids[0]
        else:
            if step >= patience:
                closing = others[CLOSING[others]]
                others = closing if closing.size else others
            token = int(rng.choice(others))
        assert matcher.accept(token), f"an allowed token {token} was refused: {matcher.error}"
        if token in eos_ids:
            return tokens
        tokens.append(token)
    raise AssertionError(f"no end after {max_steps} tokens: {TOKENIZER.decode(tokens)!r}")


def check_person(value):
    assert isinstance(value, dict) and {"name", "age"} <= set(value) <= {"name", "age", "tags"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 12, value
    assert type(value["age"]) is int and 0 <= value["age"] <= 150, value
    if "tags" in value:
        assert isinstance(value["tags"], list) and len(value["tags"]) <= 3, value
        assert all(tag in ("a", "b", "c") for tag in value["tags"]), value


def parse_arithmetic(text):
    """Whether ``text`` is a sentence of ARITHMETIC (recursive descent over its three rules)."""
    position = 0

    def term():
        nonlocal position
        if text.startswith("(", position):
            position += 1
            if not expr() or not text.startswith(")", position):
                return False
            position += 1
            return True
        number = re.match(r"[0-9]{1,3}", text[position:])
        if number is None:
            return False
        position += number.end()
        return True

    def expr():
        nonlocal position
        if not term():
            return False
        while text.startswith(("+", "-"), position):
            position += 1
            if not term():
                return False
        return True

    return expr() and position == len(text)


# ------------------------------------------------------------------------------ parameters


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of json, json_object, regex, grammar, choice; got none"),
    ({"json_object": False}, "got none"),
    ({"regex": "a", "choice": ["a"]}, "got regex and choice"),
    ({"json": {"type": "object"}, "json_object": True}, "got json and json_object"),
    ({"json_object": "yes"}, "json_object must be True or False"),
    ({"json_object": 1}, "json_object must be True or False"),
    ({"json": 5}, "json must be a JSON schema object"),
    ({"json": "[1, 2]"}, "json must be a JSON schema object"),
    ({"json": "{not json"}, "json: the schema is not valid JSON"),
    ({"json": {"type": "object", "default": {1, 2}}}, "json: the schema cannot be written as JSON"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"regex": 3}, "regex must be a non-empty string"),
    ({"grammar": b"start: /a/"}, "grammar must be a non-empty string"),
    ({"choice": []}, "choice must be a non-empty list of strings"),
    ({"choice": "yes"}, "choice must be a non-empty list of strings"),
    ({"choice": ["yes", 1]}, "choice must hold strings only, got 1"),
])
def test_params_are_checked(kwargs, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        StructuredOutputParams(**kwargs)


def test_params_equal_by_canonical_text():
    as_dict = StructuredOutputParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    as_text = StructuredOutputParams(json='{"type": "object",\n "properties": {"a": {"type": "integer"}}}')
    assert as_dict == as_text and hash(as_dict) == hash(as_text) and as_dict.kind == "json"
    reordered = StructuredOutputParams(json={"properties": {"a": {"type": "integer"}}, "type": "object"})
    assert reordered != as_dict  # key order is the order properties are written in
    assert StructuredOutputParams(regex="a") != StructuredOutputParams(grammar="a")
    assert StructuredOutputParams(choice=["a", "b"]) == StructuredOutputParams(choice=("a", "b"))
    assert StructuredOutputParams(json_object=True).kind == "json_object"
    with pytest.raises(AttributeError):
        as_dict.regex = "b"  # frozen


# ------------------------------------------------------------------------------ generation


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_output_is_valid(compiler, tokenizer, seed):
    matcher = compiler.compile(StructuredOutputParams(json=PERSON)).matcher()
    text = tokenizer.decode(generate(matcher, np.random.default_rng(seed)))
    check_person(json.loads(text))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_object_output_is_an_object(compiler, tokenizer, seed):
    matcher = compiler.compile(StructuredOutputParams(json_object=True)).matcher()
    text = tokenizer.decode(generate(matcher, np.random.default_rng(seed), min_steps=8))
    assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_regex_output_matches(compiler, tokenizer, seed):
    matcher = compiler.compile(StructuredOutputParams(regex=EMAIL)).matcher()
    text = tokenizer.decode(generate(matcher, np.random.default_rng(seed)))
    assert re.fullmatch(EMAIL, text), text


@pytest.mark.parametrize("seed", range(6))
def test_choice_output_is_one_of_the_choices(compiler, tokenizer, seed):
    matcher = compiler.compile(StructuredOutputParams(choice=CHOICES)).matcher()
    text = tokenizer.decode(generate(matcher, np.random.default_rng(seed), min_steps=0))
    assert text in CHOICES, text


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lark_output_is_a_sentence(compiler, tokenizer, seed):
    assert parse_arithmetic("(1+22)-333") and not parse_arithmetic("1+") and not parse_arithmetic("1234")
    matcher = compiler.compile(StructuredOutputParams(grammar=ARITHMETIC)).matcher()
    text = tokenizer.decode(generate(matcher, np.random.default_rng(seed), min_steps=6))
    assert parse_arithmetic(text), text


def test_choices_all_come_out(compiler, tokenizer):
    compiled = compiler.compile(StructuredOutputParams(choice=CHOICES))
    seen = {tokenizer.decode(generate(compiled.matcher(), np.random.default_rng(seed), min_steps=0)) for seed in range(40)}
    assert seen == set(CHOICES)


def test_masked_logits_sample_only_allowed_tokens(compiler, tokenizer):
    """The bitmask through the logits mask's reference, then greedy picks: the output is valid."""
    from metrale.kernels.token_mask import apply_token_bitmask_reference

    rng = np.random.default_rng(5)
    matcher = compiler.compile(StructuredOutputParams(regex=r"[0-9]{2,5}(px|em)")).matcher()
    bitmask = compiler.allocate_bitmask(2)
    tokens = []
    while not matcher.is_finished:
        matcher.fill_bitmask(bitmask[1])
        logits = rng.standard_normal((2, PADDED_VOCAB)).astype(np.float32)
        apply_token_bitmask_reference(logits, bitmask, np.array([-1, 1], np.int32))
        assert np.isfinite(logits[0]).all()
        np.testing.assert_array_equal(np.flatnonzero(np.isfinite(logits[1])), allowed_tokens(bitmask[1]))
        token = int(np.argmax(logits[1]))
        assert matcher.accept(token)
        if token == EOS:
            break
        tokens.append(token)
    assert re.fullmatch(r"[0-9]{2,5}(px|em)", tokenizer.decode(tokens))


# -------------------------------------------------------------------- end of sequence, vocab


def test_eos_is_allowed_exactly_when_accepting(compiler, tokenizer):
    matcher = compiler.compile(StructuredOutputParams(regex="ab+")).matcher()
    row = np.zeros(compiler.words, np.int32)
    states = []
    for token in tokenizer.encode("abbb", add_special_tokens=False).ids:
        matcher.fill_bitmask(row)
        states.append((EOS in allowed_tokens(row), matcher.is_accepting))
        assert matcher.accept(token)
    matcher.fill_bitmask(row)
    states.append((EOS in allowed_tokens(row), matcher.is_accepting))
    assert states[0] == (False, False) and states[-1] == (True, True)
    assert all(eos == accepting for eos, accepting in states)
    assert not matcher.is_finished  # more b's may follow
    assert matcher.accept(EOS) and matcher.is_finished


def test_eos_is_refused_before_the_output_is_complete(compiler):
    matcher = compiler.compile(StructuredOutputParams(regex="ab+")).matcher()
    assert not matcher.accept(EOS)
    assert matcher.is_error and matcher.error and not matcher.is_finished


def test_every_eos_id_follows_the_accepting_state(tokenizer):
    second = VOCAB - 1
    compiler = GrammarCompiler(tokenizer, PADDED_VOCAB, [EOS, second])
    matcher = compiler.compile(StructuredOutputParams(regex=r"[0-9]{1,4}")).matcher()
    text = tokenizer.decode(generate(matcher, np.random.default_rng(3), eos_ids=(EOS, second), min_steps=2))
    assert re.fullmatch(r"[0-9]{1,4}", text), text
    other = compiler.compile(StructuredOutputParams(regex=r"[0-9]{1,4}")).matcher()
    assert other.accept(tokenizer.token_to_id("7")) and other.accept(second) and other.is_finished


def test_a_finished_matcher_allows_only_eos(compiler, tokenizer):
    matcher = compiler.compile(StructuredOutputParams(choice=["yes", "no"])).matcher()
    for token in tokenizer.encode("yes", add_special_tokens=False).ids:
        assert not matcher.is_finished and matcher.accept(token)
    assert matcher.is_finished and matcher.is_accepting
    row = np.zeros(compiler.words, np.int32)
    matcher.fill_bitmask(row)
    assert allowed_tokens(row).tolist() == [EOS]


def test_tokens_past_the_tokenizer_are_never_allowed(compiler):
    assert compiler.words == -(-PADDED_VOCAB // 32) and compiler.words * 32 > PADDED_VOCAB > VOCAB
    row = np.full(compiler.words, -1, np.int32)  # every bit set before: the fill must clear the tail
    for params, prefix in ((StructuredOutputParams(json_object=True), '{"'), (StructuredOutputParams(regex="(?s:.)+"), ""),
                           (StructuredOutputParams(grammar='start: /(?s:.)*/'), "")):
        matcher = compiler.compile(params).matcher()
        assert all(matcher.accept(t) for t in TOKENIZER.encode(prefix, add_special_tokens=False).ids)
        matcher.fill_bitmask(row)
        allowed = allowed_tokens(row)
        assert allowed.size > 100 and allowed.max() < VOCAB
        for token in (VOCAB, PADDED_VOCAB - 1):
            assert not matcher.accept(token) and matcher.is_error
    assert not compiler.compile(StructuredOutputParams(regex="a")).matcher().accept(PADDED_VOCAB)


class EverythingAllowed:
    """An llguidance matcher whose masks allow every token (to see what fill_bitmask enforces)."""

    def __init__(self, matcher):
        self.matcher = matcher

    def __getattr__(self, name):
        return getattr(self.matcher, name)

    def unsafe_compute_mask_ptr(self, pointer, size):
        import ctypes

        ctypes.memset(pointer, 0xFF, size)


@pytest.mark.parametrize("vocab_size", [PADDED_VOCAB, VOCAB + 32, 3000])
def test_fill_bitmask_enforces_the_vocabulary_and_eos(tokenizer, vocab_size):
    compiler = GrammarCompiler(tokenizer, vocab_size, [EOS, 7])
    matcher = compiler.compile(StructuredOutputParams(regex="ab")).matcher()
    matcher._matcher = EverythingAllowed(matcher._matcher)
    row = np.zeros(compiler.words, np.int32)
    matcher.fill_bitmask(row)
    limit = min(vocab_size, VOCAB)
    expected = np.setdiff1d(np.arange(limit), [EOS, 7])
    np.testing.assert_array_equal(allowed_tokens(row), expected)
    assert matcher.accept(tokenizer.token_to_id("ab")) and matcher.is_accepting
    matcher.fill_bitmask(row)
    np.testing.assert_array_equal(allowed_tokens(row), np.arange(limit))


def test_logits_narrower_than_the_tokenizer(tokenizer):
    compiler = GrammarCompiler(tokenizer, 3000, [EOS])
    assert compiler.words == 94
    matcher = compiler.compile(StructuredOutputParams(regex="(?s:.){1,30}")).matcher()
    row = np.zeros(94, np.int32)
    matcher.fill_bitmask(row)
    allowed = allowed_tokens(row)
    assert allowed.size > 2000 and allowed.max() < 3000
    tokens = []
    rng = np.random.default_rng(0)
    while not matcher.is_finished and len(tokens) < 40:
        matcher.fill_bitmask(row)
        allowed = allowed_tokens(row)
        assert allowed.max() < 3000
        token = int(rng.choice(allowed[allowed != EOS])) if (allowed != EOS).any() else EOS
        assert matcher.accept(token)
        if token == EOS:
            break
        tokens.append(token)
    assert 1 <= len(tokenizer.decode(tokens)) <= 30


# --------------------------------------------------------------------- errors and rollback


def test_a_refused_token_leaves_the_matcher_in_error(compiler, tokenizer):
    matcher = compiler.compile(StructuredOutputParams(regex="[0-9]+")).matcher()
    assert not matcher.accept(tokenizer.token_to_id("a"))
    assert matcher.is_error and "doesn't satisfy the grammar" in matcher.error
    row = np.full(compiler.words, -1, np.int32)
    matcher.fill_bitmask(row)
    assert (row == 0).all()
    assert not matcher.accept(tokenizer.token_to_id("1"))
    assert not matcher.accept(-3) and not matcher.is_finished and not matcher.is_accepting
    outside = compiler.compile(StructuredOutputParams(regex="[0-9]+")).matcher()
    assert not outside.accept(PADDED_VOCAB + 5) and "outside the vocabulary" in outside.error
    row[:] = -1
    outside.fill_bitmask(row)
    assert (row == 0).all()


def test_rollback_returns_to_earlier_masks(compiler, tokenizer):
    matcher = compiler.compile(StructuredOutputParams(json=PERSON)).matcher()
    tokens = tokenizer.encode('{"name":"Al","age":4', add_special_tokens=False).ids
    masks = []
    row = np.zeros(compiler.words, np.int32)
    for token in tokens:
        matcher.fill_bitmask(row)
        masks.append(row.copy())
        assert matcher.accept(token)
    assert matcher.num_tokens == len(tokens)
    matcher.rollback(3)
    matcher.fill_bitmask(row)
    np.testing.assert_array_equal(row, masks[-3])
    assert matcher.num_tokens == len(tokens) - 3
    with pytest.raises(InvalidRequestError, match="rollback"):
        matcher.rollback(len(tokens))
    matcher.rollback(len(tokens) - 3)
    matcher.fill_bitmask(row)
    np.testing.assert_array_equal(row, masks[0])


def test_rollback_of_eos_after_the_output_ended(compiler, tokenizer):
    matcher = compiler.compile(StructuredOutputParams(choice=["yes"])).matcher()
    tokens = tokenizer.encode("yes", add_special_tokens=False).ids
    assert all(matcher.accept(t) for t in tokens) and matcher.is_finished
    assert matcher.accept(EOS) and matcher.accept(EOS) and matcher.num_tokens == len(tokens) + 2
    matcher.rollback(2)
    assert matcher.is_finished and matcher.num_tokens == len(tokens)
    matcher.rollback(1)
    assert not matcher.is_finished
    row = np.zeros(compiler.words, np.int32)
    matcher.fill_bitmask(row)
    assert tokens[-1] in allowed_tokens(row) and EOS not in allowed_tokens(row)
    assert matcher.accept(tokens[-1]) and matcher.is_finished


WORDS = -(-PADDED_VOCAB // 32)


@pytest.mark.parametrize("make_row, message", [
    (lambda: np.zeros(10, np.int32), "shape \\[10\\]"),
    (lambda: np.zeros(WORDS, np.uint32), "dtype uint32"),
    (lambda: np.zeros((WORDS, 2), np.int32)[:, 0], "not a C-contiguous writable"),
    (lambda: [0] * WORDS, "list"),
])
def test_fill_bitmask_checks_its_row(compiler, make_row, message):
    matcher = compiler.compile(StructuredOutputParams(regex="a")).matcher()
    with pytest.raises(KernelArgumentError, match=message):
        matcher.fill_bitmask(make_row())


def test_fill_bitmask_refuses_a_read_only_row(compiler):
    row = np.zeros(WORDS, np.int32)
    row.setflags(write=False)
    with pytest.raises(KernelArgumentError, match="not a C-contiguous writable"):
        compiler.compile(StructuredOutputParams(regex="a")).matcher().fill_bitmask(row)


# ------------------------------------------------------------------------ compile and cache


@pytest.mark.parametrize("params, message", [
    (StructuredOutputParams(json={"type": "wat"}), "(?s)json: llguidance rejects it: .*wat"),
    (StructuredOutputParams(json={"type": "string", "format": "bogus"}), "Unknown format: bogus"),
    (StructuredOutputParams(json={"$ref": "#/nowhere"}), "nowhere"),
    (StructuredOutputParams(regex="a(b"), "(?s)regex: llguidance rejects it: .*unclosed group"),
    (StructuredOutputParams(grammar="start: undefined_rule"), "(?s)grammar: llguidance rejects it: .*unknown name"),
    (StructuredOutputParams(grammar="start: ("), "grammar: llguidance rejects it"),
])
def test_invalid_constraints_are_rejected(compiler, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        compiler.compile(params)


def test_compile_cache_returns_the_same_grammar(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, [EOS], cache_size=2)
    first = compiler.compile(StructuredOutputParams(json=PERSON))
    assert compiler.compile(StructuredOutputParams(json=json.dumps(PERSON, indent=2))) is first
    regex = compiler.compile(StructuredOutputParams(regex="a+"))
    assert regex is not first and compiler.compile(StructuredOutputParams(regex="a+")) is regex
    assert compiler.compile(StructuredOutputParams(json=PERSON)) is first  # now the most recent
    compiler.compile(StructuredOutputParams(choice=["x"]))  # evicts the regex, the least recent
    assert compiler.compile(StructuredOutputParams(json=PERSON)) is first
    assert compiler.compile(StructuredOutputParams(regex="a+")) is not regex
    one, two = first.matcher(), first.matcher()
    assert one is not two and one.accept(tokenizer.token_to_id("{")) and two.num_tokens == 0
    with pytest.raises(InvalidRequestError, match="StructuredOutputParams"):
        compiler.compile({"regex": "a"})


@pytest.mark.parametrize("vocab_size, eos, message", [
    (0, [EOS], "vocab_size must be an int >= 1"),
    (VOCAB, [], "eos_token_ids must be a non-empty list"),
    (VOCAB, EOS, "eos_token_ids must be a non-empty list"),
    (PADDED_VOCAB, [VOCAB + 1], f"{VOCAB + 1} is outside the tokenizer's vocabulary"),
    (3000, [3001], "3001 is outside"),
])
def test_compiler_arguments_are_checked(tokenizer, vocab_size, eos, message):
    with pytest.raises(ConfigError, match=message):
        GrammarCompiler(tokenizer, vocab_size, eos)


# ----------------------------------------------------------------------------- dependency


def test_a_missing_llguidance_says_how_to_install_it(tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now raises ImportError
    with pytest.raises(InvalidRequestError, match=re.escape('pip install "metrale[structured]"')):
        GrammarCompiler(tokenizer, VOCAB, [EOS])


def test_importing_metrale_does_not_import_llguidance():
    code = ("import sys, metrale, metrale.structured; "
            "from metrale.structured import StructuredOutputParams; StructuredOutputParams(regex='a'); "
            "print('llguidance' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_a_grammar_past_the_lexers_limits_is_refused_when_compiled(compiler):
    with pytest.raises(InvalidRequestError, match="llguidance cannot run it"):
        compiler.compile(StructuredOutputParams(regex="a{1000000000}"))
    compiler.compile(StructuredOutputParams(regex="a{1000}"))
