"""Errors for input that cannot work. The CLI prints their message alone, without a traceback."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value, path or file that cannot work; raised before weights load."""


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
