"""Which globals a pickle may name, by allowlist: torch's, known data classes, the rest.

Classes: ``torch`` (this torch's weights_only allowlist), ``benign`` (data classes
of widely used libraries, with their own reason), ``dangerous`` (runs commands,
touches files or the network, imports, evaluates: named with why), ``unknown``
(anything else: a class or function whose code would run, to be reviewed).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from functools import lru_cache
from typing import Final, Literal

from torchverity.pickles._imports import import_effect, lookup, python_name
from torchverity.pickles._ops import GlobalRef, Item, Value, ref_of
from torchverity.pickles._torch_names import MODELED

# A file's verdict (torchverity.pickles._verdict says which, worst first).
Verdict = Literal["safe", "needs-allowlist", "needs-review", "unsafe", "malformed"]
SAFE: Final = "safe"
NEEDS_ALLOWLIST: Final = "needs-allowlist"
NEEDS_REVIEW: Final = "needs-review"
UNSAFE: Final = "unsafe"
MALFORMED: Final = "malformed"
# A global's class (this module's docstring says which).
Category = Literal["torch", "benign", "dangerous", "unknown"]
TORCH: Final = "torch"
BENIGN: Final = "benign"
DANGEROUS: Final = "dangerous"
UNKNOWN: Final = "unknown"
NESTED_LOADER = "torch.storage._load_from_bytes"

# Opcodes torch's weights_only unpickler implements (protocol 2 and below).
_WEIGHTS_ONLY_OPCODES = frozenset((
    "GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "MARK",
    "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWFALSE", "NEWTRUE", "EMPTY_TUPLE",
    "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "BININT", "BININT1", "BININT2", "BINFLOAT",
    "BINUNICODE", "SHORT_BINSTRING", "BINPERSID", "BINGET", "LONG_BINGET", "BINPUT",
    "LONG_BINPUT", "LONG1", "PROTO", "STOP",
))
_TORCH_BLOCKED_MODULES = frozenset({"sys", "os", "posix", "nt"})

_NP_CORE = ("numpy.core", "numpy._core")
_BENIGN: dict[str, str] = {
    **{f"{c}.multiarray._reconstruct": "numpy array reconstruction (data only)" for c in _NP_CORE},
    **{f"{c}.multiarray.scalar": "numpy scalar from raw bytes" for c in _NP_CORE},
    **{f"{c}.numeric._frombuffer": "numpy array from a buffer" for c in _NP_CORE},
    "numpy.ndarray": "numpy array type",
    "numpy.random._pickle.__generator_ctor": "numpy random generator state",
    "numpy.random._pickle.__randomstate_ctor": "numpy random generator state",
    "numpy.random._pickle.__bit_generator_ctor": "numpy random generator state",
    "numpy.random._generator.Generator": "numpy random generator state",
    "numpy.random.mtrand.RandomState": "numpy random generator state",
    "numpy.random._pcg64.PCG64": "numpy bit generator state",
    "numpy.random._pcg64.PCG64DXSM": "numpy bit generator state",
    "numpy.random._mt19937.MT19937": "numpy bit generator state",
    "numpy.random._philox.Philox": "numpy bit generator state",
    "numpy.random._sfc64.SFC64": "numpy bit generator state",
    "numpy.random.bit_generator.SeedSequence": "numpy seed sequence",
    "numpy.random.bit_generator.__pyx_unpickle_SeedSequence": "numpy seed sequence state",
    "numpy.dtype": "numpy dtype",
    "argparse.Namespace": "plain attribute container (argparse)",
    "types.SimpleNamespace": "plain attribute container",
    "collections.defaultdict": "dict with a default factory (the factory is checked too)",
    "collections.deque": "collection",
    "collections.Counter": "collection",
    "collections.OrderedDict": "collection",
    "copyreg._reconstructor": "protocol 0/1 object rebuild (its class and base are checked too)",
    "datetime.datetime": "timestamp",
    "datetime.date": "date",
    "datetime.time": "time of day",
    "datetime.timedelta": "duration",
    "datetime.timezone": "time zone",
    "decimal.Decimal": "number",
    "fractions.Fraction": "number",
    "uuid.UUID": "identifier",
    # Struct sequences: called with (tuple, dict) they only build the record (os.stat()'s
    # result kept in a checkpoint); nothing is read. The rest of os stays dangerous.
    "os.stat_result": "file status record (numbers only; no file is read on load)",
    "os.terminal_size": "terminal size record (numbers only)",
    "os.times_result": "process times record (numbers only)",
    "os.uname_result": "system name record (strings only)",
    "time.struct_time": "time record (numbers only)",
    "pathlib.PosixPath": "path value (no file access on load)",
    "pathlib.PurePosixPath": "path value",
    "pathlib.WindowsPath": "path value (no file access on load)",
    "pathlib.PureWindowsPath": "path value",
    "torch.serialization._get_layout": "tensor layout lookup",
    **{
        f"builtins.{n}": "builtin data type"
        for n in ("int", "float", "complex", "bool", "str", "bytes", "bytearray", "tuple",
                  "list", "dict", "set", "frozenset", "slice", "range", "object")
    },
}
_OMEGACONF = "omegaconf container or node (configuration data; nothing is evaluated on load)"
_TYPING = ("Any", "Union", "Optional", "List", "Dict", "Tuple", "Set", "FrozenSet", "Sequence",
           "Mapping", "Callable", "Type", "Literal", "Annotated", "ClassVar", "Final",
           "Iterable", "Iterator", "Generator", "Collection", "Container", "Hashable",
           "AbstractSet", "MutableMapping", "MutableSequence", "DefaultDict", "OrderedDict",
           "Deque", "Counter", "NoReturn")
_TYPING_REASON = "typing annotation object (a type hint, data only)"
_BENIGN_EXTRA: dict[str, str] = {
    **{f"omegaconf.{n}": _OMEGACONF for n in (
        "dictconfig.DictConfig", "listconfig.ListConfig", "base.ContainerMetadata",
        "base.Metadata", "nodes.AnyNode", "nodes.StringNode", "nodes.IntegerNode",
        "nodes.FloatNode", "nodes.BooleanNode", "nodes.EnumNode", "nodes.BytesNode",
        "nodes.PathNode", "nodes.InterpolationResultNode")},
    **dict.fromkeys((f"typing.{n}" for n in _TYPING), _TYPING_REASON),
    "types.GenericAlias": "typing annotation object (list[int]: a generic alias, data only)",
    "builtins.Ellipsis": "builtin constant (typing.Tuple[int, ...])",
    "builtins.NotImplemented": "builtin constant",
    **{f"enum.{n}": "standard enum base class" for n in (
        "Enum", "IntEnum", "Flag", "IntFlag", "StrEnum")},
    # An enum class is called with a value to rebuild a member (more arguments would
    # extend it, which an enum with members refuses); the rest of these modules stays
    # dangerous (http.client, socket.socket, signal.signal).
    **dict.fromkeys((
        "http.HTTPStatus", "http.HTTPMethod", "re.RegexFlag", "uuid.SafeUUID",
        "inspect._ParameterKind", "signal.Signals", "signal.Handlers", "socket.AddressFamily",
        "socket.SocketKind", "ssl.TLSVersion", "ssl.VerifyMode", "ssl.Options",
        "plistlib.PlistFormat", "pstats.SortKey", "enum.FlagBoundary"),
        "standard library enum (a member is its class called with its value)"),
    **{f"pathlib.{n}": "path value (no file access on load)" for n in ("Path", "PurePath")},
    **{f"pathlib._local.{n}": "path value (no file access on load)" for n in (
        "Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")},
    "datetime.tzinfo": "time zone",
    "argparse.Action": "argparse parser data",
    # What TorchScript's own pickles call to tag lists; each returns its argument.
    **{f"torch.jit._pickle.{n}": "TorchScript list/type tag (returns its argument)" for n in (
        "build_intlist", "build_tensorlist", "build_doublelist", "build_boollist",
        "build_complexlist", "restore_type_tag")},
    # The dataclasses a distributed checkpoint's .metadata pickles (torch's FileSystemWriter
    # pickle.dumps them): fields only, and TensorProperties.__setstate__ just maps its
    # enum back to a memory format. Named one by one: the rest of torch.distributed
    # stays dangerous (it starts processes and opens network endpoints).
    **dict.fromkeys((f"torch.distributed.checkpoint.{n}" for n in (
        "metadata.Metadata", "metadata.StorageMeta", "metadata.MetadataIndex",
        "metadata.TensorStorageMetadata", "metadata.BytesStorageMetadata",
        "metadata.TensorProperties", "metadata.ChunkStorageMetadata",
        "metadata._MEM_FORMAT_ENCODING", "filesystem._StorageInfo")),
        "distributed checkpoint metadata (dataclass or enum of plain fields: data only)"),
}
_BENIGN.update(_BENIGN_EXTRA)
# numpy.dtypes.<X>DType classes are what BUILD mutates after numpy.dtype(...).
_NUMPY_DTYPE_CLASS = re.compile(r"^numpy\.dtypes\.\w+DType$")

# Modules whose functions run code, load pickles, or touch files, processes or
# the network. Used to say *why* a global is refused; unknown globals are
# refused anyway.
_DANGER_MODULES: dict[str, str] = {
    "os": "runs commands / touches the file system",
    "posix": "runs commands / touches the file system",
    "nt": "runs commands / touches the file system",
    "sys": "interpreter internals",
    "subprocess": "runs commands",
    "_posixsubprocess": "runs commands: fork_exec starts processes",
    "_winapi": "runs commands: CreateProcess starts processes",
    # uuid.UUID and uuid.SafeUUID are benign (above); its node helpers run ifconfig, arp...
    "uuid": "runs commands: _get_command_stdout and the node lookups run ifconfig, arp...",
    "pty": "spawns processes",
    "shutil": "touches the file system",
    "socket": "network access",
    "ssl": "network access",
    "http": "network access",
    "urllib": "network access",
    "requests": "network access",
    "webbrowser": "opens programs",
    "ctypes": "calls native code",
    "cffi": "calls native code",
    "multiprocessing": "spawns processes (e.g. util.spawnv_passfds)",
    "concurrent": "runs callables",
    "threading": "runs callables",
    "asyncio": "runs callables and subprocesses",
    "signal": "process control",
    "importlib": "imports arbitrary modules",
    "pkgutil": "resolves arbitrary names (pkgutil.resolve_name)",
    "runpy": "runs modules",
    "code": "evaluates code",
    "codeop": "compiles code",
    "timeit": "evaluates code",
    "profile": "evaluates code",
    "cProfile": "evaluates code",
    "pdb": "evaluates code",
    "bdb": "evaluates code",
    "trace": "runs code",
    "pickle": "nested unpickling",
    "torch.load": "nested checkpoint loading (torch.load unpickles what it reads)",
    "torch._weights_only_unpickler": "nested unpickling",
    "torch.utils.model_zoo": "downloads and loads checkpoints",
    "torch.from_file": "reads files",
    "torch.save": "writes files",
    **dict.fromkeys((f"numpy.{n}" for n in (
        "loadtxt", "genfromtxt", "fromfile", "fromregex", "memmap", "save", "savez",
        "savez_compressed", "savetxt")), "reads or writes files"),
    **dict.fromkeys((f"{p}.utilities.cloud_io" for p in ("lightning.fabric", "lightning_fabric")),
                    "nested checkpoint loading (torch.load)"),
    "pandas.read_pickle": "nested unpickling",
    "pandas.io": "reads files (pandas.io.pickle unpickles them)",
    "yaml": "parses YAML (yaml.load and unsafe_load construct Python objects)",
    "jsonpickle": "decodes JSON into Python objects (runs their constructors)",
    "_pickle": "nested unpickling",
    "cPickle": "nested unpickling",
    "marshal": "loads code objects",
    "shelve": "nested unpickling",
    "dill": "nested unpickling",
    "cloudpickle": "nested unpickling",
    "types": "builds functions and code objects",
    "functools": "calls arbitrary callables (partial, reduce)",
    "_functools": "calls arbitrary callables (partial, reduce)",
    "operator": "attribute access and calls (attrgetter, methodcaller)",
    "_operator": "attribute access and calls (attrgetter, methodcaller)",
    "pip": "installs and runs packages (pip.main)",
    "setuptools": "runs build code",
    "distutils": "runs build code",
    "site": "interpreter setup",
    "venv": "creates environments",
    "ensurepip": "runs pip",
    "tempfile": "touches the file system",
    "io": "opens files",
    "zipfile": "opens files",
    "tarfile": "opens files",
    "glob": "reads the file system",
    "inspect": "interpreter internals",
    "gc": "interpreter internals",
    "__builtin__": "builtin functions",
    "builtins": "builtin functions (eval, exec, getattr, __import__, open)",
    "builtins.type": "creates classes (type(name, bases, dict) runs the code of their "
                     "metaclass and __init_subclass__)",
    "torch.hub": "downloads and runs code",
    "torch.jit": "compiles and runs code",
    "torch._dynamo": "compiles and runs code",
    "torch._inductor": "compiles and runs code",
    "torch.utils.cpp_extension": "compiles and loads native code",
    "torch.package": "imports packaged code",
    "torch.fx": "generates and runs code",
    "torch.distributed": "starts processes and network endpoints",
    "torch.serialization": "nested checkpoint loading",
    "torch._C": "native internals",
    "torch.ops": "native operators",
    "torch.testing": "runs code",
    "numpy.load": "nested unpickling",
    "numpy.lib": "file loading (npyio)",
    "numpy.testing": "runs code",
    "numpy.f2py": "compiles code",
    "numpy.distutils": "runs build code",
    "joblib": "nested unpickling",
}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*$")
_TORCH_CLASS_MODULES = ("torch.nn.modules.", "torch.optim.")
_JOBLIB_BENIGN = {
    "joblib.numpy_pickle.NumpyArrayWrapper": "joblib array wrapper (raw array bytes)",
}


# ------------------------------------------------------------ classification


@lru_cache(maxsize=1)
def torch_allowlist() -> frozenset[str]:
    """Names in this torch's weights_only allowlist (what a plain torch.load accepts)."""
    from torch import _weights_only_unpickler as wo

    return frozenset(wo._get_allowed_globals())


