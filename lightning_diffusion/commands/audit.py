"""``lightning-diffusion audit``: the shadow audit after the fact, on an output folder.

    lightning-diffusion audit OUT [--sample 8] [--batch-size B] [--min-psnr 30] [--json [FILE.json]]
                              [any predict flag, such as --trainer.accelerator gpu]

Takes the ``--sample`` recorded images that an in-run audit (``writer.audit``) picks first (the
lowest hashes of their indices: every fraction that sampled at least that many picked these),
makes them again on one device with the model settings run.json records but the step cache,
compile, the attention backend and quantization off, the same seeds and the run's batch size
(recorded by an in-run audit; else ``--batch-size``, default 1), and compares them with the
recorded files: PSNR, SSIM and the largest difference in 8-bit levels, as ``audit.jsonl`` has
them. Reads the folder and writes nothing there. Exit code 0, 3 when the median PSNR is under
``--min-psnr`` (the drift code of ``writer.audit.on_drift: stop``), 2 for bad input.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TypedDict

from lightning_diffusion.commands import add_json_option, help_text, json_argv, report
from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.core.records import CallArgs, JsonObject, ManifestLine, Record, RunSettings

IMAGE_SUFFIXES = (".png", ".webp", ".jpg", ".jpeg")
# run.json's model options a plain re-make leaves out (``pipelines.plain.TURNED_OFF``).
LEFT_OUT = ("cache", "compile", "attention_backend", "quantization")

if TYPE_CHECKING:
    from lightning_diffusion.output.audit import AuditLine


class FolderAudit(TypedDict, total=False):
    """An audit after the fact (``--json`` prints it): the folder, the batch size its images were
    re-made at (and whether run.json recorded it), the options left out, each image's comparison
    (``images``), their median PSNR and whether it falls under ``--min-psnr`` (``drift``)."""

    output_dir: str
    batch_size: int
    batch_size_recorded: bool
    left_out: list[str]
    images: list[AuditLine]
    median_psnr: float
    drift: bool


def run_settings(folder: Path) -> JsonObject:
    """run.json's settings, refused in one line where there is none a predict run of this version wrote."""
    path = folder / "run.json"
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder (audit reads an output folder of lightning-diffusion predict).")
    if not path.is_file():
        raise ConfigError(f"{folder} has no run.json: audit reads the settings a lightning-diffusion predict run "
                          "recorded there.")
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} cannot be read ({type(err).__name__}: {err}).") from None
    if not isinstance(settings, dict) or not {"model", "torch_dtype"} <= set(settings):
        raise ConfigError(f"{path} names no model and dtype: it was written by another version, or by another tool.")
    return settings


def model_flags(settings: RunSettings) -> list[str]:
    """``predict`` flags for the model run.json records, with the accelerators an audit turns off
    left out."""
    from lightning_diffusion.pipelines.settings import ModelSettings

    named = {f.name for f in fields(ModelSettings)}
    flags = ["--model.pretrained_model_name_or_path", str(settings["model"]), "--model.torch_dtype",
             str(settings["torch_dtype"])]
    call_kwargs: CallArgs = {}
    from_pretrained = {key.split(".", 1)[1]: value for key, value in settings.items()
                       if key.startswith("from_pretrained.")}
    for key, value in settings.items():
        if not key.startswith("model."):
            continue
        name = key.split(".", 1)[1]
        if name in LEFT_OUT:
            continue
        if name in ("lora", "adapters"):
            raise ConfigError("this run fused LoRA adapters, which run.json records by name and hash only: audit "
                              "after the fact does not load them; use writer.audit in the run.")
        if name in named:
            flags += [f"--model.{name}", value if isinstance(value, str) else json.dumps(value)]
        else:
            call_kwargs[name] = value
    if call_kwargs:
        flags += ["--model.call_kwargs", json.dumps(call_kwargs)]
    if from_pretrained:
        flags += ["--model.from_pretrained_kwargs", json.dumps(from_pretrained)]
    return flags


def batch_size_of(settings: JsonObject) -> Optional[int]:
    """The batch size the latest in-run audit recorded in run.json's history (None: none did)."""
    for summary in reversed(settings.get("history") or []):
        audit = summary.get("audit") if isinstance(summary, dict) else None
        if isinstance(audit, dict) and isinstance(audit.get("batch_size"), int):
            return audit["batch_size"]
    return None


def records_of(entries: Mapping[int, Mapping[str, Any]], chosen: list[int], settings: RunSettings) -> list[Record]:
    """Prompt records that make the ``chosen`` images again: prompt, seed, negative prompt, and the
    sizes and steps where an image's own differ from the run's."""
    from lightning_diffusion.pipelines.settings import MODEL_CALL_ARGS

    records = []
    for index in chosen:
        entry = entries[index]
        if entry.get("inputs"):
            raise ConfigError(f"image {index} was made from input images: audit after the fact re-makes text-to-image "
                              "outputs only; use writer.audit in the run.")
        if Path(str(entry.get("member") or entry["file"])).suffix.lower() not in IMAGE_SUFFIXES:
            raise ConfigError(f"image {index} ({entry['file']}) is a video: audit after the fact compares images only.")
        record: Record = {"prompt": entry["prompt"], "seed": entry["seed"]}
        if entry.get("negative_prompt") is not None:
            record["negative_prompt"] = entry["negative_prompt"]
        for name in MODEL_CALL_ARGS:
            if name in entry and entry[name] != settings.get(f"model.{name}"):
                record[name] = entry[name]
        records.append(record)
    return records


