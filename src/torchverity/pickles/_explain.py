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

import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from torchverity.pickles._explain_rules import RULES, Rule


@dataclass(frozen=True)
class Explanation:
    """What a failure message means. ``evidence`` is the text that matched."""

    key: str
    cause: str
    fix: str
    command: str
    evidence: str = ""
    count: int = 1  # what the text reports of this cause (one block for all of it)
    tally: str = "1 occurrence"  # the count in words: '39 tensors', '2 keys: 1 missing, ...'


# A cause that explains the same lines better than a general one replaces it.
_SUPERSEDES = {"peft-adapter-keys": "missing-unexpected-keys",
               "missing-shard": "checkpoint-not-found"}

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_DETAILS_SHOWN = 5
_QUOTED = re.compile(r'"([^"\n]+)"')
_INDEX_SET = re.compile(r"\{([\d, .]+)\}")
# Lines that report an error: an exception's class name (CamelCase, maybe module-qualified)
# and its message, or an 'error:' prefix at the start of a line. A class name starts a word
# with a capital letter, so metrics ('val_error: 0.3') and prose ('No error: ...') are none.
_ERROR_LINE = re.compile(
    r"^.*?(?<![\w/\-])(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception):(?:[ \t].*)?$|"
    # a program's name may lead it, as argparse and compilers write it ('train.py: error: ...')
    r"^[ \t]*(?:[\w./\-]+:[ \t]*)?(?i:error|fatal):.*$", re.MULTILINE)
# A traceback ends with the exception's line, whatever its class is called (BadZipFile,
# KeyboardInterrupt): the first unindented line after the frames.
_TRACEBACK_END = re.compile(
    r"^Traceback \(most recent call last\):[ \t]*\n(?:[ \t].*\n|[ \t]*\n)*(?P<line>\S.*)$",
    re.MULTILINE)
# A warning that a rule matches, printed before the error the same rule matches (torch warns
# that a TorchScript archive was given, then refuses it), belongs to that error.
_WARNING_LINE = re.compile(r"\b[A-Z]\w*Warning:")
# torch's weights_only error quotes its unpickler's message on a line of its own: that line
# continues the report above it, whose cause it holds. Python's separators between chained
# exceptions ("...direct cause of the following exception:") report nothing themselves.
_CONTINUATION = re.compile(r"WeightsUnpickler error:|^The above exception was the direct cause "
                           r"of the following exception:")


def strip_ansi(text: str) -> str:
    """The text without terminal colour and cursor escapes (torch and transformers emit them)."""
    return _ANSI.sub("", text)


def _matches(text: str) -> list[tuple[Rule, re.Match[str]]]:
    found = [(rule, m) for rule in RULES for m in rule.pattern.finditer(text)]
    return sorted(found, key=lambda item: item[1].start())


def explain_text(text: str) -> list[Explanation]:
    """Every known failure in ``text`` (a message or a whole log), one block per cause, in
    order of first appearance."""
    grouped: dict[str, list[re.Match[str]]] = {}
    rules: dict[str, Rule] = {}
    for rule, match in _matches(strip_ansi(text)):
        grouped.setdefault(rule.key, []).append(match)
        rules[rule.key] = rule
    for specific, general in _SUPERSEDES.items():
        if specific in grouped:
            grouped.pop(general, None)
    return [_render(rules[key], _without_forewarnings(matches))
            for key, matches in grouped.items()]


def _on_warning_line(match: re.Match[str]) -> bool:
    text = match.string
    start = text.rfind("\n", 0, match.start()) + 1
    end = text.find("\n", match.start())
    return bool(_WARNING_LINE.search(text[start:end if end >= 0 else len(text)]))


def _without_forewarnings(matches: list[re.Match[str]]) -> list[re.Match[str]]:
    """The matches less each warning whose next match (of the same cause) is an error: the
    two report one failure, and the error says it."""
    warned = [_on_warning_line(m) for m in matches]
    kept = [m for i, m in enumerate(matches)
            if not (warned[i] and i + 1 < len(matches) and not warned[i + 1])]
    return kept


def _error_starts(text: str) -> list[int]:
    """Where each error report in ``text`` starts: its exception or 'error:' line."""
    starts = {m.start() for m in _ERROR_LINE.finditer(text)
              if not _CONTINUATION.search(m.group(0))}
    starts.update(m.start("line") for m in _TRACEBACK_END.finditer(text)
                  if not _CONTINUATION.search(m.group("line")))
    return sorted(starts)


def unexplained(text: str) -> list[str]:
    """Error reports in ``text`` that no rule explains (each runs to the next error line)."""
    clean = strip_ansi(text)
    starts = _error_starts(clean)
    spans = [m.span() for _, m in _matches(clean)]
    out: list[str] = []
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(clean)
        if not any(start <= s < end or s <= start < e for s, e in spans):
            out.append(clean[start:end].strip().splitlines()[0][:200])
    return out


