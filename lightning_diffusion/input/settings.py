"""The data group's options (``PromptDataModule``'s arguments), each declared once: the defaults
here are the ones ``PromptDataModule``'s signature, ``validation.data_problems``, ``preflight`` and
SLURM's rendering use.

Kept free of torch and Lightning: the CLI's checks import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning_diffusion.errors import ConfigError
from lightning_diffusion.groups import group_options

# The most characters of a prompt or negative prompt (``data.max_prompt_chars``), counted before
# tokenizing: far past what any text encoder reads (CLIP 77 tokens, T5 512, Qwen-Image 1,024), and
# small enough that a runaway line (megabytes) costs one record, not the tokenizer's memory.
MAX_PROMPT_CHARS = 20_000
# The pixels of one image (or video frame) a config or record may ask for unless ``data.max_pixels``
# says more: 4096 x 4096, four times FLUX.1's largest published size. A typo of 10000 x 10000 would
# otherwise be found by the device's memory, after the weights loaded.
MAX_PIXELS = 4096 * 4096
ON_BAD_RECORD = ("fail", "skip")
ON_ERROR = ("fail", "skip")
LEASE_S = 180.0  # data.lease_s's default: how long a silent worker's claims wait before a takeover
MIN_LEASE_S = 2.0  # a renewal every lease/4: below this, renewals would cost more than they protect
SCHEDULES = ("deal", "pull")


@dataclass(frozen=True)
class DataSettings:
    """``PromptDataModule``'s options (the ``data`` group). Values are as given:
    ``validation.data_problems`` says what is wrong with them."""

    prompts: Union[str, list[Any]]
    batch_size: int = 1
    seed: int = 0
    num_images_per_prompt: int = 1
    num_workers: int = 0
    inputs_root: Optional[str] = None
    num_shards: int = 1
    shard_index: int = 0
    max_pixels: int = MAX_PIXELS
    max_prompt_chars: int = MAX_PROMPT_CHARS
    on_bad_record: str = "fail"
    on_error: str = "fail"
    bucket: bool = True
    columns: Optional[dict[str, Optional[str]]] = None
    keep_columns: Optional[list[str]] = None
    split: Optional[str] = None
    schedule: str = "deal"
    lease_s: float = LEASE_S

    @classmethod
    def of(cls, given: Mapping[str, Any]) -> DataSettings:
        """The group's values: ``given`` (a parsed config's ``data`` section, or keyword arguments), every
        absent option at its default."""
        given = group_options(cls, given, "the data module")
        if "prompts" not in given:
            raise ConfigError("data.prompts is required: a prompt file, a dataset, or a list of records.")
        return cls(**given)
