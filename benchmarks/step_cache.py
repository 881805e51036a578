#!/usr/bin/env python
"""Step caching on tiny:shapes: time per image against no cache, and the quality cost (PSNR/SSIM
against the uncached images, prompt adherence), one process and Ulysses 2, measured side by side.

    python benchmarks/step_cache.py [--steps 28] [--images 12] [--repeats 1] [--out /tmp/step-cache]

Every row is ``lightning-diffusion predict --config configs/tiny.yaml`` on the first ``--images``
held-out captions (64x64, batch 1, CFG 3 as the model recommends), with ``model.cache`` set; time
per image is the writing rank's images/s of the run's summary (load excluded), and quality is
``lightning-diffusion eval --reference`` against the uncached run of the same layout. Pyramid
attention broadcast and FasterCache are refused with a negative pass, so they run without CFG
(``true_cfg_scale`` 1) against an uncached run without CFG. Each process gets one core
(``OMP_NUM_THREADS=1``), the CPU analogue of one GPU. With ``--repeats`` > 1 the settings run in
turn that many times and the table gives median times. magcache uses FLUX.1's published ratios
(diffusers' ``FLUX_MAG_RATIOS``), not ratios calibrated for tiny:shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RATE = re.compile(r"images/s per writing rank: rank 0: ([0-9.]+)")
REUSED = re.compile(r"cache: (\d+)% of image steps reused")

ONE = ["--trainer.devices", "1"]
ULYSSES = ["--trainer.devices", "2", "--trainer.strategy.class_path",
           "lightning_diffusion.strategies.ContextParallelStrategy", "--trainer.strategy.init_args.ulysses_degree", "2"]
NO_CFG = ["--model.call_kwargs", "{max_sequence_length: 32, true_cfg_scale: 1.0}"]


def settings() -> list[tuple[str, str, list[str], dict | None]]:
    """(row name, baseline row, layout and call flags, cache)."""
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

    mag = [round(float(v), 5) for v in FLUX_MAG_RATIOS]
    rows = [("none", "none", ONE, None)]
    rows += [(f"first_block {t}", "none", ONE, {"type": "first_block", "threshold": t}) for t in (0.1, 0.2)]
    rows += [(f"taylorseer interval {n}", "none", ONE, {"type": "taylorseer", "cache_interval": n}) for n in (2, 4)]
    rows += [(f"magcache {t}", "none", ONE, {"type": "magcache", "threshold": t, "mag_ratios": mag})
             for t in (0.06, 0.24)]
    rows += [("none, ulysses 2", "none, ulysses 2", ULYSSES, None)]
    rows += [(f"first_block {t}, ulysses 2", "none, ulysses 2", ULYSSES, {"type": "first_block", "threshold": t})
             for t in (0.1, 0.2)]
    rows += [("none, no CFG", "none, no CFG", ONE + NO_CFG, None)]
    rows += [(f"pyramid_attention_broadcast {n}, no CFG", "none, no CFG", ONE + NO_CFG,
              {"type": "pyramid_attention_broadcast", "spatial_attention_block_skip_range": n,
               "spatial_attention_timestep_skip_range": [0, 1000]}) for n in (2, 3)]
    rows += [("faster_cache 2, no CFG", "none, no CFG", ONE + NO_CFG,
              {"type": "faster_cache", "spatial_attention_block_skip_range": 2,
               "spatial_attention_timestep_skip_range": [-1, 1000]})]
    return rows


def cli(*args: str, tries: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "lightning_diffusion", *args], cwd=REPO, capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0 and tries > 1:
        print(f"WARNING: {' '.join(args[:3])} exited {proc.returncode}; once more:\n{proc.stderr[-600:]}",
              file=sys.stderr)
        shutil.rmtree(args[args.index("--writer.output_dir") + 1], ignore_errors=True)
        return cli(*args, tries=tries - 1)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args[:3])} failed:\n{proc.stderr[-3000:]}")
    return proc


def main() -> None:
    from lightning_diffusion.pipelines.shapes import caption, held_out_scenes

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--images", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default="/tmp/step-cache")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.txt"
    prompts.write_text("\n".join(caption(s) for s in held_out_scenes()[: args.images]) + "\n")
    rows = settings()
    times: dict[str, list[float]] = {name: [] for name, *_ in rows}
    reused: dict[str, str] = {}
    for repeat in range(args.repeats):
        for name, _, flags, cache in rows:
            folder = out / re.sub(r"[^a-z0-9.]+", "-", name)
            shutil.rmtree(folder, ignore_errors=True)
            proc = cli("predict", "--config", "configs/tiny.yaml", "--data.prompts", str(prompts),
                      "--data.batch_size", "1", "--model.num_inference_steps", str(args.steps),
                       "--writer.output_dir", str(folder), *flags,
                       *(["--model.cache", json.dumps(cache)] if cache else []), tries=2)
            log = proc.stdout + proc.stderr
            times[name].append(1 / float(RATE.search(log).group(1)))
            found = REUSED.search(log)
            reused[name] = f"{found.group(1)}%" if found else ""
            print(f"[{repeat + 1}/{args.repeats}] {name}: {times[name][-1]:.3f} s/image", file=sys.stderr)
    print(f"tiny:shapes, 64x64, {args.steps} steps, {args.images} held-out captions, batch 1, one core per process\n")
    print("| setting | s/image | vs no cache | image steps reused | PSNR (dB) mean / min | SSIM mean | colour "
          "| position |")
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    for name, baseline, _, cache in rows:
        folder = out / re.sub(r"[^a-z0-9.]+", "-", name)
        ref = out / re.sub(r"[^a-z0-9.]+", "-", baseline)
        report = json.loads(_eval(folder, ref if cache else None))
        summary = report["summary"]
        seconds = statistics.median(times[name])
        ratio = seconds / statistics.median(times[baseline])
        quality = summary.get("reference", {})
        adherence = summary.get("adherence", {})
        psnr = f"{quality['psnr_mean']:.1f} / {quality['psnr_min']:.1f}" if quality else "-"
        ssim = f"{quality['ssim_mean']:.3f}" if quality else "-"
        share = {k: f"{100 * adherence[k]['share']:.0f}%" if k in adherence else "-" for k in ("colour", "position")}
        print(f"| {name} | {seconds:.3f} | {ratio:.2f}x | {reused.get(name) or '-'} | {psnr} | {ssim} | "
              f"{share['colour']} | {share['position']} |")
        results[name] = {"seconds_per_image": seconds, "ratio": ratio, "reference": quality, "adherence": adherence}
    (out / "results.json").write_text(json.dumps(results, indent=2))


def _eval(folder: Path, reference: Path | None) -> str:
    return cli("eval", str(folder), *(["--reference", str(reference)] if reference else []), "--json").stdout


if __name__ == "__main__":
    main()
