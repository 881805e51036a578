"""Writing images off the prediction thread: marginal time per image against a bare diffusers loop,
and the encoding cost of each format and size, side by side in one run.

    python benchmarks/writing.py [--sizes 64 256] [--steps 20] [--few 4] [--many 36] [--repeats 3]

Marginal time per image: (time of ``many`` prompts - time of ``few``) / (many - few), so the fixed
costs (load, start, merge) drop out. One process, one compute thread (``OMP_NUM_THREADS=1``: one
core computes, as one GPU would; the second core is free for the writers). Paths, alternating within each
repeat: a bare diffusers loop that saves PNGs synchronously at our compression level (1), the
same loop saving nothing (the limit), and ours (``Trainer.predict`` with ``ImageWriter``: PNG with
metadata, atomic writes, manifest) writing in its writer process (the default), in threads of the
rank (``write_in: thread``), and on the prediction thread (``write_workers: 0``).
Encoding: a tiny:shapes picture resized to each size, each format, median of 5 encodes.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

# One compute thread, set before torch starts its OpenMP pool: with only torch.set_num_threads(1),
# an OpenMP worker made at start-up spins on the second core (measured: 1.7 s of CPU in a 1.9 s run),
# the core this benchmark means to leave to the writers.
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer
from PIL import Image

from lightning_diffusion import DiffusionModule, ImageWriter, PromptDataModule
from lightning_diffusion.pipelines import inspect_pipeline

FORMATS = {"png level 1": ("PNG", {"compress_level": 1}), "png level 6 (Pillow's default)": ("PNG", {"compress_level": 6}),
           "webp q90": ("WEBP", {"quality": 90}), "jpeg q90": ("JPEG", {"quality": 90})}


def bare(path: str, prompts: list[str], size: int, steps: int, out: Path, save: bool) -> float:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompts), 4):
            chunk = prompts[first: first + 4]
            images = pipe(chunk, height=size, width=size, num_inference_steps=steps, guidance_scale=3.5,
                          generator=[torch.Generator("cpu").manual_seed(first + i) for i in range(len(chunk))],
                          max_sequence_length=64).images
            if save:
                for i, image in enumerate(images):
                    image.save(out / f"{first + i:06d}.png", compress_level=1)
    return time.perf_counter() - start


class _Clock(Callback):
    def on_predict_start(self, trainer, pl_module):
        self.start = time.perf_counter()

    def teardown(self, trainer, pl_module, stage):  # after the writer drained its queue
        self.elapsed = time.perf_counter() - self.start


def ours(prompts: list[str], size: int, steps: int, out: Path, workers: int, write_in: str = "process") -> float:
    clock = _Clock()
    trainer = Trainer(strategy="data_parallel", accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ImageWriter(str(out), write_workers=workers, write_in=write_in), clock])
    module = DiffusionModule("tiny:flux", height=size, width=size, num_inference_steps=steps, guidance_scale=3.5,
                             call_kwargs={"max_sequence_length": 64})
    trainer.predict(module, datamodule=PromptDataModule(prompts, batch_size=4), return_predictions=False)
    return clock.elapsed


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
    parser.add_argument("--few", type=int, default=4)
    parser.add_argument("--many", type=int, default=36)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--encode-sizes", type=int, nargs="+", default=[64, 512, 1024, 2048])
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = inspect_pipeline("tiny:flux").path
    paths = {
        "diffusers, PNG saved (level 1)": lambda p, s, o: bare(path, p, s, args.steps, o, True),
        "diffusers, nothing saved": lambda p, s, o: bare(path, p, s, args.steps, o, False),
        "ours, writer process (default)": lambda p, s, o: ours(p, s, args.steps, o, 2, "process"),
        "ours, writer threads (write_in: thread)": lambda p, s, o: ours(p, s, args.steps, o, 2, "thread"),
        "ours, on the prediction thread (write_workers: 0)": lambda p, s, o: ours(p, s, args.steps, o, 0),
    }
    for size in args.sizes:
        marginal: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, run in paths.items():
                spent = {}
                for count in (args.few, args.many):
                    prompts = [f"benchmark prompt number {i}" for i in range(count)]
                    with tempfile.TemporaryDirectory() as out:
                        spent[count] = run(prompts, size, Path(out))
                marginal[name].append((spent[args.many] - spent[args.few]) / (args.many - args.few))
        base = statistics.median(marginal["diffusers, PNG saved (level 1)"])
        print(f"\ntiny:flux {size}x{size}, {args.steps} steps, batch 4, one compute thread, marginal time per image "
              f"({args.few} vs {args.many} prompts), medians of {args.repeats}:")
        print("| path | time per image | against diffusers saving PNGs | each repeat |")
        print("| --- | --- | --- | --- |")
        for name, values in marginal.items():
            value = statistics.median(values)
            each = " ".join(f"{v / base:.2f}" for v in values)
            print(f"| {name} | {value * 1000:.1f} ms | {value / base:.2f} | {each} |", flush=True)
    encoding_table(args.encode_sizes)


if __name__ == "__main__":
    main()
