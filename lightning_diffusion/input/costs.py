"""What each image of a prompt set costs, and which images may share a pipeline call: the
pipeline's view of the records that ``batching`` cuts batches by and deals over replicas.

An image's cost is its latent tokens x denoising steps x guidance passes; images share a call when
every call argument is the same (``batching.call_key``) and their input images have one size (a
pipeline's image processor takes a batch's inputs at one size, often the first one's: a picture
would depend on its batch neighbours).
"""

from __future__ import annotations

from collections.abc import Container
from typing import TYPE_CHECKING, Optional

from lightning_diffusion.core.records import CallArgs
from lightning_diffusion.input.batching import SetFacts, call_key
from lightning_diffusion.input.images import record_inputs
from lightning_diffusion.pipelines.adapters import choice_key

if TYPE_CHECKING:
    from lightning_diffusion.input.records import Records
    from lightning_diffusion.pipelines.model_folder import PipelineInfo


def image_cost(info: PipelineInfo, args: CallArgs, negative: bool) -> float:
    """One image's estimated work under ``info`` (``PipelineInfo``) with call arguments ``args``;
    ``negative``: its record has a negative prompt."""
    spec = info.spec
    default = spec.default_size or (1024, 1024)
    height, width = args.get("height") or default[0], args.get("width") or default[1]
    frames = args.get(spec.frames_arg) if spec.frames_arg else None
    tokens = spec.image_tokens(int(height), int(width), frames, info.size_multiple) or 1
    steps = args.get("num_inference_steps") or info.call_default("num_inference_steps") or 1
    passes = 1
    if spec.cfg is not None:
        scale = args.get(spec.cfg.scale_arg, info.call_default(spec.cfg.scale_arg))
        passes = 2 if spec.cfg.runs(scale, negative or args.get("negative_prompt") is not None) else 1
    return float(tokens * steps * passes)


def set_facts(info: PipelineInfo, call_args: CallArgs, records: Records,
              rejected: Container[int] = ()) -> tuple[SetFacts, Optional[dict[int, int]]]:
    """For each call-argument set of ``records`` (``Records``): the key its images are batched by
    and an image's cost; where records have input images, the bucket of each such record, by its
    inputs' sizes too (by position; ``rejected`` positions left out)."""
    summary = records.summary
    keys: dict[str, int] = {}
    buckets, costs = [], []
    for entry in summary.sets:
        args = {**call_args, **entry.overrides}
        buckets.append(keys.setdefault(call_key(args, sorted(entry.with_inputs), adapters=choice_key(entry.adapters)),
                                       len(keys)))
        costs.append(image_cost(info, args, entry.first_negative is not None))
    by_position: Optional[dict[int, int]] = None
    if any(entry.with_inputs for entry in summary.sets):
        from lightning_diffusion.input.images import input_sizes

        by_position = {}
        sets = [i for i, entry in enumerate(summary.sets) if entry.with_inputs]
        for position in summary.positions(sets):
            if position in rejected:
                continue
            entry = summary.sets[summary.set_of[position]]
            key = call_key({**call_args, **entry.overrides}, sorted(entry.with_inputs),
                           input_sizes(record_inputs(records[position])), choice_key(entry.adapters))
            by_position[position] = keys.setdefault(key, len(keys))
    return SetFacts(buckets, costs, list(keys)), by_position
