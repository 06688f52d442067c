"""The public Python API: :class:`LLM`."""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import Any, Generator, Iterator, Sequence

import numpy as np
import pluggy

from metrale.backends.devices import cuda_unavailable_reason, get_backend
from metrale.backends.executor import RankExecutor
from metrale.backends.parallel import Shard, rank_context
from metrale.cache.store import ModelCache, cache_itemsizes, plan_cache
from metrale.config import EngineConfig, read_environment
from metrale.engine.engine import Engine
from metrale.engine.generation import Request, RequestGroup, StopChecker, make_group, prompt_logprob_dicts
from metrale.engine.lora_slots import LoraManager
from metrale.engine.pooling import PoolingGroup, make_pooling_group
from metrale.entrypoints.engine_hold import EngineHold, EngineHolds
from metrale.entrypoints.frontend import PromptFrontend
from metrale.entrypoints.prompts import Prompt, split_prompts
from metrale.entrypoints.streams import RequestStream
from metrale.entrypoints.tokenizer import Tokenizer
from metrale.errors import (
    AdapterError,
    BackendUnavailableError,
    ConfigError,
    EmptyPromptError,
    EngineBusyError,
    EngineClosedError,
    InvalidRequestError,
)
from metrale.layers.loading import DecoderEnds
from metrale.loading.checkpoint import Checkpoint
from metrale.loading.lora import LoRARequest
from metrale.loading.model import load_model, resolve_model_path
from metrale.model.family import resolve_family
from metrale.model.forward import ModelForward
from metrale.model.plugin_manager import get_plugin_manager
from metrale.ops import build_op_registry
from metrale.params import EmbeddingRequestOutput, PoolingParams, RequestOutput, SamplingParams
from metrale.runner import ModelRunner
from metrale.sequence import SequenceState
from metrale.validation import check_bool

logger = logging.getLogger(__name__)


