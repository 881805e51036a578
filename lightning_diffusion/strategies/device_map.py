"""``DeviceMapStrategy``: one pipeline spread over the devices (and CPU, and disk) of one process with
diffusers' and accelerate's ``device_map``, optionally run as staged encode / denoise / decode."""

from __future__ import annotations

import os
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from lightning_diffusion.contract import DiffusionModel, LoadPlan, ModelRequest
from lightning_diffusion.core.checks import integer
from lightning_diffusion.core.console import log
from lightning_diffusion.core.errors import ConfigError, NodeConfigError, raise_problems, run_check
from lightning_diffusion.pipelines import quantization
from lightning_diffusion.pipelines.model_folder import component_bytes
from lightning_diffusion.pipelines.staged import StagedPipeline, stages_for
from lightning_diffusion.strategies.base import DEFAULT_TIMEOUT_S
from lightning_diffusion.strategies.mesh_parallel import MeshStrategy

if TYPE_CHECKING:
    from diffusers.models.modeling_utils import ModelMixin
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline
    from transformers import PreTrainedModel

    from lightning_diffusion.pipelines.model_folder import PipelineInfo

# The model a pipeline's weights are mostly in; "auto" spreads this one over devices, CPU and disk.
DENOISERS = ("transformer", "unet")


def size_in_bytes(value: Union[int, str]) -> int:
    from accelerate.utils import convert_file_size_to_int

    try:
        return int(convert_file_size_to_int(value))
    except (ValueError, TypeError):
        raise ConfigError(f"max_memory value {value!r} is not a size such as '16GB', '500MB' or a number of "
                          "bytes.") from None


def process_max_memory(user: dict[Union[int, str], int], gpus: list[int], free: dict[int, int],
                       cpu_bytes: int) -> dict[Union[int, str], int]:
    """accelerate's ``max_memory`` for one process that owns GPUs ``gpus``: each of them with the
    user's budget (keys count from the process's first GPU) or its free memory, plus the CPU (the
    user's budget or the available RAM) and disk if the user names it. GPUs of other processes are
    not listed: accelerate would open a context on each, and diffusers' ``balanced`` assignment
    cycles through every listed device, even one with a budget of 0."""
    budget: dict[Union[int, str], int] = {}
    for position, index in enumerate(gpus):
        budget[index] = int(user.get(position, free[index]))
    budget["cpu"] = int(user.get("cpu", cpu_bytes))
    if "disk" in user:
        budget["disk"] = int(user["disk"])
    return budget


def _available_ram() -> int:
    """What accelerate itself counts for the CPU: memory available without swapping (page cache included)."""
    import psutil

    return int(psutil.virtual_memory().available)


