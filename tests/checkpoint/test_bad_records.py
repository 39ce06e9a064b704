"""Every bad record gets a verdict: each record kind is mutated many ways (wrong-typed and
missing fields, non-UTF-8 text, deep nesting, a folder where the file belongs, torn text)
and the command reading it must end in a typed error (exit 2) or a failed check (exit 1):
never an internal error, a raw exception from ``torchverity.load``, or exit 0.
A clean copy of each record passes (exit 0), so the table cannot pass by refusing all.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

import torchverity
from torchverity.errors import TorchVerityError

STATE = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(8)}
DEEP = "[" * 200_000 + "]" * 200_000
VALUES: tuple[Any, ...] = (None, True, 7, -1, 1.5, "x", [], {}, [1, "a"], {"k": []})


def _json_mutations(doc: dict[str, Any], keep: frozenset[str] = frozenset(),
                    allowed: dict[str, tuple[type, ...]] | None = None,
                    ) -> Iterator[tuple[str, bytes | None]]:
    """(label, new bytes) for a JSON record; None means 'replace the file by a folder'."""
    yield "folder", None
    yield "empty", b""
    yield "non-utf8", b"\xff\xfe{\x00\x80"
    yield "deep", DEEP.encode()
    yield "torn", json.dumps(doc).encode()[:-7]
    for root in ("[]", "1", '"text"', "null"):
        yield f"root={root}", root.encode()
    for key in doc:
        if key in keep:
            continue
        yield f"missing {key}", json.dumps({k: v for k, v in doc.items() if k != key}).encode()
        for value in VALUES:
            if type(value) is type(doc[key]) and (value == doc[key]
                                                   or isinstance(value, (str, list, dict))):
                continue  # same type: a value only its reader's own checks can judge
            if allowed and key in allowed and type(value) in allowed[key]:
                continue  # another valid value
            changed = {**doc, key: value}
            yield f"{key}={json.dumps(value)}", json.dumps(changed).encode()


def _apply(path: Path, data: bytes | None) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    if data is None:
        path.mkdir()
    else:
        path.write_bytes(data)


def _verdict(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except TorchVerityError as exc:
        return f"typed:{exc.exit_code}"
    return "accepted"


def _cli_code(run_cli: Callable[..., Any], *args: str) -> int:
    result = run_cli(*args)
    assert "internal error" not in result.err and "Traceback" not in result.err, result.err
    return int(result.code)


# ------------------------------------------------------------------ meta.json


def _saved(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    torchverity.save(STATE, path, meta={"step": 1})
    return path


@pytest.mark.parametrize("name", ["model.pt", "model.safetensors"])
def test_every_bad_meta_json_is_refused(tmp_path: Path, name: str,
                                        run_cli: Callable[..., Any]) -> None:
    path = _saved(tmp_path, name)
    meta = path.with_name(name + ".meta.json")
    good = meta.read_bytes()
    assert _verdict(lambda: torchverity.load(path, sidecar="require")) == "accepted"
    doc = json.loads(good)
    accepted = []
    nullable = {"seed": (int, type(None)), "data": (dict, type(None))}
    for label, data in _json_mutations(doc, keep=frozenset({"user"}), allowed=nullable):
        if label in ("missing digest", "digest=null"):
            continue  # a record without a file digest is valid: the tensors are rehashed
        _apply(meta, data)
        if _verdict(lambda: torchverity.load(path, sidecar="require")) == "accepted":
            accepted.append(label)
        assert _cli_code(run_cli, "inspect", str(path)) != 0, label
        _apply(meta, good)
    assert not accepted, accepted


def test_a_forged_self_consistent_meta_json_is_refused(tmp_path: Path) -> None:
    """A meta.json rebuilt for other tensors, with its digest in another algorithm."""
    path = _saved(tmp_path, "model.pt")
    other = tmp_path / "other.pt"
    torchverity.save({"w": torch.zeros(64), "b": torch.ones(8)}, other, algo="blake3")
    forged = json.loads(other.with_name("other.pt.meta.json").read_text())
    forged["file"] = "model.pt"
    path.with_name("model.pt.meta.json").write_text(json.dumps(forged))
    with pytest.raises(TorchVerityError):
        torchverity.load(path, sidecar="require")


def test_a_meta_json_whose_other_algorithm_digest_lies_is_refused(tmp_path: Path) -> None:
    """Fingerprint and size true, the digest (sha256, beside a blake3 sidecar) of other bytes."""
    from torchverity.errors import IntegrityError

    path = _saved(tmp_path, "model.pt")
    meta_file = path.with_name("model.pt.meta.json")
    meta = json.loads(meta_file.read_text())
    meta["digest"] = {"algo": "sha256", "hex": "ab" * 32}
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(IntegrityError, match="made for other bytes"):
        torchverity.load(path, sidecar="require")
    meta["digest"]["hex"] = hashlib.sha256(path.read_bytes()).hexdigest()
    meta_file.write_text(json.dumps(meta))
    torchverity.load(path, sidecar="require")  # the truth in another algorithm is accepted


# ------------------------------------------------------------------ safetensors headers


def _header_file(tmp_path: Path) -> tuple[Path, bytes, dict[str, Any]]:
    path = tmp_path / "model.safetensors"
    torchverity.save(STATE, path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return path, raw, json.loads(raw[8:8 + n])


def _with_header(raw: bytes, header: bytes) -> bytes:
    (n,) = struct.unpack("<Q", raw[:8])
    return struct.pack("<Q", len(header)) + header + raw[8 + n:]


def _header_mutations(doc: dict[str, Any]) -> Iterator[tuple[str, bytes]]:
    yield "non-utf8", b"\xff\xfe" + b" " * 10
    yield "deep", DEEP.encode()
    yield "root list", b"[]"
    yield "duplicate name", b'{"w": 1, "w": 2}'
    for name, entry in doc.items():
        if name == "__metadata__":
            continue
        for field in ("dtype", "shape", "data_offsets"):
            yield f"{name} missing {field}", json.dumps(
                {**doc, name: {k: v for k, v in entry.items() if k != field}}).encode()
            for value in (*VALUES, [0, 10**12], [-1, 4], "F32"):
                if value != entry[field]:
                    yield f"{name}.{field}={json.dumps(value)}", json.dumps(
                        {**doc, name: {**entry, field: value}}).encode()
    yield "__metadata__ not strings", json.dumps({**doc, "__metadata__": {"a": 1}}).encode()


def test_every_bad_safetensors_header_is_refused(tmp_path: Path,
                                                 run_cli: Callable[..., Any]) -> None:
    path, raw, doc = _header_file(tmp_path)
    assert _cli_code(run_cli, "inspect", str(path)) == 0
    accepted = []
    for label, header in _header_mutations(doc):
        path.write_bytes(_with_header(raw, header))
        for sidecar in ("require", "ignore"):
            if _verdict(lambda s=sidecar: torchverity.load(path, sidecar=s)) == "accepted":
                accepted.append(f"{label} ({sidecar})")
        assert _cli_code(run_cli, "inspect", str(path)) != 0, label
    assert not accepted, accepted


# ------------------------------------------------------------------ sharded indexes


def test_every_bad_sharded_index_is_refused(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    folder = tmp_path / "sharded"
    torchverity.save(STATE, folder, shard_bytes=64)
    index = folder / "model.safetensors.index.json"
    good = index.read_bytes()
    doc = json.loads(good)
    assert _verdict(lambda: torchverity.load(folder, sidecar="require")) == "accepted"
    mutations = list(_json_mutations(doc))
    shard = doc["weight_map"]["w"]
    mutations += [
        ("weight_map names ..", json.dumps({**doc, "weight_map": {
            **doc["weight_map"], "w": "../" + shard}}).encode()),
        ("weight_map value int", json.dumps({**doc, "weight_map": {"w": 3, "b": 4}}).encode()),
        ("weight_map missing a tensor", json.dumps({**doc, "weight_map": {
            "w": shard}}).encode()),
    ]
    for policy in ("require", "ignore"):
        accepted = []
        for label, data in mutations:
            _apply(index, data)
            verdict = _verdict(lambda p=policy: torchverity.load(folder, sidecar=p))
            # Hugging Face's metadata is optional; unverified, its absence is no damage.
            optional = policy == "ignore" and label in ("missing metadata", "metadata=null")
            if verdict == "accepted" and not optional:
                accepted.append(label)
            _apply(index, good)
        assert not accepted, (policy, accepted)


# ------------------------------------------------------------------ folder manifests


def test_every_bad_folder_manifest_is_refused(tmp_path: Path,
                                              run_cli: Callable[..., Any]) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("alpha")
    assert _cli_code(run_cli, "manifest", str(folder)) == 0
    record = folder / "torchverity.manifest.json"
    good = record.read_bytes()
    assert _cli_code(run_cli, "verify", str(folder)) == 0
    doc = json.loads(good)
    mutations = list(_json_mutations(doc))
    entry = doc["files"][0]
    for key in entry:
        for value in VALUES:
            if value != entry[key]:
                mutations.append((f"files[0].{key}={json.dumps(value)}", json.dumps(
                    {**doc, "files": [{**entry, key: value}]}).encode()))
    for label, data in mutations:
        _apply(record, data)
        assert _cli_code(run_cli, "verify", str(folder)) in (1, 2), label
        _apply(record, good)


# ------------------------------------------------------------------ sidecars


def test_every_bad_sidecar_is_refused(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    path = _saved(tmp_path, "model.pt")
    side = path.with_name("model.pt.blake3")
    good = side.read_bytes()
    for label, data in [("folder", None), ("empty", b""), ("non-utf8", b"\xff\xfe\x80"),
                        ("short hex", b"abc  model.pt\n"), ("two lines", good + good),
                        ("other digest", b"0" * 64 + b"  model.pt\n")]:
        _apply(side, data)
        assert _verdict(lambda: torchverity.load(path, sidecar="require")) != "accepted", label
        assert _cli_code(run_cli, "verify", str(path)) in (1, 2), label
        _apply(side, good)


# ------------------------------------------------------------------ golden files


def test_every_bad_golden_file_is_refused(tmp_path: Path) -> None:
    from torchverity.golden import check, record

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).eval()
    path = tmp_path / "golden.json"
    record(model, torch.ones(2, 4), path)
    good = path.read_bytes()
    assert check(model, path).ok
    doc = json.loads(good)
    accepted = []
    for label, data in _json_mutations(doc, keep=frozenset({"created"})):
        _apply(path, data)
        if _verdict(lambda: check(model, path)) == "accepted":
            accepted.append(label)
        _apply(path, good)
    # The environment is informational (recorded on another machine, the check says so);
    # a record may hold no weights fingerprint.
    informational = ("environment", "missing environment", "missing model", "model=null")
    assert not [a for a in accepted if not a.startswith(informational)], accepted


# ------------------------------------------------------------------ events.jsonl


def test_every_bad_event_log_line_is_refused(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    log = tmp_path / "events.jsonl"
    good = b'{"event": "metrics", "step": 1, "loss": 0.5}\n{"event": "finished"}\n'
    log.write_bytes(good)
    assert _cli_code(run_cli, "report", str(log)) == 0
    lines = [b"\xff\xfe\x80 not utf-8", DEEP.encode(), b"[1, 2]", b'{"event": 3}',
             b'{"step": 1}', b'"text"', b"{not json"]
    for bad in lines:
        log.write_bytes(good + bad + b"\n" + good)
        assert _cli_code(run_cli, "report", str(log)) == 2, bad[:20]
    shutil.rmtree(log, ignore_errors=True) if log.is_dir() else log.unlink()
    log.mkdir()
    assert _cli_code(run_cli, "report", str(log)) == 2


# ------------------------------------------------------------------ inspect on sharded folders


def test_inspect_fails_on_a_missing_or_extra_shard(tmp_path: Path,
                                                   run_cli: Callable[..., Any]) -> None:
    folder = tmp_path / "sharded"
    torchverity.save(STATE, folder, shard_bytes=64)
    torchverity.save(STATE, folder, shard_bytes=64)  # generation 2
    assert _cli_code(run_cli, "inspect", str(folder)) == 0
    (folder / "model-00001-of-00002.g3.safetensors").write_bytes(b"left by a killed save")
    assert _cli_code(run_cli, "inspect", str(folder)) == 0  # not this save's shard
    extra = folder / "model-00003-of-00002.g2.safetensors"
    extra.write_bytes(b"x")
    result = run_cli("inspect", str(folder))
    assert result.code == 1 and "does not name" in result.err
    extra.unlink()
    shard = folder / "model-00002-of-00002.g2.safetensors"
    shard.rename(tmp_path / "away")
    result = run_cli("inspect", str(folder))
    assert result.code != 0 and "internal error" not in result.err


# ------------------------------------------------------------------ batch journals and bags

JOURNAL = "batch-journal.sqlite"
BATCH_MODEL = "def build():\n    return lambda item: item.data[::-1]\n"
SQL_VALUES = {"NULL": "NULL", "blob": "x'00ff'", "non-utf8": "CAST(x'fffe80' AS TEXT)",
              "text": "'x'", "real": "1.5", "negative": "-1"}
_ALL = tuple(SQL_VALUES)
_NOT_TEXT = ("NULL", "blob", "non-utf8")  # in a TEXT column a number is stored as text
# Column: its wrong values. Left out as valid: a negative id or mtime (a file from before
# 1970), no error and no update time; any text in key, path and output is judged by the
# output-name and path checks (tests/batch/test_batch_journal_paths.py).
ITEM_COLUMNS = {
    "id": ("NULL", "blob", "non-utf8", "text", "real"),
    "size": _ALL, "attempts": _ALL, "interrupted": _ALL, "output_size": _ALL,
    "mtime_ns": ("NULL", "blob", "non-utf8", "text", "real"),
    "key": _NOT_TEXT, "path": _NOT_TEXT, "output": _NOT_TEXT,
    "digest": (*_NOT_TEXT, "text"), "output_digest": (*_NOT_TEXT, "text"),
    "state": (*_NOT_TEXT, "text"),
    "error": ("blob", "non-utf8"), "updated": ("blob", "non-utf8", "text"),
}
JOB_KEYS = ("schema", "fingerprint", "job", "inputs_root", "created")
Mutation = Callable[[Path], None]


@pytest.fixture
def batch_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
              run_cli: Callable[..., Any]) -> tuple[Callable[[Path], list[str]], Path]:
    """A finished three-item job (its ``batch run`` arguments for an --out, and that folder)."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "tvbadrec_model.py").write_text(BATCH_MODEL)
    monkeypatch.syspath_prepend(str(code))
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(3):
        (inputs / f"item{i}.bin").write_bytes(f"input {i}".encode())

    def args(out: Path) -> list[str]:
        return ["batch", "run", "--inputs", str(inputs), "--model", "tvbadrec_model:build",
                "--out", str(out)]

    good = tmp_path / "good"
    assert _cli_code(run_cli, *args(good)) == 0
    return args, good


