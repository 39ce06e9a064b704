"""Load-error explanations, fed with the real messages torch and pickle raise."""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import pickle
import re
import shlex
import shutil
import subprocess
import sys
import traceback
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr
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
        # transformers 4.x, when the weights file starts with "version" (its source's text)
        ("OSError: You seem to have cloned a repository without having git-lfs installed. "
         "Please install git-lfs and run `git lfs install` followed by `git lfs pull` in the "
         "folder you cloned.", "git-lfs-pointer"),
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
    exc = _raised(fn)
    return "".join(traceback.format_exception_only(type(exc), exc))


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_save_onto_a_full_disk_is_named(run_cli: Callable[..., object]) -> None:
    """/dev/full fails every write with ENOSPC, as a full disk does."""
    text = _error_text(lambda: torch.save({"w": torch.ones(1000)}, "/dev/full"))
    assert [e.key for e in explain_text(text)] == ["save-write-failed"], text
    res = run_cli("explain", text)
    assert res.code == 0 and "disk or quota is full" in res.out, res.out


def _transformers_4_load_state_dict(checkpoint_file: Path) -> object:
    """What transformers 4.x's modeling_utils.load_state_dict does when torch.load fails
    (the control flow and messages of its released source)."""
    try:
        return torch.load(checkpoint_file)
    except Exception as e:
        try:
            with open(checkpoint_file) as f:
                if f.read(7) == "version":
                    raise OSError(
                        "You seem to have cloned a repository without having git-lfs "
                        "installed. Please install git-lfs and run `git lfs install` followed "
                        "by `git lfs pull` in the folder you cloned.") from None
                raise ValueError(
                    f"Unable to locate the file {checkpoint_file} which is necessary to load "
                    "this pretrained model. Make sure you have saved the model properly."
                ) from e
        except (UnicodeDecodeError, ValueError):
            raise OSError(  # noqa: B904 (as transformers raises it)
                f"Unable to load weights from pytorch checkpoint file for '{checkpoint_file}' "
                f"at '{checkpoint_file}'. If you tried to load a PyTorch model from a TF 2.0 "
                "checkpoint, please set from_tf=True.")


