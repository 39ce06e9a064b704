"""The guard-state record of trainer_state.json (docs/formats/checkpoint.md) round-trips bit
for bit through the JSON the Hugging Face Trainer writes, loads into a new guard, and is
refused when edited, damaged or not of the checkpoint's step."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from guard_helpers import make_guard, make_model, train

from torchverity.errors import FormatError, IntegrityError
from torchverity.integrations._guard_record import (
    FORMAT,
    _digest,
    decode_record,
    encode_record,
)


def _strict(text: str) -> Any:
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _trainer_json(record: dict[str, Any]) -> dict[str, Any]:
    """Through the Trainer's own writing and reading (``TrainerState.save_to_json``)."""
    return dict(_strict(json.dumps(record, indent=2, sort_keys=True)))


@pytest.fixture(scope="module", params=["host", "device"])
def guarded(request: pytest.FixtureRequest) -> Any:
    """30 steps with every detector's state, and a NaN gradient at the last step left standing."""
    run = train(30, lambda inj: inj.gradient("0.bias", step=29, value=math.nan), close=False,
                plain=True, policy="record", per_layer=True, update_ratio=True,
                stats=request.param)
    assert [(e.step, e.kind) for e in run.guard.events] == [(29, "nonfinite_grad")]
    return run.guard


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return bool(a.dtype == b.dtype and a.shape == b.shape
                    and a.numpy().tobytes() == b.numpy().tobytes())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return bool(a == b)


def test_the_record_round_trips_bit_for_bit_and_loads_into_a_new_guard(guarded: Any) -> None:
    state = guarded.state_dict()
    assert math.isnan(state["unresolved"][0]["values"]["grad_norm"])
    record = _trainer_json(encode_record(state, 30, "out/checkpoint-30"))
    assert record["format"] == FORMAT and record["saved_in"] == "out/checkpoint-30"
    back = decode_record(record, 30)
    assert _same(back, state)
    model, opt = make_model()
    fresh = make_guard(model, opt, per_layer=True, update_ratio=True, policy="record",
                       min_samples=20, window=64, stats=guarded.config.stats)
    fresh.load_state_dict(back)
    assert _same(fresh.state_dict(), state)  # and once more through the guard itself
    assert fresh.certify()["unresolved"] == [
        {"step": 29, "kind": "nonfinite_grad", "suspects": ["0.bias"]}]


def _edited(record: dict[str, Any], how: str) -> dict[str, Any]:
    record = json.loads(json.dumps(record))
    stats = record["state"]["stats"]["buf"]["tensor"]
    if how == "a counter":
        record["state"]["tally"]["anomalies"] = {}
    elif how == "a window byte":
        data = bytearray(stats["data"], "ascii")
        data[10] = ord("A") if data[10] != ord("A") else ord("B")
        stats["data"] = data.decode()
    elif how == "the step":
        record["global_step"] = 31
    return record


@pytest.mark.parametrize("how", ["a counter", "a window byte", "the step"])
def test_an_edited_record_is_refused(guarded: Any, how: str) -> None:
    record = _edited(encode_record(guarded.state_dict(), 30, "out/checkpoint-30"), how)
    with pytest.raises(IntegrityError, match="SHA-256 does not match"):
        decode_record(record, 30)


def test_a_record_of_another_step_or_shape_is_refused(guarded: Any) -> None:
    record = encode_record(guarded.state_dict(), 30, "out/checkpoint-30")
    with pytest.raises(IntegrityError, match="saved at global step 30, the checkpoint is at "
                                             "step 35"):
        decode_record(record, 35)
    with pytest.raises(FormatError, match="not a torchverity-guard-state/1 record"):
        decode_record({"args": {}, "attributes": {}}, 30)
    with pytest.raises(FormatError, match="needs 'state', 'sha256' and 'global_step'"):
        decode_record({"format": FORMAT, "global_step": 30}, 30)
    # Digest and content agree, but a tensor holds fewer bytes than its shape needs.
    short = encode_record(guarded.state_dict(), 30, "out/checkpoint-30")
    buf = short["state"]["stats"]["buf"]["tensor"]
    buf["data"] = buf["data"][:8]
    short["sha256"] = _digest(short["state"], 30)
    with pytest.raises(FormatError, match="bytes, its shape"):
        decode_record(short, 30)
