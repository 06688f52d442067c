"""The request side of a model: :class:`PromptFrontend`, everything that turns a user's prompt and
options into a checked request without touching the weights.

A front end holds the checkpoint's tokenizer, its chat template, its sampling defaults
(``generation_config.json``), its pooling defaults (sentence-transformers' ``modules.json``,
:func:`pooling_defaults`) and a structured-output compiler, and knows the model's vocabulary
size and context length. :class:`~metrale.LLM` is one (it adds the weights and the engine); the
HTTP front end of an :class:`~metrale.entrypoints.engine_process.EngineProcess` is another, in a process
that never loads a weight.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from metrale.entrypoints.prompts import TokenizedPrompt, check_prompt_agreement, check_text, parse_prompt, parse_token_ids
from metrale.errors import (
    EmptyPromptError,
    InvalidRequestError,
    PromptTooLongError,
    TokenizerMissingError,
    TokenOutOfRangeError,
)
from metrale.loading.checkpoint import Checkpoint
from metrale.params import PoolingParams, SamplingParams, generation_defaults
from metrale.validation import check_bool

logger = logging.getLogger(__name__)

#: sentence-transformers' pooling modes (``1_Pooling/config.json``: a ``pooling_mode_*`` flag, or
#: a ``pooling_mode`` name) that pooling requests serve, and how they are served.
_SENTENCE_TRANSFORMERS_MODES = {"lasttoken": "last", "mean_tokens": "mean", "mean": "mean"}


def bos_token_id(checkpoint: Checkpoint) -> int | None:
    """The beginning-of-sequence id of ``generation_config.json`` or ``config.json`` (None when
    neither names an int)."""
    for source in (checkpoint.generation_config, checkpoint.config):
        value = source.get("bos_token_id")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def pooling_defaults(folder: Path) -> PoolingParams:
    """How a model's embeddings pool when a request does not say: as the checkpoint's
    sentence-transformers configuration says when ``folder`` has one (``modules.json``: its
    ``Pooling`` module's ``config.json`` -- ``pooling_mode_lasttoken`` or
    ``pooling_mode_mean_tokens`` -- and whether a ``Normalize`` module follows), else last-token
    pooling, normalized (as Qwen3-Embedding and vLLM's embedding models pool). A configuration
    that asks for what is not served (another pooling mode, a ``Dense`` projection) is logged
    and the rest of it kept."""
    default = PoolingParams("last", True)
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return default
    try:
        modules = json.loads(modules_path.read_text(encoding="utf-8"))
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise ValueError("not a list of modules")
        kinds = [str(module.get("type", "")).rsplit(".", 1)[-1] for module in modules]
        pooling = default.pooling
        for module, kind in zip(modules, kinds):
            if kind == "Pooling":
                config = json.loads((folder / str(module.get("path", "")) / "config.json").read_text(encoding="utf-8"))
                named = config.get("pooling_mode")
                modes = [named] if isinstance(named, str) else [
                    key.removeprefix("pooling_mode_") for key, value in config.items()
                    if key.startswith("pooling_mode_") and value is True]
                if len(modes) == 1 and modes[0] in _SENTENCE_TRANSFORMERS_MODES:
                    pooling = _SENTENCE_TRANSFORMERS_MODES[modes[0]]
                else:
                    logger.warning("%s asks for pooling %s, which is not served (last token or mean only); "
                                   "embeddings pool the last token unless a request says otherwise",
                                   modules_path, modes)
        unserved = sorted({kind for kind in kinds if kind not in ("Transformer", "Pooling", "Normalize")})
        if unserved:
            logger.warning("%s names modules %s, which embeddings do not run", modules_path, unserved)
        return PoolingParams(pooling, "Normalize" in kinds)
    except (OSError, ValueError, TypeError, AttributeError) as error:
        logger.warning("%s could not be read (%s); embeddings pool the last token, normalized", modules_path, error)
        return default


class PromptFrontend:
    """Tokenization, chat rendering and request checks for one checkpoint (see the module
    docstring). ``vocab_size`` and ``max_model_len`` are the loaded model's; ``chat_template``
    (a ``.jinja`` file or Jinja source) overrides the checkpoint's."""

    def __init__(self, checkpoint: Checkpoint, *, vocab_size: int, max_model_len: int,
                 chat_template: str | Path | None = None, tokenizer_path: str | Path | None = None) -> None:
        from metrale.entrypoints.chat import ChatTemplate
        from metrale.loading.checkpoint import load_tokenizer

        self.checkpoint = checkpoint
        self.vocab_size = int(vocab_size)
        self.max_model_len = int(max_model_len)
        #: The folder of the tokenizer and chat template (``tokenizer=``; the checkpoint's by default).
        self.tokenizer_path = Path(tokenizer_path) if tokenizer_path is not None else checkpoint.path
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        #: The chat template (:class:`~metrale.entrypoints.chat.ChatTemplate`) that chat requests are rendered
        #: with: the ``chat_template`` option (a ``.jinja`` file or Jinja source), else the
        #: checkpoint's (``chat_template.jinja``, or ``tokenizer_config.json``'s
        #: ``chat_template``); None when there is none.
        self.chat_template = ChatTemplate.from_checkpoint(self.tokenizer_path, chat_template)
        self.eos_token_ids = checkpoint.eos_token_ids()
        self.bos_token_id = bos_token_id(checkpoint)
        #: The sampling defaults of the checkpoint's ``generation_config.json`` (see
        #: :func:`~metrale.params.generation_defaults`): they fill the fields a request's
        #: :class:`SamplingParams` does not set explicitly.
        self.sampling_defaults = generation_defaults(checkpoint.generation_config)
        #: How embeddings pool when a request leaves it to the model (:func:`pooling_defaults`).
        self.default_pooling = pooling_defaults(checkpoint.path)
        #: Why the engine serves no pooling requests (embeddings), None when it does; the
        #: length of its vectors (``hidden_size``), None when unknown. Set by whoever knows the
        #: loaded model (:class:`~metrale.LLM`, an engine process's ready message).
        self.pooling_unavailable: str | None = None
        self.embedding_size: int | None = None
        self._grammars: Any = None
        #: Whether new structured-output constraints are checked in a worker process before they
        #: are compiled here (:mod:`metrale.structured.sandbox`); off only in a process whose requests
        #: were all checked by another (an engine process: its callers' side checks them).
        self.isolate_grammars = True

    # ----------------------------------------------------------------------------- tokens

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's special tokens, such as BOS, unless
        ``add_special_tokens`` is False; a text that already starts with the BOS token does not
        get a second one)."""
        text = check_text(text, "the text to encode")
        if self.tokenizer is None:
            raise TokenizerMissingError(f"{self.tokenizer_path} has no tokenizer.json; pass token ids instead of {text!r}")
        ids = list(self.tokenizer.encode(text, add_special_tokens=check_bool("add_special_tokens", add_special_tokens)).ids)
        bos = self.bos_token_id
        if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
            bos_text = self.tokenizer.id_to_token(bos)
            if bos_text and text.startswith(bos_text):
                ids = ids[1:]
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (special tokens skipped)."""
        if not isinstance(token_ids, (list, tuple, np.ndarray)):
            raise InvalidRequestError(f"decode() takes a list of token ids, got {token_ids!r}")
        ids = parse_token_ids(token_ids, "token_ids")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise TokenOutOfRangeError(f"token_ids holds token id {bad[0]}, outside [0, {self.vocab_size})")
        if self.tokenizer is None:
            raise TokenizerMissingError(f"{self.tokenizer_path} has no tokenizer.json")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------------------------- chat

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True, tools: Any = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """The token ids of one conversation rendered by the chat template (as transformers'
        ``apply_chat_template(..., tokenize=True)``: special tokens the template writes are not
        added again). Raises :class:`~metrale.errors.InvalidRequestError` for bad messages, or
        when the model has no chat template (pass ``chat_template=``)."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                            **template_kwargs), add_special_tokens=False)

    def render_chat(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True, tools: Any = None,
        **template_kwargs: Any,
    ) -> str:
        """The text of one conversation rendered by the chat template (see
        :meth:`apply_chat_template`)."""
        if self.chat_template is None:
            raise InvalidRequestError(
                f"{self.tokenizer_path} has no chat template (tokenizer_config.json or chat_template.jinja); "
                "pass chat_template= (a .jinja file or its source)")
        return self.chat_template.render(list(messages),
                                         add_generation_prompt=check_bool("add_generation_prompt", add_generation_prompt),
                                         tools=tools, **template_kwargs)

    # --------------------------------------------------------------------------- requests

    def prompt_ids(self, prompt: Any, label: str) -> tuple[str | None, list[int]]:
        """The text (None for token ids) and the token ids of one prompt (see
        :mod:`metrale.entrypoints.prompts`), checked against the model; ``label`` names it in errors. A
        dict with both ``prompt`` and ``prompt_token_ids`` must agree
        (:func:`~metrale.entrypoints.prompts.check_prompt_agreement`), and without a tokenizer cannot be
        checked (:class:`~metrale.errors.TokenizerMissingError`); a
        :class:`~metrale.entrypoints.prompts.TokenizedPrompt` is not tokenized again."""
        parsed = parse_prompt(prompt, label)
        ids = parsed.token_ids if parsed.token_ids is not None else self.encode(parsed.text or '')
        if not ids:
            raise EmptyPromptError(f"{label} has no tokens")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise TokenOutOfRangeError(f"{label} holds token id {bad[0]}, outside [0, {self.vocab_size})")
        if len(ids) > self.max_model_len:
            raise PromptTooLongError(f"{label} has {len(ids)} tokens, more than the model's context of {self.max_model_len}")
        if parsed.check_agreement and parsed.text is not None:
            if self.tokenizer is None:
                raise TokenizerMissingError(
                    f"{label} gives both 'prompt' and 'prompt_token_ids', but {self.checkpoint.path} has no "
                    "tokenizer.json to check that they agree; give 'prompt_token_ids' alone")
            check_prompt_agreement(parsed.text, ids, self.encode, label)
        return parsed.text, ids

    def tokenized_prompt(self, token_ids: list[int], text: str | None = None) -> TokenizedPrompt:
        """The prompt of ``token_ids`` that the caller encoded from ``text`` with :meth:`encode`
        (with or without special tokens): its requests skip the check that tokenizes ``text``
        again. Only for ids made from that text; a user's dict is checked."""
        prompt = TokenizedPrompt(prompt_token_ids=token_ids)
        if text is not None:
            prompt["prompt"] = text
        return prompt

    def request_params(self, params: Any) -> SamplingParams:
        """A request's own copy of ``params`` (later edits of the caller's object do not reach
        it), with the checkpoint's defaults filled in, checked against the model (structured
        output and stop strings need a tokenizer: :class:`~metrale.errors.TokenizerMissingError`)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {params!r}")
        own = copy.copy(params).with_defaults(self.sampling_defaults)
        own.check_for_model(self.vocab_size)
        if own.structured_output is not None and self.tokenizer is None:
            raise TokenizerMissingError(f"{self.tokenizer_path} has no tokenizer.json: structured output needs one")
        if own.stop and self.tokenizer is None:
            # Stop strings are looked for in the decoded text, which needs the tokenizer: they would never fire.
            raise TokenizerMissingError(f"stop={list(own.stop)!r}: {self.checkpoint.path} has no tokenizer.json, and stop "
                                        "strings are found in the decoded text; use stop_token_ids")
        return own

    def pooling_params(self, params: Any) -> PoolingParams:
        """A pooling request's :class:`~metrale.params.PoolingParams` (None: the model's
        defaults) with every field left None filled from :attr:`default_pooling`; a model that
        serves no pooling raises :class:`~metrale.errors.ConfigError`."""
        from metrale.errors import ConfigError

        if self.pooling_unavailable is not None:
            raise ConfigError(self.pooling_unavailable)
        if params is None:
            params = PoolingParams()
        elif not isinstance(params, PoolingParams):
            raise InvalidRequestError(f"pooling params must be PoolingParams, got {params!r}")
        return params.resolved(self.default_pooling)

    def grammar_compiler(self) -> Any:
        """The structured-output compiler of this model's tokenizer (made on first use)."""
        if self._grammars is None:
            from metrale.structured import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, list(self.eos_token_ids),
                                             isolated=self.isolate_grammars)
        return self._grammars

    def close_grammar_compiler(self) -> None:
        """Stop the structured-output compiler's worker process, if one runs."""
        if self._grammars is not None:
            self._grammars.close()
