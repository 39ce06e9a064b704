"""check_limits' fast walk of torch-written pickles: the scan's bounds, the scan's verdicts."""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from torchverity.errors import FormatError
from torchverity.pickles import _containers as containers_module
from torchverity.pickles import _limits as limits_module
from torchverity.pickles import check_limits
from torchverity.pickles._bounds import Unsure, walk_bounds
from torchverity.pickles._ops import walk_stream
from torchverity.pickles._source import ByteSource, Limits, PickleError


def _memo_bomb(levels: int, fan: int = 10) -> bytes:
    """Each list holds ``fan`` references to the one before: fan**levels items expanded."""
    out = b"\x80\x02]r\x00\x00\x00\x000"
    for k in range(1, levels + 1):
        out += b"](" + b"j" + (k - 1).to_bytes(4, "little")
        out += (b"j" + (k - 1).to_bytes(4, "little")) * (fan - 1)
        out += b"er" + k.to_bytes(4, "little") + b"0"
    return out + b"j" + levels.to_bytes(4, "little") + b"."


BOUNDED = {
    "folded lists": b"\x80\x02" + b"]" * 600 + b"a" * 599 + b".",
    "nested MARKs": b"\x80\x02" + b"(" * 600 + b"l" * 600 + b".",
    "tuples in tuples": b"\x80\x02" + b"K\x01" + b"\x85" * 600 + b".",
    "memo expansion": _memo_bomb(9),
    "BUILD state": b"\x80\x02cmod\nC\n)R" + b"]" * 600 + b"a" * 599 + b"b.",
}
TIGHT = Limits(max_ops=400, max_memo=4, max_stack=50, max_depth=6, max_expansion=300)


def _full_walk_error(data: bytes, limits: Limits) -> str | None:
    report = walk_stream(ByteSource(io.BytesIO(data), len(data)), limits)
    return report.error if report.error_limit else None


def _fast_walk_error(data: bytes, limits: Limits) -> str | None:
    try:
        walk_bounds(data, limits)
    except PickleError as exc:
        assert exc.limit
        return str(exc)
    return None


def _corpus() -> list[bytes]:
    """Pickles as torch.save writes them (state dicts, optimizer state, nested values)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    shared = torch.arange(12.0)
    objects = [
        model.state_dict(),
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3,
         "lr": [0.1, 0.01], "flags": (True, False, None), "name": "run"},
        {"a": shared, "b": shared[2:], "c": shared.view(3, 4).t()},
        OrderedDict((f"t{i}", torch.ones(i + 1, dtype=torch.bfloat16)) for i in range(300)),
        [{"x": torch.zeros(2)}, [torch.ones(1), {"deep": {"deeper": torch.ones(3)}}]],
    ]
    return [_data_pkl(_torch_bytes(obj)) for obj in objects]


def _torch_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _data_pkl(archive: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def _with_data_pkl(path: Path, data: bytes) -> Path:
    """A torch checkpoint whose data.pkl is replaced (every record stored, as torch writes)."""
    original = _torch_bytes({"w": torch.ones(2)})
    with zipfile.ZipFile(io.BytesIO(original)) as src, \
            zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for info in src.infolist():
            out.writestr(info.filename, data if info.filename.endswith("/data.pkl")
                         else src.read(info))
    return path


@pytest.mark.parametrize("data", _corpus(), ids=["state_dict", "nested", "views", "many",
                                                 "lists"])
def test_torch_pickles_take_the_fast_walk_and_agree(data: bytes) -> None:
    walk_bounds(data, Limits())  # no Unsure: what torch.save writes is all modelled
    for limits in (Limits(), TIGHT, Limits(max_depth=3), Limits(max_expansion=40)):
        assert _fast_walk_error(data, limits) == _full_walk_error(data, limits)


@pytest.mark.parametrize("name", BOUNDED)
def test_every_bound_gives_the_full_walks_message(name: str) -> None:
    data = BOUNDED[name]
    expected = _full_walk_error(data, Limits())
    assert expected is not None
    assert _fast_walk_error(data, Limits()) == expected
    assert _fast_walk_error(data, TIGHT) == _full_walk_error(data, TIGHT)


@pytest.mark.parametrize("name", BOUNDED)
def test_check_limits_refuses_a_torch_zip_as_the_full_scan_does(
        tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _with_data_pkl(tmp_path / "bad.pt", BOUNDED[name])
    with pytest.raises(FormatError, match="refused before loading") as fast:
        check_limits(path)
    monkeypatch.setattr(limits_module, "_torch_zip_within_bounds", lambda *a: False)
    with pytest.raises(FormatError, match="refused before loading") as full:
        check_limits(path)
    assert fast.value.message == full.value.message
    assert "archive/data.pkl:" in fast.value.message


def test_what_the_fast_walk_does_not_model_goes_to_the_full_scan(tmp_path: Path) -> None:
    state = {"w": torch.ones(3)}
    for data in (
        pickle.dumps(state, protocol=4),  # FRAME, protocol 4 opcodes
        b"\x80\x02B" + (1 << 17).to_bytes(4, "little") + bytes(1 << 17) + b".",  # a blob
        _data_pkl(_torch_bytes(state)) + b"N.",  # bytes after the STOP
        b"\x80\x02a.",  # APPEND on an empty stack: the loader fails there
        b"\x80\x02\x8a",  # truncated
    ):
        with pytest.raises(Unsure):
            walk_bounds(data, Limits())
    deep = b"\x80\x04" + b"]" * 600 + b"a" * 599 + b"."  # protocol 4: full scan, same bound
    with pytest.raises(FormatError, match="nested deeper than 500"):
        check_limits(_with_data_pkl(tmp_path / "p4.pt", deep))


def test_real_checkpoints_pass_without_the_full_scan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ok.pt"
    torch.save({f"layer.{i}.weight": torch.randn(4) for i in range(2000)}, path)

    def no_full_scan(*args: object) -> None:
        raise AssertionError("the full scan ran")

    monkeypatch.setattr(containers_module, "scan_fh", no_full_scan)
    check_limits(path)
    assert torch.load(path, weights_only=True)["layer.7.weight"].shape == (4,)
