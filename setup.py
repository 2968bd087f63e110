"""Package layout for setuptools (the metadata is in pyproject.toml).

``csrc/`` (CUDA kernel sources) and ``configs/`` (recipes) live at the repository's top level; the
wheel carries them inside the package as ``lightning_moe/_csrc`` and ``lightning_moe/_configs``
(which files: ``[tool.setuptools.package-data]``), where :mod:`lightning_moe.resources` finds them.
"""

from setuptools import find_packages, setup

__all__: list[str] = []

setup(
    packages=[*find_packages(include=["lightning_moe", "lightning_moe.*"]), "lightning_moe._csrc", "lightning_moe._configs"],
    package_dir={"lightning_moe._csrc": "csrc", "lightning_moe._configs": "configs"},
)
