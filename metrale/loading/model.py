"""A model from a checkpoint: the folder a ``model`` argument names, and the model a family
plugin builds from it on a backend (on every rank, the same way)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from metrale.backends.devices import get_backend
from metrale.config import EngineConfig, read_environment
from metrale.errors import CheckpointError, ConfigError, HubModelNotFoundError, HubOfflineError
from metrale.loading.checkpoint import Checkpoint
from metrale.model.family import resolve_family
from metrale.model.plugin_manager import get_plugin_manager
from metrale.models import embedded_model_path, embedded_models
from metrale.ops import build_op_registry


def resolve_model_path(model: str | Path, *, revision: str | None = None, download_dir: str | Path | None = None,
                       show_progress: bool = True, tokenizer_only: bool = False) -> Path:
    """A checkpoint folder: an existing path, the name of an embedded checkpoint, or a Hugging
    Face Hub id (``ORG/NAME``) resolved from the cache or downloaded into it at ``revision``
    (:mod:`metrale.loading.hub`; ``download_dir`` replaces the cache). ``tokenizer_only``: a
    folder a tokenizer comes from (no weights needed). ``revision`` and ``download_dir`` apply to
    Hub ids only (:class:`~metrale.errors.ConfigError` with a folder or an embedded name)."""
    from metrale.loading import hub

    if not isinstance(model, (str, Path)) or not str(model):
        raise CheckpointError(f"model must be a checkpoint folder, an embedded model name or a Hugging Face Hub id, "
                              f"got {model!r}")
    path = Path(model).expanduser()
    local = path.is_dir() or embedded_model_path(str(model)) is not None
    if local and (revision is not None or download_dir is not None):
        given = "revision" if revision is not None else "download_dir"
        raise ConfigError(f"{given} applies to Hugging Face Hub ids only; {str(model)!r} is a local "
                          f"{'folder' if path.is_dir() else 'embedded model'}")
    if path.is_dir():
        return path
    embedded = embedded_model_path(str(model))
    if embedded is not None:
        return embedded
    if path.exists():
        raise CheckpointError(f"model {str(model)!r} is a file, not a checkpoint folder")
    if isinstance(model, str) and hub.looks_like_hub_id(model):
        files = hub.TOKENIZER_FILES if tokenizer_only else hub.HUB_FILES
        try:
            return hub.download_model(model, revision=revision, download_dir=download_dir, show_progress=show_progress,
                                      files=files, weights=not tokenizer_only)
        except (HubModelNotFoundError, HubOfflineError) as error:
            # (Perhaps a mistyped folder or embedded name rather than a Hub id.)
            raise type(error)(f"{error}; nor is it a checkpoint folder or an embedded model "
                              f"({', '.join(embedded_models()) or 'none'})") from None
    raise CheckpointError(f"model {str(model)!r} is neither a checkpoint folder, an embedded model nor a Hugging Face "
                          f"Hub id (embedded: {', '.join(embedded_models()) or 'none'})")


def load_model(plugin_manager: Any, family: Any, checkpoint: Checkpoint, backend: Any, config: EngineConfig) -> Any:
    """The model a plugin builds for ``family`` from ``checkpoint`` on ``backend`` (this rank's
    part of it, :mod:`metrale.backends.parallel`)."""
    with backend.activate():
        try:
            model = plugin_manager.hook.metrale_load_model(family=family, checkpoint=checkpoint, backend=backend,
                                                           config=config)
        finally:
            finish = getattr(backend, "finish_loading", None)  # a backend not built on Backend has none
            if finish is not None:
                finish()
    if model is None:
        raise CheckpointError(f"no plugin built a model for family {family.name!r}")
    if getattr(backend, "batch_invariant", False) and not getattr(model, "batch_invariant_capable", False):
        raise ConfigError(f"family {family.name!r} ({type(model).__name__}) does not say it runs batch-invariant "
                          "(FamilyModel.batch_invariant_capable); run it without batch_invariant=True")
    return model


def load_rank_model(model_path: str, options: dict) -> tuple[Any, Any, Any, Any]:
    """``(model, backend, plugin manager, environment)`` of a worker rank, built as
    :class:`LLM` builds rank 0's from the same ``options`` (inside
    :func:`~metrale.backends.parallel.rank_context`, :mod:`metrale.backends.executor`)."""
    environment = read_environment()
    config = EngineConfig.from_options(options, environment)
    plugin_manager = get_plugin_manager(environment=environment)
    checkpoint = Checkpoint(Path(model_path), quantization=config.quantization)
    family = resolve_family(plugin_manager, checkpoint.config)
    backend = get_backend(config.device, cuda_graphs=config.cuda_graphs, environment=config.environment)
    backend.use_ops(build_op_registry(plugin_manager))
    return load_model(plugin_manager, family, checkpoint, backend, config), backend, plugin_manager, environment
