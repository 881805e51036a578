"""Workarounds for other libraries' versions, in one place, each with the version and the reason.

Two of them (``apply_parallel_patches``) apply on every device type: where diffusers puts a rank's
parallel model, and a per-head attention mask under Ulysses. The others are for running diffusers'
own context- and tensor-parallel code on CPU with gloo ("CPU rehearsal"); on CUDA with NCCL none of
them changes anything. Both entry points are idempotent; the strategies call them before they make
a model parallel. Delete an entry once the pinned diffusers release no longer needs it (checked
against diffusers 0.42.1).
"""

from __future__ import annotations

import contextlib
import functools
from datetime import timedelta
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_APPLIED: set[str] = set()


def _once(name: str):
    def decorator(patch):
        @functools.wraps(patch)
        def apply() -> None:
            if name not in _APPLIED:
                patch()
                _APPLIED.add(name)

        return apply

    return decorator


def parallel_device(mesh_device_type: str, current_cuda_index: Optional[int]) -> torch.device:
    """The device a rank's parallel model lives on: the mesh's device type, and on CUDA the rank's
    own current device (the strategy sets it), never ``rank % device_count``."""
    if mesh_device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh_device_type, current_cuda_index if current_cuda_index is not None else 0)


@_once("resolve_parallel_config")
def _patch_resolve_parallel_config() -> None:
    """diffusers 0.42.1 ``ModelMixin._resolve_parallel_config`` puts a parallel model on
    ``torch.device(accelerator, rank % torch.accelerator.device_count())``: a ZeroDivisionError on a
    machine without an accelerator, shards on GPUs while the mesh and inputs are CPU/gloo on a
    machine that has GPUs (a CPU rehearsal there), and on another rank's GPU when the ranks of a
    node do not own GPUs 0..n-1 in rank order (``trainer.devices: [4, 5, 6, 7]``, SLURM's cyclic
    distribution). The strategies always pass their mesh: resolve on the mesh's device type and the
    rank's own device instead."""
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig, TensorParallelConfig
    from diffusers.models.modeling_utils import ModelMixin

    original = ModelMixin._resolve_parallel_config

    def _resolve_parallel_config(self, config):
        if isinstance(config, ContextParallelConfig):
            config = ParallelConfig(context_parallel_config=config)
        elif isinstance(config, TensorParallelConfig):
            config = ParallelConfig(tensor_parallel_config=config)
        inner = config.context_parallel_config or config.tensor_parallel_config
        if inner is None or inner.mesh is None:
            return original(self, config)  # no mesh given: diffusers' own resolution
        current = torch.cuda.current_device() if inner.mesh.device_type == "cuda" else None
        device = parallel_device(inner.mesh.device_type, current)
        config.setup(dist.get_rank(), dist.get_world_size(), device, mesh=inner.mesh)
        self._parallel_config = config
        return config

    # (a method: a plain = is refused by mypy)
    setattr(ModelMixin, "_resolve_parallel_config", _resolve_parallel_config)


@_once("native_lse_on_cpu")
def _patch_native_attention_lse_on_cpu() -> None:
    """diffusers 0.42.1's ``native`` backend raises "Native attention does not support
    return_lse=True", which ring attention needs, and ``_native_flash`` calls an aten op with no
    CPU kernel. On CPU, ``aten._scaled_dot_product_flash_attention_for_cpu`` returns the output and
    the log-sum-exp; they are transposed to the model layout the ring code expects (B,S,H,D / B,S,H)."""
    from diffusers.models import attention_dispatch

    original = attention_dispatch._native_attention_forward_op

    def _native_attention_forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     scale=None, enable_gqa=False, return_lse=False, _save_ctx=True,
                                     _parallel_config=None):
        if not (return_lse and query.device.type == "cpu"):
            return original(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                            return_lse, _save_ctx, _parallel_config)
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
        return out.transpose(1, 2).contiguous(), lse.transpose(1, 2).contiguous()

    attention_dispatch._native_attention_forward_op = _native_attention_forward_op


