"""Our predict path against diffusers called directly, side by side in one process.

    python benchmarks/data_parallel_overhead.py [--model tiny:flux] [--images 32] [--batch-size 4] [--repeats 3]

(a) diffusers: load the pipeline, call it batch by batch with one CPU generator per image, save
    each image as PNG (what a hand-written script does);
(b) ours: ``Trainer(strategy="data_parallel", devices=1).predict`` with ``DiffusionModule``,
    ``PromptDataModule`` and ``ImageWriter`` (PNG with metadata, atomic writes, manifest).

Runs alternate (a, b, a, b, ...) so that machine noise hits both alike; the table reports the
median generation time (pipeline loaded, first image to last file) and the ratio b / a. With a
tiny model the per-image work is small, so the ratio is an upper bound on our overhead.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer

from lightning_diffusion import DiffusionModule, ImageWriter, PromptDataModule
from lightning_diffusion.pipelines import bare
from lightning_diffusion.pipelines.model_folder import inspect_pipeline


def run_diffusers(path: str, prompts: list[str], batch_size: int, size: int, steps: int, out: Path) -> float:
    pipe = bare.load(path)
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        chunk = prompts[first : first + batch_size]
        images = bare.call(pipe, chunk, range(first, first + len(chunk)), height=size, width=size,
                           num_inference_steps=steps, guidance_scale=3.5, max_sequence_length=64).images
        for i, image in enumerate(images):
            image.save(out / f"{first + i:06d}.png")
    return time.perf_counter() - start


class _Clock(Callback):
    def on_predict_start(self, trainer, pl_module):
        self.start = time.perf_counter()

    def teardown(self, trainer, pl_module, stage):
        self.elapsed = time.perf_counter() - self.start


def run_ours(model: str, prompts: list[str], batch_size: int, size: int, steps: int, out: Path) -> float:
    clock = _Clock()
    trainer = Trainer(
        strategy="data_parallel", accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[ImageWriter(str(out)), clock],
    )
    module = DiffusionModule(
        model, height=size, width=size, num_inference_steps=steps, guidance_scale=3.5,
        call_kwargs={"max_sequence_length": 64},
    )
    trainer.predict(module, datamodule=PromptDataModule(prompts, batch_size=batch_size), return_predictions=False)
    return clock.elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny:flux")
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    path = inspect_pipeline(args.model).path
    prompts = [f"benchmark prompt number {i}" for i in range(args.images)]
    times: dict[str, list[float]] = {"diffusers": [], "lightning-diffusion": []}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            times["diffusers"].append(run_diffusers(path, prompts, args.batch_size, args.size, args.steps, Path(a)))
            times["lightning-diffusion"].append(
                run_ours(args.model, prompts, args.batch_size, args.size, args.steps, Path(b))
            )
    base = statistics.median(times["diffusers"])
    print(f"\n{args.images} images of {args.size}x{args.size}, {args.steps} steps, batch {args.batch_size}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print("| Path | Time (s) | Images / sec | Ratio |")
    print("| --- | --- | --- | --- |")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} | {args.images / median:.1f} | {median / base:.2f} |")


if __name__ == "__main__":
    main()
