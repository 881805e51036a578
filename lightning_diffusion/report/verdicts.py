"""``eval``'s verdicts, for the report page: the result that ``lightning-diffusion eval OUT --json
FILE.json`` writes (each image's prompt adherence and its difference from a reference, the
summary), read back and matched to the outputs by index, prompt and seed (a result of another
folder matches nothing). The report reads ``OUT/eval.json`` where it is, or the file given.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TypedDict, cast

from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.report.collect import Record

EVAL_FILE = "eval.json"  # where ``eval OUT --json OUT/eval.json`` leaves it for the report


# eval's result as its JSON file holds it (``commands.eval`` writes it, this module reads it back).
class EvalRow(TypedDict, total=False):
    """One image of eval's result: its ``index``, ``prompt`` and ``seed``; against a reference its
    ``max_abs`` difference, ``psnr`` and ``ssim``; for a shapes caption what was ``detected`` and
    each ``adherence`` check."""

    index: int
    prompt: Optional[str]
    seed: Optional[int]
    max_abs: float
    psnr: float
    ssim: float
    detected: dict[str, object]
    adherence: dict[str, bool]


class EvalSummary(TypedDict, total=False):
    """eval's summary: the ``images`` judged in ``folder``, the ``reference`` comparison, each
    adherence check's share, FID and KID (``fid``) and the CLIP score."""

    images: int
    folder: str
    reference: dict[str, Any]
    adherence: dict[str, dict[str, float]]
    fid: dict[str, Any]
    clip_score: float


class EvalResult(TypedDict):
    summary: EvalSummary
    images: list[EvalRow]


@dataclass(frozen=True)
class Verdict:
    """One image's verdict: the words the page shows, and whether every adherence check passed."""

    text: str
    ok: bool


@dataclass
class Verdicts:
    source: str  # the eval result read
    by_index: dict[int, Verdict]
    summary: str  # the eval's summary in one line


def _psnr(value: Any) -> str:
    number = float(value)  # "inf" (identical images) included
    return "PSNR inf" if math.isinf(number) else f"PSNR {number:.1f} dB"


def verdict(row: EvalRow) -> Optional[Verdict]:
    """The verdict of one of eval's rows; None for a row that judged nothing (no reference, not a
    caption the shapes detector reads)."""
    adherence = row.get("adherence") or {}
    parts = [f"{key} {'✓' if passed else '✗'}" for key, passed in adherence.items()]
    if "psnr" in row:
        parts.append(f"{_psnr(row['psnr'])}, SSIM {float(row['ssim']):.3f}")
    return Verdict(" · ".join(parts), all(adherence.values())) if parts else None


def summary_line(summary: EvalSummary) -> str:
    parts = [f"{summary.get('images', 0):,} images judged"]
    for key, share in (summary.get("adherence") or {}).items():
        parts.append(f"{key} right in {100 * float(share['share']):.0f}% of {share['images']:,}")
    reference = summary.get("reference")
    if reference:
        parts.append(f"against {reference['folder']}: {_psnr(reference['psnr_mean'])} mean, "
                     f"SSIM {float(reference['ssim_mean']):.3f} mean")
    if summary.get("fid"):
        parts.append(f"FID {float(summary['fid']['fid']):.2f}")
    if summary.get("clip_score") is not None:
        parts.append(f"CLIP score {float(summary['clip_score']):.2f}")
    return "; ".join(parts)


def read_verdicts(path: Path, records: list[Record]) -> Verdicts:
    """The verdicts of eval's result ``path`` for ``records``. Raises ``ConfigError`` (one line)
    for a file that is not an eval result."""
    try:
        result = json.loads(path.read_text())
        rows, summary = result["images"], result["summary"]
        assert isinstance(rows, list) and isinstance(summary, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise ConfigError(f"--eval {path} is not the result of lightning-diffusion eval (eval OUT --json "
                          "FILE.json writes one).") from None
    by_index = {record.index: record for record in records}
    found: dict[int, Verdict] = {}
    for row in rows:
        record = by_index.get(row["index"]) if isinstance(row, dict) and isinstance(row.get("index"), int) else None
        if record is None or row.get("prompt") != record.prompt or row.get("seed") != record.seed:
            continue  # another folder's image, or one made again since
        judged = verdict(row)
        if judged is not None:
            found[record.index] = judged
    return Verdicts(str(path), found, summary_line(cast(EvalSummary, summary)))
