"""What ``torch.load(weights_only=True)`` will ask for when it reads a scanned file: every
global outside torch's allowlist, in one pass, each commented with its class, and the
``safe_globals`` code that makes the file load (or why no allowlist can).
"""

from __future__ import annotations

import pickletools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torchverity.pickles._classes import (
    _BENIGN,
    _NP_CORE,
    _NUMPY_DTYPE_CLASS,
    _TORCH_BLOCKED_MODULES,
    _WEIGHTS_ONLY_OPCODES,
    BENIGN,
    DANGEROUS,
    UNKNOWN,
    classify,
    in_torch_allowlist,
)
from torchverity.pickles._containers import Container
from torchverity.pickles._ops import Build, GlobalRef, StreamReport, const_str, first_arg, ref_of
from torchverity.pickles._torch_names import MODELED
from torchverity.pickles._verdict import GlobalFinding


@dataclass(frozen=True)
class LoadPlan:
    """What ``torch.load(weights_only=True)`` will ask for, and the code that makes it load."""

    entry: str | None
    loadable: bool
    needs: tuple[str, ...]
    code: str
    notes: tuple[str, ...] = ()
    # Why no torch.load reads the file, weights_only or not ("" when a full load would).
    torch_cannot_read: str = ""


def _torch_name(ref: GlobalRef) -> tuple[str, str]:
    """The name torch's weights_only unpickler looks up (it remaps Python 2 names)."""
    key = (ref.module, ref.name)
    if ref.qualname in MODELED:  # none is a Python 2 name: known without importing torch
        return key
    from torch._utils import IMPORT_MAPPING, NAME_MAPPING

    if key in NAME_MAPPING:
        return NAME_MAPPING[key]
    return IMPORT_MAPPING.get(ref.module, ref.module), ref.name


# Rebuild functions whose result (the object BUILD then fills) is an instance of the
# class given as their first argument, or of a fixed class.
_RETURNS_FIRST_ARG = frozenset({
    *(f"{c}.multiarray._reconstruct" for c in _NP_CORE),
    "copyreg._reconstructor",
    "numpy.random._pickle.__bit_generator_ctor",
})
_RETURNS = {
    "numpy.random._pickle.__generator_ctor": "numpy.random._generator.Generator",
    "numpy.random._pickle.__randomstate_ctor": "numpy.random.mtrand.RandomState",
}
_NUMPY_DTYPE_ARG = re.compile(r"^[<>|=]?[?bBhHiIlLqQpPefdgFDGSUVOMmbiufc]\d{0,4}(?:\[\w+\])?$")


def _build_type(build: Build) -> str | None:
    """The type torch checks at BUILD when it differs from the global that made the object."""
    inst = build.inst
    callee = ref_of(inst.callee)
    if callee is None or inst.via != "REDUCE":
        return None
    qual = ".".join(_torch_name(callee))
    first = first_arg(inst)
    if qual in _RETURNS_FIRST_ARG or qual.rpartition(".")[2].startswith("__pyx_unpickle_"):
        ref = ref_of(first)
        return ".".join(_torch_name(ref)) if ref is not None else None
    if qual in _RETURNS:
        return _RETURNS[qual]
    if qual != "numpy.dtype":
        return None
    code = const_str(first)
    if code is None or not _NUMPY_DTYPE_ARG.match(code):
        return "numpy.dtype(?)"
    import numpy

    cls = type(numpy.dtype(code))  # a short dtype code string: parsed, nothing imported
    return f"{cls.__module__}.{cls.__qualname__}"


def _resolve_trusted(name: str) -> Any:
    """Import a *known benign* library name (never a name chosen by the file alone)."""
    import importlib

    module, _, attr = name.rpartition(".")
    for cut in range(len(module.split(".")), 0, -1):
        base = ".".join(module.split(".")[:cut])
        try:
            obj: Any = importlib.import_module(base)
        except ImportError:
            continue
        for part in [*module.split(".")[cut:], attr]:
            obj = getattr(obj, part, None)
        if obj is not None:
            return obj
    return None


def _import_of(name: str, category: str) -> tuple[str, str, bool]:
    """(module, attribute) to import for one safe_globals entry, and whether the entry must
    give the name in the file: torch keys an object by its ``__module__``/``__qualname__``,
    which differ for a re-exported class and which a constant (``builtins.Ellipsis``) lacks."""
    module, _, attr = name.rpartition(".")
    if category == BENIGN or _NUMPY_DTYPE_CLASS.match(name):
        obj = _resolve_trusted(name)
        qualname, home = getattr(obj, "__qualname__", None), getattr(obj, "__module__", None)
        if isinstance(qualname, str) and isinstance(home, str) and "." not in qualname:
            return home, qualname, f"{home}.{qualname}" != name
        return module, attr, obj is not None
    return module, attr, False


def _render_code(needs: Sequence[str], categories: dict[str, str], path: str) -> str:
    """The imports and ``safe_globals`` block that make the file load."""
    imports: dict[str, list[str]] = {}
    exprs: list[str] = []
    used: set[str] = set()
    for name in needs:
        category = categories.get(name, UNKNOWN)
        module, attr, spelled = _import_of(name, category)
        alias = attr if attr not in used else f"{module.replace('.', '_')}_{attr}"
        used.add(alias)
        if module != "builtins":
            imports.setdefault(module, []).append(attr if alias == attr else f"{attr} as {alias}")
        expr = f'({alias}, "{name}")' if spelled else alias
        if module == "__main__":
            expr = f"{alias},  # defined in the script that saved the file"
        elif category in (UNKNOWN, DANGEROUS):
            expr = f"{expr},  # {category}: only if you trust its code"
        else:
            expr += ","
        exprs.append(expr)
    lines = ["import torch"]
    lines += [f"from {m} import {', '.join(a)}" for m, a in imports.items() if m != "__main__"]
    body = "".join(f"    {e}\n" for e in exprs)
    return (
        "\n".join(lines)
        + f"\n\nwith torch.serialization.safe_globals([\n{body}]):\n"
        + f"    obj = torch.load({path!r}, weights_only=True)\n"
    )


