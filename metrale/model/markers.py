"""The pluggy markers of Metrale's hooks: :data:`hookspec` marks a specification
(:mod:`metrale.model.hookspecs`), :data:`hookimpl` a plugin's implementation (also exported as
``metrale.hookimpl`` and ``metrale.model.hookspecs.hookimpl``)."""

from __future__ import annotations

import pluggy

#: The project name pluggy groups the hooks under (``metrale_*`` hooks, the ``metrale`` entry-point group).
PROJECT_NAME = "metrale"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
