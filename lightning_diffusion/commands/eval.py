"""``lightning-diffusion eval OUTPUT_DIR [--reference REF_DIR] [--fid] [--clip CLIP_DIR] [--json]``.

Metrics of an output folder, read through its manifest (only finished images count):

* against a reference folder made with the same prompts and seeds (``--reference``): per image and
  overall max absolute difference, PSNR and SSIM (torchmetrics), on the images both folders hold;
* prompt adherence, for prompts that are ``tiny:shapes`` captions: the share of images whose
  background and shape colours (and, stated separately, shape and position; for two-shape captions,
  ``both_colours``: each shape's colour drawn) match the caption, read by the analytic detector of
  ``lightning_diffusion.pipelines.shapes`` (no learned model);
* ``--fid``: FID and KID (torchmetrics) against the reference folder, or, for shapes captions without
  one, against the captions drawn exactly by ``shapes.render``. Features come from a VAE encoder
  (``--features``; for shapes captions ``tiny:shapes`` by default: its latents pooled to 4x4) or from Inception
  (``--features inception``, which needs the torch-fidelity package and ``--inception-weights``);
* ``--clip DIR``: CLIP score (torchmetrics' definition) with a local CLIP model folder.

An object-store output or reference (``s3://bucket/prefix``, as ``writer.output_dir`` takes) is
read as its folder would be: its recorded images' tar shards and manifest lines are downloaded into
a temporary folder, removed at the end.

Reads only; writes nothing (but that temporary folder). Exit code 0 on success, 2 for bad input (a
one-line message).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_diffusion.commands import add_json_option, help_text, json_argv
from lightning_diffusion.commands import report as emit
from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.core.records import ManifestLine
from lightning_diffusion.output.manifest import MANIFEST, PART_GLOB
from lightning_diffusion.output.recorded import read_output, scan_manifest

if TYPE_CHECKING:
    import torch

    from lightning_diffusion.report.verdicts import EvalResult, EvalRow, EvalSummary

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
FEATURE_POOL = 4  # VAE latents pooled to 4x4: 64 features for 4 latent channels


def _entries(folder: Path, what: str) -> dict[int, ManifestLine]:
    if not folder.is_dir():
        raise ConfigError(f"{what} {folder} is not a folder.")
    if not (folder / MANIFEST).is_file() and not any(folder.glob(PART_GLOB)):
        raise ConfigError(f"{what} {folder} has no {MANIFEST}: eval reads the images a run recorded there.")
    entries, _ = scan_manifest(folder)
    if not entries:
        raise ConfigError(f"{what} {folder} records no finished image.")
    videos = sorted(i for i, e in entries.items()
                    if Path(str(e.get("member") or e["file"])).suffix.lower() not in IMAGE_SUFFIXES)
    if videos:
        raise ConfigError(f"{what} {folder} holds videos ({entries[videos[0]]['file']}, ...): eval reads images only.")
    return entries


def _load(folder: Path, entry: ManifestLine):
    import numpy as np
    import torch
    from PIL import Image

    try:
        with Image.open(io.BytesIO(read_output(folder, entry))) as image:  # a file, or a tar shard's member
            array = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    except (OSError, ValueError, KeyError) as err:  # recorded as finished, but not an image eval can read
        where = str(entry["file"]) + (f" member {entry['member']}" if entry.get("member") else "")
        raise ConfigError(f"{folder / where} (image {entry['index']}) is not a readable image: "
                          f"{type(err).__name__}: {err}") from None
    return torch.from_numpy(array).permute(2, 0, 1)


def _indices(indices: list[int]) -> str:
    shown = ", ".join(str(i) for i in indices[:10])
    return shown + (f" and {len(indices) - 10} more" if len(indices) > 10 else "")


def match_reference(ours: dict[int, ManifestLine], ref: dict[int, ManifestLine]) -> list[int]:
    """The indices both folders hold, after checking they were made from the same prompts and seeds."""
    common = sorted(set(ours) & set(ref))
    if not common:
        raise ConfigError("the reference folder holds none of the output's image indices.")
    differ = [i for i in common
              if ours[i].get("prompt") != ref[i].get("prompt") or ours[i].get("seed") != ref[i].get("seed")]
    if differ:
        raise ConfigError(f"the reference was made with other prompts or seeds: indices {_indices(differ)} differ.")
    return common


def _check_sizes(images: dict[int, torch.Tensor], refs: dict[int, torch.Tensor], one_size: bool) -> None:
    for index, image in images.items():
        ref = refs.get(index)
        if ref is not None and ref.shape != image.shape:
            raise ConfigError(f"image {index} is {image.shape[2]}x{image.shape[1]} in the output and "
                              f"{ref.shape[2]}x{ref.shape[1]} in the reference: compare images of one size.")
    sizes = {tuple(image.shape) for image in images.values()}
    if one_size and len(sizes) > 1:
        raise ConfigError("the output holds images of different sizes "
                          f"({', '.join('x'.join(map(str, s[1:][::-1])) for s in sorted(sizes))}).")


class VAEFeatures:
    """FID/KID features: a pipeline's VAE encoder, latents' mean pooled to 4x4 and flattened. Built as
    a torch module lazily (imports stay cheap)."""

    @staticmethod
    def build(source: str):
        import torch
        from diffusers import AutoencoderKL

        from lightning_diffusion.pipelines import tiny

        folder = Path(tiny.resolve(source))
        if not (folder / "vae").is_dir():
            raise ConfigError(f"--features {source}: {folder} has no vae/ folder to take an encoder from.")
        try:
            vae = AutoencoderKL.from_pretrained(folder, subfolder="vae", torch_dtype=torch.float32)
        except (OSError, ValueError) as err:
            raise ConfigError(f"--features {source}: its VAE does not load as an AutoencoderKL ({err}).") from None
        vae.eval().requires_grad_(False)

        class Encoder(torch.nn.Module):
            num_features = vae.config.latent_channels * FEATURE_POOL * FEATURE_POOL

            def __init__(self):
                super().__init__()
                self.vae = vae

            @torch.no_grad()
            def forward(self, images: torch.Tensor) -> torch.Tensor:  # float images in [0, 1]
                latents = self.vae.encode(images.float() * 2 - 1).latent_dist.mean
                return torch.nn.functional.adaptive_avg_pool2d(latents, FEATURE_POOL).flatten(1)

        return Encoder()


def _feature_module(args):
    if args.features == "inception":
        if importlib.util.find_spec("torch_fidelity") is None:
            raise ConfigError("--features inception needs the torch-fidelity package (pip install torch-fidelity) and "
                              "its Inception weights offline (--inception-weights FILE); or use --features "
                              "tiny:shapes.")
        if not args.inception_weights or not Path(args.inception_weights).is_file():
            raise ConfigError("--features inception needs --inception-weights FILE (torch-fidelity's "
                              "pt_inception-2015-12-05 weights): nothing is downloaded.")
        return _inception(args.inception_weights)
    return VAEFeatures.build(args.features)


def _inception(weights: str):
    """torch-fidelity's Inception v3 (FID's usual features, 2048) from a local weights file, as a
    feature module that both FID and KID take (they would otherwise each load their own)."""
    import torch
    from torchmetrics.image.fid import NoTrainInceptionV3

    net = NoTrainInceptionV3(name="inception-v3-compat", features_list=["2048"],
                             feature_extractor_weights_path=weights)

    class Inception(torch.nn.Module):
        num_features = 2048

        def __init__(self):
            super().__init__()
            self.net = net

        @torch.no_grad()
        def forward(self, images: torch.Tensor) -> torch.Tensor:  # float images in [0, 1]
            return self.net((images.clamp(0, 1) * 255).round().to(torch.uint8))

    return Inception()


# Below this many images, FID and KID are too noisy to read alone (a KID estimate below 0 is common).
FEW_IMAGES = 100


def _fid_kid(feature, real: list, fake: list) -> dict[str, float]:
    import warnings

    import torch
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.image.kid import KernelInceptionDistance

    warnings.filterwarnings("ignore", message=".*will save all extracted features in buffer.*")
    subset = min(50, len(real), len(fake))
    fid = FrechetInceptionDistance(feature=feature, normalize=True)
    kid = KernelInceptionDistance(feature=feature, normalize=True, subset_size=subset)
    for metric in (fid, kid):
        for start in range(0, len(real), 64):
            metric.update(torch.stack(real[start:start + 64]), real=True)
        for start in range(0, len(fake), 64):
            metric.update(torch.stack(fake[start:start + 64]), real=False)
    kid_mean, kid_std = kid.compute()
    result: dict[str, Any] = {"fid": float(fid.compute()), "kid": float(kid_mean), "kid_std": float(kid_std),
                              "fid_images": len(fake)}
    if len(fake) < FEW_IMAGES:
        result["warning"] = (f"FID and KID from {len(fake)} images are noisy estimates (KID can come out below 0, and "
                             f"FID is biased upwards): compare runs of the same image count, or use {FEW_IMAGES} or "
                             "more")
    return result


def evaluate(args) -> EvalResult:
    from lightning_diffusion.commands.verify import compare
    from lightning_diffusion.pipelines import shapes

    folder = Path(args.output_dir)
    ours = _entries(folder, "output")
    indices = sorted(ours)
    ref_folder = Path(args.reference) if args.reference else None
    refs = _entries(ref_folder, "reference") if ref_folder else {}
    compared = match_reference(ours, refs) if ref_folder else []
    if args.clip and not (Path(args.clip) / "config.json").is_file():
        raise ConfigError(f"--clip {args.clip} is not a local CLIP model folder (no config.json); nothing is "
                          "downloaded.")
    scenes = {i: shapes.parse_caption(str(ours[i].get("prompt", ""))) for i in indices}
    shape_captions = all(scene is not None for scene in scenes.values())
    if args.fid and not ref_folder and not shape_captions:
        raise ConfigError("--fid needs --reference REF_DIR (only tiny:shapes captions have a drawn reference).")
    if args.fid and args.features is None:
        if not shape_captions:
            raise ConfigError("--fid on these prompts needs --features: a pipeline folder whose VAE encodes them, or "
                              "inception (the default for shapes captions, tiny:shapes' VAE, knows only shapes).")
        args.features = "tiny:shapes"
    feature = _feature_module(args) if args.fid else None

    images = {i: _load(folder, ours[i]) for i in indices}
    ref_images = {i: _load(ref_folder, refs[i]) for i in compared} if ref_folder else {}
    if ref_folder or args.fid:  # pixel metrics compare pairs of one size; FID images of one size
        _check_sizes(images, ref_images, one_size=args.fid)
    if args.fid and not ref_folder and images[indices[0]].shape[-1] != images[indices[0]].shape[-2]:
        raise ConfigError("--fid against drawn shapes needs square images (they are drawn square).")

    rows = []
    for i in indices:
        row: EvalRow = {"index": i, "prompt": ours[i].get("prompt"), "seed": ours[i].get("seed")}
        if i in ref_images:
            a = images[i].permute(1, 2, 0).numpy()
            b = ref_images[i].permute(1, 2, 0).numpy()
            row.update(compare(a, b))
        scene = scenes[i]
        if scene is not None:
            found = shapes.detect(images[i])
            row["detected"] = {"background": found.background, "colour": found.colour, "shape": found.kind,
                               "position": found.position}
            row["adherence"] = shapes.adherence(images[i], scene)
        rows.append(row)

    named = getattr(args, "urls", {})  # an object store's URL for the folder it was copied into
    summary: EvalSummary = {"images": len(indices), "folder": named.get(str(folder), str(folder))}
    if compared:
        diffs = [r for r in rows if "max_abs" in r]
        summary["reference"] = {
            "folder": named.get(str(ref_folder), str(ref_folder)), "compared": len(diffs),
            "max_abs": max(r["max_abs"] for r in diffs),
            "psnr_mean": _mean([r["psnr"] for r in diffs]), "psnr_min": min(r["psnr"] for r in diffs),
            "ssim_mean": _mean([r["ssim"] for r in diffs]), "ssim_min": min(r["ssim"] for r in diffs),
        }
    judged = [r for r in rows if "adherence" in r]
    if judged:
        summary["adherence"] = {
            key: {"share": sum(r["adherence"][key] for r in with_key) / len(with_key), "images": len(with_key)}
            for key in ("colour", "shape", "position", "both_colours")
            if (with_key := [r for r in judged if key in r["adherence"]])
        }
    if args.fid:
        if ref_folder:
            real = [ref_images[i] for i in compared]
            fake = [images[i] for i in compared]
            against = named.get(str(ref_folder), str(ref_folder))
        else:
            side = images[indices[0]].shape[-1]
            # every caption is one (checked above): --fid without a reference draws them
            real = [shapes.render(scene, size=side, seed=int(ours[i].get("seed") or 0))
                    for i in indices if (scene := scenes[i]) is not None]
            fake = [images[i] for i in indices]
            against = "the captions drawn by shapes.render"
        if len(real) < 2:
            raise ConfigError("--fid needs at least 2 images.")
        summary["fid"] = {**_fid_kid(feature, real, fake), "features": args.features,
                          "against": against}
    if args.clip:
        summary["clip_score"] = _clip_score(args.clip, [images[i] for i in indices],
                                            [str(ours[i].get("prompt", "")) for i in indices])
    return {"summary": summary, "images": rows}


def _clip_score(model_dir: str, images: list, prompts: list[str]) -> float:
    """CLIP score as torchmetrics defines it, averaged (``output.clip``)."""
    import torch

    from lightning_diffusion.output.clip import ClipScorer

    pixels = [(image.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy() for image in images]
    scores = ClipScorer(model_dir, "--clip").scores(pixels, prompts)
    return sum(scores) / len(scores)


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("inf")


def _finite(value: object) -> object:
    """Strict JSON: an infinite PSNR (identical images) is written as the string "inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def report(result: EvalResult, per_image: bool) -> str:
    summary, rows = result["summary"], result["images"]
    lines = [f"{summary['folder']}: {summary['images']} images"]
    has_ref = "reference" in summary
    has_adh = "adherence" in summary
    if per_image:
        head = ["Image"] + (["Max abs diff", "PSNR (dB)", "SSIM"] if has_ref else []) + \
               (["Detected", "Colours", "Shape"] if has_adh else []) + ["Prompt"]
        lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for row in rows:
            cells = [str(row["index"])]
            if has_ref:
                cells += ([f"{row['max_abs']:.3g}", f"{row['psnr']:.1f}", f"{row['ssim']:.4f}"] if "max_abs" in row
                          else ["", "", ""])
            if has_adh:
                if "adherence" in row:
                    d, a = row["detected"], row["adherence"]
                    shape = "-" if "shape" not in a else ("yes" if a["shape"] else "NO")  # two shapes: not judged
                    cells += [f"{d['colour']} {d['shape']} on {d['background']}", "yes" if a["colour"] else "NO", shape]
                else:
                    cells += ["", "", ""]
            cells.append(str(row["prompt"]))
            lines.append("| " + " | ".join(cells) + " |")
    if has_ref:
        r = summary["reference"]
        lines.append(f"against {r['folder']} ({r['compared']} images): max abs diff {r['max_abs']:.3g}, "
                     f"PSNR mean {r['psnr_mean']:.1f} dB (min {r['psnr_min']:.1f}), "
                     f"SSIM mean {r['ssim_mean']:.4f} (min {r['ssim_min']:.4f})")
    if has_adh:
        parts = [f"{key} {100 * v['share']:.1f}% of {v['images']}" for key, v in summary["adherence"].items()]
        lines.append("prompt adherence (shapes captions): " + ", ".join(parts))
    if "fid" in summary:
        f = summary["fid"]
        # KID's estimate is unbiased, so below 0 where the sets do not differ measurably: shown as 0
        below = (f"; KID's unbiased estimate, {f['kid']:.4f}, is below 0: no measurable difference"
                 if f["kid"] < 0 else "")
        lines.append(f"FID {f['fid']:.3f}, KID {max(f['kid'], 0.0):.4f} +- {f['kid_std']:.4f} ({f['fid_images']} "
                     f"images, {f['features']} features, against {f['against']}{below})")
        if "warning" in f:
            lines.append(f"warning: {f['warning']}")
    if "clip_score" in summary:
        lines.append(f"CLIP score {summary['clip_score']:.2f}")
    return "\n".join(lines)


