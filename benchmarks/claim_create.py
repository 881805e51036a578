"""What a folder pool's claim costs made visible with its content at once, beside the exclusive create
it replaced (``output.pool.FolderPoolFiles.create``): the file written under a temporary name and
hard-linked to the claim's name, against ``O_EXCL`` create then write (which a reader can see empty:
a claim without a holder, taken for a stopped worker's). Side by side in one run, median of rounds.

    python benchmarks/claim_create.py [--claims 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from lightning_diffusion.output.pool import FolderPoolFiles, exclusive_create


def exclusive_then_write(folder: Path, name: str, data: bytes) -> bool:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return exclusive_create(path, data)


def per_claim(make, count: int) -> float:
    start = time.perf_counter()
    for i in range(count):
        make(f"claims/{i}", b"0123abcd-0")
    return (time.perf_counter() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--claims", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    linked, exclusive, held = [], [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            files = FolderPoolFiles(Path(a))
            linked.append(per_claim(files.create, args.claims))
            held.append(per_claim(files.create, args.claims))  # every name taken: refused
            exclusive.append(per_claim(lambda name, data: exclusive_then_write(Path(b), name, data), args.claims))
    new, old, refused = (statistics.median(x) for x in (linked, exclusive, held))
    print(f"| claim in a folder ({args.claims:,} claims, median of {args.rounds}) | per claim | / exclusive create |")
    print("| --- | ---: | ---: |")
    print(f"| exclusive create, then write (a reader may see it empty) | {1e6 * old:.0f} us | 1.00x |")
    print(f"| written, then hard-linked (seen whole or not at all) | {1e6 * new:.0f} us | {new / old:.2f}x |")
    print(f"| refused: the claim is held | {1e6 * refused:.0f} us | {refused / old:.2f}x |")


if __name__ == "__main__":
    main()
