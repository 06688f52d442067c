"""The public Python API: :class:`LLM`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator, Sequence, Union

import numpy as np

from metrale.backend import get_backend
from metrale.cache.store import ModelCache, plan_num_blocks
from metrale.checkpoint import Checkpoint
from metrale.config import EngineConfig, read_environment
from metrale.engine.engine import Engine
from metrale.engine.generation import Request, StopChecker, make_request
from metrale.errors import (
    CheckpointError,
    EmptyPromptError,
    InvalidRequestError,
    PromptTooLongError,
    TokenizerMissingError,
    TokenOutOfRangeError,
)
from metrale.family import resolve_family
from metrale.model import ModelForward
from metrale.models import embedded_model_path, embedded_models
from metrale.params import RequestOutput, SamplingParams
from metrale.plugin_manager import get_plugin_manager
from metrale.sequence import SequenceState

logger = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]


def resolve_model_path(model: str | Path) -> Path:
    """A checkpoint folder: an existing path, or the name of an embedded checkpoint."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    embedded = embedded_model_path(str(model))
    if embedded is not None:
        return embedded
    raise CheckpointError(
        f"model {str(model)!r} is neither a checkpoint folder nor an embedded model "
        f"(embedded: {', '.join(embedded_models()) or 'none'})"
    )


