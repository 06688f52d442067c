"""Tests of the Phi-3 family. A package, so that its ``conftest`` module does not take the name
``conftest`` from ``tests/conftest.py``, which other test modules import by that name."""
