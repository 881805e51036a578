"""Records checked against the pipeline, before any weight loads: the allow-list of record fields,
each distinct set of call arguments once (every record that has it shares its verdict), input
fields and files record by record. ``records.RecordVerdicts`` holds the outcome.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, Optional, Sequence

from lightning_diffusion.core.checks import MAX_PIXELS, SEED_MAX
from lightning_diffusion.core.records import CallArgs
from lightning_diffusion.input.images import file_problems
from lightning_diffusion.input.records import CallArgSet, RecordVerdicts, as_records
from lightning_diffusion.pipelines.checks import call_arg_problems

if TYPE_CHECKING:
    from lightning_diffusion.pipelines.model_folder import PipelineInfo


def check_records(info: PipelineInfo, records: Sequence[object], call_args: Optional[CallArgs] = None,
                  inputs_root: Optional[str] = None, max_pixels: Optional[int] = None,
                  num_images_per_prompt: int = 1, adapters: Collection[str] = ()) -> RecordVerdicts:
    """Every record against the pipeline ``info`` describes: the lines rejected while reading, each
    distinct set of call arguments (``pipelines.checks.call_arg_problems``, with the config's
    ``call_args`` under it), input fields the pipeline needs or cannot take, a negative prompt it
    cannot take, seeds that leave the generator's range, adapters that ``adapters`` (the names
    ``model.adapters`` declares) does not name, and input files (``inputs.file_problems``).
    Rejected sets leave the summary the strategies read. The outcome is kept on ``records`` (the
    launching process checks, then runs as rank 0 with the same records)."""
    records = as_records(records)
    max_pixels = max_pixels or MAX_PIXELS
    key = json.dumps([info.path, info.class_name, call_args, inputs_root, max_pixels, num_images_per_prompt,
                      sorted(adapters)], sort_keys=True, default=repr)
    if records.verdicts is not None and records._verdicts_key == key:
        return records.verdicts
    summary = records.summary
    reasons: dict[int, str] = {}
    for set_id, entry in enumerate(summary.sets):
        found = call_arg_problems(info, entry.overrides, base=call_args, max_pixels=max_pixels, record=True)
        found += _field_problems(info, entry)
        found += _adapter_problems(entry.adapters, adapters)
        if found:
            reasons[set_id] = " ".join(found)
    rejected = dict(records.bad)
    for position in summary.positions(list(reasons)):
        rejected[position] = (records.source(position), reasons[summary.set_of[position]])
    for position, seed in summary.large_seeds.items():
        if position not in rejected and seed + num_images_per_prompt - 1 > SEED_MAX:
            rejected[position] = (records.source(position), f"seed {seed} + {num_images_per_prompt - 1} (its last "
                                  "copy's) passes the generator's largest seed, 2**64 - 1.")
    with_inputs = [i for i, entry in enumerate(summary.sets) if entry.with_inputs]
    if with_inputs:
        found_files = file_problems(records, summary.positions(with_inputs), inputs_root, max_pixels)
        for position, problems in found_files.items():
            before = rejected.get(position, (records.source(position), ""))
            rejected[position] = (before[0], " ".join(filter(None, [before[1], *problems])))
    summary.rejected_sets = frozenset(reasons)
    records.verdicts, records._verdicts_key = RecordVerdicts(rejected), key
    return records.verdicts


def _adapter_problems(chosen: Optional[Mapping[str, Any]], declared: Collection[str]) -> list[str]:
    """A record's adapters that ``model.adapters`` does not declare."""
    if chosen is None:
        return []
    if not declared:
        return ["it chooses adapters, and model.adapters declares none (model.adapters: {NAME: {path: ...}})."]
    unknown = [name for name in chosen if name not in declared]
    return [f"it chooses {', '.join(repr(n) for n in unknown)}, which model.adapters does not declare (it declares "
            f"{', '.join(sorted(declared))})."] if unknown else []


def _field_problems(info: PipelineInfo, entry: CallArgSet) -> list[str]:
    """Input fields and a negative prompt that this pipeline (or these weights) cannot take or needs."""
    problems = []
    for name in entry.with_inputs:
        if name not in info.call_parameters:
            hint = "".join(f" ({task})" for field_name, task in info.spec.tasks if field_name == name)
            problems.append(f"it has {name}, which {info.class_name} does not take{hint}.")
    if info.spec.input_if_config is not None:  # an input these weights either need or cannot take
        name, key = info.spec.input_if_config
        needed = info.configs.get("transformer", {}).get(key) is not None
        if name in entry.with_inputs and not needed:
            problems.append(f"it has {name}, which these {info.class_name} weights cannot take (their transformer "
                            f"config sets no {key}).")
        if name in entry.without_inputs and needed:
            problems.append(f"it has no {name}, which these {info.class_name} weights need (their transformer config "
                            f"sets {key}).")
    for name in info.needed_inputs:
        if name in entry.without_inputs:
            problems.append(f"it has no {name}, which {info.class_name} needs (a path in the record: "
                            f"{{\"prompt\": ..., \"{name}\": \"in/0001.png\"}}).")
    if entry.first_negative is not None and "negative_prompt" not in info.call_parameters:
        problems.append(f"it has a negative_prompt, which {info.class_name} does not take.")
    return problems