def in_torch_allowlist(qualname: str) -> bool:
    """Whether torch's weights_only loader accepts this global; the names a plain state
    dict pickles are known without importing torch (start-up costs more than the scan)."""
    return qualname in MODELED or qualname in torch_allowlist()


def _torch_class_ok(module: str, name: str) -> bool:
    """A torch module/optimizer/scheduler class, looked up only among already-imported modules."""
    if not module.startswith(_TORCH_CLASS_MODULES):
        return False
    mod = sys.modules.get(module)
    obj = getattr(mod, name, None) if mod is not None else None
    if not isinstance(obj, type) or obj.__module__ != module:
        return False
    import torch

    bases = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)
    return issubclass(obj, bases)


def _danger_reason(module: str, name: str) -> str | None:
    if f"{module}.{name}" in _DANGER_MODULES:
        return _DANGER_MODULES[f"{module}.{name}"]
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in _DANGER_MODULES:
            return _DANGER_MODULES[prefix]
    return None


def classify(ref: GlobalRef, protocol: int = 0) -> tuple[Category, str]:
    """The (category, reason) of one global. Fail-closed: unrecognised means unknown."""
    module, name = python_name(ref, protocol)
    if ref.dynamic:
        return DANGEROUS, f"name computed at load time by {ref.opcode}: it can resolve anything"
    effect = import_effect(lookup(ref, protocol).modules)
    if effect is not None:
        return DANGEROUS, f"importing {effect[0]} {effect[1]}"
    if not _MODULE.match(module) or not _NAME.match(name):
        if "." in name and _NAME.match(name.replace(".", "_")):
            return DANGEROUS, "dotted attribute path: reaches nested attributes of the module"
        return DANGEROUS, "not a valid module/attribute name"
    qual = f"{module}.{name}"
    if in_torch_allowlist(qual):
        return TORCH, "in torch's weights_only allowlist"
    if qual in _BENIGN:
        return BENIGN, _BENIGN[qual]
    if qual in _JOBLIB_BENIGN:
        return BENIGN, _JOBLIB_BENIGN[qual]
    if qual == NESTED_LOADER:
        return DANGEROUS, "runs torch.load(weights_only=False) on its bytes"
    if module.startswith("__torch__."):
        return UNKNOWN, "TorchScript class: torch.jit.load compiles and runs the archive's code"
    danger = _danger_reason(module, name)
    if danger is not None:
        return DANGEROUS, danger
    if _torch_class_ok(module, name):
        return BENIGN, "torch module/optimizer class (its state is data)"
    return UNKNOWN, "not known to be benign: custom class or function whose code runs on load"


