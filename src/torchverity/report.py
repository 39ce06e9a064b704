"""Read a TrainingGuard event log (JSONL): summary, anomaly table, and a plot.

>>> from torchverity.report import summarize          # doctest: +SKIP
>>> summarize("events.jsonl").counts                   # doctest: +SKIP
{'nonfinite_grad': 2}

The log format is documented in ``docs/formats/events.md``. A run that
crashed leaves a log without a ``summary`` event and perhaps a torn last
line; both are reported, not fatal.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchverity.errors import FormatError, InputError, require_extra

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class EventReport:
    """What an event log says about a run."""

    path: str
    steps: int
    counts: dict[str, int]
    anomalies: tuple[dict[str, Any], ...]
    skipped: int
    rollbacks: int
    replays: dict[str, int]
    checkpoints: int
    first_anomaly_step: int | None
    final_loss: float | None
    finished: bool
    torn_last_line: bool

    @property
    def clean(self) -> bool:
        """No detector fired and no update was skipped or rolled back."""
        return not self.anomalies and not self.skipped and not self.rollbacks


def _number(value: Any) -> float:
    """JSON numbers, or the strings ``"nan"``/``"inf"``/``"-inf"`` the log uses for them."""
    return float(value) if isinstance(value, (int, float, str)) else math.nan


def iter_events(path: str | Path) -> Iterator[dict[str, Any]]:
    """Yield the log's records one by one; a torn (unterminated) last line is skipped."""
    for record, _torn in _records(Path(path)):
        if record is not None:
            yield record


def _parse_event(line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(record, dict) or not isinstance(record.get("event"), str):
        raise ValueError("not an event object")
    return record


def _records(p: Path) -> Iterator[tuple[dict[str, Any] | None, bool]]:
    try:
        fh = p.open("rb")
    except FileNotFoundError:
        raise InputError(f"{p}: no such file", path=p,
                         hint="pass the log= path given to TrainingGuard") from None
    except OSError as exc:
        raise InputError(f"{p}: cannot read: {exc.strerror}", path=p) from None
    with fh:
        for number, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")  # UnicodeDecodeError is a ValueError
                record = _parse_event(line)
            except ValueError as exc:
                if not raw.endswith(b"\n"):  # the writer died mid-line: the run crashed
                    yield None, True
                    return
                raise FormatError(f"{p}:{number}: not a torchverity event line ({exc})", path=p,
                                  hint="event logs are written by TrainingGuard(log=...)") from None
            yield record, False


def summarize(path: str | Path) -> EventReport:
    """Summarise an event log (streamed: memory does not grow with the number of steps)."""
    p = Path(path)
    counts: Counter[str] = Counter()
    replays: Counter[str] = Counter()
    anomalies: list[dict[str, Any]] = []
    steps, skipped, rollbacks, checkpoints = 0, 0, 0, 0
    final_loss: float | None = None
    finished = torn = False
    for record, torn_line in _records(p):
        torn = torn or torn_line
        if record is None:
            continue
        kind = record["event"]
        if kind == "metrics":
            steps += 1
            skipped += 0 if record.get("applied", True) else 1
            final_loss = _number(record.get("loss"))
        elif kind == "anomaly":
            anomalies.append(record)
            counts[str(record.get("kind"))] += 1
        elif kind == "replay":
            replays[str(record.get("classification"))] += 1
        elif kind == "rollback":
            rollbacks += 1
        elif kind == "checkpoint":
            checkpoints += 1
        elif kind == "summary":
            finished = True
    first = min((int(a["step"]) for a in anomalies), default=None)
    return EventReport(str(p), steps, dict(counts), tuple(anomalies), skipped, rollbacks,
                       dict(replays), checkpoints, first, final_loss, finished, torn)


def plot(path: str | Path, out: str | Path) -> Path:
    """Draw loss and gradient norm per step, with anomalies marked, into a PNG."""
    require_extra("matplotlib", extra="plot", feature="torchverity report --plot")
    target = Path(out)
    _figure(path).savefig(target, dpi=110)
    return target


def _figure(path: str | Path) -> Figure:
    """The plot as a matplotlib Figure of its own (not pyplot's, whose backend is global)."""
    from matplotlib.figure import Figure

    steps, losses, norms, marks = _series(path)
    fig = Figure(figsize=(9, 5.5))
    ax_loss, ax_norm = fig.subplots(2, 1, sharex=True)
    ax_loss.plot(steps, losses, lw=1, color="tab:blue")
    ax_norm.plot(steps, norms, lw=1, color="tab:green")
    ax_loss.set_ylabel("loss")
    ax_norm.set_ylabel("grad norm")
    ax_norm.set_xlabel("step")
    for ax in (ax_loss, ax_norm):
        if all(v > 0 for v in (losses if ax is ax_loss else norms) if math.isfinite(v)):
            ax.set_yscale("log")
        for i, (step, _kind) in enumerate(marks):
            ax.axvline(step, color="tab:red", ls="--", lw=0.8,
                       label="anomaly" if i == 0 and ax is ax_loss else None)
    if marks:
        # Above the axes, at the right: inside, it would sit where the labels go.
        ax_loss.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), frameon=False,
                       fontsize="small", borderaxespad=0.1)
    ax_loss.set_title(f"{Path(path).name}: {len(steps)} steps, {len(marks)} anomalies")
    fig.tight_layout()
    if marks:
        _label_anomalies(fig, ax_loss, marks)
    return fig


