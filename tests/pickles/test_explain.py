"""Load-error explanations, fed with the real messages torch and pickle raise."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from torchverity.pickles._explain import explain, explain_exception, explain_text, with_file


class _Custom:
    def __init__(self) -> None:
        self.w = torch.ones(2)


def _raised(fn: Callable[[], object]) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def test_weights_only_global_names_the_global(tmp_path: Path) -> None:
    path = tmp_path / "obj.pt"
    torch.save({"cfg": _Custom()}, path)
    exc = _raised(lambda: torch.load(path, weights_only=True))
    found = explain_exception(exc)
    assert found is not None and found.key == "unsupported-global"
    assert "test_explain._Custom" in found.cause
    assert found.command == "torchverity scan FILE"
    assert with_file(found, str(path)).command == f"torchverity scan {path}"


def test_protocol_4_pickle_is_unsupported_operand_149(tmp_path: Path) -> None:
    path = tmp_path / "p4.pt"
    torch.save({"w": torch.ones(2)}, path, pickle_protocol=4)
    exc = _raised(lambda: torch.load(path, weights_only=True))
    found = explain_exception(exc)
    assert found is not None and found.key == "unsupported-opcode"
    assert "torchverity migrate" in found.command


def test_structures_weights_only_cannot_rebuild(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    legacy = tmp_path / "legacy.pt"
    torch.save(model, legacy, _use_new_zipfile_serialization=False)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    whole_opt = tmp_path / "opt.pt"
    torch.save(opt, whole_opt)
    allow = [torch.nn.Linear, torch.optim.Adam, __import__("collections").defaultdict, dict]
    for path in (legacy, whole_opt):
        with torch.serialization.safe_globals(allow):
            exc = _raised(lambda p=path: torch.load(p, weights_only=True))
        found = explain_exception(exc)
        assert found is not None and found.key == "weights-only-structure", exc
        assert found.command.startswith("torchverity migrate")


def test_truncated_zip(tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    torch.save({"w": torch.ones(100)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    found = explain_exception(_raised(lambda: torch.load(path, weights_only=True)))
    assert found is not None and found.key == "truncated-zip"
    assert found.command == "torchverity verify FILE"


def test_size_mismatch_and_missing_keys_from_load_state_dict() -> None:
    model = torch.nn.Linear(4, 5)
    state = {"weight": torch.zeros(10, 4), "extra": torch.zeros(1)}
    exc = _raised(lambda: model.load_state_dict(state))
    keys = [e.key for e in explain(exc)] + [e.key for e in explain_text(str(exc))]
    assert "size-mismatch" in keys and "missing-unexpected-keys" in keys
    mismatch = next(e for e in explain_text(str(exc)) if e.key == "size-mismatch")
    assert "weight is torch.Size([10, 4]) in the file, torch.Size([5, 4]) in the model" in (
        mismatch.cause
    )


def test_cant_get_attribute_and_lfs_pointer() -> None:
    found = explain_text("AttributeError: Can't get attribute 'Net' on <module '__main__'>")
    assert [e.key for e in found] == ["cant-get-attribute"]
    assert "(Net, __main__)" in found[0].cause
    lfs = explain_exception(_raised(lambda: pickle.loads(b"version https://git-lfs")))
    assert lfs is not None and lfs.key == "not-a-pickle"


@pytest.mark.parametrize(
    ("message", "key"),
    [
        ("RuntimeError: Attempting to deserialize object on a CUDA device but "
         "torch.cuda.is_available() is False.", "cuda-on-cpu"),
        ("RuntimeError: Expected all tensors to be on the same device, but found at least "
         "two devices, cuda:0 and cpu!", "different-devices"),
        ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "cuda-hardware"),
        ("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.", "cuda-hardware"),
        ("zipfile.BadZipFile: Bad CRC-32 for file 'archive/data/0'", "zip-crc"),
        ("RuntimeError: PytorchStreamReader failed reading zip archive: failed finding "
         "central directory", "truncated-zip"),
    ],
)
def test_table_recognises(message: str, key: str) -> None:
    assert key in [e.key for e in explain_text(message)]


def test_unrelated_text_has_no_explanation() -> None:
    assert explain_text("epoch 3 loss 0.1234 lr 3e-4\nsaved checkpoint ok") == []
    assert explain_exception(ValueError("bad value")) is None


def test_cli_log_and_json(tmp_path: Path, run_cli: Callable[..., object]) -> None:
    log = tmp_path / "train.log"
    log.write_text(
        "step 1 ok\nRuntimeError: CUDA error: an illegal memory access was encountered\n"
        "_pickle.UnpicklingError: Unsupported operand 149\n"
    )
    res = run_cli("explain", "--log", str(log))
    assert res.code == 0
    assert "[cuda-hardware]" in res.out and "check: torchverity selftest" in res.out
    res = run_cli("explain", "--json", "Unsupported operand 149")
    doc = json.loads(res.out)
    assert doc["recognised"] == 1 and doc["explanations"][0]["key"] == "unsupported-opcode"
    assert run_cli("explain", "all good").out.startswith("no known")
