"""What travels from the prompt reader to the writer, declared once for every part that reads it.

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
    overrides: dict[str, Any]
    source: NotRequired[str]
    adapters: NotRequired[dict[str, Optional[float]]]
    inputs: NotRequired[dict[str, Any]]
    columns: NotRequired[dict[str, Any]]
    padding: NotRequired[bool]


class SideOutput(TypedDict):
    """One image's tensors beside it (``writer.save_latents``, ``writer.save_text_embeddings``):
    ``data``, a safetensors file's bytes, and ``about``, what its manifest line says of them (each
    tensor's shape and dtype, the VAE's scaling)."""

    data: bytes
    about: dict[str, Any]


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
    columns: NotRequired[dict[str, Any]]
    image: NotRequired[np.ndarray]
    params: NotRequired[dict[str, Any]]
    sides: NotRequired[dict[str, SideOutput]]
    error: NotRequired[str]
    record: NotRequired[Optional[str]]
    claim: NotRequired[Any]
    batch: NotRequired[int]


class RecordSet(Protocol):
    """What the model's checks read of a prompt set (``input.records.RecordSummary``): its distinct
    sets of per-record call arguments, and its first negative prompt, if any."""

    @property
    def first_negative(self) -> Optional[int]: ...

    def override_sets(self) -> Sequence[tuple[int, Mapping[str, Any]]]: ...
