"""Writing images off the prediction thread: marginal time per image against a bare diffusers loop,
and the encoding cost of each format and size, side by side in one run.

    python benchmarks/writing.py [--sizes 64 256] [--steps 20] [--pairs 200 60]
        [--paths nothing position process thread sync ipc encode] [--fsync batch]
    python benchmarks/writing.py --second-core python png files [--pairs 60]
    python benchmarks/writing.py --sizes 64 --pin-thread  (the compute thread and the writer on their own cores)

One process, one compute thread (``OMP_NUM_THREADS=1``: one core computes, as one GPU would; the
second core is left to the writers, and a line before each path says how free it was). Ours is
``Trainer.predict`` with ``ImageWriter`` (PNG with metadata, atomic writes, fsync, manifest)
writing in its writer process (``process``, the default), in threads of the rank (``thread``), or
on the prediction thread (``sync``: ``write_workers: 0``); the reference is a bare diffusers loop
that saves PNGs synchronously at our compression level (1). Where the writer process's cost goes
(by name only, not run by default): ``ipc``, a writer process that receives each batch and writes
nothing (the hand-over alone), and ``encode``, one that encodes each picture with its metadata
into memory (no file calls), both from ``writing_parts.py``.

This VM's compute speed moves by 10% from one batch to the next (thread CPU time as much as wall
time: not stolen time, the host), more than the differences looked for, so the two paths take
turns batch by batch in one process: at the end of each of ours' batches a callback runs one batch
of the bare loop with the same prompts and seeds, and only then does the writer's hook queue ours'
images, so that the writing overlaps ours' next batch, as in a run of ours alone. A pair is ours'
whole cycle (from the end of the previous bare batch: queueing, Lightning's loop, our step, the
pipeline call while the writer writes) and the bare batch (saving the previous bare batch's
images, then the pipeline call and its PIL images: each path's file calls come before its own
next call, as in a run of it alone). The ratio is their summed times (marginal time per image:
start-up and the final drain left out), with a 95% interval from the pairs' differences (within the
run); the first pair is left out (warm-up). The same for the bare loop saving nothing against saving
(``nothing``, the limit) and saving against itself (``position``: what the place in a pair alone
does). Where the time goes, per image: inside the pipeline call (ours asks for arrays, the bare loop
for PIL images) and on the prediction thread outside it; "the calls counted alike" is the ratio with
the call's noise left out (both calls of a pair taken as the reference's), which leaves out any
slowing of ours' call as well. The writer process's CPU time is printed.
Encoding: a tiny:shapes picture resized to each size, each format, median of 5 encodes.
``--second-core`` measures only whether the second core is free for the writer's work: the bare
loop's batches (64x64, saving nothing) taking turns with the second core idle and busy with a
Python loop, the writer's PNG encoding, or its encoding and file calls.
"""

from __future__ import annotations

import argparse
import functools
import io
import math
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

# One compute thread, set before torch starts its OpenMP pool: with only torch.set_num_threads(1),
# an OpenMP worker made at start-up spins on the second core (measured: 1.7 s of CPU in a 1.9 s run),
# the core this benchmark means to leave to the writers.
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer
from PIL import Image

from lightning_diffusion import DiffusionModule, ImageWriter, PromptDataModule
from lightning_diffusion.output.manifest import atomic_write
from lightning_diffusion.pipelines import bare
from lightning_diffusion.pipelines.model_folder import inspect_pipeline

from writing_parts import EncodeFiles, HandOverFiles  # benchmarks/: importable by the writer process too

FORMATS = {"png level 1": ("PNG", {"compress_level": 1}),
           "png level 6 (Pillow's default)": ("PNG", {"compress_level": 6}),
           "webp q90": ("WEBP", {"quality": 90}), "jpeg q90": ("JPEG", {"quality": 90})}
REFERENCE = "diffusers, PNG saved (level 1)"
PATHS = {"nothing": "diffusers, nothing saved (the limit)",
         "position": "diffusers, PNG saved, against itself (the position in a pair alone)",
         "process": "ours, writer process (default)",
         "thread": "ours, writer threads (write_in: thread)",
         "sync": "ours, on the prediction thread (write_workers: 0)",
         "ipc": "ours, writer process that writes nothing (the hand-over alone)",
         "encode": "ours, writer process encoding in memory only (no file calls)"}
