"""``model.quantization`` (torchao) on CPU: time per image, peak memory and transformer weight bytes
against full precision, and the pictures' PSNR against the unquantized ones, side by side in one run.

    python benchmarks/quantization.py [--size 256] [--steps 8] [--images 4] [--batch-size 2] [--repeats 2]

Speed and memory: a FLUX.1-architecture pipeline whose transformer is large enough to dominate
(random weights, 8 heads of 64, 2 double and 4 single blocks, about 40M parameters; tiny:flux's
other components), timed with ``lightning-diffusion benchmark`` in one process with one core
(``OMP_NUM_THREADS=1``); settings alternate within each repeat, medians reported. Quality:
tiny:shapes (configs/tiny.yaml, the trained model) with each setting, PSNR of every picture against
the float32 one (the same seeds), the mean over ``configs/prompts/shapes.txt``.
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

import numpy as np

REPO = Path(__file__).resolve().parents[1]
INT8WO = {"backend": "torchao", "quant_type": "int8wo"}
SETTINGS = {  # name: (torch_dtype, model.quantization)
    "float32": ("float32", None),
    "int8wo": ("float32", INT8WO),
    "int8dq": ("float32", {"backend": "torchao", "quant_type": "int8dq"}),
    "bfloat16": ("bfloat16", None),
    "int8wo + bfloat16": ("bfloat16", INT8WO),
}
TIMED = ("float32", "int8wo", "bfloat16", "int8wo + bfloat16")


def build_medium(folder: Path) -> Path:
    """tiny:flux with a transformer about 40M parameters large (random weights)."""
    import torch
    from diffusers import DiffusionPipeline, FluxTransformer2DModel

    from lightning_diffusion.pipelines import tiny

    pipe = DiffusionPipeline.from_pretrained(tiny.resolve("tiny:flux"))
    torch.manual_seed(0)
    pipe.transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=64,
        num_attention_heads=8, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(8, 28, 28))
    pipe.save_pretrained(folder)
    return folder


def weight_mb(folder: Path, setting: str) -> float:
    """The transformer's weight bytes as loaded with ``setting`` (quantized tensors counted packed)."""
    from torchao.utils import get_model_size_in_bytes

    from lightning_diffusion import DiffusionModule

    dtype, quantization = SETTINGS[setting]
    module = DiffusionModule(str(folder), torch_dtype=dtype, quantization=quantization)
    module.configure_model()
    return get_model_size_in_bytes(module.pipeline.transformer) / 1e6


def cli(*args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "lightning_diffusion", *args], capture_output=True, text=True,
                          env=env, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")


def options(setting: str) -> list[str]:
    dtype, quantization = SETTINGS[setting]
    return ["--model.torch_dtype", dtype, *(["--model.quantization", json.dumps(quantization)] if quantization else [])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    per_image: dict[str, list[float]] = {s: [] for s in TIMED}
    peak: dict[str, list[float]] = {s: [] for s in TIMED}
    with tempfile.TemporaryDirectory(prefix="quant-bench-") as name:
        tmp = Path(name)
        model = build_medium(tmp / "medium")
        prompts = tmp / "prompts.txt"
        prompts.write_text("".join(f"a benchmark picture number {i}\n" for i in range(args.images)))
        for repeat in range(args.repeats):
            for setting in TIMED:
                report = tmp / "report.json"
                cli("benchmark", "--config", "configs/tiny-flux.yaml", "--json", str(report),
                    "--model.pretrained_model_name_or_path", str(model), "--data.prompts", str(prompts),
                    "--data.batch_size", str(args.batch_size), "--model.height", str(args.size),
                    "--model.width", str(args.size), "--model.num_inference_steps", str(args.steps), *options(setting))
                result = json.loads(report.read_text())
                per_image[setting].append(1 / result["images_per_sec"])
                peak[setting].append(result["peak_memory_gb"] * 1024)
                print(f"repeat {repeat}: {setting} {per_image[setting][-1]:.3f} s/image, peak RSS "
                      f"{peak[setting][-1]:.0f} MB", flush=True)
        weights = {s: weight_mb(model, s) for s in TIMED}
        arrays = {}
        for setting in SETTINGS:
            out = tmp / f"shapes-{setting.replace(' ', '')}"
            cli("predict", "--config", "configs/tiny.yaml", "--writer.output_dir", str(out), "--writer.save_arrays",
                "true", "--trainer.enable_progress_bar", "false", *options(setting))
            arrays[setting] = {f.name: np.load(f) for f in out.glob("*.npy")}
    base = statistics.median(per_image["float32"])
    print(f"\nspeed and memory: FLUX.1-architecture transformer of 40M parameters, {args.size}x{args.size}, "
          f"{args.steps} steps, batch {args.batch_size}, one core, medians of {args.repeats}:")
    print("| setting | time per image | against float32 | peak RSS | transformer weights |")
    print("| --- | --- | --- | --- | --- |")
    for setting in TIMED:
        value = statistics.median(per_image[setting])
        print(f"| {setting} | {value:.3f} s | {value / base:.2f} | {statistics.median(peak[setting]):.0f} MB "
              f"| {weights[setting]:.1f} MB ({weights[setting] / weights['float32']:.2f}) |")
    print("\nquality: tiny:shapes (configs/tiny.yaml), PSNR against float32 over "
          f"{len(arrays['float32'])} pictures (mean, lowest):")
    print("| setting | PSNR mean | PSNR lowest |")
    print("| --- | --- | --- |")
    for setting in SETTINGS:
        if setting == "float32":
            continue
        values = [10 * np.log10(1 / max(float(np.mean((arrays[setting][k] - ref) ** 2)), 1e-20))
                  for k, ref in arrays["float32"].items()]
        print(f"| {setting} | {np.mean(values):.1f} dB | {min(values):.1f} dB |")


if __name__ == "__main__":
    main()
