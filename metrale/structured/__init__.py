"""Structured output: generation held to a JSON schema, any JSON object, a regular expression, a
Lark grammar or a list of strings, through `llguidance <https://github.com/guidance-ai/llguidance>`_.

A request asks for one constraint with :class:`StructuredOutputParams` (the names are vLLM's
``StructuredOutputsParams``), exactly one of:

* ``json`` -- a JSON schema, as a dict or a JSON string: the output is one JSON value valid
  under it. llguidance implements most of JSON Schema draft 2020-12; a schema using a keyword it
  does not implement (``uniqueItems``, for one) is rejected rather than half enforced, while
  annotations (``title``, ``description``, ...) are ignored. Properties come in the schema's
  order, and the JSON has no whitespace between its tokens (unless the schema's ``x-guidance``
  options set ``whitespace_flexible``: free whitespace lets a weak model write newlines until
  ``max_tokens``);
* ``json_object=True`` -- any JSON object (the schema ``{"type": "object"}``);
* ``regex`` -- the output matches the regular expression as a whole (Rust ``regex`` syntax,
  anchored at both ends);
* ``grammar`` -- the output is a sentence of the Lark grammar, in llguidance's dialect
  (``start`` is the start rule; terminals may be ``/regex/`` or ``"literal"``, and
  ``%json {...}`` embeds a JSON schema);
* ``choice`` -- the output is exactly one of the strings.

**How the constraint is applied.** A :class:`GrammarCompiler`, built once per tokenizer, turns
the parameters into a :class:`CompiledGrammar` (kept in a bounded LRU cache keyed by the
constraint's canonical text, since a server sees the same schema many times); each request
gets its own :class:`GrammarMatcher` from :meth:`CompiledGrammar.matcher`. Before every
sampled token the engine asks the matcher for the allowed tokens
(:meth:`GrammarMatcher.fill_bitmask`, one bit per token in int32 words, llguidance's layout)
and the logits of every other token are set to -inf before sampling
(:func:`metrale.kernels.token_mask.apply_token_bitmask` on the GPU, its NumPy reference on the
CPU), so temperature, top-k and top-p then act on the allowed tokens alone; the sampled token
is handed to :meth:`GrammarMatcher.accept`. End-of-sequence tokens are allowed exactly when the
output so far is complete (the grammar is in an accepting state); once nothing more can follow
(:attr:`GrammarMatcher.is_finished`) only they are allowed. Token ids past the tokenizer's
vocabulary (the padding columns of a checkpoint's logits) are never allowed.

**Dependency.** llguidance is an optional dependency, the extra ``structured``
(``pip install "metrale[structured]"``). ``import metrale`` (and ``import metrale.structured``)
never imports it: it is imported when a :class:`GrammarCompiler` is built, and a missing
llguidance raises :class:`~metrale.errors.InvalidRequestError` saying how to install it. Only
the ``tokenizers.Tokenizer`` is needed (its JSON goes to ``llguidance.LLTokenizer``), not
transformers.

**Errors.** Bad parameters, and a schema, regular expression or grammar llguidance rejects, raise
:class:`~metrale.errors.InvalidRequestError` with llguidance's message. So does a constraint that
admits no output at all (an unsatisfiable schema, a grammar whose language is empty): nothing
could be sampled for it.

**Isolation.** A constraint is compiled in the serving process only after it passed the size
limit and compiled in a worker process of its own (:mod:`metrale.structured.sandbox`), so a
constraint that crashes llguidance, or takes too long, costs its request a 400 and nothing more.

**Threading.** :meth:`GrammarCompiler.compile` and :meth:`GrammarCompiler.check` may be called
from several threads (a lock serialises them; an event loop calls them on a worker thread).
A :class:`GrammarMatcher` must not be used from two threads at once (llguidance releases the GIL
while it computes a mask). Matchers of different requests are independent and share only
immutable state.
"""

from __future__ import annotations

