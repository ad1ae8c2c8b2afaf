"""Metadata lives in pyproject.toml. This adds one build step: the wheel carries the native kernels' C++
sources (the repository's runtime_ops/) as oscar_export/runtime_ops/, so that an installed package can
build its op libraries (oscar_export/native.py). MANIFEST.in puts runtime_ops/ in the sdist."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SOURCES = Path(__file__).resolve().parent / "runtime_ops"


class BuildPyWithNativeSources(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # an editable install reads runtime_ops/ from the checkout
            return
        dest = Path(self.build_lib) / "oscar_export" / "runtime_ops"
        shutil.rmtree(dest, ignore_errors=True)  # no file removed from runtime_ops/ lingers in build/
        shutil.copytree(SOURCES, dest)


setup(cmdclass={"build_py": BuildPyWithNativeSources})
