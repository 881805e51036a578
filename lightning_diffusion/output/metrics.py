"""Live metrics of a run in Prometheus' format, through ``prometheus_client``: ``PrometheusMetrics``,
a callback beside ``ImageWriter``, serves them over HTTP (``port``) and/or keeps a textfile for
node_exporter's textfile collector (``file``), from global rank 0::

    trainer:
      callbacks:
        - class_path: lightning_diffusion.output.metrics.PrometheusMetrics
          init_args: {port: 9464}

The counts are read from the output at each scrape, as ``lightning-diffusion status`` reads them
(``OutputStore.status``: every rank's manifest part, the failed and rejected records, a pool's
claims), so they are the manifest's own; rank 0's seconds per batch are timed by the callback. A
port in use is refused, naming it, when the trainer sets up: before any weights load.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional

from lightning.pytorch.callbacks import Callback

from lightning_diffusion.core.errors import ConfigError

if TYPE_CHECKING:
    import lightning.pytorch as pl

INSTALL = "pip install 'lightning-diffusion[report]'"
# The gauges read from the output at each scrape, with their help text.
GAUGES = {"lightning_diffusion_images_written": "outputs recorded in the manifest and its parts",
          "lightning_diffusion_images_expected": "outputs of the prompt set (run.json)",
          "lightning_diffusion_images_failed": "images whose pipeline call failed (failed.jsonl)",
          "lightning_diffusion_images_rejected": "images of rejected records (rejected.jsonl)",
          "lightning_diffusion_images_per_second": "the write rate over the last minutes",
          "lightning_diffusion_eta_seconds": "the time left at that rate",
          "lightning_diffusion_running": "1 while a run holds the output"}


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError(f"PrometheusMetrics needs prometheus_client: {INSTALL}") from None
    return prometheus_client


class OutputCollector:
    """A ``prometheus_client`` collector of an output's counts, read at each scrape."""

    def __init__(self, location: str) -> None:
        self.location = location

    def status(self) -> Optional[dict[str, Any]]:
        from lightning_diffusion.output.store import open_store

        try:
            return open_store(self.location).status()
        except ConfigError:  # nothing recorded yet
            return None

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        status = self.status()
        if status is None:
            return

        values = {"lightning_diffusion_images_written": status["done"],
                  "lightning_diffusion_images_expected": status.get("expected"),
                  "lightning_diffusion_images_failed": status.get("failed"),
                  "lightning_diffusion_images_rejected": status.get("rejected"),
                  "lightning_diffusion_images_per_second": status.get("rate_per_s"),
                  "lightning_diffusion_eta_seconds": status.get("eta_s"),
                  "lightning_diffusion_running": int(bool(status.get("running")))}
        for name, value in values.items():
            if value is not None:
                yield GaugeMetricFamily(name, GAUGES[name], value=float(value))
        by_rank = GaugeMetricFamily("lightning_diffusion_images_written_by_rank",
                                    "outputs in each writing rank's manifest part", labels=["rank"])
        for rank, count in (status.get("by_rank") or {}).items():
            by_rank.add_metric([str(rank)], float(count))
        yield by_rank
        pool = status.get("pool")
        if pool:
            claimed = GaugeMetricFamily("lightning_diffusion_batches_claimed", "batches each pool worker holds",
                                        labels=["worker"])
            for worker in pool["workers"]:
                claimed.add_metric([str(worker["worker"])], float(worker.get("claims") or 0))
            yield claimed
            yield GaugeMetricFamily("lightning_diffusion_batches_planned", "batches of the pool's plans",
                                    value=float(sum(int(plan.get("batches") or 0) for plan in pool["plans"])))


def port_problem(port: int, host: str = "") -> Optional[str]:
    """Why ``port`` cannot be served (in use, not allowed), or None."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            return f"PrometheusMetrics: port {port} cannot be served: {err.strerror or err}."
    return None


class PrometheusMetrics(Callback):
    """Live metrics of the run for Prometheus (see the module).

    Args:
        port: serve ``/metrics`` over HTTP on this port (0: none).
        file: keep this textfile (node_exporter's textfile collector) up to date.
        interval_s: seconds between two writes of ``file``.
        host: the address to serve on (all by default).
    """

    def __init__(self, port: int = 0, file: Optional[str] = None, interval_s: float = 15.0, host: str = "") -> None:
        super().__init__()
        self.port, self.file, self.interval_s, self.host = port, file, interval_s, host
        self._server: Any = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._registry: Any = None
        self._batch_started: Optional[float] = None
        self._seconds: Any = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not trainer.is_global_zero or self._registry is not None:
            return
        client = _client()
        from lightning_diffusion.output.writer import ImageWriter

        writer = next((c for c in trainer.callbacks if isinstance(c, ImageWriter)), None)  # type: ignore[attr-defined]
        if writer is None:
            raise ConfigError("PrometheusMetrics reads the run's output: it needs the ImageWriter callback.")
        if self.port:
            problem = port_problem(self.port, self.host)
            if problem:
                raise ConfigError(problem)
        self._registry = client.CollectorRegistry()
        self._registry.register(OutputCollector(writer.settings.output_dir))
        self._seconds = client.Histogram("lightning_diffusion_seconds_per_batch",
                                         "seconds a batch takes on global rank 0", registry=self._registry,
                                         buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        if self.port:
            self._server = client.start_http_server(self.port, addr=self.host or "0.0.0.0", registry=self._registry)
        if self.file:
            self._thread = threading.Thread(target=self._keep_file, name="prometheus-textfile", daemon=True)
            self._thread.start()
        trainer.callbacks.append(_AfterWriter(self))  # type: ignore[attr-defined]  # its teardown: the last counts

    def on_predict_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                               batch_idx: int, dataloader_idx: int = 0) -> None:
        self._batch_started = time.perf_counter()

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._seconds is not None and self._batch_started is not None:
            self._seconds.observe(time.perf_counter() - self._batch_started)

    def write_file(self) -> None:
        if self.file and self._registry is not None:
            _client().write_to_textfile(os.fspath(self.file), self._registry)

    def _keep_file(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write_file()

    def finish(self) -> None:
        """The last counts written (once the writer has written and merged everything), the server
        stopped."""
        if self._registry is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.write_file()  # the run's last counts (the writer merged its parts before this)
        if self._server is not None:
            server, thread = self._server if isinstance(self._server, tuple) else (self._server, None)
            server.shutdown()
            server.server_close()
            if thread is not None:
                thread.join()
        self._registry = self._server = self._thread = None


class _AfterWriter(Callback):
    """Added after every callback of the trainer (the writer among them): its ``teardown`` comes
    after the writer's, which writes the last images and merges the parts."""

    def __init__(self, metrics: PrometheusMetrics) -> None:
        self.metrics = metrics

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.metrics.finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.metrics.finish()