def test_transformers_4_hides_torchs_error_behind_its_own(
        tmp_path: Path, run_cli: Callable[..., object]) -> None:
    """The whole traceback a user pastes holds torch's error, transformers' probe of the file
    and its own OSError: torch's cause is named, and transformers' lines with it."""
    page = tmp_path / "page" / "pytorch_model.bin"
    page.parent.mkdir()
    page.write_text("<!DOCTYPE html><html><body>404</body></html>")
    cut = tmp_path / "cut" / "pytorch_model.bin"
    cut.parent.mkdir()
    torch.save({"w": torch.ones(1000)}, cut)
    cut.write_bytes(cut.read_bytes()[:-200])
    for path, cause in ((page, "html-page"), (cut, "truncated-zip")):
        exc = _raised(lambda p=path: _transformers_4_load_state_dict(p))
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        assert "During handling of the above exception" in text and "OSError: Unable" in text
        found = explain_text(text)
        assert [e.key for e in found] == [cause, "transformers-unreadable-weights"], text
        assert str(path) in found[1].cause
        res = run_cli("explain", text)
        assert res.code == 0 and "[unexplained]" not in res.out, res.out
    exc = _raised(lambda: torch.load(cut))  # the same file, torch's traceback alone
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    assert "OSError: [Errno 22] Invalid argument" in text
    found = explain_text(text)
    assert [(e.key, e.evidence) for e in found] == [
        ("truncated-zip", "OSError: [Errno 22] Invalid argument")], text
    stray = "UnicodeDecodeError: 'utf-8' codec can't decode byte 0x80 in position 0"
    assert explain_text(stray) == []  # on its own it is no transformers probe


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
    pickled = tmp_path / "state.pkl"
    pickled.write_bytes(pickle.dumps({"step": 3, "lr": [0.1, 0.01]}, protocol=2))
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(legacy.read_bytes()[:4] + b"\xff" + legacy.read_bytes()[5:])
    record = tmp_path / "record.pt"
    torch.save({"w": torch.ones(1000)}, record)
    header = next(i.header_offset for i in zipfile.ZipFile(record).infolist()
                  if i.filename.endswith("data/0"))
    damaged_record = bytearray(record.read_bytes())
    damaged_record[header] ^= 0xFF  # the record's local header signature
    record.write_bytes(bytes(damaged_record))
    cases = [
        (lambda: torch.load(record), "damaged-zip-record"),
        (lambda: torch.load(pickled, weights_only=False), "not-torch-save"),
        (lambda: torch.load(damaged, weights_only=True), "not-torch-save"),
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


@contextmanager
def _transformers_log() -> Iterator[io.StringIO]:
    """What transformers logs meanwhile (its LOAD REPORT is a warning), whatever verbosity
    other tests left it at."""
    from transformers.utils import logging as hf_logging

    text = io.StringIO()
    handler = logging.StreamHandler(text)
    logger = hf_logging.get_logger("transformers")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    logger.addHandler(handler)
    try:
        yield text
    finally:
        logger.removeHandler(handler)
        hf_logging.set_verbosity(verbosity)


def _from_pretrained_text(folder: Path, model: str = "BertModel", **kwargs: object) -> str:
    """The log of ``BertModel.from_pretrained(folder)`` (or of another ``model`` class) and
    the error it raises, if any."""
    import transformers

    with _transformers_log() as log:
        try:
            getattr(transformers, model).from_pretrained(folder, **kwargs)
        except RuntimeError as exc:
            return log.getvalue() + "".join(traceback.format_exception_only(type(exc), exc))
    return log.getvalue()


def _saved_bert(folder: Path) -> Path:
    from torch_zip_artifacts import bert

    bert().save_pretrained(folder)
    return folder


def test_transformers_report_of_merged_rows_only(
        tmp_path: Path, run_cli: Callable[..., object]) -> None:
    """transformers 5 merges the rows of keys that differ in their layer index only
    ('encoder.layer.{0, 1}.output.dense.weight'): a report of such rows is one block that
    names each row and counts the tensors they stand for."""
    from safetensors.torch import load_file, save_file

    folder = _saved_bert(tmp_path / "bert")
    weights = folder / "model.safetensors"
    state = load_file(weights)
    dropped = [k for k in state if ".output.dense." in k]
    save_file({k: v for k, v in state.items() if k not in dropped}, weights)
    text = _from_pretrained_text(folder)
    rows = [line.split("|")[0].strip() for line in text.splitlines() if "| MISSING" in line]
    assert rows and all("{0, 1}" in row for row in rows), text
    found = explain_text(text)
    assert [e.key for e in found] == ["transformers-missing"]
    assert found[0].count == len(dropped) == 8 and found[0].tally == "8 tensors"
    assert all(row in found[0].cause for row in rows)
    res = run_cli("explain", text)
    assert res.code == 0 and res.out.startswith("[transformers-missing] encoder.layer.{0, 1}.")
    blocks = [line for line in res.out.splitlines() if line.startswith("[")]
    assert len(blocks) == 1 and blocks[0].endswith("(8 tensors)"), res.out


def test_transformers_size_mismatch_counts_every_row(
        tmp_path: Path, run_cli: Callable[..., object]) -> None:
    """from_pretrained into a wider model: one block counting every mismatched tensor, the
    merged per-layer rows included, and not the 'You set ignore_mismatched_sizes' line."""
    from safetensors.torch import load_file
    from transformers import BertConfig, BertModel

    folder = _saved_bert(tmp_path / "bert")
    config = BertConfig.from_pretrained(folder)
    config.hidden_size = 64
    text = _from_pretrained_text(folder, config=config)
    assert "ignore_mismatched_sizes" in text and "\x1b[" in text, text
    saved = load_file(folder / "model.safetensors")
    wider = BertModel(config).state_dict()
    differing = sum(1 for k, v in saved.items() if k in wider and wider[k].shape != v.shape)
    rows = [line for line in text.splitlines() if "| MISMATCH" in line]
    assert differing > len(rows) > 0
    found = explain_text(text)
    assert [e.key for e in found] == ["transformers-mismatch"]
    mismatch = found[0]
    assert mismatch.count == differing and f"and {len(rows) - 5} more" in mismatch.cause
    assert "\x1b" not in mismatch.evidence + mismatch.cause
    assert " is torch.Size([" in mismatch.cause and "in the model" in mismatch.cause
    res = run_cli("explain", text)
    assert res.code == 0 and "[unexplained]" not in res.out, res.out
    assert res.out.splitlines()[0].endswith(f"({differing} tensors)"), res.out


def test_load_state_dict_names_missing_and_unexpected_keys(
        run_cli: Callable[..., object]) -> None:
    """A DataParallel 'module.' prefix: every key missing and every key unexpected, in one
    block that names the first keys of each kind and counts each kind."""
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(4)])
    state = {f"module.{k}": v for k, v in model.state_dict().items()}
    text = _error_text(lambda: model.load_state_dict(state))
    found = explain_text(text)
    assert [e.key for e in found] == ["missing-unexpected-keys"]
    keys = found[0]
    assert keys.count == 16 and keys.tally == "16 keys: 8 missing, 8 unexpected"
    assert "(missing: 0.weight, 0.bias, 1.weight, 1.bias, 2.weight and 3 more; " in keys.cause
    assert "unexpected: module.0.weight, module.0.bias, " in keys.cause
    res = run_cli("explain", text)
    assert res.code == 0 and len(res.out.splitlines()) == 4, res.out
    assert "(16 keys: 8 missing, 8 unexpected)" in res.out.splitlines()[0]


