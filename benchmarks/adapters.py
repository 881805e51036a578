"""Per-record adapters (``model.adapters``): what a set of four adapters costs in one run against
one adapter, against diffusers' unfused adapters switched by ``set_adapters``, and against one run
per adapter.

    python benchmarks/adapters.py [--images 16] [--rank 16] [--repeats 2]

The model is benchmarks/quantization.py's: a FLUX.1-architecture transformer of 40M parameters
(random weights) with tiny:flux's other components; each adapter (random A and B) targets every
linear layer of the transformer's blocks. One process, one core, 256x256, 8 steps, batch size 2,
``lightning-diffusion predict``; times are the run's prediction seconds (run.json's ``wall_s -
load_s``) over its images. Rows: the best of ``--repeats`` (a shared machine only ever adds time),
the runs alternating within a repeat:

- one adapter: ``model.lora: [a]``, ``--images`` images;
- four adapters, shuffled: ``model.adapters`` with the records cycling through four adapters in a
  shuffled order (a quarter of the images each), the switches included;
- four runs, one adapter each (what a user does without per-record adapters): four loads;
- unfused: diffusers' own pipeline with the four adapters loaded as peft layers, ``set_adapters``
  before each batch, no fuse (timed in this process: prediction only).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lora_tp import make_adapter  # benchmarks/lora_tp.py, beside this file

from quantization import build_medium  # benchmarks/quantization.py, beside this file

REPO = Path(__file__).resolve().parents[1]
NAMES = ("a", "b", "c", "d")
ARGS = ["--model.height", "256", "--model.width", "256", "--model.num_inference_steps", "8", "--data.batch_size", "2",
        "--trainer.enable_progress_bar", "false"]


def predict(model: Path, out: Path, prompts: Path, extra: list[str]) -> dict:
    """One ``predict`` run: its prediction seconds, images, load seconds and the switch line."""
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_diffusion", "predict", "--config", "configs/tiny-flux.yaml",
         "--model.pretrained_model_name_or_path", str(model), "--data.prompts", str(prompts),
         "--writer.output_dir", str(out), *ARGS, *extra],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"run failed:\n{proc.stderr[-3000:]}")
    run = json.loads((out / "run.json").read_text())["history"][-1]
    switched = re.search(r"adapters: (\d+) switches, ([0-9.]+) s .*held on the CPU: ([0-9.]+) MB", proc.stderr)
    return {"predict_s": run["wall_s"] - run["load_s"], "made": run["made"], "load_s": run["load_s"],
            "switches": int(switched.group(1)) if switched else 0,
            "switch_s": float(switched.group(2)) if switched else 0.0,
            "held_mb": float(switched.group(3)) if switched else 0.0}


def unfused(model: Path, adapters: dict[str, Path], records: list[dict]) -> float:
    """Seconds per image with diffusers' unfused peft adapters, ``set_adapters`` a batch."""
    import torch
    from diffusers import DiffusionPipeline

    torch.set_num_threads(1)
    pipe = DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    for name, file in adapters.items():
        pipe.load_lora_weights(str(file.parent), weight_name=file.name, adapter_name=name)
    start = time.perf_counter()
    for i in range(0, len(records), 2):
        batch = records[i:i + 2]
        pipe.set_adapters(batch[0]["adapters"], adapter_weights=[1.0])
        pipe(prompt=[r["prompt"] for r in batch], generator=[torch.Generator().manual_seed(r["seed"]) for r in batch],
             height=256, width=256, num_inference_steps=8, guidance_scale=3.5, max_sequence_length=64,
             output_type="np")
    return (time.perf_counter() - start) / len(records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[float]] = {"one adapter": [], "four adapters, shuffled": [], "four runs, one adapter each": [],
                                    "unfused (peft set_adapters)": []}
    loads: list[float] = []
    switches: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="adapters-bench-") as name:
        tmp = Path(name)
        model = build_medium(tmp / "medium")
        adapters = {}
        for n, adapter in enumerate(NAMES):
            import torch

            torch.manual_seed(n)
            adapters[adapter] = make_adapter(model, tmp / f"adapter-{adapter}", args.rank)
        records = [{"prompt": f"a benchmark picture number {i}", "seed": i, "adapters": [NAMES[i % 4]]}
                   for i in range(args.images)]
        random.Random(0).shuffle(records)
        mixed = tmp / "mixed.jsonl"
        mixed.write_text("".join(json.dumps(r) + "\n" for r in records))
        plain = tmp / "plain.jsonl"
        plain.write_text("".join(json.dumps({"prompt": r["prompt"], "seed": r["seed"]}) + "\n" for r in records))
        declared = json.dumps({n: {"path": str(f)} for n, f in adapters.items()})
        for repeat in range(args.repeats):
            one = predict(model, tmp / f"one-{repeat}", plain,
                          ["--model.lora", json.dumps([{"path": str(adapters["a"])}])])
            rows["one adapter"].append(one["predict_s"] / one["made"])
            loads.append(one["load_s"])
            four = predict(model, tmp / f"four-{repeat}", mixed, ["--model.adapters", declared])
            rows["four adapters, shuffled"].append(four["predict_s"] / four["made"])
            switches.append(four)
            total, made = 0.0, 0
            for adapter in NAMES:
                part = tmp / f"part-{repeat}-{adapter}.jsonl"
                part.write_text("".join(json.dumps({"prompt": r["prompt"], "seed": r["seed"]}) + "\n"
                                        for r in records if r["adapters"] == [adapter]))
                run = predict(model, tmp / f"run-{repeat}-{adapter}", part,
                              ["--model.lora", json.dumps([{"path": str(adapters[adapter])}])])
                total += run["predict_s"] + run["load_s"]
                made += run["made"]
            rows["four runs, one adapter each"].append(total / made)
            rows["unfused (peft set_adapters)"].append(unfused(model, adapters, records))
            print(f"repeat {repeat}: " + ", ".join(f"{k}: {v[-1]:.3f} s/image" for k, v in rows.items()), flush=True)
        adapter_mb = adapters["a"].stat().st_size / 1e6
        transformer_mb = sum(f.stat().st_size for f in (model / "transformer").glob("*.safetensors")) / 1e6
    base = min(rows["one adapter"])
    print(f"\nFLUX.1-architecture transformer of {transformer_mb:.0f} MB (float32), 4 adapters of rank {args.rank}, "
          f"{adapter_mb:.1f} MB each, {args.images} images, 256x256, 8 steps, batch 2, one core, best of "
          f"{args.repeats} (the four-runs row counts each run's load, {min(loads):.1f} s):\n")
    print("| run | s per image | vs one adapter |\n| --- | --- | --- |")
    for row, values in rows.items():
        print(f"| {row} | {min(values):.3f} | {min(values) / base:.2f}x |")
    four = min(switches, key=lambda run: run["switch_s"])
    each = four["switch_s"] / max(four["switches"], 1)
    print(f"\nswitches in the four-adapter run: {four['switches']}, {each:.3f} s each; base weights held on the CPU: "
          f"{four['held_mb']:.1f} MB; an adapter read and held: {adapter_mb:.1f} MB")


if __name__ == "__main__":
    main()