_LABEL_PT = 7  # the anomaly labels' font size
# The share of the loss axes' height a label may run down from the top; the curve is
# moved below the labels, so this bounds how much of the height it gives up.
_LABEL_SHARE = 0.45


def _label_anomalies(fig: Figure, ax: Any, marks: list[tuple[int, str]]) -> None:
    """Label the anomaly lines at the top of ``ax``: rotated to run down each line, wrapped
    into columns to stay in the top of the axes, one label for steps closer than a label is
    thick, and the curve scaled to stay below them."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.font_manager import FontProperties

    renderer = FigureCanvasAgg(fig).get_renderer()
    font = FontProperties(size=_LABEL_PT)
    to_pt = 72 / fig.dpi
    box = ax.get_window_extent(renderer)

    def fits(line: str) -> bool:
        width, _, _ = renderer.get_text_width_height_descent(line, font, ismath=False)
        return width * to_pt <= box.height * to_pt * _LABEL_SHARE

    lo, hi = ax.get_xlim()
    width_pt = box.width * to_pt
    columns, labels = 1, []
    while True:  # wider labels need a wider gap, whose merged labels may be wider still
        gap = (hi - lo) * _LABEL_PT * 1.2 * columns * 1.5 / width_pt if width_pt > 0 else 0.0
        labels = [(step, _wrapped(text, fits)) for step, text in _labels_by_step(marks, gap)]
        widest = max(text.count("\n") + 1 for _, text in labels)
        if widest <= columns:
            break
        columns = widest
    for step, text in labels:
        ax.annotate(text, (step, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                    va="top", ha="right", fontsize=_LABEL_PT, color="tab:red",
                    linespacing=1.2)
    _make_room_below(ax, renderer, box)


def _wrapped(text: str, fits: Callable[[str], bool]) -> str:
    """``text`` broken at its spaces into the fewest lines that fit (a word too long for a
    line gets one of its own)."""
    lines: list[str] = []
    for word in text.split(" "):
        if lines and fits(f"{lines[-1]} {word}"):
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return "\n".join(lines)


def _make_room_below(ax: Any, renderer: Any, box: Any) -> None:
    """Raise the top of the y range so the curve stays below the labels' lowest point."""
    lowest = min(text.get_window_extent(renderer).y0 for text in ax.texts)
    taken = (box.y1 - lowest) / box.height + 0.03
    if not 0 < taken < 1:
        return
    scale = ax.yaxis.get_transform()  # in its space (log10 for a log axis) heights add up
    bottom, top = (float(v) for v in scale.transform([[y] for y in ax.get_ylim()]).ravel())
    raised = bottom + (top - bottom) / (1 - taken)
    ax.set_ylim(top=float(scale.inverted().transform([[raised]])[0, 0]))


def _series(path: str | Path) -> tuple[list[int], list[float], list[float],
                                       list[tuple[int, str]]]:
    """Steps, losses and gradient norms of the metrics events; (step, kind) of the anomalies."""
    steps: list[int] = []
    losses: list[float] = []
    norms: list[float] = []
    marks: list[tuple[int, str]] = []
    for record in iter_events(path):
        if record["event"] == "metrics":
            steps.append(int(record["step"]))
            losses.append(_number(record.get("loss")))
            norms.append(_number(record.get("grad_norm")))
        elif record["event"] == "anomaly":
            marks.append((int(record["step"]), str(record.get("kind"))))
    return steps, losses, norms, marks


def _labels_by_step(marks: list[tuple[int, str]], gap: float = 0.0) -> list[tuple[int, str]]:
    """One label per group of steps less than ``gap`` after the group's first (kinds
    joined, and the steps named when the group has several), so labels never overprint."""
    groups: list[tuple[int, int, list[str]]] = []  # first step, last step, kinds
    for step, kind in sorted(marks, key=lambda m: m[0]):
        if groups and (step == groups[-1][0] or step - groups[-1][0] < gap):
            first, _, kinds = groups[-1]
            groups[-1] = (first, step, kinds)
        else:
            groups.append((step, step, kinds := []))
        if kind not in kinds:
            kinds.append(kind)
    return [(first, ", ".join(kinds) if first == last else f"{first}-{last}: {', '.join(kinds)}")
            for first, last, kinds in groups]
