"""Package discovery; everything else is declared in setup.cfg.

The top-level ``plugins/`` and ``kernels/`` folders install as ``metrale.plugins`` and
``metrale.kernels`` (``package_dir`` in setup.cfg); every package under them is found here, so a
new family or kernel package cannot be left out of the wheel.
"""

from setuptools import find_packages, setup


def mapped_packages(folder: str, name: str) -> list[str]:
    """``name`` and every package below ``folder``, named under ``name``."""
    return [name] + [f"{name}.{package}" for package in find_packages(folder)]


setup(
    packages=find_packages(include=["metrale", "metrale.*"])
    + mapped_packages("plugins", "metrale.plugins")
    + mapped_packages("kernels", "metrale.kernels"),
)
