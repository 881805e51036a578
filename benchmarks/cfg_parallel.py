"""CFG parallel: time per image with cfg=2 (two processes, one guidance pass each) against cfg=1
(one process, both passes in turn), measured side by side with ``lightning-diffusion benchmark``.

    python benchmarks/cfg_parallel.py [--size 256] [--steps 20] [--images 6] [--repeats 3]

Runs alternate (cfg1, cfg2, dp2, cfg1, ...) on tiny:qwenimage with true CFG (a negative prompt for every
image, ``true_cfg_scale`` 4), batch size 1, the first image untimed; the table gives medians.
Each process gets ``--threads`` cores (``OMP_NUM_THREADS``, default 1), the CPU analogue of one GPU
per rank: cfg=1 uses one device, cfg=2 two. ``--threads 0`` instead gives cfg=1 every core and each
cfg=2 rank half of them (the same machine either way). Only the transformer passes are split:
text encoding and VAE decoding run on both ranks of a pair, so the ratio approaches 0.5 as the
transformer's share of the time grows (more steps, larger images, a larger model). The last
column, two data-parallel replicas on the same processes, shows what two processes buy on this
machine at all (the floor for cfg=2 is that ratio, reached only if the transformer were all).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(config: Path, prompts: Path, size: int, steps: int, cfg: int, threads: int, out: Path) -> float:
    strategy = {
        1: ["--trainer.strategy", "data_parallel", "--trainer.devices", "1"],
        2: ["--trainer.strategy", "cfg_parallel", "--trainer.devices", "2"],
        0: ["--trainer.strategy", "data_parallel", "--trainer.devices", "2"],  # two replicas, for scale
    }[cfg]
    command = [
        sys.executable, "-m", "lightning_diffusion", "benchmark", "--config", str(config), "--json", str(out),
        "--data.prompts", str(prompts), "--data.batch_size", "1", "--model.height", str(size),
        "--model.width", str(size), "--model.num_inference_steps", str(steps), *strategy,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"cfg={cfg} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    return 1 / result["images_per_sec"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--images", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="cores per process; 0: split the machine")
    args = parser.parse_args()
    repo = Path(__file__).resolve().parents[1]
    cores = os.cpu_count() or 2
    times: dict[int, list[float]] = {1: [], 2: [], 0: []}
    with tempfile.TemporaryDirectory(prefix="cfg-bench-") as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("".join(
            json.dumps({"prompt": f"a benchmark picture number {i}", "negative_prompt": "blurry, low quality"}) + "\n"
            for i in range(args.images)
        ))
        for repeat in range(args.repeats):
            for cfg in (1, 2, 0):
                threads = args.threads or (cores if cfg == 1 else max(1, cores // 2))
                seconds = run(repo / "configs" / "tiny-qwenimage.yaml", prompts, args.size, args.steps, cfg,
                              threads, Path(tmp) / f"r{repeat}-{cfg}.json")
                times[cfg].append(seconds)
                print(f"repeat {repeat}: {'dp=2' if cfg == 0 else f'cfg={cfg}'} {seconds:.3f} s/image", flush=True)
    one, two, dp2 = (statistics.median(times[k]) for k in (1, 2, 0))
    threads = f"{args.threads} core(s) per process" if args.threads else f"{cores} cores split"
    print(f"\n| {args.size}x{args.size}, {args.steps} steps, {threads} | cfg=1 | cfg=2 | cfg2 / cfg1 | dp=2 / cfg1 |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| time per image (median of {args.repeats}) | {one:.3f} s | {two:.3f} s | {two / one:.2f} | {dp2 / one:.2f} |")


if __name__ == "__main__":
    main()
