"""Time ``lightning-diffusion report`` on a synthetic output folder of N images (docs/benchmarks.md).

    python benchmarks/report_scale.py --images 1000 100000

The folder is made here, not by a run: N small PNGs (32x32, 16 distinct pictures) in the sharded
layout, 4 seeds a prompt, their manifest lines as the writer writes them (two writers, one image
every 0.05 s each, one stall) and a run.json with two runs. Each size is reported twice: the first
build (every thumbnail made) and a second (thumbnails reused), with the first page's size and the
size of all pages.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from lightning_diffusion.commands.report_page import build
from lightning_diffusion.output.files import output_name


def make_folder(folder: Path, count: int) -> None:
    rng = np.random.default_rng(0)
    pictures = []
    for _ in range(16):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(buffer, format="PNG")
        pictures.append(buffer.getvalue())
    start = 1_700_000_000.0
    lines = []
    for index in range(count):
        prompt = f"prompt {index // 4} of a synthetic set"
        name = output_name(index, prompt, ".png", "sharded", 10_000)
        path = folder / name
        path.parent.mkdir(exist_ok=True)
        data = pictures[index % 16]
        path.write_bytes(data)
        writer = index % 2
        written = start + (index // 2) * 0.05 + (600.0 if writer and index > count // 2 else 0.0)  # a stall
        lines.append(json.dumps({"index": index, "prompt": prompt, "seed": index, "file": name, "bytes": len(data),
                                 "model": "synthetic", "height": 32, "width": 32, "written": round(written, 3)}))
    # merged part after part, as the writer's merge appends them
    ordered = [line for writer in (0, 1) for n, line in enumerate(lines) if n % 2 == writer]
    (folder / "manifest.jsonl").write_text("\n".join(ordered) + "\n")
    end = start + count * 0.025 + 600
    history = [{"finished": start + count * 0.0125, "made": count // 2, "wall_s": count * 0.0125 + 5, "load_s": 5,
                "images_per_s_by_rank": {"0": 20.0, "1": 20.0}},
               {"finished": end, "made": count - count // 2, "wall_s": end - start - count * 0.0125,
                "load_s": 5, "images_per_s_by_rank": {"0": 20.0, "1": 20.0}}]
    (folder / "run.json").write_text(json.dumps({"model": "synthetic", "expected": count, "history": history}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, nargs="+", default=[1000])
    parser.add_argument("--keep", action="store_true", help="keep the synthetic folders")
    args = parser.parse_args()
    print("| Images | Build, thumbnails made (s) | Build, thumbnails kept (s) | Read (s) | Pages | First page | All "
          "pages | Thumbnails |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for count in args.images:
        folder = Path(tempfile.mkdtemp(prefix=f"report-{count}-"))
        try:
            made_at = time.perf_counter()
            make_folder(folder, count)
            print(f"made {count:,} images in {time.perf_counter() - made_at:.1f} s", file=sys.stderr)
            first = build(str(folder), price=2.5)
            second = build(str(folder), price=2.5)
            thumbs = sum(path.stat().st_size for path in (folder / ".thumbs").rglob("*.jpg"))
            print(f"| {count:,} | {first['seconds']:.1f} | {second['seconds']:.1f} | {second['read_s']:.1f} | "
                  f"{first['pages']:,} | {first['first_page_bytes'] / 1e6:.2f} MB | {first['bytes'] / 1e6:,.1f} MB | "
                  f"{thumbs / 1e6:,.1f} MB |", flush=True)
        finally:
            if not args.keep:
                shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
