"""``lightning-diffusion plan``: choose a strategy from the resource that is short.

    lightning-diffusion plan --model black-forest-labs/FLUX.1-dev --gpus 8 --gpu-memory 80GB \\
        [--interconnect nvlink|pcie] [--height 1024 --width 1024 --frames 81] [--prompts 10000]
        [--goal throughput|latency] [--write plan.yaml]

Component sizes come from the safetensors headers of a local pipeline folder (no weight is read)
or, for the models below, from a table of their published sizes. The decision follows the
diffusers guide: many prompts and the pipeline fits on one GPU: data parallel; one component too
big for a GPU: tensor parallel over NVLink, a device map over PCIe; a long sequence: context
parallel, Ulysses while the heads divide, Unified (ring x Ulysses) beyond; both: TP x CP.

The goal is throughput by default: data parallelism is the only strategy that scales images per
second linearly, so when the pipeline fits on one GPU and there are at least as many prompts as
GPUs, every GPU is a replica, however long the sequence; a model that needs several GPUs gets the
smallest group that holds it, and the rest of the GPUs are replicas of that group. ``--goal
latency`` (or fewer prompts than GPUs) spends GPUs on each image instead: context parallel for long
sequences.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from lightning_diffusion.commands import help_text
from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.pipelines.specs import PipelineSpec, all_published, cfg_supported, published

# Beyond this many tokens per image one GPU spends most of its time in attention and its
# activations grow large: split the sequence (the guide's "long sequences").
LONG_SEQUENCE = 16_384
_HEADROOM = 0.9  # of GPU memory usable for weights and activations
# Rule of thumb for expected throughput, not a measurement: a model-parallel group (context or
# tensor parallel) keeps this fraction of linear speed-up per doubling of its size (per-layer or
# per-attention exchanges); a device map runs one GPU at a time, so its group makes one GPU's rate.
GROUP_EFFICIENCY = {"nvlink": 0.85, "pcie": 0.6}


@dataclass
class ModelFacts:
    """Sizes ``plan`` decides on: components in GB, the transformer's heads, hidden size and layers,
    pixels per token side, text tokens, the pipeline's resolved spec (token geometry, CFG), and the
    model-parallel modes ``predict`` runs it with (``context``: a subset of ulysses and ring;
    ``tensor``), so that no plan recommends a layout ``predict`` refuses."""

    name: str
    components: dict[str, float]
    heads: int
    hidden: int
    layers: int
    pixels_per_token: int = 16
    text_tokens: int = 512
    pipeline: str = ""
    spec: PipelineSpec = field(default_factory=lambda: PipelineSpec(""))
    context: tuple[str, ...] = ()
    tensor: bool = False
    cp_plan: bool = False
    cp_refusal: Optional[str] = None  # why context parallelism cannot run it although it has a _cp_plan
    sizes: bool = True  # the pipeline's call takes height and width (an image-to-image call takes its input's)

    @property
    def total_gb(self) -> float:
        return sum(self.components.values())

    @property
    def denoiser_gb(self) -> float:
        return max(self.components.get("transformer", 0.0), self.components.get("unet", 0.0))


def facts_for(model: str) -> ModelFacts:
    from lightning_diffusion.strategies.checks import context_modes, context_refusal

    known = published(model)
    if known is not None:
        entry, sizes = known
        spec = entry.resolved()
        return ModelFacts(model, dict(sizes.components), sizes.heads, sizes.hidden, sizes.layers,
                          pixels_per_token=spec.pixels_per_token, text_tokens=sizes.text_tokens,
                          pipeline=spec.class_name, spec=spec, context=context_modes(spec, None),
                          tensor=spec.has_plan("_tp_plan"), cp_plan=spec.has_plan("_cp_plan"),
                          cp_refusal=spec.cp_refused)
    from lightning_diffusion.pipelines.model_folder import component_bytes, inspect_pipeline

    info = inspect_pipeline(model)
    folder = Path(info.path)
    if not folder.is_dir():
        raise ConfigError(f"plan: {model} is not a local folder and not one of: {', '.join(all_published())}.")
    components = {name: size / 1e9 for name, size in component_bytes(folder).items()}
    config = info.configs.get("transformer", {})
    heads = int(config.get("num_attention_heads", 1))
    hidden = heads * int(config.get("attention_head_dim", 64))
    layers = int(config.get("num_layers", 1)) + int(config.get("num_single_layers", 0))
    text = info.sequence_lengths(1, 1, {}).get("text", 512) if info.spec.text_length_arg else 512
    return ModelFacts(model, components, heads, hidden, layers, pixels_per_token=info.size_multiple,
                      text_tokens=text, pipeline=info.class_name, spec=info.spec,
                      context=context_modes(info.spec, info.facts), tensor=bool(info.facts.tp_plan),
                      cp_plan=bool(info.facts.cp_plan), cp_refusal=context_refusal(info.spec, info.facts),
                      sizes={"height", "width"} <= info.call_parameters)


def context_note(facts: ModelFacts) -> str:
    """Why context parallelism is limited or absent for this pipeline, in a few words."""
    if not facts.cp_plan:
        return "its transformer has no _cp_plan in diffusers"
    if facts.cp_refusal:
        return facts.cp_refusal
    if not facts.context:
        return "its text attention mask is split with the sequence, which diffusers' attention does not follow"
    from lightning_diffusion.strategies.checks import ULYSSES_ANYTHING_2

    if facts.context == (ULYSSES_ANYTHING_2,):
        return "its text has each prompt's own length and a mask: Ulysses-anything over 2 GPUs only"
    return (f"Ulysses only, its text mask rules out ring, and {facts.heads} heads allow Ulysses degrees that "
            "divide them")


def cfg_note(facts: ModelFacts) -> str:
    """Whether CFG parallel (``cfg: 2``) applies to this model's pipeline."""
    entry = facts.spec.cfg
    if entry is None:
        return f"cfg parallel: not available for {facts.pipeline or 'this pipeline'} (supported: {cfg_supported()})"
    when = f"{entry.scale_arg} > 1" + (" and a negative prompt per image" if entry.needs_negative_prompt else "")
    return (f"cfg parallel: {facts.pipeline} runs two transformer passes per step with {when}; MeshStrategy "
            "cfg: 2 runs them on two GPUs at once (pairs of GPUs, times the degrees above)")


