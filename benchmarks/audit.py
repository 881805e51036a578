#!/usr/bin/env python
"""The shadow audit's overhead (``writer.audit``) on tiny:shapes with a step cache on: time per image
without an audit and at two fractions, side by side in one run.

    python benchmarks/audit.py [--images 400] [--fractions 0.01 0.05] [--repeats 3] [--out /tmp/audit-bench]
    python benchmarks/audit.py --drift [--images 20]

``--drift``: the drift table instead, what the audit records for each accelerator: the cache
settings of docs/caching.md's table, a fast attention backend and torchao's int8 quantizations
(every image audited, ``fraction: 1``): PSNR worst and median, SSIM median and the largest
difference in 8-bit levels, over the first ``--images`` held-out captions.

Every row is ``lightning-diffusion predict --config configs/tiny.yaml`` (64x64, 12 steps, batch 5,
true CFG 3) on the first ``--images`` held-out captions with ``model.cache: {type: first_block,
threshold: 0.1}``, one process on one core (``OMP_NUM_THREADS=1``). The settings take turns,
``--repeats`` rounds, and the table gives medians: time per image is the run's wall time after
loading over its images (run.json's summary: ``wall_s - load_s``), ``vs no audit`` its ratio to
the row without an audit, and ``audit share`` the audit's own seconds over the run's pipeline
seconds. The images audited are a hash of their index: the same in every round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = {"type": "first_block", "threshold": 0.1}
DRIFT = [("cache first_block 0.1", "cache", CACHE),
         ("cache first_block 0.2", "cache", {"type": "first_block", "threshold": 0.2}),
         ("cache taylorseer interval 2", "cache", {"type": "taylorseer", "cache_interval": 2}),
         ("cache taylorseer interval 4", "cache", {"type": "taylorseer", "cache_interval": 4}),
         ("attention_backend _native_math", "attention_backend", "_native_math"),
         ("quantization torchao int8wo", "quantization", {"backend": "torchao", "quant_type": "int8wo"}),
         ("quantization torchao int8dq", "quantization", {"backend": "torchao", "quant_type": "int8dq"})]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "lightning_diffusion", *args], cwd=REPO, capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args[:3])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def main() -> None:
    from lightning_diffusion.pipelines.shapes import caption, held_out_scenes

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.05])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="/tmp/audit-bench")
    parser.add_argument("--drift", action="store_true", help="the drift table per cache setting instead")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.txt"
    scenes = held_out_scenes()
    prompts.write_text("\n".join(caption(scenes[i % len(scenes)]) for i in range(args.images)) + "\n")
    if args.drift:
        return drift(prompts, out, args.images)
    rows: list[tuple[str, list[str]]] = [("no audit", [])]
    rows += [(f"fraction {f:g}", ["--writer.audit", json.dumps({"fraction": f})]) for f in args.fractions]
    per_image: dict[str, list[float]] = {name: [] for name, _ in rows}
    share: dict[str, list[float]] = {name: [] for name, _ in rows}
    audited: dict[str, int] = {}
    for repeat in range(args.repeats):
        for name, flags in rows:
            folder = out / name.replace(" ", "-")
            shutil.rmtree(folder, ignore_errors=True)
            cli("predict", "--config", "configs/tiny.yaml", "--data.prompts", str(prompts),
                "--model.cache", json.dumps(CACHE), "--writer.output_dir", str(folder),
                "--trainer.enable_progress_bar", "false", *flags)
            summary = json.loads((folder / "run.json").read_text())["history"][-1]
            busy = sum(summary["busy_s_by_rank"].values())
            audit = summary.get("audit") or {"seconds": 0.0, "images": 0}
            per_image[name].append((summary["wall_s"] - summary["load_s"]) / summary["made"])
            share[name].append(audit["seconds"] / busy)
            audited[name] = audit["images"]
            print(f"[{repeat + 1}/{args.repeats}] {name}: {per_image[name][-1]:.4f} s/image, audit "
                  f"{100 * share[name][-1]:.1f}%", file=sys.stderr)
    base = statistics.median(per_image["no audit"])
    print(f"tiny:shapes, 64x64, 12 steps, batch 5, first_block cache 0.1, {args.images} images, one core, "
          f"median of {args.repeats}\n")
    print("| setting | images audited | s/image | vs no audit | audit share |")
    print("|---|---|---|---|---|")
    for name, _ in rows:
        seconds = statistics.median(per_image[name])
        print(f"| {name} | {audited.get(name, 0)} | {seconds:.4f} | {seconds / base:.3f}x | "
              f"{100 * statistics.median(share[name]):.1f}% |")


def drift(prompts: Path, out: Path, images: int) -> None:
    import statistics as stats

    print(f"tiny:shapes, 64x64, 12 steps, batch 5, {images} held-out captions, every image audited\n")
    print("| accelerator | PSNR worst (dB) | PSNR median (dB) | SSIM median | largest difference (levels) |")
    print("|---|---|---|---|---|")
    for name, option, value in DRIFT:
        folder = out / ("drift-" + name.replace(" ", "-"))
        shutil.rmtree(folder, ignore_errors=True)
        setting = value if isinstance(value, str) else json.dumps(value)
        cli("predict", "--config", "configs/tiny.yaml", "--data.prompts", str(prompts), f"--model.{option}",
            setting, "--writer.output_dir", str(folder), "--trainer.enable_progress_bar", "false",
            "--writer.audit", json.dumps({"fraction": 1.0}))
        lines = [json.loads(line) for line in (folder / "audit.jsonl").read_text().splitlines()]
        psnr = [line["psnr"] for line in lines]
        print(f"| {name} | {min(psnr):.1f} | {stats.median(psnr):.1f} | "
              f"{stats.median(line['ssim'] for line in lines):.4f} | {max(line['max_diff'] for line in lines)} |")


if __name__ == "__main__":
    main()