# SETITEM(S) targets torch's weights_only unpickler accepts besides a plain dict.
_SETITEM_TYPES = frozenset({"collections.OrderedDict", "collections.Counter"})


def _target_notes(report: StreamReport) -> list[str]:
    notes: list[str] = []
    for offset, opcode, target in report.odd_targets:
        callee = ref_of(target.callee)
        made = ".".join(_torch_name(callee)) if callee is not None else target.kind
        if opcode.startswith("SETITEM") and made in _SETITEM_TYPES:
            continue
        notes.append(f"{opcode} at offset {offset} fills a {made}; torch's weights_only "
                     "unpickler fills only plain lists and dicts (and OrderedDict/Counter)")
        if len(notes) >= 3:
            break
    return notes


def _plan_notes(report: StreamReport) -> list[str]:
    notes = _target_notes(report)
    notes.extend(
        f"persistent id {kind!r} at offset {off}: torch's weights_only loader accepts only "
        "storages (legacy files that pickle whole modules record their source this way)"
        for kind, off in report.persistent_ids.items() if kind != "storage"
    )
    blocked = [g for g in report.globals if _torch_name(g)[0] in _TORCH_BLOCKED_MODULES]
    notes.extend(f"{g.qualname} is in a module torch blocks even when allowlisted" for g in blocked)
    return notes


_OPCODE_PROTOCOL = {op.name: op.proto for op in pickletools.opcodes}
# Why torch's weights_only unpickler lacks an opcode, by the protocol that introduced it.
_OPCODE_CAUSES = (
    (range(0, 2), "pickle protocol 0/1 opcodes", "torch's weights_only unpickler reads "
     "protocol 2 only"),
    (range(2, 4), "pickle protocol 2/3 opcodes", "not among the protocol 2 opcodes torch's "
     "weights_only unpickler implements"),
    (range(4, 256), "pickle protocol 4+ opcodes", "torch's weights_only unpickler reads "
     "protocol 2 only"),
)
# PERSID: at protocol 0 the pickler writes torch's persistent id tuple as its repr.
TEXT_IDS = ("its persistent ids (torch's references to storages) are pickled as text "
            "(pickle protocol 0), which no torch.load reads, whatever weights_only says")


def _first_offsets(reports: Sequence[StreamReport]) -> dict[str, int]:
    """Each opcode torch's weights_only unpickler lacks -> where it first appears."""
    first: dict[str, int] = {}
    for report in reports:
        for op, off in report.opcodes.items():
            if op not in _WEIGHTS_ONLY_OPCODES:
                first[op] = min(off, first.get(op, off))
    return first


def _opcode_notes(reports: Sequence[StreamReport]) -> list[str]:
    """One note per cause (not per opcode) of the opcodes torch's weights_only unpickler lacks."""
    first = _first_offsets(reports)
    notes = []
    if "PERSID" in first:
        notes.append(f"PERSID at offset {first.pop('PERSID')}: {TEXT_IDS}")
    for protocols, what, why in _OPCODE_CAUSES:
        ops = sorted((op for op in first if _OPCODE_PROTOCOL[op] in protocols),
                     key=lambda op: first[op])
        if ops:
            notes.append(f"{what} {', '.join(ops)} (the first at offset {first[ops[0]]}): {why}")
    return notes


def plan_load(path: str, container: Container,
              findings: Sequence[GlobalFinding]) -> LoadPlan | None:
    """Predict every global ``torch.load(weights_only=True)`` asks for, in one pass (each
    commented with its class in ``findings``: a global can be judged by how it is called)."""
    if container.format == "torch-tar":
        return LoadPlan(container.torch_entry, False, (), "", (
            "torch.load(weights_only=True) refuses the pre-1.0 tar format whatever you "
            "allowlist",))
    if container.format not in ("torch-zip", "torch-legacy"):
        return None
    entry = next((e for e in container.entries if e.name == container.torch_entry), None)
    if entry is None:
        return LoadPlan(container.torch_entry, False, (), "", ("torch finds no pickle to load",))
    found = {(f.entry, f.stream, f.offset): f.category for f in findings}
    categories: dict[str, str] = {}
    needs: list[str] = []
    notes = _opcode_notes(entry.streams)
    for report in entry.streams:
        notes.extend(_plan_notes(report))
    loadable = not notes
    for index, report in enumerate(entry.streams):
        for ref in report.globals:
            name = ".".join(_torch_name(ref))
            if not in_torch_allowlist(name):
                needs.append(name)
                category = found.get((entry.name, index, ref.offset))
                categories.setdefault(name, category or classify(ref, report.protocol)[0])
        for build in report.builds:
            built = _build_type(build)
            if built == "numpy.dtype(?)":
                notes.append(f"BUILD at offset {build.offset}: numpy dtype class not known")
            elif built is not None and not in_torch_allowlist(built):
                needs.append(built)
    needs = list(dict.fromkeys(needs))
    for name in needs:
        known = _NUMPY_DTYPE_CLASS.match(name) or name in _BENIGN
        categories.setdefault(name, BENIGN if known else UNKNOWN)
    code = _render_code(needs, categories, path) if needs and loadable else ""
    unreadable = TEXT_IDS if any("PERSID" in r.opcodes for r in entry.streams) else ""
    return LoadPlan(container.torch_entry, loadable, tuple(needs), code, tuple(notes),
                    unreadable)