@dataclass(frozen=True)
class _Found:
    """What one match reports: the names it gives, under a label where a cause has kinds
    (missing and unexpected keys), and how many things (tensors, keys) it stands for."""

    label: str
    names: tuple[str, ...]
    count: int


def _found(match: re.Match[str]) -> _Found:
    groups = match.groupdict()
    if groups.get("summary"):  # announces the report's rows, which are counted themselves
        return _Found("", (), 0)
    if groups.get("key"):
        return _Found("", (_with_shapes(groups),), _tensors(groups["key"]))
    if groups.get("kind"):
        keys = tuple(_QUOTED.findall(groups["keys"] or ""))
        return _Found(groups["kind"].lower(), keys, max(len(keys), 1))
    return _Found("", tuple(_named(k, v) for k, v in groups.items() if v), 1)


def _named(group: str, value: str) -> str:
    """A matched value in words: an operand number as the opcode or byte it is."""
    if group == "opcode":
        name, protocol = _opcodes()[int(value)]
        return f"operand {value} is {name}, of protocol {protocol}"
    if group == "byte":
        return f"byte {int(value):#04x} is no opcode torch's unpickler reads"
    return value


@functools.cache
def _opcodes() -> dict[int, tuple[str, int]]:
    import pickletools

    return {ord(op.code): (op.name, op.proto) for op in pickletools.opcodes}


def _with_shapes(groups: dict[str, str | None]) -> str:
    if not groups.get("ckpt"):
        return str(groups["key"])
    return f"{groups['key']} is {groups['ckpt']} in the file, {groups['model']} in the model"


def _tensors(key: str) -> int:
    """How many tensors a (merged) transformers key stands for: the product of its index
    sets; '{0...11}' is a range, as transformers writes more than ten indices."""
    count = 1
    for indices in _INDEX_SET.findall(key):
        first, _, last = indices.partition("...")
        count *= int(last) - int(first) + 1 if last else len(indices.split(","))
    return count


def _detail(found: list[_Found]) -> str:
    sections: dict[str, list[str]] = {}
    for item in found:
        sections.setdefault(item.label, []).extend(item.names)
    parts = [_listed(label, names) for label, names in sections.items() if names]
    return f" ({'; '.join(parts)})" if parts else ""


def _listed(label: str, names: list[str]) -> str:
    unique = list(dict.fromkeys(names))
    # Names that hold commas (shapes, merged layer indices) need another separator.
    sep = "; " if any(", " in name for name in unique) else ", "
    more = f" and {len(unique) - _DETAILS_SHOWN} more" if len(unique) > _DETAILS_SHOWN else ""
    prefix = f"{label}: " if label else ""
    return prefix + sep.join(unique[:_DETAILS_SHOWN]) + more


def _tally(unit: str, found: list[_Found]) -> tuple[int, str]:
    """The count and its words: '39 tensors', '3 keys: 2 missing, 1 unexpected'."""
    by_label: dict[str, int] = {}
    for item in found:
        by_label[item.label] = by_label.get(item.label, 0) + item.count
    count = sum(by_label.values()) or 1  # a summary line alone is one occurrence
    words = f"{count} {unit if count > 1 else unit.removesuffix('s')}"
    if len(by_label) > 1:
        words += ": " + ", ".join(f"{n} {label}" for label, n in by_label.items())
    return count, words


def _render(rule: Rule, matches: list[re.Match[str]]) -> Explanation:
    found = [_found(m) for m in matches]
    count, tally = _tally(rule.unit, found)
    return Explanation(
        key=rule.key,
        cause=rule.cause.replace("{detail}", _detail(found)),
        fix=rule.fix,
        command=rule.command.replace("{file}", "FILE").replace("{folder}",
                                                                _folder(matches)),
        evidence=_evidence(matches[0]),
        count=count,
        tally=tally,
    )


def _evidence(match: re.Match[str]) -> str:
    """The error's own line; a transformers report row as its key and status, without the
    table's padding and pipes (and its note, where it has one, after them)."""
    line = match.group(0).strip().splitlines()[-1]
    if not match.groupdict().get("key") or "|" not in line:
        return line
    key, status, *rest = (cell.strip() for cell in line.split("|"))
    note = " ".join(cell for cell in rest if cell)
    return f"{key}: {status}" + (f" ({note})" if note else "")


def _folder(matches: list[re.Match[str]]) -> str:
    """The model folder the messages name (the folder itself, or a file's), else FOLDER."""
    import os
    import shlex

    for match in matches:
        groups = match.groupdict()
        if groups.get("where"):
            return shlex.quote(groups["where"])
        named = next((groups[k] for k in ("shard", "config", "absent", "nofile")
                      if groups.get(k)), None)
        if named:
            return shlex.quote(os.path.dirname(named) or ".")
    return "FOLDER"


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
