"""Step caching (``model.cache``): diffusers' caching hooks, made safe under every strategy.

diffusers ships caches that reuse transformer work between denoising steps
(``transformer.enable_cache(config)``). This module checks a ``model.cache`` mapping before any
weight loads, builds the diffusers config from it, and installs it on every transformer of a
loaded pipeline. Two of diffusers' behaviours are changed where they would break our promises:

* **First-block cache** (``first_block``) decides from the first block's residual whether to run
  the remaining blocks. diffusers takes one decision for the whole batch, from the local tensor:
  an image depends on its batch neighbours, and under context or tensor parallelism (each rank
  holds a shard of the tokens) ranks can decide differently and one then waits in a collective the
  other never enters. ``FirstBlockCache`` here decides per image, from sums all-reduced over the
  *shard group* (the ranks that hold pieces of the same transformer call: ring x ulysses x tp of
  one replica and guidance branch), so every rank of the group takes the same decision and the
  decision is the one a single process takes. When the images of a batch disagree, the whole
  batch runs the remaining blocks and the images that chose to reuse take their cached result:
  the batch size never changes, and no image depends on its neighbours.
* **Pyramid attention broadcast** and **FasterCache** keep one state for the two guidance passes
  that FLUX, Qwen-Image and Wan run one after the other, so the negative pass would reuse the
  positive pass's attention; they are refused when a negative branch runs, and FasterCache always
  runs with ``is_guidance_distilled`` (our pipelines never batch the two branches).

TaylorSeer and MagCache decide from the step index alone (the same on every rank and for every
image) and are installed as diffusers builds them.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional, Union, cast

import torch

from lightning_diffusion.pipelines.specs import FIRST_BLOCK_TRANSFORMERS

if TYPE_CHECKING:
    from diffusers.hooks.faster_cache import FasterCacheConfig
    from diffusers.hooks.first_block_cache import FirstBlockCacheConfig
    from diffusers.hooks.mag_cache import MagCacheConfig
    from diffusers.hooks.pyramid_attention_broadcast import PyramidAttentionBroadcastConfig
    from diffusers.hooks.taylorseer_cache import TaylorSeerCacheConfig
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline
    from torch.distributed import ProcessGroup

    # The diffusers config classes of ``CACHE_TYPES``.
    CacheConfig = Union[FirstBlockCacheConfig, TaylorSeerCacheConfig, MagCacheConfig, PyramidAttentionBroadcastConfig,
                        FasterCacheConfig]


CACHE_TYPES = {
    "first_block": "FirstBlockCacheConfig",
    "taylorseer": "TaylorSeerCacheConfig",
    "magcache": "MagCacheConfig",
    "pyramid_attention_broadcast": "PyramidAttentionBroadcastConfig",
    "faster_cache": "FasterCacheConfig",
}
# Arguments we fill from the pipeline; a config must not set them.
_FILLED = {"current_timestep_callback", "num_inference_steps"}
# Python callables: not settable from a config (diffusers' defaults apply).
_CALLABLES = {"attention_weight_callback", "low_frequency_weight_callback", "high_frequency_weight_callback"}
# Transformers whose blocks the per-image first-block cache is verified on (tests/pipelines/test_cache.py, or a
# tiny run): text and image tokens stay separate through every block. FLUX.2 joins them before its
# single blocks, so a residual of the last block is not comparable with the first's.
_POSITIVE_INTS = ("cache_interval", "max_skip_steps", "spatial_attention_block_skip_range",
                  "temporal_attention_block_skip_range", "cross_attention_block_skip_range",
                  "unconditional_batch_skip_range", "disable_cache_before_step", "max_order")
_RANGES = ("spatial_attention_timestep_skip_range", "temporal_attention_timestep_skip_range",
           "cross_attention_timestep_skip_range", "low_frequency_weight_update_timestep_range",
           "high_frequency_weight_update_timestep_range", "unconditional_batch_timestep_skip_range")
# Caches with one state for both guidance passes (see the module docstring).
_SHARED_BRANCH_STATE = ("pyramid_attention_broadcast", "faster_cache")
_THRESHOLDS = {"first_block": "relative change of the first block's residual", "magcache": "accumulated error"}



def _config_class(kind: str) -> type:
    import diffusers

    return getattr(diffusers, CACHE_TYPES[kind])


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_timestep_range(value: object) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(_is_number(v) for v in value)


def _is_number_list(value: object) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(map(_is_number, value))


# One rule an option's value: (the test, the message; {name}, {value!r}, {kind} and {what} filled).
# Each applies wherever the option is set (a name the cache type does not take is reported apart).
_VALUE_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    **{name: (_is_positive_int, "model.cache.{name} must be an integer >= 1, got {value!r}.")
       for name in _POSITIVE_INTS},
    **{name: (_is_timestep_range, "model.cache.{name} must be two timesteps [low, high], got {value!r}.")
       for name in _RANGES},
    "mag_ratios": (_is_number_list, "model.cache.mag_ratios must be a list of numbers, got {value!r}."),
}
_THRESHOLD_RULE = (lambda v: _is_number(v) and 0 < v <= 1,
                   "model.cache.threshold ({what}) must be a number in (0, 1], got {value!r}; larger reuses more "
                   "steps (typical: 0.05 to 0.3).")


def check_cache(
    cache: object,
    transformers: Mapping[str, Optional[type]],
    class_name: str,
    negative_branch: bool,
    separate_passes: bool = True,
) -> list[str]:
    """Problems of a ``model.cache`` mapping, found without weights. ``transformers``: the
    pipeline's denoiser components and their classes; ``negative_branch``: whether a guidance pass
    on the negative prompt runs (some image has CFG on); ``separate_passes``: the pipeline runs its
    guidance passes one after the other (a registered ``PipelineSpec.cfg``)."""
    if cache is None:
        return []
    valid = ", ".join(CACHE_TYPES)
    if not isinstance(cache, Mapping) or "type" not in cache:
        return [f"model.cache must be a mapping with a type ({valid}), e.g. {{type: first_block, threshold: 0.08}}; "
                f"got {cache!r}."]
    kind = cache["type"]
    if kind not in CACHE_TYPES:
        close = difflib.get_close_matches(str(kind), list(CACHE_TYPES), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return [f"model.cache.type {kind!r} is not a cache type{hint}; valid: {valid}."]
    options = {k: v for k, v in cache.items() if k != "type"}
    problems = [*_name_problems(kind, options), *_value_problems(kind, options),
                *_pipeline_problems(kind, options, transformers, class_name, negative_branch, separate_passes)]
    if not problems:
        try:  # diffusers' own validation of the values, with a stand-in for the pipeline
            build_config(cache, _NoPipeline(), 28, separate_passes)
        except (TypeError, ValueError) as err:
            problems.append(f"model.cache: diffusers refuses this {kind} config: {err}")
    return problems


def _name_problems(kind: str, options: Mapping[str, Any]) -> list[str]:
    """Options the cache type does not take, or that a config cannot give."""
    fields = [f.name for f in dataclasses.fields(_config_class(kind)) if f.name not in _FILLED | _CALLABLES]
    problems = []
    for name in options:
        if name in _FILLED:
            problems.append(f"model.cache.{name} is set from the pipeline ({kind}); leave it out.")
        elif name in _CALLABLES:
            problems.append(f"model.cache.{name} is a Python callable, which a config cannot give; leave it out "
                            "(diffusers' default applies).")
        elif name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(f"model.cache: {kind} takes no {name!r}{hint}; it takes {', '.join(fields)}.")
    return problems


def _value_problems(kind: str, options: Mapping[str, Any]) -> list[str]:
    """Option values against ``_VALUE_RULES`` (and the threshold of the caches that have one)."""
    rules = dict(_VALUE_RULES, **({"threshold": _THRESHOLD_RULE} if kind in _THRESHOLDS else {}))
    # A threshold given is checked even when null (it has no "unset" meaning); other options' null is unset.
    problems = [message.format(name=name, value=options[name], kind=kind, what=_THRESHOLDS.get(kind))
                for name, (valid, message) in rules.items()
                if name in options and (options[name] is not None or name == "threshold")
                and not valid(options[name])]
    if options.get("taylor_factors_dtype") is not None:
        from lightning_diffusion.pipelines.model_folder import resolve_dtype

        try:
            resolve_dtype(options["taylor_factors_dtype"])
        except ValueError as err:  # its message lists the dtypes
            problems.append(f"model.cache.taylor_factors_dtype: {err}")
    if kind == "magcache" and options.get("mag_ratios") is None and not options.get("calibrate"):
        problems.append("model.cache: magcache needs mag_ratios, a list of per-step magnitude ratios of this "
                        "checkpoint (FLUX.1-dev's published list is diffusers.hooks.mag_cache.FLUX_MAG_RATIOS; "
                        "copy its numbers), or calibrate: true to print them.")
    return problems


def _pipeline_problems(kind: str, options: Mapping[str, Any], transformers: Mapping[str, Optional[type]],
                       class_name: str, negative_branch: bool, separate_passes: bool) -> list[str]:
    """What the pipeline's guidance passes and denoiser classes allow of this cache."""
    from diffusers.models.cache_utils import CacheMixin

    problems = []
    if kind == "faster_cache" and options.get("is_guidance_distilled") is False and separate_passes:
        problems.append("model.cache.is_guidance_distilled: false would split each batch into guidance halves; "
                        f"{class_name} runs its guidance passes one after the other, so leave it out.")
    if kind in _SHARED_BRANCH_STATE and negative_branch:
        problems.append(
            f"model.cache: {kind} keeps one state for both guidance passes, and {class_name} runs a negative pass "
            "here (true CFG with a negative prompt): the negative pass would reuse the positive one's attention. "
            "Use first_block, taylorseer or magcache with CFG."
        )
    if not transformers:
        problems.append(f"model.cache: {class_name} has no transformer component to cache.")
    for name, cls in transformers.items():
        if cls is not None and not issubclass(cls, CacheMixin):
            problems.append(f"model.cache: {class_name}'s {name} ({cls.__name__}) has no cache support in diffusers.")
        elif kind == "first_block" and cls is not None and cls.__name__ not in FIRST_BLOCK_TRANSFORMERS:
            problems.append(f"model.cache: first_block is verified on {', '.join(FIRST_BLOCK_TRANSFORMERS)}, not on "
                            f"{class_name}'s {cls.__name__}; use taylorseer or magcache for it.")
    return problems


