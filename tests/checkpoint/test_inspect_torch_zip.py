"""inspect and fingerprint of torch.save zip checkpoints read them without torch, with
exactly the result of loading them: every dtype, views with offsets, shared storages,
non-contiguous views, plain values, real Lightning checkpoints and Hugging Face .bin files;
malicious files never run.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_free_probe import cli
from torch_zip_artifacts import bert, lightning_checkpoints, save_bin_shards, state
from torchverity.checkpoint._file_fingerprint import fingerprint_file
from torchverity.checkpoint._fingerprint import fingerprint
from torchverity.checkpoint._folders import resolve
from torchverity.checkpoint._inspect import InspectResult, _contents, inspect
from torchverity.checkpoint._read import read_unverified


def _loaded_inspect(path: Path, algo: str = "blake3") -> InspectResult:
    """What inspect gives when it loads the checkpoint to list it (the reference)."""
    rows, values, root = _contents(read_unverified(path), algo)
    return replace(inspect(path), tensors=rows, values=values, fingerprint=root)


def _json(data: Any) -> Any:
    return json.loads(json.dumps(data))


def _same_as_loaded(path: Path, run_cli: Any, *, torch_free: bool = True,
                    values: dict[str, str] | None = None) -> None:
    """inspect and fingerprint of ``path`` equal the loaded path's, as objects, as JSON and
    as printed, and import torch only where ``torch_free`` says so (``values``: the plain
    values shown where the loader gives none)."""
    want = _loaded_inspect(path)
    if values is not None:
        want = replace(want, values=values)
    assert inspect(path) == want
    assert want.tensors and want.fingerprint
    got = cli("inspect", "--json", path)
    assert (got["code"], got["torch"]) == (0, not torch_free)
    assert json.loads(str(got["out"])) == _json({"ok": True, "problems": [], **want.to_dict()})
    assert cli("inspect", path)["out"] == run_cli("inspect", path).out
    for mode, algo in (("exact", "blake3"), ("sha256", "sha256")):
        fp = fingerprint(read_unverified(path), mode=algo)
        assert fingerprint_file(path, mode=mode) == fp
        got = cli("fingerprint", "--json", "--mode", mode, path)
        assert (got["code"], got["torch"]) == (0, not torch_free)
        assert json.loads(str(got["out"])) == _json({"ok": True, "path": str(path),
                                                      "file": str(resolve(path).record),
                                                      "format": want.format,
                                                      "unsafe": {}, **fp.to_dict()})
    human = cli("fingerprint", "--tensors", path)
    assert human["out"] == run_cli("fingerprint", "--tensors", path).out
    assert _loaded_inspect(path, "sha256").fingerprint == \
        fingerprint(read_unverified(path), mode="sha256").root


def _contiguous(checkpoint: dict[str, Any]) -> dict[str, Any]:
    checkpoint["model"] = {k: v for k, v in checkpoint["model"].items()
                           if v.is_contiguous()}
    return checkpoint


def test_every_dtype_views_and_shared_storages_read_without_torch(tmp_path: Path,
                                                                  run_cli: Any) -> None:
    saved = _contiguous(state())
    assert {"base", "rows", "p", "c128", "f8", "bf", "uint64", "empty", "scalar"} <= \
        set(saved["model"])  # rows: a view at an offset into base's storage
    torch.save(saved, tmp_path / "views.pt")
    _same_as_loaded(tmp_path / "views.pt", run_cli)


def test_non_contiguous_views_read_without_torch(tmp_path: Path, run_cli: Any) -> None:
    saved = state()  # with base.t() and base[:, ::3]
    saved["model"] |= {"expanded": torch.arange(3.0).view(3, 1).expand(3, 4),
                       "bf_t": torch.randn(3, 5).bfloat16().t()[1:, ::2],
                       "empty_t": torch.zeros(0, 4).t()}
    torch.save(saved, tmp_path / "strided.pt")
    _same_as_loaded(tmp_path / "strided.pt", run_cli)


def test_conjugate_and_negative_views_are_loaded_as_before(tmp_path: Path,
                                                          run_cli: Any) -> None:
    """torch.save records their conjugate or negative bit in the tensor's metadata, which
    only torch applies: the listing leaves such files to the loader."""
    c = torch.randn(3, 2, dtype=torch.complex64)
    torch.save({"conj": c.conj(), "neg": torch._neg_view(torch.randn(2, 3)), "w": c},
               tmp_path / "lazy.pt")
    _same_as_loaded(tmp_path / "lazy.pt", run_cli, torch_free=False)


def test_a_pt_and_its_safetensors_copy_fingerprint_alike_without_torch(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.detach().clone() for k, v in _contiguous(state())["model"].items()
               if v.dtype != torch.complex128}  # .safetensors has no complex128
    torch.save(tensors, tmp_path / "weights.pt")
    save_file(tensors, tmp_path / "weights.safetensors")
    pt = cli("fingerprint", "--json", tmp_path / "weights.pt")
    st = cli("fingerprint", "--json", tmp_path / "weights.safetensors")
    assert pt["torch"] is False and st["torch"] is False
    assert json.loads(str(pt["out"]))["root"] == json.loads(str(st["out"]))["root"] == \
        fingerprint(tensors).root


def test_a_lightning_checkpoint_reads_without_torch(tmp_path: Path, run_cli: Any) -> None:
    first, _ = lightning_checkpoints(tmp_path, {"width": 4, "lr": 0.01})
    _same_as_loaded(first, run_cli)


def test_hugging_face_bin_files_read_without_torch(tmp_path: Path, run_cli: Any) -> None:
    model = bert()
    save_bin_shards(model, tmp_path / "single", max_shard_size="10GB")
    save_bin_shards(model, tmp_path / "sharded")
    assert len(list((tmp_path / "sharded").glob("pytorch_model-*.bin"))) > 1
    _same_as_loaded(tmp_path / "single" / "pytorch_model.bin", run_cli)
    _same_as_loaded(tmp_path / "sharded", run_cli)
    want = fingerprint(model.state_dict(), mode="exact")
    assert fingerprint_file(tmp_path / "sharded") == fingerprint_file(tmp_path / "single") == want


def test_a_file_outside_the_listing_is_loaded_as_before(tmp_path: Path, run_cli: Any) -> None:
    """A Lightning checkpoint with omegaconf hyper-parameters: weights_only refuses their
    classes, so its tensors are read inertly, and its plain values with them."""
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"model": {"width": 4}, "lr": 0.01})
    first, _ = lightning_checkpoints(tmp_path, cfg)
    values = inspect(first).values
    assert {k: values[k] for k in ("epoch", "global_step", "hyper_parameters.model.width",
                                   "hyper_parameters.lr")} == {
        "epoch": "1", "global_step": "2", "hyper_parameters.model.width": "4",
        "hyper_parameters.lr": "0.01"}
    shown = run_cli("inspect", "--limit", "0", first).out
    assert "  global_step = 2" in shown and "  hyper_parameters.model.width = 4" in shown
    _same_as_loaded(first, run_cli, torch_free=False, values=values)


def test_limit_caps_the_weights_only_plan_on_the_scan_line(tmp_path: Path, run_cli: Any) -> None:
    """omegaconf hyper-parameters need many classes allowlisted: the scan line lists --limit
    of them and names the command that prints the whole plan."""
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"model": {"width": 4, "layers": [1, 2]}, "lr": 0.01,
                                      "name": "x", "flag": True})
    first, _ = lightning_checkpoints(tmp_path, cfg)
    capped = run_cli("inspect", "--limit", "2", first)
    line = next(x for x in capped.out.splitlines() if x.startswith("  scan"))
    needs = line.split("weights_only needs: ", 1)[1]
    assert needs.count(", ") == 2 and f"more (torchverity scan {first} prints" in needs, line
    full = next(x for x in run_cli("inspect", "--limit", "0", first).out.splitlines()
                if x.startswith("  scan"))
    assert "more (" not in full and full.count(", ") > 2, full


def test_names_that_collide_when_flattened_are_refused_as_when_loaded(tmp_path: Path) -> None:
    from torchverity.checkpoint._diff_listing import listing
    from torchverity.errors import FormatError

    torch.save({"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, tmp_path / "twice.pt")
    assert listing(tmp_path / "twice.pt") is None  # the loader's error is the one to show
    with pytest.raises(FormatError, match="names occur twice"):
        fingerprint(read_unverified(tmp_path / "twice.pt"))
    with pytest.raises(FormatError, match="names occur twice"):
        fingerprint_file(tmp_path / "twice.pt")


def test_malicious_torch_files_never_run(tmp_path: Path, run_cli: Any) -> None:
    """Each file's payload runs under a plain torch.load in a throwaway process; inspect
    and fingerprint list none of them and run none of them."""
    import pickle_corpus
    from torchverity.checkpoint._diff_listing import listing

    sentinel = tmp_path / "SENTINEL"
    cases = pickle_corpus.live_torch_files(tmp_path / "bad", sentinel)
    assert len(cases) >= 5
    for case in cases:
        assert listing(case.path, canonical=True) is None, case.name
        for command in ("inspect", "fingerprint"):
            result = run_cli(command, case.path)
            assert "Traceback" not in result.err, case.name
            assert not sentinel.exists(), f"{command} {case.name}: the payload ran"
