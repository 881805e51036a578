"""Loading a large transformer: streaming tensor-parallel load against load-then-shard and one process.

    python benchmarks/tensor_parallel_load.py [--layers 2 --single-layers 4 --heads 12]

A random FLUX-architecture transformer (default 1536 hidden, 2 double + 4 single blocks: about
1.2 GB in float32) is written once as safetensors, then loaded three ways, each in fresh processes:
(a) ours, tp=2: ``lightning_diffusion.strategies.sharded_load.load_sharded`` (what
    ``TensorParallelStrategy`` calls): each rank reads only its slices while loading;
(b) whole then shard, tp=2: ``from_pretrained`` then ``enable_parallelism(TensorParallelConfig)``;
(c) whole, one process: ``from_pretrained``.
Reported per rank (rank 0): load time and peak resident memory above what the process held before
loading (imports, process group).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024**3


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def build(folder: Path, args: argparse.Namespace) -> None:
    from diffusers import FluxTransformer2DModel

    if (folder / "config.json").is_file():
        return
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        in_channels=64, num_layers=args.layers, num_single_layers=args.single_layers, attention_head_dim=128,
        num_attention_heads=args.heads, joint_attention_dim=1024, pooled_projection_dim=768, guidance_embeds=True,
    )
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="10GB")


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from diffusers import FluxTransformer2DModel, TensorParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_diffusion.pipelines import compat
    from lightning_diffusion.strategies.sharded_load import load_sharded

    distributed = args.worker != "whole"
    if distributed:
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        compat.apply_cpu_rehearsal_patches()
    before = rss_gb()
    start = time.perf_counter()
    if args.worker == "stream":
        model = load_sharded(FluxTransformer2DModel, args.folder, None, torch.float32, mesh)
    else:
        model = FluxTransformer2DModel.from_pretrained(args.folder, dtype=torch.float32)
        if args.worker == "shard":
            model.enable_parallelism(config=TensorParallelConfig(mesh=mesh))
    if distributed:
        dist.barrier()
    elapsed = time.perf_counter() - start
    if not distributed or dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps({"seconds": elapsed, "peak_added_gb": peak_gb() - before}))
    del model
    if distributed:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder",
                        default=str(Path.home() / ".cache" / "lightning_diffusion" / "bench-flux-transformer"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--single-layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--worker", choices=["stream", "shard", "whole"])
    parser.add_argument("--result")
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    folder = Path(args.folder)
    build(folder, args)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1024**3
    rows = {}
    for kind, nproc in (("stream", 2), ("shard", 2), ("whole", 1)):
        result = folder.parent / f"bench-{kind}.json"
        common = [__file__, "--worker", kind, "--folder", str(folder), "--result", str(result)]
        if nproc > 1:
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                       "--master-port", "29751", *common]
        else:
            command = [sys.executable, *common]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows[kind] = json.loads(result.read_text())
        result.unlink()
    print(f"FLUX-architecture transformer, {size:.2f} GB of float32 safetensors, CPU gloo, {os.cpu_count()} cores")
    print("| Load | Ranks | Load time (s) | Peak memory added per rank (GB) | Memory vs one process |")
    print("| --- | --- | --- | --- | --- |")
    names = {"stream": "(a) ours: streaming TP load", "shard": "(b) whole, then enable_parallelism",
             "whole": "(c) whole, one process"}
    for kind, row in rows.items():
        ranks = 1 if kind == "whole" else 2
        ratio = row["peak_added_gb"] / rows["whole"]["peak_added_gb"]
        print(f"| {names[kind]} | {ranks} | {row['seconds']:.2f} | {row['peak_added_gb']:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
