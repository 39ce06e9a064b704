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
    assert lfs is not None and lfs.key == "git-lfs-pointer"
    other = explain_exception(_raised(lambda: pickle.loads(b"\x01garbage")))
    assert other is not None and other.key == "not-a-pickle"


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
    assert run_cli("explain", "all good").out.startswith("no save/load error")


_LFS = ("version https://git-lfs.github.com/spec/v1\noid sha256:"
        + "ab" * 32 + "\nsize 12345\n")


@pytest.mark.parametrize(
    ("content", "key"),
    [(_LFS, "git-lfs-pointer"), ("<!DOCTYPE html><html><body>404</body></html>", "html-page")],
)
def test_broken_downloads_under_torch_weights_only(tmp_path: Path, content: str, key: str) -> None:
    """torch >= 2.6 reports these as 'Unsupported operand 118' / '60': not protocol 4."""
    path = tmp_path / "pytorch_model.bin"
    path.write_text(content)
    exc = _raised(lambda: torch.load(path))
    assert "Unsupported operand" in str(exc)
    found = explain_text(f"{type(exc).__name__}: {exc}")
    assert [e.key for e in found] == [key]
    assert found[0].command == "torchverity scan FILE"


def test_torchscript_under_weights_only(tmp_path: Path) -> None:
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)
    exc = _raised(lambda: torch.load(path, weights_only=True))
    found = explain_exception(exc)
    assert found is not None and found.key == "torchscript-weights-only"
    assert found.command.startswith("torchverity migrate")


def test_one_block_per_cause_not_per_tensor(run_cli: Callable[..., object]) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(19)])
    state = {k: torch.zeros(5, *v.shape[1:]) for k, v in model.state_dict().items()}
    del state["18.bias"]  # 37 tensors of another shape, one missing
    exc = _raised(lambda: model.load_state_dict(state))
    assert str(exc).count("size mismatch") == 37
    found = explain_text(str(exc))
    assert [e.key for e in found] == ["missing-unexpected-keys", "size-mismatch"]
    mismatch = found[1]
    assert mismatch.count == 37 and "and 32 more" in mismatch.cause
    res = run_cli("explain", f"RuntimeError: {exc}")
    assert res.code == 0 and len(res.out.splitlines()) == 8, res.out


def test_transformers_load_report_and_ansi(run_cli: Callable[..., object]) -> None:
    report = (
        "[transformers] \x1b[1mBertModel LOAD REPORT\x1b[0m from: ./bert\n"
        "Key                               | Status     | \n"
        "----------------------------------+------------+---------------------------\n"
        "extra.weight                      | UNEXPECTED | \n"
        "pooler.dense.bias                 | MISSING    | \n"
        "embeddings.word_embeddings.weight | MISMATCH   | Reinit due to size mismatch - ckpt: "
        "torch.Size([20, 8]) vs model:torch.Size([16, 8])\n"
        "RuntimeError: You set `ignore_mismatched_sizes` to `False`, thus raising an error. "
        "For details look at the above report!\n"
    )
    found = explain_text(report)
    assert [e.key for e in found] == ["transformers-unexpected", "transformers-missing",
                                      "transformers-mismatch"]
    assert "extra.weight" in found[0].cause and "\x1b" not in found[2].evidence
    assert run_cli("explain", report).code == 0


def test_unexplained_errors_exit_1(run_cli: Callable[..., object]) -> None:
    text = "Unsupported operand 149\n\x1b[31mValueError: something nobody has seen\x1b[0m\n"
    res = run_cli("explain", text)
    assert res.code == 1 and "[unexplained] ValueError: something nobody has seen" in res.out
    assert "[unsupported-opcode]" in res.out


def _error_text(fn: Callable[[], object]) -> str:
    """What a user pastes: the last lines of the traceback, exactly as Python prints them."""
    import traceback

    exc = _raised(fn)
    return "".join(traceback.format_exception_only(type(exc), exc))


def test_torch_full_weights_only_messages_are_one_explained_report(
        tmp_path: Path, run_cli: Callable[..., object]) -> None:
    """torch quotes its unpickler's message on a line of its own ("WeightsUnpickler error:"):
    the report's header line is not a second, unexplained error."""
    omegaconf = pytest.importorskip("omegaconf")
    cfg = tmp_path / "cfg.pt"
    torch.save({"w": torch.ones(2), "cfg": omegaconf.OmegaConf.create({"lr": 0.1})}, cfg)
    pointer = tmp_path / "pytorch_model.bin"
    pointer.write_text(_LFS)
    for path, key in ((cfg, "unsupported-global"), (pointer, "git-lfs-pointer")):
        text = _error_text(lambda p=path: torch.load(p, weights_only=True))
        assert "WeightsUnpickler error:" in text
        res = run_cli("explain", text)
        assert res.code == 0 and f"[{key}]" in res.out, res.out
        assert "[unexplained]" not in res.out and "not recognised" not in res.err
        doc = json.loads(run_cli("explain", "--json", text).out)
        assert doc["recognised"] == 1 and not doc.get("unexplained")


def test_real_messages_of_broken_files_name_their_cause(
        tmp_path: Path, run_cli: Callable[..., object]) -> None:
    from safetensors.torch import load_file

    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    lfs = tmp_path / "model.safetensors"
    lfs.write_text(_LFS)
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x00" * 4)
    plain = tmp_path / "state.pt"
    torch.save({"w": torch.ones(2)}, plain)
    onnx_file = tmp_path / "m.onnx"
    torch.onnx.export(torch.nn.Linear(3, 2), (torch.ones(1, 3),), str(onnx_file), dynamo=False)
    cases = [
        (lambda: torch.load(empty, weights_only=True), "truncated-zip"),
        (lambda: load_file(lfs), "safetensors-not-safetensors"),
        (lambda: load_file(short), "truncated-zip"),
        (lambda: torch.jit.load(plain), "not-torchscript"),
        (lambda: torch.load(onnx_file, weights_only=True), "onnx-model"),
    ]
    for fn, key in cases:
        text = _error_text(fn)
        assert [e.key for e in explain_text(text)] == [key], text
        res = run_cli("explain", text)
        assert res.code == 0 and "[unexplained]" not in res.out, (text, res.out)
