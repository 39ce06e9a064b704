"""Static safety scan of pickle-bearing files, and the weights_only load plan.

Nothing from the scanned file is imported or run: every pickle stream is
walked symbolically (:mod:`torchverity.pickles._ops`) inside every container
(:mod:`torchverity.pickles._containers`). Each global gets a class, decided by
allowlist, never by denylist:

``torch``      in torch's own ``weights_only`` allowlist (this torch's list);
``benign``     known data classes (numpy arrays/dtypes/scalars, omegaconf containers,
               ``argparse``, ``pathlib``, ``typing``, ``enum``, ``datetime``,
               collections, builtin types, torch module/optimizer classes verified
               in-process) outside torch's list;
``dangerous``  runs commands, touches files or the network, imports, evaluates;
``unknown``    anything else: a class or function whose code would run (review it).

The file's verdict is ``unsafe`` if anything is dangerous, ``malformed`` if a
reading cannot be accounted for, ``needs-review`` if a class is unknown,
``needs-allowlist`` if any global is benign, else ``safe``
(:mod:`torchverity.pickles._verdict`).

>>> from torchverity.pickles import scan_file
>>> scan_file("model.pt").verdict                    # doctest: +SKIP
'safe'
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torchverity._formats import broken_download
from torchverity.errors import InputError, TorchVerityError, restore_step, shell_path
from torchverity.pickles._classes import (
    BENIGN,
    DANGEROUS,
    MALFORMED,
    NEEDS_ALLOWLIST,
    NEEDS_REVIEW,
    SAFE,
    TORCH,
    UNKNOWN,
    UNSAFE,
    Category,
    Verdict,
    classify,
    torch_allowlist,
)
from torchverity.pickles._containers import no_pickle, scan_container
from torchverity.pickles._ops import (
    Limits,
    PickleError,
)
from torchverity.pickles._plan import LoadPlan, plan_load
from torchverity.pickles._sniff import onnx_external_data
from torchverity.pickles._verdict import GlobalFinding, findings_of, problems_of, verdict_of

__all__ = [
    "BENIGN", "DANGEROUS", "MALFORMED", "NEEDS_ALLOWLIST", "NEEDS_REVIEW", "SAFE", "TORCH",
    "UNKNOWN", "UNSAFE", "GlobalFinding", "LoadPlan", "ScanReport", "ScanResult", "Skipped",
    "Unreadable", "classify",
    "scan", "scan_file", "torch_allowlist",
]

@dataclass(frozen=True)
class ScanResult:
    """The verdict on one file (``safe | needs-allowlist | needs-review | unsafe | malformed``)."""

    path: str
    verdict: Verdict
    globals: tuple[GlobalFinding, ...]
    plan: LoadPlan | None
    reason: str
    format: str = ""
    problems: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # other paths of the same file (symlinks to it)

    @property
    def ok(self) -> bool:
        return self.verdict in (SAFE, NEEDS_ALLOWLIST)

    def names(self, category: Category | None = None) -> list[str]:
        """Distinct global names, optionally of one category, in order of appearance."""
        seen = (g.name for g in self.globals if category in (None, g.category))
        return list(dict.fromkeys(seen))


# -------------------------------------------------------------------- verdict


def scan_file(path: str | os.PathLike[str], *, limits: Limits | None = None,
              weights: bool = False) -> ScanResult:
    """Scan one file without running anything from it. Text where weights belong (a
    ``.safetensors``, ``.bin``, ``.pt``, ``.pth`` or ``.ckpt`` name, or any file when
    ``weights``: a shard an index names) is a broken download, ``malformed``."""
    from torchverity.errors import no_such_file, unreadable

    p = os.fspath(path)
    if Path(p).is_dir():
        raise InputError(f"{p}: is a folder, not a file", path=p,
                         hint="scan() takes folders and scans the files in them")
    try:
        container = scan_container(p, limits or Limits())
    except PickleError as exc:
        return ScanResult(p, MALFORMED, (), None, str(exc), "unknown", (str(exc),))
    except FileNotFoundError:
        raise no_such_file(p) from None
    except OSError as exc:
        raise unreadable(p, exc) from None
    if container.runs_nothing and container.format in ("data", "pickle") and \
            onnx_external_data(p) is not None:
        no_pickle(container, "onnx-data")
    findings = findings_of(container)
    problems = problems_of(container)
    verdict, reason = verdict_of(container, findings, problems)
    if container.format == "text":
        # Every unpickler gives up on it before it calls anything (else it would not be
        # "text"), so a protocol-0 pickle never gets here: it is judged as one.
        broken = broken_download(Path(p), no_pickle=True, weights=weights)
        if broken is not None:
            verdict, reason = MALFORMED, broken.message.removeprefix(f"{p}: ")
    plan = plan_load(p, container, findings) if verdict != MALFORMED else None
    return ScanResult(p, verdict, tuple(findings), plan, reason, container.format,
                      tuple(problems))


def next_step(result: ScanResult) -> str:
    """What to do about a file, for the formats and verdicts whose answer is not a load plan."""
    path = shell_path(result.path)
    if result.format == "torchscript":
        return ("do not torch.jit.load it unless you trust its code; extract its tensors "
                f"without running it: torchverity migrate {path} NEW.safetensors")
    if result.format == "onnx":
        return f"torchverity inspect {path} lists its initializers"
    if result.format == "git-lfs-pointer":
        return "git lfs pull (or huggingface-cli download) fetches the real file"
    if result.format == "html" or (result.format == "text" and result.verdict == MALFORMED):
        return "download the file again; check the URL and any access token"
    if result.format == "index" and result.reason.startswith(UNFOLLOWED_INDEX):
        return ("do not load this checkpoint: a loader would read the files those entries "
                "name; get the index from the checkpoint's source (its entries are plain "
                "file names of shards beside it)")
    if result.format == "index" and result.verdict == MALFORMED:
        return ("fetch the shards the index names from the checkpoint's source "
                "(huggingface-cli download fetches what is missing), or restore the index "
                "that goes with them")
    if result.verdict != MALFORMED:
        return ""
    return restore_step(result.path)


@dataclass(frozen=True)
class Skipped:
    """A file a folder scan did not judge, and why (it cannot hold a pickle)."""

    path: str
    reason: str


@dataclass(frozen=True)
class Unreadable:
    """A file or folder a scan could not read: never judged, so never ``safe``."""

    path: str
    reason: str
    hint: str


@dataclass(frozen=True)
class ScanReport:
    """Verdicts for several files; ``ok`` when each is safe or needs-allowlist, every file
    could be read and every folder held a file to judge (``empty`` lists those that did not)."""

    results: tuple[ScanResult, ...] = field(default_factory=tuple)
    skipped: tuple[Skipped, ...] = field(default_factory=tuple)
    unreadable: tuple[Unreadable, ...] = field(default_factory=tuple)
    empty: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results) and not self.unreadable and not self.empty


# Names under which a file is meant to hold weights: a broken download there is reported.
_WEIGHT_SUFFIXES = frozenset({
    ".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".safetensors", ".npy", ".npz",
    ".joblib", ".h5", ".msgpack", ".model", ".tar", ".onnx",
})
SKIPPED_ONNX = "ONNX model, no pickle"
_SKIPPED_FORMATS = {"text": "text file, no pickle", "onnx": SKIPPED_ONNX,
                    "onnx-data": "ONNX external tensor data, no pickle",
                    "hdf5": "HDF5 file, no pickle", "msgpack": "msgpack file, no pickle",
                    "sentencepiece": "sentencepiece tokenizer model, no pickle",
                    "data": "binary data that no unpickler can read", "empty": "empty file"}


def _skip_reason(result: ScanResult, path: Path) -> str | None:
    """Folder scans judge only files that can hold a pickle, and broken weight downloads."""
    if result.verdict == UNSAFE or (result.format == "text" and result.verdict == MALFORMED):
        return None  # text where weights belong is a broken download: reported
    weights = path.suffix.lower() in _WEIGHT_SUFFIXES
    if result.format in ("git-lfs-pointer", "html") and not weights:
        return "Git LFS pointer" if result.format == "git-lfs-pointer" else "HTML page"
    if result.format in ("data", "empty") and weights:
        return None
    return _SKIPPED_FORMATS.get(result.format)


def _names_by_file(files: list[Path]) -> list[list[Path]]:
    """The paths of each real file once: a file reached through symlinks (a Hugging Face
    snapshot entry and its blob) is named by its links when it lives in a ``blobs`` folder,
    else by its own path first."""
    groups: dict[str, list[Path]] = {}
    for q in files:
        groups.setdefault(os.path.realpath(q), []).append(q)
    named: list[list[Path]] = []
    for real, paths in groups.items():
        links = [q for q in paths if q.is_symlink()]
        own = [q for q in paths if not q.is_symlink()]
        if links and Path(real).parent.name == "blobs":
            own = []
        named.append(own + links)
    return sorted(named, key=lambda names: names[0])


def _files_under(folder: Path, unreadable: list[Unreadable]) -> list[Path]:
    """Every regular file under ``folder``, symlinks to files and folders followed as
    loaders follow them (a pipeline's ``text_encoder`` may be a link to another folder);
    each real folder is walked once, so a link back up ends. What cannot be read is noted:
    unreadable folders, links to nothing, pipes, sockets and devices (a loader would read
    them: nothing vouches for what they give)."""
    from torchverity.errors import unreadable as cannot_read

    def add(error: InputError) -> None:
        unreadable.append(Unreadable(os.fspath(error.path or folder), error.message,
                                     error.hint or ""))

    def note(exc: OSError) -> None:
        add(cannot_read(exc.filename or folder, exc))

    files: list[Path] = []
    walked: set[str] = set()
    # The folder's own tree first, then each linked folder not walked yet: a file is named
    # by its own path where the folder holds it, by the link's where only a link reaches it.
    roots = [folder]
    while roots:
        links: list[Path] = []
        for top, dirs, names in os.walk(roots.pop(0), onerror=note):
            real = os.path.realpath(top)
            if real in walked:  # reached again through a link: its files are listed
                dirs.clear()
                continue
            walked.add(real)
            links += [Path(top) / d for d in dirs if (Path(top) / d).is_symlink()]
            dirs.sort()
            files += _regular_files(Path(top), names, add, note)
        roots += sorted(links)
    return files


def _regular_files(top: Path, names: list[str], add: Callable[[InputError], None],
                   note: Callable[[OSError], None]) -> list[Path]:
    """The regular files among ``names`` in ``top``; the others noted, each with why."""
    from torchverity.errors import no_such_file, not_regular

    files = []
    for q in (top / n for n in sorted(names)):
        try:
            mode = q.stat().st_mode
        except FileNotFoundError:
            add(no_such_file(q))
            continue
        except OSError as exc:  # a loop of links, a permission on the way
            note(exc)
            continue
        if stat.S_ISREG(mode):
            files.append(q)
        elif not stat.S_ISDIR(mode):  # a folder here appeared after the listing
            add(not_regular(q, mode))
    return files


def _scan_or_note(path: Path, limits: Limits | None, unreadable: list[Unreadable],
                  weights: bool = False) -> ScanResult | None:
    """The scan of one existing file, or None with the reason it could not be read."""
    try:
        return scan_file(path, limits=limits, weights=weights)
    except InputError as exc:
        unreadable.append(Unreadable(os.fspath(path), exc.message, exc.hint or ""))
        return None


@dataclass
class _Collected:
    """What a folder scan gathered, file by file."""

    results: list[ScanResult] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    unreadable: list[Unreadable] = field(default_factory=list)
    empty: list[str] = field(default_factory=list)


def _named_shards(files: list[Path]) -> set[str]:
    """The real paths of the shards the sharded-checkpoint indexes among ``files`` name:
    weights whatever their names (an index that cannot be read names none here; the
    index itself is reported)."""
    from torchverity.checkpoint._index import index_shards
    from torchverity.errors import TorchVerityError

    named: set[str] = set()
    for index in (f for f in files if f.name.endswith(".index.json")):
        try:
            shards, _missing = index_shards(index)
        except TorchVerityError:
            continue
        named.update(os.path.realpath(index.parent / s) for s in shards)
    return named


def _walk_folder(folder: Path, limits: Limits | None, report: _Collected) -> None:
    before = len(report.results), len(report.unreadable)
    groups = _names_by_file(_files_under(folder, report.unreadable))
    shards = _named_shards([names[0] for names in groups])
    for names in groups:
        weights = os.path.realpath(names[0]) in shards
        result = _scan_or_note(names[0], limits, report.unreadable, weights)
        if result is None:
            continue
        if _is_index(result) and (broken := _broken_index(result)) is not None:
            report.results.append(broken)  # its shards present are files of the walk
            continue
        reason = _skip_reason(result, names[0])
        if reason is None:
            aliases = tuple(os.fspath(q) for q in names[1:])
            report.results.append(dataclasses.replace(result, aliases=aliases))
        else:
            report.skipped.append(Skipped(os.fspath(names[0]), reason))
    if (len(report.results), len(report.unreadable)) == before:
        report.empty.append(os.fspath(folder))  # unreadable files speak for themselves


_WORST_FIRST: tuple[Verdict, ...] = (UNSAFE, MALFORMED, NEEDS_REVIEW, NEEDS_ALLOWLIST, SAFE)
# The reason of an index whose weight_map names a shard that is no plain file name beside
# it ("../x.bin", an absolute path): transformers joins the entry to the folder and reads
# whatever it names, so what such a checkpoint loads cannot be accounted for.
UNFOLLOWED_INDEX = "an index naming shards no loader should follow"


def _scan_index(result: ScanResult, limits: Limits | None, report: _Collected) -> None:
    """A sharded checkpoint's index given by itself stands for the checkpoint: its shards
    are scanned, and its own verdict is theirs (malformed when one is missing)."""
    from torchverity.checkpoint._index import index_shards
    from torchverity.errors import TorchVerityError

    index = Path(result.path)
    try:
        shards, missing = index_shards(index)
    except TorchVerityError as exc:
        unfollowed = _unfollowed_index(result, exc)
        reason = f"not a sharded-checkpoint index: {exc.message}"
        report.results.append(unfollowed or dataclasses.replace(
            result, verdict=MALFORMED, format="index", reason=reason, problems=(reason,)))
        return
    found = [r for s in shards if s not in missing
             if (r := _scan_or_note(index.parent / s, limits, report.unreadable, True))
             is not None]
    if missing:
        report.results += [_missing_shards(result, shards, missing), *found]
        return
    verdict: Verdict = min((r.verdict for r in found), key=_WORST_FIRST.index, default=SAFE)
    judged = (f"{len(shards)} shard(s)" if len(found) == len(shards) else
              f"{len(found)} of {len(shards)} shard(s) (the others cannot be read)")
    if verdict == SAFE:
        reason = f"sharded checkpoint, {judged} scanned: all safe"
    else:
        worst = ", ".join(Path(r.path).name for r in found if r.verdict == verdict)
        reason = f"sharded checkpoint, {judged} scanned: {worst}: {verdict}"
    report.results.append(dataclasses.replace(result, verdict=verdict, format="index",
                                              reason=reason))
    report.results += found


def _missing_shards(result: ScanResult, shards: list[str], missing: list[str]) -> ScanResult:
    """An index naming shards that are not beside it: the checkpoint cannot be accounted for."""
    return dataclasses.replace(
        result, verdict=MALFORMED, format="index",
        reason=f"{len(missing)} of its {len(shards)} shard(s) do not exist: {', '.join(missing)}",
        problems=tuple(f"shard {s} is named by the index and does not exist" for s in missing))


def _maps_weights(index: Path) -> bool:
    """Whether the file is a JSON object with a ``weight_map``: a sharded checkpoint's
    index, whatever is wrong inside it (a faiss or tokenizer ``*.index.json`` is not)."""
    import json

    from torchverity.checkpoint._records import read_text_record
    from torchverity.errors import TorchVerityError

    try:
        data = json.loads(read_text_record(index, "the index", ""))
    except (TorchVerityError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "weight_map" in data


def _unfollowed_index(result: ScanResult, exc: TorchVerityError) -> ScanResult | None:
    """A sharded checkpoint's index that no loader can follow safely (a shard path out of
    its folder, a weight_map of something else), as ``malformed``; None for a file that
    is no such index."""
    if not _maps_weights(Path(result.path)):
        return None
    reason = f"{UNFOLLOWED_INDEX}: {exc.message.removeprefix(f'{result.path}: ')}"
    return dataclasses.replace(result, verdict=MALFORMED, format="index", reason=reason,
                               problems=(reason,))


def _broken_index(result: ScanResult) -> ScanResult | None:
    """In a folder scan, a sharded checkpoint's index that names missing shards or shards
    out of its folder (another ``*.index.json``, or a complete one, is a text file like
    the rest)."""
    from torchverity.checkpoint._index import index_shards
    from torchverity.errors import TorchVerityError

    try:
        shards, missing = index_shards(Path(result.path))
    except TorchVerityError as exc:
        return _unfollowed_index(result, exc)
    return _missing_shards(result, shards, missing) if missing else None


def _is_index(result: ScanResult) -> bool:
    return result.format == "text" and result.path.endswith(".index.json")


def scan(*paths: str | os.PathLike[str], limits: Limits | None = None) -> ScanReport:
    """Scan files; folders recursively, judging only the files that can hold a pickle.

    A file that cannot be read is listed in ``unreadable`` and the others are still
    scanned; a folder with no file to judge is listed in ``empty``. A sharded checkpoint's
    ``*.index.json`` given as a file stands for its shards, which are scanned with it."""
    found = _Collected()
    for item in paths:
        p = Path(item)
        if p.is_dir():
            _walk_folder(p, limits, found)
        elif not p.exists():
            found.results.append(scan_file(p, limits=limits))  # raises: no such file
        else:
            result = _scan_or_note(p, limits, found.unreadable)
            if result is not None and _is_index(result):
                _scan_index(result, limits, found)
            elif result is not None:
                found.results.append(result)
    return ScanReport(tuple(found.results), tuple(found.skipped), tuple(found.unreadable),
                      tuple(found.empty))
