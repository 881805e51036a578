"""The pace drawn with matplotlib (a PNG for the page to embed): images per minute over the run's
life, one line per worker, each run of the history shaded as its own segment, stalls in red and the
last worker to finish drawn thicker."""

from __future__ import annotations

import base64
import io
from typing import Optional

import numpy as np

from lightning_diffusion.report.pace import Span, Worker

INSTALL = "pip install 'lightning-diffusion[report]'"
_MAX_LINES = 12  # workers drawn one line each; more are summed into one line


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def pace_png(workers: list[Worker], found: list[Span]) -> Optional[bytes]:
    """The pace plot as PNG bytes; None where nothing was timed or matplotlib is missing."""
    if not workers or not available():
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    start = min(worker.first for worker in workers)
    end = max(worker.last for worker in workers)
    span_s = max(end - start, 1.0)
    bin_s = max(1.0, span_s / 80)  # about 80 points across the run's life
    edges = np.arange(start, end + bin_s, bin_s)
    if len(edges) < 2:
        edges = np.array([start, start + bin_s])
    scale = 60.0 / bin_s  # images a bin -> images a minute
    figure, axes = plt.subplots(figsize=(9, 3.2), dpi=100)
    for number, run in enumerate(found):
        if run.end >= start and run.start <= end:
            axes.axvspan((max(run.start, start) - start) / 60, (min(run.end, end) - start) / 60,
                         color="#dde7f3" if number % 2 == 0 else "#eef3e2", zorder=0)
            axes.text((max(run.start, start) - start) / 60, 1.0, f" {run.label}", transform=axes.get_xaxis_transform(),
                      va="top", fontsize=7, color="#445")
    middles = (edges[:-1] - start) / 60 + bin_s / 120
    drawn = workers if len(workers) <= _MAX_LINES else [w for w in workers if w.last_to_finish]
    for worker in drawn:
        counts, _ = np.histogram(worker.times, bins=edges)
        rate = np.where((edges[1:] >= worker.first) & (edges[:-1] <= worker.last), counts * scale, np.nan)  # its life
        axes.plot(middles, rate, label=worker.name + (" (last to finish)" if worker.last_to_finish else ""),
                  linewidth=2.4 if worker.last_to_finish else 1.2,
                  marker="o" if np.count_nonzero(~np.isnan(rate)) < 4 else None)
    if len(workers) > _MAX_LINES:
        counts, _ = np.histogram(np.concatenate([w.times for w in workers]), bins=edges)
        axes.plot(middles, counts * scale, label=f"all {len(workers)} workers", color="black", linewidth=1.2)
    for worker in workers:
        for at, seconds in worker.stalls:
            axes.axvspan((at - start) / 60, (at + seconds - start) / 60, color="#e33", alpha=0.25, zorder=1)
    axes.set_xlabel("minutes since the first image")
    axes.set_ylabel("images / minute")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="lower left", ncol=2)
    figure.tight_layout()
    out = io.BytesIO()
    figure.savefig(out, format="png")
    plt.close(figure)
    return out.getvalue()


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")
