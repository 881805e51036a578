"""The shadow audit (``writer.audit``): a sample of a run's images made again with its accelerators
off, on the same devices with the same seeds, and the drift recorded in ``audit.jsonl``.

An image is in the sample when a hash of its index falls under ``fraction``: the same images for
any number of replicas or nodes, a pool, a job array's shards and a resume, with no coordination.
After each batch, every rank of a replica re-makes the batch's sampled images with every
accelerator off (``DiffusionModule.remake_plain``, ``pipelines.plain``: same seeds, same padding
to the batch size, so nothing but the accelerators differs) and compares the 8-bit images as
written: PSNR and SSIM (torchmetrics) and the largest difference in 8-bit levels; with
``clip_model``, the CLIP scores too (``output.clip``). Identical images have an infinite PSNR
(``Infinity`` in the JSON line, as Python's ``json`` writes and reads it). The re-made images are
kept only with ``keep_baseline`` (``audit/``, never among the outputs).

``on_drift: stop``: when the median PSNR of a replica's last ``window`` audited images falls under
``min_psnr``, the run stops as on a signal (the batch in flight written, the manifest merged) and
exits with ``preemption.DRIFT_EXIT_CODE`` (3); the same command resumes it. ``warn`` says it once
and goes on.

Kept free of torch at import: the config checks import ``audit_problems``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, TypedDict, cast, runtime_checkable

import numpy as np

from lightning_diffusion.core.errors import ConfigError, is_int
from lightning_diffusion.core.groups import group_options
from lightning_diffusion.core.records import AuditSummary, ImageResult, Sample

if TYPE_CHECKING:
    from lightning_diffusion.output.clip import ClipScorer
    from lightning_diffusion.pipelines.plain import Accelerators

AUDIT_FILE = "audit.jsonl"


# What the audit writes: JSON (``audit.jsonl``'s lines), hence TypedDicts; its summary is ``core.records.AuditSummary``.
class Comparison(TypedDict):
    """An image against its re-make: ``psnr`` (dB), ``ssim`` and ``max_diff`` (8-bit levels)."""

    psnr: float
    ssim: float
    max_diff: int


class AuditLine(Comparison, total=False):
    """A line of ``audit.jsonl``: the image's ``index`` and ``seed``, its comparison, the
    ``seconds`` its re-make took, the kept ``baseline`` image's name (``keep_baseline``) and the CLIP
    scores (``clip_model``: the run's ``clip_score``, ``clip_diff`` against the baseline's)."""

    index: int
    seed: int
    seconds: float
    baseline: str
    clip_score: float
    clip_diff: float

BASELINE_DIR = "audit"  # keep_baseline: the re-made images, beside audit.jsonl
ON_DRIFT = ("warn", "stop")
EXAMPLE = "{fraction: 0.01, min_psnr: 30, on_drift: warn}"


@dataclass(frozen=True)
class AuditSettings:
    """``writer.audit``: ``fraction`` of the images audited (0 < fraction <= 1), the PSNR bound in
    dB (``min_psnr``), what a drift does (``on_drift``: ``warn`` or ``stop``) and over how many of
    a replica's last audited images the median is taken (``window``); ``keep_baseline``: the re-made
    images stored in ``audit/`` beside audit.jsonl (PNG; a video's frames as ``.npy``);
    ``clip_model``: a local CLIP model folder, for each image's CLIP score and its difference from
    the baseline's (``output.clip``)."""

    fraction: float = 0.01
    min_psnr: float = 30.0
    on_drift: str = "warn"
    window: int = 5
    keep_baseline: bool = False
    clip_model: Optional[str] = None

    @classmethod
    def of(cls, given: Mapping[str, Any]) -> AuditSettings:
        return cls(**group_options(cls, given, "writer.audit"))


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def audit_problems(given: object) -> list[str]:
    """What is wrong with ``writer.audit`` (``None``: no audit), one line each."""
    if given is None:
        return []
    if not isinstance(given, Mapping):
        return [f"writer.audit must be a mapping such as {EXAMPLE}; got {given!r}."]
    try:
        settings = AuditSettings.of(given)
    except ConfigError as err:
        return [str(err)]
    problems = []
    if not (_is_number(settings.fraction) and 0 < settings.fraction <= 1):
        problems.append(f"writer.audit.fraction must be a number in (0, 1], got {settings.fraction!r} (0.01 audits "
                        "one image in a hundred).")
    if not _is_number(settings.min_psnr):
        problems.append(f"writer.audit.min_psnr must be a number of dB, got {settings.min_psnr!r} (typical: 30).")
    if settings.on_drift not in ON_DRIFT:
        problems.append(f"writer.audit.on_drift must be one of {', '.join(ON_DRIFT)}, got {settings.on_drift!r}.")
    if not is_int(settings.window, 1):
        problems.append(f"writer.audit.window must be an integer >= 1, got {settings.window!r}.")
    if not isinstance(settings.keep_baseline, bool):
        problems.append(f"writer.audit.keep_baseline must be true or false, got {settings.keep_baseline!r}.")
    if settings.clip_model is not None:
        from lightning_diffusion.output.clip import folder_problem

        problems += folder_problem(settings.clip_model, "writer.audit.clip_model")
    return problems


def settings_of(given: Optional[Mapping[str, Any]]) -> Optional[AuditSettings]:
    """The checked settings of ``writer.audit`` (``None``: no audit)."""
    if given is None:
        return None
    problems = audit_problems(given)
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else "; ".join(problems))
    return AuditSettings.of(given)


