"""TrainingGuard detectors on real training: NaN/Inf, spikes, jumps, per-layer and update-ratio
rules, replay; the rules on floats and on the device agree; clean runs raise nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from guard_helpers import (
    Run,
    X,
    Y,
    batch_at,
    bits,
    make_guard,
    make_model,
    step_once,
    train,
)

from torchverity import faults
from torchverity.cli._output import dumps
from torchverity.errors import UsageError
from torchverity.training import AnomalyWarning, TrainingGuard


def test_clean_run_of_300_steps_raises_nothing(clean: Run) -> None:
    assert clean.guard.events == []
    summary = clean.guard.summary()
    assert summary.steps == 300 and summary.clean and summary.skipped == 0
    assert clean.final_loss < 0.05


@pytest.mark.parametrize(
    ("name", "how"), [("0.weight", {"bit": 30}), ("2.weight", {"value": math.nan})]
)
def test_faults_in_gradients_are_caught_within_one_interval_and_named(
    name: str, how: dict[str, float]
) -> None:
    run = train(60, lambda inj: inj.gradient(name, step=45, index=3, **how), check_every=10)
    at_45 = [e for e in run.guard.events if e.step == 45]
    assert at_45 and {e.step for e in run.guard.events} == {45}
    assert run.detected_at[45] - 45 < 10
    assert all(e.suspects[:1] == (name,) for e in at_45), [e.describe() for e in at_45]
    assert run.guard.summary().skipped == 1
    assert math.isfinite(run.final_loss)


@pytest.mark.parametrize("how", [{"bit": 30}, {"value": math.nan}])
def test_activation_fault_is_caught_at_its_step(how: dict[str, float]) -> None:
    run = train(60, lambda inj: inj.activation("1", step=45, index=5, **how), check_every=10)
    kinds = {e.kind for e in run.guard.events if e.step == 45}
    assert kinds & {"nonfinite_loss", "loss_spike", "nonfinite_grad", "grad_norm_spike"}
    assert {e.step for e in run.guard.events} == {45}
    assert run.guard.summary().skipped == 1


def test_skip_lets_the_run_finish_close_to_the_clean_run(clean: Run) -> None:
    def plan(inj: faults.FaultInjector) -> None:
        for step in (40, 90, 150, 220):
            inj.gradient("0.weight", step=step, index=step % 50, bit=30)
        inj.gradient("2.bias", step=260, value=math.nan)

    run = train(300, plan, check_every=10)
    assert sorted({e.step for e in run.guard.events}) == [40, 90, 150, 220, 260]
    assert run.guard.summary().skipped == 5
    assert all(torch.isfinite(p).all() for p in run.model.parameters())
    assert run.final_loss == pytest.approx(clean.final_loss, rel=0.25, abs=5e-3)


def test_unguarded_fault_ruins_the_run_the_guard_saves() -> None:
    run = train(120, lambda inj: inj.gradient("0.weight", step=60, value=math.nan),
                policy="record")
    assert not math.isfinite(run.final_loss)


def test_check_interval_1_and_10_find_the_same_events() -> None:
    def plan(inj: faults.FaultInjector) -> None:
        inj.parameter("0.weight", step=33, index=1, bit=29)
        inj.gradient("2.weight", step=47, value=math.nan)

    every1 = train(60, plan, check_every=1, rest_every=1, policies={"weights_changed": "record"})
    every10 = train(60, plan, check_every=10, rest_every=1,
                    policies={"weights_changed": "record"})
    assert dumps([e.to_dict() for e in every1.guard.events]) == dumps(
        [e.to_dict() for e in every10.guard.events])
    assert [e.kind for e in every1.guard.events] == ["weights_changed", "nonfinite_grad"]
    assert all(every1.detected_at[s] == s for s in every1.detected_at)
    assert every1.final_loss == every10.final_loss


def test_spike_detector_catches_poisoned_batch_and_replay_says_reproducible() -> None:
    run = train(50, poison=lambda s, y: y * 1e3 if s == 40 else y, check_every=5,
                policies={"loss_spike": "replay", "grad_norm_spike": "replay"})
    at_40 = {e.kind: e for e in run.guard.events}
    assert set(at_40) >= {"loss_spike"} and {e.step for e in run.guard.events} == {40}
    assert at_40["loss_spike"].replay == "reproducible"
    assert at_40["loss_spike"].values["loss"] > at_40["loss_spike"].thresholds["loss"]
    assert run.guard.summary().replays == {"reproducible": 1}


def test_one_off_activation_fault_replays_as_transient(tmp_path: Path) -> None:
    log = tmp_path / "ev.jsonl"
    run = train(50, lambda inj: inj.activation("0", step=33, index=2, bit=30), check_every=5,
                policy="replay", log=log)
    assert {e.step for e in run.guard.events} == {33}
    assert {e.replay for e in run.guard.events} == {"transient"}
    records = [json.loads(x) for x in log.read_text().splitlines()]
    replays = [r for r in records if r["event"] == "replay"]
    assert [(r["step"], r["classification"]) for r in replays] == [(33, "transient")]


def test_replay_audit_every_k_steps_is_silent_when_clean_and_catches_a_one_off_fault() -> None:
    clean_run = train(40, check_every=10, replay_every=4, replay_tolerance=0.0)  # bit-exact
    assert clean_run.guard.events == []
    # A tiny fault (a low mantissa bit: 2**-14 of one activation) moves nothing a threshold
    # could see; the bit-exact replay still notices the step did not compute the same thing
    # twice. (Lower bits can round away in the gradient norms on some CPUs' kernels.)
    bit = faults.mantissa_lsb(torch.float32)
    run = train(40, lambda inj: inj.activation("0", step=24, index=9, bit=bit + 9),
                check_every=10, replay_every=4, replay_tolerance=0.0,
                policies={"replay_mismatch": "skip"})
    assert [(e.step, e.kind) for e in run.guard.events] == [(24, "replay_mismatch")]
    assert "2.weight" in run.guard.events[0].suspects  # the layer after the fault


class PeerReducer:
    """Combines local flags with those of a simulated peer rank, as all_reduce(MAX) would."""

    def __init__(self, peer_flags: dict[int, int]) -> None:
        self.calls = 0
        self.peer = peer_flags

    def reduce(self, flags: torch.Tensor) -> torch.Tensor:
        other = torch.zeros_like(flags)
        if self.calls in self.peer:
            other[self.peer[self.calls]] = 1.0
        self.calls += 1
        return torch.maximum(flags, other)


@pytest.mark.parametrize("stats", ["host", "device"])
def test_reducer_makes_every_rank_skip_together(stats: str) -> None:
    reducer = PeerReducer({15: 1})  # the peer saw non-finite gradients at step 15
    run = train(30, check_every=10, reducer=reducer, stats=stats)
    assert reducer.calls == 30
    assert [(e.step, e.kind, e.suspects) for e in run.guard.events] == [(15, "nonfinite_grad", ())]
    assert run.guard.summary().skipped == 1


def test_event_log_has_metrics_for_every_step_and_a_summary(tmp_path: Path) -> None:
    log = tmp_path / "run" / "events.jsonl"
    train(25, lambda inj: inj.gradient("0.weight", step=21, value=math.nan), check_every=10,
          log=log)
    records = [json.loads(x) for x in log.read_text().splitlines()]
    assert records[0]["event"] == "start" and records[-1]["event"] == "summary"
    assert [r["step"] for r in records if r["event"] == "metrics"] == list(range(25))
    anomaly = next(r for r in records if r["event"] == "anomaly")
    assert anomaly["values"]["grad_norm"] == "nan"
    assert (anomaly["step"], anomaly["action"], anomaly["rank"]) == (21, "skipped", 0)
    assert records[-1]["anomalies"] == {"nonfinite_grad": 1} and records[-1]["skipped"] == 1


def test_layer_grad_spike_names_the_layer_and_is_silent_otherwise() -> None:
    run = train(60, lambda inj: inj.gradient("2.bias", step=45, value=40.0), check_every=10,
                per_layer=True, policies={"layer_grad_spike": "skip", "grad_norm_spike": "record"})
    layer = [e for e in run.guard.events if e.kind == "layer_grad_spike"]
    assert [(e.step, e.suspects) for e in layer] == [(45, ("2.bias",))]
    assert layer[0].values["grad_norm[2.bias]"] == pytest.approx(40.0, rel=0.01)
    assert {e.step for e in run.guard.events} == {45}


def test_update_ratio_spike_catches_a_learning_rate_blunder() -> None:
    model, opt = make_model()
    guard = make_guard(model, opt, update_ratio=True, check_every=10, min_samples=20,
                          window=64, policies={"update_ratio_spike": "skip"})
    for step in range(60):
        opt.param_groups[0]["lr"] = 1.0 if step == 50 else 1e-2  # one step with lr x100
        step_once(guard, model, step)
    guard.close()
    assert [(e.step, e.kind) for e in guard.events] == [(50, "update_ratio_spike")]
    assert set(guard.events[0].suspects) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert guard.summary().skipped == 1


def test_relative_change_rule_needs_three_jumps_in_a_row() -> None:
    factors = {40: 10.0, 41: 100.0, 42: 1000.0, 50: 10.0}  # 50: a lone jump, not three
    with pytest.warns(AnomalyWarning, match="step 42: loss_jump"):
        run = train(60, poison=lambda s, y: y * factors.get(s, 1.0), check_every=10,
                    policies={"loss_spike": "record", "grad_norm_spike": "record"})
    jumps = [e.step for e in run.guard.events if e.kind == "loss_jump"]
    assert jumps == [42]
    assert run.guard.policies["loss_jump"] == "warn"


def test_rolling_threshold_is_recomputed_after_every_push_and_load() -> None:
    from torchverity.training._stats import RollingStats

    def fresh(stats: RollingStats) -> tuple[torch.Tensor, torch.Tensor]:
        copy = RollingStats(2, 8, torch.device("cpu"))
        copy.load_state_dict(stats.state_dict())
        return copy.threshold(6.0, 3, 1e-3, 1e-8)

    stats = RollingStats(2, 8, torch.device("cpu"))
    seen = []
    for i in range(12):
        stats.push(torch.tensor([1.0 + i % 3, 10.0 - i]), torch.tensor(i != 5))
        thr, ready = stats.threshold(6.0, 3, 1e-3, 1e-8)
        assert thr is stats.threshold(6.0, 3, 1e-3, 1e-8)[0]  # cached until the next push
        want_thr, want_ready = fresh(stats)
        assert torch.equal(thr, want_thr) and torch.equal(ready, want_ready)
        seen.append(thr.clone())
    assert len({tuple(t.tolist()) for t in seen}) > 6  # it did move with the pushes
    other = RollingStats(2, 8, torch.device("cpu"))
    other.threshold(6.0, 3, 1e-3, 1e-8)
    other.load_state_dict(stats.state_dict())
    assert torch.equal(other.threshold(6.0, 3, 1e-3, 1e-8)[0], seen[-1])
    assert not torch.equal(other.threshold(5.0, 3, 1e-3, 1e-8)[0], seen[-1])  # other sigma


_DRILL_POLICIES = {"weights_changed": "record", "loss_spike": "replay", "loss_jump": "record",
                   "layer_grad_spike": "record", "update_ratio_spike": "skip"}


def _drill(stats: str, update_ratio: bool, faulty: bool = True, steps: int = 70
           ) -> tuple[TrainingGuard, torch.nn.Module]:
    """Every detector fires once (faulty) on the same run; the guard's rules run on ``stats``."""
    make_opt = None if update_ratio else (lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True))
    model, opt = make_model(make_opt)

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    # update_ratio=True keeps the undo copy; without it the CPU skip is decided on the host.
    guard = make_guard(model, opt, step_fn=step_fn, stats=stats, check_every=5, rest_every=1,
                          min_samples=20, window=64, per_layer=True, update_ratio=update_ratio,
                          policies=_DRILL_POLICIES)
    injector = faults.FaultInjector(model)
    factors: dict[int, float] = {}
    if faulty:
        injector.gradient("0.weight", step=0, value=math.nan)
        injector.gradient("2.bias", step=12, value=math.inf)
        injector.parameter("0.bias", step=20, index=3, bit=faults.mantissa_lsb(torch.float32))
        injector.gradient("2.bias", step=38, value=40.0)
        factors = {30: 1e3, 44: 10.0, 45: 100.0, 46: 1000.0}
    for step in range(steps):
        injector.begin_step(step)
        opt.param_groups[0]["lr"] = 1.0 if faulty and step == 60 else 1e-2
        x, y = batch_at(step)
        guard.train_step((x, y * factors.get(step, 1.0)))
    guard.close()
    return guard, model


