"""``lightning-diffusion benchmark``: time a config the way the diffusers guide reports strategies.

    lightning-diffusion benchmark --config X.yaml [--warmup 1] [--batches 5] [--compare-diffusers] [predict flags]

Runs ``predict`` with the ``StepTimer`` callback over ``--warmup`` batches that are not timed and
then ``--batches`` batches that are (5 by default), on each replica: the prompt set's images are
repeated (``data.num_images_per_prompt``) until every replica has that many, and the run stops
there (``trainer.limit_predict_batches``). Each timed batch is one pipeline call of
``data.batch_size`` images, timed with CUDA events on CUDA (wall clock on CPU). Prints ``Strategy |
Batch | Batches timed | ms / batch step | Batch steps / s | Images / s | Peak memory (GB) | Shape |
Load (s)`` and the spread of the batch times, and writes the same as JSON: a batch step is one
denoising step of a whole batch (the batch's time over its steps, text encoding and decoding
included). Peak memory is the CUDA allocator's peak on CUDA and the peak resident set on CPU (rank
0). ``--compare-diffusers`` also times a bare diffusers loop over the same batches (prompts, seeds,
batch size, warm-up) in one process and reports our time over its time.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_diffusion.commands import add_json_option, help_text, json_argv
from lightning_diffusion.commands import report as emit
from lightning_diffusion.core.records import Params
from lightning_diffusion.input.data import PromptDataset
from lightning_diffusion.input.formats import read_data
from lightning_diffusion.input.images import record_inputs
from lightning_diffusion.module import DiffusionModule
from lightning_diffusion.output.boundaries import ImageSource, PromptSource
from lightning_diffusion.output.writer import ImageWriter, gather_idle
from lightning_diffusion.pipelines import bare
from lightning_diffusion.pipelines.model_folder import inspect_pipeline
from lightning_diffusion.run.config import read_config, report_config_error


class StepTimer(Callback):
    """Times predict batches after a warm-up and writes a JSON report from global rank 0."""

    def __init__(self, report: str, warmup: int = 1) -> None:
        self.report = report
        self.warmup = warmup
        self.times: list[float] = []
        self.images = 0
        self._start: Any = None  # the batch's start: a CUDA event, or perf_counter seconds on the CPU
        self.setup_at = self.load_s = self.warmup_s = 0.0
        self.cuda = False
        self.device_used_gb = self.allocated_gb = 0.0
        self.last_params: Params = {}  # the pipeline arguments of the last batch timed

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.setup_at = time.perf_counter()

    @staticmethod
    def devices(trainer: pl.Trainer) -> list[int]:
        """The GPUs rank 0 uses: all of a device map's, else its root device."""
        from lightning_diffusion.strategies.device_map import DeviceMapStrategy

        indices = trainer.strategy.gpu_indices() if isinstance(trainer.strategy, DeviceMapStrategy) else []
        return indices or [trainer.strategy.root_device.index or 0]

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.load_s = time.perf_counter() - self.setup_at
        self.cuda = trainer.strategy.root_device.type == "cuda"
        if self.cuda:
            indices = self.devices(trainer)
            for index in indices:
                torch.cuda.reset_peak_memory_stats(index)
            # What the device holds beyond tensors (CUDA context, NCCL communicators, the allocator's
            # cache): seen by mem_get_info, not by max_memory_allocated.
            info = [torch.cuda.mem_get_info(index) for index in indices]
            self.device_used_gb = sum(total - free for free, total in info) / 1024**3
            self.allocated_gb = sum(torch.cuda.memory_allocated(index) for index in indices) / 1024**3

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            elapsed = self._start.elapsed_time(end) / 1000
        else:
            elapsed = time.perf_counter() - self._start
        if batch_idx >= self.warmup:
            self.times.append(elapsed)
            self.images += len(batch)
        else:  # warm-up: a compiled model compiles here
            self.warmup_s += elapsed
        if outputs:
            self.last_params = outputs[0]["params"]

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # a collective: every rank, before rank 0 returns
        cache = pl_module.cache_summary() if isinstance(pl_module, DiffusionModule) else None
        busy = _gather_busy(trainer, pl_module)  # a collective too
        if not trainer.is_global_zero:
            return
        if self.cuda:  # summed over the GPUs of rank 0 (a device map spans several)
            peak = sum(torch.cuda.max_memory_allocated(index) for index in self.devices(trainer)) / 1024**3
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
        params = self.last_params
        # the call's steps, or the pipeline's own default where the config gives none (not recorded)
        default = pl_module.info.call_default("num_inference_steps") if isinstance(pl_module, DiffusionModule) else None
        steps = int(params.get("num_inference_steps") or default or 1)
        total = sum(self.times)
        per_step = total / max(1, len(self.times) * steps)
        shape = f"{params.get('height')}x{params.get('width')}"
        if params.get("num_frames"):
            shape += f"x{params['num_frames']}"
        replicas = (trainer.distributed_sampler_kwargs or {}).get("num_replicas", 1)
        images_per_sec = self.images * replicas / total if total else 0.0
        # every process holds a device (a device map's process, the GPUs it spans)
        devices = trainer.world_size * len(self.devices(trainer)) if self.cuda else trainer.world_size
        Path(self.report).write_text(json.dumps({
            "strategy": type(trainer.strategy).__name__,
            "world_size": trainer.world_size,
            "replicas": replicas,
            "batch_size": getattr(getattr(trainer, "datamodule", None), "batch_size", None),
            "steps": steps,
            "warmup_batches": self.warmup,
            "timed_batches": len(self.times),
            # one denoising step of a whole batch: the batch's time over its steps
            "ms_per_batch_step": per_step * 1000,
            "batch_steps_per_sec": 1 / per_step if per_step else 0.0,
            "batch_seconds": {"median": statistics.median(self.times), "min": min(self.times),
                              "max": max(self.times)} if self.times else None,
            "peak_memory_gb": peak,
            **({"device_used_gb_after_setup": self.device_used_gb, "allocated_gb_after_setup": self.allocated_gb}
               if self.cuda else {}),
            "shape": shape,
            # rank 0's batches, times the replicas that run alongside it
            "images_per_sec": images_per_sec,
            "devices": devices,
            "images_per_device_hour": images_per_sec * 3600.0 / devices,
            "load_s": self.load_s,
            "warmup_s": self.warmup_s,
            "device": "cuda" if self.cuda else "cpu",
            "cache": cache,
            **_plan_report(trainer, busy),
        }, indent=2))