def _sql(out: Path, *statements: str, params: tuple[Any, ...] = ()) -> None:
    conn = sqlite3.connect(out / JOURNAL)
    try:
        for statement in statements:
            conn.execute(statement, params if "?" in statement else ())
        conn.commit()
    finally:
        conn.close()


def _loosened(out: Path, table: str, drop: str | None = None) -> None:
    """``table`` rebuilt without its constraints (as other code could write it), less ``drop``."""
    conn = sqlite3.connect(out / JOURNAL)
    try:
        columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")
                   if row[1] != drop]
        conn.executescript(f"CREATE TABLE loose AS SELECT {', '.join(columns)} FROM {table};"
                           f"DROP TABLE {table}; ALTER TABLE loose RENAME TO {table};")
    finally:
        conn.close()


def _file_mutation(name: str, data: bytes | Literal[False] | None) -> Mutation:
    """Replace ``OUT/name``: by bytes, by a folder (None), or remove it (False)."""
    def mutate(out: Path) -> None:
        if data is False:
            (out / name).unlink()
        else:
            _apply(out / name, data)
    return mutate


def _journal_mutations(good: Path) -> Iterator[tuple[str, Mutation]]:
    raw = (good / JOURNAL).read_bytes()
    for label, data in [("folder", None), ("empty", b""), ("non-sqlite", b"\xff\xfe\x80" * 99),
                        ("torn", raw[:len(raw) // 2]), ("header only", raw[:100])]:
        yield f"journal {label}", _file_mutation(JOURNAL, data)
    yield "journal wal is a folder", _file_mutation(f"{JOURNAL}-wal", None)
    for column, wrong in ITEM_COLUMNS.items():
        yield f"items missing {column}", lambda out, c=column: _loosened(out, "items", c)
        for name in wrong:
            where = "key = 'item0.bin'" if column == "id" else "id = 1"
            sql = f"UPDATE items SET {column} = {SQL_VALUES[name]} WHERE {where}"
            yield f"items {column}={name}", lambda out, s=sql: (_loosened(out, "items"),
                                                                 _sql(out, s))
    yield "two items, one key", lambda out: (_loosened(out, "items"), _sql(
        out, "UPDATE items SET key = 'item1.bin', output = 'data/item1.bin.out' WHERE id = 1"))
    yield "an unknown state", lambda out: (_loosened(out, "items"), _sql(
        out, "UPDATE items SET state = 'done' WHERE id = 2"))
    for key in JOB_KEYS:
        yield f"job missing {key}", lambda out, k=key: _sql(out, f"DELETE FROM job WHERE key='{k}'")
        for name in ("NULL", "blob", "non-utf8", "text"):
            sql = f"UPDATE job SET value = {SQL_VALUES[name]} WHERE key = '{key}'"
            yield f"job {key}={name}", lambda out, s=sql: (_loosened(out, "job"), _sql(out, s))
    conn = sqlite3.connect(good / JOURNAL)
    doc = json.loads(dict(conn.execute("SELECT key, value FROM job"))["job"])
    conn.close()
    for label, data in _json_mutations(doc):
        if data is not None:
            yield f"job description {label}", lambda out, d=data: _sql(
                out, "UPDATE job SET value = CAST(? AS TEXT) WHERE key = 'job'", params=(d,))
    yield "events table missing", lambda out: _sql(out, "DROP TABLE events")
    yield "events missing detail", lambda out: _loosened(out, "events", "detail")
    yield "event of wrong types", lambda out: (_loosened(out, "events"), _sql(
        out, "INSERT INTO events VALUES ('x', 'y', NULL, x'00')"))


def _fresh(args: Callable[[Path], list[str]], good: Path, tmp_path: Path,
           mutate: Mutation) -> Path:
    out = tmp_path / "mutated"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(good, out)
    mutate(out)
    return out


def test_every_bad_batch_journal_is_refused(tmp_path: Path, run_cli: Callable[..., Any],
                                            batch_job: tuple[Callable[[Path], list[str]], Path]
                                            ) -> None:
    args, good = batch_job
    assert _cli_code(run_cli, "batch", "verify", str(good)) == 0
    assert _cli_code(run_cli, *args(good)) == 0  # the clean journal resumes
    accepted = []
    for label, mutate in _journal_mutations(good):
        for command in (args, lambda out: ["batch", "verify", str(out)]):
            out = _fresh(args, good, tmp_path, mutate)
            result = run_cli(*command(out))
            assert "internal error" not in result.err and "Traceback" not in result.err, (
                label, result.err)
            if result.code == 0:
                accepted.append(f"{label} ({command(out)[1]})")
            elif result.code == 2:  # what, where, and what to do
                assert str(out) in result.err and "next:" in result.err, (label, result.err)
    assert not accepted, accepted


def test_every_bad_batch_bag_or_output_folder_gets_a_verdict(
        tmp_path: Path, run_cli: Callable[..., Any],
        batch_job: tuple[Callable[[Path], list[str]], Path]) -> None:
    """``batch verify`` fails a damaged bag (exit 1; a missing manifest it writes, as documented);
    ``batch run`` writes the bag files again, or refuses what it cannot replace (exit 2)."""
    args, good = batch_job
    mutations: list[tuple[str, Mutation]] = []
    for name in ("manifest-sha256.txt", "bagit.txt", "bag-info.txt"):
        text = (good / name).read_bytes()
        for label, data in [("folder", None), ("missing", False), ("empty", b""),
                            ("non-utf8", b"\xff\xfe\x80\n"), ("torn", text[:len(text) // 2]),
                            ("deep", DEEP.encode()), ("doubled", text + text)]:
            mutations.append((f"{name} {label}", _file_mutation(name, data)))
    mutations += [
        ("Payload-Oxum of other outputs", _file_mutation("bag-info.txt", b"Payload-Oxum: 5.3\n")),
        ("no BagIt version", _file_mutation("bagit.txt", b"BagIt-Version: one\n")),
        ("an output is a folder", _file_mutation("data/item0.bin.out", None)),
        ("data is a file", lambda out: (shutil.rmtree(out / "data"),
                                        (out / "data").write_bytes(b"x"))),
        ("the lock is a folder", _file_mutation(".batch.lock", None)),
    ]
    for label, mutate in mutations:
        out = _fresh(args, good, tmp_path, mutate)
        expected = 1
        if label in ("manifest-sha256.txt missing", "the lock is a folder"):
            expected = 0  # verify writes an absent bag; it reads, and takes no lock
        elif label in ("an output is a folder", "data is a file"):
            expected = 2  # refused when the journal is opened: nothing is read there
        assert _cli_code(run_cli, "batch", "verify", str(out)) == expected, label
        out = _fresh(args, good, tmp_path, mutate)
        result = run_cli(*args(out))
        assert "internal error" not in result.err, (label, result.err)
        if result.code == 0:  # the run rewrote the bag: it verifies again
            assert _cli_code(run_cli, "batch", "verify", str(out)) == 0, label
        else:
            assert result.code == 2 and "next:" in result.err, (label, result.err)


def test_a_folder_left_where_the_journal_is_built_is_refused(
        tmp_path: Path, run_cli: Callable[..., Any],
        batch_job: tuple[Callable[[Path], list[str]], Path]) -> None:
    args, _good = batch_job
    for name in (f".{JOURNAL}.building", "inputs-sha256.txt"):
        out = tmp_path / name.strip(".")
        (out / name).mkdir(parents=True)
        result = run_cli(*args(out))
        assert result.code == 2 and name in result.err and "next:" in result.err, result.err
        (out / name).rmdir()
        assert _cli_code(run_cli, *args(out)) == 0
