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


def raise_problems(problems: list) -> None:
    """Raise one ConfigError naming every problem found (messages or ConfigErrors; nothing if none).
    A single ConfigError is raised as it is, keeping its type."""
    if len(problems) == 1:
        raise problems[0] if isinstance(problems[0], ConfigError) else ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems:\n  - " + "\n  - ".join(map(str, problems)))


def gather(problems: list, check, *args, **kwargs):
    """Run one check; on a ConfigError, record it and return None."""
    try:
        return check(*args, **kwargs)
    except ConfigError as err:
        problems.append(err)
        return None
