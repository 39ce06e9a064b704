"""The package's shape: no import cycles, a bottom layer that imports nothing above it,
every package's ``__all__`` resolvable, and every dotted path the docs name importable."""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "torchverity"
BOTTOM = frozenset({
    "torchverity.errors", "torchverity._formats", "torchverity._tensors",
    "torchverity._jsonable", "torchverity._callables", "torchverity._lazy",
    "torchverity._leaves",
})
PACKAGES = ("torchverity", "torchverity.checkpoint", "torchverity.pickles",
            "torchverity.training", "torchverity.distributed", "torchverity.golden",
            "torchverity.serve", "torchverity.batch", "torchverity.integrations",
            "torchverity.protection",
            "torchverity.integrations.lightning", "torchverity.integrations.hf")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """Every torchverity module a module imports at run time, function-local ones included
    (``if TYPE_CHECKING:`` blocks never run)."""
    for node in ast.iter_child_nodes(tree):
        if _is_type_checking(node):
            continue
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("torchverity"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            if base.startswith("torchverity"):
                yield base
                yield from (f"{base}.{a.name}" for a in node.names)
        yield from _imports(node, module, is_package)


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges: set[str] = set()
        for target in _imports(ast.parse(path.read_text()), name, path.name == "__init__.py"):
            if target not in files:
                continue
            # Importing a.b.c runs a and a.b first, except the packages the importer is in.
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                step = ".".join(parts[:i])
                if step in files and step != name and not name.startswith(step + "."):
                    edges.add(step)
        graph[name] = edges
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycles_including_function_local_imports() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_bottom_layer_imports_nothing_above_it() -> None:
    graph = _graph()
    for module in BOTTOM:
        above = {m for m in graph[module] if m not in BOTTOM and m != "torchverity"}
        assert not above, f"{module} imports {sorted(above)}"


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any((isinstance(d, ast.Call) and getattr(d.func, "id", "") == "dataclass")
               or getattr(d, "id", "") == "dataclass" for d in node.decorator_list)


def test_every_dataclass_has_a_docstring() -> None:
    # Without one, @dataclass builds __doc__ from inspect.signature at import time: about
    # 1 ms for the first such class in a process, on every command's start-up path.
    bare = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
            for path in SRC.rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and _is_dataclass(node)
            and ast.get_docstring(node) is None]
    assert not bare, bare


@pytest.mark.parametrize("package", PACKAGES)
def test_every_name_in_all_resolves(package: str) -> None:
    module = importlib.import_module(package)
    names = module.__all__
    assert len(set(names)) == len(names)
    for name in names:
        assert getattr(module, name) is not None, f"{package}.{name}"


def test_no_module_is_named_like_a_public_function() -> None:
    import torchverity

    functions = {n for n in torchverity.__all__ if n[:1].islower() and n != "__version__"}
    modules = {p.stem for p in SRC.glob("*.py")} | {p.name for p in SRC.iterdir() if p.is_dir()}
    clash = {n for n in functions & modules if callable(getattr(torchverity, n))
             and not isinstance(getattr(torchverity, n), type(torchverity))}
    assert not clash


_DOTTED = re.compile(r"\btorchverity(?:\.[A-Za-z_]\w*)+")


def _doc_paths() -> set[str]:
    paths: set[str] = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text()
        for block in re.findall(r"```(?:python|py|bash|sh|console)?\n(.*?)```", text, re.S):
            paths |= set(_DOTTED.findall(block))
        paths |= set(_DOTTED.findall(" ".join(re.findall(r"`([^`\n]+)`", text))))
    return {p for p in paths if not p.endswith((".json", ".jsonl", ".md", ".py"))}


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    obj: object = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[:i + 1]))
    return obj


def test_every_dotted_path_the_docs_name_resolves() -> None:
    paths = _doc_paths()
    assert len(paths) > 20
    broken = []
    for dotted in sorted(paths):
        try:
            _resolve(dotted)
        except (ImportError, AttributeError) as exc:
            broken.append(f"{dotted}: {exc}")
    assert not broken, "\n".join(broken)
