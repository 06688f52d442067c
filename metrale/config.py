"""Engine configuration.

This module is the only reader of ``METRALE_*`` environment variables (and of the one vLLM
variable Metrale honours, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): everything else receives its
settings as the dataclasses below, or from the readers here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import PurePath
from typing import Any, Callable, Mapping

from metrale.errors import ConfigError, UnknownOptionError, UnsupportedQuantizationError
from metrale.validation import check_bool, check_int, check_optional_int, check_seed

#: Environment variables the engine reads, with a one-line description each. The docs page
#: ``environment`` documents every entry; a test keeps the two in step.
ENVIRONMENT_VARIABLES: dict[str, str] = {
    "METRALE_DEVICE": "default device when LLM(device='auto') is used: 'auto', 'cpu' or 'cuda'",
    "METRALE_BLOCKED_PLUGINS": "comma-separated plugin names that are not registered",
    "METRALE_NO_ENTRY_POINTS": "when set to 1, third-party plugins (entry points) are not loaded",
    "METRALE_NO_MTP_EAGER_DRAFTER": "when set to 1, the eager MTP drafter stage never runs",
    "METRALE_NO_PROGRESS": "when set to 1, no progress bars are shown",
    "METRALE_NUMBA_LAUNCH": "when set to 1, numba kernels launch through numba's own launcher, not CuPy's",
    "METRALE_DECODE_MMA": "when set to 0, decode attention runs on CUDA cores where tensor cores would serve",
    "METRALE_DEPENDENT_LAUNCH": "set to 0, the CUDA C++ decode kernels launch without programmatic dependent launch",
    "METRALE_API_KEY": "the API key metrale serve requires when --api-key is not given",
    "METRALE_KERNEL_CACHE": "the folder of compiled sm_90a kernels (default $XDG_CACHE_HOME/metrale/kernels)",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "vLLM's switch: 1 or true turns on the server's LoRA load and unload endpoints",
}

#: vLLM's variable that turns on ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``.
RUNTIME_LORA_VARIABLE = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def environment_flag(name: str, env: Mapping[str, str] | None = None, default: bool = False) -> bool:
    """One boolean ``METRALE_*`` variable of ``env`` (default: ``os.environ``), parsed as
    :func:`read_environment` parses it: for a reader that must not depend on the others. Unset or
    empty, it is ``default``."""
    return _flag(os.environ if env is None else env, name, default)


def environment_api_key(env: Mapping[str, str] | None = None) -> str | None:
    """``METRALE_API_KEY`` of ``env`` (default: ``os.environ``): the key ``metrale serve``
    requires when ``--api-key`` is not given; None when unset or empty."""
    value = (os.environ if env is None else env).get("METRALE_API_KEY", "")
    return value or None


def environment_api_key_is_empty(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``METRALE_API_KEY`` is set to the empty string (which :func:`environment_api_key`
    reads as no key, as when it is unset)."""
    return (os.environ if env is None else env).get("METRALE_API_KEY") == ""


def environment_allows_runtime_lora_updating(env: Mapping[str, str] | None = None) -> bool:
    """``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` of ``env`` (default: ``os.environ``), read as vLLM reads
    it: true when it is ``1`` or ``true`` (any letter case, spaces around ignored), false for
    anything else, unset included."""
    return (os.environ if env is None else env).get(RUNTIME_LORA_VARIABLE, "0").strip().lower() in ("1", "true")


def _flag(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{name}={env[name]!r} is not a boolean (use 1 or 0)")


@dataclass(frozen=True)
class EnvironmentConfig:
    """The ``METRALE_*`` variables, parsed.

    The kernel settings reach the kernels through the backend, never by a kernel reading the
    environment: ``decode_mma`` is a condition of the op registry (a kernel's ``enabled``,
    :class:`~metrale.ops.Kernel`); ``numba_launch`` and ``dependent_launch`` say how kernels
    launch, and the CUDA backend applies them when it is built, as it applies ``kernel_cache``
    (where compiled ``sm_90a`` kernels are kept). ``batch_invariant`` is no
    variable: it is the engine's option of that name (:class:`EngineConfig`), carried here so that
    the op registry binds the batch-invariant kernels under it like any other setting."""

    device: str = "auto"
    blocked_plugins: tuple[str, ...] = ()
    no_entry_points: bool = False
    no_mtp_eager_drafter: bool = False
    no_progress: bool = False
    numba_launch: bool = False
    decode_mma: bool = True
    dependent_launch: bool = True
    batch_invariant: bool = False
    kernel_cache: str | None = None


def read_environment(env: Mapping[str, str] | None = None) -> EnvironmentConfig:
    """Parse the ``METRALE_*`` variables of ``env`` (default: ``os.environ``)."""
    env = os.environ if env is None else env
    device = env.get("METRALE_DEVICE", "auto").strip().lower() or "auto"
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"METRALE_DEVICE={device!r} is not one of 'auto', 'cpu', 'cuda'")
    blocked = tuple(
        name.strip() for name in env.get("METRALE_BLOCKED_PLUGINS", "").split(",") if name.strip()
    )
    return EnvironmentConfig(
        device=device,
        blocked_plugins=blocked,
        no_entry_points=_flag(env, "METRALE_NO_ENTRY_POINTS"),
        no_mtp_eager_drafter=_flag(env, "METRALE_NO_MTP_EAGER_DRAFTER"),
        no_progress=_flag(env, "METRALE_NO_PROGRESS"),
        numba_launch=_flag(env, "METRALE_NUMBA_LAUNCH"),
        decode_mma=_flag(env, "METRALE_DECODE_MMA", default=True),
        dependent_launch=_flag(env, "METRALE_DEPENDENT_LAUNCH", default=True),
        kernel_cache=kernel_cache_folder(env),
    )


def kernel_cache_folder(env: Mapping[str, str] | None = None) -> str:
    """Where kernels compiled for ``sm_90a`` are kept between processes: ``METRALE_KERNEL_CACHE``
    of ``env`` (default: ``os.environ``) if set, else ``$XDG_CACHE_HOME/metrale/kernels``
    (``~/.cache/metrale/kernels``), the user's folder expanded."""
    env = os.environ if env is None else env
    configured = env.get("METRALE_KERNEL_CACHE", "").strip()
    if configured:
        return os.path.expanduser(configured)
    return os.path.join(os.path.expanduser(env.get("XDG_CACHE_HOME") or "~/.cache"), "metrale", "kernels")


#: The values the ``kv_cache_dtype`` option takes: ``"auto"`` (the backend's cache dtype) or an
#: FP8 E4M3 cache (``"fp8"``, ``"fp8_e4m3"``; :mod:`metrale.kernels.kv_cache_fp8`).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def check_kv_cache_dtype(kv_cache_dtype: object) -> str:
    """``kv_cache_dtype`` checked: one of :data:`KV_CACHE_DTYPES`, else
    :class:`~metrale.errors.UnsupportedQuantizationError` naming those that are served."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UnsupportedQuantizationError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not served; use one of {', '.join(map(repr, KV_CACHE_DTYPES))} "
            "(FP8 E4M3 only: fp8_e5m2 is not served)"
        )
    return kv_cache_dtype


@dataclass(frozen=True)
class CacheConfig:
    """Sizing of the paged KV cache and of the recurrent-state slot pool.

    ``num_blocks`` counts usable blocks; one extra dummy block (id 0) is always reserved for
    padding rows. When ``num_blocks`` is None it is derived from ``memory_bytes``, capped at what
    ``max_num_seqs`` sequences of ``max_model_len`` tokens can use; ``num_state_snapshots`` is how
    many recurrent-state snapshots a model with recurrent layers keeps for prefix-cache hits;
    ``memory_bytes`` None means
    512 MiB on the CPU and 80% of the free device memory on the GPU. ``block_size`` is at most
    1024. The whole cache is checked against the memory available before it is allocated.
    ``kv_cache_dtype`` is how keys, values and latents are stored: ``"auto"`` (the backend's cache
    dtype: float32 on the CPU, bf16 on the GPU) or ``"fp8"`` / ``"fp8_e4m3"`` (FP8 E4M3 codes with a
    float32 scale per token and head, the checkpoint's static ``k_scale`` / ``v_scale`` where it
    has them); any other value raises
    :class:`~metrale.errors.UnsupportedQuantizationError`.
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int | None = None
    num_state_slots: int = 8
    num_state_snapshots: int = 16
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _checked(self, {
            "kv_cache_dtype": check_kv_cache_dtype,
            "block_size": lambda v: check_int("block_size", v, minimum=1, maximum=MAX_BLOCK_SIZE, error=ConfigError),
            "num_blocks": lambda v: check_optional_int("num_blocks", v, minimum=1, maximum=MAX_COUNT, error=ConfigError),
            "memory_bytes": lambda v: check_optional_int("memory_bytes", v, minimum=1, maximum=MAX_BYTES, error=ConfigError),
            "num_state_slots": lambda v: check_int("num_state_slots", v, minimum=1, maximum=MAX_COUNT, error=ConfigError),
            "num_state_snapshots": lambda v: check_int(
                "num_state_snapshots", v, minimum=0, maximum=MAX_COUNT, error=ConfigError
            ),
        })