class LLM(PromptFrontend):
    """A loaded model, ready to generate.

    ``model`` is a checkpoint folder (``config.json``, ``*.safetensors``, optionally
    ``tokenizer.json``), the name of an embedded checkpoint such as ``"tiny-dense"``, or a
    Hugging Face Hub id such as ``"Qwen/Qwen3-8B"`` (from the Hub cache, downloaded when missing;
    :mod:`metrale.loading.hub`; options ``revision``, ``download_dir``, and ``tokenizer`` /
    ``tokenizer_revision`` for a tokenizer from elsewhere).
    ``device`` is ``"auto"`` (the GPU when a CUDA device and the ``gpu`` extra are usable, else
    the CPU), ``"cpu"`` or ``"cuda"`` (:class:`~metrale.errors.BackendUnavailableError` when no
    GPU can be used).
    Further keyword options: ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``enable_prefix_caching``, ``seed``, ``cuda_graphs``, ``overlap_scheduling``,
    ``speculative_config`` (speculative decoding, :mod:`metrale.speculative`), ``block_size``,
    ``num_blocks``, ``memory_bytes``, ``num_state_slots``, ``num_state_snapshots``, ``kv_cache_dtype`` (see
    :class:`~metrale.config.EngineConfig`
    and :class:`~metrale.config.CacheConfig`); ``plugin_manager`` to use a prepared plugin manager;
    ``show_progress`` to turn progress bars off. Unknown options raise
    :class:`~metrale.errors.UnknownOptionError`, bad values :class:`~metrale.errors.ConfigError`.

    One generation runs at a time: :meth:`generate`, :meth:`generate_stream` (from its call
    until the stream is exhausted or closed) and :meth:`score` take the engine, and a second
    call meanwhile -- from the same thread or another -- raises
    :class:`~metrale.errors.EngineBusyError` without disturbing the first. Whatever exception
    ends a call (a ``KeyboardInterrupt`` included, at any line), its requests are dropped, the
    engine is left idle and consistent, and the ``LLM`` is free for the next call
    (:mod:`metrale.entrypoints.engine_hold`). ``with LLM(...) as llm:`` or :meth:`close` frees the cache, the
    weights and (on a GPU) the device memory at once.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        device: str = "auto",
        plugin_manager: Any = None,
        show_progress: bool = True,
        chat_template: str | Path | None = None,
        **options: Any,
    ) -> None:
        environment = read_environment()
        self.config = EngineConfig.from_options({"device": device, **options}, environment)
        self.show_progress = check_bool("show_progress", show_progress) and not environment.no_progress
        #: Who holds the engine (:mod:`metrale.entrypoints.engine_hold`): one generation at a time.
        self._holds = EngineHolds()
        self._closed = False
        self._torn_down = False
        if plugin_manager is not None and not isinstance(plugin_manager, pluggy.PluginManager):
            raise ConfigError(f"plugin_manager must be a pluggy PluginManager (get_plugin_manager()), got {plugin_manager!r}")
        self.plugin_manager = plugin_manager or get_plugin_manager(environment=environment)
        config = self.config
        self.checkpoint = Checkpoint(
            resolve_model_path(model, revision=config.revision, download_dir=config.download_dir,
                               show_progress=self.show_progress),
            quantization=config.quantization)
        # The folder the tokenizer and chat template come from (``tokenizer=``), None: the checkpoint's.
        self._tokenizer_folder = None if config.tokenizer is None else resolve_model_path(
            config.tokenizer, revision=config.tokenizer_revision, download_dir=config.download_dir,
            show_progress=self.show_progress, tokenizer_only=True)
        self.family = resolve_family(self.plugin_manager, self.checkpoint.config)
        #: The model's other ranks (:class:`~metrale.backends.executor.RankExecutor`), None on one rank.
        self.ranks: RankExecutor | None = None
        rank = self._start_ranks({"device": device, **options}, plugin_manager is not None)
        try:
            self._build(rank, chat_template, environment)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise

    def _build(self, rank: Any, chat_template: str | Path | None, environment: Any) -> None:
        """The backend (rank 0 of the ranks in ``rank``), the model, its cache and the engine."""
        with rank:
            self.backend = get_backend(self.config.device, cuda_graphs=self.config.cuda_graphs,
                                       environment=self.config.environment)
        # A cache dtype the backend cannot serve is refused before any weight is loaded.
        cache_itemsizes(self.backend, self.config.cache.kv_cache_dtype)
        # The built-in ops plus every plugin's (metrale_register_ops), bound to this backend.
        self.backend.use_ops(build_op_registry(self.plugin_manager))
        with self.checkpoint.progress(f"loading {self.checkpoint.path.name}", self.show_progress):
            self.model = load_model(self.plugin_manager, self.family, self.checkpoint, self.backend, self.config)
        PromptFrontend.__init__(self, self.checkpoint, vocab_size=self.model.vocab_size,
                                max_model_len=self.model.max_model_len, chat_template=chat_template,
                                tokenizer_path=self._tokenizer_folder)
        self.forward = ModelForward(self.model, self.plugin_manager, environment)
        self.pooling_unavailable, self.embedding_size = self._pooling_support()
        #: The LoRA adapter slots (:class:`~metrale.engine.lora_slots.LoraManager`), None without ``enable_lora``.
        self.lora: LoraManager | None = self._enable_lora() if self.config.enable_lora else None
        if self.config.speculative_config is not None:
            # Before the cache: a drafter may need cache layers of its own (an MTP module's).
            prepare = getattr(self.model, "prepare_speculation", None)  # (FamilyModel's; a hook-only model has none)
            if prepare is not None:
                prepare(self.config.speculative_config)
        self.cache = self._build_cache()
        # The runner of this model's steps over the cache: the engine dispatches to it, the
        # model's own contract methods run through it too.
        runner = ModelRunner(self.model, self.cache, ranks=self.ranks) if hasattr(self.model, "forward_batch") else None
        self.model.bind_cache(self.cache, runner) if runner is not None else self.model.bind_cache(self.cache)
        self.backend.synchronize()
        if self.ranks is not None:
            self.ranks.build_caches({"block_size": self.cache.block_size, "num_blocks": self.cache.num_blocks,
                                     "num_state_slots": self.cache.state_slots.num_slots if self.cache.state_slots else 0,
                                     "num_state_snapshots": self.cache.snapshots.count if self.cache.snapshots else 0,
                                     "kv_cache_dtype": self.cache.kv_cache_dtype})
            self.ranks.mirror(self.cache)
        self._requests_started = 0
        speculation = None
        if self.config.speculative_config is not None:
            if not getattr(self.model, "speculation_capable", True):
                raise ConfigError(f"the {self.family.name} family does not serve speculative decoding yet "
                                  f"({type(self.model).__name__} cannot verify drafts); leave speculative_config out")
            speculation = (self.config.speculative_config, self.forward.drafter(self.config.speculative_config))
        #: The continuous-batching engine behind :meth:`generate` and :meth:`generate_stream`.
        self.engine = Engine(
            self.forward, self.cache, self.backend, StopChecker(self.eos_token_ids, self.max_model_len),
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            enable_prefix_caching=self.config.enable_prefix_caching,
            # (The other ranks get each step's tokens with its metadata: none sampled on the device.)
            overlap=(self.config.overlap_scheduling and speculation is None and self.ranks is None
                     and self._forward_feeds_tokens()),
            speculation=speculation,
            adapters=self.lora,
            runner=runner,
        )

    def _start_ranks(self, options: dict, custom_plugins: bool) -> Any:
        """With ``tensor_parallel_size`` above 1, start the other ranks' workers
        (:mod:`metrale.backends.executor`); the context in which this process's backend is rank 0."""
        size = self.config.tensor_parallel_size
        if size == 1:
            return contextlib.nullcontext()
        if custom_plugins:
            raise ConfigError("tensor_parallel_size > 1 loads the installed plugins (entry points) in every rank's "
                              "worker: a prepared plugin_manager cannot reach them; leave plugin_manager out")
        gpu = False
        if self.config.device != "cpu":
            reason = cuda_unavailable_reason()
            if reason is not None and self.config.device == "cuda":
                raise BackendUnavailableError(f"device='cuda' cannot be used: {reason}; use device='cpu'")
            # ("auto" without a usable GPU: every rank runs on the CPU, as this one.)
            gpu = reason is None
        self.ranks = RankExecutor(self.checkpoint.path, options, size, self.config.expert_parallel,
                                  self.config.distributed_executor_backend, gpu=gpu)
        communicator = self.ranks.start()
        return rank_context(Shard(0, size, self.config.expert_parallel), communicator)

    def _pooling_support(self) -> tuple[str | None, int | None]:
        """Why pooling requests (embeddings) are not served, or None; and the vectors' length."""
        ends = getattr(self.model, "ends", None)
        if not isinstance(ends, DecoderEnds):
            return (f"the {self.family.name} family's model keeps no DecoderEnds whose final states embeddings "
                    "pool; embeddings are not served for it"), None
        if self.config.tensor_parallel_size > 1:
            return "embeddings are not served with tensor parallelism yet; use tensor_parallel_size=1", None
        return None, int(ends.norm.shape[0])

    def _enable_lora(self) -> LoraManager:
        """The adapter slots, built before the cache takes the free memory."""
        enable = getattr(self.model, "enable_lora", None)  # (FamilyModel's; a hook-only model has none)
        with self.backend.activate():
            layout = enable(self.config.max_loras, self.config.max_lora_rank) if enable is not None else None
        if layout is None:
            raise ConfigError(f"the {self.family.name} family does not serve LoRA adapters; leave enable_lora out")
        self.model.lora_layout = layout
        return LoraManager(self.backend, layout, max_lora_rank=self.config.max_lora_rank,
                           vocab_size=self.model.vocab_size, served_model=self.checkpoint, ranks=self.ranks)

    def _forward_feeds_tokens(self) -> bool:
        """Whether overlap scheduling can serve this model: its family's model feeds pending
        tokens on the device, and the family plugin answers its decode and mixed steps (every
        hook implementation called before it is another family's, which answers None)."""
        from metrale.model.family import FamilyPlugin

        if not getattr(self.model, "feeds_pending_tokens", False):
            return False
        hook = self.plugin_manager.hook
        for name in ("metrale_decode_batch", "metrale_mixed_forward"):
            # pluggy calls the implementations from the end of this list.
            for impl in reversed(getattr(hook, name).get_hookimpls()):
                if getattr(impl, "wrapper", False) or getattr(impl, "hookwrapper", False):
                    continue
                plugin = impl.plugin
                if not isinstance(plugin, FamilyPlugin):
                    return False
                if plugin._owns(self.model):
                    break
            else:
                return False
        return True

    def _build_cache(self) -> ModelCache:
        spec = self.forward.cache_spec()
        cache_config = self.config.cache
        block_size = self.forward.kv_block_size() or cache_config.block_size
        itemsize, scale_itemsize = cache_itemsizes(self.backend, cache_config.kv_cache_dtype)
        plan = plan_cache(
            spec,
            block_size=block_size,
            itemsize=itemsize,
            scale_itemsize=scale_itemsize,
            num_blocks=cache_config.num_blocks,
            memory_bytes=cache_config.memory_bytes or self.backend.default_cache_bytes(),
            available_bytes=self.backend.available_memory_bytes(),
            num_state_slots=max(cache_config.num_state_slots, self.config.max_num_seqs),
            num_state_snapshots=cache_config.num_state_snapshots if self.config.enable_prefix_caching else 0,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
        )
        try:
            return ModelCache(
                spec, self.backend, block_size=block_size, num_blocks=plan.num_blocks,
                num_state_slots=plan.num_state_slots, num_state_snapshots=plan.num_state_snapshots,
                kv_cache_dtype=cache_config.kv_cache_dtype,
            )
        except MemoryError as error:  # CuPy's OutOfMemoryError is one too
            raise ConfigError(
                f"the cache of {plan.num_bytes / 2**30:.2f} GiB ({plan.num_blocks} blocks) could not be allocated: "
                f"{error}; lower num_blocks or memory_bytes"
            ) from None

    # ------------------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Free the cache, the weights, the CUDA graphs and (on a GPU) the device memory they
        held, at once. Later calls raise :class:`~metrale.errors.EngineClosedError`; closing
        twice does nothing. Raises :class:`~metrale.errors.EngineBusyError` while a generation
        (an open :meth:`generate_stream`) runs. A close that an interrupt cut short leaves the
        ``LLM`` either open and usable or closed; calling ``close()`` again finishes it."""
        if self._torn_down:
            return
        hold = self._take("close()", closing=True)
        try:
            self._closed = True
            self._tear_down()
        finally:
            self._release(hold)

    def _tear_down(self) -> None:
        """Drop the engine, the cache and the model and free the backend's memory; every step
        may run again, so a close cut short is finished by the next."""
        for name in ("engine", "forward", "cache"):
            self.__dict__.pop(name, None)
        self.model = None
        self.close_grammar_compiler()
        self.backend.close()
        if self.ranks is not None:
            self.ranks.close()
        self._torn_down = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"device={self.backend.name!r}"
        return f"LLM({str(self.checkpoint.path)!r}, {state})"

    def _take(self, what: str, *, closing: bool = False) -> EngineHold:
        """Take the engine for ``what`` (the calling method), or raise: closed (unless
        ``closing``), or held by another call or an open stream. A holder that went away
        without giving the engine back (an interrupt) no longer holds it; its requests are
        dropped first."""
        if self._closed and not closing:
            raise EngineClosedError(f"{what} on a closed LLM")
        owner, hold, gone = self._holds.claim(what, sys._getframe(1))
        if owner is not hold:
            raise EngineBusyError(
                f"{what} was called while another generation runs on this LLM ({owner.what if owner else 'another call'} "
                "holds it); one runs at a time (finish or close the running generate_stream first, or use another LLM)"
            )
        if gone:
            self._take_back(gone)
        if self._closed and not closing:  # closed by another thread meanwhile
            self._release(hold)
            raise EngineClosedError(f"{what} on a closed LLM")
        return hold

    def _take_back(self, gone: list[EngineHold]) -> None:
        """After holders that ended without giving the engine back: drop whatever they left in
        the engine, so it is idle and consistent."""
        logger.info("%s ended without giving this LLM back (interrupted); the engine is taken back",
                    ", ".join(hold.what for hold in gone))
        if not self._torn_down and "engine" in self.__dict__:
            self._recover()

    def _release(self, hold: EngineHold) -> None:
        """Give the engine back (any number of times)."""
        self._holds.release(hold)

    def _recover(self, requests: Sequence[Request] = (), seqs: Sequence[SequenceState] = ()) -> None:
        problems = self.engine.recover(requests, seqs)
        if problems:
            logger.warning("the engine's bookkeeping was rebuilt after an interrupted step: %s", "; ".join(problems))

    # ----------------------------------------------------------------------------- tokens

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (:class:`~metrale.entrypoints.tokenizer.Tokenizer`): ``encode``,
        ``decode``, ``apply_chat_template`` and calling it on a text, as on vLLM's
        ``get_tokenizer()``, giving exactly the ids this engine runs."""
        return Tokenizer(self)

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: Any = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation (a list of ``{"role", "content"}``
        messages) or to each of a list of conversations, rendered by the chat template
        (:meth:`apply_chat_template`); otherwise as :meth:`generate`. Each output's ``prompt`` is
        the rendered text."""
        if isinstance(messages, dict) or not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError(
                f"chat() takes a conversation (a non-empty list of messages) or a list of them, got {messages!r}")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        extra = dict(chat_template_kwargs or {})
        prompts: list[Prompt] = []
        for index, conversation in enumerate(conversations):
            text = self.render_chat(conversation, add_generation_prompt=add_generation_prompt, tools=tools, **extra)
            ids = self.encode(text, add_special_tokens=False)
            prompts.append(self.tokenized_prompt(ids, text))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ------------------------------------------------------------------------- generation

    def _requests(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestGroup]:
        """Validated requests for ``prompts``; nothing runs before every prompt passed."""
        prompt_list = split_prompts(prompts)
        if not prompt_list:
            raise EmptyPromptError("generate() got no prompts")
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        elif isinstance(sampling_params, (list, tuple)):
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidRequestError(f"got {len(params_list)} sampling params for {len(prompt_list)} prompts")
        else:
            raise InvalidRequestError(f"sampling_params must be SamplingParams or a list of them, got {sampling_params!r}")
        checked = [(self.prompt_ids(prompt, f"prompt {index}"), self.request_params(params))
                   for index, (prompt, params) in enumerate(zip(prompt_list, params_list))]
        adapters = self.lora_requests(lora_request, len(prompt_list))
        groups = [self.new_group(text, ids, params, lora=lora) for ((text, ids), params), lora in zip(checked, adapters)]
        # (Built per call: ``eos_token_ids`` may be changed between calls.)
        self.engine.stopper = StopChecker(self.eos_token_ids, self.max_model_len)
        return groups

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter ahead of its first request
        (:class:`~metrale.errors.AdapterError` for one this model cannot serve); it goes to a
        device slot when a request first needs it. Needs ``enable_lora=True``."""
        self.lora_requests(lora_request, 1)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget adapter ``lora_int_id`` (its slot is free for others); False when it is not
        known. :class:`~metrale.errors.AdapterError` while requests run with it."""
        if self.lora is None:
            raise ConfigError("remove_lora() needs an engine that serves LoRA: LLM(..., enable_lora=True)")
        return self.lora.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters read so far (:meth:`add_lora`, or a request's), by ``lora_int_id``."""
        return [] if self.lora is None else self.lora.requests()

    def lora_requests(self, lora_request: Any, count: int) -> list[LoRARequest | None]:
        """``lora_request`` (None, one :class:`~metrale.loading.lora.LoRARequest` for every prompt, or a
        list of one per prompt, None for the base model) for ``count`` prompts, every adapter read
        and checked before anything runs (:class:`~metrale.errors.AdapterError`)."""
        if lora_request is None:
            return [None] * count
        if isinstance(lora_request, LoRARequest):
            items: list[Any] = [lora_request] * count
        elif isinstance(lora_request, (list, tuple)):
            items = list(lora_request)
            if len(items) != count:
                raise InvalidRequestError(f"got {len(items)} LoRA requests for {count} prompts")
        else:
            raise InvalidRequestError(f"lora_request must be a LoRARequest or a list of them, got {lora_request!r}")
        for item in items:
            if item is not None and not isinstance(item, LoRARequest):
                raise InvalidRequestError(f"lora_request entries must be LoRARequest or None, got {item!r}")
        if any(item is not None for item in items):
            if self.lora is None:
                raise ConfigError("a lora_request needs an engine that serves LoRA: LLM(..., enable_lora=True)")
            for item in items:
                if item is not None:
                    self.lora.resolve(item)
        return items

    def new_group(self, text: str | None, ids: list[int], params: SamplingParams, request_id: str | None = None,
                  lora: LoRARequest | None = None) -> RequestGroup:
        """The request for one checked prompt (its ``n`` completions, with the adapter ``lora``
        when given: checked by :meth:`lora_requests`); compiles its structured output
        (:class:`~metrale.errors.InvalidRequestError` for a bad schema or grammar)."""
        grammar = None
        if params.structured_output is not None:
            grammar = self.grammar_compiler().compile(params.structured_output)
        index = self._requests_started
        self._requests_started += 1
        group = make_group(index, text, ids, params, self.config.seed, self.tokenizer, request_id=request_id,
                           grammar=grammar)
        if lora is not None:
            for request in group.completions:
                request.lora, request.seq.adapter_id = lora, lora.lora_int_id
        return group

    def new_pooling_group(self, text: str | None, ids: list[int], params: PoolingParams,
                          request_id: str | None = None) -> PoolingGroup:
        """The pooling request (:mod:`metrale.engine.pooling`) of one checked prompt, pooled as
        ``params`` (resolved by :meth:`pooling_params`) says."""
        index = self._requests_started
        self._requests_started += 1
        return make_pooling_group(str(index) if request_id is None else request_id, text, ids, params)

    def prompt_logprobs(self, group: RequestGroup) -> None:
        """Fill ``group.prompt_logprobs`` when its params ask for them: one teacher-forced pass
        over the prompt (its cache released at once)."""
        k = group.completions[0].params.prompt_logprobs
        if k is None:
            return
        ids = group.completions[0].prompt_token_ids
        seq = SequenceState.from_prompt(ids)
        with self._holding_adapter(seq, group.completions[0].lora):
            try:
                with self.backend.activate():
                    logits = self.forward.score(ids, seq)
                    entries = self.engine.sampler.prompt_logprobs(logits[: len(ids) - 1], ids[1:], k) if len(ids) > 1 else []
                self.cache.release(seq)
            except BaseException:
                self._recover(seqs=[seq])
                raise
        group.prompt_logprobs = prompt_logprob_dicts(entries, self.tokenizer)

    @contextlib.contextmanager
    def _holding_adapter(self, seq: SequenceState, lora: LoRARequest | None) -> Iterator[None]:
        """``seq`` holds ``lora``'s adapter slot while the block runs (nothing for None)."""
        if lora is None:
            yield
            return
        assert self.lora is not None  # (lora_requests takes an adapter only when LoRA is served)
        slot = self.lora.acquire(lora)
        if slot is None:
            raise AdapterError(f"no adapter slot is free for {lora.lora_name!r}: every slot is held by running requests")
        seq.adapter_slot, seq.adapter_id = slot, lora.lora_int_id
        try:
            yield
        finally:
            seq.adapter_slot = None
            self.lora.release(slot)

    @contextlib.contextmanager
    def _engine_run(self, groups: list[RequestGroup], hold: EngineHold) -> Iterator[None]:
        """Add ``groups``' completions to the engine for the ``with`` block, which steps it until
        all are finished. Leaving early -- any exception, or a closed stream -- drops the
        unfinished ones and leaves the engine idle and consistent (unless ``hold`` no longer owns
        the engine: whoever took it back cleaned it). While the block runs this generator is
        suspended, so a step's call path starts at the caller's frame."""
        requests = [request for group in groups for request in group.completions]
        try:
            for group in groups:
                self.prompt_logprobs(group)
            for request in requests:
                self.engine.add_request(request)
            yield
        except BaseException:
            if self._holds.owns(hold):
                self._recover(requests)
            raise

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list of prompts (see :mod:`metrale.entrypoints.prompts`: strings,
        token-id lists, or ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}`` dicts).

        ``sampling_params`` is one :class:`SamplingParams` for all prompts or one per prompt.
        Every prompt is validated before any runs. All prompts go to the engine at once, which
        batches them continuously (up to ``max_num_seqs`` at a time, prompts in chunks under
        ``max_num_batched_tokens``). Returns one :class:`~metrale.params.RequestOutput` per
        prompt, in order; a request that cannot run at all (it needs more cache than there is),
        or whose logits are not finite, finishes with ``finish_reason == "error"`` and the others
        go on. ``lora_request`` runs the prompts with a LoRA adapter (one
        :class:`~metrale.loading.lora.LoRARequest` for all, or one per prompt, None for the base model;
        needs ``enable_lora=True``); a batch may mix adapters.
        """
        hold = self._take("generate()")
        try:
            groups = self._requests(prompts, sampling_params, lora_request)
            bar = None
            if check_bool("use_tqdm", use_tqdm) and self.show_progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=sum(len(g.completions) for g in groups), desc="generating", unit="seq", leave=False)
            try:
                with self._engine_run(groups, hold):
                    while self.engine.has_unfinished():
                        changed = self.engine.step()
                        if bar is not None:
                            done = sum(1 for r in changed if r.finish_reason is not None)
                            if done:
                                bar.update(done)
            finally:
                if bar is not None:
                    bar.close()
            outputs = [group.output(finished=True) for group in groups]
        finally:
            self._release(hold)
        for output in outputs:
            if output.error is not None:
                logger.warning("request %s failed: %s", output.request_id, output.error)
        return outputs

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> RequestStream:
        """Like :meth:`generate`, but returns a :class:`~metrale.entrypoints.streams.RequestStream` that
        yields a :class:`~metrale.params.RequestOutput` each time a request gets new tokens
        (``finished`` False, ``finish_reason`` None) and once more when it finishes (``finished``
        True). ``token_ids`` and ``text`` hold everything generated so far; the text only ever
        grows (text that may still become a stop string, or an incomplete character, is held
        back until it is settled) and ends up equal to :meth:`generate`'s.

        Every prompt is validated, and the engine taken, by this call: a second generation
        raises :class:`~metrale.errors.EngineBusyError` until the stream is exhausted or closed
        (``stream.close()``, ``with llm.generate_stream(...) as stream:``, or dropping it).
        Closing it early drops the unfinished requests and releases their cache.
        """
        hold = self._take("generate_stream()")
        try:
            groups = self._requests(prompts, sampling_params, lora_request)
        except BaseException:
            self._release(hold)
            raise
        return RequestStream(self._stream(groups, hold), hold, self._release)

    def _stream(self, groups: list[RequestGroup], hold: EngineHold) -> Generator[RequestOutput, None, None]:
        try:
            owner = {id(request): group for group in groups for request in group.completions}
            with self._engine_run(groups, hold):
                while self.engine.has_unfinished():
                    updated: dict[int, RequestGroup] = {}
                    for request in self.engine.step():
                        if request.finish_reason is not None or len(request.generated) > request.streamed:
                            request.streamed = len(request.generated)
                            group = owner[id(request)]
                            updated[id(group)] = group
                    for group in updated.values():
                        yield group.output()
        finally:
            self._release(hold)

    def capture_graphs(self, batch_sizes: Sequence[int] | None = None, mixed: bool = True) -> None:
        """Record the CUDA graphs of decode steps ahead of time (a no-op on the CPU).

        ``batch_sizes`` defaults to every rung (1, 2, 4, ... 128); otherwise each size is rounded
        up to its rung. Each rung gets a graph per live-context bucket (512 tokens, then four
        times more each, up to ``max_model_len``). With ``mixed`` (and a family that replays mixed steps from graphs), also
        the graphs of mixed steps: every decode rung up to ``max_num_seqs - 1`` rows, each with
        every prompt-chunk bucket up to ``max_num_batched_tokens``. Without this, a graph is recorded
        the first time its shape is used.
        """
        hold = self._take("capture_graphs()")
        try:
            runner: Any = self.engine.runner
            if getattr(runner, "graphs", None) is None:
                return
            from metrale.runner.graphs import DECODE_RUNGS

            sizes = tuple(batch_sizes) if batch_sizes else DECODE_RUNGS
            config = self.config
            mixed_shape = (max(config.max_num_seqs - 1, 1), config.max_num_batched_tokens) if mixed else None
            if self.ranks is None:
                runner.capture_graphs(sizes, mixed_shape)
                return
            self.ranks.capture_graphs(sizes, mixed_shape)
            try:
                runner.capture_graphs(sizes, mixed_shape)
            except BaseException as error:
                self.ranks.abandon(error)
                raise
            self.ranks.finish(self.backend)
        finally:
            self._release(hold)

    def embed(self, prompts: Prompt | Sequence[Prompt], *, pooling: str | None = None, normalize: bool | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, as vLLM's ``LLM.embed``: the final normed states of the
        prompt's tokens (the model's last norm, before the LM head) pooled -- ``"last"`` the last
        token's (Qwen3-Embedding and other decoder embedders), ``"mean"`` their mean -- and, with
        ``normalize``, scaled to unit length. ``pooling`` and ``normalize`` left None take the
        model's defaults (:attr:`~metrale.entrypoints.frontend.PromptFrontend.default_pooling`:
        last-token and normalized, unless the checkpoint's sentence-transformers configuration
        says otherwise). Prompts are those :meth:`generate` takes; each is checked before any
        runs.

        The prompts go to the engine together as pooling requests (:mod:`metrale.engine.pooling`),
        batched and chunked as :meth:`generate` batches prompts; a prompt's vector does not
        depend on the prompts beside it. A request that fails in the engine (its prompt needs
        more cache than there is, its states are not finite) gets an empty embedding and its
        ``error``; the others go on. Every built-in family serves it; a model whose family keeps
        no :class:`~metrale.layers.loading.DecoderEnds` raises
        :class:`~metrale.errors.ConfigError`, and so does tensor parallelism (not served yet)."""
        params = self.pooling_params(PoolingParams(pooling, normalize))
        hold = self._take("embed()")
        try:
            prompt_list = split_prompts(prompts)
            parsed = [self.prompt_ids(prompt, f"prompts[{index}]") for index, prompt in enumerate(prompt_list)]
            groups = [self.new_pooling_group(text, ids, params) for text, ids in parsed]
            bar = None
            if check_bool("use_tqdm", use_tqdm) and self.show_progress and len(groups) > 1:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(groups), desc="embedding", unit="prompt", leave=False)
            try:
                with self._engine_run(groups, hold):  # type: ignore[arg-type]
                    while self.engine.has_unfinished():
                        done = sum(1 for r in self.engine.step() if r.finish_reason is not None)
                        if bar is not None and done:
                            bar.update(done)
            finally:
                if bar is not None:
                    bar.close()
            outputs = [group.output(finished=True) for group in groups]
        finally:
            self._release(hold)
        for output in outputs:
            if output.error is not None:
                logger.warning("request %s failed: %s", output.request_id, output.error)
        return outputs

    def score(self, token_ids: Sequence[int], *, lora_request: LoRARequest | None = None) -> np.ndarray:
        """Teacher-forced logits for every position of ``token_ids``: ``[len, vocab]`` float32
        (with the adapter of ``lora_request`` when given).

        Row ``i`` holds the logits that predict token ``i + 1``.
        """
        hold = self._take("score()")
        try:
            if isinstance(token_ids, (str, dict)):
                raise InvalidRequestError(f"score() takes a list of token ids, got {token_ids!r}")
            _, ids = self.prompt_ids(token_ids, "the scored sequence")
            seq = SequenceState.from_prompt(ids)
            with self._holding_adapter(seq, self.lora_requests(lora_request, 1)[0]):
                try:
                    logits = self.backend.to_numpy(self.forward.score(ids, seq)).copy()
                    self.cache.release(seq)
                except BaseException:
                    self._recover(seqs=[seq])
                    raise
            return logits
        finally:
            self._release(hold)
