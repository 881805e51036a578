"""``model.compile``: steady-state time per image of regional and full compile against eager, and
the compile time (the untimed warm-up batch), measured side by side with ``lightning-diffusion
benchmark``.

    python benchmarks/compile.py [--size 256] [--steps 20] [--images 8] [--batch-size 2] [--repeats 2] [--devices 1]

Runs alternate (eager, regional, full, eager, ...) on tiny:flux, where the transformer is most of
the time at 256x256; one core per process (``OMP_NUM_THREADS=1``), inductor's C++ backend on CPU.
The inductor cache is emptied before each compiled run, so the warm-up column is a cold compile.
``--devices 2`` runs Ulysses 2 instead of one process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("eager", "regional", "full")


def run(mode: str, args: argparse.Namespace, tmp: Path, prompts: Path, repeat: int) -> dict:
    report = tmp / f"{mode}-{repeat}.json"
    strategy = ["--trainer.devices", "1"] if args.devices == 1 else ["--trainer.devices", str(args.devices),
                                                                      "--trainer.strategy", "ulysses"]
    command = [sys.executable, "-m", "lightning_diffusion", "benchmark", "--config", "configs/tiny-flux.yaml",
               "--json", str(report), "--data.prompts", str(prompts), "--data.batch_size", str(args.batch_size),
               "--model.height", str(args.size), "--model.width", str(args.size),
               "--model.num_inference_steps", str(args.steps), *strategy,
               *([] if mode == "eager" else ["--model.compile", mode])]
    cache = tmp / f"inductor-{mode}-{repeat}"
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(report.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    per_image: dict[str, list[float]] = {mode: [] for mode in MODES}
    warmup: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="compile-bench-") as name:
        tmp = Path(name)
        prompts = tmp / "prompts.txt"
        prompts.write_text("".join(f"a benchmark picture number {i}\n" for i in range(args.images)))
        for repeat in range(args.repeats):
            for mode in MODES:
                result = run(mode, args, tmp, prompts, repeat)
                per_image[mode].append(1 / result["images_per_sec"])
                warmup[mode].append(result["warmup_s"])
                print(f"repeat {repeat}: {mode} {per_image[mode][-1]:.3f} s/image, warm-up batch "
                      f"{result['warmup_s']:.1f} s", flush=True)
    eager = statistics.median(per_image["eager"])
    where = "one process" if args.devices == 1 else f"Ulysses {args.devices}"
    print(f"\ntiny:flux {args.size}x{args.size}, {args.steps} steps, batch {args.batch_size}, {where}, "
          f"medians of {args.repeats}:")
    print("| mode | time per image | against eager | warm-up batch (compile) |")
    print("| --- | --- | --- | --- |")
    for mode in MODES:
        value = statistics.median(per_image[mode])
        print(f"| {mode} | {value:.3f} s | {value / eager:.2f} | {statistics.median(warmup[mode]):.1f} s |")


if __name__ == "__main__":
    main()
