"""Static scan and weights_only planner, on a corpus built at test time.

Both directions: every malicious file is unsafe (or malformed) with the
offending global named and located, every ordinary checkpoint is safe or
needs-allowlist with exactly the globals torch asks for, and the advice is
applied to real ``torch.load(weights_only=True)`` calls. A sentinel file
proves that nothing ran.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pickle_corpus
from pickle_corpus import Case
from torchverity.pickles._ops import Limits
from torchverity.pickles._scan import BENIGN, DANGEROUS, UNKNOWN, scan, scan_file

# The default bounds: exhaustion cases must trip them, ordinary files stay far below.
LIMITS = Limits()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("corpus")
    sentinel = root / "SENTINEL"
    data = {
        "sentinel": sentinel,
        "malicious": pickle_corpus.malicious(root / "bad", sentinel),
        "benign": pickle_corpus.benign(root / "good"),
        "root": root,
    }
    yield data
    assert not sentinel.exists(), "a payload ran while the corpus was being tested"


def _ids(cases: list[Case]) -> list[str]:
    return [c.name for c in cases]


def test_every_malicious_file_is_caught_and_located(corpus: dict[str, Any]) -> None:
    cases: list[Case] = corpus["malicious"]
    assert len(cases) >= 45
    missed = []
    for case in cases:
        result = scan_file(case.path, limits=LIMITS)
        if result.verdict not in case.verdicts:
            missed.append(f"{case.name}: {result.verdict} ({result.reason})")
            continue
        if case.offender is None:
            continue
        hits = [g for g in result.globals if g.name == case.offender]
        if not hits:
            missed.append(f"{case.name}: {case.offender} not named in {result.names()}")
            continue
        # The exact class is pinned: relabelling a dangerous global as unknown fails here.
        hits = [g for g in hits if g.category == case.category]
        if not hits:
            missed.append(f"{case.name}: {case.offender} is not {case.category}")
            continue
        assert hits[0].offset >= 0 and hits[0].entry and hits[0].opcode
    assert not missed, "\n".join(missed)
    assert not corpus["sentinel"].exists()


def test_offender_location_is_exact(corpus: dict[str, Any]) -> None:
    by_name = {c.name: c for c in corpus["malicious"]}
    result = scan_file(by_name["memo_stack_global"].path)
    (hit,) = [g for g in result.globals if g.name == "os.system"]
    assert hit.opcode == "STACK_GLOBAL"
    raw = by_name["memo_stack_global"].path.read_bytes()
    assert raw[hit.offset] == 0x93  # the STACK_GLOBAL opcode itself
    zipped = scan_file(by_name["torch_zip_reduce"].path)
    (evil,) = [g for g in zipped.globals if g.name == "posix.system"]
    assert evil.entry == "evil/data.pkl" and evil.opcode == "GLOBAL"
    appended = scan_file(by_name["appended_pickle"].path)
    assert [g.stream for g in appended.globals if g.name == "os.system"] == [1]


def test_live_payloads_really_run_under_plain_loaders(tmp_path: Path) -> None:
    """The corpus is not a straw man: plain unpicklers do run these payloads."""
    sentinel = tmp_path / "LIVE"
    live = [c for c in pickle_corpus.malicious(tmp_path / "c", sentinel) if c.live is not None]
    assert len(live) >= 20
    for case in live:
        assert case.live is not None
        with contextlib.suppress(Exception):  # the broken stream raises after its payload ran
            case.live(case.path)
        assert sentinel.exists(), f"{case.name}: payload did not run under a plain loader"
        sentinel.unlink()
        assert scan_file(case.path, limits=LIMITS).verdict in case.verdicts
    assert not sentinel.exists()


def test_benign_files_have_no_false_alarms(corpus: dict[str, Any]) -> None:
    wrong = []
    for case in corpus["benign"]:
        result = scan_file(case.path, limits=LIMITS)
        if result.verdict not in case.verdicts or result.problems:
            wrong.append(f"{case.name}: {result.verdict} ({result.reason}) {result.problems}")
        # torch files: what torch.load will ask for; other formats: the benign globals.
        got = set(result.plan.needs) if result.plan is not None else set(result.names(BENIGN))
        if case.needs and got != set(case.needs):
            wrong.append(f"{case.name}: needs {sorted(got)} != {sorted(case.needs)}")
    assert not wrong, "\n".join(wrong)


def _run_plan(code: str, drop: int | None = None) -> Any:
    lines = code.splitlines()
    start = lines.index("with torch.serialization.safe_globals([")
    end = lines.index("]):")
    entries = list(range(start + 1, end))
    if drop is not None:
        del lines[entries[drop]]
    namespace: dict[str, Any] = {}
    exec("\n".join(lines), namespace)  # our own generated advice, on our own files
    return namespace["obj"]


def _case(corpus: dict[str, Any], name: str) -> Case:
    return next(c for c in corpus["benign"] if c.name == name)


@pytest.mark.parametrize(
    "name", ["numpy_extras.pt", "whole_model.pt", "numpy_1x_names.pt", "rng_states.pt",
             "type_hints.pt"]
)
def test_plan_is_exactly_what_torch_needs(corpus: dict[str, Any], name: str) -> None:
    path = _case(corpus, name).path
    plan = scan_file(path).plan
    assert plan is not None and plan.loadable and plan.needs
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(path, weights_only=True)
    loaded = _run_plan(plan.code)  # sufficient: loads in one go
    reference = torch.load(path, weights_only=False)  # our own benign file
    if isinstance(reference, dict):
        assert loaded.keys() == reference.keys()
    for i in range(len(plan.needs)):  # minimal: every entry is required
        with pytest.raises(Exception, match="Weights only load failed"):
            _run_plan(plan.code, drop=i)


def test_numpy_1x_names_use_the_tuple_form(corpus: dict[str, Any]) -> None:
    plan = scan_file(_case(corpus, "numpy_1x_names.pt").path).plan
    assert plan is not None
    assert '(_reconstruct, "numpy.core.multiarray._reconstruct")' in plan.code
    assert np.array_equal(_run_plan(plan.code)["arr"], np.arange(3))


def test_plan_flags_files_torch_cannot_read(tmp_path: Path) -> None:
    p4 = tmp_path / "p4.pt"
    torch.save({"w": torch.ones(2)}, p4, pickle_protocol=4)
    result = scan_file(p4)
    assert result.verdict == "safe" and result.plan is not None and not result.plan.loadable
    assert any("FRAME" in n for n in result.plan.notes)
    with pytest.raises(Exception, match="Unsupported operand"):
        torch.load(p4, weights_only=True)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    whole_opt = tmp_path / "opt.pt"
    torch.save(opt, whole_opt)
    plan = scan_file(whole_opt).plan
    assert plan is not None and not plan.loadable
    assert any("defaultdict" in n for n in plan.notes)


def test_user_class_is_unknown_not_dangerous(tmp_path: Path) -> None:
    path = pickle_corpus.user_class_checkpoint(tmp_path / "user.pt")
    result = scan_file(path)
    assert result.verdict == "needs-review" and "UserConfig" in result.reason
    user = [g for g in result.globals if g.name.endswith("UserConfig")]
    assert user and user[0].category == UNKNOWN
    assert not [g for g in result.globals if g.category == DANGEROUS]
    assert result.plan is not None and any(n.endswith("UserConfig") for n in result.plan.needs)


def test_scan_never_reads_tensor_data(tmp_path: Path) -> None:
    path = tmp_path / "big.pt"
    torch.save({"w": torch.zeros(4 << 20)}, path)  # 16 MiB of storage
    data = bytearray(path.read_bytes())
    start = data.find(b"big/data/0")
    data[start + 200 : start + 4000] = b"\xff" * 3800  # scramble storage bytes: never read
    path.write_bytes(bytes(data))
    assert scan_file(path).verdict == "safe"


def test_cli_json_and_exit_codes(
    corpus: dict[str, Any], run_cli: Callable[..., Any]
) -> None:
    good = _case(corpus, "state_dict.pt").path
    bad = next(c for c in corpus["malicious"] if c.name == "pkgutil_resolve_name").path
    ok = run_cli("scan", str(good))
    assert ok.code == 0 and ": safe (torch-zip)" in ok.out
    res = run_cli("scan", "--json", str(good), str(bad))
    assert res.code == 1
    doc = json.loads(res.out)
    assert doc["ok"] is False
    verdicts = {Path(f["path"]).name: f["verdict"] for f in doc["files"]}
    assert verdicts == {good.name: "safe", bad.name: "unsafe"}
    bad_doc = next(f for f in doc["files"] if f["verdict"] == "unsafe")
    first = bad_doc["globals"][0]
    assert first["name"] == "pkgutil.resolve_name" and first["offset"] == 0
    assert first["category"] == "dangerous" and "resolves" in first["reason"]
    needs = run_cli("scan", str(_case(corpus, "numpy_extras.pt").path))
    assert needs.code == 0 and "safe_globals([" in needs.out and "Namespace," in needs.out


def test_folder_scan_skips_companions(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "a.pt")
    (tmp_path / "a.pt.sha256").write_text("0" * 64 + "  a.pt\n")
    report = scan(tmp_path)
    assert [Path(r.path).name for r in report.results] == ["a.pt"] and report.ok


def test_load_and_inspect_never_run_payloads(corpus: dict[str, Any]) -> None:
    """torchverity.load (and inspect, when present) refuse malicious files without running them."""
    import torchverity

    sentinel = corpus["sentinel"]
    targets = [c for c in corpus["malicious"] if c.name in ("torch_zip_reduce", "torch_legacy")]
    for case in targets:
        with pytest.raises(Exception):  # noqa: B017 - any refusal is fine; running is not
            torchverity.load(case.path, sidecar="ignore")
        if importlib.util.find_spec("torchverity.inspect") is not None:
            with contextlib.suppress(Exception):
                torchverity.inspect(case.path)
    assert not sentinel.exists()


@pytest.mark.parametrize(
    ("limits", "data", "message"),
    [
        (Limits(max_ops=1000), b"\x80\x02]" + b"K\x01a" * 600 + b".", "more than 1000 opcodes"),
        (Limits(max_memo=10), b"\x80\x02]" + b"q\x00" * 5 + b"".join(
            b"r" + i.to_bytes(4, "little") for i in range(20)) + b".", "memo larger than 10"),
        (Limits(max_line=100), b"cos\n" + b"x" * 200 + b"\n.", "longer than 100 bytes"),
    ],
)
def test_explicit_bounds(tmp_path: Path, limits: Limits, data: bytes, message: str) -> None:
    path = tmp_path / "bounded.pkl"
    path.write_bytes(data)
    result = scan_file(path, limits=limits)
    assert result.verdict == "malformed" and message in result.reason


def test_inflate_bound(corpus: dict[str, Any]) -> None:
    bomb = next(c for c in corpus["malicious"] if c.name == "zip_bomb").path
    assert "compression ratio over" in scan_file(bomb).reason
    assert "more than 1048576 bytes" in scan_file(bomb, limits=Limits(max_inflate=1 << 20)).reason


def _allowlist_objects(names: tuple[str, ...]) -> list[Any]:
    """Resolve plan names of known libraries (our own test files) for safe_globals."""
    import importlib

    out: list[Any] = []
    for name in names:
        module, _, attr = name.rpartition(".")
        real = module.replace("numpy.core", "numpy._core", 1)
        obj = getattr(importlib.import_module(real), attr)
        # torch keys an entry by its __module__; a constant (Ellipsis) has none.
        out.append(obj if real == module and hasattr(obj, "__module__") else (obj, name))
    return out


def test_plan_agrees_with_torch_on_every_checkpoint(
    corpus: dict[str, Any], tmp_path: Path
) -> None:
    """loadable=True: the advice loads. loadable=False: torch refuses even with every need."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    extra = {
        "legacy_module.pt": (model, {"_use_new_zipfile_serialization": False}),
        "legacy_numpy.pt": ({"a": np.arange(2.0)}, {"_use_new_zipfile_serialization": False}),
        "protocol4.pt": ({"w": torch.ones(1)}, {"pickle_protocol": 4}),
        "whole_optimizer.pt": (opt, {}),
    }
    paths = [c.path for c in corpus["benign"] if c.path.suffix in (".pt", ".ckpt")]
    for name, (obj, kwargs) in extra.items():
        torch.save(obj, tmp_path / name, **kwargs)
        paths.append(tmp_path / name)
    outcomes = {}
    for path in paths:
        plan = scan_file(path).plan
        assert plan is not None, path
        try:
            with torch.serialization.safe_globals(_allowlist_objects(plan.needs)):
                torch.load(path, weights_only=True)
            loaded = True
        except Exception:
            loaded = False
        outcomes[path.name] = (plan.loadable, loaded)
    assert all(p == t for p, t in outcomes.values()), outcomes
    assert not outcomes["legacy_module.pt"][0] and not outcomes["protocol4.pt"][0]
    assert outcomes["legacy_numpy.pt"] == (True, True)