def read_rgb(folder: Path, entry: ManifestLine) -> Any:
    import numpy as np
    from PIL import Image

    from lightning_diffusion.output.recorded import read_output

    try:
        with Image.open(io.BytesIO(read_output(folder, entry))) as image:
            return np.asarray(image.convert("RGB"))
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"{folder / str(entry['file'])} (image {entry['index']}) is not a readable image: "
                          f"{type(err).__name__}: {err}") from None


def audit_folder(folder: Path, sample: int, batch_size: Optional[int], extra: list[str]) -> FolderAudit:
    """The after-the-fact audit of ``folder``: its lines and how they were made."""
    from lightning_diffusion.output.audit import compare_8bit, lowest
    from lightning_diffusion.output.recorded import scan_manifest

    settings = run_settings(folder)
    entries, _ = scan_manifest(folder)
    if not entries:
        raise ConfigError(f"{folder} records no finished image.")
    chosen = lowest(list(entries), sample)
    records = records_of(entries, chosen, settings)
    flags = model_flags(settings)
    recorded_size = batch_size_of(settings)
    size = batch_size or recorded_size or 1
    with tempfile.TemporaryDirectory(prefix="ld-audit-") as tmp:
        prompts = Path(tmp) / "records.jsonl"
        prompts.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        plain = Path(tmp) / "plain"
        command = [sys.executable, "-m", "lightning_diffusion", "predict", *flags, "--data.prompts", str(prompts),
                   "--data.batch_size", str(size), "--data.num_images_per_prompt", "1", "--trainer.devices", "1",
                   "--trainer.num_nodes", "1", "--trainer.strategy", "data_parallel", "--writer.output_dir",
                   str(plain), "--trainer.enable_progress_bar", "false", *extra]
        # diffusers' process-wide attention backend is an accelerator too: the re-make runs its default
        env = {k: v for k, v in os.environ.items() if k != "DIFFUSERS_ATTN_BACKEND"}
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise ConfigError(f"the plain run failed (exit {proc.returncode}): "
                              f"{(proc.stderr.strip().splitlines() or [''])[-1]}")
        made, _ = scan_manifest(plain)
        lines: list[AuditLine] = [{"index": index, "seed": entries[index]["seed"],
                  **compare_8bit(read_rgb(folder, entries[index]), read_rgb(plain, made[position]))}
                 for position, index in enumerate(chosen)]
    return {"output_dir": str(folder), "batch_size": size, "batch_size_recorded": recorded_size is not None,
            "left_out": [f"model.{name}" for name in LEFT_OUT if f"model.{name}" in settings], "images": lines}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-diffusion audit", description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir")
    parser.add_argument("--sample", type=int, default=8, help="how many recorded images to re-make (default 8)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="the run's data.batch_size (default: what an in-run audit recorded, else 1)")
    parser.add_argument("--min-psnr", type=float, default=30.0, help="the bound on the median PSNR in dB (default 30)")
    add_json_option(parser, "the audit")
    args, extra = parser.parse_known_args(json_argv(argv))
    if args.sample < 1:
        parser.error("--sample must be at least 1")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error("--batch-size must be at least 1")
    from lightning_diffusion.output.store import store_class

    if not store_class(args.output_dir).is_folder:
        print(f"lightning-diffusion audit: error: {args.output_dir} is in an object store; audit after the fact reads "
              "a folder (download the records, or use writer.audit in the run).", file=sys.stderr)
        return 2
    try:
        result = audit_folder(Path(args.output_dir).expanduser(), args.sample, args.batch_size, extra)
    except ConfigError as err:
        print(f"lightning-diffusion audit: error: {err}", file=sys.stderr)
        return 2
    psnrs = [line["psnr"] for line in result["images"]]
    result["median_psnr"] = statistics.median(psnrs)
    result["drift"] = result["median_psnr"] < args.min_psnr

    def table() -> None:
        off = ", ".join(result["left_out"]) or "nothing (a determinism check)"
        size = f"batch size {result['batch_size']}" + ("" if result["batch_size_recorded"] or args.batch_size
                                                        else " (the run's is not recorded: --batch-size)")
        print(f"audit {result['output_dir']}: {len(psnrs)} images re-made with {off} off, {size}")
        print("| Image | PSNR (dB) | SSIM | Max diff (levels) |")
        print("| --- | --- | --- | --- |")
        for line in result["images"]:
            print(f"| {line['index']} | {line['psnr']:.1f} | {line['ssim']:.4f} | {line['max_diff']} |")
        verdict = "under" if result["drift"] else "at or above"
        print(f"median PSNR {result['median_psnr']:.1f} dB, {verdict} the bound of {args.min_psnr:g} dB")

    report(args.json, result, table)
    from lightning_diffusion.core.preemption import DRIFT_EXIT_CODE

    return DRIFT_EXIT_CODE if result["drift"] else 0
