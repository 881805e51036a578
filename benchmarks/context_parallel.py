"""Context-parallel modes: our strategy against a torchrun-style script that calls diffusers directly.

    python benchmarks/context_parallel.py [--size 256] [--steps 8] [--images 4] [--modes ulysses ring unified]

For each mode, two runs with the same processes, prompts, seeds and sizes:
(a) diffusers: ``torchrun`` starts the ranks; the script initialises gloo (or NCCL), loads the
    pipeline, calls ``enable_parallelism(ContextParallelConfig(...))`` and loops over the prompts
    (what the diffusers guide shows);
(b) ours: ``Trainer(strategy=ContextParallelStrategy(...)).predict`` with the writer.
Runs alternate (a, b, a, b, ...) and the table gives medians. Each rank 0 reports the generation
time (pipeline loaded, first image to last image) and its peak resident memory. Time / Iter is that
time over images x steps, so it includes text encoding and decoding. On CPU both sides need the
rehearsal patches of ``lightning_diffusion.pipelines.compat``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODES = {
    "ulysses": dict(nproc=2, ulysses_degree=2, ring_degree=1),
    "ring": dict(nproc=2, ulysses_degree=1, ring_degree=2),
    "unified": dict(nproc=4, ulysses_degree=2, ring_degree=2),
}


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def prompts(n: int) -> list[str]:
    return [f"benchmark prompt number {i}" for i in range(n)]


def worker_diffusers(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from diffusers import ContextParallelConfig, DiffusionPipeline
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_diffusion.pipelines import compat
    from lightning_diffusion.pipelines.model_folder import inspect_pipeline

    dist.init_process_group("gloo")
    mode = MODES[args.mode]
    mesh = init_device_mesh("cpu", (mode["ring_degree"], mode["ulysses_degree"]), mesh_dim_names=("ring", "ulysses"))
    compat.apply_cpu_rehearsal_patches()
    pipe = DiffusionPipeline.from_pretrained(inspect_pipeline(args.model).path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.enable_parallelism(
        config=ContextParallelConfig(ring_degree=mode["ring_degree"], ulysses_degree=mode["ulysses_degree"], mesh=mesh)
    )
    dist.barrier()
    start = time.perf_counter()
    with torch.inference_mode():
        for i, prompt in enumerate(prompts(args.images)):
            image = pipe(
                prompt, height=args.size, width=args.size, num_inference_steps=args.steps, guidance_scale=3.5,
                generator=torch.Generator("cpu").manual_seed(i), max_sequence_length=64,
            ).images[0]
            if dist.get_rank() == 0:
                image.save(Path(args.out) / f"{i:06d}.png")
    dist.barrier()
    elapsed = time.perf_counter() - start
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps({"seconds": elapsed, "peak_gb": peak_rss_gb()}))
    dist.destroy_process_group()


def worker_ours(args: argparse.Namespace) -> None:
    from lightning.pytorch import Callback, Trainer

    from lightning_diffusion import DiffusionModule, ImageWriter, PromptDataModule
    from lightning_diffusion.strategies import ContextParallelStrategy

    class Clock(Callback):
        def on_predict_start(self, trainer, pl_module):
            trainer.strategy.barrier()
            self.start = time.perf_counter()

        def teardown(self, trainer, pl_module, stage):
            elapsed = time.perf_counter() - self.start
            if trainer.is_global_zero:
                Path(args.result).write_text(json.dumps({"seconds": elapsed, "peak_gb": peak_rss_gb()}))

    mode = MODES[args.mode]
    trainer = Trainer(
        accelerator="cpu", devices=mode["nproc"], logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False,
        strategy=ContextParallelStrategy(ulysses_degree=mode["ulysses_degree"], ring_degree=mode["ring_degree"]),
        callbacks=[ImageWriter(args.out), Clock()],
    )
    module = DiffusionModule(
        args.model, height=args.size, width=args.size, num_inference_steps=args.steps, guidance_scale=3.5,
        call_kwargs={"max_sequence_length": 64},
    )
    trainer.predict(module, datamodule=PromptDataModule(prompts(args.images), batch_size=1), return_predictions=False)


def run(kind: str, mode: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        result = Path(out) / "result.json"
        common = [__file__, "--worker", kind, "--mode", mode, "--out", out, "--result", str(result),
                  "--model", args.model, "--size", str(args.size), "--steps", str(args.steps),
                  "--images", str(args.images)]
        if kind == "diffusers":
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(MODES[mode]["nproc"]),
                       "--master-port", "29731", *common]
        else:
            command = [sys.executable, *common]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // MODES[mode]["nproc"]))}
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny:flux")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", choices=["diffusers", "ours"])
    parser.add_argument("--mode", choices=list(MODES))
    parser.add_argument("--out")
    parser.add_argument("--result")
    args = parser.parse_args()
    if args.worker == "diffusers":
        return worker_diffusers(args)
    if args.worker == "ours":
        return worker_ours(args)

    tokens = (args.size // 16) ** 2
    print(f"{args.images} images of {args.size}x{args.size} ({tokens} image tokens), {args.steps} steps, "
          f"{args.model}, CPU gloo, {os.cpu_count()} cores")
    print("| CP Backend | Path | Time / Iter (ms) | range over runs | Steps / sec | Peak memory (GB, rank 0 RSS) "
          "| Shape | Ours / diffusers |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode in args.modes:
        runs: dict[str, list[dict]] = {"diffusers": [], "ours": []}
        for _ in range(args.repeats):  # alternate, so that machine noise hits both alike
            for kind in runs:
                runs[kind].append(run(kind, mode, args))
        seconds = {kind: statistics.median(r["seconds"] for r in results) for kind, results in runs.items()}
        for kind, results in runs.items():
            per_step = seconds[kind] / (args.images * args.steps)
            peak = max(r["peak_gb"] for r in results)
            spread = [r["seconds"] / (args.images * args.steps) * 1000 for r in results]
            print(f"| {mode} | {kind} | {per_step * 1000:.1f} | {min(spread):.1f}-{max(spread):.1f} | "
                  f"{1 / per_step:.2f} | {peak:.2f} | {args.size}x{args.size} | "
                  f"{seconds[kind] / seconds['diffusers']:.2f} |")


if __name__ == "__main__":
    main()
