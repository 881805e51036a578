"""First-block cache with one decision per image, agreed over the shard group (see ``cache``).

diffusers' hook machinery (``ModelHook``, ``StateManager`` per cache context, the block metadata
of ``TransformerBlockRegistry``) with our own decision: the first block always runs; per image,
the relative change of its residual since the image's last computed step, summed over the shards
of the group, decides whether the remaining blocks run. Imported only when the cache is installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol, Union

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
from diffusers.hooks._helpers import TransformerBlockRegistry
from diffusers.hooks.hooks import BaseState, CacheContext, StateManager
from diffusers.utils.torch_utils import unwrap_module

if TYPE_CHECKING:
    # What a transformer block returns: its hidden states, or a tuple holding them and the encoder's.
    _BlockOutput = Union[torch.Tensor, tuple[torch.Tensor, ...]]


class StepDecisions(Protocol):
    """What the hooks ask of the run's step cache (``cache.StepCache``): the per-image decision, agreed
    over the shard group, and its count."""

    def decide(self, residual: torch.Tensor, reference: torch.Tensor) -> list[bool]: ...

    def count(self, compute: list[bool]) -> None: ...


HEAD_HOOK = "lightning_diffusion.fbc_head"
BLOCK_HOOK = "lightning_diffusion.fbc_block"


class FirstBlockState(BaseState):
    """Per cache context (guidance branch), per image of the batch: the first block's residual at
    the image's last computed step (the reference), the remaining blocks' residuals then (the
    tail), this step's first-block outputs (the head) and decisions."""

    def __init__(self) -> None:
        super().__init__()
        self.reset()

    def reset(self) -> None:
        self.reference: Optional[torch.Tensor] = None
        self.tail: Optional[tuple] = None
        self.head: Optional[tuple] = None
        self.compute: list[bool] = []


def install_first_block(model: torch.nn.Module, step_cache: StepDecisions) -> None:
    """Hooks on the first block (decides), the blocks after it (skip or run) and the last (records).
    ``step_cache``: a ``cache.StepCache`` (its ``decide`` and ``count``)."""
    blocks = [block for name, child in model.named_children()
              if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList)
              for block in child]
    if len(blocks) < 2:
        raise ValueError(f"first_block cache needs at least two transformer blocks in {type(model).__name__}.")
    manager = StateManager(FirstBlockState)  # type: ignore[arg-type]  # diffusers types the class as an instance
    HookRegistry.check_if_exists_or_initialize(blocks[0]).register_hook(_HeadHook(manager, step_cache), HEAD_HOOK)
    for block in blocks[1:]:
        is_tail = block is blocks[-1]
        HookRegistry.check_if_exists_or_initialize(block).register_hook(_BlockHook(manager, is_tail), BLOCK_HOOK)
    HookRegistry.check_if_exists_or_initialize(model).invalidate_child_registries_cache()


class _Block:
    """A block's (hidden, encoder) inputs and outputs, by the block class's diffusers metadata."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.meta = TransformerBlockRegistry.get(unwrap_module(module).__class__)

    def inputs(self, args: tuple, kwargs: dict) -> tuple:
        get = self.meta._get_parameter_from_args_kwargs
        hidden = get(self.meta.hidden_states_argument_name, args, kwargs)
        if self.meta.return_encoder_hidden_states_index is None:
            return (hidden,)
        return hidden, get(self.meta.encoder_hidden_states_argument_name, args, kwargs)

    def outputs(self, output: _BlockOutput) -> tuple:
        if not isinstance(output, tuple):
            return (output,)
        parts: tuple = (output[self.meta.return_hidden_states_index],)
        if self.meta.return_encoder_hidden_states_index is not None:
            parts += (output[self.meta.return_encoder_hidden_states_index],)
        return parts

    def output(self, parts: tuple) -> _BlockOutput:
        """The block's return value made of (hidden, encoder) ``parts``."""
        if self.meta.return_encoder_hidden_states_index is None:
            return parts[0]
        out: list[Any] = [None, None]
        out[self.meta.return_hidden_states_index] = parts[0]
        out[self.meta.return_encoder_hidden_states_index] = parts[1]
        return tuple(out)


