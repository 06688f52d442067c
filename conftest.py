"""Keeps the checkout's top-level folders from shadowing installed distributions.

``kernels/`` and ``plugins/`` install as ``metrale.kernels`` and ``metrale.plugins``; they are not
top-level packages. ``python -m pytest`` puts the working directory on ``sys.path``, where the
checkout's ``kernels/`` would hide the ``kernels`` distribution that transformers imports (and
loading this file puts the checkout there too). The tests import the project as installed, so the
checkout's own directory is taken off the path before anything is collected.
"""

from __future__ import annotations

import sys
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent


def _is_checkout(entry: str) -> bool:
    try:
        return Path(entry or ".").resolve() == _CHECKOUT
    except OSError:
        return False


sys.path[:] = [entry for entry in sys.path if not _is_checkout(entry)]
