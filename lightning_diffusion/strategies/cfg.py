"""CFG parallel: the conditional and unconditional transformer passes of classifier-free guidance
on the two ranks of a ``cfg`` pair, at the same time.

Pipelines with true CFG (Qwen-Image, FLUX.1 with ``true_cfg_scale``, Wan) encode the positive and
the negative prompt before the denoising loop, then call the transformer twice per step: first
with the positive embeddings ("cond"), then with the negative ones ("uncond"). Both ranks of a
pair run the same pipeline loop with the same seeds. ``CFGSplit`` records what ``encode_prompt``
returned; at the "cond" call, rank 0 of the pair runs the cond pass and rank 1 the uncond pass
(its kwargs swapped for the recorded negative ones), the two predictions are exchanged with one
all-gather, the "cond" call returns the cond prediction and the "uncond" call that follows returns
the uncond one without computing. Both ranks then combine and step the scheduler on identical
numbers, so their latents stay identical and equal to the one-process run.

Which transformer arguments hold the prompt, per pipeline, is its ``PipelineSpec.cfg``; a pipeline
without one, or a config without a negative branch, is refused before loading.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_diffusion.data import summarize_records
from lightning_diffusion.errors import ConfigError
from lightning_diffusion.specs import CFGBranches, spec_for, with_cfg


def supported() -> str:
    return ", ".join(f"{name} ({spec.cfg.scale_arg} > 1)" for name, spec in with_cfg().items())


def check_cfg(
    class_name: str, call_args: dict[str, Any], default: Callable[[str], Any], records: Any
) -> None:
    """A cfg pair would only run the same work twice unless the pipeline has a table entry and the
    config turns its negative branch on; refuse instead. ``default(name)``: the pipeline's default
    for a call argument (``PipelineInfo.call_default``: ``true_cfg_scale`` is 4.0 for Qwen-Image,
    1.0 for FLUX)."""
    entry = spec_for(class_name).cfg
    if entry is None:
        raise ConfigError(
            f"cfg=2 needs a pipeline whose two guidance passes this project knows how to split; {class_name} is "
            f"not one. Supported: {supported()}. Use cfg=1 (data_parallel) for it."
        )
    scale = call_args.get(entry.scale_arg, default(entry.scale_arg))
    if not isinstance(scale, (int, float)) or scale <= 1:
        where = "model.guidance_scale" if entry.scale_arg == "guidance_scale" else f"model.call_kwargs.{entry.scale_arg}"
        raise ConfigError(
            f"cfg=2 splits classifier-free guidance, but {class_name} runs it only with {entry.scale_arg} > 1 "
            f"(got {scale!r}): set {where} above 1, or use cfg=1."
        )
    if entry.needs_negative_prompt and records is not None:
        summary = summarize_records(records)
        if summary.without_negative:
            shown = summary.first_without_negative
            lines = ", ".join(map(str, shown)) + (" ..." if summary.without_negative > len(shown) else "")
            raise ConfigError(
                f"cfg=2 needs a negative prompt for every image: {class_name} skips the unconditional pass without "
                f"one, and {summary.without_negative} of {summary.count} records have none (records {lines}). Give "
                'each record a "negative_prompt" (a .jsonl field or .csv column), or use cfg=1.'
            )


class CFGSplit:
    """Installed on a loaded pipeline on each rank of a cfg pair (see the module docstring)."""

    def __init__(self, pipeline: Any, entry: CFGBranches, group: Any, branch: int) -> None:
        self.entry = entry
        self.group = group
        self.branch = branch  # 0: this rank computes cond, 1: uncond
        self.encoded: list[Any] = []
        self.denoising = False
        self.pending: Optional[Any] = None
        self.split_calls = 0
        self.plain_calls = 0
        original_encode = pipeline.encode_prompt

        def encode_prompt(*args: Any, **kwargs: Any) -> Any:
            if self.denoising:  # a new pipeline call
                self.encoded, self.denoising, self.pending = [], False, None
            outputs = original_encode(*args, **kwargs)
            self.encoded.append(outputs)
            return outputs

        pipeline.encode_prompt = encode_prompt
        for name in entry.transformers:
            model = getattr(pipeline, name, None)
            if isinstance(model, torch.nn.Module):
                model.forward = self._wrap(model.forward)

    def branches(self) -> Optional[tuple[tuple, tuple]]:
        """The (cond, uncond) values of ``entry.kwargs`` recorded for the current pipeline call."""
        if self.entry.one_call:
            if len(self.encoded) != 1 or self.encoded[0][1] is None:
                return None
            return (self.encoded[0][0],), (self.encoded[0][1],)
        if len(self.encoded) != 2:
            return None
        return tuple(self.encoded[0]), tuple(self.encoded[1])

    def _wrap(self, forward: Callable) -> Callable:
        def split_forward(*args: Any, **kwargs: Any) -> Any:
            self.denoising = True
            return self.forward(forward, args, kwargs)

        return split_forward

    def forward(self, inner: Callable, args: tuple, kwargs: dict) -> Any:
        names = self.entry.kwargs
        branches = self.branches()
        if self.pending is not None:
            # The call after a split one must be its unconditional pass: answer it from the exchange.
            assert branches is not None
            if not (_same(kwargs.get(names[0]), branches[1][0]) and kwargs.get("hidden_states") is self.pending[0]):
                raise RuntimeError(
                    "cfg parallel: the transformer call after the conditional one is not the unconditional pass "
                    "this pipeline's PipelineSpec.cfg describes; the pipeline changed, refusing to guess."
                )
            _, output = self.pending
            self.pending = None
            return output
        if args or branches is None or not _same(kwargs.get(names[0]), branches[0][0]):
            # No negative branch in this call (or a call the table does not describe): compute it here.
            self.plain_calls += 1
            if self.plain_calls == 1:
                warnings.warn("cfg parallel: a transformer call without a negative branch runs on both ranks of the pair.")
            return inner(*args, **kwargs)
        if self.branch == 1:
            kwargs = {**kwargs, **dict(zip(names, branches[1]))}
        output = inner(*args, **kwargs)
        mine = output[0] if isinstance(output, tuple) else output.sample
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine.contiguous(), group=self.group)
        self.split_calls += 1
        self.pending = (kwargs.get("hidden_states"), _with_prediction(output, both[1]))
        return _with_prediction(output, both[0])


def _same(value: Any, recorded: Any) -> bool:
    if value is recorded:
        return True
    if isinstance(value, torch.Tensor) and isinstance(recorded, torch.Tensor) and value.shape == recorded.shape:
        return bool(torch.equal(value, recorded.to(value.dtype)))
    return False


def _with_prediction(output: Any, prediction: torch.Tensor) -> Any:
    if isinstance(output, tuple):
        return (prediction, *output[1:])
    return type(output)(sample=prediction)