def _select(keep: list[bool], computed: tuple, reused: tuple) -> tuple:
    """Per image: the computed tensors where ``keep``, else the reused ones (batch is dimension 0)."""
    mask = torch.tensor(keep, device=computed[0].device)
    return tuple(torch.where(mask.view(-1, *([1] * (c.ndim - 1))), c, r.to(c.device)) for c, r in zip(computed, reused))


class _FirstBlockHook(ModelHook):
    """What both hooks share: the state manager of the transformer's blocks, and the block's
    (hidden, encoder) layout, read when the hook is registered."""

    fn_ref: Any  # diffusers' HookFunctionReference, whose original_forward it types as None (its initial value)

    def __init__(self, state_manager: StateManager) -> None:
        super().__init__()
        self.state_manager = state_manager

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self.block = _Block(module)
        return module


class _HeadHook(_FirstBlockHook):
    """On the first block: run it, decide per image, and either let the remaining blocks run
    (some image needs them) or return every image's cached result (none does)."""

    _is_stateful = True

    def __init__(self, state_manager: StateManager, step_cache: StepDecisions) -> None:
        super().__init__(state_manager)
        self.step_cache = step_cache

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.state_manager.reset()
        return module

    @torch.compiler.disable(recursive=False)
    def new_forward(self, module: torch.nn.Module, *args: object, **kwargs: object) -> _BlockOutput:
        # Under model.compile only the block's own forward is traced (see _BlockHook.new_forward).
        output = self.fn_ref.original_forward(*args, **kwargs)
        return self._decide(args, kwargs, output)

    @torch.compiler.disable
    def _decide(self, args: tuple, kwargs: dict, output: _BlockOutput) -> _BlockOutput:
        if self.state_manager._context is None:  # a pipeline without cache contexts
            self.state_manager.set_context(CacheContext(name="inference"))
        state = self.state_manager.get_state()
        hidden_in = self.block.inputs(args, kwargs)[0]
        head = self.block.outputs(output)
        residual = head[0] - hidden_in.to(head[0].device)
        fresh = state.reference is None or state.reference.shape != residual.shape
        compute = [True] * residual.shape[0] if fresh else self.step_cache.decide(residual, state.reference)
        self.step_cache.count(compute)
        state.compute, state.head = compute, head
        state.reference = residual if all(compute) else _select(compute, (residual,), (state.reference,))[0]
        if any(compute):
            return output
        return self.block.output(_reuse(head, state.tail))


def _reuse(head: tuple, tail: tuple) -> tuple:
    # Blocks of a transformer spread by a device map may sit on different devices.
    return tuple(h + t.to(h.device) for h, t in zip(head, tail))


class _BlockHook(_FirstBlockHook):
    """On every other block: pass the inputs through when every image reuses; run otherwise. The
    last block records the remaining blocks' residuals and mixes computed and reused images."""

    def __init__(self, state_manager: StateManager, is_tail: bool) -> None:
        super().__init__(state_manager)
        self.is_tail = is_tail

    @torch.compiler.disable(recursive=False)
    def new_forward(self, module: torch.nn.Module, *args: object, **kwargs: object) -> _BlockOutput:
        # Under model.compile, dynamo skips this frame and the decisions around it (run eagerly)
        # and traces only the block's own forward: guards on the cache's state (the guidance
        # branch's name, which images reuse, the last block) would otherwise make a graph per
        # pattern, past dynamo's recompile limit, after which it runs eagerly without a word.
        if self._passes_through():
            return self._pass_through(args, kwargs)
        output = self.fn_ref.original_forward(*args, **kwargs)
        return self._record(output) if self.is_tail else output

    @torch.compiler.disable
    def _passes_through(self) -> bool:
        return not any(self.state_manager.get_state().compute)

    @torch.compiler.disable
    def _pass_through(self, args: tuple, kwargs: dict) -> _BlockOutput:
        return self.block.output(self.block.inputs(args, kwargs))

    @torch.compiler.disable
    def _record(self, output: _BlockOutput) -> _BlockOutput:
        state = self.state_manager.get_state()
        parts = self.block.outputs(output)
        residuals = tuple(p - h.to(p.device) for p, h in zip(parts, state.head))
        if all(state.compute):
            state.tail = residuals
            return output
        reused = _reuse(state.head, state.tail)
        state.tail = _select(state.compute, residuals, state.tail)
        return self.block.output(_select(state.compute, parts, reused))