# ------------------------------------------------------------------ data calls


def _one_argument(made: Value, protocol: int) -> bool:
    args = made.args
    return (made.via == "REDUCE" and type(args) is Value and args.kind == "tuple"
            and len(args.items) == 1 and not args.truncated)


# What _operator.getitem may subscript to build a type hint (typing.List[int], dict[str, int]).
_GENERICS = frozenset({
    *(f"typing.{n}" for n in _TYPING),
    *(f"builtins.{n}" for n in ("list", "dict", "tuple", "set", "frozenset")),
    *(f"collections.{n}" for n in ("OrderedDict", "defaultdict", "deque", "Counter")),
})


def _subscripts_a_generic(made: Value, protocol: int) -> bool:
    args = made.args
    if (made.via != "REDUCE" or type(args) is not Value or args.kind != "tuple"
            or len(args.items) != 2):
        return False
    ref = ref_of(args.items[0])
    return ref is not None and not ref.dynamic and ".".join(python_name(ref, protocol)) in _GENERICS


_GETITEM = (_subscripts_a_generic, "subscripts a type hint (typing.List[int]): typing data")
# Globals whose calls build data only with these arguments (any other use, type() with
# three arguments to create a class say, leaves them to their module's class).
_DATA_CALLS = {
    "builtins.type": (_one_argument, "type of a value (type() with one argument returns its "
                                     "class, data only)"),
    "_operator.getitem": _GETITEM,
    "operator.getitem": _GETITEM,
}


