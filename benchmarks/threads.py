"""CPU runs with and without ``OMP_NUM_THREADS``, side by side: the default threads a process
(each rank its share of the node's cores) against the one thread a process a user would set.

    python benchmarks/threads.py [--config configs/tiny.yaml] [--repeats 3]

Each row runs ``lightning-diffusion predict`` on the config (1 and 2 processes), once without the
variable and once with ``OMP_NUM_THREADS=1``, alternating so that machine noise hits both alike.
Reported: the median of the run's own prediction time (``wall`` in its last line: load to last
image) and of the whole command (start-up included), and the ratio default / ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(config: str, devices: int, threads: str | None) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "lightning_diffusion", "predict", "--config", config,
                               "--trainer.devices", str(devices), "--writer.output_dir", out],
                              cwd=REPO, env=env, capture_output=True, text=True, check=True)
        whole = time.perf_counter() - start
    wall = float(re.search(r"wall ([0-9.]+) s", proc.stderr).group(1))
    return wall, whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; {args.config}; median of {args.repeats}\n")
    print("| processes | prediction, default | prediction, OMP_NUM_THREADS=1 | ratio | command, default | "
          "command, OMP_NUM_THREADS=1 | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for devices in (1, 2):
        times: dict[str | None, list[tuple[float, float]]] = {None: [], "1": []}
        for _ in range(args.repeats):
            for threads in (None, "1"):
                times[threads].append(run(args.config, devices, threads))
        wall = {k: statistics.median(t[0] for t in v) for k, v in times.items()}
        whole = {k: statistics.median(t[1] for t in v) for k, v in times.items()}
        print(f"| {devices} | {wall[None]:.2f} s | {wall['1']:.2f} s | {wall[None] / wall['1']:.2f}x | "
              f"{whole[None]:.1f} s | {whole['1']:.1f} s | {whole[None] / whole['1']:.2f}x |")


if __name__ == "__main__":
    main()
