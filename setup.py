"""Builds DynamiQ's CPU kernels at install and maps the top-level ``recipes/`` folder into the package (the rest
of the package is configured in pyproject.toml).

The kernels are plain C, not a Python module: each library of ``cpu_kernels_build.VARIANTS`` (one per x86-64
level; the portable one elsewhere) is a setuptools extension so that wheels and editable installs put it in
the package directory, where ``cpu_kernels.py`` loads it with ``ctypes``. Each is optional: without a C
compiler, or where a level's flags do not build, the install goes on and the kernels are compiled at run time
or the torch functions run (``cpu_kernels.origin()`` says which).
"""

import importlib.util
import os
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup

# loaded by path: pip's isolated build environment has neither torch nor this package
_spec = importlib.util.spec_from_file_location(
    "_fedshard_cpu_kernels_build", Path(__file__).parent / "lightning_fedshard" / "dynamiq" / "cpu_kernels_build.py"
)
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

ext_modules = [
    Extension(
        f"lightning_fedshard.dynamiq.{variant.name}",
        sources=["lightning_fedshard/dynamiq/cpu_kernels.c"],
        extra_compile_args=[*build.FLAGS, *variant.flags],
        define_macros=[build.source_macro()],
        libraries=["m"],
        optional=True,
    )
    for variant in build.variants(sysconfig.get_platform().rsplit("-", 1)[-1])
]
# The LightningCLI recipes live in the checkout's top-level recipes/ (where users and the design look for them)
# and ship as the data package lightning_fedshard.recipes.shipped (its files: pyproject's package-data), where
# lightning_fedshard.recipes finds them.
# Listed here, not in pyproject.toml: a package mapped from another folder is not found by `packages.find`.
RECIPES_PACKAGE = "lightning_fedshard.recipes.shipped"
setup(
    packages=[*find_packages(include=["lightning_fedshard*"]), RECIPES_PACKAGE],
    package_dir={RECIPES_PACKAGE: "recipes"},
    ext_modules=ext_modules if os.name == "posix" else [],
)
