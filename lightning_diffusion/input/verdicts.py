"""The records a pipeline cannot make, found once for the job: global rank 0 checks them (reading each
input file once), every rank learns its verdicts and refuses or skips alike.

``RecordChecks`` holds what the checks read of the model; ``DiffusionModule`` holds one, and its
``setup`` runs it before the batch plan.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, Optional, Protocol, TypeVar

from lightning_diffusion.core.console import log
from lightning_diffusion.core.errors import raise_problems
from lightning_diffusion.input.data import PromptDataModule
from lightning_diffusion.input.record_checks import check_records
from lightning_diffusion.input.records import RecordVerdicts
from lightning_diffusion.output.boundaries import run_strategy
from lightning_diffusion.pipelines.checks import model_cache_problems, pixel_problems

if TYPE_CHECKING:
    from lightning_diffusion.pipelines.model_folder import PipelineInfo

T = TypeVar("T")


class JobRanks(Protocol):
    """What agreeing on the verdicts reads of the run's strategy (every Lightning strategy has these
    once its processes have started, though its base class does not declare the ranks)."""

    @property
    def global_rank(self) -> int:
        ...

    @property
    def world_size(self) -> int:
        ...

    def broadcast(self, obj: T, src: int = 0) -> T:
        ...


class RecordChecks:
    """The records the pipeline of ``info`` cannot make with the config's ``call_args`` (before
    per-record overrides) and step ``cache`` (``None``: none), and the problems that refuse the run."""

    def __init__(self, info: PipelineInfo, call_args: Mapping[str, Any], cache: Optional[Mapping[str, Any]],
                 adapters: Collection[str] = ()) -> None:
        self.info = info
        self.adapters = tuple(adapters)  # the names model.adapters declares
        self.call_args = dict(call_args)
        self.cache = cache

    def record_verdicts(self, data: PromptDataModule) -> tuple[RecordVerdicts, list[str]]:
        """The records of ``data`` this pipeline cannot make, and the problems that refuse the run
        whatever ``on_bad_record`` says (a size over the budget in the config, a cache that does not
        suit the records' guidance passes, no record left)."""
        settings = data.settings
        verdicts = check_records(self.info, data.records, dict(self.call_args), settings.inputs_root,
                                 settings.max_pixels, settings.num_images_per_prompt, self.adapters)
        problems = [f"model: {p}" for p in pixel_problems(self.info, self.call_args, settings.max_pixels)]
        if self.cache is not None:
            problems += model_cache_problems(self.info, self.cache, self.call_args, data.records.summary)
        problems += verdicts.refusal(len(data.records), data.settings.on_bad_record)
        return verdicts, problems

    def agreed_verdicts(self, data: PromptDataModule, strategy: Optional[JobRanks]) -> RecordVerdicts:
        """``record_verdicts`` as global rank 0 finds them (it reads each input file once for the
        job), on every rank of ``strategy`` (``None``: no Trainer, one process); raises its problems
        on every rank. Ranks started by the CLI, whose launching process checked the same command
        line, skip it when bad records refuse the run."""
        ours = run_strategy(strategy)
        context = ours.run_context if ours is not None else None
        if context is not None and context.checked and data.settings.on_bad_record == "fail":
            return RecordVerdicts()  # none, or the launching process would have refused
        outcome: tuple[Optional[RecordVerdicts], list[str]] = (None, [])
        if strategy is None or strategy.global_rank == 0:
            outcome = self.record_verdicts(data)
        if strategy is not None and strategy.world_size > 1:
            outcome = strategy.broadcast(outcome)
        verdicts, problems = outcome
        raise_problems(problems)
        assert verdicts is not None
        if verdicts and (strategy is None or strategy.global_rank == 0):
            log.warning(f"data.on_bad_record: skip: {len(verdicts.rejected):,} of {len(data.records):,} prompt records "
                        "cannot be made; they are listed in rejected.jsonl")
        return verdicts