def test_size_mismatch_check_lists_every_tensor_of_the_file(
        tmp_path: Path, run_cli: Callable[..., object]) -> None:
    """The fix says to compare every differing tensor: its check lists them all, past
    inspect's default limit of 50."""
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(30)])
    path = tmp_path / "wide.pt"
    torch.save({k: torch.zeros(5, *v.shape[1:]) for k, v in model.state_dict().items()}, path)
    text = _error_text(lambda: model.load_state_dict(torch.load(path)))
    [mismatch] = explain_text(text)
    assert mismatch.key == "size-mismatch" and mismatch.count == 60
    assert "compare the shapes the check lists" in mismatch.fix
    command = shlex.split(with_file(mismatch, str(path)).command)
    assert command[:2] == ["torchverity", "inspect"]
    res = run_cli(*command[1:])
    assert res.code == 0
    assert all(f"{k} " in res.out for k in model.state_dict()), res.out


def test_unexplained_hint_fits_the_error(tmp_path: Path, run_cli: Callable[..., object]) -> None:
    """A KeyError after loading points at the file's content; only an error naming the GPU
    stack points at the environment (doctor)."""
    path = tmp_path / "state.pt"
    torch.save({"w": torch.ones(2)}, path)
    key_error = _error_text(lambda: torch.load(path)["model_state_dict"])
    res = run_cli("explain", key_error)
    assert res.code == 1 and "[unexplained] KeyError: 'model_state_dict'" in res.out
    assert "torchverity inspect FILE" in res.err and "doctor" not in res.err, res.err
    gpu_error = _error_text(lambda: torch.zeros(1, device="cuda:99"))
    res = run_cli("explain", gpu_error)
    assert res.code == 1 and "torchverity doctor" in res.err, (gpu_error, res.err)
    assert "inspect" not in res.err


