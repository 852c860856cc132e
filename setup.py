"""Build step that pyproject.toml cannot say: copy the top-level tla/, specs/ and examples/
into the wheel as omni_core/_data/ (omni_core/resources.py finds them there once installed).

The checkout keeps one copy of each, at the top level where docs, tests and reviewers use
them; the wheel gets a copy made at build time. An editable install copies nothing: it runs
from the checkout, which has them."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED = ("tla", "specs", "examples")  # omni_core/resources.py: SHIPPED
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "states", "*.out", "*.old")


class BuildPyWithData(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "omni_core" / "_data"
        for name in SHIPPED:
            source = ROOT / name
            if not source.is_dir():
                raise SystemExit(
                    f"setup.py: {source} is missing; a wheel without it cannot check traces "
                    "or serve the examples (build from a full checkout or its sdist)"
                )
            shutil.copytree(source, target / name, ignore=SKIP, dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildPyWithData})
