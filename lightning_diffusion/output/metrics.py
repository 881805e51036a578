"""Live metrics of a run in Prometheus' format, through ``prometheus_client``, from global rank 0:
served over HTTP (a port) and/or kept in a textfile for node_exporter's textfile collector. The
writer keeps them itself where ``writer.metrics_port`` or ``writer.metrics_file`` is set::

    writer:
      metrics_port: 9464
      metrics_file: /var/lib/node_exporter/textfile/diffusion.prom

``PrometheusMetrics``, a callback beside ``ImageWriter``, does the same without the writer's keys.

The counts are read from the output at each scrape, as ``lightning-diffusion status`` reads them
(``OutputStore.status``: every rank's manifest part, the failed and rejected records, a pool's
claims and takeovers), so they are the manifest's own; rank 0's seconds per batch and its writer's
queue depth are rank 0's own. A port in use is refused, naming it, before any weights load.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from lightning.pytorch.callbacks import Callback

from lightning_diffusion.core.errors import ConfigError

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_diffusion.output.pool import PoolSummary
    from lightning_diffusion.output.settings import StorageOptions
    from lightning_diffusion.output.status import RunStatus

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
        raise ConfigError(f"live metrics (writer.metrics_port, writer.metrics_file, PrometheusMetrics) need "
                          f"prometheus_client: {INSTALL}") from None
    return prometheus_client


# A scrape re-reads the output at most once in this many times the last read took: reading a 10^6-line
# manifest takes seconds (docs/benchmarks.md), in global rank 0's process, beside its prediction.
READ_SHARE = 10


class OutputCollector:
    """A ``prometheus_client`` collector of an output's counts, read at a scrape (kept for
    ``READ_SHARE`` times the read's own duration, so that frequent scrapes of a large output cost
    rank 0 at most a tenth of a core; ``fresh`` forgets it)."""

    def __init__(self, location: str, read_share: float = READ_SHARE,
                 clock: Callable[[], float] = time.monotonic, options: Optional[StorageOptions] = None) -> None:
        self.location, self.read_share, self.clock = location, read_share, clock
        self.options = options  # a bucket's fsspec options (writer.storage_options)
        self._kept: Optional[RunStatus] = None
        self._until = 0.0
        self._lock = threading.Lock()  # scrapes and the textfile's thread read one at a time

    def fresh(self) -> None:
        """The next scrape reads the output again (the run's last counts)."""
        self._until = 0.0

    def status(self) -> Optional[RunStatus]:
        from lightning_diffusion.output.store import open_store

        with self._lock:
            started = self.clock()
            if started < self._until:
                return self._kept
            try:
                self._kept = open_store(self.location, options=self.options).status()
            except ConfigError:  # nothing recorded yet
                self._kept = None
            ended = self.clock()
            self._until = ended + self.read_share * (ended - started)
            return self._kept

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
        shard_eta = GaugeMetricFamily("lightning_diffusion_eta_seconds_by_shard",
                                      "seconds until each running array task's shard ends (see shard_etas)",
                                      labels=["shard"])
        for shard, seconds in shard_etas(status).items():
            shard_eta.add_metric([str(shard)], seconds)
        yield shard_eta
        pool = status.get("pool")
        if pool:
            claimed = GaugeMetricFamily("lightning_diffusion_batches_claimed", "batches each pool worker holds",
                                        labels=["worker"])
            for worker in pool["workers"]:
                claimed.add_metric([str(worker["worker"])], float(worker.get("claims") or 0))
            yield claimed
            yield GaugeMetricFamily("lightning_diffusion_batches_planned", "batches of the pool's plans",
                                    value=float(sum(int(plan.get("batches") or 0) for plan in pool["plans"])))
            yield GaugeMetricFamily("lightning_diffusion_batches_taken_over",
                                    "takeovers of the pool's batches (a worker's claim made after its holder stopped)",
                                    value=float(sum(int(plan.get("taken_over") or 0) for plan in pool["plans"])))
            took = GaugeMetricFamily("lightning_diffusion_batches_taken_over_by_worker",
                                     "batches each pool worker holds by a takeover", labels=["worker"])
            eta = GaugeMetricFamily("lightning_diffusion_eta_seconds_by_worker",
                                    "seconds until each live pool worker ends (see worker_etas)", labels=["worker"])
            for worker in pool["workers"]:
                took.add_metric([str(worker["worker"])], float(worker.get("took_over") or 0))
            for name, seconds in worker_etas(pool, time.time()).items():
                eta.add_metric([name], seconds)
            yield took
            yield eta


def worker_etas(pool: PoolSummary, now: float) -> dict[str, float]:
    """Seconds until each live worker of a pool (``pool_summary``) ends: the batches nobody has
    claimed yet at the pace the live workers claim them together, then its own batch at its own pace
    (each worker's pace: its claims since it joined). A worker that claimed nothing yet has none."""
    left = sum(max(0, int(plan.get("batches") or 0) - int(plan.get("claimed") or 0)) for plan in pool["plans"])
    paces = {str(worker["worker"]): int(worker.get("claims") or 0) / max(now - float(worker["since"] or 0.0), 1.0)
             for worker in pool["workers"] if worker["live"] and worker.get("since") is not None}
    together = sum(paces.values())
    return {name: (left / together if left else 0.0) + 1 / pace for name, pace in paces.items() if pace > 0}


def shard_etas(status: RunStatus) -> dict[int, float]:
    """Seconds until each running shard of a job array ends: its images left at the folder's live
    rate shared evenly by the running shards (a shard's own rate is not kept while it runs)."""
    running = [shard for shard in status.get("shards") or [] if shard["running"]]
    rate = status.get("rate_per_s")
    if not running or not rate or not status.get("rate_live"):
        return {}
    each = rate / len(running)
    return {shard["shard"]: max(0, shard["expected"] - shard["done"]) / each for shard in running}


def port_problem(port: int, host: str = "") -> Optional[str]:
    """Why ``port`` cannot be served (in use, not allowed), or None."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            return f"metrics: port {port} cannot be served: {err.strerror or err}."
    return None


class LiveMetrics:
    """The live metrics of the run writing into ``location``, kept on global rank 0: ``/metrics`` on
    ``port`` (0: none) of ``host`` (all addresses by default), and/or the textfile ``file`` written
    every ``interval_s`` seconds. ``queue_depth``: the batches waiting in rank 0's write queue;
    ``options``: a bucket's fsspec options."""

    def __init__(self, location: str, port: int = 0, file: Optional[str] = None, interval_s: float = 15.0,
                 host: str = "", queue_depth: Optional[Callable[[], int]] = None,
                 options: Optional[StorageOptions] = None) -> None:
        self.port, self.file, self.interval_s, self.host = port, file, interval_s, host
        client = _client()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._server: Any = None
        self._registry: Any = client.CollectorRegistry()
        self._collector = OutputCollector(location, options=options)
        self._registry.register(self._collector)
        self._seconds = client.Histogram("lightning_diffusion_seconds_per_batch",
                                         "seconds a batch takes on global rank 0", registry=self._registry,
                                         buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        if queue_depth is not None:
            client.Gauge("lightning_diffusion_write_queue_depth", "batches waiting in global rank 0's write queue",
                         registry=self._registry).set_function(queue_depth)
        if port:  # the server's own bind decides (a probe before it would leave a window for another process)
            try:
                self._server = client.start_http_server(port, addr=host or "0.0.0.0", registry=self._registry)
            except OSError as err:
                raise ConfigError(f"metrics: port {port} cannot be served: {err.strerror or err}.") from None
        if file:
            self._thread = threading.Thread(target=self._keep_file, name="prometheus-textfile", daemon=True)
            self._thread.start()

    def observe_batch(self, seconds: float) -> None:
        self._seconds.observe(seconds)

    def write_file(self) -> None:
        if self.file and self._registry is not None:
            _client().write_to_textfile(os.fspath(self.file), self._registry)

    def _keep_file(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write_file()

    def finish(self) -> None:
        """The last counts written (call it once the writer has merged everything), the server
        stopped. Safe to call twice."""
        if self._registry is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._collector.fresh()  # the merged manifest's counts, not a kept read
        self.write_file()
        if self._server is not None:
            server, thread = self._server if isinstance(self._server, tuple) else (self._server, None)
            server.shutdown()
            server.server_close()
            if thread is not None:
                thread.join()
        self._registry = self._server = self._thread = None


class PrometheusMetrics(Callback):
    """Live metrics of the run for Prometheus (see the module), for a run that does not set the
    writer's ``metrics_port``/``metrics_file``.

    Args:
        port: serve ``/metrics`` over HTTP on this port (0: none).
        file: keep this textfile (node_exporter's textfile collector) up to date.
        interval_s: seconds between two writes of ``file``.
        host: the address to serve on (all by default).
    """

    def __init__(self, port: int = 0, file: Optional[str] = None, interval_s: float = 15.0, host: str = "") -> None:
        super().__init__()
        self.port, self.file, self.interval_s, self.host = port, file, interval_s, host
        self.live: Optional[LiveMetrics] = None
        self._batch_started: Optional[float] = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not trainer.is_global_zero or self.live is not None:
            return
        from lightning_diffusion.output.settings import WriterSettings

        # the ImageWriter, known by its settings (the writer imports this module: no import back)
        writer = next((c for c in trainer.callbacks  # type: ignore[attr-defined]
                       if isinstance(getattr(c, "settings", None), WriterSettings)), None)
        if writer is None:
            raise ConfigError("PrometheusMetrics reads the run's output: it needs the ImageWriter callback.")
        self.live = LiveMetrics(writer.settings.output_dir, self.port, self.file, self.interval_s, self.host,
                                options=writer.settings.storage_options)
        trainer.callbacks.append(_AfterWriter(self))  # type: ignore[attr-defined]  # its teardown: the last counts

    def on_predict_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                               batch_idx: int, dataloader_idx: int = 0) -> None:
        self._batch_started = time.perf_counter()

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.live is not None and self._batch_started is not None:
            self.live.observe_batch(time.perf_counter() - self._batch_started)

    def finish(self) -> None:
        if self.live is not None:
            self.live.finish()
            self.live = None


class _AfterWriter(Callback):
    """Added after every callback of the trainer (the writer among them): its ``teardown`` comes
    after the writer's, which writes the last images and merges the parts."""

    def __init__(self, metrics: PrometheusMetrics) -> None:
        self.metrics = metrics

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.metrics.finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.metrics.finish()
