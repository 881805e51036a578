"""``MeshStrategy``: data x context x tensor parallelism on one device mesh, through diffusers' own
parallel machinery. The data-, context- and tensor-parallel strategies are presets of it.

What runs where, per replica (one ``dp`` coordinate):
* ``tp > 1``: the transformer is created with ``from_pretrained(parallel_config=TensorParallelConfig)``,
  so each rank reads only its slice of every weight of the model's ``_tp_plan``;
* ``ring * ulysses > 1``: diffusers' context-parallel hooks (the model's ``_cp_plan``) split each
  image's tokens over the ``("ring", "ulysses")`` sub-mesh and its attention dispatch runs Ulysses,
  Ring or Unified attention;
* both: diffusers' ``enable_parallelism`` accepts one kind only, so the same pieces it uses are
  composed here: TP from the load, then the context-parallel hooks and the processors' config.
  Ulysses then splits the heads each TP rank holds, so ``tp * ulysses`` must divide the heads.
"""

from __future__ import annotations

from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_diffusion import compat
from lightning_diffusion.data import summarize_records
from lightning_diffusion.errors import ConfigError
from lightning_diffusion.specs import spec_for, with_plan
from lightning_diffusion.strategies.cfg import CFGSplit, check_cfg
from lightning_diffusion.strategies.mesh import ParallelDims
from lightning_diffusion.strategies.parallel import DEFAULT_TIMEOUT_S, DiffusionParallelStrategy

# from_pretrained options that diffusers cannot combine with a tensor-parallel load, and why.
_TP_INCOMPATIBLE_OPTIONS = {
    "quantization_config": "quantized weights cannot be sharded into DTensors",
    "device_map": "tensor parallelism already places each rank's shard on its device",
    "max_memory": "it only applies with device_map",
    "offload_folder": "offloaded weights cannot be sharded",
    "offload_state_dict": "offloaded weights cannot be sharded",
}


def check_attention_backend(name: str) -> None:
    """The backend must exist and support context parallelism in the installed diffusers."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    try:
        backend = AttentionBackendName(name)
    except ValueError:
        raise ConfigError(
            f"attention_backend {name!r} is not a diffusers attention backend; "
            f"choose one of: {', '.join(sorted(b.value for b in AttentionBackendName))}."
        ) from None
    if not _AttentionBackendRegistry._is_context_parallel_available(backend):
        raise ConfigError(
            f"attention_backend {name!r} cannot do context parallelism; choose one of: "
            f"{', '.join(sorted(_AttentionBackendRegistry._supports_context_parallel))}."
        )


def check_shardable(cls: type, config: dict[str, Any], tp_degree: int, name: str) -> None:
    """Heads and every (packed) block of the plan must divide by ``tp_degree``; checked on an empty
    (meta) model built from the config alone, so no weight is read."""
    from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

    heads = config.get("num_attention_heads")
    if isinstance(heads, int) and heads % tp_degree:
        raise ConfigError(f"{name} has {heads} attention heads, not divisible by tp_degree={tp_degree}.")
    with torch.device("meta"):
        model = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    try:
        resolve_tp_shard_specs(model, cls._tp_plan, tp_degree)
    except ValueError as err:
        raise ConfigError(f"{name}: {err} Choose a tp_degree that divides it.") from None


def load_sharded(cls: type, path: str, subfolder: Optional[str], dtype: torch.dtype, tp_mesh: Any, **options: Any):
    """Create a diffusers model with a tensor-parallel ``parallel_config``: diffusers builds it empty
    and streams this rank's slice of every planned weight straight into a DTensor."""
    from diffusers import TensorParallelConfig

    if tp_mesh.device_type == "cpu":
        compat.apply_cpu_rehearsal_patches()
    return cls.from_pretrained(
        path, subfolder=subfolder, dtype=dtype, parallel_config=TensorParallelConfig(mesh=tp_mesh), **options
    )


