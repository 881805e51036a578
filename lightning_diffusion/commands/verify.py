"""``lightning-diffusion verify``: check a parallel plan numerically against one device.

    lightning-diffusion verify --config configs/tiny-tp.yaml [--num-prompts 4] [any predict flag ...]

Runs the first K prompts of the config twice, with the same seeds and batch size: as configured,
and as a single process (``data_parallel``, 1 device, same accelerator). Both runs save their
decoded float images; each image pair is compared by max absolute difference, PSNR and SSIM
(torchmetrics). The verdict uses thresholds that depend on the dtype; the exit code is 0 only
when every image passes. The diffusers guide's warning is the reason: a wrong parallel plan
usually runs and gives a plausible but wrong picture, which only numbers catch.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Optional, TypedDict, cast

import numpy as np
import torch

from lightning_diffusion.commands import add_json_option, help_text, json_argv, report
from lightning_diffusion.input.formats import read_data
from lightning_diffusion.pipelines.model_folder import dtype_name
from lightning_diffusion.run.config import read_config, report_config_error

if TYPE_CHECKING:
    from jsonargparse import Namespace

# (max abs difference, min PSNR dB, min SSIM) on decoded images in [0, 1], by dtype. float32 runs
# differ by rounding only (measured up to 2e-6); half-precision kernels reorder sums more freely.
THRESHOLDS = {
    "float32": (1e-4, 60.0, 0.999),
    "bfloat16": (0.1, 30.0, 0.95),
    "float16": (0.05, 35.0, 0.97),
}


class Difference(TypedDict):
    """Two images' difference: the largest absolute one (``max_abs``), ``psnr`` and ``ssim``."""

    max_abs: float
    psnr: float
    ssim: float


def compare(ours: np.ndarray, ref: np.ndarray) -> Difference:
    """Max abs difference, PSNR and SSIM of two float images (H x W x 3, or frames x H x W x 3)."""
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    a = torch.from_numpy(ours).float().reshape(-1, *ours.shape[-3:]).permute(0, 3, 1, 2)
    b = torch.from_numpy(ref).float().reshape(-1, *ref.shape[-3:]).permute(0, 3, 1, 2)
    max_abs = float((a - b).abs().max())
    psnr = float("inf") if max_abs == 0 else float(peak_signal_noise_ratio(a, b, data_range=1.0))
    if max_abs == 0:  # identical: torchmetrics' float32 SSIM gives 0.99994 on flat images
        return {"max_abs": 0.0, "psnr": float("inf"), "ssim": 1.0}
    side = min(a.shape[-2:])
    kernel = max(3, min(11, side if side % 2 else side - 1))
    # a tensor (the tuple with the full image only when asked for it)
    ssim = float(cast(torch.Tensor, structural_similarity_index_measure(a, b, data_range=1.0, kernel_size=kernel)))
    return {"max_abs": max_abs, "psnr": psnr, "ssim": ssim}


def plan_attention_backend(config: Namespace) -> Optional[str]:
    """The attention backend the plan's context-parallel denoisers run with when the strategy chose
    it (its ``attention_backend``, or ring's choice on CUDA); None when the model's own
    ``model.attention_backend`` is set, which the reference run reads from the same config. The
    reference run takes it too, so that the two runs differ by the plan and not by the kernel."""
    from lightning_diffusion.run.preflight import build_strategy, device_type, world_size
    from lightning_diffusion.strategies.checks import resolved_attention_backend
    from lightning_diffusion.strategies.mesh_parallel import MeshStrategy

    if config.model.get("attention_backend") is not None:
        return None
    strategy = build_strategy(config.trainer.get("strategy"))
    size = world_size(config.trainer)
    if not isinstance(strategy, MeshStrategy) or size is None:
        return None
    dims = strategy.make_parallel_dims(size)
    if dims.cp == 1:
        return None  # the strategy's backend serves context parallelism only
    device = torch.device(device_type(config.trainer.get("accelerator")))
    dtype = getattr(torch, dtype_name(config.model.torch_dtype))
    return resolved_attention_backend(strategy.attention_backend, device, dims, dtype)