PARTS = ("ipc", "encode")  # where the writer process's cost goes: asked for by name only
CALLS: dict[int, list[float]] = {}  # id of a pipeline object: seconds of each of its calls


def time_pipeline_calls() -> None:
    """Record the seconds of every ``FluxPipeline.__call__`` (both paths call it), by pipeline object."""
    from diffusers import FluxPipeline

    call = FluxPipeline.__call__

    @functools.wraps(call)
    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return call(self, *args, **kwargs)
        finally:
            CALLS.setdefault(id(self), []).append(time.perf_counter() - start)

    FluxPipeline.__call__ = timed


def prompts(batch: int) -> list[str]:
    return [f"benchmark prompt number {4 * batch + i}" for i in range(4)]


class Bare:
    """The bare diffusers loop, one batch at a time: ``batch(k)`` saves batch k-1's images, then makes
    batch k's, and returns (seconds, seconds in the call). Saving first keeps the aftermath of its
    file calls on its own next call, whatever runs between two bare batches."""

    def __init__(self, path: str, size: int, steps: int, out: Path, save: bool) -> None:
        self.pipe = bare.load(path)
        self.size, self.steps, self.out, self.save = size, steps, out, save
        self.pending: list = []  # (index, PIL image) of the previous batch

    def batch(self, k: int) -> tuple[float, float]:
        start = time.perf_counter()
        if self.save:
            for index, image in self.pending:
                image.save(self.out / f"{index:06d}.png", compress_level=1)
        images = bare.call(self.pipe, prompts(k), range(4 * k, 4 * k + 4), height=self.size, width=self.size,
                           num_inference_steps=self.steps, guidance_scale=3.5, max_sequence_length=64).images
        self.pending = [(4 * k + i, image) for i, image in enumerate(images)]
        return time.perf_counter() - start, CALLS[id(self.pipe)][-1]


class Pairs:
    """Times of paired batches: (ours or the second loop, its call) and (the reference, its call)."""

    def __init__(self) -> None:
        self.first: list[tuple[float, float]] = []
        self.second: list[tuple[float, float]] = []
        self.writer_cpu: Optional[float] = None  # seconds of CPU of ours' writer process an image

    @property
    def used(self) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
        """The pairs measured: the first one is left out (warm-up)."""
        return self.first[1:], self.second[1:]

    def ratio(self, part: Callable[[tuple[float, float]], float] = lambda t: t[0]) -> tuple[float, float, float]:
        """The first path's time over the reference's, 1 + mean(part(first) - part(reference)) / mean(reference),
        with a 95% interval from the pairs' differences. ``part``, the whole time (default): the measured
        ratio. The time outside the pipeline call: the ratio if both calls (the same work; the
        reference's call also makes its PIL images) had taken the same time, the call's noise left out."""
        first, second = self.used
        base = statistics.fmean(t for t, _ in second)
        diffs = [part(a) - part(b) for a, b in zip(first, second)]
        mid = 1 + statistics.fmean(diffs) / base
        half = 1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs)) / base
        return mid, mid - half, mid + half

    @staticmethod
    def per_image(times: list[tuple[float, float]]) -> tuple[float, float, float]:
        """ms per image: in all, inside the pipeline call, outside it."""
        total, called = (statistics.fmean(x[i] for x in times) / 4 * 1000 for i in (0, 1))
        return total, called, total - called


class _Interleave(Callback):
    """After each of ours' batches, one bare batch; then the writer's hook queues ours' images."""

    def __init__(self, bare: Bare, pairs: Pairs) -> None:
        self.bare, self.pairs, self.mark, self.calls = bare, pairs, None, 0

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        calls = CALLS.setdefault(id(pl_module.pipeline), [])
        if self.mark is not None:  # ours' cycle: from the end of the previous bare batch (then the previous
            # batch queued, the loop, our step, the call while the writer writes) to here
            assert len(calls) == self.calls + 1, "one pipeline call a batch"
            self.pairs.first.append((time.perf_counter() - self.mark, calls[-1]))
            self.pairs.second.append(self.bare.batch(batch_idx))
        else:
            self.bare.batch(batch_idx)  # warm-up of the bare loop
            if PIN:  # the writer process started with the compute core's mask: it moves to the other
                for child in _children():
                    os.sched_setaffinity(child, {PIN[1]})
                if PIN_THREAD:  # this thread alone (Linux sets a thread's mask): the feeder and acks keep both
                    os.sched_setaffinity(0, {PIN[0]})
        self.calls = len(calls)
        self.mark = time.perf_counter()


