"""A mixed prompt set: buckets against index-order batches and a set sorted by hand, side by side.

    python benchmarks/mixed_sizes.py [--records 48] [--batch-size 4] [--repeats 3] [--model tiny:flux]

The set interleaves three sizes (``--sizes``, default 128x128, 192x192, 256x256) record by
record. Each run is the real command (``lightning-diffusion predict``) in a process of its own with
one thread (a process stands for a GPU), into a fresh folder; the runs alternate so that machine
noise hits each alike:

(a) buckets (the default): batches of one size each;
(b) index order (``data.bucket: false``): each batch of 4 holds several sizes, one padded call each;
(c) the same records sorted by size by hand, in index order: what buckets should match.

It reports, from each run's summary (``run.json``), the time per image of the prediction loop
(median of ``--repeats``), the images computed per image kept, and, for (a) and (b) over 2
replicas (``--replicas``), each replica's seconds in pipeline calls and the faster one's idle time
at the end against one batch's time.
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

REPO = Path(__file__).resolve().parents[1]


def write_prompts(path: Path, records: int, sizes: list[int], by_size: bool) -> None:
    rows = [{"prompt": f"a shape number {n} on a plain background", "height": sizes[n % len(sizes)],
             "width": sizes[n % len(sizes)]} for n in range(records)]
    if by_size:
        rows.sort(key=lambda r: r["height"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run(model: str, prompts: Path, out: Path, batch_size: int, steps: int, bucket: bool, devices: int = 1) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "lightning_diffusion", "predict", "--config", "configs/tiny-flux.yaml",
                    "--model.pretrained_model_name_or_path", model, "--model.num_inference_steps", str(steps),
                    "--data.prompts", str(prompts), "--data.batch_size", str(batch_size),
                    "--data.bucket", str(bucket).lower(), "--trainer.devices", str(devices),
                    "--trainer.enable_progress_bar", "false", "--writer.output_dir", str(out)],
                   cwd=REPO, env=env, check=True, capture_output=True, text=True)
    return json.loads((out / "run.json").read_text())["history"][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 192, 256])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--model", default="tiny:flux")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        mixed, sorted_ = root / "mixed.jsonl", root / "sorted.jsonl"
        write_prompts(mixed, args.records, args.sizes, by_size=False)
        write_prompts(sorted_, args.records, args.sizes, by_size=True)
        variants = {"buckets": (mixed, True), "index order": (mixed, False), "sorted by hand": (sorted_, False)}
        per_image: dict[str, list[float]] = {name: [] for name in variants}
        computed: dict[str, float] = {}
        for repeat in range(args.repeats):
            for name, (prompts, bucket) in variants.items():
                summary = run(args.model, prompts, root / f"{name}-{repeat}", args.batch_size, args.steps, bucket)
                per_image[name].append((summary["wall_s"] - summary["load_s"]) / summary["made"])
                computed[name] = summary["computed"] / summary["made"]
        base = statistics.median(per_image["sorted by hand"])
        print(f"{args.records} records, sizes {', '.join(f'{s}x{s}' for s in args.sizes)} interleaved, batch "
              f"{args.batch_size}, {args.steps} steps, {args.model}, one thread a process, median of {args.repeats}:\n")
        print("| batches | ms per image | vs sorted by hand | images computed per image kept |")
        print("| --- | ---: | ---: | ---: |")
        for name in variants:
            ms = 1000 * statistics.median(per_image[name])
            print(f"| {name} | {ms:.1f} | {statistics.median(per_image[name]) / base:.2f} | {computed[name]:.2f} |")
        if args.replicas > 1:
            print(f"\n{args.replicas} replicas, seconds in pipeline calls of each:\n")
            print("| batches | busy s per replica | faster replica idle at the end | one batch |")
            print("| --- | --- | ---: | ---: |")
            for name in ("buckets", "index order"):
                prompts, bucket = variants[name]
                summary = run(args.model, prompts, root / f"{name}-replicas", args.batch_size, args.steps, bucket,
                              args.replicas)
                busy = sorted(summary["busy_s_by_rank"].values())
                batches = -(-summary["computed"] // args.batch_size)
                one_batch = sum(busy) / batches
                print(f"| {name} | {', '.join(f'{b:.2f}' for b in busy)} | {busy[-1] - busy[0]:.2f} s | "
                      f"{one_batch:.2f} s |")


if __name__ == "__main__":
    main()
