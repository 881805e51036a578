"""The pool (``data.schedule: pull``) against the deal, and what its claims cost.

    python benchmarks/pool.py [--batches 24] [--pace 0.3] [--claims 100000] [--lease 8]

1. Two replicas (``data_parallel``, 2 processes, one thread each) where replica 1 is 3x slower:
   each batch is held ``pace`` s on rank 0 and ``3 * pace`` s on rank 1 before it is written (a
   writer of this script, standing for a slower GPU). ``deal`` and ``pull`` make the same batches
   of tiny:flux; reported: each one's prediction time (the run's ``wall - load``) against the
   ideal, the total work over the sum of the two rates (each rank's time a batch: its pipeline
   seconds a batch from the run's summary, plus its hold).
2. A claim's cost: ``--claims`` batches claimed one after another by one worker in a folder
   (an ``O_EXCL`` create), with the check a worker makes before writing a batch (``lost``), and
   a takeover's (``holder`` + ``take_over``); the same for ``--bucket-claims`` batches in moto's
   S3 server on this machine (conditional PUTs; a real bucket adds its network round trips).
3. The wait of a dead worker's batch: a worker in another process claims a batch and dies (SIGKILL)
   or freezes (SIGSTOP); a worker polling as ``PullSampler`` does (every ``min(1, lease/4)`` s)
   takes it over. Reported: seconds from the kill to the takeover.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lightning_diffusion.output.bucket import Uploader  # noqa: E402
from lightning_diffusion.output.fence import BucketFence, Claim, Fence, FolderFence  # noqa: E402
from lightning_diffusion.output.pool import FolderPoolFiles, Pool  # noqa: E402

SCRIPT = """
import json, sys, time
sys.path.insert(0, {repo!r})
from lightning.pytorch import Trainer
from lightning_diffusion import DiffusionModule, ImageWriter, PromptDataModule

class Paced(ImageWriter):
    def write_on_batch_end(self, trainer, pl_module, prediction, *args, **kwargs):
        time.sleep({pace!r} * (3 if trainer.global_rank == 1 else 1))
        super().write_on_batch_end(trainer, pl_module, prediction, *args, **kwargs)

writer = Paced({out!r})
trainer = Trainer(accelerator='cpu', devices=2, strategy='data_parallel', callbacks=[writer], logger=False,
                  enable_progress_bar=False)
trainer.predict(DiffusionModule('tiny:flux', height=32, width=32, num_inference_steps=2, guidance_scale=3.5,
                                call_kwargs={{'max_sequence_length': 16}}),
                datamodule=PromptDataModule([f'prompt {{i}}' for i in range({batches})], batch_size=1,
                                            schedule={schedule!r}))
if writer.summary is not None:
    print('SUMMARY', json.dumps(writer.summary))
