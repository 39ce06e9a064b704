"""TrainingGuard: faults injected into real training are caught, located and handled; clean runs
raise nothing; the per-step path never synchronises with the host."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from torchverity import faults
from torchverity.cli._output import dumps
from torchverity.errors import TrainingAnomalyError, UsageError
from torchverity.training import AnomalyWarning, TrainingGuard
from torchverity.training._checksum import (
    PairedSums,
    WordSums,
    balanced_cut,
    checksums,
    run_beside,
)

X = torch.randn(512, 16, generator=torch.Generator().manual_seed(1))
Y = X @ torch.randn(16, 1, generator=torch.Generator().manual_seed(2)) + 0.1


def batch_at(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    i = (step * 32) % 512
    return X[i: i + 32], Y[i: i + 32]


MakeOptimizer = Callable[[Any], torch.optim.Optimizer]


def make_model(make_opt: MakeOptimizer | None = None
               ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    if make_opt is not None:
        return model, make_opt(model.parameters())
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


@dataclass
class Run:
    guard: TrainingGuard
    model: torch.nn.Module
    final_loss: float
    detected_at: dict[int, int]  # anomaly step -> step after which the host knew


def train(
    steps: int,
    plan: Callable[[faults.FaultInjector], Any] | None = None,
    poison: Callable[[int, torch.Tensor], torch.Tensor] | None = None,  # applied to targets
    close: bool = True,
    make_opt: MakeOptimizer | None = None,
    **options: Any,
) -> Run:
    model, opt = make_model(make_opt)

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    options.setdefault("step_fn", step_fn)
    options.setdefault("min_samples", 20)
    options.setdefault("window", 64)
    guard = TrainingGuard(model, opt, **options)
    injector = faults.FaultInjector(model)
    if plan:
        plan(injector)
    detected: dict[int, int] = {}
    for step in range(steps):
        injector.begin_step(step)
        x, y = batch_at(step)
        if poison:
            y = poison(step, y)
        guard.train_step((x, y))
        for e in guard.events:
            detected.setdefault(e.step, step)
    if close:
        guard.close()
        for e in guard.events:
            detected.setdefault(e.step, steps)
    with torch.no_grad():
        final = float(torch.nn.functional.mse_loss(model(X), Y))
    return Run(guard, model, final, detected)


@pytest.fixture(scope="module")
def clean() -> Run:
    return train(300, check_every=10, rest_every=1, per_layer=True, update_ratio=True)


def test_clean_run_of_300_steps_raises_nothing(clean: Run) -> None:
    assert clean.guard.events == []
    summary = clean.guard.summary()
    assert summary.steps == 300 and summary.clean and summary.skipped == 0
    assert clean.final_loss < 0.05


@pytest.mark.parametrize(
    ("name", "how"), [("0.weight", {"bit": 30}), ("2.bias", {"value": math.nan})]
)
def test_faults_in_parameters_stop_the_run_within_one_interval_naming_the_tensor(
    name: str, how: dict[str, float]
) -> None:
    with pytest.raises(TrainingAnomalyError) as info:
        train(60, lambda inj: inj.parameter(name, step=45, index=0, **how), check_every=10,
              rest_every=1, close=False)
    err = info.value
    assert (err.step, err.kind, err.suspects) == (45, "weights_changed", [name])
    assert err.hint == "pass log='events.jsonl' to TrainingGuard to keep events"


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


def test_lowest_mantissa_bit_flip_between_steps_is_caught_and_named() -> None:
    bit = faults.mantissa_lsb(torch.float32)
    run = train(30, lambda inj: inj.parameter("2.weight", step=17, index=7, bit=bit),
                check_every=5, rest_every=1, policies={"weights_changed": "record"})
    assert [(e.step, e.kind, e.suspects) for e in run.guard.events] == [
        (17, "weights_changed", ("2.weight",))
    ]


def test_flip_in_optimizer_state_is_named() -> None:
    model, opt = make_model()
    guard = TrainingGuard(model, opt, check_every=1, rest_every=1,
                          policies={"weights_changed": "record"})
    for step in range(6):
        if step == 4:
            faults.flip_bit(opt.state[model[0].bias]["exp_avg_sq"], index=2, bit=0)
        opt.zero_grad()
        x, y = batch_at(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.check(loss)
        guard.step()
    assert [(e.step, e.suspects) for e in guard.events] == [(4, ("optimizer.0.bias.exp_avg_sq",))]


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


def test_warn_policy_warns(recwarn: pytest.WarningsRecorder) -> None:
    train(30, lambda inj: inj.parameter("0.bias", step=12, index=4, bit=0), check_every=5,
          rest_every=1, policies={"weights_changed": "warn"})
    messages = [str(w.message) for w in recwarn if issubclass(w.category, AnomalyWarning)]
    assert len(messages) == 1
    assert messages[0].startswith("torchverity: training anomaly at step 12: weights_changed (")
    assert messages[0].endswith(") in 0.bias")


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
    # A tiny fault (a low mantissa bit) moves nothing a threshold could see; the
    # bit-exact replay still notices the step did not compute the same thing twice.
    bit = faults.mantissa_lsb(torch.float32)
    run = train(40, lambda inj: inj.activation("0", step=24, index=9, bit=bit + 3),
                check_every=10, replay_every=4, replay_tolerance=0.0,
                policies={"replay_mismatch": "skip"})
    assert [(e.step, e.kind) for e in run.guard.events] == [(24, "replay_mismatch")]
    assert run.guard.events[0].suspects == ("2.weight",)  # the layer after the fault


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


# ------------------------------------------------------------ no host sync


_SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__",
                 "__index__", "nonzero", "__array__")


@contextmanager
def count_syncs() -> Iterator[list[str]]:
    calls: list[str] = []
    originals = {m: getattr(torch.Tensor, m) for m in _SYNC_METHODS}

    def wrap(name: str, fn: Any) -> Any:
        def counted(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            calls.append(name)
            return fn(self, *a, **k)

        return counted

    try:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, wrap(name, fn))
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


@pytest.mark.parametrize("fused", [False, True])
def test_hot_path_never_reads_the_device(fused: bool) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True) if fused
           else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    # host_skip=False: the device-side skip an accelerator uses, proven on the CPU.
    guard = TrainingGuard(model, opt, check_every=50, per_layer=True, update_ratio=not fused,
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


# ------------------------------------------------------------ usage errors


def test_misuse_is_reported() -> None:
    model, opt = make_model()
    guard = TrainingGuard(model, opt)
    with pytest.raises(UsageError, match=r"step\(\) called before check"):
        guard.step()
    loss = model(X[:4]).sum()
    loss.backward()
    guard.check(loss)
    with pytest.raises(UsageError, match="called twice"):
        guard.check(loss)
    with pytest.raises(UsageError, match="needs checkpoint_dir"):
        TrainingGuard(model, opt, policy="rollback")
    with pytest.raises(UsageError, match="unknown policy 'explode'"):
        TrainingGuard(model, opt, policies={"loss_spike": "explode"})
    with pytest.raises(UsageError, match="replay needs step_fn"):
        TrainingGuard(model, opt, replay_every=5)
    with pytest.raises(UsageError, match="unknown options: chek_every"):
        TrainingGuard(model, opt, chek_every=5)
    with pytest.raises(UsageError, match=r"rest_every must be an integer >= 1, not None") as err:
        TrainingGuard(model, opt, rest_every=None)
    assert "rest_every=1 verifies every update window" in str(err.value)


# ------------------------------------------------------------ rollback


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
        "guard-step00000250.pt", "guard-step00000250.pt.meta.json", "guard-step00000250.pt.sha256",
        "guard-step00000300.pt", "guard-step00000300.pt.meta.json", "guard-step00000300.pt.sha256",
    ]


def test_rollback_refuses_a_checkpoint_corrupted_on_disk(tmp_path: Path) -> None:
    from torchverity.errors import IntegrityError
    from torchverity.inject import flip_bit

    model, opt = make_model()
    guard = TrainingGuard(model, opt, checkpoint_dir=tmp_path, check_every=1)
    flip_bit(guard.checkpoints[-1], offset=guard.checkpoints[-1].stat().st_size // 2, bit=3)
    with pytest.raises(IntegrityError):
        guard.rollback()


# ------------------------------------------------------------ at-rest checksum


def test_at_rest_checksum_catches_every_single_bit_flip_and_names_only_that_tensor() -> None:
    from torchverity.training._checksum import WordSums
    from torchverity.training._checksum import checksums as checksum

    gen = torch.Generator().manual_seed(3)
    tensors = [
        torch.randn(1100, 1000, generator=gen),  # beyond 2**20 words: chunk-weighted
        torch.randn(7, generator=gen, dtype=torch.float64),
        torch.randn(5, generator=gen).to(torch.bfloat16),  # odd byte count: padded
        torch.randn(3, 3, generator=gen).to(torch.float16).t(),  # non-contiguous
        torch.randint(0, 255, (9,), generator=gen, dtype=torch.uint8),
        torch.randn(40, 30, generator=gen),
    ]
    record = checksum(tensors)
    assert torch.equal(checksum(tensors, weighted=False), record[:, :1])
    # The per-step form (cached views, small tensors summed in one group) gives the same sums.
    grouped, grouped_plain = WordSums(tensors, weighted=True), WordSums(tensors, weighted=False)
    assert torch.equal(grouped(), record) and torch.equal(grouped_plain(), record[:, :1])
    with_empty = [torch.zeros(0), torch.ones(3), torch.zeros(0, dtype=torch.int8), tensors[1]]
    assert torch.equal(WordSums(with_empty, weighted=True)(), checksum(with_empty))
    for i, t in enumerate(tensors):
        for index in (0, t.numel() // 3, t.numel() - 1):
            for bit in range(8 * t.element_size()):
                faults.flip_bit(t, index, bit)
                plain = (checksum(tensors, weighted=False) != record[:, :1]).any(dim=1)
                changed = (checksum(tensors) != record).any(dim=1).tolist()
                assert plain.tolist() == changed
                assert (grouped_plain() != record[:, :1]).any(dim=1).tolist() == changed
                faults.flip_bit(t, index, bit)
                assert changed == [j == i for j in range(len(tensors))], (i, index, bit)
    assert torch.equal(checksum(tensors), record)
    big = tensors[0].view(-1)
    # A swap keeps the plain sum; the position-weighted one sees it.
    big[[10, 20 + (1 << 20)]] = big[[20 + (1 << 20), 10]]
    now = checksum(tensors)
    assert (now[:, 0] != record[:, 0]).tolist() == [False] * 6
    assert (now[:, 1] != record[:, 1]).tolist() == [True] + [False] * 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hot_path_never_synchronises_on_cuda() -> None:
    device = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 1)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True)
    guard = TrainingGuard(model, opt, check_every=1000, per_layer=True, update_ratio=True,
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


# ------------------------------------------------------------ opt-in and rule-based detectors


def test_layer_grad_spike_names_the_layer_and_is_silent_otherwise() -> None:
    run = train(60, lambda inj: inj.gradient("2.bias", step=45, value=40.0), check_every=10,
                per_layer=True, policies={"layer_grad_spike": "skip", "grad_norm_spike": "record"})
    layer = [e for e in run.guard.events if e.kind == "layer_grad_spike"]
    assert [(e.step, e.suspects) for e in layer] == [(45, ("2.bias",))]
    assert layer[0].values["grad_norm[2.bias]"] == pytest.approx(40.0, rel=0.01)
    assert {e.step for e in run.guard.events} == {45}


def test_update_ratio_spike_catches_a_learning_rate_blunder() -> None:
    model, opt = make_model()
    guard = TrainingGuard(model, opt, update_ratio=True, check_every=10, min_samples=20,
                          window=64, policies={"update_ratio_spike": "skip"})
    for step in range(60):
        opt.param_groups[0]["lr"] = 1.0 if step == 50 else 1e-2  # one step with lr x100
        opt.zero_grad()
        x, y = batch_at(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.check(loss)
        guard.step()
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


def test_skip_restores_optimizer_state_even_when_at_rest_leaves_it_out() -> None:
    model, opt = make_model()
    guard = TrainingGuard(model, opt, optimizer_state=False, check_every=1)
    injector = faults.FaultInjector(model)
    injector.gradient("0.bias", step=5, value=math.nan)
    for step in range(7):
        injector.begin_step(step)
        if step == 5:
            before = {k: v.clone() for k, v in opt.state[model[0].bias].items()}
        opt.zero_grad()
        x, y = batch_at(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.check(loss)
        guard.step()
        if step == 5:
            after = opt.state[model[0].bias]
            assert all(torch.equal(before[k], after[k]) for k in before)
    assert [(e.step, e.kind) for e in guard.events] == [(5, "nonfinite_grad")]
    assert all(torch.isfinite(t).all() for s in opt.state.values() for t in s.values())


def test_bfloat16_model_is_guarded_and_a_flip_in_it_is_named() -> None:
    model, _ = make_model()
    model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = TrainingGuard(model, opt, check_every=4, rest_every=1, per_layer=True,
                          update_ratio=True, policies={"weights_changed": "record"})
    for step in range(12):
        if step == 9:
            faults.flip_bit(model[2].weight, index=4, bit=faults.mantissa_lsb(torch.bfloat16))
        opt.zero_grad()
        x, y = batch_at(step)
        loss = torch.nn.functional.mse_loss(model(x.bfloat16()), y.bfloat16())
        loss.backward()
        guard.check(loss)
        guard.step()
    guard.close()
    assert [(e.step, e.kind, e.suspects) for e in guard.events] == [
        (9, "weights_changed", ("2.weight",))
    ]


@pytest.mark.parametrize("stats", ["host", "device"])
def test_fused_optimizer_skips_exactly_without_copies(stats: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = TrainingGuard(model, opt, check_every=5, host_skip=False, stats=stats)
    assert guard._fused_skip and not guard._needs_backup and not guard._host_skip

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


def test_at_rest_follows_a_parameter_whose_storage_moved() -> None:
    model, opt = make_model()
    guard = TrainingGuard(model, opt, check_every=1, rest_every=1,
                          policies={"weights_changed": "record"})
    for step in range(6):
        if step == 2:  # a new storage with the same bits: nothing to report
            model[0].weight.data = model[0].weight.data.clone()
        if step == 4:
            model[2].bias.data = model[2].bias.data.clone()
            faults.flip_bit(model[2].bias, 0, 0)
        opt.zero_grad()
        x, y = batch_at(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.check(loss)
        guard.step()
    guard.close()
    assert [(e.step, e.kind, e.suspects) for e in guard.events] == [
        (4, "weights_changed", ("2.bias",))
    ]


# ------------------------------------------------------------ host skip (parameters on the CPU)


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


def _bits(t: torch.Tensor) -> list[int]:
    return t.detach().reshape(-1).view(torch.int32).tolist()


@pytest.mark.parametrize("opt_name", sorted(_OPTIMIZERS))
def test_host_skip_and_device_skip_give_the_same_events_and_bits(opt_name: str,
                                                                 tmp_path: Path) -> None:
    host = _faulty_run(_OPTIMIZERS[opt_name], True, tmp_path / "host.jsonl")
    device = _faulty_run(_OPTIMIZERS[opt_name], False, tmp_path / "device.jsonl")
    assert host.guard._host_skip and not device.guard._host_skip
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
        assert _bits(a) == _bits(b)
    opt_h, opt_d = host.guard.optimizer, device.guard.optimizer
    for a, b in zip(host.model.parameters(), device.model.parameters(), strict=True):
        assert opt_h.state[a].keys() == opt_d.state[b].keys()
        assert all(torch.equal(opt_h.state[a][k], opt_d.state[b][k]) for k in opt_h.state[a])


def test_cpu_parameters_skip_on_the_host_exactly_and_never_copy() -> None:
    model, opt = make_model()
    guard = TrainingGuard(model, opt, check_every=5)
    assert guard._host_skip

    def after(step: int) -> None:
        if step == 0:  # skipped before the optimizer ever ran: it created no state
            assert not opt.state

    _skip_drill(model, opt, guard, after)
    assert guard._snapshot.copies == [] and guard._snapshot.live == []
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
        opt.zero_grad()
        x, y = batch_at(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.check(loss)
        guard.step()
        after(step)
        if step == 7:
            assert all(_bits(a) == _bits(p) for a, p in zip(params, model.parameters(),
                                                            strict=True))
            for before, p in zip(state, model.parameters(), strict=True):
                assert all(_bits(before[k]) == _bits(opt.state[p][k]) for k in before)
    guard.close()
    assert [(e.step, e.kind, e.action) for e in guard.events] == [
        (0, "nonfinite_grad", "skipped"), (7, "nonfinite_grad", "skipped")]
    assert all(float(s["step"]) == 10 for s in opt.state.values())


def test_host_skip_falls_back_to_the_device_copy_where_it_cannot_apply() -> None:
    model, opt = make_model()
    # Update ratios are known only after the update: undoing it needs the copy.
    assert not TrainingGuard(model, opt, update_ratio=True)._host_skip
    assert not TrainingGuard(model, opt, host_skip=False)._host_skip
    assert not TrainingGuard(model, opt, policy="record")._host_skip  # nothing ever skips
    assert TrainingGuard(model, opt)._host_skip


# ------------------------------------------------------------ helper thread (CPU, a spare core)


def _step(guard: TrainingGuard, model: torch.nn.Module, step: int) -> None:
    guard.optimizer.zero_grad()
    x, y = batch_at(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    guard.check(loss)
    guard.step()


def _flip_drill(guard: TrainingGuard, model: torch.nn.Module,
                flips: dict[int, tuple[str, Callable[[], torch.Tensor], int]], *,
                wait: bool = False) -> None:
    """Ten steps, flipping a bit after the steps in ``flips``; each flip is reported at the
    next step as ``weights_changed`` naming its tensor. ``wait``: let the helper take each
    record before the flip."""
    for step in range(10):
        _step(guard, model, step)
        if wait:
            guard.wait()
        if step in flips:
            _, tensor, bit = flips[step]
            faults.flip_bit(tensor(), 3, bit)
    guard.close()
    assert [(e.step, e.kind, e.suspects) for e in guard.events] == [
        (step + 1, "weights_changed", (name,)) for step, (name, _, _) in flips.items()]



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
        assert _bits(a) == _bits(b)


@pytest.mark.parametrize("check_every", [1, 3])
def test_a_flip_right_after_step_returns_is_caught_and_named(check_every: int) -> None:
    """The record is complete when step() returns, though half of it ran on the helper."""
    model, opt = make_model()
    guard = TrainingGuard(model, opt, check_every=check_every, rest_every=1, overlap=True,
                          policies={"weights_changed": "record"})
    assert guard._helper is not None
    lsb = faults.mantissa_lsb(torch.float32)
    flips = {4: ("2.weight", lambda: model[2].weight, lsb),
             5: ("0.bias", lambda: model[0].bias, lsb),  # with interval 3: right after a read
             7: ("optimizer.0.weight.exp_avg_sq", lambda: opt.state[model[0].weight]["exp_avg_sq"],
                 0)}
    _flip_drill(guard, model, flips)
    assert guard._helper is None  # shut down with the guard


def test_clean_run_with_the_helper_raises_nothing() -> None:
    model, opt = make_model()
    guard = TrainingGuard(model, opt, check_every=7, rest_every=1, overlap=True, per_layer=True,
                          min_samples=20, window=64)
    for step in range(200):
        _step(guard, model, step)
    summary = guard.close()
    assert guard.events == [] and summary.skipped == 0 and summary.steps == 200


def test_hot_path_with_the_helper_never_reads_the_device() -> None:
    model, opt = make_model(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9))
    guard = TrainingGuard(model, opt, check_every=50, overlap=True, host_skip=False,
                          stats="device", update_ratio=True)
    with count_syncs() as calls:
        for step in range(12):
            _step(guard, model, step)
        guard.wait()
    assert calls == []
    guard.close()


def test_helper_thread_is_opt_in() -> None:
    model, opt = make_model()
    assert TrainingGuard(model, opt)._helper is None
    assert TrainingGuard(model, opt, overlap=True)._helper is not None


def test_paired_sums_equal_the_single_thread_sums_and_locate_every_flip() -> None:
    gen = torch.Generator().manual_seed(5)
    tensors = [torch.randn(300, 200, generator=gen), torch.randn(7, generator=gen),
               torch.randn(5, generator=gen).to(torch.bfloat16),
               torch.randn(90, 100, generator=gen), torch.randint(0, 9, (3,), generator=gen),
               torch.randn(40, 30, generator=gen)]
    record = checksums(tensors, weighted=False)
    with ThreadPoolExecutor(1) as pool:
        for weighted in (False, True):
            paired = PairedSums(tensors, weighted=weighted)
            expected = WordSums(tensors, weighted=weighted)()
            assert torch.equal(paired(), expected) and torch.equal(paired(pool), expected)
        paired = PairedSums(tensors, weighted=False)
        for i, t in enumerate(tensors):
            for index in (0, t.numel() - 1):
                faults.flip_bit(t, index, 0)
                changed = (paired(pool) != record).any(dim=1).tolist()
                faults.flip_bit(t, index, 0)
                assert changed == [j == i for j in range(len(tensors))], (i, index)
        assert torch.equal(paired(pool), record)
        assert torch.equal(PairedSums(tensors[:1], weighted=False)(pool), record[:1])
    assert paired.matches(tensors) and not paired.matches(tensors[::-1])


def test_balanced_cut_splits_the_bytes_evenly() -> None:
    assert balanced_cut([10, 1, 1, 10]) == 2
    assert balanced_cut([100, 1, 1]) == 1
    assert balanced_cut([1, 1, 100]) == 2
    assert balanced_cut([5]) == 1
    assert balanced_cut([]) == 0
    assert balanced_cut([3, 3, 3, 3]) == 2


def test_run_beside_uses_the_helper_when_free_and_never_waits_for_a_busy_one() -> None:
    here = threading.get_ident
    with ThreadPoolExecutor(1) as pool:
        started = threading.Event()

        def there() -> int:
            started.set()
            return threading.get_ident()

        a, b = run_beside(pool, lambda: (started.wait(10), here())[1], there)
        assert a == here() and b != a  # the free helper ran its half
        gate = threading.Event()
        pool.submit(gate.wait, 10)  # now busy with something else
        assert run_beside(pool, here, here) == (here(), here())  # both halves ran here
        gate.set()

        def fails() -> None:
            raise ValueError("half failed")

        with pytest.raises(ValueError, match="half failed"):
            run_beside(pool, here, fails)


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


# ------------------------------------------------------------ rules on floats (CPU) vs the device


_DRILL_POLICIES = {"weights_changed": "record", "loss_spike": "replay", "loss_jump": "record",
                   "layer_grad_spike": "record", "update_ratio_spike": "skip"}


def _drill(stats: str, update_ratio: bool, faulty: bool = True, steps: int = 70
           ) -> tuple[TrainingGuard, torch.nn.Module]:
    """Every detector fires once (faulty) on the same run; the guard's rules run on ``stats``."""
    make_opt = None if update_ratio else _OPTIMIZERS["adamw-fused"]
    model, opt = make_model(make_opt)

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    # update_ratio=True keeps the undo copy; without it the CPU skip is decided on the host.
    guard = TrainingGuard(model, opt, step_fn=step_fn, stats=stats, check_every=5, rest_every=1,
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
        assert _bits(a) == _bits(b)


@pytest.mark.parametrize("stats", ["host", "device"])
def test_clean_runs_raise_nothing_on_either_path(stats: str) -> None:
    guard, _ = _drill(stats, update_ratio=True, faulty=False, steps=150)
    assert guard.events == [] and guard.summary().skipped == 0


def test_rules_run_on_floats_by_default_on_the_cpu() -> None:
    model, opt = make_model()
    on_floats, on_device = TrainingGuard(model, opt), TrainingGuard(model, opt, stats="device")
    assert on_floats._host is not None and on_floats._rules is None  # no device buffers
    assert on_device._host is None and on_device._rules is not None
    with pytest.raises(UsageError, match="unknown stats='gpu'"):
        TrainingGuard(model, opt, stats="gpu")


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


# ------------------------------------------------------------ at-rest cadence


@pytest.mark.parametrize(("check_every", "rest_every", "caught"), [
    (5, None, [9]),  # the default, one window in 10: the one ending at update 10 (step 9)
    (1, None, [9]),  # the same windows at interval 1: the interval changes only the read
    (5, 1, [9, 11, 12]),  # every window
    (1, 1, [9, 11, 12]),
    (5, 4, [11]),  # windows ending at updates 4, 8, 12, ...: step 11, read at step 14
])
def test_at_rest_cadence_is_rest_every_whatever_the_check_interval(
        check_every: int, rest_every: int | None, caught: list[int]) -> None:
    def plan(inj: faults.FaultInjector) -> None:
        for step in (9, 11, 12):  # flipped before the step's forward: between two updates
            inj.parameter("2.weight", step=step, index=step, bit=faults.mantissa_lsb(
                torch.float32))

    cadence = {} if rest_every is None else {"rest_every": rest_every}
    run = train(20, plan, check_every=check_every, policies={"weights_changed": "record"},
                **cadence)
    assert [(e.step, e.kind, e.suspects) for e in run.guard.events] == [
        (s, "weights_changed", ("2.weight",)) for s in caught]
    # Reported at the first read of the step's row (steps 4, 9, 14, ... with interval 5):
    # when the interval divides rest_every, the read right after the verification.
    assert [run.detected_at[s] for s in caught] == [s + (-s - 1) % check_every for s in caught]


# ------------------------------------------------------------ deferred at-rest record (opt-in)


@pytest.mark.parametrize("check_every", [1, 3])
def test_deferred_record_catches_and_names_a_flip_made_once_the_record_is_taken(
        check_every: int) -> None:
    model, opt = make_model()
    guard = TrainingGuard(model, opt, check_every=check_every, rest_every=1, defer_record=True,
                          policies={"weights_changed": "record"})
    assert guard._helper is not None and not guard._split
    lsb = faults.mantissa_lsb(torch.float32)
    flips = {4: ("2.weight", lambda: model[2].weight, lsb),
             7: ("optimizer.0.weight.exp_avg_sq", lambda: opt.state[model[0].weight]["exp_avg_sq"],
                 0)}
    _flip_drill(guard, model, flips, wait=True)


def test_deferred_record_leaves_the_stretch_before_the_helper_reads_uncovered() -> None:
    """The documented limit: a flip after step() returns but before the helper has summed
    the tensor is part of the record (the helper is held here); the default catches it."""
    for defer, expected in ((True, []), (False, [(3, "weights_changed", ("0.bias",))])):
        model, opt = make_model()
        guard = TrainingGuard(model, opt, check_every=1, rest_every=1, defer_record=defer,
                              policies={"weights_changed": "record"})
        gate, calls = threading.Event(), []
        take = guard._deferred_record

        def held(sums: PairedSums, take: Callable[[PairedSums], None] = take,
                 gate: threading.Event = gate, calls: list[int] = calls) -> None:
            calls.append(len(calls))
            if len(calls) == 3:  # the record after step 2's update
                gate.wait(10)
            take(sums)

        guard._deferred_record = held  # type: ignore[method-assign]
        for step in range(5):
            _step(guard, model, step)
            if step == 2:
                faults.flip_bit(model[0].bias, 1, 0)  # after step() returned
                gate.set()
        guard.close()
        assert len(calls) == (5 if defer else 0)
        assert [(e.step, e.kind, e.suspects) for e in guard.events] == expected, defer


def test_deferred_record_clean_run_raises_nothing() -> None:
    model, opt = make_model()
    guard = TrainingGuard(model, opt, check_every=1, rest_every=1, defer_record=True,
                          min_samples=20, window=64)
    for step in range(120):
        _step(guard, model, step)
    assert guard.close().clean and guard.events == []


# ------------------------------------------------------------ clipping with check()'s norms


@pytest.mark.parametrize("stats", ["host", "device"])
@pytest.mark.parametrize("max_norm", [0.05, 1e6])  # clipped every step / never
def test_clip_grad_norm_gives_torchs_total_and_gradients_bit_for_bit(
        stats: str, max_norm: float) -> None:
    ref, ref_opt = make_model()
    model, opt = make_model()
    guard = TrainingGuard(model, opt, stats=stats, check_every=3)
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
    guard = TrainingGuard(model, opt, min_samples=20, window=64,
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
    guard = TrainingGuard(model, opt)
    with pytest.raises(UsageError, match=r"clip_grad_norm_\(\) called before this step's "
                                         r"check\(\)") as err:
        guard.clip_grad_norm_(1.0)
    assert "then guard.clip_grad_norm_(max_norm), then guard.step()" in str(err.value)
    _step(guard, model, 0)
    with pytest.raises(UsageError, match="before this step's check"):
        guard.clip_grad_norm_(1.0)
    loss = torch.nn.functional.mse_loss(model(X[:8]), Y[:8])
    loss.backward()
    guard.check(loss)
    guard.clip_grad_norm_(1e-3)
    with pytest.raises(UsageError, match="or twice in one step"):  # the norms are stale now
        guard.clip_grad_norm_(1e-3)
