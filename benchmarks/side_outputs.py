"""What ``writer.save_latents`` and ``writer.save_text_embeddings`` cost: bytes and milliseconds per
image, against the same work without them, side by side in one process.

    python benchmarks/side_outputs.py [--size 128] [--steps 4] [--batch 4] [--pairs 15]
        [--formats files webdataset parquet]

Two costs, each measured in pairs that take turns in one process (this VM's speed moves by 10% and
more from one run to the next, far more than a side output costs, so runs one after the other
cannot show it; a pair's two halves run within a second of each other, in alternating order):

- capture, on the prediction thread: a tiny:flux (float32) pipeline call of ``--batch`` images,
  plain, against the same call under ``SideCapture.during`` with both side outputs, followed by
  ``per_image`` (the per-image safetensors bytes);
- writing, in the writer: ``OutputFiles.write_batch`` of those images with their side outputs against
  the same images without, into a fresh folder, for each format (a shard closed at the batch's end).

Each row gives the median over the pairs of the time per image with and without, the median of the
pairs' differences and their ratio; bytes are the side outputs' and the image's per image.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

SIDES = ("latents", "text_embeddings")


def paired(pairs: int, plain: Callable[[], None], sides: Callable[[], None]) -> tuple[float, float, float]:
    """Median seconds of ``plain`` and ``sides`` and of their differences, over ``pairs`` alternating pairs."""
    a, b, diff = [], [], []
    for n in range(pairs):
        order = (plain, sides) if n % 2 == 0 else (sides, plain)
        took = {}
        for run in order:
            start = time.perf_counter()
            run()
            took[run] = time.perf_counter() - start
        a.append(took[plain])
        b.append(took[sides])
        diff.append(took[sides] - took[plain])
    return statistics.median(a), statistics.median(b), statistics.median(diff)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--formats", nargs="+", default=["files", "webdataset", "parquet"])
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import numpy as np
    import torch
    from diffusers import FluxPipeline

    from lightning_diffusion.output.files import OutputFiles
    from lightning_diffusion.output.settings import WriterSettings
    from lightning_diffusion.pipelines import tiny
    from lightning_diffusion.pipelines.side_outputs import SideCapture

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    pipe = FluxPipeline.from_pretrained(tiny.resolve("tiny:flux"), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    prompts = [f"prompt {n}" for n in range(args.batch)]
    capture = SideCapture(latents=True, text_embeddings=True)

    def call() -> Any:
        generators = [torch.Generator("cpu").manual_seed(n) for n in range(args.batch)]
        return pipe(prompts, generator=generators, height=args.size, width=args.size, output_type="np",
                    num_inference_steps=args.steps, max_sequence_length=64).images

    made: dict[str, Any] = {}

    def call_with_sides() -> None:
        with capture.during(pipe) as captured:
            made["images"] = call()
        made["sides"] = capture.per_image(captured, pipe, args.batch, args.batch)

    call_with_sides()  # warm-up, and the images and side outputs the writing rows write
    rows = []
    plain_s, sides_s, diff_s = paired(args.pairs, call, call_with_sides)
    rows.append(("capture (pipeline call)", plain_s, sides_s, diff_s))
    items = [{"index": n, "prompt": prompts[n], "seed": n, "negative_prompt": None,
              "image": np.asarray(made["images"][n], dtype=np.float32),
              "params": {"model": "tiny:flux", "height": args.size, "width": args.size}, "sides": made["sides"][n]}
             for n in range(args.batch)]
    bare = [{k: v for k, v in item.items() if k != "sides"} for item in items]
    side_bytes = statistics.mean(sum(len(s["data"]) for s in side.values()) for side in made["sides"])
    image_bytes = 0.0
    with tempfile.TemporaryDirectory() as scratch:
        for fmt in args.formats:
            count = [0]

            def write(batch: list[dict[str, Any]], fmt: str = fmt, count: list[int] = count) -> None:
                count[0] += 1
                folder = Path(scratch) / f"{fmt}-{count[0]}"
                folder.mkdir()
                on = "sides" in batch[0]
                settings = WriterSettings(format=fmt, save_latents=on, save_text_embeddings=on)
                files = OutputFiles(folder, settings, folder / "manifest.part-0.jsonl")
                files.write_batch(batch)  # type: ignore[arg-type]
                files.finish()

            write(bare)
            image_bytes = sum(p.stat().st_size for p in Path(scratch).glob("files-1/*.png")) / args.batch or image_bytes
            plain_s, sides_s, diff_s = paired(args.pairs, lambda: write(bare), lambda: write(items))
            rows.append((f"writing, {fmt}", plain_s, sides_s, diff_s))
    print(f"tiny:flux float32, {args.size}x{args.size}, {args.steps} steps, batch {args.batch}, {args.pairs} pairs; "
          f"side outputs {side_bytes:,.0f} bytes/image (latents and text embeddings), "
          f"PNG {image_bytes:,.0f} bytes/image")
    print("| what | without, ms/image | with both, ms/image | difference, ms/image | ratio |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for what, plain_s, sides_s, diff_s in rows:
        per = 1000 / args.batch
        print(f"| {what} | {plain_s * per:.2f} | {sides_s * per:.2f} | {diff_s * per:+.2f} | {sides_s / plain_s:.2f} |")


if __name__ == "__main__":
    main()