import json as jsonlib
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from metrale.errors import ConfigError, InvalidRequestError, KernelArgumentError
from metrale.structured.sandbox import GrammarSandbox, check_constraint_size

if TYPE_CHECKING:  # pragma: no cover
    import tokenizers

logger = logging.getLogger(__name__)

INSTALL_HINT = 'pip install "metrale[structured]"'

#: Compiled grammars a :class:`GrammarCompiler` keeps by default.
DEFAULT_CACHE_SIZE = 64

#: The constraint fields of :class:`StructuredOutputParams`, in order.
KINDS = ("json", "json_object", "regex", "grammar", "choice")

ANY_JSON_OBJECT = '{"type":"object"}'


def _llguidance() -> Any:
    """The ``llguidance`` module, imported on first use."""
    try:
        import llguidance
    except ImportError as error:
        raise InvalidRequestError(
            f"structured output needs llguidance, which is not installed ({error}); install it with: {INSTALL_HINT}"
        ) from None
    return llguidance


def _schema_text(value: Any) -> str:
    """The canonical text of a ``json`` schema: compact JSON, keys in their given order (the
    order llguidance writes properties in)."""
    if isinstance(value, str):
        try:
            value = jsonlib.loads(value)
        except ValueError as error:
            raise InvalidRequestError(f"json: the schema is not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"json must be a JSON schema object (a dict or a JSON string of one), got {value!r}")
    try:
        return jsonlib.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise InvalidRequestError(f"json: the schema cannot be written as JSON ({error})") from None


@dataclass(frozen=True, eq=False)
class StructuredOutputParams:
    """The constraint of one request: exactly one of the fields below (see the module docstring).

    * ``json`` -- a JSON schema, a dict or a JSON string of an object;
    * ``json_object`` -- True for any JSON object;
    * ``regex`` -- a regular expression the whole output matches (a non-empty string);
    * ``grammar`` -- a Lark grammar in llguidance's dialect (a non-empty string);
    * ``choice`` -- a non-empty list of strings, one of which is the output.

    The values are checked, and the constraint's canonical text is taken, at construction: a bad
    value raises :class:`~metrale.errors.InvalidRequestError` naming the field, and later changes
    to a dict or list passed in are not seen. Two parameters are equal (and hash alike) when their
    canonical texts are: a schema given as a dict equals the same schema as a JSON string.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    #: (kind, canonical text): what the compile cache is keyed by.
    key: tuple[str, str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, (bool, np.bool_)):
            raise InvalidRequestError(f"json_object must be True or False, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise InvalidRequestError(f"choice must be a non-empty list of strings, got {self.choice!r}")
            bad = [c for c in self.choice if not isinstance(c, str)]
            if bad:
                raise InvalidRequestError(f"choice must hold strings only, got {bad[0]!r} in {list(self.choice)!r}")
        given = [name for name in KINDS if (self.json_object if name == "json_object" else getattr(self, name) is not None)]
        if len(given) != 1:
            found = " and ".join(given) if given else "none"
            raise InvalidRequestError(f"StructuredOutputParams takes exactly one of {', '.join(KINDS)}; got {found}")
        kind = given[0]
        if kind == "json":
            text = _schema_text(self.json)
        elif kind == "json_object":
            text = ANY_JSON_OBJECT
        elif kind == "choice":
            text = jsonlib.dumps(list(self.choice or ()), ensure_ascii=False)
        else:
            text = getattr(self, kind)
        object.__setattr__(self, "key", (kind, text))

    @property
    def kind(self) -> str:
        """Which constraint this is: ``json``, ``json_object``, ``regex``, ``grammar`` or ``choice``."""
        return self.key[0]

    @classmethod
    def from_key(cls, kind: str, text: str) -> "StructuredOutputParams":
        """The parameters whose :attr:`key` is ``(kind, text)``."""
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "choice":
            return cls(choice=jsonlib.loads(text))
        if kind not in KINDS:
            raise InvalidRequestError(f"unknown structured output kind {kind!r} (one of {', '.join(KINDS)})")
        if kind == "json":
            return cls(json=text)
        return cls(regex=text) if kind == "regex" else cls(grammar=text)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StructuredOutputParams):
            return NotImplemented
        return self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


#: What the JSON of a constraint embedded in a Lark grammar (:func:`after_prefix`) is written with
#: unless its schema says otherwise: no whitespace between tokens, as for a plain ``json`` one.
_COMPACT_JSON = {"whitespace_flexible": False}


def after_prefix(params: StructuredOutputParams, prefix_rules: str) -> StructuredOutputParams:
    """``params``' constraint applied after a prefix the grammar lets pass: a ``grammar``
    constraint (llguidance's Lark) whose ``start`` is the rule ``reasoning_prefix``, which
    ``prefix_rules`` define (:meth:`metrale.entrypoints.parsers.ReasoningParser.structured_output_prefix`),
    then the constraint itself -- a JSON schema as ``%json``, a regular expression as a
    terminal, a choice as alternatives, a grammar nested with ``%lark``. Raises
    :class:`~metrale.errors.InvalidRequestError` when ``params`` is not a
    :class:`StructuredOutputParams`."""
    if not isinstance(params, StructuredOutputParams):
        raise InvalidRequestError(f"structured output must be given as StructuredOutputParams, got {params!r}")
    kind, text = params.key
    if kind in ("json", "json_object"):
        schema = jsonlib.loads(text)
        schema = {"x-guidance": _COMPACT_JSON, **schema}
        answer = "%json " + jsonlib.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    elif kind == "regex":
        answer = "/" + re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", text) + "/"
    elif kind == "choice":
        answer = " | ".join(jsonlib.dumps(choice, ensure_ascii=False) for choice in jsonlib.loads(text))
    else:
        answer = "%lark {\n" + text + "\n}"
    grammar = f"%llguidance {{}}\nstart: reasoning_prefix structured_answer\nstructured_answer: {answer}\n{prefix_rules}"
    return StructuredOutputParams(grammar=grammar)


class GrammarCompiler:
    """Compiles :class:`StructuredOutputParams` for one tokenizer (build one per model).

    ``vocab_size`` is the width of the model's logits, which may exceed the tokenizer's
    vocabulary: the tokens past the tokenizer are never allowed. ``eos_token_ids`` are the ids
    that end a sequence (at least one, each inside the tokenizer's vocabulary); every one of them
    is allowed exactly when the output is complete. A bad argument raises
    :class:`~metrale.errors.ConfigError`; a missing llguidance
    :class:`~metrale.errors.InvalidRequestError`. ``cache_size`` bounds the compiled grammars kept
    (least recently used first out). ``isolated`` (the default) checks every new constraint in a
    :class:`~metrale.structured.sandbox.GrammarSandbox` before compiling it here; only a process
    whose constraints were all checked elsewhere turns it off.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int, eos_token_ids: Sequence[int], *,
                 cache_size: int = DEFAULT_CACHE_SIZE, isolated: bool = True) -> None:
        llguidance = _llguidance()
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
            raise ConfigError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        if isinstance(cache_size, bool) or not isinstance(cache_size, (int, np.integer)) or cache_size < 1:
            raise ConfigError(f"cache_size must be an int >= 1, got {cache_size!r}")
        eos = list(eos_token_ids) if isinstance(eos_token_ids, (list, tuple)) else None
        if not eos or any(isinstance(e, bool) or not isinstance(e, (int, np.integer)) for e in eos):
            raise ConfigError(f"eos_token_ids must be a non-empty list of token ids, got {eos_token_ids!r}")
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(int(e) for e in eos)
        self.tokenizer_vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        #: The tokens that can ever be allowed: ``[0, allowed_limit)``.
        self.allowed_limit = min(self.vocab_size, self.tokenizer_vocab_size)
        bad = [e for e in self.eos_token_ids if not 0 <= e < self.allowed_limit]
        if bad:
            raise ConfigError(f"eos_token_ids {list(self.eos_token_ids)}: {bad[0]} is outside the tokenizer's vocabulary "
                              f"and the logits ({self.allowed_limit} tokens)")
        #: int32 words of one bitmask row: ``ceil(vocab_size / 32)``.
        self.words = -(-self.vocab_size // 32)
        # llguidance's vocabulary is at least the tokenizer's (it refuses a smaller one).
        self._llg_vocab = max(self.vocab_size, self.tokenizer_vocab_size)
        spec = jsonlib.loads(tokenizer.to_str())
        spec["padding"] = None  # as llguidance.hf does: no padding or truncation while it reads tokens
        spec["truncation"] = None
        try:
            self._tokenizer = llguidance.LLTokenizer(jsonlib.dumps(spec), n_vocab=self._llg_vocab,
                                                     eos_token=list(self.eos_token_ids))
        except ValueError as error:
            raise ConfigError(f"llguidance cannot read the tokenizer: {error}") from None
        self.cache_size = int(cache_size)
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        #: Where new constraints are checked first (None: not isolated).
        self.sandbox = GrammarSandbox(tokenizer.to_str(), self.vocab_size, self.eos_token_ids) if isolated else None

    def compile(self, params: StructuredOutputParams) -> CompiledGrammar:
        """The compiled grammar of ``params`` (the cached one when the same constraint was
        compiled before); raises :class:`~metrale.errors.InvalidRequestError` with llguidance's
        message when it rejects the schema, regular expression or grammar, and naming the limit
        when it is over one (:mod:`metrale.structured.sandbox`)."""
        params = self._checked_type(params)
        with self._lock:
            cached = self._cache.get(params.key)
            if cached is not None:
                self._cache.move_to_end(params.key)
                return cached
            self._check(params)
            compiled = self._compile(params)
            self._cache[params.key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return compiled

    def check(self, params: StructuredOutputParams) -> None:
        """Check ``params`` as :meth:`compile` does, without compiling it in this process (the
        callers' side of an engine in another process, which compiles it there)."""
        params = self._checked_type(params)
        with self._lock:
            if params.key not in self._cache:
                self._check(params)

    def is_compiled(self, params: StructuredOutputParams) -> bool:
        """Whether :meth:`compile` would return ``params``' grammar from its cache."""
        return isinstance(params, StructuredOutputParams) and params.key in self._cache

    def close(self) -> None:
        """Stop the sandbox's worker process (a later compile starts another)."""
        if self.sandbox is not None:
            self.sandbox.close()

    @staticmethod
    def _checked_type(params: Any) -> StructuredOutputParams:
        if not isinstance(params, StructuredOutputParams):
            raise InvalidRequestError(f"structured output must be given as StructuredOutputParams, got {params!r}")
        return params

    def _check(self, params: StructuredOutputParams) -> None:
        kind, text = params.key
        check_constraint_size(kind, text)
        if self.sandbox is not None:
            self.sandbox.check(kind, text)

    def _compile(self, params: StructuredOutputParams) -> CompiledGrammar:
        llguidance = _llguidance()
        kind, text = params.key
        try:
            if kind in ("json", "json_object"):
                # Compact JSON unless the schema's "x-guidance" options say otherwise: free
                # whitespace lets a weak model emit newlines until max_tokens.
                grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(text)
            elif kind == "grammar":
                grammar = llguidance.LLMatcher.grammar_from_lark(text)
            else:
                grammar = llguidance.grammar_from("choice", text)
        except ValueError as error:
            raise InvalidRequestError(f"{kind}: {error}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise InvalidRequestError(f"{kind}: llguidance rejects it: {messages[0].strip()}")
        for message in messages:
            logger.warning("structured output (%s): %s", kind, message.strip())
        prototype = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if prototype.is_error():
            raise InvalidRequestError(f"{kind}: llguidance rejects it: {prototype.get_error().strip()}")
        compiled = CompiledGrammar(self, params, grammar, prototype)
        self._probe(compiled, kind)
        return compiled

    @staticmethod
    def _probe(compiled: "CompiledGrammar", kind: str) -> None:
        """Run the first token of a matcher: a grammar llguidance accepts can still exceed its
        lexer's limits (``a{1000000000}``), which shows only once a token is consumed, and one
        that allows no first token at all (not even the end) admits no output."""
        matcher = compiled.matcher()
        row = np.zeros(compiled.compiler.words, dtype=np.int32)
        matcher.fill_bitmask(row)
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        if not len(allowed):
            reason = matcher.error.splitlines()[0] if matcher.error else "no token can start an output"
            raise InvalidRequestError(f"{kind}: the constraint admits no output, so nothing could be generated under it "
                                      f"(an unsatisfiable schema or an empty language; llguidance: {reason})")
        first = next((int(t) for t in allowed if t not in compiled.compiler.eos_token_ids), None)
        if first is not None and not matcher.accept(first):
            reason = (matcher.error or "").splitlines()[0] if matcher.error else "it rejects every token"
            raise InvalidRequestError(f"{kind}: llguidance cannot run it: {reason}")

    def allocate_bitmask(self, rows: int) -> np.ndarray:
        """An int32 bitmask ``[rows, words]`` allowing every token (each row for :meth:`GrammarMatcher.fill_bitmask`)."""
        return np.full((rows, self.words), -1, dtype=np.int32)


class CompiledGrammar:
    """A validated grammar for one tokenizer (from :meth:`GrammarCompiler.compile`); immutable,
    shared by every request with the same constraint."""

    def __init__(self, compiler: GrammarCompiler, params: StructuredOutputParams, grammar: str, prototype: Any) -> None:
        self.compiler = compiler
        self.params = params
        #: The llguidance grammar (its JSON form).
        self.grammar = grammar
        self._prototype = prototype

    def matcher(self) -> GrammarMatcher:
        """A new matcher at the start of the output (a copy of one built at compile time, so no
        grammar is rebuilt per request)."""
        return GrammarMatcher(self, self._prototype.deep_copy())

    def __repr__(self) -> str:
        return f"CompiledGrammar({self.params!r})"


class GrammarMatcher:
    """One request's place in its grammar (from :meth:`CompiledGrammar.matcher`).

    Per token: :meth:`fill_bitmask` gives the allowed tokens, the engine masks the logits and
    samples, :meth:`accept` advances by the sampled token. A token that is not allowed puts the
    matcher in error for good (:attr:`error` says why): from then on it allows nothing, so a
    row masked by it has no token to sample (the sampler gives -1 and the engine fails the
    request). Not thread-safe (see the module docstring).
    """

    def __init__(self, compiled: CompiledGrammar, matcher: Any) -> None:
        self.compiled = compiled
        compiler = compiled.compiler
        self.vocab_size, self.words = compiler.vocab_size, compiler.words
        self._matcher = matcher
        self._eos = [(e >> 5, np.uint32(1 << (e & 31))) for e in compiler.eos_token_ids]
        # Words of llguidance's mask, and the first word holding a token past allowed_limit.
        self._llg_words = -(-compiler._llg_vocab // 32)
        self._scratch = np.empty(self._llg_words, dtype=np.int32) if self._llg_words != self.words else None
        limit = compiler.allowed_limit
        self._tail_word = limit >> 5
        self._tail_keep = np.uint32((1 << (limit & 31)) - 1)
        self._recorded = 0  # tokens llguidance holds (what it can roll back)
        self._trailing_eos = 0  # end-of-sequence tokens accepted after it stopped (it keeps none of them)
        self._error: str | None = None

    @property
    def error(self) -> str | None:
        """Why the matcher is in error (a token that was not allowed), or None."""
        if self._error is None and self._matcher.is_error():
            self._error = self._matcher.get_error().strip()
        return self._error

    @property
    def is_error(self) -> bool:
        return self.error is not None

    @property
    def is_accepting(self) -> bool:
        """Whether the output so far is complete (an end-of-sequence token is allowed)."""
        return not self.is_error and bool(self._matcher.is_accepting())

    @property
    def is_finished(self) -> bool:
        """Whether the output is complete and nothing more can follow: only end-of-sequence
        tokens are allowed (the engine may finish the request without sampling one)."""
        return not self.is_error and bool(self._matcher.is_stopped())

    @property
    def num_tokens(self) -> int:
        """Tokens accepted so far (less those rolled back)."""
        return self._recorded + self._trailing_eos

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the tokens allowed next into ``row``: int32 ``[words]`` (``words =
        ceil(vocab_size / 32)``, C-contiguous, writable), bit ``i`` of word ``w`` set when token
        ``32 * w + i`` is allowed. Raises :class:`~metrale.errors.KernelArgumentError` for a row of
        another dtype, shape or layout."""
        if not isinstance(row, np.ndarray) or row.dtype != np.int32 or row.shape != (self.words,):
            found = f"dtype {row.dtype}, shape {list(row.shape)}" if isinstance(row, np.ndarray) else repr(type(row))
            raise KernelArgumentError(f"fill_bitmask: row has {found}, expected int32 [{self.words}]")
        if not row.flags["C_CONTIGUOUS"] or not row.flags["WRITEABLE"]:
            raise KernelArgumentError(f"fill_bitmask: row (shape {list(row.shape)}) is not a C-contiguous writable array")
        if self._scratch is None:
            self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        else:
            self._matcher.unsafe_compute_mask_ptr(self._scratch.ctypes.data, self._scratch.nbytes)
            row[:] = self._scratch[: self.words]
        if self.is_error:  # refused before, or the parser failed computing the mask (a resource limit)
            row[:] = 0
            return
        # Enforced here whatever llguidance wrote: nothing past the tokenizer or the logits, and
        # end-of-sequence exactly when the output is complete.
        bits = row.view(np.uint32)
        if self._tail_word < self.words:
            bits[self._tail_word] &= self._tail_keep
            bits[self._tail_word + 1:] = 0
        accepting = bool(self._matcher.is_accepting())
        for word, bit in self._eos:
            if accepting:
                bits[word] |= bit
            else:
                bits[word] &= ~bit

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (and the matcher is in error from then on) when it was not
        allowed."""
        if self.is_error:
            return False
        token = int(token)
        if not 0 <= token < self.vocab_size:
            self._error = f"token {token} is outside the vocabulary [0, {self.vocab_size})"
            return False
        stopped = bool(self._matcher.is_stopped())
        if not self._matcher.consume_token(token):
            self._error = self._matcher.get_error().strip() or f"token {token} is not allowed here"
            return False
        if stopped:
            self._trailing_eos += 1  # once stopped, llguidance takes end-of-sequence tokens without keeping them
        else:
            self._recorded += 1
        return True

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` accepted tokens (cheap: llguidance keeps its states), as
        speculative decoding needs for rejected draft tokens. It does not leave an error state.
        Raises :class:`~metrale.errors.InvalidRequestError` when fewer tokens were accepted."""
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or not 0 <= count <= self.num_tokens:
            raise InvalidRequestError(f"rollback: count must be an int in [0, {self.num_tokens}], got {count!r}")
        eos = min(int(count), self._trailing_eos)
        recorded = int(count) - eos
        if recorded and not self._matcher.rollback(recorded):
            raise InvalidRequestError(f"rollback of {count} tokens failed: {self._matcher.get_error().strip()}")
        self._trailing_eos -= eos
        self._recorded -= recorded