def hash_value(index: int) -> float:
    """Image ``index``'s place in the audit's order: a hash of the index, uniform in [0, 1)."""
    digest = hashlib.blake2b(f"lightning-diffusion audit {int(index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


def sampled(index: int, fraction: float) -> bool:
    """Whether image ``index`` is audited: its ``hash_value`` under ``fraction``."""
    return hash_value(index) < fraction


def lowest(indices: Sequence[int], count: int) -> list[int]:
    """The ``count`` of ``indices`` a fraction picks first (the lowest ``hash_value``s), sorted: an
    in-run audit's images, where it audited at least ``count`` of them."""
    return sorted(sorted((int(i) for i in indices), key=hash_value)[:count])


def sample_of(indices: Sequence[int], fraction: float) -> list[int]:
    """The audited ones of ``indices``, in their order."""
    return [int(i) for i in indices if sampled(int(i), fraction)]


def compare(made: np.ndarray, plain: np.ndarray) -> Comparison:
    """``made`` (the run's image, or video) against ``plain`` (its re-make without accelerators), both
    as written: 8-bit. ``psnr`` and ``ssim`` (torchmetrics, over the frames of a video), ``max_diff``
    in 8-bit levels."""
    from lightning_diffusion.output.files import to_uint8

    return compare_8bit(to_uint8(np.asarray(made)), to_uint8(np.asarray(plain)))


def compare_8bit(made: np.ndarray, plain: np.ndarray) -> Comparison:
    """``compare`` of two 8-bit images (or videos) as read from their files."""
    import torch
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    a, b = (torch.from_numpy(np.asarray(x, dtype=np.float32)) for x in (made, plain))
    if a.ndim == 3:  # H x W x C: one image; a video is F x H x W x C
        a, b = a[None], b[None]
    a, b = a.permute(0, 3, 1, 2), b.permute(0, 3, 1, 2)
    max_diff = int((a - b).abs().max())
    if max_diff == 0:  # identical (torchmetrics' SSIM of a flat image comes out a hair under 1)
        return {"psnr": math.inf, "ssim": 1.0, "max_diff": 0}
    side = min(a.shape[-2:])
    kernel = max(3, min(11, side if side % 2 else side - 1))  # SSIM's window fits a small image
    psnr = cast(torch.Tensor, peak_signal_noise_ratio(a, b, data_range=255.0))
    ssim = cast(torch.Tensor, structural_similarity_index_measure(a, b, data_range=255.0, kernel_size=kernel))
    return {"psnr": round(float(psnr), 4), "ssim": round(float(ssim), 6), "max_diff": max_diff}


@runtime_checkable
class PlainRemaker(Protocol):
    """What the audit asks of the module (``DiffusionModule``): what it has on, and a batch's
    samples re-made with it off."""

    batch_size: Optional[int]  # the size of its pipeline calls

    def accelerators(self) -> Accelerators: ...

    def remake_plain(self, samples: Sequence[Sample]) -> list[ImageResult]: ...


def median_psnr(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else math.inf


class Auditor:
    """One rank's audit in a run: collects the sampled images of its batches, has them re-made a
    full call at a time (``call_size`` of them: the batch size, so that an audit costs about its
    fraction of the run, not a padded call per sampled image), appends their lines to ``part``
    (``writes``: this rank writes its replica's outputs), and judges the drift. At most
    ``call_size - 1`` images wait; ``flush`` audits them at the run's end (a killed run does not)."""

    def __init__(self, settings: AuditSettings, part: Path, writes: bool, folder: Optional[Path] = None) -> None:
        self.settings = settings
        # keep_baseline: where the writing rank stores the re-made images (the output folder's ``audit/``)
        self.baselines = folder / BASELINE_DIR if settings.keep_baseline and folder is not None else None
        self.part = part
        self.writes = writes
        self.psnrs: list[float] = []
        self.seconds = 0.0
        self.drifting = False  # the median is under the bound now (said once each time it falls)
        self.waiting: list[tuple[Sample, np.ndarray]] = []  # (sample, the run's image)
        self.clip: Optional[ClipScorer] = None  # clip_model's, loaded by the first audit that needs it

    def after_batch(self, module: PlainRemaker, batch: Sequence[Sample],
                    prediction: Sequence[ImageResult], call_size: int) -> Optional[str]:
        """Take the batch's sampled images (those made: a failed call has nothing to compare) and
        audit ``call_size`` at a time; the drift message when the median falls under the bound
        with them, else ``None``."""
        made = {item["index"]: item["image"] for item in prediction if "image" in item}
        self.waiting += [(s, made[s["index"]]) for s in batch if not s.get("padding") and s["index"] in made
                         and sampled(s["index"], self.settings.fraction)]
        said = None
        while len(self.waiting) >= max(1, call_size):
            said = self._audit(module, max(1, call_size)) or said
        return said

    def flush(self, module: PlainRemaker) -> Optional[str]:
        """Audit the images still waiting (the run's end)."""
        return self._audit(module, len(self.waiting)) if self.waiting else None

    def _audit(self, module: PlainRemaker, count: int) -> Optional[str]:
        taken, self.waiting = self.waiting[:count], self.waiting[count:]
        made = {sample["index"]: image for sample, image in taken}
        start = time.perf_counter()
        plain = module.remake_plain([sample for sample, _ in taken])
        remade = [item for item in plain if "image" in item]
        lines: list[AuditLine] = [{"index": int(item["index"]), "seed": item["seed"],
                                   **compare(made[item["index"]], item["image"])} for item in remade]
        if self.writes and self.settings.clip_model is not None:
            self._clip_scores(lines, {sample["index"]: sample for sample, _ in taken}, made, remade)
        seconds = time.perf_counter() - start
        self.seconds += seconds
        for line in lines:
            line["seconds"] = round(seconds / len(lines), 4)
        if self.writes and self.baselines is not None:
            for line, item in zip(lines, remade):
                line["baseline"] = store_baseline(self.baselines, line["index"], item["image"])
        if self.writes and lines:
            with open(self.part, "a", encoding="utf-8") as f:
                f.write("".join(json.dumps(line) + "\n" for line in lines))
                f.flush()
        self.psnrs.extend(line["psnr"] for line in lines)
        return self._judge()

    def _clip_scores(self, lines: list[AuditLine], samples: Mapping[int, Sample],
                     made: Mapping[int, np.ndarray], remade: Sequence[ImageResult]) -> None:
        """Each image's ``clip_score`` (the run's, against its prompt) and ``clip_diff`` (the run's
        minus the baseline's), in its line; a video's are left out."""
        from lightning_diffusion.output.clip import ClipScorer
        from lightning_diffusion.output.files import to_uint8

        pairs = [(line, to_uint8(np.asarray(made[line["index"]])), to_uint8(np.asarray(item["image"])))
                 for line, item in zip(lines, remade) if np.asarray(item["image"]).ndim == 3]
        if not pairs:
            return
        if self.clip is None:
            assert self.settings.clip_model is not None
            self.clip = ClipScorer(self.settings.clip_model, "writer.audit.clip_model")
        prompts = [str(samples[line["index"]]["prompt"]) for line, _, _ in pairs]
        scores = self.clip.scores([a for _, a, _ in pairs] + [b for _, _, b in pairs], prompts + prompts)
        for (line, _, _), ours, theirs in zip(pairs, scores, scores[len(pairs):]):
            line["clip_score"], line["clip_diff"] = round(ours, 4), round(ours - theirs, 4)

    def _judge(self) -> Optional[str]:
        recent = self.psnrs[-self.settings.window:]
        median = median_psnr(recent)
        drifting = median < self.settings.min_psnr
        said, self.drifting = self.drifting, drifting
        if not drifting or said:
            return None
        return (f"audit: the median PSNR of the last {len(recent)} audited images is {median:.1f} dB, under "
                f"writer.audit.min_psnr {self.settings.min_psnr:g} (worst {min(recent):.1f} dB): the accelerators "
                "change these pictures more than the bound allows")


def store_baseline(folder: Path, index: int, image: np.ndarray) -> str:
    """Store image ``index``'s re-made baseline in ``folder`` (8-bit, as the run's own is compared):
    a PNG, or a video's frames as ``.npy``; its path from the output folder, for its audit line."""
    from PIL import Image

    from lightning_diffusion.output.files import to_uint8

    folder.mkdir(exist_ok=True)
    pixels = to_uint8(np.asarray(image))
    path = folder / f"{int(index):06d}{'.png' if pixels.ndim == 3 else '.npy'}"
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as f:
        if pixels.ndim == 3:
            Image.fromarray(pixels).save(f, format="PNG")
        else:
            np.save(f, pixels)
    os.replace(temporary, path)
    return f"{BASELINE_DIR}/{path.name}"


def part_name(manifest_part: Path) -> Path:
    """The audit part beside a rank's manifest part (``manifest.part-R.jsonl`` -> ``audit.part-R.jsonl``)."""
    return manifest_part.with_name(manifest_part.name.replace("manifest", "audit", 1))


def read_lines(path: Path) -> list[AuditLine]:
    """An audit file's whole lines (a line cut by a kill is left out)."""
    lines: list[AuditLine] = []
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    for raw in text.splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict) and is_int(line.get("index"), 0):
            lines.append(cast(AuditLine, line))
    return lines


def merge(folder: Path, parts: Sequence[Path]) -> list[AuditLine]:
    """Add the ``parts`` (the ranks' lines) to ``folder/audit.jsonl`` (one line an index, the latest
    kept, sorted), remove them; the lines they held. Under the folder's merge lock: the shards of a
    job array and the jobs of a pool merge into the one file."""
    from lightning_diffusion.output.manifest import merge_lock

    target = folder / AUDIT_FILE
    new = [line for part in parts for line in read_lines(part)]
    with merge_lock(folder):
        if new:
            lines = {line["index"]: line for line in [*read_lines(target), *new]}
            temporary = target.with_name(f".{AUDIT_FILE}.{os.getpid()}.tmp")
            with open(temporary, "w", encoding="utf-8") as f:
                f.write("".join(json.dumps(lines[i]) + "\n" for i in sorted(lines)))
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, target)
        for part in parts:
            part.unlink(missing_ok=True)
    return new