class MeshStrategy(DiffusionParallelStrategy):
    """Data x CFG x ring x Ulysses x tensor parallelism on one ``("dp", "cfg", "ring", "ulysses", "tp")`` mesh.

    Args:
        dp, ring, ulysses, tp: the degrees; their product with ``cfg`` is the world size (devices x
            num_nodes), and one of them may be ``-1`` to be inferred. ``tp`` is innermost (adjacent
            ranks, one node), ``dp`` outermost (the only dimension that may span nodes at no cost).
        cfg: 2 runs the conditional and unconditional passes of classifier-free guidance on two
            ranks at once (pipelines whose ``PipelineSpec`` has ``cfg``, with their negative branch
            on); 1 runs them in turn, as diffusers does.
        ulysses_anything: Ulysses for sequence lengths and head counts that do not divide the degree.
        ring_anything: ring attention for sequence lengths that do not divide the degree.
        attention_backend: a diffusers attention backend that supports context parallelism; ``None``
            keeps diffusers' default (``native``), except ring on CUDA, which takes ``_native_cudnn``
            because ``native`` returns no log-sum-exp there.
        process_group_backend: ``None``: ``gloo`` on CPU; on CUDA ``nccl``, or ``cpu:gloo,cuda:nccl``
            with context parallelism (its anything-modes exchange sizes on the CPU without syncs).
        timeout: seconds a collective may wait before the process group gives up.
    """

    def __init__(
        self,
        dp: int = -1,
        ring: int = 1,
        ulysses: int = 1,
        tp: int = 1,
        cfg: int = 1,
        ulysses_anything: bool = False,
        ring_anything: bool = False,
        attention_backend: Optional[str] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, **kwargs)
        if cfg not in (1, 2) or isinstance(cfg, bool):
            raise ConfigError(f"cfg degree must be 1 or 2 (the two passes of classifier-free guidance), got {cfg!r}.")
        self._requested = {"dp": dp, "cfg": cfg, "ring": ring, "ulysses": ulysses, "tp": tp}
        ParallelDims.check_degrees(self._requested)
        if ulysses_anything and ring_anything:
            raise ConfigError("Set at most one of ulysses_anything and ring_anything.")
        if attention_backend is not None:
            check_attention_backend(attention_backend)
        self.ulysses_anything = ulysses_anything
        self.ring_anything = ring_anything
        self.attention_backend = attention_backend
        self._sharded: set[str] = set()
        self._cfg_split: Optional[CFGSplit] = None

    # ----------------------------------------------------------------- degrees and their rules

    def degrees(self) -> dict[str, int]:
        return dict(self._requested)

    # A preset names the group it exists for ("cp" or "tp"): a world too small for it is an error.
    required_group: Optional[str] = None

    def make_parallel_dims(self, world_size: int) -> ParallelDims:
        dims = super().make_parallel_dims(world_size)
        if self.required_group is not None and getattr(dims, self.required_group) == 1:
            kind = {"cp": "Context", "tp": "Tensor", "cfg": "CFG"}[self.required_group]
            raise ConfigError(
                f"{kind} parallelism over {world_size} process(es) leaves a group of 1: "
                "launch more devices (trainer.devices x trainer.num_nodes) or use strategy data_parallel."
            )
        # diffusers' own rules for the anything-modes, here so they fail before any process starts.
        if self.ring_anything and dims.ring == 1:
            raise ConfigError("ring_anything needs ring degree > 1; for Ulysses use ulysses_anything instead.")
        if self.ulysses_anything and dims.ulysses == 1:
            raise ConfigError("ulysses_anything needs ulysses degree > 1; for ring use ring_anything instead.")
        if self.ulysses_anything and dims.ring > 1:
            raise ConfigError("ulysses_anything works with ring degree 1 only (diffusers has no unified anything-mode).")
        if self.ring_anything and dims.ulysses > 1:
            raise ConfigError("ring_anything works with ulysses degree 1 only (diffusers has no unified anything-mode).")
        if dims.tp > 1 and dims.cp > 1:
            if dims.ring > 1 and dims.ulysses > 1:
                raise ConfigError(
                    "tp with both ring and ulysses > 1 is refused: that pairing is not verified against one "
                    "device; use tp with ulysses or with ring."
                )
            if self.ulysses_anything or self.ring_anything:
                raise ConfigError(
                    "tp with an anything-mode is refused: that pairing is not verified against one device; "
                    "choose sizes whose token count divides the context-parallel degree."
                )
        return dims

    @property
    def tp_degree(self) -> int:
        return self.parallel_dims.tp

    @property
    def ulysses_degree(self) -> int:
        return self.parallel_dims.ulysses

    @property
    def ring_degree(self) -> int:
        return self.parallel_dims.ring

    @property
    def cp_mode(self) -> str:
        if self.ring_degree > 1 and self.ulysses_degree > 1:
            return "unified"
        name = "ring" if self.ring_degree > 1 else "ulysses"
        return f"{name}-anything" if self.ulysses_anything or self.ring_anything else name

    # ----------------------------------------------------------------- checks before weights

    def check_model(self, module: pl.LightningModule, records: Optional[Sequence[Any]] = None) -> None:
        """``records``: the prompt records when known before the Trainer exists (the CLI's preflight)."""
        info = getattr(module, "info", None)
        if info is None:  # not a DiffusionModule: nothing is known before loading
            return
        dims = self.parallel_dims
        if dims.cfg > 1:
            if records is None:
                trainer = getattr(module, "_trainer", None)
                records = getattr(getattr(trainer, "datamodule", None), "records", None)
            check_cfg(
                info.class_name, {**module.base_call_args, **module.call_kwargs}, info.call_default, records
            )
        if dims.cp > 1:
            self.check_context_parallel(module, info)
        if dims.tp > 1:
            self.check_tensor_parallel(module, info)

    def check_context_parallel(self, module: pl.LightningModule, info: Any) -> None:
        planned = info.models_with("_cp_plan")
        if not planned:
            raise ConfigError(
                f"{info.class_name} has no model with a context-parallel plan (_cp_plan) in diffusers; "
                f"use data_parallel, or a pipeline whose transformer has one ({', '.join(with_plan('_cp_plan'))})."
            )
        split = self.ulysses_degree * self.tp_degree
        for name in planned:
            heads = info.configs.get(name, {}).get("num_attention_heads")
            if isinstance(heads, int) and heads % split and not self.ulysses_anything:
                if self.tp_degree > 1:
                    raise ConfigError(
                        f"{name} has {heads} attention heads, not divisible by tp x ulysses = {self.tp_degree} x "
                        f"{self.ulysses_degree}: Ulysses splits the heads each tensor-parallel rank holds; "
                        "lower one of the two or use ring instead of ulysses."
                    )
                raise ConfigError(
                    f"{name} has {heads} attention heads, not divisible by ulysses_degree={self.ulysses_degree}: "
                    f"use ulysses_anything=True or a ulysses_degree that divides {heads}."
                )
        if info.spec.prompt_length_text and not self.ulysses_anything:
            # diffusers splits the text tokens too; an odd prompt would fail after the weights load. Ring's
            # anything-mode refuses the text attention mask these pipelines pass (diffusers 0.42.1).
            raise ConfigError(
                f"{info.class_name}'s text tokens have each prompt's own length, which the context-parallel degree "
                f"{self.parallel_dims.cp} would have to divide (an odd prompt fails after the weights load): use "
                "Ulysses alone with ulysses_anything=True (ring_anything rejects its attention mask; tp with an "
                "anything-mode is not verified here)."
            )
        trainer = getattr(module, "_trainer", None)
        records = getattr(getattr(trainer, "datamodule", None), "records", None)
        override_sets = [overrides for _, overrides in summarize_records(records).override_sets()] if records else [{}]
        for overrides in override_sets:
            call_args = {**module.base_call_args, **module.call_kwargs, **overrides}
            self.check_sequence(info, call_args.get("height"), call_args.get("width"), call_args)

    def check_sequence(self, info: Any, height: Optional[int], width: Optional[int], call_args: dict) -> None:
        if self.ulysses_anything or self.ring_anything:
            return
        degree = self.parallel_dims.cp
        if self.ring_degree > 1 and self.ulysses_degree > 1 or self.tp_degree > 1:
            fix = "choose sizes"
        else:
            fix = f"use {'ulysses_anything' if self.ring_degree == 1 else 'ring_anything'}=True or choose sizes"
        for kind, length in info.sequence_lengths(height, width, call_args).items():
            if length % degree == 0:
                continue
            if kind == "image":
                m = info.size_multiple
                raise ConfigError(
                    f"{height}x{width} gives {length} image tokens ((height/{m}) x (width/{m})), not divisible by "
                    f"the context-parallel degree {degree}: {fix} whose token count is divisible by {degree}."
                )
            arg = info.spec.text_length_arg
            raise ConfigError(
                f"{arg}={length} text tokens are not divisible by the context-parallel degree {degree}: "
                f"{fix.replace('sizes', 'a ' + arg)} divisible by {degree}."
            )

    def check_tensor_parallel(self, module: pl.LightningModule, info: Any) -> None:
        planned = info.models_with("_tp_plan")
        if not planned:
            raise ConfigError(
                f"{info.class_name} has no model with a tensor-parallel plan (_tp_plan) in diffusers; "
                f"use data_parallel or context parallelism, or a pipeline with one ({', '.join(with_plan('_tp_plan'))})."
            )
        options = getattr(module, "from_pretrained_kwargs", {})
        for option, reason in _TP_INCOMPATIBLE_OPTIONS.items():
            if options.get(option) is not None:
                raise ConfigError(f"model.from_pretrained_kwargs.{option} cannot be used with tensor parallelism: {reason}.")
        if options.get("use_safetensors") is False or options.get("low_cpu_mem_usage") is False:
            raise ConfigError(
                "Tensor parallelism reads each rank's slice of safetensors files while loading: "
                "drop use_safetensors=False and low_cpu_mem_usage=False."
            )
        for name, cls in planned.items():
            folder = Path(info.path) / name
            if folder.is_dir() and not any(folder.glob("*.safetensors")):
                raise ConfigError(
                    f"{folder} has no .safetensors weights; tensor parallelism reads each rank's slice from "
                    "safetensors files. Convert the checkpoint (save_pretrained(safe_serialization=True))."
                )
            check_shardable(cls, info.configs.get(name, {}), self.tp_degree, name)

    # ----------------------------------------------------------------- lifecycle

    def setup_environment(self) -> None:
        if self._process_group_backend is None and self.root_device.type == "cuda" and self.parallel_dims.cp > 1:
            self._process_group_backend = "cpu:gloo,cuda:nccl"
        super().setup_environment()
        module = self.lightning_module
        info = getattr(module, "info", None)
        if self.tp_degree > 1 and info is not None and hasattr(module, "component_loaders"):
            for name, cls in info.models_with("_tp_plan").items():
                module.component_loaders[name] = partial(
                    self._load_sharded, name, cls, dict(module.from_pretrained_kwargs)
                )

    def _load_sharded(self, name: str, cls: type, options: dict, info: Any, dtype: torch.dtype) -> torch.nn.Module:
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        passed = {k: v for k, v in options.items() if k in ("revision", "variant", "token", "cache_dir")}
        model = load_sharded(cls, info.path, name, dtype, self.device_mesh["tp"], **passed)
        self._sharded.add(name)
        from torch.distributed.tensor import DTensor

        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
        total = sum(p.numel() for p in model.parameters())
        rank_zero_info(
            f"tensor parallel tp={self.tp_degree}: {cls.__name__} '{name}' loaded shard by shard, "
            f"{local:,} of {total:,} parameters on this rank"
        )
        return model

    def setup(self, trainer: pl.Trainer) -> None:
        if self.tp_degree > 1:
            # Lightning predicts under torch.inference_mode on NCCL, and DTensor operations fail on
            # inference tensors (pytorch/pytorch#142190); no_grad gives the same memory savings here.
            trainer.predict_loop.inference_mode = False
        super().setup(trainer)

    def model_to_device(self) -> None:
        # Move whole components only: sharded ones are already on this rank's device, and moving
        # DTensor shards through Module.to would at best do nothing.
        for name, component in getattr(self.lightning_module, "components", {}).items():
            if name not in self._sharded:
                component.to(self.root_device)

    def parallelize(self, pipeline: Any) -> None:
        if self.parallel_dims.cp > 1:
            if self.root_device.type == "cpu":
                compat.apply_cpu_rehearsal_patches()
            for component in pipeline.components.values():
                if isinstance(component, torch.nn.Module) and getattr(component, "_cp_plan", None) is not None:
                    self._enable_context_parallel(component)
        if self.parallel_dims.cfg > 1:
            # Last, so that the split wraps the context-parallel hooks: each branch sees whole inputs.
            pair = self.device_mesh["cfg"]
            self._cfg_split = CFGSplit(
                pipeline, spec_for(type(pipeline).__name__).cfg, pair.get_group(), pair.get_local_rank()
            )
            rank_zero_info(f"cfg parallel: {type(pipeline).__name__}'s cond and uncond passes on the two ranks of each pair")

    def on_predict_end(self) -> None:
        super().on_predict_end()
        if self._cfg_split is not None:
            # Parity cannot tell a split from both ranks running both passes; this count can.
            split, plain = self._cfg_split.split_calls, self._cfg_split.plain_calls
            rank_zero_info(
                f"cfg parallel: {split} transformer calls split over the pair, {plain} run whole on both ranks"
            )

    def resolved_attention_backend(self, dtype: torch.dtype) -> Optional[str]:
        if self.attention_backend is not None or self.root_device.type == "cpu" or self.ring_degree == 1:
            return self.attention_backend
        if dtype not in (torch.bfloat16, torch.float16):
            raise ConfigError(
                "Ring attention on CUDA needs an attention backend that returns the log-sum-exp; those that "
                "diffusers has need bfloat16 or float16: set model.torch_dtype to bfloat16, or attention_backend."
            )
        return "_native_cudnn"

    def _enable_context_parallel(self, component: torch.nn.Module) -> None:
        from diffusers import ContextParallelConfig
        from diffusers.hooks.context_parallel import apply_context_parallel
        from diffusers.models._modeling_parallel import ParallelConfig

        backend = self.resolved_attention_backend(component.dtype)
        if backend is not None:
            component.set_attention_backend(backend)
        cp_mesh = self.device_mesh["ring", "ulysses"]
        cp_config = ContextParallelConfig(
            ring_degree=self.ring_degree,
            ulysses_degree=self.ulysses_degree,
            ulysses_anything=self.ulysses_anything,
            ring_anything=self.ring_anything,
            mesh=cp_mesh,
        )
        if getattr(component, "_parallel_config", None) is None:
            component.enable_parallelism(config=cp_config)  # context parallelism alone: diffusers' entry point
        else:
            # Already tensor-parallel (sharded while loading). enable_parallelism refuses a second
            # kind, so do what it does for context parallelism: give the attention processors the
            # config (the dispatch then runs Ulysses/Ring over the cp sub-mesh) and add the hooks
            # that split the inputs and gather the output along the sequence.
            config = ParallelConfig(context_parallel_config=cp_config)
            config.setup(self.global_rank, self.world_size, self.root_device, mesh=cp_mesh)
            for module in component.modules():
                processor = getattr(module, "processor", None)
                if processor is not None and hasattr(processor, "_parallel_config"):
                    processor._parallel_config = config
            apply_context_parallel(component, cp_config, component._cp_plan)
        rank_zero_info(
            f"context parallel {self.cp_mode} (ring={self.ring_degree}, ulysses={self.ulysses_degree}"
            f"{f', on tp={self.tp_degree} shards' if self.tp_degree > 1 else ''}) on {type(component).__name__}, "
            f"attention backend {backend or 'default'}"
        )