def _gather_busy(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
    """Each writing rank's seconds in pipeline calls (one a replica), by global rank."""
    writes = isinstance(pl_module, ImageSource) and ImageWriter.writes_outputs(trainer)
    every = gather_idle(trainer.strategy, cast(ImageSource, pl_module).stats["busy_s"] if writes else None)
    return {str(rank): round(value, 4) for rank, value in enumerate(every) if value is not None}


def _plan_report(trainer: pl.Trainer, busy: dict[str, float]) -> dict[str, Any]:
    """The batch plan (``batching``): buckets, padded images and each replica's busy seconds."""
    data = getattr(trainer, "datamodule", None)  # Lightning sets it only for a run given a data module
    plan = data.plan if isinstance(data, PromptSource) else None
    if plan is None:
        return {}
    computed = plan.images + plan.padded
    return {"buckets": plan.num_buckets, "batches": len(plan), "padded_images": plan.padded,
            "padded_share": round(plan.padded / computed, 4) if computed else 0.0, "busy_s_by_rank": busy}


def diffusers_loop(model: str, dtype: str, records: list[dict], batch_size: int, call_args: dict,
                   seed: int, warmup: int, cache: Optional[dict] = None,
                   pipeline_class: Optional[str] = None, copies: int = 1,
                   batches: Optional[int] = None) -> dict[str, Any]:
    """A bare diffusers loop on the same prompts, seeds and batch size, timed like StepTimer: the
    first ``batches`` batches of the set (each record ``copies`` times; all of them by default), the
    first ``warmup`` of them untimed; with ``cache``, diffusers' own cache of that type (its
    batch-wide first-block decision included)."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    pipe = bare.load(model, dtype, device, pipeline_class)
    if cache:
        from lightning_diffusion.pipelines.cache import build_config

        has_cfg = inspect_pipeline(model, pipeline_class).spec.cfg is not None
        config = build_config(cache, pipe, call_args.get("num_inference_steps"), has_cfg)
        for component in pipe.components.values():
            if hasattr(component, "enable_cache"):
                component.enable_cache(config)
    dataset = PromptDataset(records, seed=seed, num_images_per_prompt=copies)
    call_args = dict(call_args)
    default_negative = call_args.pop("negative_prompt", None)  # the records' default, as in DiffusionModule
    times, images = [], 0
    firsts = range(0, len(dataset), batch_size)
    for number, first in enumerate(firsts if batches is None else firsts[:batches]):
        samples = [dataset[i] for i in range(first, min(first + batch_size, len(dataset)))]
        negatives = [s["negative_prompt"] if s["negative_prompt"] is not None else default_negative
                     for s in samples]
        # The same work as ours: negative prompts (the second CFG pass) where the records give them.
        extra = {"negative_prompt": [n or "" for n in negatives]} if any(n is not None for n in negatives) else {}
        start = time.perf_counter()
        bare.call(pipe, [s["prompt"] for s in samples], [s["seed"] for s in samples], output_type="np",
                  **call_args, **extra)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if number >= warmup:
            times.append(time.perf_counter() - start)
            images += len(samples)
    return {"seconds": sum(times), "images": images, "batches": len(times)}


def processes(trainer: Any) -> int:
    """The processes a config's trainer group starts (devices x nodes), at least the replicas it
    makes: ``auto`` and ``-1`` count this machine's GPUs (1 without one)."""
    devices = trainer.get("devices", "auto") if trainer is not None else "auto"
    if isinstance(devices, (list, tuple)):
        count = len(devices)
    elif isinstance(devices, int) and devices > 0:
        count = devices
    elif isinstance(devices, str) and devices.strip().isdigit() and int(devices) > 0:
        count = int(devices)
    elif isinstance(devices, str) and "," in devices:
        count = len([d for d in devices.split(",") if d.strip()])
    else:
        accelerator = str(trainer.get("accelerator", "auto") if trainer is not None else "auto")
        count = torch.cuda.device_count() if accelerator != "cpu" and torch.cuda.is_available() else 1
    nodes = trainer.get("num_nodes", 1) if trainer is not None else 1
    return max(1, count) * max(1, int(nodes or 1))


def repeats(images: int, batch_size: int, batches: int, processes: int) -> int:
    """How many times the set's images are repeated so that every replica (at most ``processes``)
    has ``batches`` batches of ``batch_size``."""
    return max(1, math.ceil(batches * batch_size * processes / max(1, images)))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-diffusion benchmark", description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--warmup", type=int, default=1, help="batches run before the timed ones, not timed "
                                                               "(default 1: a compiled model compiles there)")
    parser.add_argument("--batches", type=int, default=5,
                        help="batches timed on each replica after the warm-up (default 5); the prompt set is "
                             "repeated until there are that many")
    parser.add_argument("--compare-diffusers", action="store_true",
                        help="also time a bare diffusers loop over the same batches, in this process")
    add_json_option(parser, "the report")
    args, extra = parser.parse_known_args(json_argv(argv))
    if args.warmup < 0 or args.batches < 1:
        print("lightning-diffusion benchmark: error: --warmup must be 0 or more and --batches 1 or more.",
              file=sys.stderr)
        return 2
    run_batches = args.warmup + args.batches
    with tempfile.TemporaryDirectory(prefix="ld-bench-") as tmp:
        out = str(Path(tmp) / "out")  # the run writes here: the config's own folder is neither read nor checked
        try:
            cfg = read_config(args.config, [*extra, "--writer.output_dir", out])
        except ValueError as err:
            return report_config_error(err, "lightning-diffusion benchmark")
        prompt_set = read_data(cfg.data)
        if args.compare_diffusers and any(record_inputs(r) for _, r in prompt_set.accepted()):
            print("benchmark: --compare-diffusers does not feed the records' input images to its bare loop yet; "
                  "run without it.", file=sys.stderr)
            return 2
        data = cfg.data
        copies = int(data.num_images_per_prompt) * repeats(len(prompt_set) * int(data.num_images_per_prompt),
                                                           int(data.batch_size), run_batches, processes(cfg.trainer))
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "lightning_diffusion", "predict", "--config", args.config, *extra,
                   "--writer.output_dir", out, "--trainer.enable_progress_bar", "false",
                   "--data.num_images_per_prompt", str(copies), "--trainer.limit_predict_batches", str(run_batches),
                   "--trainer.callbacks+=lightning_diffusion.commands.benchmark.StepTimer",
                   f"--trainer.callbacks.report={report}", f"--trainer.callbacks.warmup={args.warmup}"]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"benchmark: the run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}", file=sys.stderr)
            return 2
        result = json.loads(report.read_text())
    result["copies_per_record"] = copies

    if args.compare_diffusers:
        model = cfg.model
        from lightning_diffusion.pipelines.model_folder import inspect_pipeline
        from lightning_diffusion.pipelines.settings import MODEL_CALL_ARGS

        named = {k: model.get(k) for k in MODEL_CALL_ARGS}
        base, more = inspect_pipeline(model.pretrained_model_name_or_path).effective_call_args(
            named, model.get("call_kwargs"))
        call_args = {**base, **more}  # what predict calls the pipeline with, the model's recommendations included
        records = [r for _, r in read_data(data).accepted()]
        bare = diffusers_loop(model.pretrained_model_name_or_path, model.torch_dtype, records, int(data.batch_size),
                              call_args, int(data.seed), args.warmup, model.get("cache"), model.get("pipeline_class"),
                              copies=copies, batches=run_batches)
        bare_ips = bare["images"] / bare["seconds"] if bare["seconds"] else 0.0
        result["diffusers_images_per_sec"] = bare_ips
        result["diffusers_timed_batches"] = bare["batches"]
        result["time_ratio_vs_diffusers"] = bare_ips / result["images_per_sec"] if result["images_per_sec"] else None

    def table() -> None:
        print("| Strategy | Batch | Batches timed | ms / batch step | Batch steps / s | Images / s "
              "| Images / device-hour | Peak memory (GB) | Shape | Load (s) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        print(f"| {result['strategy']} x{result['world_size']} | {result['batch_size']} | {result['timed_batches']} | "
              f"{result['ms_per_batch_step']:.1f} | {result['batch_steps_per_sec']:.2f} | "
              f"{result['images_per_sec']:.2f} | {result['images_per_device_hour']:,.0f} | "
              f"{result['peak_memory_gb']:.2f} | {result['shape']} | "
              f"{result['load_s']:.1f} |")
        spread = result.get("batch_seconds")
        if spread:
            print(f"batch time: median {spread['median']:.3f} s, {spread['min']:.3f} to {spread['max']:.3f} s over "
                  f"{result['timed_batches']} batches of {result['batch_size']} images x {result['steps']} steps, "
                  f"after {result['warmup_batches']} warm-up batch(es) (rank 0)")
        if result["timed_batches"] < args.batches:
            print(f"benchmark: only {result['timed_batches']} batch(es) timed of the {args.batches} asked for: rank 0 "
                  "had no more; the figures are less stable")
        if args.compare_diffusers:
            print(f"bare diffusers loop, the same {result['diffusers_timed_batches']} batches after the warm-up: "
                  f"{result['diffusers_images_per_sec']:.2f} images/s; "
                  f"ours takes {result['time_ratio_vs_diffusers']:.3f}x its time")

    emit(args.json, result, table)
    return 0
