"""A model from a checkpoint: the folder a ``model`` argument names, and the model a family
plugin builds from it on a backend (on every rank, the same way)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from metrale.backends.devices import get_backend
from metrale.config import EngineConfig, read_environment
from metrale.errors import CheckpointError
from metrale.loading.checkpoint import Checkpoint
from metrale.model.family import resolve_family
from metrale.model.plugin_manager import get_plugin_manager
from metrale.models import embedded_model_path, embedded_models
from metrale.ops import build_op_registry


def resolve_model_path(model: str | Path) -> Path:
    """A checkpoint folder: an existing path, or the name of an embedded checkpoint."""
    if not isinstance(model, (str, Path)) or not str(model):
        raise CheckpointError(f"model must be a checkpoint folder or an embedded model name, got {model!r}")
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    embedded = embedded_model_path(str(model))
    if embedded is not None:
        return embedded
    reason = "is a file, not a checkpoint folder" if path.exists() else "is neither a checkpoint folder nor an embedded model"
    raise CheckpointError(f"model {str(model)!r} {reason} (embedded: {', '.join(embedded_models()) or 'none'})")


def load_model(plugin_manager: Any, family: Any, checkpoint: Checkpoint, backend: Any, config: EngineConfig) -> Any:
    """The model a plugin builds for ``family`` from ``checkpoint`` on ``backend`` (this rank's
    part of it, :mod:`metrale.backends.parallel`)."""
    with backend.activate():
        model = plugin_manager.hook.metrale_load_model(family=family, checkpoint=checkpoint, backend=backend,
                                                       config=config)
    if model is None:
        raise CheckpointError(f"no plugin built a model for family {family.name!r}")
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