def ours_against_bare(path: str, size: int, steps: int, count: int, workers: int, write_in: str,
                      fsync: str = "batch", writer: type = ImageWriter) -> Pairs:
    pairs = Pairs()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as ours_out, tempfile.TemporaryDirectory() as bare_out:
        bare = Bare(path, size, steps, Path(bare_out), save=True)
        trainer = Trainer(strategy="data_parallel", accelerator="cpu", devices=1, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          # the bare batch first: ours' images are queued after it, so that the writer's
                          # work overlaps ours' next batch (as in a run of ours alone), not the bare batch
                          callbacks=[_Interleave(bare, pairs),
                                     writer(ours_out, write_workers=workers, write_in=write_in, fsync=fsync)])
        module = DiffusionModule("tiny:flux", height=size, width=size, num_inference_steps=steps, guidance_scale=3.5,
                                 call_kwargs={"max_sequence_length": 64})
        every = [p for k in range(count + 1) for p in prompts(k)]
        mask = os.sched_getaffinity(0) if PIN_THREAD else None
        try:
            trainer.predict(module, datamodule=PromptDataModule(every, batch_size=4), return_predictions=False)
        finally:
            if mask is not None:
                os.sched_setaffinity(0, mask)  # --pin-thread: the next path starts as this one did
    if write_in == "process" and workers:  # the writer process has ended and been waited for
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        spent = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
        pairs.writer_cpu = spent / len(every)
    return pairs


def bare_against_saving(path: str, size: int, steps: int, count: int, save: bool) -> Pairs:
    """The bare loop saving nothing (``save`` false: the limit) or saving too (the position in a pair
    alone) against the bare loop saving, taking turns as ours does: batch 0 a warm-up, then ``count``."""
    pairs = Pairs()
    with tempfile.TemporaryDirectory() as out:
        first, saving = Bare(path, size, steps, Path(out), save=save), Bare(path, size, steps, Path(out), save=True)
        for k in range(count + 1):
            times = first.batch(k), saving.batch(k)
            if k:  # batch 0: a warm-up, as ours' first batch is
                pairs.first.append(times[0])
                pairs.second.append(times[1])
    return pairs


class HandOverWriter(ImageWriter):
    files_class = HandOverFiles


class EncodeWriter(ImageWriter):
    files_class = EncodeFiles


PIN: list[int] = []  # --pin, --pin-thread: the compute core and the writers' core
PIN_THREAD: list[bool] = []  # [True] with --pin-thread: the prediction thread alone on the compute core


def _children() -> list[int]:
    found = []
    for task in Path("/proc/self/task").iterdir():
        try:
            found += [int(pid) for pid in (task / "children").read_text().split()]
        except FileNotFoundError:  # a thread that ended since the listing
            pass
    return found


def _python_load() -> None:
    sum(i * i for i in range(10_000))


def _writer_load(picture: Image.Image, folder: Optional[Path]) -> None:
    """The writer's work on one 64x64 image: its PNG at level 1, and with ``folder`` its file calls
    (a temporary file written and synced, renamed, then removed)."""
    if folder is None:
        picture.save(io.BytesIO(), format="PNG", compress_level=1)
    else:
        atomic_write(folder / "image.png", lambda f: picture.save(f, format="PNG", compress_level=1))
        (folder / "image.png").unlink()


def _spin(busy, ready, cpu: int, parent: int, load: str) -> None:
    os.sched_setaffinity(0, {cpu})
    import numpy as np

    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)  # a model's output: no runs to pack
    picture = Image.fromarray(noise)
    with tempfile.TemporaryDirectory(dir=".") as folder:
        work = {"python": _python_load, "png": lambda: _writer_load(picture, None),
                "files": lambda: _writer_load(picture, Path(folder))}[load]
        ready.set()
        while os.getppid() == parent:  # ends with the benchmark, however it ends
            if busy.value:
                work()
            else:
                time.sleep(0.001)