def _from_pretrained_traceback(folder: Path) -> str:
    """The whole traceback ``BertModel.from_pretrained(folder)`` prints, as a user pastes it."""
    from transformers import BertModel

    exc = _raised(lambda: BertModel.from_pretrained(folder))
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def test_broken_model_folders_are_named_from_transformers_own_tracebacks(
        tmp_path: Path, run_cli: Callable[..., object]) -> None:
    """The folders a download or copy leaves broken, loaded with transformers: each
    traceback is explained, none exits 1, and the check names the folder."""
    from torch_zip_artifacts import bert

    pytest.importorskip("transformers")
    model = bert()
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="40KB")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(single, no_weights)
    (no_weights / "model.safetensors").unlink()
    missing = tmp_path / "missing_shard"
    shutil.copytree(sharded, missing)
    shard = sorted(json.loads((missing / "model.safetensors.index.json").read_text())
                   ["weight_map"].values())[-1]
    (missing / shard).unlink()
    cut = tmp_path / "cut"
    shutil.copytree(single, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    bad_config = tmp_path / "bad_config"
    shutil.copytree(single, bad_config)
    (bad_config / "config.json").write_text('{"model_type": "bert", ')
    cases = [(no_weights, "hf-no-weights", f"torchverity inspect {no_weights}"),
             (missing, "missing-shard", f"torchverity verify {missing}"),
             (cut, "truncated-zip", "torchverity verify FILE"),
             (bad_config, "config-not-json", f"torchverity verify {bad_config}")]
    for folder, key, command in cases:
        text = _from_pretrained_traceback(folder)
        found = explain_text(text)
        assert [(e.key, e.command) for e in found] == [(key, command)], text
        res = run_cli("explain", text)
        assert res.code == 0 and "[unexplained]" not in res.out, res.out
    assert str(shard) in explain_text(_from_pretrained_traceback(missing))[0].cause


def test_a_checkpoint_path_that_does_not_exist_is_named_with_its_folder(
        tmp_path: Path, run_cli: Callable[..., object]) -> None:
    """A real Lightning resume from a path with no file, and torch.load of one."""
    import lightning as L

    from torch_zip_artifacts import lightning_net

    gone = tmp_path / "runs" / "epoch=3-step=400.ckpt"
    gone.parent.mkdir()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)),
                                       batch_size=2)
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), accelerator="cpu", devices=1)
    exc = _raised(lambda: trainer.fit(lightning_net({"lr": 0.1}), data, ckpt_path=gone))
    lightning_text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    for text in (lightning_text, _error_text(lambda: torch.load(gone))):
        found = explain_text(text)
        assert [(e.key, e.command) for e in found] == [
            ("checkpoint-not-found", f"torchverity verify {gone.parent}")], text
        assert str(gone) in found[0].cause
        res = run_cli("explain", text)
        assert res.code == 0 and "[unexplained]" not in res.out, res.out


def test_an_operand_that_is_no_newer_pickle_opcode_is_not_called_a_protocol(
        tmp_path: Path, run_cli: Callable[..., object]) -> None:
    """torch names the first byte its unpickler does not know an 'operand': only the opcodes
    protocols 3 to 5 added mean a newer protocol (and migrate converts such a file); any other
    byte means the file is no pickle torch reads, and inspect says what it is."""
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x00\x01garbage" * 10)
    text = _error_text(lambda: torch.load(junk))
    assert "Unsupported operand 0" in text
    [found] = explain_text(text)
    assert found.key == "not-a-pickle-opcode" and "protocol" not in found.cause
    assert "byte 0x00" in found.cause and found.command == "torchverity inspect FILE"
    check = run_cli(*shlex.split(with_file(found, str(junk)).command)[1:])
    assert check.code == 2 and "not a checkpoint" in check.err, check.err
    newer = {3: tmp_path / "p3.pt", 5: tmp_path / "p5.pt"}
    for protocol, path in newer.items():
        torch.save({"w": torch.ones(2), "tag": b"run-7"}, path, pickle_protocol=protocol)
    opcodes = {3: "operand 67 is SHORT_BINBYTES, of protocol 3",
               5: "operand 149 is FRAME, of protocol 4"}
    for protocol, path in newer.items():
        with pytest.warns(UserWarning, match=f"pickle protocol {protocol}"):
            [found] = explain_text(_error_text(lambda p=path: torch.load(p)))
        assert found.key == "unsupported-opcode", found
        assert f"pickled with protocol 3 or later ({opcodes[protocol]})," in found.cause
        converted = run_cli(*shlex.split(with_file(found, str(path)).command)[1:])
        assert converted.code == 0, converted.err


