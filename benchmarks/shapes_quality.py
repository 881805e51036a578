#!/usr/bin/env python
"""tiny:shapes quality and speed: prompt adherence on the 200 held-out captions, FID/KID against the
captions drawn exactly, the time to load the shipped weights and the quickstart's wall time.

    OMP_NUM_THREADS=2 python benchmarks/shapes_quality.py [--settings 20:1 20:3 12:3] [--out /tmp/shapes-quality]

Each setting runs ``lightning-diffusion predict --config configs/tiny.yaml`` on the held-out
captions (``lightning_diffusion.pipelines.shapes.held_out_scenes()``, never trained on) and reads the folder
with ``lightning-diffusion eval --fid --json``; the table is printed in Markdown. Then ``--pairs``
two-shape captions (``shapes.held_out_pairs()``) at the recommended settings: the share whose both
shapes' colours are drawn (``both_colours``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cli(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "lightning_diffusion", *args], cwd=REPO, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args[:3])} failed:\n{proc.stderr[-3000:]}")
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", default=["20:1", "20:3", "12:3"],
                        help="STEPS:TRUE_CFG_SCALE pairs (1: no guidance; else against the empty prompt)")
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--pairs", type=int, default=200,
                        help="two-shape captions (shapes.held_out_pairs) drawn at the recommended settings; 0: none")
    parser.add_argument("--out", default="/tmp/shapes-quality")
    args = parser.parse_args()

    import torch
    from diffusers import FluxPipeline

    from lightning_diffusion.pipelines import shapes, tiny

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "held-out.txt"
    prompts.write_text("".join(shapes.caption(s) + "\n" for s in shapes.held_out_scenes(args.count)))

    start = time.perf_counter()
    FluxPipeline.from_pretrained(tiny.resolve("tiny:shapes"), torch_dtype=torch.float32)
    load_s = time.perf_counter() - start

    start = time.perf_counter()
    shutil.rmtree(out / "quickstart", ignore_errors=True)
    cli("predict", "--config", "configs/tiny.yaml", "--writer.output_dir", str(out / "quickstart"))
    quickstart_s = time.perf_counter() - start

    settings = [(int(s.split(":")[0]), float(s.split(":")[1])) for s in args.settings]
    print(f"tiny:shapes: weights load in {load_s:.2f} s; quickstart (10 images, configs/tiny.yaml) "
          f"{quickstart_s:.1f} s wall, process start included")
    print("| steps | true CFG | colour adherence | shape adherence | position adherence | FID | KID "
          "| images/s (wall, start and load included) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for steps, cfg in settings:
        folder = out / f"steps{steps}-cfg{cfg:g}"
        extra = ["--model.num_inference_steps", str(steps), "--model.call_kwargs.true_cfg_scale", str(cfg)]
        shutil.rmtree(folder, ignore_errors=True)  # measure every image, never resume
        start = time.perf_counter()
        cli("predict", "--config", "configs/tiny.yaml", "--data.prompts", str(prompts), "--writer.output_dir",
            str(folder), *extra)
        seconds = time.perf_counter() - start
        summary = json.loads(cli("eval", str(folder), "--fid", "--json").stdout)["summary"]
        a, fid = summary["adherence"], summary["fid"]
        print(f"| {steps} | {cfg:g} | {100 * a['colour']['share']:.1f}% | {100 * a['shape']['share']:.1f}% | "
              f"{100 * a['position']['share']:.1f}% of {a['position']['images']} | {fid['fid']:.2f} | "
              f"{fid['kid']:.4f} | {args.count / seconds:.1f} |", flush=True)
    if args.pairs:
        pairs = out / "pairs.txt"
        pairs.write_text("".join(shapes.caption(s) + "\n" for s in shapes.held_out_pairs(args.pairs)))
        folder = out / "pairs"
        shutil.rmtree(folder, ignore_errors=True)
        cli("predict", "--config", "configs/tiny.yaml", "--data.prompts", str(pairs), "--writer.output_dir",
            str(folder))
        a = json.loads(cli("eval", str(folder), "--json").stdout)["summary"]["adherence"]
        print(f"two-shape captions ({args.pairs}, the recommended settings): both shapes' colours and the background "
              f"right in {100 * a['both_colours']['share']:.1f}%; the detector's main shape's colour and the "
              f"background in {100 * a['colour']['share']:.1f}%", flush=True)


if __name__ == "__main__":
    main()