# int | None pickles as functools.reduce(operator.or_, (int, type(None))) (protocols 0-2
# spell reduce __builtin__.reduce); operator.or_ called on two types builds the same union.
_UNION_REDUCE = frozenset({"functools.reduce", "_functools.reduce"})
_UNION_OR = frozenset({"operator.or_", "_operator.or_"})
# What a hint subscript or generic alias may hold besides hints (Literal["a"], Annotated).
_CONSTANTS = (str, int, float, bool, bytes, type(None))
# Hints nested deeper than this inside a union are not judged (the union stays dangerous).
_HINT_DEPTH = 16


def _called(made: Value, protocol: int, size: int) -> tuple[str, list[Item]] | None:
    """(python name of the callee, arguments) of a REDUCE of a named global with ``size``
    arguments kept in full; None for any other value."""
    args, callee = made.args, ref_of(made.callee)
    if (made.kind != "made" or made.via != "REDUCE" or callee is None or callee.dynamic
            or type(args) is not Value or args.kind != "tuple" or args.truncated
            or len(args.items) != size):
        return None
    return ".".join(python_name(callee, protocol)), args.items


def _hint_argument(item: Item, protocol: int, depth: int) -> str | None:
    """A subscript of a hint as it reads: hints, constants, and tuples or lists of them."""
    if type(item) is not Value:
        return repr(item) if isinstance(item, _CONSTANTS) else None
    if item.kind in ("tuple", "list") and not item.truncated:
        parts = [_hint_argument(i, protocol, depth + 1) for i in item.items]
        if None in parts or depth > _HINT_DEPTH:
            return None
        joined = ", ".join(p for p in parts if p is not None)
        return joined if item.kind == "tuple" else f"[{joined}]"
    return _hint(item, protocol, depth)