@pytest.mark.parametrize("update_ratio", [True, False])
def test_rules_on_floats_and_on_the_device_find_the_same_events(update_ratio: bool) -> None:
    runs = {stats: _drill(stats, update_ratio) for stats in ("host", "device")}
    (host, host_model), (device, device_model) = runs["host"], runs["device"]
    assert host._host is not None and device._host is None

    def seen(guard: TrainingGuard) -> list[tuple[int, str, str, tuple[str, ...], str | None]]:
        return [(e.step, e.kind, e.action, e.suspects, e.replay) for e in guard.events]

    assert seen(host) == seen(device)
    found = {(e.step, e.kind): e for e in host.events}
    expected = {(0, "nonfinite_grad"), (12, "nonfinite_grad"), (20, "weights_changed"),
                (30, "loss_spike"), (38, "layer_grad_spike"), (46, "loss_jump")}
    if update_ratio:
        expected.add((60, "update_ratio_spike"))
    assert expected <= set(found), sorted(found)
    assert found[(20, "weights_changed")].suspects == ("0.bias",)
    assert found[(38, "layer_grad_spike")].suspects == ("2.bias",)
    assert found[(12, "nonfinite_grad")].suspects == ("2.bias",)
    assert found[(30, "loss_spike")].replay == "reproducible"
    # Values agree to float32 rounding (the host sums in float64).
    for mine, theirs in zip(host.events, device.events, strict=True):
        assert mine.values == pytest.approx(theirs.values, rel=1e-5, nan_ok=True)
        assert mine.thresholds == pytest.approx(theirs.thresholds, rel=1e-4)
    assert host.summary() == device.summary()
    for a, b in zip(host_model.parameters(), device_model.parameters(), strict=True):
        assert bits(a) == bits(b)


