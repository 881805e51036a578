"""``DiffusionModule``: a diffusers pipeline as a LightningModule for ``Trainer.predict``."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional, Union, cast

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn

from lightning_diffusion.contract import DiffusionModel, LoadPlan, ModelRequest
from lightning_diffusion.core.console import log
from lightning_diffusion.core.errors import raise_problems
from lightning_diffusion.core.groups import documented_by
from lightning_diffusion.core.records import (
    INPUT_FIELDS,
    CallArgs,
    ImageResult,
    InputFiles,
    Record,
    RunSettings,
    Sample,
    SideOutput,
)
from lightning_diffusion.input.batching import call_key
from lightning_diffusion.input.costs import set_facts
from lightning_diffusion.input.data import PromptDataModule
from lightning_diffusion.input.records import Records
from lightning_diffusion.input.verdicts import JobRanks, RecordChecks
from lightning_diffusion.output.settings import image_settings, recorded_options
from lightning_diffusion.pipelines.adapters import AdapterSets, AdapterSwitch, choice_key, parse_named
from lightning_diffusion.pipelines.cache import CacheStats, StepCache
from lightning_diffusion.pipelines.checks import model_problems
from lightning_diffusion.pipelines.failures import CallRunner
from lightning_diffusion.pipelines.loading import NodeRanks, PipelineLoader, decoding_defaults
from lightning_diffusion.pipelines.model_folder import PipelineInfo, dtype_name, resolve_dtype
from lightning_diffusion.pipelines.plain import Accelerators, PlainWeights
from lightning_diffusion.pipelines.settings import ModelSettings
from lightning_diffusion.pipelines.side_outputs import SideCapture, side_output_problems

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from lightning_diffusion.strategies.group_work import GroupWork


@documented_by(ModelSettings)
class DiffusionModule(pl.LightningModule, DiffusionModel):
    """Runs a diffusers ``DiffusionPipeline`` on batches of prompt samples.

    Args: the options of ``ModelSettings``.

    ``predict_step`` returns one dict per image: ``index``, ``prompt``, ``seed``, ``image`` (float32
    array H x W x 3 in [0, 1], or F x H x W x 3 for a video) and ``params`` (the model, the
    arguments the pipeline's call received, no default it did not, and the output's size).
    Nothing here depends on the strategy: a strategy reads ``request()``, hands a ``LoadPlan`` to
    ``use_load_plan`` and its parallelised pipeline to ``use_pipeline`` (see ``contract``).

    The module holds three parts, each built from the settings it needs: ``loader``
    (``PipelineLoader``: how the pipeline loads), ``runner`` (``CallRunner``: a call's failures
    under ``data.on_error``; it owns ``pad_batches``) and ``checks`` (``RecordChecks``: the records
    the pipeline cannot make). The module owns the loaded ``pipeline`` (a strategy replaces it
    through ``use_pipeline``), its ``components``, ``step_cache`` and ``batch_size``.
    """

    def __init__(
        self,
        pretrained_model_name_or_path: str = ModelSettings.pretrained_model_name_or_path,
        torch_dtype: str = ModelSettings.torch_dtype,
        height: Optional[int] = ModelSettings.height,
        width: Optional[int] = ModelSettings.width,
        num_inference_steps: Optional[int] = ModelSettings.num_inference_steps,
        guidance_scale: Optional[float] = ModelSettings.guidance_scale,
        num_frames: Optional[int] = ModelSettings.num_frames,
        call_kwargs: Optional[dict[str, Any]] = ModelSettings.call_kwargs,
        from_pretrained_kwargs: Optional[dict[str, Any]] = ModelSettings.from_pretrained_kwargs,
        show_inner_progress: bool = ModelSettings.show_inner_progress,
        pad_batches: bool = ModelSettings.pad_batches,
        cache: Optional[dict[str, Any]] = ModelSettings.cache,
        vae_tiling: Optional[Union[bool, dict[str, int]]] = ModelSettings.vae_tiling,
        split_work: bool = ModelSettings.split_work,
        compile: Optional[str] = ModelSettings.compile,
        vae_slicing: bool = ModelSettings.vae_slicing,
        attention_backend: Optional[str] = ModelSettings.attention_backend,
        quantization: Optional[dict[str, Any]] = ModelSettings.quantization,
        pipeline_class: Optional[str] = ModelSettings.pipeline_class,
        lora: Optional[list[dict[str, Any]]] = ModelSettings.lora,
        adapters: Optional[dict[str, Any]] = ModelSettings.adapters,
        max_loaded_adapters: int = ModelSettings.max_loaded_adapters,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.settings = ModelSettings.among(self.hparams)
        named, options = self.settings.named_call_args(), self.settings.options()
        # Reads configs only: a bad path, a non-pipeline folder or an impossible size fails here,
        # in the launching process, before any worker starts or any weight is read. The size
        # budget (data.max_pixels) is the data module's: checked in ``setup``.
        info, problems = model_problems(self.settings, max_pixels=None)
        raise_problems(problems)
        assert info is not None
        self.info: PipelineInfo = info
        self.dtype_ = resolve_dtype(torch_dtype)
        self.base_call_args, self.call_kwargs = info.effective_call_args(named, call_kwargs)
        self.from_pretrained_kwargs = dict(from_pretrained_kwargs or {})
        self.show_inner_progress = show_inner_progress
        self.batch_size: Optional[int] = None  # the data module's, read in setup; else the largest seen
        # What predict_step calls: the loaded pipeline, or what the strategy made of it (``use_pipeline``).
        self.pipeline: Any = None
        self.cache = dict(cache) if cache is not None else None
        self.step_cache: Optional[StepCache] = None
        self.split_work = split_work
        self.group_work: Optional[GroupWork] = None
        self.failures = 0  # records whose call failed in this run (``on_error: skip``)
        # This process's work in the run: images computed (padding included) and kept, seconds in calls.
        self.stats = {"computed": 0, "kept": 0, "busy_s": 0.0}
        from lightning_diffusion.pipelines import lora as lora_

        self.adapters = lora_.parse(lora)
        # model.adapters: sets chosen per record, switched between batches (``use_adapters``)
        declared = parse_named(adapters)
        self.adapter_sets = AdapterSets(declared, self.adapters) if declared else None
        self.switch: Optional[AdapterSwitch] = None
        self.adapter_record: list[dict[str, Any]] = []  # the fused set, as each image's metadata says it
        if declared:
            lora_.keep_read(max_loaded_adapters)
        defaults, notes = decoding_defaults(info, options)  # a VAE that decodes only by tiles
        self.options = recorded_options({**options, **defaults})  # OPTIONS: in run.json and each image's metadata
        self.compiled = False
        self.plain_weights: Optional[PlainWeights] = None  # a quantized run's, for the audit (``remake_plain``)
        self.cache_totals: Optional[list[float]] = None  # summed over processes at the end of a run
        # How to load: set by the strategy (``use_load_plan``), whole pipeline on the CPU by default.
        self.load_plan = LoadPlan()
        # The pipeline's torch modules, registered so that Lightning's device moves reach them.
        self.components = nn.ModuleDict()
        self.loader = PipelineLoader(
            info, self.dtype_, dict(self.from_pretrained_kwargs), quantization=self.options["quantization"],
            adapters=() if self.adapter_sets else tuple(self.adapters), vae_tiling=self.options["vae_tiling"],
            vae_slicing=self.options["vae_slicing"], attention_backend=self.options["attention_backend"],
            compile=self.options["compile"], cache=self.cache,
            num_inference_steps=self.call_args.get("num_inference_steps"), show_inner_progress=show_inner_progress,
            notes=tuple(notes))
        self.runner = CallRunner(pad_batches, info.spec.call_batch)
        self.checks = RecordChecks(info, self.call_args, self.cache, declared)
        self.side_capture = SideCapture()  # what the writer saves beside each image (``save_side_outputs``)
        self._sides: dict[int, dict[str, SideOutput]] = {}  # by index, from ``generate`` to ``predict_step``

    @property
    def model_path(self) -> str:
        return self.hparams["pretrained_model_name_or_path"]

    def image_settings(self) -> RunSettings:
        """The settings that decide the pictures (a folder made with others is not resumed into)."""
        return image_settings(self.model_path, dtype_name(self.hparams["torch_dtype"]), self.call_args,
                              self.from_pretrained_kwargs, self.cache, self.options)

    @property
    def call_args(self) -> CallArgs:
        """The pipeline-call arguments of the config (before per-record overrides)."""
        return {**self.base_call_args, **self.call_kwargs}

    # ----------------------------------------------------------------- the contract with strategies

    def request(self, records: Optional[Sequence[Record]] = None) -> ModelRequest:
        """What a strategy may know before the weights load (see ``contract``): the records that
        ``data.on_bad_record: skip`` leaves out are not in their summary."""
        data = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if isinstance(records, Records) and isinstance(data, PromptDataModule) and data.records is records:
            self.checks.record_verdicts(data)
        return ModelRequest(self.info, self.dtype_, self.call_args, dict(self.from_pretrained_kwargs), records,
                            self.options["attention_backend"], self.options["quantization"],
                            (*self.adapters, *(self.adapter_sets.declared.values() if self.adapter_sets else ())))

    def save_side_outputs(self, latents: bool, text_embeddings: bool) -> None:
        """Capture each image's decoded latents and prompt embeddings in its result's ``sides``
        (the writer's ``save_latents``, ``save_text_embeddings``); refused, before the weights load,
        where the pipeline's classes have none (``side_outputs``)."""
        raise_problems(side_output_problems(self.info, latents, text_embeddings))
        self.side_capture = SideCapture(latents, text_embeddings)

    def use_load_plan(self, plan: LoadPlan) -> None:
        """Load with ``plan`` in ``configure_model`` (a strategy's components and options)."""
        self.load_plan = plan

    def use_pipeline(self, pipeline: Any) -> None:
        """Call ``pipeline`` from now on (a strategy's parallelised or wrapped pipeline)."""
        self.pipeline = pipeline

    @property
    def needs_shard_group(self) -> bool:
        """Whether decisions inside the transformer depend on the data (a first-block cache), so
        that the ranks sharing one transformer call must agree on them (``use_shard_group``)."""
        return self.cache is not None and self.cache.get("type") == "first_block"

    def use_shard_group(self, group: Optional[ProcessGroup]) -> None:
        """The process group of the ranks that hold pieces of the same transformer call (ring x
        ulysses x tp of one replica and guidance branch); the cache agrees its decisions over it."""
        if self.step_cache is not None:
            self.step_cache.set_group(group)

    def use_group(self, group: Optional[ProcessGroup]) -> None:
        """The process group of the ranks that make the same images (one replica's cfg x ring x
        ulysses x tp ranks; ``None``: one process per replica): they agree on each call's failures
        (``data.on_error: skip``, ``CallRunner.group``), and text encoding and VAE decoding are split
        over it (``group_work``) unless ``split_work`` is off."""
        self.runner.group = group
        if not self.split_work or self.pipeline is None or self.group_work is not None:
            return
        from lightning_diffusion.strategies import group_work

        self.group_work = group_work.install(self.pipeline, group)
        if self.group_work is not None and self.global_rank == 0:
            log.info(f"split over the group: {self.group_work.description}")

    # ----------------------------------------------------------------- Lightning hooks

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if isinstance(datamodule, PromptDataModule):
            self.batch_size = datamodule.call_size  # data.batch_size, or a smaller set's size
            self.runner.on_error = datamodule.settings.on_error
            self.failures, self.stats = 0, {"computed": 0, "kept": 0, "busy_s": 0.0}
            # cast: Lightning's Strategy does not declare the ranks every strategy has once started
            strategy = cast(JobRanks, self._trainer.strategy) if self._trainer is not None else None
            datamodule.reject(self.checks.agreed_verdicts(datamodule, strategy))
            facts = set_facts(self.info, self.call_args, datamodule.records, datamodule.rejected.rejected)
            # a pipeline called one record at a time (``call_batch`` 1) pads nothing: its plan counts no padding
            datamodule.use_batch_facts(*facts, pad=self.runner.pad_batches and self.info.spec.call_batch != 1)

    def configure_model(self) -> None:
        """Load the pipeline with the strategy's ``LoadPlan`` (once: a loaded module keeps its pipeline)."""
        if self.pipeline is not None:
            return
        # cast: Lightning's Strategy does not declare the ranks every strategy has once started
        strategy = cast(NodeRanks, self._trainer.strategy) if self._trainer is not None else None
        self.loader.fetch_weights(strategy, self.global_rank)
        self.load_pipeline(**self.loader.build_components(self.load_plan))

    def load_pipeline(self, **components: nn.Module) -> None:
        """Load the pipeline on the CPU (``PipelineLoader.load_pipeline``); ``components`` are
        pre-built components (a strategy may build the transformer itself, sharded) passed through
        to ``from_pretrained``. Its torch modules are registered in ``components``."""
        loaded = self.loader.load_pipeline(self.load_plan, components, self.global_rank)
        self.pipeline, self.step_cache = loaded.pipeline, loaded.step_cache
        self.loaded = loaded.pipeline  # what adapters are fused into, whatever wraps it (``use_pipeline``)
        for name, component in loaded.pipeline.components.items():
            if isinstance(component, nn.Module):
                self.components[name] = component

    def compile_denoisers(self) -> None:
        """``model.compile`` on each denoiser of the pipeline the strategy set up (after its
        context-parallel hooks, sharding and caches), once."""
        if not self.compiled and self.pipeline is not None:
            self.compiled = self.loader.compile_denoisers(self.pipeline, self.global_rank)

    def cache_summary(self) -> Optional[dict[str, Any]]:
        """What the step cache reused in this run, summed over every process (a collective: every
        rank calls it, at the end of a run; computed once, then remembered). ``None`` without a
        data-dependent cache, which has nothing to count."""
        if self.step_cache is None or self.step_cache.kind != "first_block" or self._trainer is None:
            return None
        if self.cache_totals is None:
            # Every process counted its own decisions (rank 0 of each shard group only); sum them
            # once every rank is done (an idle wait first: replicas finish at different times).
            strategy = self.trainer.strategy
            strategy.barrier("cache_stats")
            totals = strategy.reduce(self.step_cache.stats.as_tensor().to(strategy.root_device), reduce_op="sum")
            self.cache_totals = [float(v) for v in totals.cpu()]
            line = CacheStats.describe(self.step_cache.kind, self.cache_totals)
            if line and self.trainer.is_global_zero:
                log.info(line)
        image_steps, reused, calls, skipped = (int(v) for v in self.cache_totals)
        return {"type": self.step_cache.kind, "image_steps": image_steps, "reused_image_steps": reused,
                "calls": calls, "skipped_calls": skipped,
                "reused_fraction": round(reused / image_steps, 4) if image_steps else 0.0}

    def on_predict_start(self) -> None:
        self.compile_denoisers()
        if self.step_cache is not None:  # a second predict on the same module counts afresh
            self.step_cache.stats, self.cache_totals = CacheStats(), None

    def teardown(self, stage: str) -> None:
        if stage == "predict":
            self.cache_summary()
            if self.switch is not None and self.switch.switches and self.global_rank == 0:
                log.info(self.switch.summary())
            if self.group_work is not None and self.global_rank == 0:
                log.info(self.group_work.summary())

    def accelerators(self) -> Accelerators:
        """The accelerators this run has on, all of which an audit turns off (``plain``); raises where
        it cannot (``plain.quantization_problems``): before the weights load, the writer asks."""
        from lightning_diffusion.pipelines.plain import quantization_problems

        raise_problems(quantization_problems(self.options["quantization"], self.adapters))
        strategy = self._trainer.strategy if self._trainer is not None else None
        backend = getattr(strategy, "attention_backend", None)
        return Accelerators.of(self.cache, self.options, dtype_name(self.hparams["torch_dtype"]),
                               backend if isinstance(backend, str) else None, torch.get_float32_matmul_precision(),
                               os.environ.get("DIFFUSERS_ATTN_BACKEND"))

    def remake_plain(self, samples: Sequence[Sample]) -> list[ImageResult]:
        """``predict_step`` on ``samples`` with every accelerator off (``plain``): the same seeds,
        padding and devices, so the images differ from the run's by the accelerators alone. Every
        rank of the group calls it for the same samples; the run's counts are untouched. A quantized
        run's full-precision weights load on the first call (on the CPU, kept for the next)."""
        from lightning_diffusion.pipelines import quantization
        from lightning_diffusion.pipelines.plain import accelerators_off

        spec = self.options["quantization"]
        if spec and self.plain_weights is None:
            names = quantization.quantized(spec, tuple(self.info.denoisers()))
            self.plain_weights = PlainWeights.load(self.info, self.dtype_, names, self.from_pretrained_kwargs)
        denoisers = self.loader.denoiser_modules(self.pipeline)
        saved = dict(self.stats), self.failures
        try:
            with accelerators_off(self.pipeline, self.step_cache, denoisers, self.plain_weights,
                                  dict(self.components.items())):
                return self.predict_step(list(samples))
        finally:
            self.stats, self.failures = saved

    def negative_prompt(self, sample: Sample) -> Optional[str]:
        """The record's own negative prompt, else ``call_kwargs.negative_prompt`` (the default)."""
        own = sample.get("negative_prompt")
        return own if own is not None else self.call_args.get("negative_prompt")

    def call_arguments(self, sample: Sample) -> CallArgs:
        return {**self.call_args, **sample["overrides"]}

    def predict_step(self, batch: list[Sample], batch_idx: int = 0, dataloader_idx: int = 0) -> list[ImageResult]:
        # Samples with different per-record overrides cannot share one pipeline call (with buckets,
        # the data module's batches hold one kind each: see ``batching``).
        groups: dict[str, list[Sample]] = {}
        spec = self.info.spec
        for sample in batch:
            sizes = None
            if sample.get("inputs"):  # a call takes its inputs at one size (``costs.set_facts``)
                from lightning_diffusion.input.images import input_sizes

                sizes = input_sizes(sample["inputs"])
            key = call_key(self.call_arguments(sample), sorted(sample.get("inputs") or {}), sizes,
                           choice_key(sample.get("adapters")))
            groups.setdefault(key, []).append(sample)
        self.batch_size = max(self.batch_size or 0, len(batch))
        calls = [samples[i:i + (spec.call_batch or len(samples))] for samples in groups.values()
                 for i in range(0, len(samples), spec.call_batch or len(samples))]
        results = {}
        start = time.perf_counter()
        for samples in calls:
            self.use_adapters(samples[0])
            outcomes = self.runner.run_call(samples, self.generate, self.batch_size, self.global_rank)
            for sample, (image, params, error) in zip(samples, outcomes):
                result: ImageResult = {
                    "index": sample["index"],
                    "prompt": sample["prompt"],
                    "seed": sample["seed"],
                    "negative_prompt": self.negative_prompt(sample),
                }
                if "columns" in sample:  # data.keep_columns
                    result["columns"] = sample["columns"]
                if error is None:
                    assert image is not None and params is not None  # a call that did not fail made both
                    result["image"], result["params"] = image, params
                    if sample["index"] in self._sides:
                        result["sides"] = self._sides[sample["index"]]
                else:  # on_error: skip; the writer lists it in failed.jsonl
                    result["error"], result["record"] = error, sample.get("source")
                    self.failures += 1
                results[sample["index"]] = result
        self.stats["busy_s"] += time.perf_counter() - start
        self._sides = {}
        return [results[sample["index"]] for sample in batch]

    def use_adapters(self, sample: Sample) -> None:
        """Fuse the adapter set ``sample`` chooses (``model.adapters``), unless it is fused already."""
        if self.adapter_sets is None:
            return
        if self.switch is None:
            from lightning_diffusion.pipelines import lora

            fuse = self.load_plan.fuse_adapters
            self.switch = AdapterSwitch(self.loaded, fuse or lora.fuse, on_cpu=fuse is None)
        adapters = self.adapter_sets.resolve(sample.get("adapters"))
        if self.switch.use(adapters):
            log.debug(f"adapters: {', '.join(name for name, _ in adapters) or 'none'} fused")
        self.adapter_record = self.adapter_sets.record(adapters)

    def generate(self, samples: list[Sample], agree: bool = False
                 ) -> tuple[list[np.ndarray], list[CallArgs]]:
        """One pipeline call for samples that share their arguments; noise from one CPU generator each.
        With ``pad_batches`` the call is padded to the batch size and the padding's outputs dropped.
        ``agree``: the replica's ranks agree on its preparation and on the call (``CallRunner.step``)."""
        samples, kwargs, given = self.runner.step(agree, self.device, lambda: self.prepare_call(samples))
        real = len([s for s in samples if not s.get("padding")])
        self.stats["computed"] += len(samples)
        self.stats["kept"] += real
        generators = [torch.Generator("cpu").manual_seed(sample["seed"]) for sample in samples]
        items: CallArgs = {"prompt": [sample["prompt"] for sample in samples], "generator": generators}
        # A call that takes one prompt or generator (``facts.single_items``) is made one record at a time.
        single = self.info.facts.single_items
        items = {name: values[0] if name in single else values for name, values in items.items()}
        if "prompt" in single and isinstance(kwargs.get("negative_prompt"), list):
            kwargs = {**kwargs, "negative_prompt": kwargs["negative_prompt"][0]}
        if self.side_capture:
            def call() -> Any:
                with self.side_capture.during(self.pipeline) as captured:
                    output = self.pipeline(**items, output_type="np", **kwargs)
                sides = self.side_capture.per_image(captured, self.pipeline, len(samples), real)
                self._sides.update({sample["index"]: side for sample, side in zip(samples, sides)})
                return output
        else:
            def call() -> Any:
                return self.pipeline(**items, output_type="np", **kwargs)
        output = self.runner.step(agree, self.device, call)
        images = np.asarray(getattr(output, self.info.spec.output or "images"), dtype=np.float32)
        # What the call received, and nothing it did not (the pipeline's own defaults are not the
        # run's arguments: FluxPipeline's guidance_scale=3.5 reaches no transformer without guidance
        # embeddings); the size is the output's, the negative prompt and inputs are said beside.
        recorded = {k: v for k, v in kwargs.items() if k not in ("height", "width", "negative_prompt", *INPUT_FIELDS)}
        options = {k: v for k, v in self.options.items() if v not in (None, False) and k != "adapters"}
        if self.adapter_sets is not None:  # the image's own set, not every adapter the run declares
            options = {k: v for k, v in options.items() if k != "lora"}
            options["adapters"] = self.adapter_record
        params = {"model": self.model_path, **recorded, **options}
        sizes = [{"height": int(image.shape[-3]), "width": int(image.shape[-2])} for image in images]
        if images.ndim == 5:  # videos: (batch, frames, height, width, 3)
            sizes = [{**size, "num_frames": int(video.shape[0])} for size, video in zip(sizes, images)]
        return list(images)[:real], [{**params, **size, **({"inputs": files} if files else {})}
                                     for size, files in zip(sizes, given)][:real]

    def prepare_call(self, samples: list[Sample]) -> tuple[list[Sample], CallArgs, list[InputFiles]]:
        """The samples of one call (padded to the batch size with copies of the last, marked
        ``padding``), its keyword arguments (input images read) and what each sample's metadata
        records of its inputs."""
        size = min(self.batch_size or 0, self.info.spec.call_batch or self.batch_size or 0)
        if self.runner.pad_batches and len(samples) < size:
            samples = samples + [{**samples[-1], "padding": True}] * (size - len(samples))
        kwargs = self.call_arguments(samples[0])
        kwargs.pop("negative_prompt", None)
        negatives = [self.negative_prompt(sample) for sample in samples]
        if any(n is not None for n in negatives):
            kwargs["negative_prompt"] = [n or "" for n in negatives]
        given: list[InputFiles] = [{} for _ in samples]
        if samples[0].get("inputs"):
            from lightning_diffusion.input import images as inputs

            images, given = inputs.load(samples)
            if self.info.spec.call_batch == 1:  # one prompt a call: its input itself, not a list of one
                images = {name: values[0] for name, values in images.items()}
            kwargs.update(images)
        return samples, kwargs, given
