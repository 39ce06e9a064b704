"""Every bad record gets a verdict: each record kind is mutated many ways (wrong-typed and
missing fields, non-UTF-8 text, deep nesting, a folder where the file belongs, torn text)
and the command reading it must end in a typed error (exit 2) or a failed check (exit 1):
never an internal error, a raw exception from ``torchverity.load``, or exit 0.
A clean copy of each record passes (exit 0), so the table cannot pass by refusing all.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
    """Fingerprint and size true, the digest (blake3, beside a sha256 sidecar) of other bytes."""
    from torchverity.errors import IntegrityError

    path = _saved(tmp_path, "model.pt")
    meta_file = path.with_name("model.pt.meta.json")
    meta = json.loads(meta_file.read_text())
    meta["digest"] = {"algo": "blake3", "hex": "ab" * 32}
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(IntegrityError, match="made for other bytes"):
        torchverity.load(path, sidecar="require")
    import blake3

    meta["digest"]["hex"] = blake3.blake3(path.read_bytes()).hexdigest()
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
    side = path.with_name("model.pt.sha256")
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
