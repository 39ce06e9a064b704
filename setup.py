"""Build hook: installs ``torchverity-protect.pth`` into site-packages.

The project's metadata is in pyproject.toml. The .pth file turns on
``torchverity.protect`` at interpreter start when ``TORCHVERITY_PROTECT`` is set;
its one line reads the variable and imports nothing otherwise. Wheels (and so
plain installs) get it at the root of the build, beside the packages;
editable installs get it written into the editable wheel next to setuptools'
own ``__editable__`` .pth.
"""

from __future__ import annotations

import os
from typing import Any

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "torchverity-protect.pth"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "src", PTH)


class BuildWithStartupHook(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(SOURCE, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


class _StrategyWithStartupHook:
    """setuptools' editable strategy, plus the startup .pth in the same wheel."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __call__(self, wheel: Any, files: list[str], mapping: dict[str, str]) -> None:
        self._inner(wheel, files, mapping)
        with open(SOURCE, "rb") as fh:
            wheel.writestr(PTH, fh.read())

    def __enter__(self) -> _StrategyWithStartupHook:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)


class EditableWithStartupHook(editable_wheel):
    def _select_strategy(self, name: str, tag: str, build_lib: Any) -> Any:
        return _StrategyWithStartupHook(super()._select_strategy(name, tag, build_lib))


setup(cmdclass={"build_py": BuildWithStartupHook, "editable_wheel": EditableWithStartupHook})
