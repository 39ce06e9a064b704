"""What an unpickler imports to resolve a global, and the modules that act when imported.

CPython's ``find_class`` runs ``__import__(module)`` (each parent package first) and only
then looks the name up; GLOBAL and INST decode their two lines first (UTF-8 and ASCII),
and pickle.py (the unpickler joblib uses) calls ``find_class`` for INST before it pops
the MARK, and even for a line the end of the stream cuts (it drops the line's last
byte, newline or not). Nothing here imports anything: names are judged by their spelling.

Installed packages name their modules with identifiers, except modules that nothing
imports by name (rich's ``unicode13-0-0`` tables, sysconfig's ``_sysconfigdata_*``,
mypyc runtime libraries) and pip's ``__pip-runner__``, listed below: a global whose
module path or name is not a dotted identifier is one that ``find_class`` fails on.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchverity.pickles._values import GlobalRef

# Modules whose import does something beyond defining names (checked parents first; any
# ``<package>.__main__`` too, which runs the package as a program).
IMPORT_EFFECTS: dict[str, str] = {
    "this": "prints the Zen of Python",
    "antigravity": "opens a web browser",
    "__hello__": "prints a greeting (Python 3.10 and older)",
    "__phello__": "prints a greeting (Python 3.10 and older)",
    "idlelib.idle": "starts the IDLE editor",
    "test.autotest": "runs CPython's test suite",
    "pip.__pip-runner__": "installs an import hook, then runs pip",
}
_MAIN = "runs the package as a program (a __main__ module)"


@dataclass(frozen=True)
class Lookup:
    """What ``find_class`` does for one global: the modules it imports, parents first, and
    whether the lookup can succeed at all (False: it fails after those imports)."""

    modules: tuple[str, ...]
    found: bool


def python_name(ref: GlobalRef, protocol: int) -> tuple[str, str]:
    """The (module, name) Python's unpickler imports: protocols 0-2 remap Python 2 names."""
    import _compat_pickle

    key = (ref.module, ref.name)
    if protocol >= 3:
        return key
    if key in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[key]
    return _compat_pickle.IMPORT_MAPPING.get(ref.module, ref.module), ref.name


def _decoded(ref: GlobalRef) -> GlobalRef | None:
    """The names as the unpickler decodes the lines (the walker keeps them as latin-1);
    None when it cannot decode them, and fails before importing anything."""
    if ref.opcode not in ("GLOBAL", "INST"):
        return ref
    codec = "utf-8" if ref.opcode == "GLOBAL" else "ascii"
    try:
        module = ref.module.encode("latin-1").decode(codec)
        name = ref.name.encode("latin-1").decode(codec)
    except UnicodeError:
        return None
    return GlobalRef(module, name, ref.offset, ref.opcode, ref.dynamic)


def lookup(ref: GlobalRef, protocol: int) -> Lookup:
    """The imports ``find_class`` makes for a global named in the file (not a computed one)."""
    decoded = _decoded(ref)
    if decoded is None:
        return Lookup((), False)
    module, name = python_name(decoded, protocol)
    parts = module.split(".")
    modules: list[str] = []
    for i, part in enumerate(parts):
        path = ".".join(parts[: i + 1])
        if not part.isidentifier() and path not in IMPORT_EFFECTS:
            return Lookup(tuple(modules), False)
        modules.append(path)
    # Protocol 4 resolves dotted names attribute by attribute; older ones take one name.
    names = name.split(".") if protocol >= 4 else [name]
    return Lookup(tuple(modules), all(n.isidentifier() for n in names))


def import_effect(modules: tuple[str, ...]) -> tuple[str, str] | None:
    """(module, what importing it does) for the first of ``modules`` known to act."""
    for module in modules:
        if module in IMPORT_EFFECTS:
            return module, IMPORT_EFFECTS[module]
        if "__main__" in module.split(".")[1:]:
            return module, _MAIN
    return None