@pytest.mark.parametrize("stats", ["host", "device"])
def test_clean_runs_raise_nothing_on_either_path(stats: str) -> None:
    guard, _ = _drill(stats, update_ratio=True, faulty=False, steps=150)
    assert guard.events == [] and guard.summary().skipped == 0


def test_rules_run_on_floats_by_default_on_the_cpu() -> None:
    model, opt = make_model()
    on_floats, on_device = make_guard(model, opt), make_guard(model, opt, stats="device")
    assert on_floats._host is not None and on_floats._rules is None  # no device buffers
    assert on_device._host is None and on_device._rules is not None
    with pytest.raises(UsageError, match="unknown stats='gpu'"):
        make_guard(model, opt, stats="gpu")


def test_host_rolling_stats_follow_the_device_rule_and_share_its_checkpoint_layout() -> None:
    from torchverity.training._host_rules import HostRollingStats
    from torchverity.training._stats import RollingStats

    gen = torch.Generator().manual_seed(9)
    rows = (torch.randn(40, 3, generator=gen) * torch.tensor([1.0, 50.0, 1e-3]) + 7).tolist()
    device, host = RollingStats(3, 16, torch.device("cpu")), HostRollingStats(3, 16)
    rule = (6.0, 8, 1e-3, 1e-8)
    for i, row in enumerate(rows):
        accept = i % 5 != 2  # rejected rows leave both windows untouched
        device.push(torch.tensor(row), torch.tensor(accept))
        host.push(row, accept)
        thr, ready = device.threshold(*rule)
        host_thr, host_ready = host.threshold(*rule)
        assert host_thr == pytest.approx(thr.tolist(), rel=1e-5) and host_ready == bool(ready)
    # Either loads the other's state: a checkpoint works whichever path wrote it.
    into_host, into_device = HostRollingStats(3, 16), RollingStats(3, 16, torch.device("cpu"))
    into_host.load_state_dict(device.state_dict())
    into_device.load_state_dict(host.state_dict())
    assert into_host.threshold(*rule)[0] == pytest.approx(thr.tolist(), rel=1e-5)
    assert into_device.threshold(*rule)[0].tolist() == pytest.approx(thr.tolist(), rel=1e-5)


