"""``golden record --shape --dtype int64`` draws inputs a token model takes: ids in
``[0, vocab_size)`` of the model's transformers config, else in ``[0, DEFAULT_ID_HIGH)``,
never beyond the dtype. The record keeps every parameter of the draw, and the parameters
read back from the file draw the stored inputs again, bit for bit. Real tiny transformers
models record and check clean; a flipped embedding weight is caught.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from torchverity import golden
from torchverity.cli import main
from torchverity.errors import FormatError
from torchverity.golden import DEFAULT_ID_HIGH, InputDraw, draw_inputs, load_record

transformers = pytest.importorskip("transformers")

MODELS = '''
import torch
import transformers

from torch_zip_artifacts import flip

transformers.logging.set_verbosity_error()
FLIP_ROW = {flip_row}


def bert():
    torch.manual_seed(0)
    return transformers.BertModel(transformers.BertConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=20,
        vocab_size=1000, max_position_embeddings=32))


def bert_flipped():
    """One bit of the embedding row of a token the golden inputs hold."""
    model = bert()
    with torch.no_grad():
        flip(model.embeddings.word_embeddings.weight, FLIP_ROW * 16 + 3, 20)
    return model


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=500, n_positions=32, use_cache=False))


class Ids(torch.nn.Module):
    """No config: ids index an embedding of DEFAULT_ID_HIGH rows."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding({rows}, 4)

    def forward(self, ids):
        return self.emb(ids.long()).sum(-1)


def ids():
    torch.manual_seed(0)
    return Ids()
'''

SHAPE = (2, 8)


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tvtoken_models, with its flipped row one of the ids the CLI draws for BERT."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    drawn = draw_inputs(SHAPE, "int64", seed=3, model=_Vocab(1000)).tensor()
    (tmp_path / "tvtoken_models.py").write_text(
        MODELS.format(flip_row=int(drawn[1, 5]), rows=DEFAULT_ID_HIGH))
    return tmp_path


class _Vocab:
    def __init__(self, size: int) -> None:
        self.config = transformers.PretrainedConfig(vocab_size=size)


def _record(run_cli: Callable[..., Any], build: str, *extra: str) -> Any:
    return run_cli("golden", "record", "--model", f"tvtoken_models:{build}", "--golden",
                   f"{build}.json", "--shape", ",".join(map(str, SHAPE)), "--dtype", "int64",
                   "--seed", "3", *extra)


@pytest.mark.parametrize(("build", "vocab"), [("bert", 1000), ("gpt2", 500)])
def test_token_models_record_and_check_clean(models: Path, build: str, vocab: int,
                                             run_cli: Callable[..., Any]) -> None:
    result = _record(run_cli, build)
    assert result.code == 0, result.err
    rec, named = load_record(models / f"{build}.json")
    ids = named["input"]
    assert ids.dtype == torch.int64 and int(ids.min()) >= 0 and int(ids.max()) < vocab
    assert len(set(ids.reshape(-1).tolist())) > 8  # spread over the vocabulary, not a few ids
    assert rec.inputs_drawn == InputDraw(SHAPE, "int64", 3, "integers", 0, vocab,
                                         "config.vocab_size")
    assert torch.equal(rec.inputs_drawn.tensor(), ids)
    check = run_cli("golden", "check", "--model", f"tvtoken_models:{build}", "--golden",
                    f"{build}.json")
    assert check.code == 0 and "golden check passed" in check.out, check.out + check.err


def test_a_flipped_embedding_weight_is_caught(models: Path,
                                             run_cli: Callable[..., Any]) -> None:
    assert _record(run_cli, "bert").code == 0
    args = ("golden", "check", "--model", "tvtoken_models:bert_flipped", "--golden",
            "bert.json", "--json")
    result = run_cli(*args)
    doc = json.loads(result.out)
    assert result.code == 1 and doc["weights_changed"] == ["embeddings.word_embeddings.weight"]
    outputs_only = run_cli(*args, "--no-check-weights")
    parts = {f["part"] for f in json.loads(outputs_only.out)["failures"]}
    assert outputs_only.code == 1 and "digest" in parts  # the flipped row is one the inputs use


def test_without_a_vocabulary_ids_stay_in_the_default_range(
        models: Path, run_cli: Callable[..., Any], capsys: pytest.CaptureFixture[str]) -> None:
    result = _record(run_cli, "ids")
    assert result.code == 0, result.err
    rec, named = load_record(models / "ids.json")
    assert rec.inputs_drawn is not None and rec.inputs_drawn.high_from == "default"
    assert int(named["input"].max()) < DEFAULT_ID_HIGH and int(named["input"].min()) >= 0
    with pytest.raises(SystemExit):
        main(["golden", "record", "--help"])
    assert f"(else [0, {DEFAULT_ID_HIGH}))" in " ".join(capsys.readouterr().out.split())


def test_draws_within_the_dtype_and_floats_as_before() -> None:
    small = draw_inputs((64,), "int8", model=_Vocab(1000))
    assert (small.high, small.high_from) == (128, "dtype")
    assert int(small.tensor().max()) <= 127 and int(small.tensor().min()) >= 0
    flags = draw_inputs((64,), "bool").tensor()
    assert flags.dtype == torch.bool and 0 < int(flags.sum()) < 64
    normal = draw_inputs((3, 4), "bfloat16", seed=5)
    assert normal.to_dict() == {"distribution": "normal", "shape": [3, 4], "dtype": "bfloat16",
                                "seed": 5}
    expected = torch.randn((3, 4), generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    assert torch.equal(normal.tensor(), expected)


def test_the_draw_round_trips_through_the_golden_file(tmp_path: Path) -> None:
    """Written as docs/formats/golden.md says; read back equal; a record of given inputs
    (or one written before draws were recorded) has none; a bad draw is a FormatError."""
    model = torch.nn.Embedding(DEFAULT_ID_HIGH, 2)
    drawn = draw_inputs((4,), "int32", seed=9, model=model)
    rec = golden.record(model, drawn, tmp_path / "g.json")
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["inputs"]["drawn"] == {"distribution": "integers", "shape": [4],
                                      "dtype": "int32", "seed": 9, "low": 0,
                                      "high": DEFAULT_ID_HIGH, "high_from": "default"}
    assert rec.to_dict()["inputs_drawn"] == doc["inputs"]["drawn"]
    assert load_record(tmp_path / "g.json")[0].inputs_drawn == drawn
    assert golden.check(model, tmp_path / "g.json").ok
    golden.record(model, drawn.tensor(), tmp_path / "given.json")
    assert load_record(tmp_path / "given.json")[0].inputs_drawn is None
    del doc["inputs"]["drawn"]
    (tmp_path / "old.json").write_text(json.dumps(doc))
    assert load_record(tmp_path / "old.json")[0].inputs_drawn is None
    doc["inputs"]["drawn"] = {"distribution": "integers", "shape": [4], "dtype": "int32",
                              "seed": 9, "low": 0, "high": 10, "high_from": "guess"}
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="malformed golden file"):
        load_record(tmp_path / "bad.json")
