"""Peak memory of group work's exchange (``group_work.exchange``): what a rank holds while the
tiles of a tile-parallel decode (or the outputs of a split text encoder) are all-gathered, before
and after it gathered into one flat tensor.

    python benchmarks/group_work_memory.py [--world 2] [--tiles 4] [--tile-mb 64] [--dtype float32]

``--world`` gloo processes on the CPU (``torch.multiprocessing`` spawn, one thread each); each holds
``--tiles`` tensors of ``--tile-mb`` MiB (its share of the tiles, shaped like a decoded video tile:
1 x 3 x frames x 256 x 256) and hands them to the exchange as ``GroupWork._decode_tiles`` does (the
list is the only reference, so a packed tile can be freed). Memory: the process's peak resident
set size during the call above its size just before it (``VmHWM`` after resetting it through
``/proc/self/clear_refs``: no sampling), and what is still held after it, with the results alive.
"before" is the exchange as it was (a list all-gather into per-rank buffers of a packed copy),
kept here as the reference; "after" is ``lightning_diffusion.strategies.group_work.exchange`` (on gloo: one
in-place broadcast per rank); "after, all_gather_single" is the same with the all-gather into one
tensor that it uses on NCCL, forced on gloo (whose version of it stages the whole output). Each
variant runs in fresh processes. Prints a markdown table with the command that made it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

MIB = 1 << 20
VARIANTS = {"before": "before (list all_gather)", "after": "after", "single": "after, all_gather_single"}
PAGE = os.sysconf("SC_PAGE_SIZE")


def exchange_before(tensors: list[torch.Tensor], group, device) -> list[list[torch.Tensor]]:
    """The exchange before issue #39 (point 7): pack a copy, list all-gather into per-rank buffers."""
    from lightning_diffusion.strategies.group_work import _ALIGN, _padded_bytes

    size = dist.get_world_size(group)
    metas = [None] * size
    dist.all_gather_object(metas, [(tuple(t.shape), t.dtype) for t in tensors], group=group)
    pieces = []
    for tensor in tensors:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        pieces += [data, data.new_zeros((-data.numel()) % _ALIGN)]
    longest = max(sum(_padded_bytes(shape, dtype) for shape, dtype in meta) for meta in metas)
    mine = torch.cat(pieces + [torch.zeros(longest - sum(p.numel() for p in pieces), dtype=torch.uint8,
                                            device=device)])
    pieces.clear()
    tensors.clear()
    buffers = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
    dist.all_gather(buffers, mine, group=group)
    result = []
    for buffer, meta in zip(buffers, metas):
        offset, unpacked = 0, []
        for shape, dtype in meta:
            count = math.prod(shape) * dtype.itemsize
            unpacked.append(buffer[offset:offset + count].view(dtype).reshape(shape))
            offset += _padded_bytes(shape, dtype)
        result.append(unpacked)
    return result


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set size (Linux >= 4.0)


def peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def worker(rank: int, world: int, port: int, args: argparse.Namespace, variant: str, out: str) -> None:
    from lightning_diffusion.strategies import group_work

    if variant == "single":
        group_work._BROADCAST_BACKENDS = ()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dtype = getattr(torch, args.dtype)
    frames = max(1, args.tile_mb * MIB // (3 * 256 * 256 * dtype.itemsize))
    generator = torch.Generator().manual_seed(rank)
    tiles = [torch.randn(1, 3, frames, 256, 256, generator=generator).to(dtype) for _ in range(args.tiles)]
    tile_bytes = tiles[0].nbytes
    fn = exchange_before if variant == "before" else group_work.exchange
    dist.barrier()
    start = rss()
    reset_peak()
    parts = fn(tiles, dist.group.WORLD, torch.device("cpu"))
    top, held = peak(), rss()
    assert not tiles and [len(p) for p in parts] == [args.tiles] * world
    checksum = float(sum(float(t[0, 0, 0, 0, :8].double().sum()) for p in parts for t in p))
    Path(out, f"{variant}-{rank}.json").write_text(json.dumps(
        {"grown": top - start, "held": held - start, "tile": tile_bytes, "checksum": checksum}))
    dist.barrier()
    dist.destroy_process_group()


def measure(variant: str, args: argparse.Namespace, out: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(worker, args=(args.world, port, args, variant, out), nprocs=args.world)
    return [json.loads(Path(out, f"{variant}-{r}.json").read_text()) for r in range(args.world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tiles", type=int, default=4, help="tiles per rank")
    parser.add_argument("--tile-mb", type=int, default=64, help="MiB per tile (rounded to whole frames)")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as out:
        results = {variant: measure(variant, args, out) for variant in VARIANTS}
    if len({r["checksum"] for ranks in results.values() for r in ranks}) != 1:
        raise SystemExit(f"the variants gathered different tiles: {results}")
    tile = results["after"][0]["tile"]
    gathered = tile * args.tiles * args.world
    print(f"`{shlex.join(['python', *sys.argv])}` (torch {torch.__version__}, gloo, {args.world} processes; "
          f"{args.tiles} tiles of {tile / MIB:.0f} MiB {args.dtype} per rank, {gathered / MIB:.0f} MiB gathered "
          "per rank)\n")
    print("| exchange | peak above start, MiB (rank 0 / 1) | peak / gathered | held after, MiB |")
    print("|---|---|---|---|")
    for variant, ranks in results.items():
        grown = " / ".join(f"{r['grown'] / MIB:.0f}" for r in ranks)
        held = " / ".join(f"{r['held'] / MIB:.0f}" for r in ranks)
        print(f"| {VARIANTS[variant]} | {grown} | {max(r['grown'] for r in ranks) / gathered:.2f} | {held} |")


if __name__ == "__main__":
    main()
