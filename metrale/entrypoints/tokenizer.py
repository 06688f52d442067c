"""The tokenizer of a loaded model as :meth:`metrale.LLM.get_tokenizer` gives it: the calls
people make on vLLM's ``llm.get_tokenizer()`` (a transformers tokenizer) -- ``encode``,
``decode``, ``apply_chat_template``, calling it on a text, the special token ids -- answered by
the engine's own tokenizer and chat template, so they give exactly the ids the engine runs."""

from __future__ import annotations

from typing import Any, Sequence

from metrale.errors import InvalidRequestError, TokenizerMissingError


class Tokenizer:
    """The tokenizer of a :class:`~metrale.LLM` (:meth:`~metrale.LLM.get_tokenizer`).

    ``backend_tokenizer`` is the underlying ``tokenizers.Tokenizer`` (None when the checkpoint
    has no ``tokenizer.json``: then every call that needs it raises
    :class:`~metrale.errors.TokenizerMissingError`)."""

    def __init__(self, frontend: Any) -> None:
        self._frontend = frontend

    @property
    def backend_tokenizer(self) -> Any:
        return self._frontend.tokenizer

    @property
    def name_or_path(self) -> str:
        """The folder the tokenizer and chat template were read from."""
        return str(self._frontend.tokenizer_path)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (the rows of its embedding)."""
        return self._frontend.vocab_size

    @property
    def model_max_length(self) -> int:
        """The longest sequence the engine serves (``max_model_len``)."""
        return self._frontend.max_model_len

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (``eos_token_ids`` holds them all)."""
        ids = self._frontend.eos_token_ids
        return ids[0] if ids else None

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends a sequence (``generation_config.json`` may name several)."""
        return list(self._frontend.eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self._frontend.bos_token_id

    @property
    def chat_template(self) -> str | None:
        """The chat template's Jinja source, None when the model has none."""
        template = self._frontend.chat_template
        return None if template is None else template.source

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's special tokens, such as BOS, unless
        ``add_special_tokens`` is False), as the engine encodes a text prompt."""
        return self._frontend.encode(text, add_special_tokens=add_special_tokens)

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, Any]:
        """``{"input_ids": ...}`` of a text (a list of ids) or of a list of texts (a list of lists),
        as a transformers tokenizer answers the same call."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        if not isinstance(text, (list, tuple)):
            raise InvalidRequestError(f"a tokenizer call takes a text or a list of texts, got {text!r}")
        return {"input_ids": [self.encode(item, add_special_tokens) for item in text]}

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; with ``skip_special_tokens`` False the special tokens' text too."""
        if skip_special_tokens:
            return self._frontend.decode(token_ids)
        self._frontend.decode(token_ids)  # (the same checks of the ids)
        return self._require().decode([int(t) for t in token_ids], skip_special_tokens=False)

    def convert_ids_to_tokens(self, token_ids: int | Sequence[int]) -> str | list[str | None] | None:
        """The vocabulary entry of each id (one entry for one id)."""
        tokenizer = self._require()
        if isinstance(token_ids, int):
            return tokenizer.id_to_token(token_ids)
        return [tokenizer.id_to_token(int(t)) for t in token_ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int | None] | None:
        """The id of each vocabulary entry (None for one the vocabulary lacks)."""
        tokenizer = self._require()
        if isinstance(tokens, str):
            return tokenizer.token_to_id(tokens)
        return [tokenizer.token_to_id(token) for token in tokens]

    def apply_chat_template(self, conversation: Sequence[dict[str, Any]], *, tokenize: bool = True,
                            add_generation_prompt: bool = False, tools: Any = None,
                            **template_kwargs: Any) -> list[int] | str:
        """One conversation rendered by the model's chat template: its token ids (``tokenize``, as
        :meth:`metrale.LLM.chat` runs them) or its text. ``add_generation_prompt`` defaults to
        False, as in transformers."""
        if tokenize:
            return self._frontend.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      tools=tools, **template_kwargs)
        return self._frontend.render_chat(conversation, add_generation_prompt=add_generation_prompt, tools=tools,
                                          **template_kwargs)

    def _require(self) -> Any:
        tokenizer = self._frontend.tokenizer
        if tokenizer is None:
            raise TokenizerMissingError(f"{self._frontend.tokenizer_path} has no tokenizer.json")
        return tokenizer

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size})"
