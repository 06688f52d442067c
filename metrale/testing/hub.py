"""A Hugging Face Hub cache written by hand, for tests without a network: the layout
``huggingface_hub`` keeps (``models--ORG--NAME/blobs`` by content hash, ``snapshots/COMMIT`` of
links to the blobs, ``refs/REVISION`` naming a commit), so that ``huggingface_hub`` itself
resolves a Hub id from it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cached_repo_folder(cache_dir: str | Path, repo_id: str) -> Path:
    """``cache_dir/models--ORG--NAME``."""
    return Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def write_hub_cache(cache_dir: str | Path, repo_id: str, folder: str | Path, *, revision: str = "main",
                    commit: str | None = None, skip: tuple[str, ...] = ()) -> str:
    """Put the files of checkpoint ``folder`` (but those named in ``skip``) into the Hub cache
    ``cache_dir`` as commit ``commit`` (default: a hash of their contents) of model ``repo_id``,
    with ref ``revision`` pointing at it; return the commit."""
    source = Path(folder)
    files = sorted(path for path in source.iterdir() if path.is_file() and path.name not in skip)
    if commit is None:
        digest = hashlib.sha1()
        for path in files:
            digest.update(path.name.encode() + path.read_bytes())
        commit = digest.hexdigest()
    repo = cached_repo_folder(cache_dir, repo_id)
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in files:
        data = path.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / path.name
        if link.exists() or link.is_symlink():
            link.unlink()
        os.symlink(os.path.relpath(blob, snapshot), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return commit
