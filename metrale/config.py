"""Engine configuration.

This module is the only reader of ``METRALE_*`` environment variables: everything else receives
its settings as the dataclasses below.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Mapping

from metrale.errors import ConfigError, UnknownOptionError

#: Environment variables the engine reads, with a one-line description each. The docs page
#: ``environment`` documents every entry; a test keeps the two in step.
ENVIRONMENT_VARIABLES: dict[str, str] = {
    "METRALE_DEVICE": "default device when LLM(device='auto') is used: 'auto', 'cpu' or 'cuda'",
    "METRALE_BLOCKED_PLUGINS": "comma-separated plugin names that are not registered",
    "METRALE_NO_ENTRY_POINTS": "when set to 1, third-party plugins (entry points) are not loaded",
    "METRALE_NO_MTP_EAGER_DRAFTER": "when set to 1, the eager MTP drafter stage never runs",
    "METRALE_NO_PROGRESS": "when set to 1, no progress bars are shown",
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{name}={env[name]!r} is not a boolean (use 1 or 0)")


@dataclass(frozen=True)
class EnvironmentConfig:
    """The ``METRALE_*`` variables, parsed."""

    device: str = "auto"
    blocked_plugins: tuple[str, ...] = ()
    no_entry_points: bool = False
    no_mtp_eager_drafter: bool = False
    no_progress: bool = False


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
    )


@dataclass(frozen=True)
class CacheConfig:
    """Sizing of the paged KV cache and of the recurrent-state slot pool.

    ``num_blocks`` counts usable blocks; one extra dummy block (id 0) is always reserved for
    padding rows. When ``num_blocks`` is None it is derived from ``memory_bytes``, capped at what
    ``max_num_seqs`` sequences of ``max_model_len`` tokens can use; ``num_state_snapshots`` is how
    many recurrent-state snapshots a model with recurrent layers keeps for prefix-cache hits;
    ``memory_bytes`` None means
    512 MiB on the CPU and 80% of the free device memory on the GPU.
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int | None = None
    num_state_slots: int = 8
    num_state_snapshots: int = 16

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.memory_bytes is not None and self.memory_bytes < 1:
            raise ConfigError(f"memory_bytes must be >= 1, got {self.memory_bytes}")
        if self.num_state_slots < 1:
            raise ConfigError(f"num_state_slots must be >= 1, got {self.num_state_slots}")
        if self.num_state_snapshots < 0:
            raise ConfigError(f"num_state_snapshots must be >= 0, got {self.num_state_snapshots}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know besides the checkpoint.

    ``device`` is ``"auto"``, ``"cpu"`` or ``"cuda"``; ``max_model_len`` caps the context (None:
    the checkpoint's ``max_position_embeddings``); ``max_num_seqs`` caps the requests running at
    once; ``max_num_batched_tokens`` is the token budget of one engine step for prefill chunks
    (decode rows always run; at least the KV block size); ``enable_prefix_caching`` shares the
    KV blocks of equal prompt prefixes between requests; ``seed`` seeds requests that give no
    seed; ``cuda_graphs`` replays decode steps from CUDA graphs on the GPU.
    """

    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    seed: int = 0
    cuda_graphs: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if isinstance(self.max_num_batched_tokens, bool) or not isinstance(self.max_num_batched_tokens, int) \
                or self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be an int >= 1, got {self.max_num_batched_tokens!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, object], env: EnvironmentConfig) -> "EngineConfig":
        """Build a config from flat keyword options (those :class:`metrale.LLM` accepts)."""
        engine_names = {f.name for f in fields(cls)} - {"cache", "environment"}
        cache_names = {f.name for f in fields(CacheConfig)}
        engine_kwargs: dict[str, object] = {}
        cache_kwargs: dict[str, object] = {}
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
