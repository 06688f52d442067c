"""Models named by a Hugging Face Hub id (``ORG/NAME``), resolved to a checkpoint folder with
``huggingface_hub``: from the standard cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``; ``download_dir`` replaces it), downloading what is missing unless
``HF_HUB_OFFLINE=1``. Only the files the engine reads are fetched (:data:`HUB_FILES`: the config,
the safetensors weights and their index, the tokenizer and generation files; never ``.bin``,
``.pth`` or ``.gguf``), with a progress bar. ``HF_TOKEN`` (or a token saved by ``hf auth login``)
reaches gated and private models; ``HF_ENDPOINT`` names a Hub mirror. Every failure is a
:class:`~metrale.errors.HubError`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from metrale.errors import HubAccessError, HubError, HubModelNotFoundError, HubOfflineError, NoSafetensorsError

#: The files of a Hub repository the engine reads (glob patterns, as ``allow_patterns``).
HUB_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)

#: The files of a repository a tokenizer comes from (``tokenizer=``).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)

_TRUE = {"1", "true", "yes", "on"}


def looks_like_hub_id(text: str) -> bool:
    """Whether ``text`` can name a Hub repository (``NAME`` or ``ORG/NAME``: letters, digits,
    ``-``, ``_``, ``.``; no path syntax such as ``./``, ``~`` or a second ``/``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if text.startswith((".", "/", "~")) or text.count("/") > 1 or os.sep != "/" and os.sep in text:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def hub_cache_dir(download_dir: str | Path | None = None) -> Path:
    """Where Hub models are cached: ``download_dir``, else ``HF_HUB_CACHE``, else
    ``HF_HOME/hub``, else ``~/.cache/huggingface/hub`` (read when called, not at import)."""
    if download_dir is not None:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` asks for the cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def download_model(repo_id: str, *, revision: str | None = None, download_dir: str | Path | None = None,
                   show_progress: bool = True, files: tuple[str, ...] = HUB_FILES, weights: bool = True) -> Path:
    """The snapshot folder of Hub model ``repo_id`` at ``revision`` (a branch, tag or commit;
    None: ``main``) holding ``files``, from the cache or downloaded into it. With ``weights``
    the folder must hold ``.safetensors`` weights (:class:`~metrale.errors.NoSafetensorsError`)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = hub_offline()
    cache = hub_cache_dir(download_dir)
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        folder = Path(snapshot_download(
            repo_id, revision=revision, cache_dir=cache, allow_patterns=list(files), local_files_only=offline,
            endpoint=os.environ.get("HF_ENDPOINT") or None, tqdm_class=_progress_class(show_progress),
        ))
    except GatedRepoError as error:
        raise HubAccessError(f"{where} is gated on the Hugging Face Hub: accept its terms on its page and set HF_TOKEN "
                             f"to a token of an account with access ({_reason(error)})") from None
    except RevisionNotFoundError as error:
        raise HubModelNotFoundError(f"the Hugging Face Hub model {repo_id!r} has no revision {revision!r} "
                                    f"({_reason(error)})") from None
    except RepositoryNotFoundError as error:
        raise HubModelNotFoundError(f"{repo_id!r} is not a model on the Hugging Face Hub (a private model needs "
                                    f"HF_TOKEN) ({_reason(error)})") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as error:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        raise HubOfflineError(f"{where} is not in the Hugging Face cache at {cache} and {why}; download it "
                              f"once online, or point HF_HOME / HF_HUB_CACHE / download_dir at a cache that holds it "
                              f"({_reason(error)})") from None
    except HfHubHTTPError as error:
        status = getattr(getattr(error, "response", None), "status_code", None)
        if status in (401, 403):
            raise HubAccessError(f"the Hugging Face Hub refused {where} (HTTP {status}): set HF_TOKEN to a token that "
                                 f"may read it ({_reason(error)})") from None
        raise HubError(f"the Hugging Face Hub failed to serve {where}: {_reason(error)}") from None
    if weights and not any(folder.glob("*.safetensors")):
        raise NoSafetensorsError(f"the Hugging Face Hub model {where} has no .safetensors weights (the engine reads "
                                 "safetensors only, not .bin, .pth or .gguf files)")
    return folder


def _reason(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _progress_class(show: bool) -> Any:
    from tqdm.auto import tqdm

    if show:
        return tqdm

    class Silent(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent
