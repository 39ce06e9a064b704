"""From what the walk found to a verdict: findings per global and per call, problems, why.

Verdicts, worst first: ``unsafe`` (a dangerous global or gadget shape),
``malformed`` (a reading that cannot be accounted for), ``needs-review`` (a
class whose code would run, e.g. the user's own classes or TorchScript code),
``needs-allowlist`` (only benign data classes outside torch's list), ``safe``.
Formats that hold no pickle get their own reason (text, ONNX) or are broken
downloads (Git LFS pointers, HTML pages: ``malformed``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torchverity.pickles._classes import (
    BENIGN,
    DANGEROUS,
    MALFORMED,
    NEEDS_ALLOWLIST,
    NEEDS_REVIEW,
    SAFE,
    UNKNOWN,
    UNSAFE,
    Category,
    Verdict,
    classify,
    data_call_reason,
)
from torchverity.pickles._containers import Container, Entry
from torchverity.pickles._imports import import_effect, lookup
from torchverity.pickles._ops import GlobalRef, StreamReport, Value, first_arg
from torchverity.pickles._text_pids import TEXT_PID_UNKNOWN


@dataclass(frozen=True)
class GlobalFinding:
    """One global a pickle resolves (or a call, or a shape), where it is, and its class."""

    name: str
    module: str
    attr: str
    entry: str
    stream: int
    offset: int
    opcode: str
    category: Category
    reason: str


_Class = tuple[Category, str]
_NESTED_OK: _Class = (
    BENIGN, "inline torch.save archive (pickle.dumps of a tensor); scanned in place")
_NESTED_ABSENT: _Class = (
    DANGEROUS, "runs torch.load(weights_only=False) on bytes that are not in the file")
_NESTED_SCRIPT: _Class = (
    DANGEROUS, "loads a nested TorchScript archive: torch.load hands it to torch.jit.load, "
    "which runs its scripted code")
_NESTED_ESCAPED: _Class = (
    DANGEROUS, "the nested loader is passed on instead of called on bytes of the file: it may "
    "load anything")


def _nested_classes(container: Container) -> dict[int, _Class]:
    """The class of each nested-loader global: benign only when every call it makes loads
    bytes of the file that were scanned, and it reaches nothing else."""
    out: dict[int, _Class] = {}
    for nested in container.nested:
        if nested.container is None:
            found = _NESTED_ABSENT
        elif nested.container.format == "torchscript":
            found = _NESTED_SCRIPT
        else:
            found = _NESTED_OK
        if out.get(id(nested.ref), _NESTED_OK) is _NESTED_OK:
            out[id(nested.ref)] = found
    for _, ref, _ in container.escaped:
        out[id(ref)] = _NESTED_ESCAPED
    return out


def _data_call_classes(container: Container) -> dict[int, _Class]:
    """Benign for a global that builds data in every use (type(None), typing.List[int],
    int | None: the or_ a union's reduce is handed as its first argument)."""
    out: dict[int, _Class] = {}
    for entry in container.entries:
        for report in entry.streams:
            calls: dict[int, list[Value]] = {}
            handed: dict[int, list[Value]] = {}
            for _, _, made in report.calls:
                calls.setdefault(id(made.callee), []).append(made)
                handed.setdefault(id(first_arg(made)), []).append(made)
            for key, (value, pushes) in report.watched.items():
                reason = data_call_reason(value.ref, report.protocol, calls.get(key, []), pushes,
                                          handed.get(key, []))
                if reason is not None:
                    out[id(value.ref)] = (BENIGN, reason)
    return out


def _call_findings(container: Container, prefix: str) -> list[GlobalFinding]:
    out: list[GlobalFinding] = []
    for n in container.nested:
        where = prefix + n.entry
        if n.container is None:
            out.append(GlobalFinding(n.ref.qualname, n.ref.module, n.ref.name, where, 0,
                                     n.offset, n.via, DANGEROUS,
                                     "nested torch.load call on bytes not literally in the file"))
        elif n.container.format == "torchscript":
            out.append(GlobalFinding(n.ref.qualname, n.ref.module, n.ref.name, where, 0,
                                     n.offset, n.via, DANGEROUS,
                                     "nested TorchScript archive: torch.load hands it to "
                                     "torch.jit.load, which runs its scripted code"))
    for entry, ref, uses in container.escaped:
        out.append(GlobalFinding(ref.qualname, ref.module, ref.name, prefix + entry, 0,
                                 ref.offset, ref.opcode, DANGEROUS,
                                 f"nested loader passed on {uses} time(s) instead of being "
                                 "called on bytes of the file (it may load anything)"))
    return out


def _entry_findings(entry: Entry, classes: dict[int, _Class], prefix: str,
                    torchscript: bool) -> list[GlobalFinding]:
    out: list[GlobalFinding] = []
    for index, report in enumerate(entry.streams):
        for ref in report.globals:
            if entry.alternate and (ref.dynamic or _fails_quietly(ref, report.protocol)):
                continue  # that reading fails there: nothing can be imported by that name
            category, reason = classes.get(id(ref)) or classify(ref, report.protocol)
            if torchscript and category == UNKNOWN and ref.module.startswith("__torch__."):
                reason = "TorchScript class: compiled from the archive's own code"
            out.append(GlobalFinding(
                ref.qualname, ref.module, ref.name, prefix + entry.name, index, ref.offset,
                ref.opcode, category, reason,
            ))
        cut = report.cut_global
        if cut is not None and import_effect(lookup(cut, report.protocol).modules):
            out.append(GlobalFinding(
                cut.qualname, cut.module, cut.name, prefix + entry.name, index, cut.offset,
                cut.opcode, DANGEROUS, f"{classify(cut, report.protocol)[1]}; pickle.py "
                "(joblib's unpickler) imports it though the stream ends inside its name",
            ))
    if not entry.alternate:
        out.extend(_gadget_findings(prefix + entry.name, entry.streams))
    return out


def _fails_quietly(ref: GlobalRef, protocol: int) -> bool:
    """find_class fails on this global having imported nothing known to act."""
    found = lookup(ref, protocol)
    return not found.found and import_effect(found.modules) is None


def findings_of(container: Container, prefix: str = "") -> list[GlobalFinding]:
    classes = {**_nested_classes(container), **_data_call_classes(container)}
    torchscript = container.format == "torchscript"
    out: list[GlobalFinding] = []
    for entry in container.entries:
        out.extend(_entry_findings(entry, classes, prefix, torchscript))
    out.extend(_call_findings(container, prefix))
    if torchscript:
        out.append(GlobalFinding(
            "(TorchScript code)", "", "", prefix + (container.torch_entry or "code/"), 0, 0,
            "code", UNKNOWN, f"{container.code_files} TorchScript source file(s) that "
            "torch.jit.load compiles and runs (scripted methods, __setstate__)",
        ))
    for nested in container.nested:
        if nested.container is not None:
            out.extend(findings_of(nested.container, f"{prefix}{nested.entry}@{nested.offset}>"))
    return out


def _gadget_findings(entry: str, streams: Sequence[StreamReport]) -> list[GlobalFinding]:
    """Shapes only attacks produce, reported like dangerous globals so the verdict is unsafe."""
    out: list[GlobalFinding] = []
    for index, report in enumerate(streams):
        for offset, via in report.computed_calls:
            out.append(GlobalFinding(
                "(object computed at load time)", "", "", entry, index, offset, via, DANGEROUS,
                "calls an object produced while loading (getattr/method-call gadget shape)",
            ))
        for offset, ref in report.global_builds:
            out.append(GlobalFinding(
                ref.qualname, ref.module, ref.name, entry, index, offset, "BUILD", DANGEROUS,
                "BUILD sets attributes on the class/function itself (attribute overwrite)",
            ))
    return out


def _stream_errors(container: Container, prefix: str = "") -> list[str]:
    errors = [
        f"{prefix}{e.name}: stream {i} at offset {r.error_offset}: {r.error}"
        for e in container.entries
        for i, r in enumerate(e.streams)
        if r.error is not None and (not e.alternate or r.error_limit)
    ]
    for nested in container.nested:
        if nested.container is not None:
            inner = f"{prefix}{nested.entry}@{nested.offset}>"
            errors += [f"{inner}{p}" for p in nested.container.problems]
            errors += _stream_errors(nested.container, inner)
    return errors


def problems_of(container: Container) -> list[str]:
    return list(dict.fromkeys([*container.problems, *_stream_errors(container),
                               *_text_pid_problems(container)]))


def _text_pid_problems(container: Container) -> list[str]:
    """A torch file's protocol-0 persistent id whose text torch never writes: no loader,
    the inert reader included, can say what it stands for."""
    if container.format not in ("torch-legacy", "torch-zip"):
        return []
    return [f"{e.name}: the persistent id at offset {offset} is {TEXT_PID_UNKNOWN} (at "
            "pickle protocol 0 an id is the repr of torch's storage tuple)"
            for e in container.entries if e.name == container.torch_entry
            for r in e.streams if (offset := r.persistent_ids.get(TEXT_PID_UNKNOWN)) is not None]


_BROKEN = {
    "git-lfs-pointer": "a Git LFS pointer file, not the weights (the download fetched the "
                       "pointer only): run 'git lfs pull' or download the file again",
    "html": "an HTML page (a download error or login page) saved under a weights name: "
            "download the file again",
    "empty": "empty file (0 bytes): the save or download that wrote it stopped before "
             "writing anything",
}
_NO_PICKLE = {
    "onnx": "ONNX model (protobuf): holds no pickle; torch.load cannot read it, "
            "onnxruntime or onnx.load can",
    "text": "text file: holds no pickle (every unpickler fails on it before it calls "
            "anything)",
    "hdf5": "HDF5 file (Keras/TensorFlow weights, h5py): holds no pickle (every unpickler "
            "fails on it before it calls anything)",
    "msgpack": "msgpack file (Flax weights): holds no pickle (every unpickler fails on it "
               "before it calls anything)",
    "sentencepiece": "sentencepiece tokenizer model (protobuf): holds no pickle (every "
                     "unpickler fails on it before it calls anything)",
    "onnx-data": "ONNX external data (raw tensor bytes an .onnx model beside it names): "
                 "holds no pickle (every unpickler fails on it before it calls anything)",
}


def verdict_of(container: Container, findings: Sequence[GlobalFinding],
               problems: Sequence[str]) -> tuple[Verdict, str]:
    dangerous = [f for f in findings if f.category == DANGEROUS]
    if dangerous:
        names = ", ".join(dict.fromkeys(f"{f.name} ({f.reason})" for f in dangerous[:5]))
        return UNSAFE, f"loading would resolve {names}"
    if container.format in _BROKEN:
        return MALFORMED, _BROKEN[container.format]
    if problems:
        return MALFORMED, problems[0]
    if container.format in _NO_PICKLE:
        return SAFE, _NO_PICKLE[container.format]
    unknown = [f for f in findings if f.category == UNKNOWN]
    if container.format == "torchscript":
        return NEEDS_REVIEW, (
            f"TorchScript archive (torch.jit.save): torch.jit.load runs its code "
            f"({container.code_files} source files, {len(unknown) - 1} scripted classes); "
            "torch.load(weights_only=True) refuses it")
    if unknown:
        names = ", ".join(dict.fromkeys(f.name for f in unknown[:5]))
        return NEEDS_REVIEW, (f"code of these classes or functions would run on load: "
                              f"{names} (review them)")
    benign = [f.name for f in findings if f.category == BENIGN]
    if benign:
        return NEEDS_ALLOWLIST, f"needs allowlisting: {', '.join(dict.fromkeys(benign))}"
    if not findings:
        return SAFE, "no globals: plain data only"
    return SAFE, "every global is in torch's weights_only allowlist"
