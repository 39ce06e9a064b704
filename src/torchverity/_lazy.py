"""Lazy package attributes, so ``import torchverity`` and the torch-free commands (``hash``,
``verify``, ``scan``) never pay for torch.

A package lists its public names once, as imports under ``if TYPE_CHECKING:`` (what type
checkers and readers see; ``from <package> import sub`` for a submodule), plus ``__all__``.
:func:`attach` reads that block from the package's own source and imports each module on
first access to one of its names, the way scientific Python's ``lazy_loader`` reads a stub.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def _type_checking_imports(source: str, package: str) -> dict[str, tuple[str, str | None]]:
    """Public name -> (module, attribute in it, or None when the name is the module).

    ``from <package> import sub`` in a package's own ``__init__`` names a submodule.
    """
    import ast  # parsed on first use: the CLI's start-up never needs the table

    exports: dict[str, tuple[str, str | None]] = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
                and node.test.id == "TYPE_CHECKING"):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.ImportFrom) and stmt.module:
                for alias in stmt.names:
                    exports[alias.asname or alias.name] = (
                        (f"{package}.{alias.name}", None) if stmt.module == package
                        else (stmt.module, alias.name))
    return exports


def attach(package: str, init_file: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for the package whose ``__init__`` is ``init_file``."""
    table: dict[str, tuple[str, str | None]] = {}
    # Read now, while the package is being imported: a process may lose access to its own
    # files later (a dropped privilege, a removed checkout). Parsed on first use.
    with open(init_file, encoding="utf-8") as fh:
        source = fh.read()

    def exports() -> dict[str, tuple[str, str | None]]:
        if not table:
            table.update(_type_checking_imports(source, package))
        return table

    def __getattr__(name: str) -> Any:
        if name not in exports():
            raise AttributeError(f"module '{package}' has no attribute '{name}'")
        module, attribute = exports()[name]
        imported = importlib.import_module(module)
        value = imported if attribute is None else getattr(imported, attribute)
        importlib.import_module(package).__dict__[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(exports())

    return __getattr__, __dir__
