"""LoRA under tensor parallelism: each rank's peak resident memory and time per image with and
without an adapter fused into the shards, against the size of the adapter and of the transformer.

    python benchmarks/lora_tp.py [--rank 64] [--repeats 2]

The model is benchmarks/quantization.py's: a FLUX.1-architecture transformer of 40M parameters
(random weights) with tiny:flux's other components; the adapter targets every linear layer of the
transformer's blocks (random A and B). tp=2 on CPU with gloo, one core per process, 256x256, 8
steps; ``lightning-diffusion benchmark`` reports rank 0's peak resident set. Runs alternate (no
adapter, adapter) within each repeat; medians reported.
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

from quantization import build_medium  # benchmarks/quantization.py, beside this file

REPO = Path(__file__).resolve().parents[1]


def make_adapter(model: Path, folder: Path, rank: int) -> Path:
    import torch
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from peft import LoraConfig, get_peft_model_state_dict

    transformer = FluxTransformer2DModel.from_pretrained(model, subfolder="transformer")
    config = LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False,
                        target_modules=r".*blocks\.\d+\..*(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|"
                                       r"to_add_out|proj_mlp|proj_out|ff\.net\.0\.proj|ff\.net\.2|ff_context\.net\.0\.proj|"
                                       r"ff_context\.net\.2)")
    transformer.add_adapter(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.02)
    FluxPipeline.save_lora_weights(folder, transformer_lora_layers=get_peft_model_state_dict(transformer),
                                   transformer_lora_adapter_metadata=config.to_dict())
    return folder / "pytorch_lora_weights.safetensors"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"no adapter": [], "adapter": []}
    with tempfile.TemporaryDirectory(prefix="lora-tp-bench-") as name:
        tmp = Path(name)
        model = build_medium(tmp / "medium")
        adapter = make_adapter(model, tmp / "adapter", args.rank)
        prompts = tmp / "prompts.txt"
        prompts.write_text("".join(f"a benchmark picture number {i}\n" for i in range(4)))
        for repeat in range(args.repeats):
            for setting in runs:
                report = tmp / "report.json"
                extra = ["--model.lora", json.dumps([{"path": str(adapter)}])] if setting == "adapter" else []
                proc = subprocess.run(
                    [sys.executable, "-m", "lightning_diffusion", "benchmark", "--config", "configs/tiny-tp.yaml",
                     "--json", str(report), "--model.pretrained_model_name_or_path", str(model), "--data.prompts",
                     str(prompts), "--data.batch_size", "2", "--model.height", "256", "--model.width", "256",
                     "--model.num_inference_steps", "8", *extra],
                    capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
                if proc.returncode != 0:
                    raise SystemExit(f"{setting} failed:\n{proc.stderr[-3000:]}")
                runs[setting].append(json.loads(report.read_text()))
                print(f"repeat {repeat}: {setting}: peak RSS {runs[setting][-1]['peak_memory_gb'] * 1024:.0f} MB, "
                      f"{1 / runs[setting][-1]['images_per_sec']:.3f} s/image", flush=True)
        adapter_mb = adapter.stat().st_size / 1e6
        transformer_mb = sum(f.stat().st_size for f in (model / "transformer").glob("*.safetensors")) / 1e6
    print(f"\ntp=2, FLUX.1-architecture transformer of {transformer_mb:.0f} MB (float32), adapter rank {args.rank} "
          f"of {adapter_mb:.1f} MB, 256x256, 8 steps, one core a rank, medians of {args.repeats}:")
    print("| run | rank 0 peak RSS | time per image |")
    print("| --- | --- | --- |")
    for setting, results in runs.items():
        peak = statistics.median(r["peak_memory_gb"] * 1024 for r in results)
        per_image = statistics.median(1 / r["images_per_sec"] for r in results)
        print(f"| {setting} | {peak:.0f} MB | {per_image:.3f} s |")


if __name__ == "__main__":
    main()
