#!/usr/bin/env python
"""Train ``tiny:shapes``: a FLUX.1-architecture pipeline that draws captioned shapes, on CPU.

    OMP_NUM_THREADS=2 python scripts/train_shapes.py --out lightning_diffusion/models/shapes

Two stages and an optional third, all with diffusers' and transformers' own classes, so the result loads with
``FluxPipeline.from_pretrained`` and every strategy runs it unchanged:

1. the VAE (``AutoencoderKL``, ``--downsampling`` 4, ``--latent-channels`` 4) learns to reconstruct
   64x64 shape images, then again with the shapes' pixels weighing 5x and their outlines 21x (a
   caption asks for a shape, and a shape is its outline); its latents' mean and std become
   ``shift_factor`` and ``scaling_factor``, and the round trip's shape adherence on held-out scenes is
   measured and recorded;
2. the transformer (``FluxTransformer2DModel``, 4 heads of 32) and both text encoders (word-level
   CLIP and T5 towers) learn rectified flow on the frozen VAE's latents, with the text encoded by the
   pipeline's own ``encode_prompt`` (so training sees exactly what inference sees; plain MSE on the
   velocity, or with ``--flow-shape-weight``/``--flow-edge-weight`` the shapes' tokens weighed more),
   and an exponential moving average of the weights kept (that average is what is saved). One
   caption in ten is dropped (empty prompt), so ``true_cfg_scale`` with ``negative_prompt=""`` works
   too;
3. optionally (``--decoder-steps``), the decoder alone, shapes and outlines weighted again: the encoder is
   frozen, so the latents the flow model learned do not move while the decoder draws them sharper.

``--device cuda`` trains on a GPU and ``--data-workers N`` draws the batches in N processes ahead of
it (the same batches for any N). docs/shapes.md measures what these options did.

The held-out captions (``shapes.held_out_scenes()`` and ``shapes.held_out_pairs()``) are never trained on.
Seeded and resumable: every stage saves WORK_DIR/state.pt (weights, optimiser, average, random
state, step) every ``--checkpoint-every`` steps, and the same command continues from it. Each stage
logs its loss every 50 steps to the console and WORK_DIR/train.log; the result is saved in float16
with the recommended settings, and models/shapes/training.json records the run. See docs/shapes.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPE_WEIGHT = 4.0  # extra weight of a shape's pixels (1 + 4 = 5x the background's)
EDGE_WEIGHT = 16.0  # extra weight of its outline's pixels on top (21x)


DEVICE = torch.device("cpu")  # --device: where the models train (the batches are drawn on the CPU)
WORKERS = 0  # --data-workers: processes drawing batches ahead of the device


def batch_at(seed: int, step: int, batch: int, exclude: set[str]) -> tuple[list[str], torch.Tensor]:
    """Training batch ``step``: its captions and images in [-1, 1], a function of (seed, step) alone."""
    from lightning_diffusion.pipelines import shapes

    scenes = [s for s in shapes.sample_scenes(seed + step, batch * 2) if shapes.caption(s) not in exclude][:batch]
    images = torch.stack([shapes.render(s, seed=(seed + step) * 10_000 + i) for i, s in enumerate(scenes)])
    return [shapes.caption(s) for s in scenes], images * 2 - 1


class Batches(torch.utils.data.IterableDataset):
    """Batches ``start``, ``start + 1``, ... dealt round-robin over the loader's workers, which the
    loader reads back in the same round-robin order: the sequence is the same for any worker count."""

    def __init__(self, seed: int, batch: int, exclude: set[str], start: int) -> None:
        self.seed, self.batch, self.exclude, self.start = seed, batch, exclude, start

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        step = self.start + worker
        while True:
            yield batch_at(self.seed, step, self.batch, self.exclude)
            step += workers


def batches(seed: int, batch: int, exclude: set[str], start: int = 0):
    """Batch after batch, on ``DEVICE``; drawn ahead by ``WORKERS`` processes when there are any."""
    if WORKERS:
        loader = torch.utils.data.DataLoader(Batches(seed, batch, exclude, start), batch_size=None,
                                             num_workers=WORKERS, prefetch_factor=4,
                                             pin_memory=DEVICE.type == "cuda",
                                             generator=torch.Generator().manual_seed(seed))  # not the global RNG
        for captions, images in loader:
            yield captions, images.to(DEVICE, non_blocking=True)
        return
    step = start
    while True:
        captions, images = batch_at(seed, step, batch, exclude)
        yield captions, images.to(DEVICE)
        step += 1


def lr_at(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def pixel_weights(x: torch.Tensor, shape_weight: float, edge_weight: float) -> torch.Tensor:
    """(B, 1, H, W): 1 on the background, ``1 + shape_weight`` on the pixels that differ from it (the
    border's median), and ``edge_weight`` more on the shapes' outlines (pixels within one of a
    change). The shapes are a small share of the pixels but all of what a caption asks for, and
    what tells a star from a circle is its outline."""
    b = x.shape[0]
    border = torch.cat([x[:, :, 0], x[:, :, -1], x[:, :, :, 0], x[:, :, :, -1]], dim=2)
    background = border.median(dim=2).values.view(b, 3, 1, 1)
    differs = (((x - background) ** 2).sum(1, keepdim=True).sqrt() > 0.1).float()
    grown = F.max_pool2d(differs, 3, stride=1, padding=1)
    shrunk = -F.max_pool2d(-differs, 3, stride=1, padding=1)
    return 1 + shape_weight * differs + edge_weight * (grown - shrunk)


class Checkpoint:
    """WORK_DIR/state.pt: the stage, its step, and everything needed to continue it: bit for bit on
    the CPU; on a GPU with the same random streams, through kernels that are not bit-exact."""

    def __init__(self, work: Path, every: int, log) -> None:
        self.path, self.every, self.log = work / "state.pt", every, log
        self.state = torch.load(self.path, weights_only=False, map_location="cpu") if self.path.exists() else None

    def resume(self, stage: str) -> dict | None:
        if self.state and self.state["stage"] == stage:
            torch.set_rng_state(self.state["rng"])  # dropout in the text encoders draws from it
            if DEVICE.type == "cuda" and self.state.get("cuda_rng") is not None:  # there, from the GPU's
                torch.cuda.set_rng_state(self.state["cuda_rng"], DEVICE)
            self.log(f"{stage}: continuing from step {self.state['step']} ({self.path})")
            return self.state
        return None

    def done(self, stage: str) -> bool:
        return bool(self.state) and stage in self.state.get("finished", [])

    def save(self, stage: str, step: int, finished: list[str], **parts) -> None:
        state = {**(self.state or {}), "stage": stage, "step": step, "finished": list(finished),
                 "rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state(DEVICE) if DEVICE.type == "cuda" else None, **parts}
        tmp = self.path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.path)
        self.state = state


def train_vae(pipe, stage: str, steps: int, batch: int, seed: int, exclude: set[str], log, ckpt: Checkpoint,
              finished: list[str], lr: float = 1e-3, shape_weight: float = 0.0, edge_weight: float = 0.0,
              decoder_only: bool = False) -> None:
    """The VAE on reconstruction; with ``decoder_only`` the encoder is frozen, so the latents (and a
    flow model trained on them) stay as they are while the decoder learns to draw them sharper."""
    vae = pipe.vae
    vae.train()
    trained = vae.decoder if decoder_only else vae
    opt = torch.optim.AdamW(trained.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    first = 0
    if (state := ckpt.resume(stage)) is not None:
        vae.load_state_dict(state["vae"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        first = state["step"]
    data = batches(seed, batch, exclude, start=first)
    start = time.time()
    for step in range(first, steps):
        _, x = next(data)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        with torch.set_grad_enabled(not decoder_only):
            posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=gen).to(DEVICE)
        rec = vae.decode(z).sample
        w = pixel_weights(x, shape_weight, edge_weight)
        err = rec - x
        loss = (w * err ** 2).mean() + 0.5 * (w * err.abs()).mean() + 1e-6 * posterior.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"{stage} step {step} loss {loss.item():.4f} ({time.time() - start:.0f} s)")
        if (step + 1) % ckpt.every == 0 and step + 1 < steps:
            ckpt.save(stage, step + 1, finished, vae=vae.state_dict(), opt=opt.state_dict(), gen=gen.get_state())
    vae.eval()


@torch.no_grad()
def latent_stats(vae, seed: int, exclude: set[str]) -> tuple[float, float]:
    data = batches(seed, 64, exclude)
    zs = torch.cat([vae.encode(next(data)[1]).latent_dist.mean for _ in range(8)])
    return float(zs.mean()), float(zs.std())


@torch.no_grad()
def round_trip(vae, n: int = 300) -> dict[str, float]:
    """The VAE's round trip of ``n`` exact held-out drawings, read by ``eval``'s detector: the share of
    colours and shapes that survive it (an upper bound on what the whole pipeline can draw)."""
    from lightning_diffusion.pipelines import shapes

    scenes = shapes.held_out_scenes(n)
    kept = {"colour": 0, "shape": 0}
    for i in range(0, n, 50):
        part = scenes[i:i + 50]
        x = (torch.stack([shapes.render(s, seed=j) for j, s in enumerate(part, start=i)]) * 2 - 1).to(DEVICE)
        rec = ((vae.decode(vae.encode(x).latent_dist.mean).sample + 1) / 2).float().cpu()
        for image, scene in zip(rec, part):
            result = shapes.adherence(image, scene)
            kept["colour"] += result["colour"]
            kept["shape"] += result["shape"]
    return {k: round(100 * v / n, 1) for k, v in kept.items()}


def token_weights(x: torch.Tensor, tokens: int, shape_weight: float, edge_weight: float) -> torch.Tensor:
    """(B, tokens, 1): each packed image token's share of ``pixel_weights`` (the background's tokens
    weigh 1, as in plain MSE). Normalising them to mean 1 instead (the background under 1) made the
    shapes sprawl over the background: 11% of positions right at 3750 steps."""
    w = pixel_weights(x, shape_weight, edge_weight)
    side = int(math.isqrt(tokens))
    return F.adaptive_avg_pool2d(w, side).flatten(1).unsqueeze(-1)


def train_flow(pipe, steps: int, batch: int, seed: int, exclude: set[str], text_len: int, log, ckpt: Checkpoint,
               finished: list[str], lr: float = 1e-3, ema_decay: float = 0.999, shape_weight: float = 0.0,
               edge_weight: float = 0.0) -> dict[str, torch.nn.Module]:
    """Rectified flow; returns the moving averages of the trained modules (what ships)."""
    from diffusers import FluxPipeline

    vae, transformer = pipe.vae, pipe.transformer
    trained = {"transformer": transformer, "text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2}
    params = [p for module in trained.values() for p in module.parameters()]
    for module in trained.values():
        module.train()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    averages = {name: copy.deepcopy(module).eval().requires_grad_(False) for name, module in trained.items()}
    first = 0
    if (state := ckpt.resume("flow")) is not None:
        for name, module in trained.items():
            module.load_state_dict(state["models"][name])
            averages[name].load_state_dict(state["averages"][name])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        first = state["step"]
    data = batches(seed, batch, exclude, start=first)
    scale, shift = vae.config.scaling_factor, vae.config.shift_factor
    start = time.time()
    average = None
    for step in range(first, steps):
        captions, x = next(data)
        drop = torch.rand(len(captions), generator=gen) < 0.1
        captions = ["" if d else c for c, d in zip(captions, drop.tolist())]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        with torch.no_grad():
            x0 = (vae.encode(x).latent_dist.mean - shift) * scale
        b, c, h, w = x0.shape
        noise = torch.randn(x0.shape, generator=gen).to(DEVICE)
        sigma = torch.sigmoid(torch.randn(b, generator=gen)).to(DEVICE)  # logit-normal, as in SD3
        xt = (1 - sigma.view(b, 1, 1, 1)) * x0 + sigma.view(b, 1, 1, 1) * noise
        prompt_embeds, pooled, text_ids = pipe.encode_prompt(captions, None, device=DEVICE,
                                                             max_sequence_length=text_len)
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
        error = (pred - target) ** 2
        if shape_weight or edge_weight:
            error = token_weights(x, pred.shape[1], shape_weight, edge_weight) * error
        loss = error.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for name, module in trained.items():
                torch._foreach_lerp_(list(averages[name].parameters()), list(module.parameters()), 1 - decay)
        average = loss.item() if average is None else 0.98 * average + 0.02 * loss.item()
        if step % 50 == 0 or step == steps - 1:
            log(f"flow step {step} loss {average:.4f} ({time.time() - start:.0f} s)")
        if (step + 1) % ckpt.every == 0 and step + 1 < steps:
            ckpt.save("flow", step + 1, finished, models={n: m.state_dict() for n, m in trained.items()},
                      averages={n: m.state_dict() for n, m in averages.items()}, opt=opt.state_dict(),
                      gen=gen.get_state())
            log(f"checkpoint at flow step {step + 1}")
    for module in trained.values():
        module.eval()
    return averages


def save(pipe, out: Path, dtype: str, steps: int, cfg: float) -> None:
    """The pipeline in safetensors (float16 by default: half the bytes; it loads in any dtype) and
    the settings DiffusionModule uses where a config sets nothing (pipelines.RECOMMENDED_FILE)."""
    from lightning_diffusion.pipelines import tiny

    pipe.to("cpu", getattr(torch, dtype))
    pipe.save_pretrained(out, safe_serialization=True)
    recommended = {"height": 64, "width": 64, "num_inference_steps": steps,
                   "max_sequence_length": tiny.SHAPES_TEXT_LENGTH}
    if cfg > 1:  # true classifier-free guidance against the empty prompt (trained by caption dropout)
        recommended.update(true_cfg_scale=cfg, negative_prompt="")
    (out / "lightning_diffusion.json").write_text(json.dumps({"call_defaults": recommended}, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="lightning_diffusion/models/shapes")
    parser.add_argument("--latent-channels", type=int, default=4)
    parser.add_argument("--downsampling", type=int, default=4, choices=[2, 4],
                        help="the VAE's: 2 gives 256 image tokens of 4x4 pixels, 4 gives 64 of 8x8")
    parser.add_argument("--vae-steps", type=int, default=1500)
    parser.add_argument("--vae-finetune-steps", type=int, default=1000)
    parser.add_argument("--decoder-steps", type=int, default=0,
                        help="after the flow: the VAE's decoder alone, shapes and outlines weighted (0: none)")
    parser.add_argument("--vae-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flow-lr", type=float, default=1e-3)
    parser.add_argument("--ema-decay", type=float, default=0.999)
    parser.add_argument("--flow-shape-weight", type=float, default=0.0,
                        help="extra weight of the image tokens a shape covers in the flow loss (0: plain MSE)")
    parser.add_argument("--flow-edge-weight", type=float, default=0.0,
                        help="extra weight of the tokens its outline crosses (0: plain MSE)")
    parser.add_argument("--default-steps", type=int, default=12, help="the steps recommended to users")
    parser.add_argument("--default-cfg", type=float, default=3.0, help="the true_cfg_scale recommended (1: none)")
    parser.add_argument("--save-dtype", default="float16", choices=["float16", "float32"])
    parser.add_argument("--checkpoint-every", type=int, default=250, help="steps between saves of WORK_DIR/state.pt")
    parser.add_argument("--device", default="cpu", help="where the models train: cpu, cuda (TF32 matmuls)")
    parser.add_argument("--data-workers", type=int, default=0,
                        help="processes drawing batches ahead (the same batches for any number)")
    parser.add_argument("--work-dir", default="/tmp/train-shapes", help="the log and the checkpoint (not the package)")
    args = parser.parse_args()

    from lightning_diffusion.pipelines import shapes, tiny

    global DEVICE, WORKERS
    DEVICE, WORKERS = torch.device(args.device), args.data_workers
    if DEVICE.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    out = Path(args.out)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(work / "train.log", "a")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    ckpt = Checkpoint(work, args.checkpoint_every, log)
    times_path = work / "times.json"
    times = json.loads(times_path.read_text()) if times_path.exists() else {}

    def timed(stage: str, began: float) -> None:
        times[stage] = round(times.get(stage, 0) + time.time() - began)
        times_path.write_text(json.dumps(times))

    exclude = {shapes.caption(s) for s in shapes.held_out_scenes() + shapes.held_out_pairs()}
    pipe = tiny.shapes_architecture(args.latent_channels, args.downsampling).to(DEVICE)
    finished: list[str] = list(ckpt.state.get("finished", [])) if ckpt.state else []
    if "vae" in finished:
        pipe.vae.load_state_dict(ckpt.state["vae"])
        pipe.vae.register_to_config(**{k: ckpt.state["vae_config"][k] for k in ("shift_factor", "scaling_factor")})
        kept = ckpt.state["round_trip"]
    else:
        began = time.time()
        if "vae-plain" in finished:
            pipe.vae.load_state_dict(ckpt.state["vae"])
        else:
            train_vae(pipe, "vae-plain", args.vae_steps, args.vae_batch, args.seed, exclude, log, ckpt, finished)
            finished.append("vae-plain")
            ckpt.save("vae-outlines-start", 0, finished, vae=pipe.vae.state_dict())
        # then the shapes' pixels and outlines weigh more: sharp small stars, exact colours
        train_vae(pipe, "vae-outlines", args.vae_finetune_steps, args.vae_batch, args.seed + 5_000_000, exclude, log,
                  ckpt, finished, lr=5e-4, shape_weight=SHAPE_WEIGHT, edge_weight=EDGE_WEIGHT)
        mean, std = latent_stats(pipe.vae, args.seed + 7_000_000, exclude)
        pipe.vae.register_to_config(shift_factor=round(mean, 4), scaling_factor=round(1 / std, 4))
        log(f"vae latents: mean {mean:.4f} std {std:.4f}")
        kept = round_trip(pipe.vae)
        log(f"vae round trip of 300 held-out drawings: colours {kept['colour']}%, shapes {kept['shape']}%")
        finished.append("vae")
        ckpt.save("flow-start", 0, finished, vae=pipe.vae.state_dict(), vae_config=dict(pipe.vae.config),
                  round_trip=kept)
        timed("vae", began)
    pipe.vae.eval()
    if "flow" in finished:
        averages = {name: getattr(pipe, name) for name in ckpt.state["averages"]}
        for name, module in averages.items():
            module.load_state_dict(ckpt.state["averages"][name])
            module.eval()
    else:
        began = time.time()
        averages = train_flow(pipe, args.steps, args.batch, args.seed + 1_000_000, exclude, tiny.SHAPES_TEXT_LENGTH,
                              log, ckpt, finished, args.flow_lr, args.ema_decay, args.flow_shape_weight,
                              args.flow_edge_weight)
        finished.append("flow")
        ckpt.save("decoder-start", 0, finished, averages={n: m.state_dict() for n, m in averages.items()})
        timed("flow", began)
        for name, module in averages.items():
            setattr(pipe, name, module)
        pipe.register_modules(**averages)
    encoder_round_trip = kept
    if args.decoder_steps and "decoder" not in finished:
        # The decoder alone, on the flow's finished latents: sharper outlines without moving the latents.
        began = time.time()
        train_vae(pipe, "decoder", args.decoder_steps, args.vae_batch, args.seed + 9_000_000, exclude, log, ckpt,
                  finished, lr=5e-4, shape_weight=SHAPE_WEIGHT, edge_weight=EDGE_WEIGHT, decoder_only=True)
        kept = round_trip(pipe.vae)
        log(f"vae round trip after the decoder's pass: colours {kept['colour']}%, shapes {kept['shape']}%")
        finished.append("decoder")
        ckpt.save("done", 0, finished, vae=pipe.vae.state_dict(), decoder_round_trip=kept)
        timed("decoder", began)
    elif "decoder" in finished:  # its VAE is the checkpoint's, loaded above
        kept = ckpt.state["decoder_round_trip"]
    pipe.vae.eval()
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.requires_grad_(False)
    save(pipe, out, args.save_dtype, args.default_steps, args.default_cfg)
    record = {
        "command": " ".join([f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')}", "python",
                             "scripts/train_shapes.py", *sys.argv[1:]]),
        **{k: getattr(args, k) for k in ("latent_channels", "downsampling", "vae_steps", "vae_finetune_steps",
                                         "decoder_steps", "vae_batch", "steps", "batch", "seed", "flow_lr",
                                         "ema_decay", "flow_shape_weight", "flow_edge_weight")},
        "vae_round_trip_percent": kept, "vae_round_trip_before_decoder_pass_percent": encoder_round_trip,
        "vae_minutes": round(times.get("vae", 0) / 60, 1), "decoder_minutes": round(times.get("decoder", 0) / 60, 1),
        "flow_minutes": round(times.get("flow", 0) / 60, 1), "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu",
        "saved_dtype": args.save_dtype, "recommended_steps": args.default_steps,
        "recommended_true_cfg_scale": args.default_cfg,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    log(f"done: vae {record['vae_minutes']} min, flow {record['flow_minutes']} min: {out}")


if __name__ == "__main__":
    main()