@dataclass
class Plan:
    strategy: str
    init_args: dict = field(default_factory=dict)
    devices: int = 1
    reasons: list[str] = field(default_factory=list)
    group: int = 1  # GPUs that make one image together
    replicas: int = 1

    def rate(self, interconnect: str) -> float:
        """Expected images per hour relative to one GPU running the whole pipeline (``GROUP_EFFICIENCY``)."""
        if self.group == 1 or self.strategy == "DeviceMapStrategy":
            per_group = 1.0
        else:
            per_group = self.group * GROUP_EFFICIENCY[interconnect] ** math.log2(self.group)
        return self.replicas * per_group

    def label(self) -> str:
        if self.strategy == "data_parallel":
            return f"data_parallel ({self.replicas} replicas)"
        degrees = ", ".join(f"{k} {v}" for k, v in self.init_args.items() if isinstance(v, int) and v > 1)
        replicas = f", {self.replicas} replicas" if self.replicas > 1 else ""
        return f"{self.strategy} ({degrees or 'one group'}{replicas})"

    def config(self, facts: ModelFacts, height: int, width: int, frames: Optional[int]) -> dict:
        strategy = self.strategy if not self.init_args else {
            "class_path": f"lightning_diffusion.strategies.{self.strategy}", "init_args": self.init_args}
        model: dict[str, Any] = {"pretrained_model_name_or_path": facts.name, "torch_dtype": "bfloat16"}
        if facts.sizes:  # only what ``predict`` accepts: an image-to-image call's size is its input's
            model.update(height=height, width=width)
        if frames:
            model["num_frames"] = frames
        return {"trainer": {"accelerator": "gpu", "devices": self.devices, "strategy": strategy}, "model": model,
                "data": {"prompts": "prompts.jsonl", "batch_size": 1}, "writer": {"output_dir": "outputs"}}