#: The largest KV block: a block's tokens are handled together by the attention kernels.
MAX_BLOCK_SIZE = 1024
#: Bounds of the counts (blocks, slots, sequences, tokens) and byte sizes an option may give:
#: far above any machine, low enough that sizes computed from them stay exact.
MAX_COUNT = 1 << 40
#: Bounds of the LoRA options: adapter slots on the device, and the rank of one adapter module.
MAX_LORAS = 1024
MAX_LORA_RANK = 1024
#: The most ranks a model is split over, and how their worker processes are started.
MAX_RANKS = 1024
EXECUTOR_BACKENDS = ("mp", "ray")
MAX_BYTES = 1 << 60


def _checked(config: object, checks: Mapping[str, Callable[[object], object]]) -> None:
    """Replace each field of a frozen ``config`` by its checked, canonical value."""
    for name, check in checks.items():
        object.__setattr__(config, name, check(getattr(config, name)))


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know besides the checkpoint.

    ``device`` is ``"auto"``, ``"cpu"`` or ``"cuda"``; ``max_model_len`` caps the context (None:
    the checkpoint's ``max_position_embeddings``); ``max_num_seqs`` caps the requests running at
    once; ``max_num_batched_tokens`` is the token budget of one engine step for prefill chunks
    (decode rows always run; at least the KV block size); ``enable_prefix_caching`` shares the
    KV blocks of equal prompt prefixes between requests; ``seed`` (an int in ``[0, 2**64)``)
    seeds requests that give no seed; ``cuda_graphs`` replays decode steps from CUDA graphs on
    the GPU; ``overlap_scheduling`` plans and queues each engine step while the one before it
    still runs, its decode tokens fed on the device (for models whose forward goes through the
    model runner; :mod:`metrale.engine.engine`); ``speculative_config`` turns on speculative
    decoding (a mapping such as ``{"method": "ngram", "num_speculative_tokens": 3}``, read into a
    :class:`~metrale.speculative.SpeculativeConfig`; decode steps then run without overlap);
    ``enable_lora`` serves LoRA adapters (:mod:`metrale.loading.lora`): ``max_loras`` of them on the
    device at once, of rank at most ``max_lora_rank``; ``tensor_parallel_size`` splits the model
    over that many ranks (:mod:`metrale.backends.parallel`; this process is rank 0, the others are worker
    processes started by ``distributed_executor_backend``: ``"mp"``, the default, processes on this
    machine, or ``"ray"``, Ray actors placed by a Ray cluster, :mod:`metrale.backends.executor`; on GPUs a
    visible device each, joined by NCCL), with
    ``expert_parallel`` spreading an MoE model's routed experts over the ranks instead of
    splitting each expert; ``quantization`` quantizes a full-precision checkpoint's linear layers
    at load (``"fp8"``, :mod:`metrale.loading.quantization`; a quantized checkpoint is read as
    stored whatever it says). ``revision`` (a branch, tag or commit) and ``download_dir`` (the
    cache to use) apply when the model is a Hugging Face Hub id (:mod:`metrale.loading.hub`);
    ``tokenizer`` takes the tokenizer and chat template from another checkpoint folder, embedded
    model or Hub id (at ``tokenizer_revision``). ``batch_invariant`` computes every row of a step
    from that row's inputs alone, so a prompt's logits are bitwise the same whatever else is in
    the batch and however its prefill is chunked (on the GPU, for bf16 weights and caches and
    families without MoE, MLA, Gated DeltaNet or LoRA layers; docs/serving.rst, "Batch-invariant
    mode"). Every value is type-checked: ints only ints, the flags only True or False
    (:class:`~metrale.errors.ConfigError` otherwise).
    """

    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    seed: int = 0
    cuda_graphs: bool = True
    overlap_scheduling: bool = True
    speculative_config: Any = None
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    distributed_executor_backend: str = "mp"
    quantization: str | None = None
    revision: str | None = None
    download_dir: str | None = None
    tokenizer: str | None = None
    tokenizer_revision: str | None = None
    batch_invariant: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        _checked(self, {
            "max_model_len": lambda v: check_optional_int("max_model_len", v, minimum=1, maximum=MAX_COUNT, error=ConfigError),
            "max_num_seqs": lambda v: check_int("max_num_seqs", v, minimum=1, maximum=MAX_COUNT, error=ConfigError),
            "max_num_batched_tokens": lambda v: check_int(
                "max_num_batched_tokens", v, minimum=1, maximum=MAX_COUNT, error=ConfigError
            ),
            "enable_prefix_caching": lambda v: check_bool("enable_prefix_caching", v, error=ConfigError),
            "seed": lambda v: check_seed("seed", v, error=ConfigError),
            "cuda_graphs": lambda v: check_bool("cuda_graphs", v, error=ConfigError),
            "overlap_scheduling": lambda v: check_bool("overlap_scheduling", v, error=ConfigError),
            "enable_lora": lambda v: check_bool("enable_lora", v, error=ConfigError),
            "max_loras": lambda v: check_int("max_loras", v, minimum=1, maximum=MAX_LORAS, error=ConfigError),
            "max_lora_rank": lambda v: check_int("max_lora_rank", v, minimum=1, maximum=MAX_LORA_RANK, error=ConfigError),
            "tensor_parallel_size": lambda v: check_int("tensor_parallel_size", v, minimum=1, maximum=MAX_RANKS,
                                                        error=ConfigError),
            "expert_parallel": lambda v: check_bool("expert_parallel", v, error=ConfigError),
            "batch_invariant": lambda v: check_bool("batch_invariant", v, error=ConfigError),
        })
        # The backend binds its kernels under its settings (metrale.ops.registry.Kernel.enabled).
        object.__setattr__(self, "environment", replace(self.environment, batch_invariant=self.batch_invariant))
        for name in ("revision", "download_dir", "tokenizer", "tokenizer_revision"):
            value = getattr(self, name)
            if isinstance(value, PurePath):
                object.__setattr__(self, name, str(value))
            elif value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{name} must be a non-empty string or None, got {value!r}")
        if self.quantization is not None and not isinstance(self.quantization, str):
            raise ConfigError(f"quantization must be a method name such as 'fp8' or None, got {self.quantization!r}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ConfigError(f"distributed_executor_backend must be one of {', '.join(map(repr, EXECUTOR_BACKENDS))}, "
                              f"got {self.distributed_executor_backend!r}")
        from metrale.speculative import SpeculativeConfig

        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config))

    @classmethod
    def from_options(cls, options: Mapping[str, object], env: EnvironmentConfig) -> "EngineConfig":
        """Build a config from flat keyword options (those :class:`metrale.LLM` accepts)."""
        engine_names = {f.name for f in fields(cls)} - {"cache", "environment"}
        cache_names = {f.name for f in fields(CacheConfig)}
        # Values as the caller gave them: the configs' ``__post_init__`` checks their types.
        engine_kwargs: dict[str, Any] = {}
        cache_kwargs: dict[str, Any] = {}
        for name, value in options.items():
            if name in engine_names:
                engine_kwargs[name] = value
            elif name in cache_names:
                cache_kwargs[name] = value
            else:
                known = ", ".join(sorted(engine_names | cache_names))
                raise UnknownOptionError(f"unknown engine option {name!r}; known options: {known}")
        if engine_kwargs.get("device", "auto") == "auto":
            engine_kwargs["device"] = env.device
        return cls(cache=CacheConfig(**cache_kwargs), environment=env, **engine_kwargs)
