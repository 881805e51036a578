"""The pace and the cost of a run, from what it recorded.

Pace: each output's manifest line records when it was written (``written``); grouped by the worker
that wrote it (``collect.Record.worker``) and placed in the run of the history whose time span
holds it (a resume is a run of its own), that gives images per minute per worker, the stalls (a
gap between two writes of one worker far longer than its usual one) and the last worker to finish
each run.

Cost: a run held its devices for its whole wall time (loading included: it is paid for), so its
device-hours are ``wall_s`` times its devices (``collect.devices_of``); images per device-hour and,
with a price, money per image follow, per run and in total.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, TypedDict

import numpy as np

from lightning_diffusion.core.records import RunSummary
from lightning_diffusion.report.collect import Record, devices_of

STALL_MIN_S = 60.0  # a gap shorter than this is never a stall
STALL_FACTOR = 10.0  # a gap this many times a worker's usual gap between batches is one


@dataclass
class Span:
    """One run of the history: its label, when it predicted and what it made."""

    label: str  # "run 1", "shard 0 of 4, run 2"
    start: float
    end: float
    made: int
    wall_s: float
    devices: int


@dataclass
class Worker:
    name: str  # "run 2 · part-0", "run 1 · writer 3"
    run: str  # its span's label ("" where no span holds it)
    times: np.ndarray  # sorted write times
    stalls: list[tuple[float, float]] = field(default_factory=list)  # (start, seconds)
    last_to_finish: bool = False
    behind_s: float = 0.0  # how long after the run's other workers' median finish it finished

    @property
    def count(self) -> int:
        return len(self.times)

    @property
    def first(self) -> float:
        return float(self.times[0])

    @property
    def last(self) -> float:
        return float(self.times[-1])

    @property
    def per_minute(self) -> Optional[float]:
        seconds = self.last - self.first
        return 60.0 * (self.count - 1) / seconds if seconds > 0 and self.count > 1 else None


def spans(histories: dict[str, list[RunSummary]], devices: Optional[int] = None) -> list[Span]:
    """Every run of every history, oldest first (``devices``: the devices of every run, where
    the writer's record does not tell, see ``collect.devices_of``)."""
    found = []
    for source, history in histories.items():
        for number, run in enumerate(history, start=1):
            end = float(run.get("finished") or 0.0)
            wall = float(run.get("wall_s") or 0.0)
            label = f"run {number}" if source == "run.json" else f"{source}, run {number}"
            found.append(Span(label, end - wall, end, int(run.get("made") or 0), wall,
                              devices or devices_of(run)))
    return sorted(found, key=lambda span: span.start)


def _span_indices(times: np.ndarray, found: list[Span]) -> np.ndarray:
    """The span (index into ``found``, sorted by start) each time falls in; -1 for none."""
    if not found:
        return np.full(len(times), -1)
    starts = np.asarray([span.start - 1.0 for span in found])
    ends = np.asarray([span.end + 1.0 for span in found])
    at = np.searchsorted(starts, times, side="right") - 1
    inside = (at >= 0) & (times <= ends[np.clip(at, 0, None)])
    return np.where(inside, at, -1)


def workers(records: list[Record], found: list[Span]) -> list[Worker]:
    """The workers of ``records`` with their times, stalls, and the last of each run to finish: a
    worker's outputs split by the run whose time span holds them (a resume is a worker of its own)."""
    by_worker: dict[str, list[float]] = {}
    for record in records:
        if record.written is not None:
            by_worker.setdefault(record.worker, []).append(record.written)
    shown: list[Worker] = []
    numbering: dict[str, int] = {}
    for name, times in by_worker.items():
        array = np.sort(np.asarray(times, dtype=np.float64))
        at = _span_indices(array, found)
        for span in np.unique(at).tolist():
            run = found[span].label if span >= 0 else ""
            label = name
            if name.startswith("stretch "):  # the merged manifest's: numbered within their run
                numbering[run] = numbering.get(run, 0) + 1
                label = f"writer {numbering[run]}"
            shown.append(Worker(f"{run} · {label}" if run else label, run, array[at == span]))
    for worker in shown:
        gaps = np.diff(worker.times)
        usual = float(np.median(gaps[gaps > 0])) if (gaps > 0).any() else 0.0
        limit = max(STALL_MIN_S, STALL_FACTOR * usual)
        worker.stalls = [(float(worker.times[i]), float(gaps[i])) for i in np.flatnonzero(gaps > limit)]
    for run in {worker.run for worker in shown}:
        group = [worker for worker in shown if worker.run == run]
        if len(group) > 1:
            last = max(group, key=lambda worker: worker.last)
            last.last_to_finish = True
            last.behind_s = last.last - float(np.median([worker.last for worker in group if worker is not last]))
    return sorted(shown, key=lambda worker: (worker.first, worker.name))


class CostLine(TypedDict):
    """A line of the cost table (the report's JSON holds it as it is): a run's (or the ``total``)
    ``devices``, wall and device hours, images ``made`` and per device-hour, money and money per image."""

    label: str
    devices: Optional[int]
    wall_s: float
    device_h: float
    made: int
    images_per_device_h: Optional[float]
    money: Optional[float]
    money_per_image: Optional[float]


@dataclass
class Cost:
    rows: list[CostLine]  # per run
    total: CostLine
    price: Optional[float]


def _line(label: str, devices: Optional[int], wall_s: float, device_s: float, made: int,
          price: Optional[float]) -> CostLine:
    device_h = device_s / 3600.0
    money = price * device_h if price is not None else None
    return {"label": label, "devices": devices, "wall_s": round(wall_s, 3), "device_h": device_h, "made": made,
            "images_per_device_h": made / device_h if device_h > 0 else None,
            "money": money, "money_per_image": money / made if money is not None and made else None}


def cost(found: list[Span], price: Optional[float] = None) -> Cost:
    """Device-hours, images per device-hour and money (at ``price`` a device-hour) of each run and
    of all of them."""
    rows = [_line(span.label, span.devices, span.wall_s, span.wall_s * span.devices, span.made, price)
            for span in found]
    total = _line("total", None, sum(span.wall_s for span in found),
                  sum(span.wall_s * span.devices for span in found), sum(span.made for span in found), price)
    return Cost(rows, total, price)


def per_device_hour(made: int, wall_s: float, devices: int) -> Optional[float]:
    """Images per device-hour of a run that made ``made`` in ``wall_s`` on ``devices``."""
    return made * 3600.0 / (wall_s * devices) if wall_s > 0 and devices > 0 else None
