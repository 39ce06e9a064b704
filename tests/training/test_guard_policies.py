"""Policies and their mechanics: stop, warn, skip (on the host, on the device, by a fused
optimizer), rollback; misuse; the per-step path never synchronises with the host."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from guard_helpers import (
    MakeOptimizer,
    Run,
    X,
    Y,
    batch_at,
    bits,
    count_syncs,
    make_guard,
    make_model,
    step_once,
    train,
)

from torchverity import faults
from torchverity.cli._output import dumps
from torchverity.errors import TrainingAnomalyError, UsageError
from torchverity.training import AnomalyWarning, TrainingGuard


def test_stop_raises_with_step_kind_values_and_suspects(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    with pytest.raises(TrainingAnomalyError) as info:
        train(40, lambda inj: inj.gradient("0.bias", step=23, value=math.nan),
              check_every=4, policy="stop", log=log, close=False)
    err = info.value
    assert (err.step, err.kind, err.suspects) == (23, "nonfinite_grad", ["0.bias"])
    assert math.isnan(err.values["grad_norm"])
    assert err.exit_code == 1
    assert "training anomaly at step 23: nonfinite_grad" in err.message
    assert "in 0.bias" in err.message
    assert err.hint == f"see every event with: torchverity report {log}"
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["step"] for x in lines if x["event"] == "anomaly"] == [23]


def test_warn_policy_warns(recwarn: pytest.WarningsRecorder) -> None:
    train(30, lambda inj: inj.parameter("0.bias", step=12, index=4, bit=0), check_every=5,
          rest_every=1, policies={"weights_changed": "warn"})
    messages = [str(w.message) for w in recwarn if issubclass(w.category, AnomalyWarning)]
    assert len(messages) == 1
    assert messages[0].startswith("torchverity: training anomaly at step 12: weights_changed (")
    assert messages[0].endswith(") in 0.bias")


@pytest.mark.parametrize("fused", [False, True])
def test_hot_path_never_reads_the_device(fused: bool) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True) if fused
           else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    # host_skip=False: the device-side skip an accelerator uses, proven on the CPU.
    guard = make_guard(model, opt, check_every=50, per_layer=True, update_ratio=not fused,
                          step_fn=step_fn, replay_every=3, host_skip=False, stats="device",
                          policies={"loss_spike": "replay", "loss_jump": "stop"})
    with count_syncs() as calls:
        for step in range(24):
            guard.train_step(batch_at(step))
            x, y = batch_at(step + 1)
            opt.zero_grad()
            loss = step_fn((x, y))
            loss.backward()
            guard.check(loss)
            guard.step()
    assert calls == []
    with count_syncs() as calls:
        guard.flush()
    assert calls, "the wrapper must see the host read at flush time"


def test_misuse_is_reported() -> None:
    model, opt = make_model()
    guard = make_guard(model, opt)
    with pytest.raises(UsageError, match=r"step\(\) called before check"):
        guard.step()
    loss = model(X[:4]).sum()
    loss.backward()
    guard.check(loss)
    with pytest.raises(UsageError, match="called twice"):
        guard.check(loss)
    with pytest.raises(UsageError, match="needs checkpoint_dir"):
        make_guard(model, opt, policy="rollback")
    with pytest.raises(UsageError, match="unknown policy 'explode'"):
        make_guard(model, opt, policies={"loss_spike": "explode"})
    with pytest.raises(UsageError, match="replay needs step_fn"):
        make_guard(model, opt, replay_every=5)
    with pytest.raises(UsageError, match="unknown options: chek_every"):
        make_guard(model, opt, chek_every=5)
    with pytest.raises(UsageError, match=r"rest_every must be an integer >= 1, not None") as err:
        make_guard(model, opt, rest_every=None)
    assert "rest_every=1 verifies every update window" in str(err.value)


@pytest.mark.parametrize("stats", ["host", "device"])
def test_rollback_reloads_the_verified_checkpoint_and_the_run_finishes(
    tmp_path: Path, clean: Run, stats: str
) -> None:
    def plan(inj: faults.FaultInjector) -> None:
        inj.parameter("0.weight", step=130, index=11, bit=30)  # corrupted at rest
        inj.parameter("2.weight", step=210, index=3, bit=0)  # the smallest possible change

    log = tmp_path / "events.jsonl"
    run = train(300, plan, check_every=10, rest_every=1, checkpoint_dir=tmp_path / "ckpt",
                checkpoint_every=50, log=log, stats=stats)
    assert [(e.step, e.kind, e.action, e.suspects) for e in run.guard.events
            if e.kind == "weights_changed"] == [
        (130, "weights_changed", "rolled_back", ("0.weight",)),
        (210, "weights_changed", "rolled_back", ("2.weight",)),
    ]
    assert run.guard.summary().rollbacks == 2
    records = [json.loads(x) for x in log.read_text().splitlines()]
    rollbacks = [r for r in records if r["event"] == "rollback"]
    assert [(r["anomaly_step"], r["restored_step"]) for r in rollbacks] == [(130, 100), (210, 200)]
    # Two rollbacks cost 40 of 300 steps of progress; the run still lands near the clean one.
    assert run.final_loss == pytest.approx(clean.final_loss, rel=0.5)
    kept = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert kept == [
        "guard-step00000250.pt", "guard-step00000250.pt.blake3", "guard-step00000250.pt.meta.json",
        "guard-step00000300.pt", "guard-step00000300.pt.blake3", "guard-step00000300.pt.meta.json",
    ]


def test_rollback_refuses_a_checkpoint_corrupted_on_disk(tmp_path: Path) -> None:
    from torchverity.errors import IntegrityError
    from torchverity.inject import flip_bit

    model, opt = make_model()
    guard = make_guard(model, opt, checkpoint_dir=tmp_path, check_every=1)
    flip_bit(guard.checkpoints[-1], offset=guard.checkpoints[-1].stat().st_size // 2, bit=3)
    with pytest.raises(IntegrityError):
        guard.rollback()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hot_path_never_synchronises_on_cuda() -> None:
    device = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 1)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True)
    guard = make_guard(model, opt, check_every=1000, per_layer=True, update_ratio=True,
                          rest_weighted=True)
    x, y = X.to(device), Y.to(device)

    def one(step: int) -> None:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[step: step + 32]), y[step: step + 32])
        loss.backward()
        guard.check(loss)
        guard.clip_grad_norm_(0.5)  # clipping with check()'s norms: on the device too
        guard.step()

    for step in range(3):  # first steps allocate optimizer state and checksum tables
        one(step)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3, 40):
            one(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert guard.close().clean


def test_skip_restores_optimizer_state_even_when_at_rest_leaves_it_out() -> None:
    model, opt = make_model()
    guard = make_guard(model, opt, optimizer_state=False, check_every=1)
    injector = faults.FaultInjector(model)
    injector.gradient("0.bias", step=5, value=math.nan)
    for step in range(7):
        injector.begin_step(step)
        if step == 5:
            before = {k: v.clone() for k, v in opt.state[model[0].bias].items()}
        step_once(guard, model, step)
        if step == 5:
            after = opt.state[model[0].bias]
            assert all(torch.equal(before[k], after[k]) for k in before)
    assert [(e.step, e.kind) for e in guard.events] == [(5, "nonfinite_grad")]
    assert all(torch.isfinite(t).all() for s in opt.state.values() for t in s.values())


@pytest.mark.parametrize("stats", ["host", "device"])
def test_fused_optimizer_skips_exactly_without_copies(stats: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = make_guard(model, opt, check_every=5, host_skip=False, stats=stats)
    m = guard._modes
    assert m.fused_skip and not m.needs_backup and not m.host_skip

    def after(step: int) -> None:
        assert not hasattr(opt, "found_inf")
        if step == 0:  # even the step creating the state is skipped
            assert all(float(s["step"]) == 0 for s in opt.state.values())

    _skip_drill(model, opt, guard, after)


def test_undo_copy_restores_every_dtype_and_layout_bit_for_bit() -> None:
    from torchverity._tensors import byte_view
    from torchverity.training._snapshot import Snapshot

    gen = torch.Generator().manual_seed(5)
    nan_payload = torch.randn(1000, 3, generator=gen)
    nan_payload.view(-1)[:2].view(torch.int32).copy_(torch.tensor([0x7FC01234, -(2**31)]))
    tensors = [
        nan_payload,  # a NaN payload and -0.0 survive: the select runs on int64 words
        torch.randn(7, generator=gen, dtype=torch.float64),
        torch.randn(5, generator=gen).to(torch.bfloat16),  # 10 bytes: int16 words
        torch.randn(3, 3, generator=gen).to(torch.float16).t(),  # non-contiguous
        torch.randint(1, 255, (9,), generator=gen, dtype=torch.uint8),
        torch.randn(11, generator=gen)[1:],  # storage offset of 4 bytes: int32 words
        torch.ones(5, dtype=torch.bool),
        torch.tensor(3.0),  # a 0-dim step counter
    ]
    before = [byte_view(t).clone() for t in tensors]
    snap = Snapshot()
    # The flag as a device tensor (device rules) or a host bool (rules on floats).
    for keep, flag in ((False, torch.tensor(False)), (True, torch.tensor(True)), (False, False),
                       (True, True)):
        snap.take(tensors)
        for t in tensors:
            t.zero_()
        snap.keep_if(flag)
        for t, b in zip(tensors, before, strict=True):
            assert torch.equal(byte_view(t), torch.zeros_like(b) if keep else b)
        for t, b in zip(tensors, before, strict=True):
            # byte_view holds a non-contiguous tensor's bytes in logical order.
            byte_view(t).copy_(b) if t.is_contiguous() else t.copy_(b.view(t.dtype).view(t.shape))


_OPTIMIZERS: dict[str, MakeOptimizer] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}


def _faulty_run(make_opt: MakeOptimizer, host_skip: bool, log: Path, **options: Any) -> Run:
    def plan(inj: faults.FaultInjector) -> None:
        inj.gradient("0.weight", step=0, value=math.nan)  # the step that creates the state
        inj.gradient("2.bias", step=12, value=math.inf)
        inj.parameter("0.bias", step=20, index=3, bit=faults.mantissa_lsb(torch.float32))

    # The spike at 30 asks for a replay: the later steps of its interval stay skipped.
    return train(45, plan, poison=lambda s, y: y * 1e3 if s == 30 else y, check_every=5,
                 rest_every=1, make_opt=make_opt, host_skip=host_skip, log=log,
                 policies={"weights_changed": "record", "loss_spike": "replay"}, **options)


@pytest.mark.parametrize("opt_name", sorted(_OPTIMIZERS))
def test_host_skip_and_device_skip_give_the_same_events_and_bits(opt_name: str,
                                                                 tmp_path: Path) -> None:
    host = _faulty_run(_OPTIMIZERS[opt_name], True, tmp_path / "host.jsonl")
    device = _faulty_run(_OPTIMIZERS[opt_name], False, tmp_path / "device.jsonl")
    assert host.guard._modes.host_skip and not device.guard._modes.host_skip
    events = [e.to_dict() for e in host.guard.events]
    assert dumps(events) == dumps([e.to_dict() for e in device.guard.events])
    assert [(e["step"], e["kind"]) for e in events][:3] == [
        (0, "nonfinite_grad"), (12, "nonfinite_grad"), (20, "weights_changed")]
    assert (30, "loss_spike") in [(e["step"], e["kind"]) for e in events]
    assert host.guard.summary() == device.guard.summary()
    assert host.guard.summary().skipped >= 3

    def records(path: Path) -> list[dict[str, Any]]:
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        # The start record holds the options; times differ.
        return [{k: v for k, v in r.items() if k != "time"} for r in rows
                if r["event"] != "start"]

    assert records(tmp_path / "host.jsonl") == records(tmp_path / "device.jsonl")
    for a, b in zip(host.model.parameters(), device.model.parameters(), strict=True):
        assert bits(a) == bits(b)
    opt_h, opt_d = host.guard.optimizer, device.guard.optimizer
    for a, b in zip(host.model.parameters(), device.model.parameters(), strict=True):
        assert opt_h.state[a].keys() == opt_d.state[b].keys()
        assert all(torch.equal(opt_h.state[a][k], opt_d.state[b][k]) for k in opt_h.state[a])


def test_cpu_parameters_skip_on_the_host_exactly_and_never_copy() -> None:
    model, opt = make_model()
    guard = make_guard(model, opt, check_every=5)
    assert guard._modes.host_skip

    def after(step: int) -> None:
        if step == 0:  # skipped before the optimizer ever ran: it created no state
            assert not opt.state

    _skip_drill(model, opt, guard, after)
    assert guard._upd.snapshot.copies == [] and guard._upd.snapshot.live == []
    assert all(math.isfinite(float(p.detach().abs().sum())) for p in model.parameters())


def _skip_drill(model: torch.nn.Module, opt: torch.optim.Optimizer, guard: TrainingGuard,
                after: Callable[[int], None]) -> None:
    """A NaN gradient at step 0 and an Inf one at step 7: both updates are skipped, step 7's
    bit for bit (parameters and optimizer state), and the other ten applied."""
    injector = faults.FaultInjector(model)
    injector.gradient("0.weight", step=0, value=math.nan)
    injector.gradient("2.bias", step=7, value=math.inf)
    for step in range(12):
        injector.begin_step(step)
        if step == 7:
            params = [p.detach().clone() for p in model.parameters()]
            state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
        step_once(guard, model, step)
        after(step)
        if step == 7:
            assert all(bits(a) == bits(p) for a, p in zip(params, model.parameters(),
                                                            strict=True))
            for before, p in zip(state, model.parameters(), strict=True):
                assert all(bits(before[k]) == bits(opt.state[p][k]) for k in before)
    guard.close()
    assert [(e.step, e.kind, e.action) for e in guard.events] == [
        (0, "nonfinite_grad", "skipped"), (7, "nonfinite_grad", "skipped")]
    assert all(float(s["step"]) == 10 for s in opt.state.values())


def test_host_skip_falls_back_to_the_device_copy_where_it_cannot_apply() -> None:
    model, opt = make_model()
    # Update ratios are known only after the update: undoing it needs the copy.
    assert not make_guard(model, opt, update_ratio=True)._modes.host_skip
    assert not make_guard(model, opt, host_skip=False)._modes.host_skip
    assert not make_guard(model, opt, policy="record")._modes.host_skip  # nothing ever skips
    assert make_guard(model, opt)._modes.host_skip


@pytest.mark.parametrize("opt_name", sorted(_OPTIMIZERS))
def test_helper_thread_gives_the_same_events_log_and_bits(opt_name: str, tmp_path: Path) -> None:
    # _faulty_run: a NaN and an Inf gradient, a lowest-mantissa flip in 0.bias, a spike replayed.
    runs = {overlap: _faulty_run(_OPTIMIZERS[opt_name], True, tmp_path / f"{overlap}.jsonl",
                                 overlap=overlap) for overlap in (True, False)}
    helper, alone = runs[True], runs[False]
    assert helper.guard._helper is None and alone.guard._helper is None  # closed
    events = [e.to_dict() for e in helper.guard.events]
    assert [(e["step"], e["kind"], e["suspects"]) for e in events][:3] == [
        (0, "nonfinite_grad", ["0.weight"]), (12, "nonfinite_grad", ["2.bias"]),
        (20, "weights_changed", ["0.bias"])]
    assert dumps(events) == dumps([e.to_dict() for e in alone.guard.events])
    assert helper.guard.summary() == alone.guard.summary()

    def records(path: Path) -> list[str]:
        return [line.split('"time"')[0] for line in path.read_text().splitlines()[1:]]

    assert records(tmp_path / "True.jsonl") == records(tmp_path / "False.jsonl")
    for a, b in zip(helper.model.parameters(), alone.model.parameters(), strict=True):
        assert bits(a) == bits(b)


# ------------------------------------------------------------ certified checkpoints, guard state


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b) or (a != a and b != b)  # NaN values in anomaly events


def test_guard_state_round_trips_through_a_checkpoint_file(tmp_path: Path) -> None:
    import torchverity

    run = train(40, lambda inj: inj.gradient("0.bias", step=21, value=math.nan), plain=True,
                close=False, update_ratio=True, policies={"nonfinite_grad": "record"})
    state = run.guard.state_dict()
    torchverity.save(state, tmp_path / "guard.pt")
    model, opt = make_model()
    fresh = make_guard(model, opt, update_ratio=True)
    fresh.load_state_dict(torchverity.load(tmp_path / "guard.pt", sidecar="require"))
    assert _same(fresh.state_dict(), state)
    assert fresh.summary() == run.guard.summary()
    # The NaN update let stand at 21 (and the NaN gradients after it) stay unresolved.
    assert state["unresolved"][0]["step"] == 21 and state["tally"]["anomalies"]


def test_a_checkpoint_of_weights_changed_at_rest_is_uncertified_and_never_rolled_back_to(
        tmp_path: Path) -> None:
    from torchverity.checkpoint._meta import read_meta

    model, opt = make_model()
    guard = make_guard(model, opt, checkpoint_dir=tmp_path, policies={"weights_changed": "record"})
    start = guard.checkpoints[0]
    assert read_meta(start)["certification"]["certified"]
    for step in range(5):
        step_once(guard, model, step)
    faults.flip_bit(model[2].weight, 3, 0)  # at rest, after the last update
    cert = guard.certify()
    assert (cert["certified"], cert["verified"]["at_rest"], cert["changed"]) == (
        False, "failed", ["2.weight"])
    doubtful = guard.save_checkpoint()
    assert read_meta(doubtful)["certification"] == {**cert, "step": 5}
    guard.rollback()  # to the certified start, not to the newest file
    records = [r for r in guard._recovery.certified]
    assert records == [start] and bits(model[2].weight) == bits(make_model()[0][2].weight)