class LLM:
    """A loaded model, ready to generate.

    ``model`` is a checkpoint folder (``config.json``, ``*.safetensors``, optionally
    ``tokenizer.json``) or the name of an embedded checkpoint such as ``"tiny-dense"``.
    ``device`` is ``"auto"`` (the GPU when a CUDA device and the ``gpu`` extra are usable, else
    the CPU), ``"cpu"`` or ``"cuda"`` (:class:`~metrale.errors.BackendUnavailableError` when no
    GPU can be used).
    Further keyword options: ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``enable_prefix_caching``, ``seed``, ``cuda_graphs``, ``block_size``,
    ``num_blocks``, ``memory_bytes``, ``num_state_slots``, ``num_state_snapshots`` (see
    :class:`~metrale.config.EngineConfig`
    and :class:`~metrale.config.CacheConfig`); ``plugin_manager`` to use a prepared plugin manager;
    ``show_progress`` to turn progress bars off. Unknown options raise
    :class:`~metrale.errors.UnknownOptionError`.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        device: str = "auto",
        plugin_manager: Any = None,
        show_progress: bool = True,
        **options: Any,
    ) -> None:
        environment = read_environment()
        self.config = EngineConfig.from_options({"device": device, **options}, environment)
        self.show_progress = show_progress and not environment.no_progress
        self.plugin_manager = plugin_manager or get_plugin_manager(environment=environment)
        self.checkpoint = Checkpoint(resolve_model_path(model))
        self.family = resolve_family(self.plugin_manager, self.checkpoint.config)
        self.backend = get_backend(self.config.device, cuda_graphs=self.config.cuda_graphs)
        with self.checkpoint.progress(f"loading {self.checkpoint.path.name}", self.show_progress):
            with self.backend.activate():
                self.model = self.plugin_manager.hook.metrale_load_model(
                    family=self.family, checkpoint=self.checkpoint, backend=self.backend, config=self.config
                )
        if self.model is None:
            raise CheckpointError(f"no plugin built a model for family {self.family.name!r}")
        self.forward = ModelForward(self.model, self.plugin_manager, environment)
        self.cache = self._build_cache()
        self.model.bind_cache(self.cache)
        self.backend.synchronize()
        self.tokenizer = self.checkpoint.tokenizer()
        self.eos_token_ids = self.checkpoint.eos_token_ids()
        self._requests_started = 0
        decode_text = self.decode if self.tokenizer is not None else None
        self.stopper = StopChecker(self.eos_token_ids, self.max_model_len, decode_text)
        #: The continuous-batching engine behind :meth:`generate` and :meth:`generate_stream`.
        self.engine = Engine(
            self.forward, self.cache, self.backend, self.stopper,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            enable_prefix_caching=self.config.enable_prefix_caching,
        )
        self.model.prefix_caching = self.engine.prefix_cache is not None

    def _build_cache(self) -> ModelCache:
        spec = self.forward.cache_spec()
        cache_config = self.config.cache
        block_size = self.forward.kv_block_size() or cache_config.block_size
        num_state_slots = max(cache_config.num_state_slots, self.config.max_num_seqs)
        num_state_snapshots = cache_config.num_state_snapshots if self.config.enable_prefix_caching else 0
        # The recurrent-state rows (slots, the dummy slot, snapshots) come out of the same budget.
        state_bytes = (num_state_slots + 1 + num_state_snapshots) * spec.state_bytes_per_slot()
        memory = cache_config.memory_bytes or self.backend.default_cache_bytes()
        num_blocks = cache_config.num_blocks or plan_num_blocks(
            spec,
            block_size,
            max(1, memory - state_bytes),
            np.dtype(self.backend.cache_dtype).itemsize,
            self.config.max_num_seqs,
            self.max_model_len,
        )
        return ModelCache(
            spec, self.backend, block_size=block_size, num_blocks=num_blocks,
            num_state_slots=num_state_slots, num_state_snapshots=num_state_snapshots,
        )

    # ------------------------------------------------------------------------- properties

    @property
    def vocab_size(self) -> int:
        return int(self.model.vocab_size)

    @property
    def max_model_len(self) -> int:
        return int(self.model.max_model_len)

    # ----------------------------------------------------------------------------- tokens

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's special tokens, such as BOS)."""
        if self.tokenizer is None:
            raise TokenizerMissingError(f"{self.checkpoint.path} has no tokenizer.json; pass token ids instead of {text!r}")
        return list(self.tokenizer.encode(text).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (special tokens skipped)."""
        if self.tokenizer is None:
            raise TokenizerMissingError(f"{self.checkpoint.path} has no tokenizer.json")
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise EmptyPromptError("the prompt is the empty string ''")
            return prompt, self.encode(prompt)
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {prompt!r}") from None
        if any(isinstance(t, bool) or isinstance(t, float) for t in prompt):
            raise InvalidRequestError(f"token ids must be ints, got {list(prompt)!r}")
        return None, ids

    def _validate_ids(self, ids: list[int], label: str) -> None:
        if not ids:
            raise EmptyPromptError(f"{label} has no tokens")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise TokenOutOfRangeError(f"{label} holds token id {bad[0]}, outside [0, {self.vocab_size})")
        if len(ids) > self.max_model_len:
            raise PromptTooLongError(
                f"{label} has {len(ids)} tokens, more than the model's context of {self.max_model_len}"
            )

    @staticmethod
    def _split_prompts(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in prompts):
            return [prompts]
        return prompts

    # ------------------------------------------------------------------------- generation

    def _requests(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[Request]:
        """Validated requests for ``prompts``; nothing runs before every prompt passed."""
        prompt_list = self._split_prompts(prompts)
        if not prompt_list:
            raise EmptyPromptError("generate() got no prompts")
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidRequestError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts"
                )
        requests = []
        for index, (prompt, params) in enumerate(zip(prompt_list, params_list)):
            if not isinstance(params, SamplingParams):
                raise InvalidRequestError(f"sampling params must be SamplingParams, got {params!r}")
            text, ids = self._prompt_ids(prompt)
            self._validate_ids(ids, f"prompt {index}")
            requests.append(make_request(self._requests_started + index, text, ids, params, self.config.seed))
        if self.engine.has_unfinished():
            raise InvalidRequestError(
                "another generation is still running on this LLM (an unfinished generate_stream); "
                "finish or close it first"
            )
        self._requests_started += len(requests)
        # (Built per call: the end-of-sequence ids and the tokenizer may be changed in between.)
        decode_text = self.decode if self.tokenizer is not None else None
        self.stopper = self.engine.stopper = StopChecker(self.eos_token_ids, self.max_model_len, decode_text)
        return requests

    def _run_engine(self, requests: list[Request]) -> Iterator[list[Request]]:
        """Add ``requests`` and step the engine until all are finished, yielding each step's
        changed requests. Leaving early (an error, or a closed stream) drops the unfinished ones
        and releases their cache."""
        for request in requests:
            self.engine.add_request(request)
        try:
            while self.engine.has_unfinished():
                yield self.engine.step()
        finally:
            self.engine.abort_all()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list of prompts (strings or token-id lists).

        ``sampling_params`` is one :class:`SamplingParams` for all prompts or one per prompt.
        Every prompt is validated before any runs. All prompts go to the engine at once, which
        batches them continuously (up to ``max_num_seqs`` at a time, prompts in chunks under
        ``max_num_batched_tokens``). Returns one :class:`~metrale.params.RequestOutput` per
        prompt, in order; a request that cannot run at all (it needs more cache than there is)
        finishes with ``finish_reason == "error"`` and the others go on.
        """
        requests = self._requests(prompts, sampling_params)
        bar = None
        if use_tqdm and self.show_progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc="generating", unit="req", leave=False)
        try:
            for changed in self._run_engine(requests):
                if bar is not None:
                    done = sum(1 for r in changed if r.finish_reason is not None)
                    if done:
                        bar.update(done)
        finally:
            if bar is not None:
                bar.close()
        outputs = [self.stopper.output(r) for r in requests]
        for output in outputs:
            if output.error is not None:
                logger.warning("request %s failed: %s", output.request_id, output.error)
        return outputs

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Like :meth:`generate`, but yields a :class:`~metrale.params.RequestOutput` each time a
        request gets new tokens (``finished`` False, ``finish_reason`` None) and once more when
        it finishes (``finished`` True); ``token_ids`` and ``text`` hold everything generated so
        far. Every prompt is validated by this call, before the first output. Closing the iterator
        early drops the unfinished requests and releases their cache.
        """
        requests = self._requests(prompts, sampling_params)
        return self._stream(requests)

    def _stream(self, requests: list[Request]) -> Iterator[RequestOutput]:
        for changed in self._run_engine(requests):
            for request in changed:
                finished = request.finish_reason is not None
                if finished or len(request.generated) > request.streamed:
                    request.streamed = len(request.generated)
                    yield self.stopper.output(request, finished=finished)

    def capture_graphs(self, batch_sizes: Sequence[int] | None = None) -> None:
        """Record the CUDA graphs of decode steps ahead of time (a no-op on the CPU).

        ``batch_sizes`` defaults to every rung (1, 2, 4, ... 128); otherwise each size is rounded
        up to its rung. Without this, a rung's graph is recorded the first time it is used.
        """
        runner = self.backend.graph_runner(self.model)
        if runner is None:
            return
        from metrale.engine.cuda_graphs import DECODE_RUNGS

        with self.backend.activate():
            runner.capture(tuple(batch_sizes) if batch_sizes else DECODE_RUNGS)
        self.backend.synchronize()

    def score(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits for every position of ``token_ids``: ``[len, vocab]`` float32.

        Row ``i`` holds the logits that predict token ``i + 1``.
        """
        _, ids = self._prompt_ids(token_ids)
        self._validate_ids(ids, "the scored sequence")
        seq = SequenceState.from_prompt(ids)
        try:
            logits = self.forward.score(ids, seq)
            return self.backend.to_numpy(logits).copy()
        finally:
            self.cache.release(seq)