def folder_audit(folder: Path, glob: Optional[str] = None) -> Optional[AuditSummary]:
    """The audit recorded in ``folder`` so far (``audit.jsonl`` and the parts of a run going on), as
    ``status`` shows it: images audited, worst and median PSNR, largest difference; None without one.
    ``glob``: these parts only (a running run's own, for its progress line)."""
    paths = sorted(folder.glob(glob)) if glob else [folder / AUDIT_FILE, *sorted(folder.glob("audit.*part-*.jsonl"))]
    lines = {line["index"]: line for path in paths for line in read_lines(path) if _is_number(line.get("psnr"))}
    if not lines:
        return None
    psnrs = [float(line["psnr"]) for line in lines.values()]
    return {"images": len(psnrs), "worst_psnr": min(psnrs), "median_psnr": median_psnr(psnrs),
            "max_diff": max(int(line.get("max_diff") or 0) for line in lines.values())}


def progress_text(folder: Path, glob: str) -> str:
    """What the progress line adds while a run audits: its drift so far (``glob``: its parts)."""
    audit = folder_audit(folder, glob)
    if audit is None:
        return ""
    return (f"; audit PSNR worst {audit['worst_psnr']:.1f} dB, median {audit['median_psnr']:.1f} dB "
            f"({audit['images']:,})")