"""


def two_replicas(schedule: str, batches: int, pace: float) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "run.py"
        script.write_text(SCRIPT.format(repo=str(REPO), pace=pace, out=str(Path(folder) / "out"), batches=batches,
                                        schedule=schedule))
        proc = subprocess.run([sys.executable, str(script)], cwd=folder, capture_output=True, text=True, check=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(re.search(r"^SUMMARY (.*)$", proc.stdout, re.M).group(1))


def ideal(summary: dict, pace: float) -> float:
    """The total work over the sum of the rates: each rank's seconds a batch are its pipeline
    seconds a batch and its hold."""
    made = {rank: rate * (summary["wall_s"] - summary["load_s"]) for rank, rate in
            summary["images_per_s_by_rank"].items()}
    rates = []
    for rank, busy in summary["busy_s_by_rank"].items():
        per_batch = busy / max(made.get(rank, 0), 1) + pace * (3 if rank == "1" else 1)
        rates.append(1 / per_batch)
    return summary["made"] / sum(rates)


def claims(count: int, bucket: bool = False) -> tuple[float, float, float, float]:
    """Seconds a batch: a claim, the check before writing, the fence's publication (with nothing to
    publish: its look under the folder's lock, or its seal in a bucket) and a takeover."""
    with tempfile.TemporaryDirectory() as folder:
        files = bucket_files() if bucket else FolderPoolFiles(Path(folder))
        pool = Pool(files, "bench", 0, 60.0, "plan")
        other = Pool(files, "other", 0, 60.0, "plan")
        start = time.perf_counter()
        for batch in range(count):
            pool.claim(batch)
        claim = (time.perf_counter() - start) / count
        start = time.perf_counter()
        for batch in range(count):
            pool.lost(batch, 0)
        lost = (time.perf_counter() - start) / count
        if bucket:
            fence: Fence = BucketFence(Uploader(files.store.url, None, 0, "bench", ".pool-bench"))
        else:
            fence = FolderFence(Path(folder))
        fenced = count // 2  # the first half: sealed in a bucket, so the takeovers below are of the rest
        start = time.perf_counter()
        for batch in range(fenced):
            fence.publish([Claim(pool.claims, batch, 0, pool.worker)], lambda held: None)
        publish = (time.perf_counter() - start) / fenced
        start = time.perf_counter()
        for batch in range(fenced, fenced + count // 10):
            generation, _ = other.holder(batch)
            other.take_over(batch, generation)
        takeover = (time.perf_counter() - start) / (count // 10)
    return claim, lost, publish, takeover


def bucket_files():
    """A prefix in moto's S3 server on this machine (``pip install -e .[test]``), as a pool's files."""
    import logging

    from moto.server import ThreadedMotoServer

    from lightning_diffusion.output.object_store import BucketPoolFiles, ObjectStore

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line a request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="testing",
                      AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    store = ObjectStore(f"s3://bench/pool-{os.getpid()}", None)
    store.fs[0].mkdir("bench")
    return BucketPoolFiles(store)


JOB = """
import sys, time
sys.path.insert(0, {repo!r})
from lightning.pytorch import Trainer
from lightning_diffusion import DiffusionModule, ImageWriter, PromptDataModule

class Paced(ImageWriter):
    def write_on_batch_end(self, *args, **kwargs):
        time.sleep({pace!r})
        super().write_on_batch_end(*args, **kwargs)

trainer = Trainer(accelerator='cpu', devices=1, callbacks=[Paced({out!r})], logger=False, enable_progress_bar=False)
trainer.predict(DiffusionModule('tiny:flux', height=32, width=32, num_inference_steps=2, guidance_scale=3.5,
                                call_kwargs={{'max_sequence_length': 16}}),
                datamodule=PromptDataModule([f'prompt {{i}}' for i in range({batches})], batch_size=1,
                                            schedule='pull', lease_s=8))
"""


def tail(batches: int, pace: float) -> tuple[float, float]:
    """Two jobs of one pool started together, one holding each batch ``pace`` s and one ``3 * pace``
    s: (seconds from the start to the first job's end, seconds between the two ends)."""
    with tempfile.TemporaryDirectory() as folder:
        procs = []
        for name, hold in (("fast", pace), ("slow", 3 * pace)):
            script = Path(folder) / f"{name}.py"
            script.write_text(JOB.format(repo=str(REPO), pace=hold, out=str(Path(folder) / "out"), batches=batches))
            procs.append(subprocess.Popen([sys.executable, str(script)], cwd=folder, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"}))
        start, ends = time.monotonic(), {}
        while len(ends) < 2:
            for n, proc in enumerate(procs):
                if n not in ends and proc.poll() is not None:
                    ends[n] = time.monotonic() - start
            time.sleep(0.05)
        assert all(proc.returncode == 0 for proc in procs)
    return min(ends.values()), abs(ends[0] - ends[1])


WORKER = """
import sys, time
sys.path.insert(0, {repo!r})
from pathlib import Path
from lightning_diffusion.output.pool import FolderPoolFiles, Pool
pool = Pool(FolderPoolFiles(Path({folder!r})), "dying", 0, {lease!r}, "plan")
pool.register("plan", {{"batches": 1, "images": 1, "batch_size": 1}})
pool.claim(0)
print("claimed", flush=True)
time.sleep(3600)
"""


def dead_wait(how: signal.Signals, lease: float) -> float:
    with tempfile.TemporaryDirectory() as folder:
        worker = subprocess.Popen([sys.executable, "-c", WORKER.format(repo=str(REPO), folder=folder, lease=lease)],
                                  stdout=subprocess.PIPE, text=True)
        assert worker.stdout is not None and worker.stdout.readline().strip() == "claimed"
        taker = Pool(FolderPoolFiles(Path(folder)), "taker", 0, lease, "plan")
        poll = min(1.0, lease / 4)
        os.kill(worker.pid, how)
        killed = time.monotonic()
        if how == signal.SIGKILL:
            worker.wait()  # reaped, as its launcher reaps a rank
        while True:
            taker.refresh()
            generation, holder = taker.holder(0)
            if not taker.working(holder) and taker.take_over(0, generation)[0]:
                waited = time.monotonic() - killed
                break
            time.sleep(poll)
        worker.kill()
        worker.wait()
    return waited


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--pace", type=float, default=0.3)
    parser.add_argument("--claims", type=int, default=100_000)
    parser.add_argument("--lease", type=float, default=8.0)
    parser.add_argument("--bucket-claims", type=int, default=10_000, help="claims in moto's S3 server (0: none)")
    parser.add_argument("--tail", type=int, default=3, help="runs of two jobs, one 3x slower (0: none)")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; {args.batches} batches of 1 image, tiny:flux 32x32, 2 steps; replica 1 holds "
          f"each batch {3 * args.pace:g} s, replica 0 {args.pace:g} s\n")
    print("| schedule | prediction | ideal | / ideal | batches rank 0 : rank 1 |")
    print("| --- | --- | --- | --- | --- |")
    for schedule in ("deal", "pull"):
        summary = two_replicas(schedule, args.batches, args.pace)
        seconds = summary["wall_s"] - summary["load_s"]
        best = ideal(summary, args.pace)
        made = [round(rate * seconds) for rate in summary["images_per_s_by_rank"].values()]
        print(f"| {schedule} | {seconds:.2f} s | {best:.2f} s | {seconds / best:.2f}x | {made[0]} : "
              f"{made[1] if len(made) > 1 else 0} |")
    claim, lost, publish, takeover = claims(args.claims)
    print(f"\n| claims in a folder ({args.claims:,} batches) | per batch |\n| --- | --- |")
    print(f"| claim (O_EXCL create) | {1e6 * claim:.0f} us |\n| check before writing (lost) | {1e6 * lost:.0f} us |")
    print(f"| fence (publication: the merge lock and a look for the next slot) | {1e6 * publish:.0f} us |")
    print(f"| takeover (holder + take_over: the records read under the lock), {args.claims // 10:,} batches | "
          f"{1e6 * takeover:.0f} us |")
    if args.bucket_claims:
        claim, lost, publish, takeover = claims(args.bucket_claims, bucket=True)
        print(f"\n| claims in moto's S3 server on this machine ({args.bucket_claims:,} batches) | per batch |\n"
              f"| --- | --- |\n| claim (conditional PUT) | {1e3 * claim:.2f} ms |\n"
              f"| check before writing (lost: a GET) | {1e3 * lost:.2f} ms |\n"
              f"| fence (publication: the seal, a conditional PUT) | {1e3 * publish:.2f} ms |\n"
              f"| takeover (holder + take_over), {args.bucket_claims // 10:,} batches | {1e3 * takeover:.2f} ms |")
    if args.tail:
        print("\n| two jobs of one pool, one 3x slower (tail: between their ends) | first end | tail |\n"
              "| --- | --- | --- |")
        for run in range(args.tail):
            first, gap = tail(args.batches, args.pace)
            print(f"| run {run + 1} | {first:.1f} s | {gap:.1f} s |")
    print(f"\n| a worker that (lease {args.lease:g} s, poll {min(1.0, args.lease / 4):g} s) | its batch taken over "
          "after |\n| --- | --- |")
    print(f"| dies (SIGKILL, same host) | {dead_wait(signal.SIGKILL, args.lease):.2f} s |")
    print(f"| freezes (SIGSTOP: its renewals stop) | {dead_wait(signal.SIGSTOP, args.lease):.2f} s |")


if __name__ == "__main__":
    main()