# A training script whose log holds metrics named like errors, as Lightning's progress bar
# and metric table, a Hugging Face-style metrics dict and print() write them.
_TRAIN_SCRIPT = """
import sys
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, _i):
        loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("train_error", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, _i):
        error = torch.nn.functional.l1_loss(self.layer(batch[0]), batch[1])
        self.log("val_error", error, prog_bar=True)
        self.log("error_rate", (error > 0.5).float(), prog_bar=True)

    def on_validation_epoch_end(self):
        m = self.trainer.callback_metrics
        print(f"Epoch {self.current_epoch}: val_error: {float(m['val_error']):.4f}, "
              f"error_rate: {float(m['error_rate']):.2f}")
        print({"eval_loss": float(m["val_error"]), "eval_error_rate": float(m["error_rate"]),
               "epoch": float(self.current_epoch)})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)
trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False,
                    accelerator="cpu", devices=1, default_root_dir=sys.argv[1])
trainer.fit(Net(), data, data)
trainer.validate(trainer.lightning_module, data)
print("No error: all fine")
"""


def _training_log(tmp_path: Path) -> str:
    """What ``python train.py > train.log 2>&1`` leaves: a real Lightning run's output."""
    pytest.importorskip("lightning")
    script = tmp_path / "train.py"
    script.write_text(_TRAIN_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def _usage_error() -> str:
    """What argparse prints for an unknown option."""
    parser = argparse.ArgumentParser(prog="train.py")
    err = io.StringIO()
    with pytest.raises(SystemExit), redirect_stderr(err):
        parser.parse_args(["--lr-warmup"])
    return err.getvalue()


def _interrupted() -> str:
    """The traceback of a run stopped with Ctrl-C: its last line names no Error class."""
    def train() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as info:
        train()
    exc = info.value
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def test_metrics_named_like_errors_are_not_errors(
        tmp_path: Path, run_cli: Callable[..., object]) -> None:
    log_text = _training_log(tmp_path)
    assert "val_error: " in log_text and "train_error" in log_text and "error_rate" in log_text
    log = tmp_path / "train.log"
    log.write_text(log_text)
    res = run_cli("explain", "--log", log)
    assert res.code == 0 and "[unexplained]" not in res.out, res.out
    state = tmp_path / "state.pt"
    torch.save({"w": torch.ones(2)}, state)
    errors = [_error_text(lambda: torch.load(state)["model_state_dict"]), _usage_error(),
              _interrupted()]
    log.write_text(log_text + "".join(errors))
    res = run_cli("explain", "--log", log)
    assert res.code == 1
    assert re.findall(r"^\[unexplained\] (.*)$", res.out, re.MULTILINE) == [
        "KeyError: 'model_state_dict'",
        "train.py: error: unrecognized arguments: --lr-warmup",
        "KeyboardInterrupt"], res.out


_TORCHSCRIPT_LOADS = """
import sys, traceback, torch
for _ in range(int(sys.argv[2])):
    try:
        torch.load(sys.argv[1], weights_only=True)
    except RuntimeError:
        traceback.print_exc()
"""


def test_torchscripts_warning_and_error_are_one_failure(
        tmp_path: Path, run_cli: Callable[..., object]) -> None:
    """torch warns that the file looks like a TorchScript archive, then refuses it: one
    failure, quoted by its error; two loads are two."""
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)
    for loads, times in ((1, ""), (2, " (2 occurrences)")):
        done = subprocess.run([sys.executable, "-c", _TORCHSCRIPT_LOADS, str(path), str(loads)],
                              capture_output=True, text=True, timeout=120)
        assert "UserWarning" in done.stderr and "RuntimeError: Cannot use" in done.stderr
        res = run_cli("explain", done.stderr)
        assert res.code == 0
        headline = "Cannot use ``weights_only=True`` with TorchScript archives"
        assert res.out.splitlines()[0] == f"[torchscript-weights-only] {headline}{times}"


