"""A pipeline call's failures: what ``data.on_error`` does with them, the agreement of a replica's
ranks on each step of a call, and the out-of-memory retry one record at a time.

``CallFailures`` is the part of ``DiffusionModule`` that runs one call (``generate``) and turns its
failure into a failed record (``on_error: skip``) or a ``RecordFailure`` that names the records
(``fail``).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from lightning_diffusion.console import log
from lightning_diffusion.errors import RecordFailure

Outcome = tuple[Optional[np.ndarray], Optional[dict], Optional[str]]


class CallFailures:
    """Mixed into ``DiffusionModule``: ``run_call`` around its ``generate``."""

    on_error: str
    pad_batches: bool
    batch_size: Optional[int]
    replica_group: Any
    info: Any
    global_rank: int
    device: torch.device

    def generate(self, samples: list[dict[str, Any]], agree: bool = False
                 ) -> tuple[list[np.ndarray], list[dict[str, Any]]]:
        raise NotImplementedError  # DiffusionModule's

    def run_call(
        self, samples: list[dict[str, Any]]
    ) -> list[Outcome]:
        """(image, params, None) for each sample of one pipeline call, or (None, None, reason) for
        a sample whose call failed or whose image is not finite. With ``on_error: fail`` a failure
        raises ``RecordFailure`` naming its records; with ``skip`` the ranks of the replica agree on
        each step of the call (``_agree``), and out of memory retries the samples one at a time."""
        skip = self.on_error == "skip"
        images, params, failure = None, None, None
        try:
            images, params = self.generate(samples, agree=True) if skip else self.generate(samples)
        except Agreed as agreed:
            failure = agreed.reason
        except Exception as err:
            if not skip:
                raise RecordFailure(f"{which(samples)} failed: {last_line(err)}") from err
            log_traceback(samples, err)
            failure = last_line(err)  # one rank, no group: nothing to agree
        if failure is not None:
            padded = self.pad_batches and min(self.batch_size or 1, self.info.spec.call_batch or 1 << 30) > 1
            if failure.startswith(OOM_NAMES) and (len(samples) > 1 or padded):
                log.warning(f"[rank {self.global_rank}] {which(samples)}: out of memory; retrying one record at a "
                            "time, unpadded", extra={"all_ranks": True})
                free_memory()
                return [outcome for sample in samples for outcome in self._run_alone(sample)]
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

    def _run_alone(self, sample: dict[str, Any]) -> list[Outcome]:
        """One sample in a call of its own, unpadded (after out of memory at the batch size)."""
        saved, self.pad_batches = self.pad_batches, False
        try:
            return self.run_call([sample])
        finally:
            self.pad_batches = saved

    def _agree(self, error: Optional[BaseException]) -> None:
        """The replica's ranks agree on one step of a call (``on_error: skip``): when any of them
        failed, every one raises ``Agreed`` with the first failing rank's reason, so that none goes
        on into a collective the failed one never enters. A failure inside the pipeline on some
        ranks only, in the middle of a collective, cannot be agreed: the collective times out."""
        group = self.replica_group
        if group is None:
            if error is not None:
                raise Agreed(last_line(error)) from error
            return
        import torch.distributed as dist

        flag = torch.tensor([0 if error is None else 1], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not int(flag.item()):
            return
        reasons: list[Optional[str]] = [None] * dist.get_world_size(group)
        dist.all_gather_object(reasons, None if error is None else last_line(error), group=group)
        reason = next(r for r in reasons if r is not None)
        raise Agreed(reason) from error

    def _step(self, agree: bool, step: Any, *args: Any) -> Any:
        """``step(*args)``; with ``agree``, the replica's ranks agree on how it went (``_agree``)
        before any of them goes on, whether it raised here or elsewhere."""
        if not agree:
            return step(*args)
        try:
            result = step(*args)
        except Exception as err:
            log_traceback(None, err)
            self._agree(err)
            raise  # _agree raised (with one rank, too): not reached
        self._agree(None)
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


def log_traceback(samples: Optional[list[dict[str, Any]]], err: BaseException) -> None:
    """With ``--verbose``, a failed call's full traceback on the rank where it failed (the record
    and the run go on as ``on_error`` says; without it, one line names the exception)."""
    from lightning_diffusion import console

    if console.verbose():
        where = which(samples) if samples else "a pipeline call"
        log.warning(f"{where} failed:", exc_info=err, extra={"all_ranks": True})


def which(samples: list[dict[str, Any]]) -> str:
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