@_once("gloo_all_gather_anything")
def _patch_all_gather_anything_for_gloo() -> None:
    """diffusers 0.42.1 ``_all_gather_anything`` (the output gather of the anything-modes) calls
    ``dist.all_gather`` with tensors of unequal sizes, which gloo refuses ("invalid tensor size");
    NCCL accepts it. On gloo, pad every shard to the largest size, gather, and trim."""
    from diffusers.hooks import context_parallel
    from diffusers.models._modeling_parallel import gather_size_by_comm

    original = context_parallel._all_gather_anything

    def _all_gather_anything(tensor: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        if "nccl" in str(dist.get_backend(group=group)) and tensor.device.type != "cpu":
            return original(tensor, dim, group)
        tensor = tensor.contiguous()
        sizes = gather_size_by_comm(tensor.shape[dim], group)
        largest = max(sizes)
        if tensor.shape[dim] < largest:
            pad = list(tensor.shape)
            pad[dim] = largest - tensor.shape[dim]
            tensor = torch.cat([tensor, tensor.new_zeros(pad)], dim=dim)
        gathered = [torch.empty_like(tensor) for _ in sizes]
        dist.all_gather(gathered, tensor, group=group)
        return torch.cat([part.narrow(dim, 0, size) for part, size in zip(gathered, sizes)], dim=dim)

    context_parallel._all_gather_anything = _all_gather_anything


@_once("ulysses_per_head_mask")
def _patch_ulysses_per_head_mask() -> None:
    """diffusers 0.42.1 ``TemplatedUlyssesAttention`` gathers a sequence-split attention mask along
    the keys but not its heads: a per-head mask (LTX's and LTX-2's text mask, (B, H, 1, S)) meets
    the H/W heads a rank holds after the all-to-all and fails ("The size of tensor a (2) must match
    the size of tensor b (4)"; diffusers issue 14316). After the all-to-all, Ulysses rank r holds
    the contiguous heads [r*H/W, (r+1)*H/W): give the attention op those heads of the mask. A mask
    with one head (broadcast) is left as it is. On every device type."""
    from diffusers.models.attention_dispatch import TemplatedUlyssesAttention

    original = TemplatedUlyssesAttention.forward

    def forward(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                forward_op, backward_op, _parallel_config=None):
        if attn_mask is None or attn_mask.ndim != 4 or attn_mask.shape[1] == 1:
            return original(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                            forward_op, backward_op, _parallel_config)
        rank = _parallel_config.context_parallel_config._ulysses_local_rank

        def local_heads_op(op_ctx, q, k, v, mask, *args, **kwargs):
            if mask is not None and mask.ndim == 4 and mask.shape[1] not in (1, q.shape[2]):
                mask = mask[:, rank * q.shape[2]:(rank + 1) * q.shape[2]]
            return forward_op(op_ctx, q, k, v, mask, *args, **kwargs)

        return original(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                        local_heads_op, backward_op, _parallel_config)

    setattr(TemplatedUlyssesAttention, "forward", staticmethod(forward))


@_once("tensor_parallel_on_cpu")
def _patch_tensor_parallel_devices() -> None:
    """diffusers 0.42.1 ``apply_tensor_parallel`` refuses meshes whose device type is not in
    ``_SUPPORTED_TP_DEVICES`` (cuda, neuron, tpu, xpu); torch's ``parallelize_module`` itself works
    on a CPU mesh over gloo, and TP=2 then equals one process to 4.8e-7."""
    from diffusers.hooks import tensor_parallel

    if "cpu" not in tensor_parallel._SUPPORTED_TP_DEVICES:
        # (setattr: diffusers' typing fixes the tuple at its four devices)
        setattr(tensor_parallel, "_SUPPORTED_TP_DEVICES", (*tensor_parallel._SUPPORTED_TP_DEVICES, "cpu"))


@contextlib.contextmanager
def saving_on_every_rank():
    """transformers 5.x ``save_pretrained`` writes a model's files only on rank 0 of an initialized
    process group (``DistributedMixin.should_save_on_this_rank``), so a tiny pipeline built on
    another rank got empty text-encoder folders (and, renamed first, became the cache's copy). Our
    builders write into a folder of their own on every rank: let each rank write."""
    try:
        from transformers.distributed.mixin import DistributedMixin
    except ImportError:  # transformers 4.x writes on every rank
        yield
        return
    original = DistributedMixin.should_save_on_this_rank
    DistributedMixin.should_save_on_this_rank = lambda self, is_main_process: is_main_process
    try:
        yield
    finally:
        DistributedMixin.should_save_on_this_rank = original


def _has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # missing, or a build that does not match torch ("operator torchvision::nms does not exist")
        return False
    return True


@_once("qwen_vl_processor_without_torchvision")
def _patch_qwen_vl_processor_without_torchvision() -> None:
    """transformers 5.24's ``Qwen2VLProcessor`` (the processor of Qwen-Image's edit pipelines) has a
    video processor besides its image processor and tokenizer, and that one needs torchvision:
    without it the processor can be neither built ("VIDEO_PROCESSOR_MAPPING has no attribute
    _extra_content") nor loaded ("Qwen2VLVideoProcessor requires the Torchvision library"), and
    PyPI's torchvision does not import beside the CPU build of torch 2.13 used here. The edit
    pipelines pass images only: where torchvision is missing, the processor has the other two."""
    if _has_torchvision():
        return
    from transformers import Qwen2VLProcessor

    # (a method: a plain = is refused by mypy)
    setattr(Qwen2VLProcessor, "get_attributes", classmethod(lambda cls: ["image_processor", "tokenizer"]))


@_once("wan_i2v_without_ftfy")
def _patch_wan_i2v_prompt_clean_without_ftfy() -> None:
    """diffusers 0.42.1's ``pipeline_wan_i2v`` calls ``ftfy.fix_text`` on every prompt without
    checking that ftfy is installed (``pipeline_wan`` checks): a NameError on the first prompt.
    Where ftfy is missing, clean prompts as ``WanPipeline`` does then (no ftfy step)."""
    import types

    from diffusers.pipelines.wan import pipeline_wan_i2v
    from diffusers.utils import is_ftfy_available

    if not is_ftfy_available() and not hasattr(pipeline_wan_i2v, "ftfy"):
        pipeline_wan_i2v.ftfy = types.SimpleNamespace(fix_text=lambda text: text)


def apply_pipeline_patches() -> None:
    """Before any pipeline is built or loaded: let the edit and image-to-video pipelines load and run
    without optional packages they need only for inputs this project never passes."""
    _patch_qwen_vl_processor_without_torchvision()
    _patch_wan_i2v_prompt_clean_without_ftfy()


def set_collective_timeout(timeout: timedelta, group: Optional[ProcessGroup] = None) -> None:
    """torch 2.13 gives ``init_process_group`` one timeout for the rendezvous (connecting to the
    store) and the collectives, and ``init_device_mesh`` none for the groups it makes; the
    strategies set the collectives' own here (the default group's when ``group`` is None), through
    the private ``distributed_c10d._set_pg_timeout`` (present since torch 2.4), which sets the
    timeout of the group's gloo or NCCL backend. Where it is missing, torch's defaults stay."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is not None:
        setter(timeout, group)


def collective_timeout(group: ProcessGroup) -> Optional[timedelta]:
    """The timeout a group's collectives wait, read back from its backend's options (gloo, NCCL)."""
    for device in group._device_types:
        options = getattr(group._get_backend(device), "options", None)
        if options is not None:
            return options._timeout
    return None


def apply_parallel_patches() -> None:
    """Before any model is made parallel, on every device type: resolve each rank's device from
    the mesh it is given, and split a per-head text mask with the heads under Ulysses."""
    _patch_resolve_parallel_config()
    _patch_ulysses_per_head_mask()


def apply_cpu_rehearsal_patches() -> None:
    """Make diffusers' context and tensor parallelism run on CPU with gloo (no effect on CUDA paths)."""
    apply_parallel_patches()
    _patch_native_attention_lse_on_cpu()
    _patch_all_gather_anything_for_gloo()
    _patch_tensor_parallel_devices()