def audit_text(audit: AuditSummary) -> str:
    """``status``'s line of ``folder_audit``."""
    return (f"audit: {audit['images']:,} images re-made without accelerators, PSNR worst {audit['worst_psnr']:.1f} "
            f"dB, median {audit['median_psnr']:.1f} dB, largest difference {audit['max_diff']} levels ({AUDIT_FILE})")


def summary(lines: Sequence[AuditLine], busy_s: float) -> AuditSummary:
    """The run's audit as run.json's summary records it: images audited, worst and median PSNR,
    seconds spent and their share of the time in pipeline calls (``busy_s``, the run's own)."""
    psnrs = [float(line["psnr"]) for line in lines]
    seconds = sum(float(line.get("seconds", 0.0)) for line in lines)
    return {"images": len(lines), "worst_psnr": min(psnrs) if psnrs else None,
            "median_psnr": median_psnr(psnrs) if psnrs else None,
            "max_diff": max((int(line["max_diff"]) for line in lines), default=None),
            "seconds": round(seconds, 3), "share": round(seconds / busy_s, 4) if busy_s > 0 else None}


def summary_text(audit: AuditSummary) -> str:
    if not audit["images"]:
        return "audit: no image of this run was in the sample"
    share = f" ({100 * part:.1f}% of the run's pipeline time)" if (part := audit.get("share")) is not None else ""
    return (f"audit: {audit['images']} images re-made, PSNR worst {audit['worst_psnr']:.1f} dB, median "
            f"{audit['median_psnr']:.1f} dB, largest difference {audit['max_diff']} levels; "
            f"{audit['seconds']:.1f} s{share}")

