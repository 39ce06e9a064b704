"""``torchverity report``: real guard logs summarised, tabulated, plotted; bad logs rejected."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from torchverity import faults
from torchverity.report import summarize
from torchverity.training import TrainingGuard


def _guarded_run(log: Path, steps: int = 40, *, close: bool = True,
                 nan_grads: tuple[int, ...] = (12,), inf_activation: bool = True) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(256, 8), torch.randn(256, 1)

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    guard = TrainingGuard(model, opt, log=log, check_every=5, step_fn=step_fn,
                          policies={"nonfinite_loss": "replay", "nonfinite_grad": "skip"})
    inj = faults.FaultInjector(model)
    for at in nan_grads:
        inj.gradient("2.bias", step=at, value=math.nan)
    if inf_activation:
        inj.activation("1", step=27, index=1, value=math.inf)
    for step in range(steps):
        inj.begin_step(step)
        guard.train_step((x[step % 8 * 32:][:32], y[step % 8 * 32:][:32]))
    if close:
        guard.close()


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("report") / "events.jsonl"
    _guarded_run(path)
    return path


def test_summary_counts_what_happened(log: Path) -> None:
    report = summarize(log)
    assert report.steps == 40 and report.finished and not report.torn_last_line
    assert [(a["step"], a["kind"]) for a in report.anomalies] == [
        (12, "nonfinite_grad"), (27, "nonfinite_loss"), (27, "nonfinite_grad")
    ]
    assert report.counts == {"nonfinite_grad": 2, "nonfinite_loss": 1}
    assert report.replays == {"transient": 1}
    # Step 12, then 27 held (replay latches) until the host read after step 29.
    assert report.skipped == 4 and report.first_anomaly_step == 12
    assert report.final_loss is not None and math.isfinite(report.final_loss)


def test_cli_report_table(log: Path, run_cli: Any,
                          golden: Callable[[str, str], None]) -> None:
    res = run_cli("report", log)
    assert res.code == 1, res.err  # the run had anomalies
    text = res.out.replace(str(log), "events.jsonl")
    golden("report_table.txt", text)
    assert res.err == ""


def test_cli_report_json_and_plot(log: Path, tmp_path: Path, run_cli: Any) -> None:
    png = tmp_path / "run.png"
    res = run_cli("report", log, "--plot", png, "--json")
    assert res.code == 1
    data = json.loads(res.out)
    assert data["ok"] is False and data["steps"] == 40 and data["plot"] == str(png)
    assert data["counts"] == {"nonfinite_grad": 2, "nonfinite_loss": 1}
    assert data["anomalies"][1]["replay"] == "transient"
    head = png.read_bytes()[:8]
    assert head == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _plot_labels(log: Path) -> list[tuple[str, Any]]:
    """The anomaly labels of the plot, drawn: their texts and boxes."""
    from matplotlib.text import Annotation

    from torchverity.report import _figure

    fig = _figure(log)
    fig.draw_without_rendering()
    # A label wrapped into columns reads as its words.
    return [(t.get_text().replace("\n", " "), t.get_window_extent()) for t in fig.axes[0].texts
            if isinstance(t, Annotation)]


def _overprinted(labels: list[tuple[str, Any]]) -> list[tuple[str, str]]:
    from itertools import combinations

    return [(a, b) for (a, box_a), (b, box_b) in combinations(labels, 2)
            if box_a.overlaps(box_b)]


def test_plot_labels_of_one_step_do_not_overprint(log: Path) -> None:
    """Step 27 has two anomalies: every kind is labelled at its step, and no two labels'
    drawn boxes intersect."""
    labels = _plot_labels(log)
    assert sorted(text for text, _ in labels) == ["nonfinite_grad",
                                                 "nonfinite_loss, nonfinite_grad"]
    assert _overprinted(labels) == []


def test_plot_labels_of_neighbouring_steps_do_not_overprint(tmp_path: Path) -> None:
    """Anomalies one step apart in a long run share a label that names both steps."""
    log = tmp_path / "events.jsonl"
    _guarded_run(log, steps=200, nan_grads=(80, 81, 150))
    labels = _plot_labels(log)
    assert _overprinted(labels) == []
    texts = [text for text, _ in labels]
    assert "80-81: nonfinite_grad" in texts and "nonfinite_grad" in texts


def test_exit_code_says_whether_the_run_had_anomalies(
        log: Path, tmp_path: Path, run_cli: Any) -> None:
    """A run with faults fails the report (exit 1, ok false); the same run without them
    passes (exit 0, ok true)."""
    clean = tmp_path / "clean.jsonl"
    _guarded_run(clean, nan_grads=(), inf_activation=False)
    for path, code in ((log, 1), (clean, 0)):
        res = run_cli("report", path, "--json")
        assert res.code == code, res.err
        data = json.loads(res.out)
        assert data["ok"] is (code == 0) and data["steps"] == 40
        assert bool(data["anomalies"]) is (code == 1)
        assert run_cli("report", path).code == code


def _events(path: Path, steps: int, anomalies: list[tuple[int, str]]) -> None:
    """An event log as TrainingGuard writes it (docs/formats/events.md): a loss falling
    from 1, and anomalies whose updates were skipped."""
    records: list[dict[str, Any]] = [{"event": "start", "time": 0.0, "rank": 0, "step": 0,
                                      "config": {}, "policies": {}, "parameters": ["w"]}]
    records += [{"event": "metrics", "time": float(step), "rank": 0, "step": step,
                 "loss": 1 / math.sqrt(step), "grad_norm": 1.0 + step % 7 / 7,
                 "applied": True} for step in range(1, steps + 1)]
    records += [{"event": "anomaly", "time": float(step), "rank": 0, "step": step,
                 "kind": kind, "policy": "skip", "action": "skipped", "values": {},
                 "thresholds": {}, "suspects": []} for step, kind in anomalies]
    records.append({"event": "summary", "time": steps + 1.0, "rank": 0, "steps": steps,
                    "anomalies": {}, "skipped": len(anomalies), "rollbacks": 0,
                    "replays": {}, "checkpoints": 0, "stopped": False})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_plot_labels_of_many_kinds_stay_inside_the_axes_and_off_the_curve(
        tmp_path: Path) -> None:
    """Three kinds at one step and two steps close together: every label lies within the
    loss axes, none overprints another, the legend or the loss curve."""
    from matplotlib.text import Annotation

    from torchverity.report import _figure

    log = tmp_path / "events.jsonl"
    _events(log, 1000, [(500, "loss_spike"), (502, "grad_norm_spike"), (700, "nonfinite_loss"),
                        (700, "nonfinite_grad"), (700, "loss_jump")])
    fig = _figure(log)
    fig.draw_without_rendering()
    ax = fig.axes[0]
    labels = [t for t in ax.texts if isinstance(t, Annotation)]
    assert sorted(t.get_text().replace("\n", " ") for t in labels) == [
        "500-502: loss_spike, grad_norm_spike", "nonfinite_loss, nonfinite_grad, loss_jump"]
    inside = ax.get_window_extent()
    boxes = [t.get_window_extent() for t in labels]
    assert all(inside.x0 <= b.x0 and b.x1 <= inside.x1 and inside.y0 <= b.y0
               and b.y1 <= inside.y1 + 1 for b in boxes), (inside, boxes)
    legend = ax.get_legend().get_window_extent()
    assert not any(b.overlaps(other) for i, b in enumerate(boxes)
                   for other in [*boxes[i + 1:], legend])
    curve = ax.lines[0]
    points = curve.get_transform().transform(curve.get_xydata())
    assert not any(b.contains(x, y) for b in boxes for x, y in points)


def test_crashed_run_with_torn_last_line_is_reported_not_fatal(
    tmp_path: Path, run_cli: Any
) -> None:
    log = tmp_path / "crashed.jsonl"
    _guarded_run(log, steps=20, close=False)
    with log.open("a") as fh:
        fh.write('{"event": "metrics", "step": 2')  # the process died mid-line
    report = summarize(log)
    assert not report.finished and report.torn_last_line and report.steps == 20
    res = run_cli("report", log)
    assert res.code == 1  # its anomaly, not the crash: a torn log is still read
    assert "no summary event: the run did not finish" in res.err
    assert "its last line is torn" in res.err


def test_bad_inputs_exit_2(tmp_path: Path, run_cli: Any) -> None:
    res = run_cli("report", tmp_path / "missing.jsonl")
    assert res.code == 2
    assert "missing.jsonl: no such file" in res.err
    assert "next: pass the log= path given to TrainingGuard" in res.err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"event": "start"}\nhello\n{"event": "summary"}\n')
    res = run_cli("report", bad)
    assert res.code == 2
    assert "bad.jsonl:2: not a torchverity event line" in res.err


def test_plot_without_matplotlib_says_which_extra(
    log: Path, tmp_path: Path, run_cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    res = run_cli("report", log, "--plot", tmp_path / "x.png")
    assert res.code == 2
    assert "torchverity report --plot needs the optional package 'matplotlib'" in res.err
    assert "next: pip install 'torchverity[plot]'" in res.err
    assert not (tmp_path / "x.png").exists()
