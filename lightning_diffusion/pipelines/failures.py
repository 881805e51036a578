"""A pipeline call's failures: what ``data.on_error`` does with them, the agreement of a replica's
ranks on each step of a call, and the out-of-memory retry one record at a time.

``CallRunner`` runs one call (the module's ``generate``, passed in) and turns its failure into a
failed record (``on_error: skip``) or a ``RecordFailure`` that names the records (``fail``);
``DiffusionModule`` holds one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Protocol, TypeVar

import numpy as np
import torch

from lightning_diffusion.core.console import log
from lightning_diffusion.core.errors import RecordFailure
from lightning_diffusion.core.records import CallArgs, Sample

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Outcome = tuple[Optional[np.ndarray], Optional[dict], Optional[str]]
T = TypeVar("T")


class Generate(Protocol):
    """One pipeline call for ``samples`` (``DiffusionModule.generate``): their images and the
    parameters that made each; ``agree``: the replica's ranks agree on each step (``CallRunner.step``)."""

    def __call__(self, samples: list[Sample], agree: bool = False
                 ) -> tuple[list[np.ndarray], list[CallArgs]]:
        ...


class CallRunner:
    """Runs pipeline calls under ``data.on_error``.

    ``pad_batches``: the model's setting, owned here: the module pads a call to the batch size
    (``DiffusionModule.prepare_call``) while it is on, and ``run_call`` turns it off while it
    retries the samples of a call that ran out of memory one at a time. ``call_batch``: the most
    prompts the pipeline takes in one call (``PipelineSpec.call_batch``; ``None``: no limit).
    ``on_error``: the data module's (``fail`` until the module's ``setup`` sets it). ``group``: the
    process group of the ranks that make the same images (the module's ``use_group``; ``None``:
    one process per replica), over which each step of a call is agreed."""

    def __init__(self, pad_batches: bool, call_batch: Optional[int], on_error: str = "fail",
                 group: Optional[ProcessGroup] = None) -> None:
        self.pad_batches = pad_batches
        self.call_batch = call_batch
        self.on_error = on_error
        self.group = group

    def run_call(self, samples: list[Sample], generate: Generate, batch_size: Optional[int],
                 rank: int) -> list[Outcome]:
        """(image, params, None) for each sample of one pipeline call (``generate``), or (None, None,
        reason) for a sample whose call failed or whose image is not finite. With ``on_error: fail``
        a failure raises ``RecordFailure`` naming its records; with ``skip`` the ranks of the replica
        agree on each step of the call (``step``), and out of memory retries the samples one at a
        time. ``batch_size``: the batch size the call was padded to; ``rank``: this process's global
        rank, for the messages."""
        skip = self.on_error == "skip"
        images, params, failure = None, None, None
        try:
            images, params = generate(samples, agree=True) if skip else generate(samples)
        except Agreed as agreed:
            failure = agreed.reason
        except Exception as err:
            if not skip:
                raise RecordFailure(f"{which(samples)} failed: {last_line(err)}") from err
            log_traceback(samples, err)
            failure = last_line(err)  # one rank, no group: nothing to agree
        if failure is not None:
            padded = self.pad_batches and min(batch_size or 1, self.call_batch or 1 << 30) > 1
            if failure.startswith(OOM_NAMES) and (len(samples) > 1 or padded):
                log.warning(f"[rank {rank}] {which(samples)}: out of memory; retrying one record at a "
                            "time, unpadded", extra={"all_ranks": True})
                free_memory()
                return [outcome for sample in samples
                        for outcome in self._run_alone(sample, generate, batch_size, rank)]
            return [(None, None, failure)] * len(samples)
        assert images is not None and params is not None  # the call returned them (no failure)
        outcomes: list[Outcome] = []
        for sample, image, param in zip(samples, images, params):
            if np.isfinite(image).all():
                outcomes.append((image, param, None))
            elif skip:
                outcomes.append((None, None, NOT_FINITE))
            else:
                raise RecordFailure(f"{which([sample])} failed: {NOT_FINITE}")
        return outcomes

    def _run_alone(self, sample: Sample, generate: Generate, batch_size: Optional[int],
                   rank: int) -> list[Outcome]:
        """One sample in a call of its own, unpadded (after out of memory at the batch size)."""
        saved, self.pad_batches = self.pad_batches, False
        try:
            return self.run_call([sample], generate, batch_size, rank)
        finally:
            self.pad_batches = saved

    def agree_on(self, error: Optional[BaseException], device: torch.device) -> None:
        """The replica's ranks agree on one step of a call (``on_error: skip``): when any of them
        failed, every one raises ``Agreed`` with the first failing rank's reason, so that none goes
        on into a collective the failed one never enters. A failure inside the pipeline on some
        ranks only, in the middle of a collective, cannot be agreed: the collective times out.
        ``device``: where the group's collectives take their tensors (the module's device)."""
        group = self.group
        if group is None:
            if error is not None:
                raise Agreed(last_line(error)) from error
            return
        import torch.distributed as dist

        flag = torch.tensor([0 if error is None else 1], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not int(flag.item()):
            return
        reasons: list[Optional[str]] = [None] * dist.get_world_size(group)
        dist.all_gather_object(reasons, None if error is None else last_line(error), group=group)
        reason = next(r for r in reasons if r is not None)
        raise Agreed(reason) from error

    def step(self, agree: bool, device: torch.device, run: Callable[[], T]) -> T:
        """``run()``; with ``agree``, the replica's ranks agree on how it went (``agree_on``) before
        any of them goes on, whether it raised here or elsewhere."""
        if not agree:
            return run()
        try:
            result = run()
        except Exception as err:
            log_traceback(None, err)
            self.agree_on(err, device)
            raise  # agree_on raised (with one rank, too): not reached
        self.agree_on(None, device)
        return result


class Agreed(Exception):
    """A step of a pipeline call failed on some rank of the replica; every rank of it raises this."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


NOT_FINITE = "the image has NaN or infinite pixels (a numerical overflow: try torch_dtype bfloat16 or float32)"
OOM_NAMES = ("OutOfMemoryError", "torch.OutOfMemoryError")


def last_line(err: BaseException) -> str:
    """The exception's type and the last line of its message (CUDA's out-of-memory message is a
    paragraph whose first line is what matters: kept whole for it)."""
    text = str(err).strip()
    line = text.splitlines()[0 if isinstance(err, torch.OutOfMemoryError) else -1] if text else ""
    return f"{type(err).__name__}: {line}" if line else type(err).__name__


def log_traceback(samples: Optional[list[Sample]], err: BaseException) -> None:
    """With ``--verbose``, a failed call's full traceback on the rank where it failed (the record
    and the run go on as ``on_error`` says; without it, one line names the exception)."""
    from lightning_diffusion.core import console

    if console.verbose():
        where = which(samples) if samples else "a pipeline call"
        log.warning(f"{where} failed:", exc_info=err, extra={"all_ranks": True})


def which(samples: list[Sample]) -> str:
    """``image 4 (prompts.jsonl:5)``, or the images of a call."""
    real = [s for s in samples if not s.get("padding")]
    named = [f"{s['index']} ({s['source']})" if s.get("source") else str(s["index"]) for s in real[:4]]
    more = f" and {len(real) - 4} more" if len(real) > 4 else ""
    return f"image{'s' if len(real) > 1 else ''} {', '.join(named)}{more}"


def free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
