"""Build hook: the wheel ships a copy of the top-level ``configs/`` as ``nexrl_hpc/configs``.

``configs/`` stays the one source of the defaults (Hydra reads it in place from a checkout); an
installed wheel has no checkout, so ``build_py`` copies the tree into the package. Everything else
about the package is in pyproject.toml.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithConfigs(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads configs/ in the checkout
        source = Path(__file__).resolve().parent / "configs"
        target = Path(self.build_lib) / "nexrl_hpc" / "configs"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildPyWithConfigs})
