"""What travels from the prompt reader to the writer, and what the writer records, declared once for every
part that reads it.

- ``Record``: one line of a prompt set as read (``input.records``): a ``prompt``, an optional ``seed``
  and ``negative_prompt``, the input files an image-conditioned pipeline takes (``INPUT_FIELDS``) and
  the call arguments a record may set (``pipelines.checks.CALL_ARGS``). Its keys are the user's (a
  set's extra columns ride along), so it stays a plain mapping of names to JSON values.
- ``Sample``: one image to make, as the data module hands it to the module (``input.data``): the
  record's fields this image needs, with its index in the run and its seed.
- ``ImageResult``: what the module made of a sample, as the writer receives it: the image and what
  made it (``params``), or the error that stopped it under ``data.on_error: skip``.

``Sample`` and ``ImageResult`` are ``TypedDict``s, not dataclasses: they are built once a batch from
JSON-born records, cross processes (the writer's process pickles them) and their fields go into
manifest lines and metadata as they are, so a dict costs no conversion at any joint, while mypy
checks every key's spelling and type where one is read or written.

What the writer records, read back by resume, ``status``, ``report``, ``audit`` and ``eval``:

- ``ManifestLine``: one output's line of the manifest (``manifest.jsonl`` and the parts appended to it).
- ``FailureLine``: a line of ``failed.jsonl``, an image whose pipeline call failed.
- ``RejectedLine``: a line of ``rejected.jsonl``, a record ``data.on_bad_record: skip`` left out.
- ``RunSettings``: run.json's settings, the values a resume must share; ``RunSummary``: one run of
  its ``history``; ``AuditSummary``: its audit (``writer.audit``), which ``status`` shows too.

These are ``TypedDict``s too: they are JSON lines and files, written with ``json.dumps`` and read
back with ``json.loads`` by other processes and other versions, so the declaration names their keys
for mypy without any conversion on the way in or out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional, Protocol, TypedDict

from typing_extensions import NotRequired  # typing's own from Python 3.11; torch requires the package

if TYPE_CHECKING:
    import numpy as np

# Input files a record may carry (a path, or a list of paths for pipelines that take several);
# relative paths resolve against the prompt file's folder.
INPUT_FIELDS = ("image", "mask_image", "last_image", "control_image")
# Fields of a record that are not pipeline-call arguments (``adapters``: the LoRA adapters it chooses).
RECORD_FIELDS = ("prompt", "seed", "negative_prompt", "adapters", *INPUT_FIELDS)

# A prompt record as read: field -> JSON value, the user's own keys included.
Record = dict[str, Any]
# Pipeline-call keyword arguments (a record's overrides, the config's call_kwargs, what a call received):
# the pipeline's own names and values.
CallArgs = dict[str, Any]
# The columns of a record's source that ``data.keep_columns`` carries into its manifest line: the user's.
KeptColumns = dict[str, Any]
# A sample's input files by field (``INPUT_FIELDS``): as a record gives them (a path, or a list of paths), or
# as its metadata and manifest line record them (each file's name, size and SHA-256).
InputFiles = dict[str, Any]
# What one image was made with (``ImageResult.params``, a file's metadata): the model, the call's arguments
# (the pipeline's own names), its size and input files.
Params = dict[str, Any]
# run.json's settings: ``model``, ``torch_dtype``, ``model.<call argument>`` (the pipeline's own names),
# ``from_pretrained.*``, ``data.*`` and ``writer.*``: dotted option names to JSON values; a resume refuses
# a folder whose recorded settings differ (``output.manifest.settings_conflict``).
RunSettings = dict[str, Any]
# A JSON object read from a file before the reader knows which of the shapes below it is (a line that may
# be cut, a record written by another version): names to JSON values.
JsonObject = dict[str, Any]


class Sample(TypedDict):
    """One image of the run: its ``index`` (record ``index // num_images_per_prompt``), ``seed``
    (``input.data.image_seed``), the record's prompt and negative prompt, its call-argument
    ``overrides``, ``source`` (``prompts.jsonl:5``: where the record came from, for messages), its
    input files by field (``inputs``), the adapters it chose (``adapters``: name -> scale, None for the
    declared one; absent: the run's default), the columns ``data.keep_columns`` carries (``columns``), and
    ``padding``: a copy that fills a padded call, whose output is dropped."""

    index: int
    prompt: str
    seed: int
    negative_prompt: Optional[str]
    overrides: CallArgs
    source: NotRequired[str]
    adapters: NotRequired[dict[str, Optional[float]]]
    inputs: NotRequired[InputFiles]
    columns: NotRequired[KeptColumns]
    padding: NotRequired[bool]


class SideOutput(TypedDict):
    """One image's tensors beside it (``writer.save_latents``, ``writer.save_text_embeddings``):
    ``data``, a safetensors file's bytes, and ``about``, what its manifest line says of them (each
    tensor's shape and dtype, the VAE's scaling)."""

    data: bytes
    about: dict[str, object]


class ImageResult(TypedDict):
    """What the module made of one sample: its ``index``, ``prompt``, ``seed`` and the negative prompt
    it ran with; either ``image`` (float pixels in [0, 1], or uint8 once the writer converted them;
    frames first for a video) and ``params`` (what the call received, its size and input files), or
    ``error`` (one line) and ``record`` (the sample's source); ``sides``: its side outputs by name
    (``latents``, ``text_embeddings``), where the writer saves them. The writer adds its ``claim`` (a pool's
    ``fence.Claim``) or ``batch`` (the run's batch count) before the files are written."""

    index: int
    prompt: str
    seed: int
    negative_prompt: Optional[str]
    columns: NotRequired[KeptColumns]
    image: NotRequired[np.ndarray]
    params: NotRequired[Params]
    sides: NotRequired[dict[str, SideOutput]]
    error: NotRequired[str]
    record: NotRequired[Optional[str]]
    claim: NotRequired[Any]
    batch: NotRequired[int]


class ManifestLine(TypedDict, total=False):
    """One output's manifest line, as the writer appends it (``output.files``): ``index``, ``prompt``,
    ``seed``, where the output is (``file``: a loose file's path, or a shard's name with the sample's
    ``member``), its ``bytes`` and ``sha256`` (what a resume verifies), the parameters it was made with
    (``model``, the call's arguments, ``width``, ``height``, ``inputs``, ``negative_prompt``, the kept
    ``columns``; ``num_frames`` and ``fps`` for a video), each side output's place (``latents``, ``text_embeddings``),
    a pool's ``claim`` token and the time it was ``written``. The call's own arguments ride along
    under the pipeline's names, so a line may hold keys beyond these."""

    index: int
    prompt: str
    seed: int
    negative_prompt: str
    file: str
    member: str
    bytes: int
    shard_bytes: int
    sha256: str
    model: str
    width: int
    height: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    inputs: InputFiles
    columns: KeptColumns
    fps: int
    latents: dict[str, Any]
    text_embeddings: dict[str, Any]
    claim: str
    written: float


class FailureLine(TypedDict):
    """A line of ``failed.jsonl``: the image's ``index``, its ``record`` (file:line), ``prompt``,
    ``seed``, the ``error``'s last line and when it ``failed``."""

    index: int
    record: Optional[str]
    prompt: str
    seed: int
    error: str
    failed: float


class RejectedLine(TypedDict):
    """A line of ``rejected.jsonl``: the ``record`` (1-based), its ``line`` (file:line), the ``reason``
    and the indices of the ``images`` it would have made."""

    record: int
    line: str
    reason: str
    images: list[int]


class AuditSummary(TypedDict, total=False):
    """An audit summed up: ``images`` audited, ``worst_psnr`` and ``median_psnr``, the largest
    difference (``max_diff``); a run's (run.json's ``audit``) adds the ``seconds`` spent, their
    ``share`` of its pipeline time, its ``AuditSettings`` and the ``batch_size`` it re-made at."""

    images: int
    worst_psnr: Optional[float]
    median_psnr: Optional[float]
    max_diff: Optional[int]
    seconds: float
    share: Optional[float]
    fraction: float
    min_psnr: float
    on_drift: str
    window: int
    batch_size: int


class RunSummary(TypedDict, total=False):
    """One run in run.json's ``history`` (``output.writer``): when it ``finished``, the outputs it
    ``made``, those ``skipped`` (already there), ``rejected`` and ``failed``, the manifest's count
    (``in_manifest``) of those ``expected``, its seconds (``wall_s``, ``load_s``), its rates and
    busy seconds by rank, the batch plan's ``buckets`` and padding, its SLURM job, shard and audit."""

    finished: float
    made: int
    skipped: int
    rejected: int
    failed: int
    buckets: Any
    computed: int
    padded: int
    busy_s_by_rank: dict[str, float]
    in_manifest: int
    expected: Optional[int]
    wall_s: float
    load_s: float
    images_per_s_by_rank: dict[str, float]
    slurm_job: Optional[str]
    shard: list[int]
    audit: AuditSummary
    world_size: int
    devices: int


class RecordSet(Protocol):
    """What the model's checks read of a prompt set (``input.records.RecordSummary``): its distinct
    sets of per-record call arguments, and its first negative prompt, if any."""

    @property
    def first_negative(self) -> Optional[int]: ...

    def override_sets(self) -> Sequence[tuple[int, Mapping[str, Any]]]: ...