@pytest.mark.parametrize("stats", ["host", "device"])
@pytest.mark.parametrize("max_norm", [0.05, 1e6])  # clipped every step / never
def test_clip_grad_norm_gives_torchs_total_and_gradients_bit_for_bit(
        stats: str, max_norm: float) -> None:
    ref, ref_opt = make_model()
    model, opt = make_model()
    guard = make_guard(model, opt, stats=stats, check_every=3)
    clipped = []
    for step in range(8):
        x, y = batch_at(step)
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        guard.check(torch.nn.functional.mse_loss(model(x), y).detach())
        got = guard.clip_grad_norm_(max_norm)
        assert torch.equal(got, want)
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(
            model.parameters(), ref.parameters(), strict=True))
        clipped.append(bool(want > max_norm))
        ref_opt.step()
        guard.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(),
                                                   strict=True))
    assert clipped == [max_norm < 1] * 8  # both branches were taken where meant
    assert guard.close().clean


def test_clip_grad_norm_leaves_the_rules_the_norm_before_clipping() -> None:
    model, opt = make_model()
    guard = make_guard(model, opt, min_samples=20, window=64,
                          policies={"grad_norm_spike": "skip"})
    injector = faults.FaultInjector(model)
    injector.gradient("0.weight", step=30, index=3, value=1e4)  # a huge, finite gradient
    for step in range(40):
        injector.begin_step(step)
        opt.zero_grad()
        x, y = batch_at(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.check(loss)
        total = guard.clip_grad_norm_(1.0)
        guard.step()
        if step == 30:
            spike_total = float(total)
    guard.close()
    [event] = guard.events
    assert (event.step, event.kind, event.action) == (30, "grad_norm_spike", "skipped")
    assert event.values["grad_norm"] == pytest.approx(spike_total) and spike_total > 1e3
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_clip_grad_norm_outside_check_and_step_is_refused() -> None:
    model, opt = make_model()
    guard = make_guard(model, opt)
    with pytest.raises(UsageError, match=r"clip_grad_norm_\(\) called before this step's "
                                         r"check\(\)") as err:
        guard.clip_grad_norm_(1.0)
    assert "then guard.clip_grad_norm_(max_norm), then guard.step()" in str(err.value)
    step_once(guard, model, 0)
    with pytest.raises(UsageError, match="before this step's check"):
        guard.clip_grad_norm_(1.0)
    loss = torch.nn.functional.mse_loss(model(X[:8]), Y[:8])
    loss.backward()
    guard.check(loss)
    guard.clip_grad_norm_(1e-3)
    with pytest.raises(UsageError, match="or twice in one step"):  # the norms are stale now
        guard.clip_grad_norm_(1e-3)
