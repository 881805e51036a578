"""How long the checks before a job take for a large prompt file with per-record overrides.

    python benchmarks/records.py [--lines 1000000] [--bad 0] [--repeats 3]

Writes a ``.jsonl`` of ``--lines`` records (each with a seed; a third with their own size, steps
and guidance; one in five with a negative prompt; ``--bad`` of them with a value out of bounds),
then times, in one process:

(a) reading: every line parsed and checked, its call-argument set recorded (``read_records``);
(b) the records against the pipeline (``check_records`` on tiny:flux: the allow-list, types,
    bounds, sizes), each distinct set of overrides once;
(c) the whole preflight of ``lightning-diffusion predict`` on that file (``read_config``: the
    config, the model folder, the records, the writer and the strategy), as the CLI runs it;

and reports the file's size, each time (median of ``--repeats``) and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path


def write_prompts(path: Path, lines: int, bad: int) -> None:
    rng = random.Random(0)
    sizes = [(512, 512), (768, 512), (512, 768), (1024, 1024)]
    bad_at = set(rng.sample(range(lines), bad)) if bad else set()
    with path.open("w", encoding="utf-8") as f:
        for n in range(lines):
            record = {"prompt": f"a photo of object {n} on a table, studio light", "seed": n}
            if n % 3 == 0:
                height, width = sizes[n % len(sizes)]
                record.update(height=height, width=width, num_inference_steps=20 + 8 * (n % 2),
                              guidance_scale=3.5)
            if n % 5 == 0:
                record["negative_prompt"] = "blurry, low quality"
            if n in bad_at:
                record["num_inference_steps"] = 0
            f.write(json.dumps(record) + "\n")


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--bad", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from lightning_diffusion.input import formats as records_module
    from lightning_diffusion.input.formats import read_records
    from lightning_diffusion.input.record_checks import check_records
    from lightning_diffusion.pipelines.model_folder import inspect_pipeline
    from lightning_diffusion.run.config import read_config

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.jsonl"
        write_prompts(path, args.lines, args.bad)
        info = inspect_pipeline("tiny:flux")

        def read():
            records_module._READ.clear()  # no cached index: read the file again
            return read_records(str(path))

        read_s, records = timed(read, args.repeats)

        def check():
            records.verdicts = None
            return check_records(info, records, {"height": 512, "width": 512})

        check_s, verdicts = timed(check, args.repeats)

        def preflight():
            records_module._READ.clear()
            try:
                read_config("configs/tiny-flux.yaml", ["--data.prompts", str(path), "--writer.output_dir",
                                                      str(Path(tmp) / "out"), "--data.on_bad_record", "skip"])
            except ValueError as err:  # a refusal still ran every check
                return str(err)
            return None

        preflight_s, _ = timed(preflight, args.repeats)
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        size_mb = path.stat().st_size / 1e6
        sets = len(records.summary.sets)
    print("| lines | file | call-argument sets | rejected | read | check against the pipeline | whole preflight "
          "| peak RSS |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {args.lines:,} | {size_mb:.1f} MB | {sets} | {len(verdicts.rejected):,} | {read_s:.2f} s | "
          f"{check_s:.3f} s | {preflight_s:.2f} s | {peak_mb:.0f} MB |")


if __name__ == "__main__":
    main()
