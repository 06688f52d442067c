"""Checkpoints shipped with the package, reachable by name (``LLM("tiny-dense")``)."""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent

#: The model ``metrale generate`` uses when no ``--model`` is given.
DEFAULT_MODEL = "tiny-dense"


def embedded_models() -> list[str]:
    """Names of the checkpoints shipped with the package."""
    return sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())


def embedded_model_path(name: str) -> Path | None:
    """The folder of the embedded checkpoint ``name``, or None when there is none."""
    if "/" in name or name.startswith("."):
        return None
    path = MODELS_DIR / name
    return path if (path / "config.json").is_file() else None
