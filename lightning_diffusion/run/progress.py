"""``ImageProgressBar``: one bar for the whole job, on global rank 0.

It counts the outputs every writing rank has flushed to its manifest part (``manifest.part_counts``,
a few file reads every refresh, no collective), out of the run's pending total (the prompt set less
what a resume skipped), and ends at exactly the merged count once the writer has merged the
manifest. On a terminal it is a tqdm bar with rate and ETA; elsewhere (SLURM logs, nohup, CI) it
writes one plain line every ``log_every_s`` seconds, with no carriage returns.
"""

from __future__ import annotations

import datetime
import sys
import threading
import time
from typing import TYPE_CHECKING, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar

from lightning_diffusion.core.console import log
from lightning_diffusion.output.audit import progress_text
from lightning_diffusion.output.manifest import part_counts
from lightning_diffusion.output.writer import ImageWriter

if TYPE_CHECKING:
    from tqdm import tqdm


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(seconds, 0))))


class ImageProgressBar(ProgressBar):
    """Images done by every replica out of the job's pending total.

    Args:
        refresh_s: how often the terminal bar re-reads the counts.
        log_every_s: without a terminal, seconds between progress lines (60 by default).
        terminal: force the terminal bar (True) or the plain lines (False); ``None``: stderr is a TTY.
    """

    def __init__(self, refresh_s: float = 0.5, log_every_s: float = 60.0, terminal: Optional[bool] = None) -> None:
        super().__init__()
        self.refresh_s = refresh_s
        self.log_every_s = log_every_s
        self.terminal = terminal
        self._enabled = True
        self._writer: Optional[ImageWriter] = None
        self._bar: Optional[tqdm] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self.total: Optional[int] = None
        self.audit = ""  # the run's drift so far, where it audits (``audit.progress_text``)
        self.done = 0

    # ProgressBar's switches (Lightning calls them around sanity checks and prints).
    def enable(self) -> None:
        self._enabled = True

    def disable(self) -> None:
        self._enabled = False

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not (trainer.is_global_zero and self._enabled):
            return
        writer = next((c for c in trainer.callbacks if  # type: ignore[attr-defined]  # set by Trainer
                       isinstance(c, ImageWriter)), None)
        if writer is None:
            return  # nothing counts images: no bar
        self._writer = writer
        writer.progress_listener = self
        self.total, self.done, self._start = writer.pending, 0, time.time()
        on_terminal = sys.stderr.isatty() if self.terminal is None else self.terminal
        if on_terminal:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total, unit="img", desc="Images", dynamic_ncols=True, file=sys.stderr)
        self._stop.clear()
        interval = self.refresh_s if on_terminal else self.log_every_s
        self._thread = threading.Thread(target=self._watch, args=(interval,), name="image-progress", daemon=True)
        self._thread.start()

    def _watch(self, interval: float) -> None:
        while not self._stop.wait(interval):
            assert self._writer is not None
            counts = part_counts(self._writer.parts_folder, self._writer.parts_glob)
            glob = self._writer.audit_glob
            self.audit = progress_text(self._writer.parts_folder, glob) if glob else ""
            self._show(sum(counts.values()), counts, final=False)

    def _show(self, done: int, counts: dict[int, int], final: bool) -> None:
        with self._lock:
            self.done = done
            if self._bar is not None:
                self._bar.n = done
                if self.audit:
                    self._bar.set_postfix_str(self.audit.lstrip("; "), refresh=False)
                self._bar.refresh()
                if final:
                    self._bar.close()
                    self._bar = None
                return
            elapsed = time.time() - self._start
            rate = done / elapsed if elapsed > 0 else 0.0
            of = f" of {self.total:,} ({100 * done / self.total:.0f}%)" if self.total else ""
            if final:
                log.info(f"progress: {done:,}{of} images in {_clock(elapsed)}")
                return
            eta = f", ETA {_clock((self.total - done) / rate)}" if self.total and rate > 0 else ""
            slowest = ""
            if len(counts) > 1:
                rank = min(counts, key=lambda r: counts[r])
                slowest = f"; slowest writing rank {rank}: {counts[rank]:,}"
            log.info(f"progress: {done:,}{of} images, {rate:.2f}/s{eta}{slowest}{self.audit}")

    def finish(self, made: int, pending: Optional[int]) -> None:
        """Called by the writer once the manifest is merged: the run's final count."""
        self._halt()
        self._show(made, {}, final=True)

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._halt()  # the writer closes the bar with the final count (whichever tears down first)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._halt()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
