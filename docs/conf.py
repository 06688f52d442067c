"""Sphinx configuration of the Metrale documentation.

Build with ``sphinx-build -W --keep-going -b html docs docs/_build/html`` from the repository
root; metrale must be importable (``python3 -m pip install -e .``).
"""

from metrale._version import __version__

project = "Metrale"
author = "The Metrale authors"
copyright = "The Metrale authors"
version = __version__
release = __version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinxcontrib.mermaid",
]

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# -- autodoc -------------------------------------------------------------------------------------

autodoc_typehints = "description"
# The conformance kit is a pytest plugin; the docs build needs only the docs extra, so pytest
# is stood in for while its modules are imported.
autodoc_mock_imports = ["pytest"]
autodoc_member_order = "bysource"
autoclass_content = "class"

# -- napoleon ------------------------------------------------------------------------------------

napoleon_google_docstring = True
napoleon_numpy_docstring = False

# -- diagrams ------------------------------------------------------------------------------------

# The diagrams' Mermaid sources stay in the pages (``.. mermaid::``); the reader's browser draws
# them, so the build needs no Mermaid binary.
mermaid_output_format = "raw"
# As tall as the page's width makes them (the extension's default is a fixed 500 px box).
mermaid_height = "auto"

# -- HTML ----------------------------------------------------------------------------------------

html_theme = "furo"
html_title = f"Metrale {release}"
html_static_path: list[str] = []