def tokens(facts: ModelFacts, height: int, width: int, frames: Optional[int]) -> int:
    return facts.spec.image_tokens(height, width, frames, facts.pixels_per_token) + facts.text_tokens


def activation_gb(facts: ModelFacts, sequence: int) -> float:
    """Peak activations of one image with memory-efficient attention: a few hidden-size tensors per
    token (the MLP's 4x expansion dominates), in bf16."""
    return sequence * facts.hidden * 2 * 12 / 1e9


def choose(facts: ModelFacts, gpus: int, gpu_gb: float, interconnect: str, height: int, width: int,
           frames: Optional[int], prompts: int, goal: str = "throughput") -> Plan:
    usable = gpu_gb * _HEADROOM
    sequence = tokens(facts, height, width, frames)
    act = activation_gb(facts, sequence)
    long = sequence > LONG_SEQUENCE or act > usable / 4
    numbers = (f"weights {facts.total_gb:.1f} GB (transformer {facts.denoiser_gb:.1f} GB), {sequence:,} tokens "
               f"(about {act:.1f} GB of activations per image), {gpus} x {gpu_gb:g} GB GPUs over {interconnect}")
    fits_whole = facts.total_gb + act <= usable
    fits_denoiser = facts.denoiser_gb + act <= usable

    def cp_degrees(group: int) -> Optional[dict]:
        """Ulysses while the heads divide, ring for the rest; None when the pipeline's context
        parallelism (``facts.context``) cannot split the group that way."""
        from lightning_diffusion.strategies.checks import ULYSSES_ANYTHING_2

        if facts.context == (ULYSSES_ANYTHING_2,):  # a prompt-length text with its mask (Qwen-Image)
            return {"ulysses_degree": 2, "ring_degree": 1, "ulysses_anything": True} if group == 2 else None
        if "ulysses" not in facts.context and "ring" not in facts.context:
            return None
        ulysses = max(d for d in range(1, group + 1) if group % d == 0 and facts.heads % d == 0
                      and (d == 1 or "ulysses" in facts.context))
        if group // ulysses > 1 and "ring" not in facts.context:
            return None
        return {"ulysses_degree": ulysses, "ring_degree": group // ulysses}

    throughput = goal == "throughput" and prompts >= gpus
    if fits_whole and (not long or throughput or gpus == 1):
        why = "" if not long else (
            "; the sequence is long, but replicas scale throughput linearly and context parallel does not "
            "(--goal latency splits each image over the GPUs instead)")
        return Plan("data_parallel", devices=gpus, group=1, replicas=gpus, reasons=[
            numbers, f"the whole pipeline fits on one GPU: {gpus} replicas split the {prompts:,} prompts{why}"])
    degrees = cp_degrees(gpus) if fits_denoiser and long else None
    if degrees is not None:
        group = gpus
        mode = "Ulysses" if degrees["ring_degree"] == 1 else "Unified (ring x Ulysses)"
        return Plan("ContextParallelStrategy", degrees, devices=gpus, group=group, reasons=[
            numbers, f"the sequence is long: split it over {group} GPUs with {mode}; "
                     f"{facts.heads} heads allow Ulysses up to {degrees['ulysses_degree']}"])
    if fits_whole:  # a long sequence this pipeline's context parallelism cannot split
        return Plan("data_parallel", devices=gpus, group=1, replicas=gpus, reasons=[
            numbers, f"the sequence is long, but {facts.pipeline}'s context parallelism cannot split it over "
                     f"{gpus} GPUs ({context_note(facts)}): {gpus} replicas, one image per GPU"])
    staged = facts.spec.stages is not None  # encode / denoise / decode as stages where the spec knows them
    if fits_denoiser:
        # Each component fits, not all together: move whole components, no per-layer traffic.
        return Plan("DeviceMapStrategy", {"device_map": "balanced", "staged": staged,
                                          "devices_per_process": min(gpus, 2)},
                    devices=max(1, gpus // 2), group=min(gpus, 2), replicas=max(1, gpus // 2), reasons=[
            numbers, "each component fits on a GPU but not all of them together: place whole components "
                     "(device_map balanced" + (", staged encode/denoise/decode" if staged else "")
                     + "), replicas on the other GPUs"])
    # The transformer itself does not fit on one GPU.
    shards = next((t for t in (2, 4, 8) if facts.tensor and t <= gpus and facts.denoiser_gb / t + act <= usable
                   and facts.heads % t == 0), None)
    if interconnect == "pcie" or shards is None:
        # The fewest GPUs whose memory holds the model, a divisor of the count so that none idles: the
        # others are replicas of that group.
        per = next((k for k in range(2, gpus + 1) if gpus % k == 0 and facts.total_gb / k + act <= usable), gpus)
        per = per if throughput else gpus
        replicas = gpus // per
        return Plan("DeviceMapStrategy", {"device_map": "auto", "staged": staged, "devices_per_process": per},
                    devices=replicas, group=per, replicas=replicas, reasons=[
            numbers, "the transformer does not fit on one GPU and "
                     + ("PCIe is too slow for per-layer tensor-parallel traffic" if interconnect == "pcie"
                        else "no tensor-parallel degree makes it fit")
                     + f": spread it with device_map auto over {per} GPUs"
                     + (f", {replicas} replicas" if replicas > 1 else "")])
    if long and gpus // shards > 1 and "ulysses" in facts.context and "ring" in facts.context:
        group = gpus // shards
        ulysses = max(d for d in range(1, group + 1) if group % d == 0 and facts.heads % (d * shards) == 0)
        return Plan("MeshStrategy", {"dp": 1, "tp": shards, "ulysses": ulysses, "ring": group // ulysses},
                    devices=gpus, group=gpus, reasons=[
            numbers, f"the transformer needs {shards} GPUs (tensor parallel over NVLink) and the sequence is long: "
                     f"TP {shards} x context parallel {group}"])
    return Plan("TensorParallelStrategy", {"tp_degree": shards}, devices=gpus, group=shards, replicas=gpus // shards,
                reasons=[
        numbers, f"the transformer needs {shards} GPUs: tensor parallel over NVLink, "
                 f"{gpus // shards} replica(s) of tp {shards}"])


def runner_up(facts: ModelFacts, gpus: int, gpu_gb: float, interconnect: str, height: int, width: int,
              frames: Optional[int], prompts: int, goal: str, chosen: Plan) -> Optional[tuple[Plan, str]]:
    """The plan the other goal gives and why it lost to ``chosen`` (None when both goals agree)."""
    if goal == "throughput" and prompts < gpus:  # the choice was already made for latency: show the replicas
        other = choose(facts, gpus, gpu_gb, interconnect, height, width, frames, gpus, "throughput")
    else:
        other_goal = "latency" if goal == "throughput" else "throughput"
        other = choose(facts, gpus, gpu_gb, interconnect, height, width, frames, max(prompts, gpus), other_goal)
    if gpus == 1 or (other.strategy, other.init_args, other.devices) == (chosen.strategy, chosen.init_args,
                                                                         chosen.devices):
        return None
    if goal == "latency":
        why = "more images per hour, but --goal latency spends the GPUs on each image instead"
    elif prompts < gpus:
        why = f"{prompts:,} prompts cannot keep {other.replicas} replicas busy"
    else:
        why = f"fewer images per hour: it spends {other.group} GPUs on each image (--goal latency picks it)"
    return other, why


def describe_rates(chosen: Plan, other: Optional[tuple[Plan, str]], interconnect: str) -> list[str]:
    """The expected-throughput lines ``plan`` prints for its choice and the runner-up."""
    lines = ["expected images per hour relative to one GPU (a rule of thumb: model-parallel groups keep "
             f"{GROUP_EFFICIENCY[interconnect]:.0%} per doubling over {interconnect}; a device map runs one GPU "
             "at a time):",
             f"  1. {chosen.label()}: {chosen.rate(interconnect):.1f}x"]
    if other is not None:
        plan, why = other
        lines.append(f"  2. {plan.label()}: {plan.rate(interconnect):.1f}x, not chosen: {why}")
    return lines


def prompt_set(prompts: str, height: int, width: int) -> tuple[int, dict[tuple[int, int], int], int]:
    """``--prompts``: a count, or a prompt file's record count, its records by size (their own
    ``height`` and ``width``, else ``--height`` and ``--width``), from the buckets of its
    call-argument sets (``records.RecordSummary``; every line is read once), and how many adapter
    sets its records choose (0: none chooses)."""
    if prompts.isdigit():
        return int(prompts), {}, 0
    from lightning_diffusion.input.formats import read_records

    records = read_records(prompts)
    sizes: dict[tuple[int, int], int] = {}
    for entry in records.summary.sets:
        size = (entry.overrides.get("height") or height, entry.overrides.get("width") or width)
        sizes[size] = sizes.get(size, 0) + entry.count
    return len(records), sizes, records.summary.adapter_sets()


ASSUMED_PROMPTS = 1000  # the prompt count a plan assumes when none is given


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-diffusion plan", description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu-memory", required=True, help="per GPU, e.g. 80GB")
    parser.add_argument("--interconnect", choices=["nvlink", "pcie"], default="nvlink")
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--frames", type=int)
    parser.add_argument("--prompts", default=None,
                        help="how many prompts, or a prompt file: its count, and its largest image for memory "
                             f"(default: {ASSUMED_PROMPTS:,}, said in the output)")
    parser.add_argument("--goal", choices=["throughput", "latency"], default="throughput",
                        help="throughput: replicas first (default); latency: split each image over GPUs")
    parser.add_argument("--write", help="write the recommended config (YAML) here")
    args = parser.parse_args(argv)
    if args.gpus < 1:
        parser.error(f"--gpus must be at least 1, got {args.gpus}")
    gpu_gb = float(args.gpu_memory.upper().removesuffix("GB").removesuffix("G"))
    try:
        facts = facts_for(args.model)
    except ConfigError as err:
        print(f"lightning-diffusion plan: error: {err}", file=sys.stderr)
        return 2
    if args.prompts is None:
        print(f"prompt set: none given; planned for {ASSUMED_PROMPTS:,} prompts (--prompts N, or a prompt file, plans "
              "for yours)")
        args.prompts = str(ASSUMED_PROMPTS)
    try:
        args.prompts, sizes, adapter_sets = prompt_set(args.prompts, args.height, args.width)
    except ConfigError as err:
        print(f"lightning-diffusion plan: error: {err}", file=sys.stderr)
        return 2
    if sizes:  # the largest image decides memory and the split of its tokens
        args.height, args.width = max(sizes, key=lambda s: s[0] * s[1])
        shown = ", ".join(f"{h}x{w}: {n:,}" for (h, w), n in sorted(sizes.items(), key=lambda item: -item[1])[:5])
        print(f"prompt set: {args.prompts:,} records by size ({shown}); planned for the largest, "
              f"{args.height}x{args.width}")
    if adapter_sets:
        print(f"prompt set: {adapter_sets:,} adapter sets (model.adapters): a batch has one set, and a replica "
              "switches sets between batches")
    plan = choose(facts, args.gpus, gpu_gb, args.interconnect, args.height, args.width, args.frames, args.prompts,
                  args.goal)
    print(f"recommended: {plan.strategy} {plan.init_args or ''} on {plan.devices} process(es)")
    for reason in plan.reasons:
        print(f"  - {reason}")
    print(f"  - {cfg_note(facts)}")
    other = runner_up(facts, args.gpus, gpu_gb, args.interconnect, args.height, args.width, args.frames,
                      args.prompts, args.goal, plan)
    print("\n".join(describe_rates(plan, other, args.interconnect)))
    text = yaml.safe_dump(plan.config(facts, args.height, args.width, args.frames), sort_keys=False)
    print(text)
    if args.write:
        Path(args.write).write_text(text)
    return 0