def _predict(config: str, extra: list[str], out: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lightning_diffusion", "predict", "--config", config, *extra,
               "--writer.output_dir", str(out), "--writer.save_arrays", "true", "--writer.allow_config_change", "true",
               "--trainer.enable_progress_bar", "false"]
    return subprocess.run(command, capture_output=True, text=True)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-diffusion verify", description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--num-prompts", type=int, default=4)
    add_json_option(parser, "the comparison")
    args, extra = parser.parse_known_args(json_argv(argv))
    if args.num_prompts < 1:
        parser.error("--num-prompts must be at least 1")

    try:
        # Both runs write into folders of their own: the config's output folder is not resumed.
        config = read_config(args.config, [*extra, "--writer.allow_config_change", "true"])
    except ValueError as err:
        return report_config_error(err, "lightning-diffusion verify")
    records = [r for _, r in read_data(config.data).accepted()]
    records = records[: args.num_prompts]
    dtype = dtype_name(config.model.torch_dtype)
    max_abs, min_psnr, min_ssim = THRESHOLDS.get(dtype, THRESHOLDS["bfloat16"])
    accelerator = config.trainer.accelerator

    with tempfile.TemporaryDirectory(prefix="ld-verify-") as tmp:
        tmp_path = Path(tmp)
        subset = tmp_path / "prompts.jsonl"
        subset.write_text("".join(json.dumps(r) + "\n" for r in records))
        # the subset's records are already read through data.columns: it is read as it is
        common = [*extra, "--data.prompts", str(subset), "--data.num_images_per_prompt", "1", "--data.columns",
                  "null", "--data.keep_columns", "null", "--data.split", "null"]
        reference = [*common, "--trainer.strategy", "data_parallel", "--trainer.devices", "1", "--trainer.num_nodes",
                     "1", "--trainer.accelerator", str(accelerator)]
        backend = plan_attention_backend(config)
        if backend is not None:
            reference += ["--model.attention_backend", backend]
        kernel = f", attention backend {backend} (the plan's)" if backend else ""
        print(f"verify: reference run on one device{kernel}")
        runs = {
            "plan": _predict(args.config, common, tmp_path / "plan"),
            "reference": _predict(args.config, reference, tmp_path / "reference"),
        }
        for name, proc in runs.items():
            if proc.returncode != 0:
                print(f"verify: the {name} run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}",
                      file=sys.stderr)
                return 2
        rows = []
        for index in range(len(records)):
            ours = np.load(tmp_path / "plan" / f"{index:06d}.npy")
            ref = np.load(tmp_path / "reference" / f"{index:06d}.npy")
            diff = compare(ours, ref)
            rows.append({"index": index, **diff, "pass": diff["max_abs"] <= max_abs and diff["psnr"] >= min_psnr
                         and diff["ssim"] >= min_ssim})

    passed = all(row["pass"] for row in rows)

    def table() -> None:
        print(f"verify {args.config} against one device, {dtype}: pass if max abs <= {max_abs:g}, "
              f"PSNR >= {min_psnr:g} dB, SSIM >= {min_ssim:g}")
        print("| Image | Max abs diff | PSNR (dB) | SSIM | Verdict |")
        print("| --- | --- | --- | --- | --- |")
        for row in rows:
            print(f"| {row['index']} | {row['max_abs']:.3g} | {row['psnr']:.1f} | {row['ssim']:.6f} | "
                  f"{'pass' if row['pass'] else 'FAIL'} |")
        print("PASS" if passed else "FAIL: the plan does not reproduce the single-device images")

    report(args.json, {"config": args.config, "dtype": dtype, "images": rows, "pass": passed}, table)
    return 0 if passed else 1
