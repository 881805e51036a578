"""CFG parallel: time per image with cfg=2 (two processes, one guidance pass each) against cfg=1
(one process, both passes in turn), measured side by side with ``lightning-diffusion benchmark``.

    python benchmarks/cfg_parallel.py [--size 256] [--steps 20] [--images 16] [--batch-size 4] [--repeats 3]

Runs alternate (cfg1, cfg2, cfg2 without the split of text encoding and decoding, dp2, cfg1, ...) on
tiny:qwenimage with true CFG (a negative prompt for every image, ``true_cfg_scale`` 4), the first batch
untimed; the table gives medians.
Each process gets ``--threads`` cores (``OMP_NUM_THREADS``, default 1), the CPU analogue of one GPU
per rank: cfg=1 uses one device, cfg=2 two. ``--threads 0`` instead gives cfg=1 every core and each
cfg=2 rank half of them (the same machine either way). cfg=2 splits the transformer passes by
branch and, in batches of two or more, text encoding and VAE decoding by sample (``group_work``);
"no split" repeats those on both ranks (``model.split_work: false``), as before the split existed.
The last column, two data-parallel replicas on the same processes, shows what two processes buy on
this machine at all (the floor for cfg=2).
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

RUNS = {
    "cfg=1": ["--trainer.strategy", "data_parallel", "--trainer.devices", "1"],
    "cfg=2": ["--trainer.strategy", "cfg_parallel", "--trainer.devices", "2"],
    "cfg=2 no split": ["--trainer.strategy", "cfg_parallel", "--trainer.devices", "2", "--model.split_work", "false"],
    "dp=2": ["--trainer.strategy", "data_parallel", "--trainer.devices", "2"],  # two replicas, for scale
}


def run(config: Path, prompts: Path, size: int, steps: int, batch: int, name: str, threads: int, out: Path) -> float:
    command = [
        sys.executable, "-m", "lightning_diffusion", "benchmark", "--config", str(config), "--json", str(out),
        "--data.prompts", str(prompts), "--data.batch_size", str(batch), "--model.height", str(size),
        "--model.width", str(size), "--model.num_inference_steps", str(steps), *RUNS[name],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    return 1 / result["images_per_sec"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="cores per process; 0: split the machine")
    args = parser.parse_args()
    repo = Path(__file__).resolve().parents[1]
    cores = os.cpu_count() or 2
    times: dict[str, list[float]] = {name: [] for name in RUNS}
    with tempfile.TemporaryDirectory(prefix="cfg-bench-") as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("".join(
            json.dumps({"prompt": f"a benchmark picture number {i}", "negative_prompt": "blurry, low quality"}) + "\n"
            for i in range(args.images)
        ))
        for repeat in range(args.repeats):
            for i, name in enumerate(RUNS):
                threads = args.threads or (cores if name == "cfg=1" else max(1, cores // 2))
                seconds = run(repo / "configs" / "tiny-qwenimage.yaml", prompts, args.size, args.steps,
                              args.batch_size, name, threads, Path(tmp) / f"r{repeat}-{i}.json")
                times[name].append(seconds)
                print(f"repeat {repeat}: {name} {seconds:.3f} s/image", flush=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    one = median["cfg=1"]
    threads = f"{args.threads} core(s) per process" if args.threads else f"{cores} cores split"
    print(f"\n{args.size}x{args.size}, {args.steps} steps, batch {args.batch_size}, {threads}, "
          f"time per image (median of {args.repeats}):")
    print("| " + " | ".join(median) + " | cfg2 / cfg1 | cfg2 no split / cfg1 | dp=2 / cfg1 |")
    print("| --- " * (len(median) + 3) + "|")
    print("| " + " | ".join(f"{value:.3f} s" for value in median.values()) + f" | {median['cfg=2'] / one:.2f} | "
          f"{median['cfg=2 no split'] / one:.2f} | {median['dp=2'] / one:.2f} |")


if __name__ == "__main__":
    main()
