"""Errors for input that cannot work. The CLI prints their message alone, without a traceback."""

from __future__ import annotations

from typing import Optional


class ConfigError(ValueError):
    """A config value, path or file that cannot work; raised before weights load."""

    # The latest one raised in this process: jsonargparse re-raises an error from a class given
    # for a Union-typed option (trainer.strategy) as a plain ValueError that keeps only its text.
    latest: Optional["ConfigError"] = None

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        ConfigError.latest = self