SECOND_CORE_LOADS = {"python": "a Python loop", "png": "64x64 PNGs encoded (level 1)",
                     "files": "64x64 PNGs encoded, written, synced and renamed"}


def second_core_cost(path: str, count: int = 12, load: str = "python") -> Optional[Pairs]:
    """How much slower the compute core runs while the second core is busy with ``load`` (in another
    process) than while it is idle: whether the writers' core is free (ratio 1.00). Batches taking
    turns, busy and idle; ``count`` pairs. The default, a Python loop for 12 pairs, is a rough probe
    (about +-5% on this VM); ``--second-core`` measures the writer's own work for longer. None where
    affinity cannot be set."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        return None
    import multiprocessing

    context = multiprocessing.get_context("fork")  # nothing of torch runs in it
    busy, ready = context.Value("i", 0, lock=False), context.Event()
    mask = os.sched_getaffinity(0)
    compute, other = sorted(mask)[:2]
    spinner = context.Process(target=_spin, args=(busy, ready, other, os.getpid(), load), daemon=True)
    try:
        spinner.start()
        if not ready.wait(timeout=60):
            raise RuntimeError("the probe of the second core did not start")
        os.sched_setaffinity(0, {compute})
        bare, pairs = Bare(path, 64, 20, Path("."), save=False), Pairs()
        bare.batch(0)  # warm-up
        for k in range(count):
            for value in (0, 1) if k % 2 else (1, 0):
                busy.value = value
                time.sleep(0.05)
                (pairs.first if value else pairs.second).append(bare.batch(k))
        return pairs
    finally:
        if spinner.is_alive():
            spinner.kill()
        spinner.join()
        os.sched_setaffinity(0, mask)


RUNS = {
    "nothing": lambda path, size, steps, count, fsync: bare_against_saving(path, size, steps, count, save=False),
    "position": lambda path, size, steps, count, fsync: bare_against_saving(path, size, steps, count, save=True),
    "process": lambda path, size, steps, count, fsync: ours_against_bare(path, size, steps, count, 2, "process", fsync),
    "thread": lambda path, size, steps, count, fsync: ours_against_bare(path, size, steps, count, 2, "thread", fsync),
    "sync": lambda path, size, steps, count, fsync: ours_against_bare(path, size, steps, count, 0, "thread", fsync),
    "ipc": lambda path, size, steps, count, fsync: ours_against_bare(path, size, steps, count, 2, "process", fsync,
                                                                     HandOverWriter),
    "encode": lambda path, size, steps, count, fsync: ours_against_bare(path, size, steps, count, 2, "process", fsync,
                                                                        EncodeWriter),
}


def encoding_table(sizes: list[int]) -> None:
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(inspect_pipeline("tiny:shapes").path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    base = pipe("a red circle and a yellow star on a blue background", height=64, width=64, num_inference_steps=12,
                max_sequence_length=32, generator=torch.Generator().manual_seed(0)).images[0]
    print("\nencoding one picture (tiny:shapes, resized), median of 5:")
    print("| format | " + " | ".join(f"{s}x{s}" for s in sizes) + " |")
    print("| --- |" + " --- |" * len(sizes))
    for name, (fmt, options) in FORMATS.items():
        cells = []
        for size in sizes:
            picture = base.resize((size, size), Image.BICUBIC)
            times, data = [], b""
            for _ in range(5):
                buffer = io.BytesIO()
                start = time.perf_counter()
                picture.save(buffer, format=fmt, **options)
                times.append(time.perf_counter() - start)
                data = buffer.getvalue()
            cells.append(f"{statistics.median(times) * 1000:.1f} ms, {len(data) / 1024:.0f} KB")
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pairs", type=int, nargs="+", default=[200, 60], help="pairs of batches of 4, a size each")
    parser.add_argument("--paths", nargs="+", choices=list(PATHS), default=[p for p in PATHS if p not in PARTS],
                        help="each compared with the bare loop saving PNGs")
    parser.add_argument("--fsync", choices=["batch", "file", "off"], default="batch", help="ours' writer.fsync")
    parser.add_argument("--encode-sizes", type=int, nargs="+", default=[64, 512, 1024, 2048])
    parser.add_argument("--pin", action="store_true",
                        help="compute on the first CPU, ours' writer process on the second (Linux)")
    parser.add_argument("--second-core", nargs="+", choices=list(SECOND_CORE_LOADS),
                        help="measure only how the compute core slows while the second core does each of these "
                             "(--pairs: pairs of batches a load), then stop")
    parser.add_argument("--pin-thread", action="store_true",
                        help="from ours' first batch on, the prediction thread alone on the first CPU and ours' "
                             "writer process on the second (Linux); the bare loop runs on that thread too")
    args = parser.parse_args()
    if min(args.pairs) < 3:
        parser.error("--pairs: at least 3 (the first pair is left out, an interval needs two)")
    torch.set_num_threads(1)
    if args.pin or args.pin_thread:
        PIN[:] = sorted(os.sched_getaffinity(0))[:2]
        PIN_THREAD[:] = [True] if args.pin_thread else []
    if args.pin:
        os.sched_setaffinity(0, {PIN[0]})
    time_pipeline_calls()
    path = inspect_pipeline("tiny:flux").path

    def core_line(when: str) -> None:  # this machine's second core may be free at one time and not at another
        pairs = second_core_cost(path)
        if pairs is not None:
            print(f"{when}, the compute core took {pairs.ratio()[0]:.2f}x its time while the second core was busy "
                  "(against idle; 1.00: a core free for the writers)", flush=True)

    if args.second_core:
        print(f"tiny:flux 64x64, {args.steps} steps, batch 4, one compute thread; batches taking turns, the second "
              f"core busy or idle, {args.pairs[0]} pairs a load:")
        print("| the second core busy with | the compute core's time against idle (95% interval) |")
        print("| --- | --- |")
        for load in args.second_core:
            pairs = second_core_cost(path, args.pairs[0], load)
            if pairs is None:
                parser.error("--second-core needs two CPUs and sched_setaffinity (Linux)")
            mid, low, high = pairs.ratio()
            print(f"| {SECOND_CORE_LOADS[load]} | {mid:.3f} ({low:.3f}-{high:.3f}) |", flush=True)
        return

    for size, count in zip(args.sizes, args.pairs + args.pairs[-1:] * len(args.sizes)):
        runs = {}
        for name, run in RUNS.items():
            if name in args.paths:
                core_line(f"{size}x{size}, before '{PATHS[name]}'")
                runs[PATHS[name]] = run(path, size, args.steps, count, args.fsync)
        print(f"\ntiny:flux {size}x{size}, {args.steps} steps, batch 4, one compute thread; {count} pairs of "
              "batches each, taking turns with the bare loop saving PNGs:")
        print("| path | time per image | against diffusers saving PNGs (95% interval) | the same, the calls "
              "counted alike | in the pipeline call | outside it |")
        print("| --- | --- | --- | --- | --- | --- |")
        total, called, outside = Pairs.per_image([t for pairs in runs.values() for t in pairs.used[1]])
        print(f"| {REFERENCE} | {total:.1f} ms | 1.000 | 1.000 | {called:.1f} ms | {outside:.2f} ms |")
        for name, pairs in runs.items():
            total, called, outside = Pairs.per_image(pairs.used[0])
            cells = [f"{mid:.3f} ({low:.3f}-{high:.3f})" for mid, low, high in
                     (pairs.ratio(), pairs.ratio(lambda t: t[0] - t[1]))]
            print(f"| {name} | {total:.1f} ms | {cells[0]} | {cells[1]} | {called:.1f} ms | {outside:.2f} ms |",
                  flush=True)
        for name, pairs in runs.items():
            if pairs.writer_cpu is not None:
                print(f"{name}: the writer process used {pairs.writer_cpu * 1000:.2f} ms of CPU an image (its start-up "
                      "included)")
        core_line("after them")
    encoding_table(args.encode_sizes)


if __name__ == "__main__":
    main()
