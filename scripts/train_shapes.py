#!/usr/bin/env python
"""Train ``tiny:shapes``: a FLUX.1-architecture pipeline that draws captioned shapes, on CPU.

    OMP_NUM_THREADS=2 python scripts/train_shapes.py --out lightning_diffusion/models/shapes

Two stages, all with diffusers' and transformers' own classes, so the result loads with
``FluxPipeline.from_pretrained`` and every strategy runs it unchanged:

1. the VAE (``AutoencoderKL``, 4x downsampling, 4 latent channels) learns to reconstruct 64x64
   shape images (1500 steps), then again with the shapes' pixels weighing 10x (1000 steps); its
   latents' mean and std become ``shift_factor`` and ``scaling_factor``;
2. the transformer (``FluxTransformer2DModel``, 4 heads of 32) and both text encoders (word-level
   CLIP and T5 towers) learn rectified flow on the frozen VAE's latents, with the text encoded by the
   pipeline's own ``encode_prompt`` (so training sees exactly what inference sees). One caption in
   ten is dropped (empty prompt), so ``true_cfg_scale`` with ``negative_prompt=""`` works too.

The 200 held-out captions of ``lightning_diffusion.shapes.held_out_scenes()`` are never trained on.
Seeded. On this project's 2-core CPU machines the shipped weights took 15 + 8 min (VAE) and 58 min
(flow, 6000 steps of 32) with other work running beside them, 81 minutes; alone, a flow step takes
0.42 s (42 min). See docs/shapes.md and models/shapes/training.json. Each stage logs its loss every 50 steps to
the console and WORK_DIR/train.log; the result is saved in float16 with the recommended settings.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def batches(seed: int, batch: int, exclude: set[str]):
    from lightning_diffusion import shapes

    step = 0
    while True:
        scenes = [s for s in shapes.sample_scenes(seed + step, batch * 2) if shapes.caption(s) not in exclude][:batch]
        images = torch.stack([shapes.render(s, seed=(seed + step) * 10_000 + i) for i, s in enumerate(scenes)])
        yield [shapes.caption(s) for s in scenes], images * 2 - 1
        step += 1


def lr_at(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def shape_weights(x: torch.Tensor, weight: float) -> torch.Tensor:
    """1 on the background, 1 + weight on the pixels that differ from it (the border's median): the
    shapes are a small share of the pixels but all of what a caption asks for."""
    b = x.shape[0]
    border = torch.cat([x[:, :, 0], x[:, :, -1], x[:, :, :, 0], x[:, :, :, -1]], dim=2)
    background = border.median(dim=2).values.view(b, 3, 1, 1)
    differs = ((x - background) ** 2).sum(1, keepdim=True).sqrt() > 0.1
    return 1 + weight * differs.float()


def train_vae(vae, steps: int, batch: int, seed: int, exclude: set[str], log, lr: float = 1e-3,
              shape_weight: float = 0.0) -> None:
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    data = batches(seed, batch, exclude)
    start = time.time()
    for step in range(steps):
        _, x = next(data)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=gen)
        rec = vae.decode(z).sample
        w = shape_weights(x, shape_weight)
        err = rec - x
        loss = (w * err ** 2).mean() + 0.5 * (w * err.abs()).mean() + 1e-6 * posterior.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"vae step {step} loss {loss.item():.4f} ({time.time() - start:.0f} s)")
    vae.eval()


@torch.no_grad()
def latent_stats(vae, seed: int, exclude: set[str]) -> tuple[float, float]:
    data = batches(seed, 64, exclude)
    zs = torch.cat([vae.encode(next(data)[1]).latent_dist.mean for _ in range(8)])
    return float(zs.mean()), float(zs.std())


def train_flow(pipe, steps: int, batch: int, seed: int, exclude: set[str], text_len: int, log,
               save_every: int = 0, checkpoint: Path | None = None, lr: float = 1e-3) -> None:
    from diffusers import FluxPipeline

    vae, transformer = pipe.vae, pipe.transformer
    params = [*transformer.parameters(), *pipe.text_encoder.parameters(), *pipe.text_encoder_2.parameters()]
    for module in (transformer, pipe.text_encoder, pipe.text_encoder_2):
        module.train()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    data = batches(seed, batch, exclude)
    scale, shift = vae.config.scaling_factor, vae.config.shift_factor
    start = time.time()
    average = None
    for step in range(steps):
        captions, x = next(data)
        drop = torch.rand(len(captions), generator=gen) < 0.1
        captions = ["" if d else c for c, d in zip(captions, drop.tolist())]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        with torch.no_grad():
            x0 = (vae.encode(x).latent_dist.mean - shift) * scale
        b, c, h, w = x0.shape
        noise = torch.randn(x0.shape, generator=gen)
        sigma = torch.sigmoid(torch.randn(b, generator=gen))  # logit-normal, as in SD3
        xt = (1 - sigma.view(b, 1, 1, 1)) * x0 + sigma.view(b, 1, 1, 1) * noise
        prompt_embeds, pooled, text_ids = pipe.encode_prompt(captions, None, device="cpu", max_sequence_length=text_len)
        img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x0.device, x0.dtype)
        pred = transformer(
            hidden_states=FluxPipeline._pack_latents(xt, b, c, h, w),
            timestep=sigma,
            guidance=None,
            pooled_projections=pooled,
            encoder_hidden_states=prompt_embeds,
            txt_ids=text_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        target = FluxPipeline._pack_latents(noise - x0, b, c, h, w)
        loss = F.mse_loss(pred, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        average = loss.item() if average is None else 0.98 * average + 0.02 * loss.item()
        if step % 50 == 0 or step == steps - 1:
            log(f"flow step {step} loss {average:.4f} ({time.time() - start:.0f} s)")
        if save_every and checkpoint and step and step % save_every == 0:
            pipe.save_pretrained(checkpoint, safe_serialization=True)
            log(f"checkpoint at step {step}: {checkpoint}")
    for module in (transformer, pipe.text_encoder, pipe.text_encoder_2):
        module.eval()


def save(pipe, out: Path, dtype: str, steps: int, cfg: float) -> None:
    """The pipeline in safetensors (float16 by default: half the bytes; it loads in any dtype) and
    the settings DiffusionModule uses where a config sets nothing (pipelines.RECOMMENDED_FILE)."""
    from lightning_diffusion import tiny

    pipe.to(getattr(torch, dtype))
    pipe.save_pretrained(out, safe_serialization=True)
    recommended = {"height": 64, "width": 64, "num_inference_steps": steps, "max_sequence_length": tiny.SHAPES_TEXT_LENGTH}
    if cfg > 1:  # true classifier-free guidance against the empty prompt (trained by caption dropout)
        recommended.update(true_cfg_scale=cfg, negative_prompt="")
    (out / "lightning_diffusion.json").write_text(json.dumps({"call_defaults": recommended}, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="lightning_diffusion/models/shapes")
    parser.add_argument("--vae-steps", type=int, default=1500)
    parser.add_argument("--vae-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vae-finetune-steps", type=int, default=1000)
    parser.add_argument("--vae-init", help="start stage 1 from this pipeline folder's VAE (skips its first part)")
    parser.add_argument("--vae-from", help="reuse the VAE of this pipeline folder (skips stage 1)")
    parser.add_argument("--default-steps", type=int, default=12, help="the steps recommended to users")
    parser.add_argument("--default-cfg", type=float, default=3.0, help="the true_cfg_scale recommended (1: none)")
    parser.add_argument("--save-dtype", default="float16", choices=["float16", "float32"])
    parser.add_argument("--continue-from", help="train the flow stage further from this saved pipeline")
    parser.add_argument("--flow-lr", type=float, default=1e-3)
    parser.add_argument("--save-every", type=int, default=0, help="also save WORK_DIR/checkpoint every N flow steps")
    parser.add_argument("--work-dir", default="/tmp/train-shapes", help="the log and checkpoints (not the package)")
    args = parser.parse_args()

    from lightning_diffusion import shapes, tiny

    torch.manual_seed(args.seed)
    out = Path(args.out)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / "train.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "a")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    exclude = {shapes.caption(s) for s in shapes.held_out_scenes()}
    started = time.time()
    pipe = tiny.shapes_architecture()
    if args.continue_from:  # more flow training on a saved pipeline (its VAE, encoders and transformer)
        from diffusers import FluxPipeline

        pipe = FluxPipeline.from_pretrained(args.continue_from)
        pipe.vae.eval()
    elif args.vae_from:
        from diffusers import AutoencoderKL

        pipe.vae = AutoencoderKL.from_pretrained(args.vae_from, subfolder="vae")
        pipe.vae.eval()
    else:
        if args.vae_init:
            from diffusers import AutoencoderKL

            pipe.vae = AutoencoderKL.from_pretrained(args.vae_init, subfolder="vae")
        else:
            train_vae(pipe.vae, args.vae_steps, args.vae_batch, args.seed, exclude, log)
        # then the shapes' pixels count 10x: sharper small shapes, exact colours
        train_vae(pipe.vae, args.vae_finetune_steps, args.vae_batch, args.seed + 5_000_000, exclude, log,
                  lr=5e-4, shape_weight=9.0)
        mean, std = latent_stats(pipe.vae, args.seed + 7_000_000, exclude)
        pipe.vae.register_to_config(shift_factor=round(mean, 4), scaling_factor=round(1 / std, 4))
        log(f"vae latents: mean {mean:.4f} std {std:.4f}")
    vae_done = time.time()
    train_flow(pipe, args.steps, args.batch, args.seed + 1_000_000, exclude, tiny.SHAPES_TEXT_LENGTH, log,
               args.save_every, work / "checkpoint", args.flow_lr)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.requires_grad_(False)
    save(pipe, out, args.save_dtype, args.default_steps, args.default_cfg)
    wall = time.time() - started
    record = {
        "vae_steps": args.vae_steps, "vae_finetune_steps": args.vae_finetune_steps, "vae_batch": args.vae_batch, "steps": args.steps, "batch": args.batch,
        "seed": args.seed, "vae_seconds": round(vae_done - started), "flow_seconds": round(time.time() - vae_done),
        "wall_seconds": round(wall), "threads": torch.get_num_threads(),
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    log(f"done in {wall / 60:.1f} min: {out}")


if __name__ == "__main__":
    main()