def _hint(item: Item, protocol: int, depth: int = 0) -> str | None:
    """How a type a union may hold reads (int, None, typing.List[int], list[int], a union):
    None for anything else, a global that is neither benign nor torch's included."""
    if item is None:
        return "None"
    if type(item) is not Value or depth > _HINT_DEPTH:
        return None
    if item.kind == "global":
        ref = item.ref
        if ref is None or ref.dynamic or classify(ref, protocol)[0] not in (TORCH, BENIGN):
            return None
        module, name = python_name(ref, protocol)
        return name if module == "builtins" else f"{module}.{name}"
    one = _called(item, protocol, 1)
    if one is not None:  # type(None): the class of a constant
        called, (arg,) = one
        if called != "builtins.type" or type(arg) is Value or not isinstance(arg, _CONSTANTS):
            return None
        return "None" if arg is None else type(arg).__name__
    two = _called(item, protocol, 2)
    if two is None:
        return None
    called, (base, params) = two
    if called in ("_operator.getitem", "operator.getitem", "types.GenericAlias"):
        if called != "types.GenericAlias" and not _subscripts_a_generic(item, protocol):
            return None
        origin, inner = _hint(base, protocol, depth + 1), _hint_argument(params, protocol,
                                                                         depth + 1)
        return None if origin is None or inner is None else f"{origin}[{inner}]"
    return union_text(item, protocol, depth)