class _NoPipeline:
    current_timestep = 500


def build_config(cache: Mapping[str, Any], pipeline: Union[DiffusionPipeline, _NoPipeline],
                 num_inference_steps: Optional[int], separate_passes: bool) -> CacheConfig:
    """The diffusers config of ``cache`` for a loaded ``pipeline`` (callbacks read its current
    timestep). ``separate_passes``: the pipeline runs its guidance passes one after the other (its
    ``PipelineSpec`` has ``cfg``), so FasterCache must not split batches into guidance halves."""
    kind = cache["type"]
    options = {k: v for k, v in cache.items() if k != "type"}
    for tuple_field in _RANGES:
        if isinstance(options.get(tuple_field), list):  # YAML has lists, diffusers wants tuples
            options[tuple_field] = tuple(options[tuple_field])
    if isinstance(options.get("taylor_factors_dtype"), str):
        from lightning_diffusion.pipelines.model_folder import resolve_dtype

        options["taylor_factors_dtype"] = resolve_dtype(options["taylor_factors_dtype"])
    if kind in ("pyramid_attention_broadcast", "faster_cache"):
        options["current_timestep_callback"] = lambda: pipeline.current_timestep
    if kind == "faster_cache" and separate_passes:
        options["is_guidance_distilled"] = True
    if kind == "magcache" and num_inference_steps:
        options["num_inference_steps"] = num_inference_steps
    return _config_class(kind)(**options)


