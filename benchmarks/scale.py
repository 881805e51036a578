"""The framework's own cost at 10^5 to 10^6 images: sampler, batch plan, module plumbing, writer,
manifest, resume, status and the merges of a job array, with a stand-in pipeline.

    python benchmarks/scale.py --images 1000000 --json scale.json [--format files|webdataset|parquet|litdata]
        [--batch-size 64] [--replicas 2] [--shards 16]

The stand-in replaces only the diffusers pipeline (``DiffusionModule.configure_model``): it returns
8x8 images at once, so what is timed is everything around the pipeline call, as a real run goes
through it: ``Trainer.predict`` with ``DataParallelStrategy``, ``PromptDataModule`` over a ``.txt``
file, ``ImageWriter`` (its writer process, PNG encoding, the layout or tar shards, the manifest).
Each run is a process of its own (its peak RSS is its own); one thread a process.

Reported (and written to ``--json``):

* ``framework_ms_per_image``: a run's prediction loop (from its first batch to its merged
  manifest) per image, one process;
* ``peak_rss_mb``: that process's peak RSS, and ``rss_growth_mb`` against a run of a tenth of the
  images; ``bytes_per_image``: the finished folder's bytes (outputs, manifest, run.json) an image;
* ``resume_scan_s``: reading the finished folder's manifest as a resume does (``finished``), and
  ``resume_s``: a whole resume run that finds nothing left to make (start-up excluded);
* ``status_s``: ``lightning-diffusion status`` on the finished folder;
* ``merge_s``: the merge of the one-process run's manifest parts (every line once), and
  ``array_merges_s``: the 16 merges of a job array of the same images into one folder;
* with ``--replicas 2``: ``replicas_ms_per_image`` over 2 processes.

``--start-up 100000 1000000 10000000`` instead measures what a prompt set costs a rank before its
work: one process over a ``.jsonl`` file and a Parquet file of that many records (``--start-up-formats``)
runs its first batch only (``Trainer(limit_predict_batches=1)``), and reports its peak RSS, the time
the data module takes to read and check every record (``read_s``) and the wall time from there to
``Trainer.predict``'s return (that reading, the data module's set-up, the batch plan, the writer's
set-up and one batch): ``start_up``, a row a format and count.

``--shard-spread 100000`` instead measures how evenly a job array's ``--shards`` tasks share a mixed
set's work, from the plan alone (no pipeline): each shard's computed cost (pixels x steps of its
images, padded batches at their padded size) under the cost deal (``shard.deal_shards``) and under
the index rule (image ``i`` to shard ``i % N``), for two sets of that many records: each prompt at
four sizes in turn (a grid written by nested loops), and runs of random length of one size and
step count (a set concatenated from sources).

``--metrics-cost`` instead times the one-process run without and with the writer's live metrics
(``writer.metrics_port``, scraped over HTTP every second from this process, and ``metrics_file``):
``plain_ms_per_image``, ``metrics_ms_per_image``, and the scrapes answered.

``--object-store`` instead times the same one-process run into a bucket of a local S3 server (moto's
server mode on 127.0.0.1, with s3fs as the client) beside the run into a folder, both with
``writer.format: webdataset`` (``bucket_ms_per_image``, ``folder_ms_per_image``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]


class StandIn:
    """What a diffusers pipeline returns, at once: an 8x8 image a prompt."""

    def __call__(self, prompt, generator=None, output_type="np", **kwargs):
        class Output:
            images = np.full((len(prompt), 8, 8, 3), 0.5, dtype=np.float32)

        return Output()

    def set_progress_bar_config(self, **kwargs):
        pass


def child(args: argparse.Namespace) -> None:
    """One run (``--child``): predict, then report its summary and timings as JSON on stdout."""
    from lightning.pytorch import Trainer

    from lightning_diffusion import DiffusionModule, ImageWriter, PromptDataModule
    from lightning_diffusion.output import folder_store as store_module
    from lightning_diffusion.output import manifest as manifest_module
    from lightning_diffusion.strategies import DataParallelStrategy

    merges: list[float] = []
    merge = store_module.merge_manifest

    def timed_merge(*a, **k):  # the folder's merge, timed where it runs
        start = time.perf_counter()
        try:
            return merge(*a, **k)
        finally:
            merges.append(time.perf_counter() - start)

    store_module.merge_manifest = timed_merge
    del manifest_module

    class StandInModule(DiffusionModule):
        def configure_model(self):
            self.pipeline = StandIn()

    metrics = dict(metrics_port=args.metrics_port, metrics_file=f"{args.out}.prom") if args.metrics_port else {}
    writer = ImageWriter(args.out, format=args.format, fsync=args.fsync, **metrics)
    trainer = Trainer(accelerator="cpu", devices=args.replicas, strategy=DataParallelStrategy(), logger=False,
                      enable_progress_bar=False, callbacks=[writer],
                      limit_predict_batches=args.limit_batches or None)
    start = time.perf_counter()
    data = PromptDataModule(args.prompts, batch_size=args.batch_size, num_shards=args.shards,
                            shard_index=args.shard_index)  # reads and checks every record
    read_s = time.perf_counter() - start
    trainer.predict(StandInModule("tiny:flux", height=16, width=16), datamodule=data, return_predictions=False)
    if trainer.is_global_zero:
        summary = writer.summary or {}
        print(json.dumps({"summary": summary, "merge_s": sum(merges), "read_s": read_s,
                          "run_s": time.perf_counter() - start,
                          "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def run(args: argparse.Namespace, out: Path, prompts: Path, replicas: int = 1, shards: int = 1, shard: int = 0,
        limit_batches: int = 0, metrics_port: int = 0) -> dict:
    command = [sys.executable, __file__, "--child", "--out", str(out), "--prompts", str(prompts), "--format",
               args.format, "--fsync", args.fsync, "--batch-size", str(args.batch_size), "--replicas", str(replicas),
               "--shards", str(shards), "--shard-index", str(shard), "--limit-batches", str(limit_batches),
               "--metrics-port", str(metrics_port)]
    proc = subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    summary = report["summary"]
    report["ms_per_image"] = 1000 * (summary["wall_s"] - summary["load_s"]) / max(1, summary["made"])
    return report


def timed(fn) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def write_prompt_set(path: Path, count: int) -> None:
    """``count`` records of distinct prompts, as JSON lines or as one Parquet file (row groups of
    pyarrow's default size), written in pieces."""
    step = 1_000_000
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        with pq.ParquetWriter(path, pa.schema([("prompt", pa.string())])) as out:
            for first in range(0, count, step):
                part = [f"a shape number {n}" for n in range(first, min(count, first + step))]
                out.write_table(pa.table({"prompt": part}))
        return
    with open(path, "w") as out:
        for first in range(0, count, step):
            out.write("".join(f'{{"prompt": "a shape number {n}"}}\n' for n in range(first, min(count, first + step))))


def start_up(args: argparse.Namespace) -> None:
    """Peak RSS and start-up time of one process against the prompt set's size, a format each."""
    args.format = "webdataset"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for fmt in args.start_up_formats:
            for count in args.start_up:
                prompts = root / f"prompts-{count}.{fmt}"
                write_prompt_set(prompts, count)
                report = run(args, root / f"out-{fmt}-{count}", prompts, limit_batches=1)
                made = report["summary"].get("made")
                rows.append({"format": fmt, "records": count, "peak_rss_mb": round(report["peak_rss_mb"]),
                             "read_s": round(report["read_s"], 1), "start_up_s": round(report["run_s"], 1),
                             "made": made})
                prompts.unlink()
                print(json.dumps(rows[-1]), flush=True)
    print("\n| format | records | peak RSS | reading and checking the records | start-up (first batch made) |\n"
          "| --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['format']} | {row['records']:,} | {row['peak_rss_mb']} MB | {row['read_s']} s | "
              f"{row['start_up_s']} s |")
    if args.json:
        Path(args.json).write_text(json.dumps({"start_up": rows}, indent=2))


SPREAD_SIZES = [(512, 512), (768, 768), (1024, 1024), (1024, 1536)]


def spread_records(kind: str, count: int) -> list[dict[str, Any]]:
    if kind == "grid":  # prompt p at the four sizes, one after the other
        return [{"prompt": f"p {n // 4}", "height": SPREAD_SIZES[n % 4][0], "width": SPREAD_SIZES[n % 4][1]}
                for n in range(count)]
    rng = np.random.default_rng(0)
    records: list[dict[str, Any]] = []
    while len(records) < count:
        (height, width), steps = SPREAD_SIZES[rng.integers(4)], int(rng.choice([20, 50]))
        records += [{"prompt": f"p {len(records) + i}", "height": height, "width": width,
                     "num_inference_steps": steps} for i in range(int(rng.integers(1, 200)))]
    return records[:count]


def shard_spread(args: argparse.Namespace) -> None:
    """Each shard's computed cost under the cost deal and under the index rule, for mixed sets."""
    from lightning_diffusion.input.batching import SetFacts, image_facts, plan_batches
    from lightning_diffusion.input.data import shard_owners
    from lightning_diffusion.input.formats import read_records

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("grid", "runs"):
            path = Path(tmp) / f"{kind}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in spread_records(kind, args.shard_spread)))
            records = read_records(str(path))
            total = len(records)
            indices = np.arange(total)
            summary = records.summary
            buckets, costs = image_facts(SetFacts.from_summary(summary), summary.set_array(), indices, 1)
            plan = plan_batches(indices, buckets, costs, args.batch_size)
            per_image = np.repeat(plan.costs / plan.sizes, plan.sizes)  # a padded batch at its padded size
            image_cost = np.empty(total)
            image_cost[plan.order] = per_image
            seconds, owners = timed(lambda: shard_owners(records, 1, args.batch_size, True, args.shards))
            for rule, shard_of in (("cost deal", owners.astype(np.int64)), ("index rule", indices % args.shards)):
                loads = np.bincount(shard_of, weights=image_cost, minlength=args.shards)
                rows.append({"set": kind, "rule": rule, "records": total, "shards": args.shards,
                             "spread_pct": round(100 * (loads.max() - loads.min()) / loads.mean(), 2),
                             "spread_batches": round((loads.max() - loads.min()) / plan.costs.max(), 2),
                             "plan_s": round(seconds, 2) if rule == "cost deal" else None})
                print(json.dumps(rows[-1]), flush=True)
    print("\n| set | rule | (max - min) / mean shard cost | max - min, in costliest batches | plan |\n"
          "| --- | --- | ---: | ---: | ---: |")
    for row in rows:
        plan = f"{row['plan_s']} s" if row["plan_s"] is not None else ""
        print(f"| {row['set']} | {row['rule']} | {row['spread_pct']}% | {row['spread_batches']} | {plan} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"shard_spread": rows}, indent=2))


def metrics_cost(args: argparse.Namespace) -> None:
    """The one-process run without, then with the writer's live metrics, scraped every second."""
    import socket
    import threading
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    scrapes: list[float] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.wait(1.0):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
                scrapes.append(time.time())
            except OSError:
                continue

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prompts = root / "prompts.txt"
        prompts.write_text("".join(f"a shape number {n}\n" for n in range(args.images)))
        plain = run(args, root / "plain", prompts)
        thread = threading.Thread(target=scrape, daemon=True)
        thread.start()
        try:
            with_metrics = run(args, root / "metrics", prompts, metrics_port=port)
        finally:
            stop.set()
            thread.join()
    result = {"images": args.images, "format": args.format, "plain_ms_per_image": plain["ms_per_image"],
              "metrics_ms_per_image": with_metrics["ms_per_image"], "scrapes": len(scrapes)}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def object_store(args: argparse.Namespace) -> None:
    """One process into a folder and into a local S3 server's bucket, tar shards both."""
    from moto.server import ThreadedMotoServer

    args.format = "webdataset"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True).mkdir("bench")
    result: dict[str, Any] = {"images": args.images, "format": "webdataset", "batch_size": args.batch_size}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            prompts = root / "prompts.txt"
            prompts.write_text("".join(f"a shape number {n}\n" for n in range(args.images)))
            folder = run(args, root / "one", prompts)
            bucket = run(args, "s3://bench/one", prompts)  # type: ignore[arg-type]
            assert bucket["summary"]["in_manifest"] == args.images, bucket["summary"]
            result.update(folder_ms_per_image=folder["ms_per_image"], bucket_ms_per_image=bucket["ms_per_image"],
                          bucket_peak_rss_mb=bucket["peak_rss_mb"], folder_peak_rss_mb=folder["peak_rss_mb"])
    finally:
        server.stop()
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=100_000)
    parser.add_argument("--json")
    parser.add_argument("--format", default="files", choices=["files", "webdataset", "parquet", "litdata"])
    parser.add_argument("--fsync", default="batch")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--start-up", type=int, nargs="+", metavar="RECORDS",
                        help="peak RSS and start-up time of one process for prompt sets of these sizes")
    parser.add_argument("--start-up-formats", nargs="+", default=["jsonl", "parquet"], choices=["jsonl", "parquet"])
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--limit-batches", type=int, default=0, help="each process's first batches only (0: all)")
    parser.add_argument("--out")
    parser.add_argument("--prompts")
    parser.add_argument("--shard-index", type=int, default=0)
    parser.add_argument("--object-store", action="store_true", help="a bucket of a local S3 server against a folder")
    parser.add_argument("--metrics-cost", action="store_true", help="the run without and with the writer's metrics")
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--shard-spread", type=int, metavar="RECORDS",
                        help="the job array shards' computed cost spread on mixed sets of this many records")
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.object_store:
        return object_store(args)
    if args.metrics_cost:
        return metrics_cost(args)
    if args.start_up:
        return start_up(args)
    if args.shard_spread:
        return shard_spread(args)

    from lightning_diffusion.commands.status import folder_status
    from lightning_diffusion.output.recorded import finished

    result: dict[str, Any] = {"images": args.images, "format": args.format, "fsync": args.fsync,
                              "batch_size": args.batch_size}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prompts, small = root / "prompts.txt", root / "small.txt"
        prompts.write_text("".join(f"a shape number {n}\n" for n in range(args.images)))
        small.write_text("".join(f"a shape number {n}\n" for n in range(args.images // 10)))
        tenth = run(args, root / "tenth", small)
        whole = run(args, root / "one", prompts)
        result.update(framework_ms_per_image=whole["ms_per_image"], peak_rss_mb=whole["peak_rss_mb"],
                      rss_growth_mb=whole["peak_rss_mb"] - tenth["peak_rss_mb"], merge_s=whole["merge_s"])
        outputs = sum(f.stat().st_size for f in (root / "one").rglob("*") if f.is_file())
        result["bytes_per_image"] = round(outputs / args.images)  # the folder's: outputs, manifest, run.json
        result["resume_scan_s"], found = timed(lambda: finished(root / "one"))
        assert len(found) == args.images, (len(found), found.problems[:3])
        resume = run(args, root / "one", prompts)
        result["resume_s"] = resume["summary"]["load_s"]
        result["status_s"], status = timed(lambda: folder_status(root / "one"))
        assert status["complete"], status
        if args.shards > 1:
            merges = [run(args, root / "array", prompts, shards=args.shards, shard=t)["merge_s"]
                      for t in range(args.shards)]
            result["array_merges_s"] = sum(merges)
            assert len(finished(root / "array")) == args.images
        if args.replicas > 1:
            result["replicas_ms_per_image"] = run(args, root / "replicas", prompts, replicas=args.replicas)[
                "ms_per_image"]
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
