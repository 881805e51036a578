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

from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry, ModelHook

from lightning_diffusion.core.console import log
from lightning_diffusion.pipelines.specs import CFGBranches

if TYPE_CHECKING:
    from diffusers.models.modeling_outputs import Transformer2DModelOutput
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline
    from torch.distributed import ProcessGroup

    # What a transformer's forward returns: its output class, or a tuple with ``return_dict=False``.
    _Prediction = Union[Transformer2DModelOutput, tuple[torch.Tensor, ...]]

HOOK_NAME = "lightning_diffusion.cfg_split"


class _SplitHook(ModelHook):
    """The CFG split on a transformer's forward, as a named diffusers hook. Registered after the
    context-parallel hooks, so it is the outermost: it sees (and swaps) whole, unsplit inputs."""

    fn_ref: Any  # diffusers' HookFunctionReference, whose original_forward it types as None (its initial value)

    def __init__(self, split: "CFGSplit") -> None:
        super().__init__()
        self.split = split

    def new_forward(self, module: torch.nn.Module, *args: object, **kwargs: object) -> _Prediction:
        self.split.denoising = True
        return self.split.forward(self.fn_ref.original_forward, args, kwargs)


class CFGSplit:
    """Installed on a loaded pipeline on each rank of a cfg pair (see the module docstring):
    a ``HookRegistry`` hook named ``HOOK_NAME`` on each transformer of the entry, and a recorder
    of ``encode_prompt``'s outputs (a pipeline method, not a module, so it is wrapped on the
    instance). ``remove()`` takes both off."""

    def __init__(self, pipeline: DiffusionPipeline, entry: CFGBranches, group: ProcessGroup, branch: int) -> None:
        self.entry = entry
        self.group = group
        self.branch = branch  # 0: this rank computes cond, 1: uncond
        self.encoded: list[tuple[object, ...]] = []  # encode_prompt's outputs in this pipeline call
        self.denoising = False
        self.pending: Optional[tuple[object, _Prediction]] = None  # (its hidden states, the uncond answer)
        self.split_calls = 0
        self.plain_calls = 0
        self.pipeline = pipeline
        original_encode = pipeline.encode_prompt

        def encode_prompt(*args: object, **kwargs: object) -> object:
            if self.denoising:  # a new pipeline call
                self.encoded, self.denoising, self.pending = [], False, None
            outputs = original_encode(*args, **kwargs)
            self.encoded.append(outputs)
            return outputs

        pipeline.encode_prompt = encode_prompt
        self.models = [m for m in (getattr(pipeline, name, None) for name in entry.transformers)
                       if isinstance(m, torch.nn.Module)]
        for model in self.models:
            HookRegistry.check_if_exists_or_initialize(model).register_hook(_SplitHook(self), HOOK_NAME)

    def remove(self) -> None:
        """Run the pipeline as diffusers does again: both passes on every rank."""
        for model in self.models:
            HookRegistry.check_if_exists_or_initialize(model).remove_hook(HOOK_NAME, recurse=False)
        self.pipeline.__dict__.pop("encode_prompt", None)

    def branches(self) -> Optional[tuple[tuple, tuple]]:
        """The (cond, uncond) values of ``entry.kwargs`` recorded for the current pipeline call."""
        if self.entry.one_call:
            if len(self.encoded) != 1 or self.encoded[0][1] is None:
                return None
            return (self.encoded[0][0],), (self.encoded[0][1],)
        if len(self.encoded) != 2:
            return None
        return tuple(self.encoded[0]), tuple(self.encoded[1])

    def forward(self, inner: Callable, args: tuple, kwargs: dict) -> _Prediction:
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
                log.warning("cfg parallel: a transformer call without a negative branch runs on both ranks of the "
                            "pair.")
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


def _same(value: object, recorded: object) -> bool:
    if value is recorded:
        return True
    if isinstance(value, torch.Tensor) and isinstance(recorded, torch.Tensor) and value.shape == recorded.shape:
        return bool(torch.equal(value, recorded.to(value.dtype)))
    return False


def _with_prediction(output: _Prediction, prediction: torch.Tensor) -> _Prediction:
    if isinstance(output, tuple):
        return (prediction, *output[1:])
    return type(output)(sample=prediction)