class DeviceMapStrategy(MeshStrategy):
    """Place one pipeline over several devices of one process: the answer when the weights do not
    fit on one GPU and the interconnect is too slow for tensor parallelism (PCIe consumer cards).

    Args:
        device_map: ``"auto"`` spreads the transformer over this process's GPUs, then the CPU, then
            disk (``offload_folder``), fastest first, and puts the other components on the first GPU;
            ``"balanced"`` spreads whole components over the GPUs (diffusers' pipeline-level map);
            a mapping ``{component: device}`` places each named component (the others go to the first GPU).
        max_memory: per-device budget, e.g. ``{0: "16GB", 1: "16GB", "cpu": "64GB"}``; GPU keys count
            from this process's first GPU.
        offload_folder: where weights that fit nowhere else go (``device_map="auto"``).
        staged: encode, denoise and decode each batch as three stages, with the text encoders and the
            VAE on the GPU only during their stage (diffusers guide, "staged"); images equal the unstaged run.
        devices_per_process: GPUs each process spans; process ``r`` of a node owns GPUs
            ``r*k .. r*k+k-1``, so several processes are data-parallel replicas on disjoint devices.
    """

    def __init__(
        self,
        device_map: Union[str, dict[str, str]] = "auto",
        max_memory: Optional[dict[Union[int, str], Union[int, str]]] = None,
        offload_folder: Optional[str] = None,
        staged: bool = False,
        devices_per_process: int = 1,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(dp=-1, process_group_backend=process_group_backend, timeout=timeout)
        problems: list = []
        if not isinstance(device_map, (str, dict)) or isinstance(device_map, str) and device_map not in ("auto",
                                                                                                         "balanced"):
            problems.append(f"device_map must be 'auto', 'balanced' or a {{component: device}} mapping, got "
                            f"{device_map!r}.")
        problems += integer(devices_per_process, "devices_per_process")
        problems += [f"max_memory key {k!r} is not a GPU number (0, 1, ...) or 'cpu'." for k in (max_memory or {})
                     if self._memory_key(k) is None]
        if offload_folder is not None:
            folder = Path(offload_folder).expanduser()
            probe = folder if folder.exists() else next((p for p in folder.parents if p.exists()), None)
            if probe is None or not probe.is_dir() or not os.access(probe, os.W_OK):
                problems.append(f"offload_folder {str(folder)!r} is not a writable folder.")
        raise_problems(problems)
        # (no key is None: those were refused above)
        self.max_memory = {key: size_in_bytes(v) for k, v in (max_memory or {}).items()
                           if (key := self._memory_key(k)) is not None}
        self.device_map = device_map
        self.offload_folder = str(Path(offload_folder).expanduser()) if offload_folder else None
        self.staged = staged
        self.devices_per_process = devices_per_process
        self._placed: set[str] = set()

    @staticmethod
    def _memory_key(key: Union[int, str]) -> Optional[Union[int, str]]:
        """A ``max_memory`` key as accelerate takes it; None for one that is no GPU number or ``cpu``."""
        if isinstance(key, str) and key.isdigit():
            return int(key)
        if isinstance(key, int) and not isinstance(key, bool) and key >= 0 or key in ("cpu", "disk"):
            return key
        return None

    # ----------------------------------------------------------------- devices of this process

    @property
    def root_device(self) -> torch.device:
        device = super().root_device
        if device.type == "cpu":
            return device
        # With GPUs bound to tasks, a process's own GPUs are the ones it sees, numbered from 0.
        first = 0 if self.gpus_bound_to_tasks else self.local_rank * self.devices_per_process
        return torch.device(device.type, first)

    def gpu_indices(self) -> list[int]:
        if self.root_device.type == "cpu":
            return []
        first = self.root_device.index
        return list(range(first, first + self.devices_per_process))

    def accelerate_max_memory(self) -> Optional[dict[Union[int, str], int]]:
        """This process's budget for accelerate: its own GPUs only (absolute numbers) and the CPU."""
        gpus = self.gpu_indices()
        if not gpus:
            return dict(self.max_memory) or None
        free = {index: int(torch.cuda.mem_get_info(index)[0]) for index in gpus}
        return process_max_memory(self.max_memory, gpus, free, _available_ram())

    # ----------------------------------------------------------------- checks before weights

    def check_request(self, request: ModelRequest, world_size: Optional[int] = None,
                      device_type: Optional[str] = None) -> list:
        problems = super().check_request(request, world_size, device_type)
        problems += self._placement_problems(request)
        problems += self._quantized_placement_problems(request, self.planned_device_type(device_type))
        problems += self._adapter_problems(request)
        return problems

    def _adapter_problems(self, request: ModelRequest) -> list:
        """Adapter updates are fused into the placed weights (plain LoRA pairs only: ``updates``
        refuses the rest), which must not be offloaded."""
        if not request.lora:
            return []
        if self.offload_folder or any(k == "cpu" for k in self.max_memory):
            return ["model.lora (or model.adapters) with a device map that may offload weights to the CPU or disk "
                    "(offload_folder, max_memory for cpu): an update cannot be fused into offloaded weights; drop "
                    "them, or use data_parallel."]
        from lightning_diffusion.pipelines import lora

        problems: list = []
        for adapter in request.lora:
            run_check(problems, lora.updates, request.info.pipeline_class, adapter)
        return problems

    def _quantized_placement_problems(self, request: ModelRequest, device_type: str) -> list:
        """diffusers' torchao quantizer leaves the weights a device map puts on the CPU or disk
        unquantized (offloaded weights are not quantized): in a CPU rehearsal that is all of them,
        on GPUs a component mapped to ``cpu`` or ``disk``."""
        if request.quantization is None:
            return []
        quantized = quantization.quantized(request.quantization, tuple(request.info.denoisers()))
        if isinstance(self.device_map, dict):
            offloaded = [n for n in quantized if str(self.device_map.get(n)) in ("cpu", "disk")]
            if offloaded and device_type != "cpu":
                return [f"model.quantization: device_map puts {', '.join(offloaded)} on the CPU or disk, where "
                        "diffusers does not quantize: map it to a GPU or leave it unquantized."]
        if device_type != "cpu":
            return []
        if self.device_map == "auto":  # the first denoiser (load_plan)
            placed = {n for n in DENOISERS if n in request.info.model_index}
            placed = set(sorted(placed, key=DENOISERS.index)[:1])
        else:
            placed = set(request.info.model_index) if self.device_map == "balanced" else set(self.device_map)
        both = [n for n in quantized if n in placed]
        if both:
            return [f"model.quantization: {', '.join(both)} would load unquantized, because diffusers does not "
                    "quantize weights a device map places on the CPU or disk, and on a CPU run that is every weight; "
                    "drop model.quantization for this CPU rehearsal, or use data_parallel."]
        return []

    def check_devices(self) -> list:
        return super().check_devices() + self._device_problems()

    def _device_problems(self) -> list:
        """This node's GPUs against the processes and their devices (known once the Trainer exists);
        a shortage of GPUs is this node's (``NodeConfigError``: its first process says it)."""
        if self.parallel_devices is None:
            return []
        if self.root_device.type == "cuda":
            if self.gpus_bound_to_tasks:
                needed, what = self.devices_per_process, f"devices_per_process {self.devices_per_process} GPUs"
                where = "this task sees"
            else:
                needed = self.num_processes * self.devices_per_process
                what = (f"{self.num_processes} processes x devices_per_process {self.devices_per_process} = "
                        f"{needed} GPUs")
                where = "this node has"
            if needed > torch.cuda.device_count():
                return [NodeConfigError(f"{what}, but {where} {torch.cuda.device_count()}.")]
        elif self.device_map == "balanced":
            return ["device_map 'balanced' spreads components over GPUs; on a CPU use 'auto' (with offload_folder)."]
        gpus = len(self.gpu_indices())
        return [f"max_memory names GPU {key}, but this process spans {gpus} GPU(s) (devices_per_process="
                f"{self.devices_per_process}{', and no GPU on a CPU run' if not gpus else ''})."
                for key in self.max_memory if isinstance(key, int) and key >= gpus][:1]

    def _placement_problems(self, request: ModelRequest) -> list:
        info = request.info
        if request.from_pretrained_kwargs.get("device_map") is not None:
            return ["Set device_map on the DeviceMapStrategy, not in model.from_pretrained_kwargs."]
        if isinstance(self.device_map, dict):
            unknown = set(self.device_map) - {k for k in info.model_index if not k.startswith("_")}
            if unknown:
                return [f"device_map names {', '.join(sorted(unknown))}, which {info.class_name} does not have."]
        if self.staged:
            problems: list = []
            if run_check(problems, stages_for, info.class_name) is None:
                return problems
        sizes = component_bytes(info.path)
        if self.max_memory and sizes and self.offload_folder is None:
            budget = sum(self.max_memory.values())
            smallest = min(sizes.values())
            if budget < smallest:
                return [f"max_memory ({budget:,} bytes in all) cannot hold even the smallest component "
                        f"({smallest:,} bytes); raise it or give an offload_folder."]
            denoiser = next((sizes[n] for n in DENOISERS if n in sizes), None)
            if self.device_map == "auto" and denoiser is not None and budget < denoiser:
                return [f"max_memory ({budget:,} bytes) cannot hold the transformer ({denoiser:,} bytes) and no "
                        "offload_folder is given for the rest: give one, or raise max_memory."]
        return []

    # ----------------------------------------------------------------- placement

    def load_plan(self, request: ModelRequest) -> LoadPlan:
        info, plan = request.info, LoadPlan()
        if request.lora:  # diffusers' fuse would undo the placement (it re-enables sequential offload)
            from lightning_diffusion.pipelines import lora

            plan.fuse_adapters = lora.fuse_in_place
        if self.device_map == "balanced":
            plan.pipeline_kwargs.update(device_map="balanced", max_memory=self.accelerate_max_memory())
            self._placed.update(k for k in info.model_index if not k.startswith("_"))
            return plan
        if isinstance(self.device_map, dict):
            placements = dict(self.device_map)
        else:  # "auto"
            names = [n for n in DENOISERS if n in info.model_index][:1]
            placements = {name: "auto" for name in names}
        for name, target in placements.items():
            cls = info.component_class(name)
            if cls is None:
                raise ConfigError(f"Cannot place component {name!r}: its class is not importable.")
            plan.components[name] = partial(self._load_placed, name, cls, target)
        return plan

    def _load_placed(self, name: str, cls: type[Union[ModelMixin, PreTrainedModel]], target: str, info: PipelineInfo,
                     dtype: torch.dtype, **from_pretrained: object) -> torch.nn.Module:
        kwargs: dict[str, Any] = dict(from_pretrained)  # quantization_config
        if target == "auto":
            kwargs.update(device_map="auto", max_memory=self.accelerate_max_memory())
            if self.offload_folder:
                Path(self.offload_folder, f"rank{self.global_rank}-{name}").mkdir(parents=True, exist_ok=True)
                kwargs["offload_folder"] = str(Path(self.offload_folder, f"rank{self.global_rank}-{name}"))
        else:
            kwargs["device_map"] = {"": self._resolve(target)}
        model = cls.from_pretrained(info.path, subfolder=name, dtype=dtype, **kwargs)
        self._placed.add(name)
        return model

    def _resolve(self, target: str) -> str:
        """``cuda:N`` in a mapping counts from this process's first GPU, like max_memory."""
        device = torch.device(target)
        if device.type == "cuda" and device.index is not None:
            gpus = self.gpu_indices()
            if device.index >= len(gpus):
                raise ConfigError(f"device_map names {target}, but this process spans {len(gpus)} GPU(s).")
            return f"cuda:{gpus[device.index]}"
        return target

    def model_to_device(self) -> None:
        assert self.lightning_module is not None
        pipeline_class = type(self.lightning_module.pipeline).__name__
        stage_resident = set(stages_for(pipeline_class).encoders) | {"vae"} if self.staged else set()
        module = self.lightning_module
        components: dict[str, Any] = dict(module.components) if isinstance(module, DiffusionModel) else {}
        for name, component in components.items():
            if name in self._placed:
                continue
            component.to("cpu" if name in stage_resident else self.root_device)

    def setup_pipeline(self, pipeline: DiffusionPipeline) -> Union[DiffusionPipeline, StagedPipeline]:
        """Report where each component went; wrap the pipeline in its stages when ``staged``."""
        placement = []
        for name, component in pipeline.components.items():
            if isinstance(component, torch.nn.Module):
                where = getattr(component, "hf_device_map", None) or str(next(component.parameters()).device)
                placement.append(f"{name}: {where}")
        log.info(f"rank {self.global_rank} device map: " + "; ".join(placement), extra={"all_ranks": True})
        if not self.staged:
            return pipeline
        log.info(f"staged: encode, denoise, decode per batch; encoders and VAE on {self.root_device} only in their "
                 "stage")
        return StagedPipeline(pipeline, self.root_device)