def union_text(made: Item, protocol: int, depth: int = 0) -> str | None:
    """``int | None`` for a call that builds a union of types (reduce(or_, types), or_ of
    two types); None for any other value or call, a union holding other globals included."""
    if type(made) is not Value:
        return None
    two = _called(made, protocol, 2)
    if two is None:
        return None
    called, items = two
    if called in _UNION_REDUCE:
        operator, operands = items
        op = ref_of(operator)
        if (op is None or op.dynamic or ".".join(python_name(op, protocol)) not in _UNION_OR
                or type(operands) is not Value or operands.kind != "tuple"
                or operands.truncated or not operands.items):
            return None
        items = operands.items
    elif called not in _UNION_OR:
        return None
    parts = [_hint(i, protocol, depth + 1) for i in items]
    return None if None in parts else " | ".join(p for p in parts if p is not None)


def data_call_reason(ref: GlobalRef, protocol: int, calls: list[Value], pushes: int,
                     handed: Sequence[Value] = ()) -> str | None:
    """Why a global is benign when every use of it is a call that builds data (``pushes``:
    the times it was pushed; a push that is not one of ``calls``, nor the first argument of
    one of the calls ``handed`` it, let it escape), else None."""
    name = ".".join(python_name(ref, protocol))
    if len(calls) + len(handed) != pushes:
        return None
    if name in _UNION_REDUCE or name in _UNION_OR:
        unions = [union_text(c, protocol) for c in (*calls, *handed)]
        if not unions or None in unions:
            return None
        role = "builds a union" if name in _UNION_REDUCE else "joins the members of a union"
        return f"{role} of types ({unions[0]}): typing data"
    rule = _DATA_CALLS.get(name)
    if rule is None or handed or not all(rule[0](c, protocol) for c in calls):
        return None
    return rule[1]
