"""GPU acceptance: named checks of the CUDA paths that no CPU test can show, on the tiny pipelines.

    python scripts/gpu_acceptance.py [--only NAME ...] [--json report.json]

Each check runs the real command line in a fresh process and prints ``PASS``, ``FAIL`` or
``SKIP`` (too few GPUs) with its evidence; the exit code is 1 if any check failed. Run it once on
a GPU node after changing a strategy; it takes a few minutes on one GPU, more with two or more.
The checks name the failure they guard against (see docs/internals.md and issue #23's list).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
CHECKS: dict[str, tuple[int, str, Callable[[Path], tuple[bool, str]]]] = {}


def check(name: str, gpus: int, guards: str):
    def register(fn):
        CHECKS[name] = (gpus, guards, fn)
        return fn

    return register


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_diffusion", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def verdict(proc: subprocess.CompletedProcess, *needles: str) -> tuple[bool, str]:
    log = proc.stdout + proc.stderr
    missing = [n for n in needles if n not in log]
    ok = proc.returncode == 0 and not missing
    tail = log.strip().splitlines()[-3:] if not ok else [line for line in log.splitlines() if any(n in line for n in needles)][:3]
    return ok, f"exit {proc.returncode}; " + (f"missing {missing}; " if missing else "") + " | ".join(tail)


@check("cuda-pipeline", 1, "a CUDA pipeline run under NCCL and inference mode, with its peak memory")
def cuda_pipeline(tmp: Path) -> tuple[bool, str]:
    report = tmp / "bench.json"
    proc = cli("benchmark", "--config", "configs/tiny.yaml", "--trainer.accelerator", "gpu", "--trainer.devices", "1",
               "--json", str(report))
    ok, evidence = verdict(proc, "| DataParallelStrategy x1 |")
    if ok:
        result = json.loads(report.read_text())
        ok = result["device"] == "cuda" and result["peak_memory_gb"] > 0
        evidence = f"peak {result['peak_memory_gb']:.3f} GB, {result['images_per_sec']:.1f} images/s"
    return ok, evidence


@check("cpu-tensor-parallel-on-a-gpu-machine", 1, "#23.1: shards placed on cuda while the mesh is CPU/gloo")
def cpu_tp(tmp: Path) -> tuple[bool, str]:
    return verdict(cli("verify", "--config", "configs/tiny-tp.yaml", "--num-prompts", "1"), "PASS")


@check("device-map-own-gpus", 1, "#23.3: a device map that reaches GPUs of other processes")
def device_map(tmp: Path) -> tuple[bool, str]:
    proc = cli("predict", "--config", "configs/tiny-device-map.yaml", "--trainer.accelerator", "gpu",
               "--trainer.devices", "1", "--trainer.strategy.init_args.max_memory", "null",
               "--trainer.strategy.init_args.offload_folder", "null", "--writer.output_dir", str(tmp / "dm"))
    ok, evidence = verdict(proc, "rank 0 device map:")
    return ok and "cuda:1" not in proc.stdout + proc.stderr, evidence


@check("tensor-parallel-cuda", 2, "#23.2 and DTensor under inference mode: TP=2 on CUDA equals one GPU")
def tp_cuda(tmp: Path) -> tuple[bool, str]:
    return verdict(cli("verify", "--config", "configs/tiny-tp.yaml", "--trainer.accelerator", "gpu",
                       "--trainer.devices", "2", "--num-prompts", "2"), "PASS")


@check("ring-bf16-cuda", 2, "ring attention on CUDA with _native_cudnn in bfloat16 (verify's bf16 thresholds)")
def ring_cuda(tmp: Path) -> tuple[bool, str]:
    return verdict(cli("verify", "--config", "configs/tiny-ring.yaml", "--trainer.accelerator", "gpu",
                       "--trainer.devices", "2", "--model.torch_dtype", "bfloat16", "--num-prompts", "2"), "PASS")


@check("ulysses-anything-cuda", 2, "the anything-modes' all-gather of unequal sizes on NCCL (48x80: 15 tokens)")
def ulysses_anything(tmp: Path) -> tuple[bool, str]:
    return verdict(cli("verify", "--config", "configs/tiny-ulysses-anything.yaml", "--trainer.accelerator", "gpu",
                       "--trainer.devices", "2", "--num-prompts", "2"), "PASS")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=sorted(CHECKS))
    parser.add_argument("--json")
    args = parser.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    rows = []
    for name, (needed, guards, fn) in CHECKS.items():
        if args.only and name not in args.only:
            continue
        if gpus < needed:
            rows.append({"check": name, "result": "SKIP", "evidence": f"needs {needed} GPUs, {gpus} here", "guards": guards})
        else:
            with tempfile.TemporaryDirectory(prefix="ld-gpu-") as tmp:
                ok, evidence = fn(Path(tmp))
            rows.append({"check": name, "result": "PASS" if ok else "FAIL", "evidence": evidence, "guards": guards})
        row = rows[-1]
        print(f"{row['result']:4}  {name}: {row['evidence']}  [{guards}]", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 1 if any(row["result"] == "FAIL" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
