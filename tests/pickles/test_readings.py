"""The scan reads a file the way every loader reads it, not the way its magic bytes suggest.

Each malicious file here is proved live in one throwaway subprocess (its plain loader
creates its sentinel) and is caught by the scan with the offender located; the benign
files of the same shapes raise no alarm; nothing runs under torchverity.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import joblib
import loader_cases as lc
import numpy as np
import pytest
import torch

from torchverity.errors import FormatError
from torchverity.pickles import check_limits, scan, scan_file
from torchverity.pickles._classes import BENIGN, DANGEROUS


def _malicious(root: Path) -> list[lc.LoaderCase]:
    root.mkdir()

    def case(name: str, loader: str, build: Any, *extra: Any, **kw: Any) -> lc.LoaderCase:
        sentinel = root / f"RAN-{name}"
        suffix = kw.pop("suffix", ".pt")
        return lc.LoaderCase(name, build(root / f"{name}{suffix}", sentinel, *extra), sentinel,
                             loader, **kw)

    def tar(path: Path, sentinel: Path) -> Path:
        return lc.tar_checkpoint(path, lc.payload(sentinel))

    def straddle_pickle(path: Path, sentinel: Path) -> Path:
        path.write_bytes(lc.straddling_frame(sentinel))
        return path

    return [
        case("tar_pickle_member", "torch", tar),
        case("upper_case_data_pkl", "torch", lc.upper_data_pkl),
        # torch.load hands a *.safetensors name to safetensors: the same bytes named .bin
        case("safetensors_polyglot", "torch", lc.polyglot_safetensors, suffix=".bin"),
        case("frame_straddle_zip", "torch", lc.straddle_zip, verdict="malformed"),
        case("frame_straddle_stream", "pickle_stream", straddle_pickle, verdict="malformed",
             suffix=".pkl"),
        case("loader_escape", "pickle", lc.nested_loader_escape, suffix=".pkl",
             offender="torch.storage._load_from_bytes"),
        case("nested_second_call", "pickle", lc.nested_second_call, suffix=".pkl",
             offender="posix.system"),
        case("nested_obj_call", "pickle", lc.nested_obj_call, suffix=".pkl",
             offender="posix.system"),
        case("prepended_npz", "numpy", lc.prepended_npz, suffix=".npz"),
        case("npz_member_by_magic", "numpy", lc.npz_member_by_magic, suffix=".npz"),
        case("npy_descr_object", "numpy", lc.npy_object_spelling, "'object'", suffix=".npy"),
        case("npy_structured_object", "numpy", lc.npy_object_spelling, "[('a', 'O')]",
             suffix=".npy"),
        case("joblib_duplicate_key", "joblib", lc.joblib_duplicate_key, suffix=".joblib"),
        case("joblib_read_by_pickle", "pickle", lc.joblib_array_bytes_payload,
             suffix=".joblib"),
        case("bz_magic_pickle", "pickle", lc.bz_spelling_pickle, suffix=".pkl"),
    ]


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[lc.LoaderCase]]:
    built = _malicious(tmp_path_factory.mktemp("readings") / "bad")
    yield built
    assert not [c.name for c in built if c.sentinel.exists()], "a payload ran under the tests"


def test_each_payload_runs_under_its_plain_loader(tmp_path: Path) -> None:
    """One throwaway process runs every file with its plain loader: each sentinel appears."""
    live = _malicious(tmp_path / "live")
    jobs = [(c.loader, str(c.path)) for c in live]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, "-c", lc.LIVE_SCRIPT, json.dumps(jobs)], check=True,
                   capture_output=True, timeout=120, env=env, cwd=tmp_path)
    dead = [c.name for c in live if not c.sentinel.exists()]
    assert not dead, f"payloads that did not run under their plain loader: {dead}"


def test_each_reading_is_caught_and_located(cases: list[lc.LoaderCase]) -> None:
    wrong = []
    for case in cases:
        result = scan_file(case.path)
        if result.verdict != case.verdict:
            wrong.append(f"{case.name}: {result.verdict} ({result.reason})")
            continue
        if case.verdict == "unsafe":
            hits = [g for g in result.globals
                    if g.name == case.offender and g.category == DANGEROUS]
            if not hits or not hits[0].entry:
                wrong.append(f"{case.name}: {case.offender} not named dangerous: "
                             f"{[(g.name, g.category) for g in result.globals]}")
    assert not wrong, "\n".join(wrong)
    assert not [c.name for c in cases if c.sentinel.exists()]


def test_where_each_reading_is_reported(cases: list[lc.LoaderCase]) -> None:
    by = {c.name: scan_file(c.path) for c in cases}
    assert by["tar_pickle_member"].format == "torch-tar"
    assert {g.entry for g in by["tar_pickle_member"].globals} == {"tar:pickle"}
    upper = [g for g in by["upper_case_data_pkl"].globals if g.name == "os.system"]
    assert upper[0].entry.endswith("/DATA.PKL")
    poly = by["safetensors_polyglot"]
    assert poly.format == "safetensors" and "read as a pickle" in poly.globals[0].entry
    assert "straddles the end of a pickle FRAME" in by["frame_straddle_zip"].reason
    assert any(p.startswith("the zip end record") for p in by["prepended_npz"].problems)
    assert [g.entry for g in by["prepended_npz"].globals] == ["zipfile:evil.npy"]
    assert [g.entry for g in by["npz_member_by_magic"].globals] == ["evil"]
    escape = [g for g in by["loader_escape"].globals if g.category == DANGEROUS]
    assert any("passed on 1 time" in g.reason for g in escape)


def test_benign_files_of_the_same_shapes_raise_no_alarm(tmp_path: Path) -> None:
    tar = lc.tar_checkpoint(tmp_path / "old.tar.pt", lc.tar_object_pickle(), storage=True)
    assert torch.equal(torch.load(tar, weights_only=False)["w"], torch.tensor([1.0, 2, 3]))
    from safetensors.torch import save_file

    save_file({"w": torch.ones(3)}, str(tmp_path / "w.safetensors"))
    np.savez(tmp_path / "a.npz", a=np.arange(3), s=np.array(["x"]))
    structured = np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8"), ("t", "M8[ns]")])
    joblib.dump({"f16": np.ones(5, np.float16), "u": np.array(["abc", "de"]), "s": structured,
                 "c": np.ones(2, np.complex128), "b": np.ones(3, bool)}, tmp_path / "z.joblib")
    joblib.dump({"u": np.array(["abc"]), "i": np.arange(7)}, tmp_path / "z.gz.joblib",
                compress=("gzip", 3))
    torch.save({"w": torch.ones(2)}, tmp_path / "p4.pt", pickle_protocol=4)
    py2 = tmp_path / "py2.npy"  # a header as Python 2 numpy wrote it: (3L,)
    py2.write_bytes(lc._npy_bytes("'<i8'", struct.pack("<3q", 1, 2, 3), shape="(3L,)"))
    assert np.load(py2).tolist() == [1, 2, 3]
    verdicts = {Path(r.path).name: (r.verdict, r.problems) for r in scan(tmp_path).results}
    assert verdicts["old.tar.pt"] == ("safe", ()), verdicts
    assert verdicts["w.safetensors"] == ("safe", ())
    assert verdicts["a.npz"] == ("safe", ())
    assert verdicts["z.joblib"] == ("needs-allowlist", ()), verdicts["z.joblib"]
    assert verdicts["z.gz.joblib"] == ("needs-allowlist", ())
    assert verdicts["p4.pt"] == ("safe", ())
    assert verdicts["py2.npy"] == ("safe", ())


def test_joblib_unknown_dtype_code_is_malformed(tmp_path: Path) -> None:
    result = scan_file(lc.joblib_unknown_code(tmp_path / "bad.joblib"))
    assert result.verdict == "malformed" and "dtype 'Z8'" in result.reason


def test_decompression_errors_get_a_verdict_in_a_folder(tmp_path: Path) -> None:
    (tmp_path / "broken.pkl.gz").write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)) * 4)
    (tmp_path / "broken.joblib").write_bytes(b"\x78\x9c" + b"\xff" * 300)
    (tmp_path / "old.joblib").write_bytes(b"ZF0x2f   " + bytes(40))  # joblib < 0.9.3 zfile
    torch.save({"w": torch.ones(1)}, tmp_path / "good.pt")
    report = scan(tmp_path)
    verdicts = {Path(r.path).name: r.verdict for r in report.results}
    assert verdicts == {"broken.pkl.gz": "malformed", "broken.joblib": "malformed",
                        "old.joblib": "malformed", "good.pt": "safe"}
    assert "decompression failed" in next(
        r.reason for r in report.results if r.path.endswith(".gz"))


def test_deep_nesting_is_a_format_error_everywhere(tmp_path: Path) -> None:
    marks = tmp_path / "marks.pkl"
    marks.write_bytes(b"\x80\x02" + b"(" * 300_000 + b"l" * 300_000 + b".")
    folded = tmp_path / "folded.pkl"
    folded.write_bytes(b"\x80\x02" + b"]" * 300_000 + b"a" * 299_999 + b".")
    from torchverity.pickles import migrate

    for path in (marks, folded):
        result = scan_file(path)
        assert result.verdict == "malformed" and "nested" in result.reason, result.reason
        with pytest.raises(FormatError, match="nested"):
            check_limits(path)
        with pytest.raises(FormatError):
            migrate(path, tmp_path / f"{path.stem}.safetensors")


def test_check_limits_refuses_bombs_before_torch(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.pt"
    torch.save({"w": torch.ones(1)}, bomb)
    with zipfile.ZipFile(bomb, "a", zipfile.ZIP_DEFLATED) as z:
        z.writestr("bomb/data/9", bytes(64 << 20))  # 64 MiB of zeros in a few KiB
    assert bomb.stat().st_size < 1 << 20
    with pytest.raises(FormatError, match="decompression bomb"):
        check_limits(bomb)
    header = tmp_path / "huge.safetensors"
    with open(header, "wb") as fh:
        fh.write((20 << 20).to_bytes(8, "little") + b"{" + b" " * (20 << 20))
    with pytest.raises(FormatError, match="safetensors header"):
        check_limits(header)
    torch.save({"w": torch.ones(1)}, tmp_path / "ok.pt")
    check_limits(tmp_path / "ok.pt")


def test_nested_archives_are_judged_per_call(
    cases: list[lc.LoaderCase], tmp_path: Path
) -> None:
    """Each call has its own bytes scanned: the second call through the memo, an OBJ call;
    a call on bytes built at load time is dangerous; pickle.dumps(tensor) stays benign."""
    by = {c.name: scan_file(c.path) for c in cases}
    second = [g for g in by["nested_second_call"].globals if g.name == "posix.system"]
    assert len(second) == 1 and second[0].entry.endswith(">archive/data.pkl"), second
    loader = [g for g in by["nested_second_call"].globals if "_load_from_bytes" in g.name]
    assert {g.category for g in loader} == {BENIGN}  # both calls were scanned in place
    assert [g.name for g in by["nested_obj_call"].globals if g.category == DANGEROUS] == \
        ["posix.system"]
    made = tmp_path / "computed.pkl"  # bytes built at load time, not in the file
    made.write_bytes(b"\x80\x02ctorch.storage\n_load_from_bytes\ncbuiltins\nbytes\n(K\x01tR"
                     b"\x85R.")
    reasons = [g.reason for g in scan_file(made).globals if g.category == DANGEROUS]
    assert any("not literally in the file" in r for r in reasons)
    ok = tmp_path / "plain.pkl"
    import pickle

    ok.write_bytes(pickle.dumps({"a": torch.ones(3), "b": torch.zeros(2)}))
    plain = scan_file(ok)
    assert plain.verdict == "needs-allowlist"
    assert {g.category for g in plain.globals if "_load_from_bytes" in g.name} == {BENIGN}


def test_load_inspect_fingerprint_apply_the_limits_first(tmp_path: Path) -> None:
    """A torch zip whose data.pkl nests 20k lists, a zip bomb and a huge safetensors header:
    FormatError, not RecursionError, gigabytes inflated by torch or a 20 MB header parsed."""
    import torchverity
    from torchverity.checkpoint import fingerprint_file

    deep = tmp_path / "deep.pt"  # (300k levels are covered above; 20k are as deep for these)
    deep.write_bytes(lc._rewrite(lc._torch_bytes({"w": torch.ones(1)}), lambda n, d: (
        (n, b"\x80\x02" + b"]" * 20_000 + b"a" * 19_999 + b".") if n.endswith("data.pkl")
        else (n, d))))
    bomb = tmp_path / "bomb.pt"
    torch.save({"w": torch.ones(1)}, bomb)
    with zipfile.ZipFile(bomb, "a", zipfile.ZIP_DEFLATED) as z:
        z.writestr("bomb/data/9", bytes(64 << 20))
    header = tmp_path / "huge.safetensors"
    with open(header, "wb") as fh:
        fh.write((20 << 20).to_bytes(8, "little") + b"{" + b" " * (20 << 20))
    for path in (deep, bomb, header):
        with pytest.raises(FormatError, match="refused before loading"):
            torchverity.load(path, sidecar="ignore")
        with pytest.raises(FormatError, match="refused before loading"):
            fingerprint_file(path)
        result = torchverity.inspect(path)  # shows what it can, and why the rest is not read
        assert result.not_loaded and not result.tensors
        assert any(w in result.not_loaded for w in ("refused before loading", "deeper than"))


def test_damaged_files_get_a_verdict_never_an_internal_error(tmp_path: Path) -> None:
    """Byte flips, cuts and insertions in real files of every format: the scan and the
    preflight give a verdict or a typed error, never a raw exception."""
    import random

    import pickle_corpus
    from torchverity.errors import TorchVerityError

    sources = [c.path for c in pickle_corpus.benign(tmp_path / "good")]
    sources.append(lc.tar_checkpoint(tmp_path / "t.pt", lc.tar_object_pickle(), storage=True))
    rng = random.Random(20260501)
    target = tmp_path / "mutated.bin"
    for _ in range(300):
        data = bytearray(rng.choice(sources).read_bytes())
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(max(len(data), 1))
            kind = rng.random()
            if kind < 0.6 and data:
                data[pos] = rng.randrange(256)
            elif kind < 0.8:
                del data[pos : pos + rng.randint(1, 64)]
            else:
                data[pos:pos] = rng.randbytes(rng.randint(1, 16))
        target.write_bytes(bytes(data))
        assert scan_file(target).verdict
        with contextlib.suppress(TorchVerityError):
            check_limits(target)