@contextlib.contextmanager
def local_copies(args):
    """An object-store output (``s3://...``) or reference read as a folder: its recorded images'
    tar shards and manifest lines downloaded into a temporary folder for the run of ``eval``;
    the summary names the URL."""
    from lightning_diffusion.output.store import open_store

    with contextlib.ExitStack() as stack:
        urls = {}
        for key in ("output_dir", "reference"):
            location = getattr(args, key)
            if location is None:
                continue
            store = open_store(location)
            what = "output" if key == "output_dir" else "reference"
            folder = stack.enter_context(store.local_records(what))  # a folder itself, or a bucket's records
            if str(folder) != store.where:
                urls[str(folder)] = store.where
            setattr(args, key, str(folder))
        args.urls = urls
        yield


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-diffusion eval", description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir")
    parser.add_argument("--reference", help="an output folder made with the same prompts and seeds")
    parser.add_argument("--fid", action="store_true", help="FID and KID (against --reference, or drawn shapes)")
    parser.add_argument("--features",
                        help="FID/KID features: a pipeline folder or tiny:NAME whose VAE encodes, or 'inception' "
                             "(default for shapes captions: tiny:shapes)")
    parser.add_argument("--inception-weights", help="torch-fidelity's Inception weights file (--features inception)")
    parser.add_argument("--clip", help="a local CLIP model folder for the CLIP score")
    parser.add_argument("--per-image", action="store_true", help="print every image's row (--json always has them)")
    add_json_option(parser, "the result (every image's row included)")
    args = parser.parse_args(json_argv(argv))
    try:
        with local_copies(args):
            result = evaluate(args)
    except ConfigError as err:
        print(f"lightning-diffusion eval: error: {err}", file=sys.stderr)
        return 2
    emit(args.json, _finite(result), lambda: print(report(result, args.per_image or len(result["images"]) <= 20)),
         default=str, repeats_json=True)
    return 0
