"""Explain known failures around saving and loading checkpoints.

A table of recognisers, each a regular expression over an error message and
the cause, the fix and the ``torchverity`` command that checks it. The same
table serves ``torchverity explain`` (a message or a whole log) and
``torchverity.load``, which appends the explanation to its own error.

>>> from torchverity.pickles import explain_text
>>> [e.key for e in explain_text("_pickle.UnpicklingError: Unsupported operand 149")]
['unsupported-opcode']
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Explanation:
    """What a failure message means. ``evidence`` is the text that matched."""

    key: str
    cause: str
    fix: str
    command: str
    evidence: str = ""


@dataclass(frozen=True)
class _Rule:
    key: str
    pattern: re.Pattern[str]
    cause: str
    fix: str
    command: str


def _rule(key: str, pattern: str, cause: str, fix: str, command: str) -> _Rule:
    return _Rule(key, re.compile(pattern, re.IGNORECASE), cause, fix, command)


# Order matters: the first rules are the most specific, and a message that
# matches several rules is explained by each (e.g. a WeightsUnpickler error
# about a numpy global and the generic weights_only note).
_RULES: tuple[_Rule, ...] = (
    _rule(
        "unsupported-global",
        r"Unsupported global: GLOBAL (?P<name>[\w.]+)|"
        r"Trying to load unsupported GLOBAL (?P<blocked>[\w.]+)|"
        r"Trying to call reduce for unrecognized function|"
        r"Can only (?:build|create new object for)[^\n]*?got <class '(?P<built>[\w.]+)'>",
        "torch.load(weights_only=True), the default since PyTorch 2.6, met a global outside its "
        "allowlist{detail}: the file pickles a custom class, a whole model or optimizer, "
        "numpy data or argparse.Namespace. torch names only one global per attempt.",
        "list every global the file needs in one pass and get the exact safe_globals code; "
        "allowlist only classes you trust, or convert the file to a plain state_dict. Never set "
        "weights_only=False or TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 for a file you did not make: "
        "it runs any code inside the file.",
        "torchverity scan {file}",
    ),
    _rule(
        "unsupported-opcode",
        r"Unsupported operand (?P<op>\d+)",
        "the file was pickled with protocol 4 or later (operand 149 is FRAME), e.g. by "
        "pickle.dump or torch.save(pickle_protocol=4); torch's weights_only unpickler reads "
        "protocol 2 only.",
        "convert it without running its code: torchverity migrate writes a protocol-2 "
        "state_dict; or re-save it from trusted code with the default pickle_protocol=2.",
        "torchverity migrate {file} {file}.safetensors",
    ),
    _rule(
        "weights-only-structure",
        r"Only persistent_load of storage is allowed|"
        r"Can only (?:SETITEMS?|append|extend)[^\n]*?(?:got <class '(?P<target>[\w.]+)'>|lists)",
        "the file holds a structure torch's weights_only unpickler cannot rebuild whatever you "
        "allowlist{detail}: a legacy (pre-1.6) file that pickles whole modules with their source, "
        "or a whole optimizer whose state is a defaultdict.",
        "convert it without running its code (the scan says so in its plan): torchverity "
        "migrate extracts the tensors and the plain data into a weights-only state_dict.",
        "torchverity migrate {file} {file}.safetensors",
    ),
    _rule(
        "cant-get-attribute",
        r"Can't get attribute '(?P<attr>[\w.]+)' on <module '(?P<module>[\w.]+)'|"
        r"No module named '(?P<missing>[\w.]+)'",
        "the file pickles a whole object whose class{detail} is no longer where it was when "
        "saved (renamed, moved, or defined in a __main__ script).",
        "extract the tensors and plain data without the original code: torchverity migrate "
        "rebuilds unknown classes as inert placeholders; then load the state_dict into a model "
        "built by the current code.",
        "torchverity migrate {file} {file}.safetensors",
    ),
    _rule(
        "size-mismatch",
        r"size mismatch for (?P<key>[\w.]+): copying a param with shape "
        r"(?P<ckpt>torch\.Size\(\[[\d, ]*\]\)) from checkpoint, the shape in current model "
        r"is (?P<model>torch\.Size\(\[[\d, ]*\]\))",
        "the model was built with a different configuration than the checkpoint "
        "(vocabulary size, number of classes, hidden width){detail}.",
        "build the model with the configuration saved with the checkpoint (meta.json or "
        "hyperparameters), or compare both sides to see every differing tensor.",
        "torchverity inspect {file}",
    ),
    _rule(
        "missing-unexpected-keys",
        r"(?:Missing|Unexpected) key\(s\) in state_dict",
        "the state_dict keys do not match the model: a 'module.' prefix from "
        "DataParallel/DistributedDataParallel, an '_orig_mod.' prefix from torch.compile, or a "
        "different architecture.",
        "strip the prefix (consume_prefix_in_state_dict_if_present) or build the matching "
        "architecture; load with strict=False only after reading the list of keys.",
        "torchverity inspect {file}",
    ),
    _rule(
        "cuda-on-cpu",
        r"Attempting to deserialize object on a CUDA device|"
        r"Attempting to deserialize object on CUDA device \d+ but torch\.cuda\.device_count",
        "the checkpoint holds tensors saved on a GPU, and this machine has no (or fewer) "
        "CUDA devices.",
        "load with map_location='cpu' (torchverity.load does by default), then move the model "
        "with model.to(device).",
        "torchverity inspect {file}",
    ),
    _rule(
        "different-devices",
        r"Expected all tensors to be on the same device",
        "a model and its inputs (or two parts of a model) live on different devices, often "
        "after loading a checkpoint with map_location='cpu' and moving only part of it.",
        "move the whole model after load_state_dict (model.to(device)) and the inputs with "
        "the same device; rebuild the optimizer after moving the model.",
        "torchverity inspect {file}",
    ),
    _rule(
        "truncated-zip",
        r"PytorchStreamReader failed (?:reading zip archive|finding central directory|"
        r"locating file)[^\n]*|failed finding central directory|"
        r"file is not a zip file|truncated|Ran out of input|"
        r"MetadataIncompleteBuffer|HeaderTooLarge|InvalidHeaderDeserialization",
        "the file is incomplete or damaged: a save interrupted before it finished (torch.save "
        "is not atomic), a partial copy or download, or a full disk.",
        "check the file against its sidecar or manifest and restore a good copy; write "
        "checkpoints with torchverity.save, which writes atomically.",
        "torchverity verify {file}",
    ),
    _rule(
        "zip-crc",
        r"CRC[- ]?32|Bad CRC|CRC check failed|crc mismatch",
        "bytes inside the checkpoint changed after it was written (storage or transfer "
        "corruption). torch.load does not check zip CRCs, so such damage usually loads silently.",
        "verify the file against its sidecar and restore a good copy if it differs.",
        "torchverity verify {file}",
    ),
    _rule(
        "not-a-pickle",
        r"invalid load key, '(?P<loadkey>[^']*)'",
        "the file is not a checkpoint: often a Git LFS pointer (load key 'v'), an HTML error "
        "page from a download (load key '<'), or a corrupted file.",
        "run 'git lfs pull' or download the file again, then verify it.",
        "torchverity verify {file}",
    ),
    _rule(
        "cuda-hardware",
        r"uncorrectable ECC error|ECC error|\bXid\b|GPU has fallen off the bus|"
        r"unspecified launch failure|an illegal memory access was encountered",
        "the GPU reported a fault that points to hardware (ECC, Xid, lost device), which can "
        "also corrupt data silently before it surfaces as an error.",
        "drain the node, check 'nvidia-smi -q -d ECC' and the kernel log for Xid codes, verify "
        "checkpoints written since the last good one, and run the device self-test.",
        "torchverity selftest",
    ),
)


def explain_text(text: str) -> list[Explanation]:
    """Every known failure in ``text`` (a message or a whole log), in order of appearance."""
    found: list[tuple[int, Explanation]] = []
    seen: set[tuple[str, str]] = set()
    for rule in _RULES:
        for match in rule.pattern.finditer(text):
            evidence = match.group(0).strip()
            if (rule.key, evidence) in seen:
                continue
            seen.add((rule.key, evidence))
            found.append((match.start(), _render(rule, match)))
    found.sort(key=lambda item: item[0])
    return [explanation for _, explanation in found]


def _render(rule: _Rule, match: re.Match[str]) -> Explanation:
    groups = match.groupdict()
    if groups.get("key"):
        key, ckpt, model = groups["key"], groups["ckpt"], groups["model"]
        detail = f": {key} is {ckpt} in the file, {model} in the model"
    else:
        named = [v for v in groups.values() if v]
        detail = f" ({', '.join(named)})" if named else ""
    return Explanation(
        key=rule.key,
        cause=rule.cause.replace("{detail}", detail),
        fix=rule.fix,
        command=rule.command.replace("{file}", "FILE"),
        evidence=match.group(0).strip(),
    )


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def explain_exception(exc: BaseException) -> Explanation | None:
    """The explanation of an exception raised by saving or loading (its causes included)."""
    for item in _chain(exc):
        found = explain_text(f"{type(item).__name__}: {item}")
        if found:
            return found[0]
    return None


def explain(source: str | BaseException | Iterable[str]) -> list[Explanation]:
    """Explain an error message, an exception, or the lines of a log."""
    if isinstance(source, BaseException):
        found = explain_exception(source)
        return [found] if found else []
    if isinstance(source, str):
        return explain_text(source)
    return explain_text("\n".join(source))


def with_file(explanation: Explanation, path: str) -> Explanation:
    """The same explanation with the command naming ``path`` instead of FILE."""
    import dataclasses
    import shlex

    command = explanation.command.replace("FILE", shlex.quote(path))
    return dataclasses.replace(explanation, command=command)
