"""What a resume's trust of a folder costs: reading its manifest as a resume does (``finished``),
where each output is checked by its size and, where its file changed after its line was written,
by its SHA-256.

    python benchmarks/verify.py --images 100000 1000000 [--formats files webdataset] [--changed 0.01]

For each count and format, a folder of that many 8x8 outputs is written as a run writes them
(``OutputFiles``: the sharded layout, or tar shards of 1,000; then the merge), and reported:

* ``scan_s``: ``finished`` of the folder as written (each file's size checked; none read);
* ``changed_scan_s`` and ``hashed``: the same after ``--changed`` of the outputs' files (loose files,
  or whole tar shards) were touched after their lines (their modification time moved on): those
  are read and their SHA-256 compared;
* ``write_s``: writing the folder (for scale; not part of a resume).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lightning_diffusion.output.files import OutputFiles  # noqa: E402
from lightning_diffusion.output.recorded import _Looked, finished, merge_manifest  # noqa: E402
from lightning_diffusion.output.settings import WriterSettings  # noqa: E402


def build(folder: Path, images: int, fmt: str) -> float:
    settings = WriterSettings(format=fmt, layout="sharded", samples_per_shard=1000, fsync="off", write_workers=0)
    files = OutputFiles(folder, settings, folder / "manifest.part-0.jsonl", "sharded" if fmt == "files" else "flat")
    pixels = np.random.default_rng(0).integers(0, 255, (8, 8, 3), dtype=np.uint8)
    start = time.perf_counter()
    for first in range(0, images, 1000):
        files.write_batch([{"index": i, "prompt": f"prompt {i}", "seed": i, "params": {"num_inference_steps": 4},
                            "image": pixels} for i in range(first, min(first + 1000, images))])
    files.finish()
    merge_manifest(folder)
    return time.perf_counter() - start


def touch(folder: Path, fraction: float) -> int:
    """Move the modification time of ``fraction`` of the outputs' files an hour on."""
    paths = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in (".png", ".tar"))
    chosen = paths[:: max(1, round(1 / fraction))] if fraction else []
    later = time.time() + 3600
    for path in chosen:
        os.utime(path, (later, later))
    return len(chosen)


def scan(folder: Path) -> tuple[float, int]:
    hashed = []
    original = _Looked.same_bytes

    def counting(self, *args):  # what was read to verify
        hashed.append(1)
        return original(self, *args)

    _Looked.same_bytes = counting  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        found = finished(folder)
        seconds = time.perf_counter() - start
    finally:
        _Looked.same_bytes = original  # type: ignore[method-assign]
    assert not found.problems, found.problems[:3]
    return seconds, len(hashed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, nargs="+", default=[100_000])
    parser.add_argument("--formats", nargs="+", default=["files", "webdataset"], choices=["files", "webdataset"])
    parser.add_argument("--changed", type=float, default=0.01)
    args = parser.parse_args()
    print(f"| images | format | write s | scan s | scan s, {args.changed:.0%} of the files changed after | "
          "outputs hashed |\n| ---: | --- | ---: | ---: | ---: | ---: |")
    for images in args.images:
        for fmt in args.formats:
            with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
                folder = Path(tmp)
                wrote = build(folder, images, fmt)
                plain, _ = scan(folder)
                touched = touch(folder, args.changed)
                changed, hashed = scan(folder)
                print(f"| {images:,} | {fmt} | {wrote:.1f} | {plain:.2f} | {changed:.2f} ({touched:,} files) | "
                      f"{hashed:,} |", flush=True)


if __name__ == "__main__":
    main()
