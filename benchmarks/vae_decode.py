"""Tile-parallel VAE decoding: decode time and peak memory per rank with the tiles of a tiled decode
dealt over a group of 2 ranks, against one process's tiled (and untiled) decode, side by side.

    python benchmarks/vae_decode.py [--model tiny:flux] [--size 1024] [--frames 1] [--repeats 3] [--whole]

Each process loads the pipeline, turns tiling on (``--tiles`` settings for the video VAEs), decodes
one batch of random latents once untimed, then ``--repeats`` times timed. Memory: resident set size
sampled every millisecond during the first decode, minus the size just before it. One core per
process (``OMP_NUM_THREADS=1``), the CPU analogue of one GPU per rank. The group of 2 is
``group_work.GroupWork`` on a gloo group of two processes, as a Ulysses-2 or cfg-2 run installs it.
``--whole`` adds the time per image of whole runs (``lightning-diffusion benchmark``, one process
against Ulysses 2, tiling on both, 4 prompts with the first untimed) of the same model, size and
frames (``configs/tiny-NAME.yaml``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakSampler:
    """Largest resident set size seen while the ``with`` block runs, above the size at its start."""

    def __enter__(self) -> "PeakSampler":
        self.start = self.peak = rss()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss())

    @property
    def grown(self) -> int:
        return self.peak - self.start


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    from diffusers import DiffusionPipeline

    from lightning_diffusion.pipelines import tiny
    from lightning_diffusion.strategies.group_work import GroupWork

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pipeline = DiffusionPipeline.from_pretrained(tiny.resolve(args.model))
    vae = pipeline.vae
    video = hasattr(vae.config, "z_dim")
    if args.tiled:
        vae.enable_tiling(**(json.loads(args.tiles) if video else {}))
    channels = vae.config.z_dim if video else vae.config.latent_channels
    shape = (args.batch, channels, *([(args.frames - 1) // 4 + 1] if video else []), args.size // 8, args.size // 8)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    work = GroupWork(pipeline, dist.group.WORLD) if world > 1 else None
    times = []
    with torch.inference_mode():
        # Memory on the first decode: later ones reuse what the allocator kept from it.
        with PeakSampler() as peak:
            vae.decode(z, return_dict=False)
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            vae.decode(z, return_dict=False)
            times.append(time.perf_counter() - start)
    decodes = args.repeats + 1
    tiles = (work.tiles_decoded // decodes, work.tiles_seen // decodes) if work is not None else None
    Path(out, f"{world}-{int(args.tiled)}-{rank}.json").write_text(json.dumps(
        {"seconds": statistics.median(times), "grown": peak.grown, "tiles": tiles}))
    dist.destroy_process_group()


def measure(world: int, tiled: bool, args: argparse.Namespace, out: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args.tiled = tiled
    torch.multiprocessing.spawn(worker, args=(world, port, args, out), nprocs=world)
    ranks = [json.loads(Path(out, f"{world}-{int(tiled)}-{r}.json").read_text()) for r in range(world)]
    return {"seconds": max(r["seconds"] for r in ranks), "grown": [r["grown"] for r in ranks],
            "tiles": [r["tiles"] for r in ranks]}


def whole(args: argparse.Namespace, tmp: str) -> dict[str, float]:
    """Time per image of whole runs of --model at --size (and --frames) with tiling: one process
    against Ulysses 2."""
    times = {}
    model = args.model.removeprefix("tiny:")
    video = ["--model.num_frames", str(args.frames), "--model.vae_tiling", args.tiles] if args.frames > 1 else \
        ["--model.vae_tiling", "true"]
    prompts = Path(tmp) / "prompts.txt"
    prompts.write_text("".join(f"a benchmark picture number {i}\n" for i in range(4)))
    for name, flags in (("one process", ["--trainer.devices", "1"]),
                        ("ulysses 2", ["--trainer.devices", "2", "--trainer.strategy", "ulysses"])):
        report = Path(tmp) / f"{name}.json"
        command = [sys.executable, "-m", "lightning_diffusion", "benchmark", "--config", f"configs/tiny-{model}.yaml",
                   "--json", str(report), "--data.prompts", str(prompts), "--data.batch_size", "1",
                   "--model.height", str(args.size), "--model.width", str(args.size), *video, *flags]
        proc = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        times[name] = 1 / json.loads(report.read_text())["images_per_sec"]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny:flux")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--frames", type=int, default=1, help="video frames (4k+1) for the video VAEs")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiles", default=json.dumps({"tile_sample_min_height": 128, "tile_sample_min_width": 128,
                                                       "tile_sample_stride_height": 96,
                                                       "tile_sample_stride_width": 96}),
                        help="enable_tiling settings of the video VAEs (JSON)")
    parser.add_argument("--whole", action="store_true")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="vae-bench-") as tmp:
        untiled = measure(1, False, args, tmp)
        one = measure(1, True, args, tmp)
        two = measure(2, True, args, tmp)
        extra = whole(args, tmp) if args.whole else None
    mb = 1024 * 1024
    what = f"{args.model} {args.size}x{args.size}" + (f", {args.frames} frames" if args.frames > 1 else "")
    print(f"\n{what}, batch {args.batch}, decode (median of {args.repeats}, one core per process):")
    print("| decode | time | tiles per decode, this rank's of all | peak memory growth per rank |")
    print("| --- | --- | --- | --- |")
    print(f"| one process, untiled | {untiled['seconds']:.3f} s | | {untiled['grown'][0] / mb:.0f} MB |")
    print(f"| one process, tiled | {one['seconds']:.3f} s | | {one['grown'][0] / mb:.0f} MB |")
    shares = ", ".join(f"{done} of {seen}" for done, seen in two["tiles"])
    memory = ", ".join(f"{g / mb:.0f} MB" for g in two["grown"])
    print(f"| group of 2, tiles dealt | {two['seconds']:.3f} s ({two['seconds'] / one['seconds']:.2f}x tiled) "
          f"| {shares} | {memory} |")
    if extra:
        one_s, two_s = extra["one process"], extra["ulysses 2"]
        print(f"\nwhole run, {what}, tiled, time per image (3 timed of 4): one process {one_s:.3f} s, "
              f"Ulysses 2 {two_s:.3f} s ({two_s / one_s:.2f}x)")


if __name__ == "__main__":
    main()