class CacheStats:
    """What a cache reused on this process: image-steps (one image through the transformer once)
    and whole transformer calls whose remaining blocks were skipped."""

    def __init__(self) -> None:
        self.image_steps = 0
        self.reused_image_steps = 0
        self.calls = 0
        self.skipped_calls = 0

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.image_steps, self.reused_image_steps, self.calls, self.skipped_calls],
                            dtype=torch.float64)

    @staticmethod
    def describe(kind: str, totals: Sequence[float]) -> Optional[str]:
        image_steps, reused, calls, skipped = (int(v) for v in totals)
        if not image_steps:
            return None
        return (f"{kind.replace('_', '-')} cache: {100 * reused / image_steps:.0f}% of image steps reused "
                f"({reused} of {image_steps}); {skipped} of {calls} transformer calls skipped their remaining blocks")


class StepCache:
    """A cache installed on a pipeline's transformers. ``group``: the shard group whose ranks must
    agree (``None``: this process holds whole tensors). Only rank 0 of a group counts statistics,
    so that summing over all processes counts each image step once."""

    def __init__(self, kind: str, threshold: float) -> None:
        self.kind = kind
        self.threshold = threshold
        self.group: Optional[ProcessGroup] = None
        self.stats = CacheStats()
        self.counting = True
        # Every block runs and nothing is counted while set (an audit's plain call, ``plain``).
        self.bypass = False

    def set_group(self, group: Optional[ProcessGroup]) -> None:
        import torch.distributed as dist

        self.group = group
        self.counting = group is None or dist.get_rank(group) == 0

    def decide(self, residual: torch.Tensor, reference: torch.Tensor) -> list[bool]:
        """Per image: whether the remaining blocks must run (the residual moved by more than the threshold)."""
        if self.bypass:  # every rank of the group bypasses the same call: none waits in the reduction
            return [True] * residual.shape[0]
        sums = torch.stack([
            (residual - reference).abs().flatten(1).sum(1, dtype=torch.float32),
            reference.abs().flatten(1).sum(1, dtype=torch.float32),
        ])
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(sums, group=self.group)
        change = torch.where(sums[1] > 0, sums[0] / sums[1], torch.full_like(sums[0], float("inf")))
        return (~(change <= self.threshold)).tolist()  # NaN computes

    def count(self, compute: list[bool]) -> None:
        if self.counting and not self.bypass:
            reused = compute.count(False)
            self.stats.image_steps += len(compute)
            self.stats.reused_image_steps += reused
            self.stats.calls += 1
            self.stats.skipped_calls += reused == len(compute)


def install(cache: Mapping[str, Any], pipeline: DiffusionPipeline, num_inference_steps: Optional[int],
            separate_passes: bool = True) -> StepCache:
    """Install ``cache`` on every cache-capable transformer of ``pipeline``."""
    from diffusers.models.cache_utils import CacheMixin

    kind = cache["type"]
    threshold = cache.get("threshold")  # null (which the checks let pass, as for every option): the default
    step_cache = StepCache(kind, 0.05 if threshold is None else threshold)
    for component in pipeline.components.values():
        if not isinstance(component, CacheMixin):
            continue
        if kind == "first_block":
            from lightning_diffusion.pipelines.first_block_cache import install_first_block

            install_first_block(cast(torch.nn.Module, component), step_cache)  # a diffusers model
        else:
            component.enable_cache(build_config(cache, pipeline, num_inference_steps, separate_passes))
    return step_cache
