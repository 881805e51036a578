"""What the settings of every config group share: reading a parsed section into its dataclass.

Each group declares its options once, as a frozen dataclass in its package
(``pipelines.settings.ModelSettings``, ``input.settings.DataSettings``,
``output.settings.WriterSettings``); the parser, the checks, preflight and run.json read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from lightning_diffusion.core.errors import ConfigError


def group_options(cls: type, given: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """``given`` (a parsed config's section, or keyword arguments) as the options of ``cls``, a
    settings dataclass; an option ``cls`` lacks is refused in one message naming ``owner`` (``the
    model``) and every option it has. jsonargparse's meta keys (``__path__``: the group was given
    as a file) are not options and are dropped."""
    options = {key: value for key, value in given.items() if not key.startswith("__")}
    names = [option.name for option in fields(cls)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ConfigError(f"{owner} has no option {', '.join(unknown)}; it has: {', '.join(names)}.")
    return options