def test_transformers_report_rows_are_quoted_as_key_and_status(
        tmp_path: Path, run_cli: Callable[..., object]) -> None:
    """A BERT encoder with one extra tensor, loaded as a classifier: the headlines name a
    key and its status, not the table's padding and pipes."""
    from safetensors.torch import load_file, save_file

    folder = _saved_bert(tmp_path / "bert")
    weights = folder / "model.safetensors"
    save_file({**load_file(weights), "extra.weight": torch.ones(3)}, weights)
    text = _from_pretrained_text(folder, "BertForSequenceClassification")
    assert re.search(r"^extra\.weight +\| UNEXPECTED +\|", text, re.MULTILINE), text
    res = run_cli("explain", text)
    assert res.code == 0, res.out
    headlines = [line for line in res.out.splitlines() if line.startswith("[")]
    assert headlines[0] == "[transformers-unexpected] extra.weight: UNEXPECTED", headlines
    assert re.fullmatch(r"\[transformers-missing\] classifier\.(weight|bias): MISSING "
                        r"\(2 tensors\)", headlines[1]), headlines


def _explain_stdin(data: bytes) -> subprocess.CompletedProcess[bytes]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("TORCHVERITY_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "torchverity", "explain"], input=data,
                          capture_output=True, env=env, timeout=120)


def test_input_that_is_no_log_is_refused(tmp_path: Path, run_cli: Callable[..., object]) -> None:
    """A checkpoint or an empty file given as the log, or piped in, holds no message: exit 2
    with what it is and the step that fits; a log of text is still read."""
    checkpoint = tmp_path / "model.pt"
    torch.save({"w": torch.randn(100)}, checkpoint)
    empty = tmp_path / "train.log"
    empty.write_bytes(b"")
    res = run_cli("explain", "--log", checkpoint)
    assert res.code == 2 and "model.pt: binary data, not a log" in res.err, res.err
    assert f"next: to see what the file is, torchverity inspect {checkpoint}" in res.err
    res = run_cli("explain", "--log", empty)
    assert res.code == 2 and "train.log: empty" in res.err and "next: " in res.err
    piped = _explain_stdin(checkpoint.read_bytes())
    assert piped.returncode == 2 and b"stdin: binary data" in piped.stderr, piped.stderr
    assert b"Traceback" not in piped.stderr
    piped = _explain_stdin(b"")
    assert piped.returncode == 2 and b"stdin: empty" in piped.stderr
    assert b"next: the command before the pipe printed nothing" in piped.stderr
    piped = _explain_stdin(b"epoch 1 loss 0.3\n_pickle.UnpicklingError: Unsupported operand 149\n")
    assert piped.returncode == 0 and b"[unsupported-opcode]" in piped.stdout, piped.stderr


def test_a_log_that_cannot_be_read_says_what_to_do(
        tmp_path: Path, run_cli: Callable[..., object]) -> None:
    res = run_cli("explain", "--log", tmp_path / "runs" / "train.log")
    assert res.code == 2 and "train.log: cannot read log: No such file or directory" in res.err
    assert f"next: check the path (ls {tmp_path / 'runs'})" in res.err, res.err
    res = run_cli("explain", "--log", tmp_path)
    assert res.code == 2 and "cannot read log: Is a directory" in res.err
    assert f"next: pass one log file from it (ls {tmp_path})" in res.err, res.err
