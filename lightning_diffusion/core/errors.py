"""Errors for input that cannot work. The CLI prints their message alone, without a traceback."""

from __future__ import annotations

from typing import Callable, Optional, TypeGuard, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value, path or file that cannot work; raised before weights load."""


class NodeConfigError(ConfigError):
    """A problem of this machine's hardware (how many GPUs it has, their compute capability), which
    the job's other nodes may not share: each node's first process reports it, naming its host."""


class RecordFailure(RuntimeError):
    """A pipeline call that failed for its records (``data.on_error: fail``); the message names them.
    The CLI prints it as one line and exits with 1."""


class WritingFailed(RuntimeError):
    """Outputs that could not be written (a full disk, a lost mount); the message says where and
    what to do. The CLI prints it as one line and exits with 1, after ``details`` where there are
    some: the traceback of a failure that was not the file system's (a bug to report)."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


class PeerLost(RuntimeError):
    """Another process of the run ended before a gather every rank joins (its node lost, a rank
    killed late): the CLI prints it as one line and exits with 1; what was recorded is kept."""


def raise_problems(problems: list) -> None:
    """Raise one ConfigError naming every problem found (messages or ConfigErrors; nothing if none).
    A single ConfigError is raised as it is, keeping its type; several are a NodeConfigError where
    one of them is."""
    if len(problems) == 1:
        raise problems[0] if isinstance(problems[0], ConfigError) else ConfigError(problems[0])
    if problems:
        kind = NodeConfigError if any(isinstance(p, NodeConfigError) for p in problems) else ConfigError
        raise kind(f"{len(problems)} problems:\n  - " + "\n  - ".join(map(str, problems)))


def run_check(problems: list, reader: Callable[..., T], *args: object, **kwargs: object) -> Optional[T]:
    """Run a reader (a function that returns a value or raises ``ConfigError``: ``resolve_dtype``,
    ``read_records``, ``checks.planned_models``...) as a rule: its value, or None with its refusal
    appended to ``problems`` (the ConfigError itself, so that a subclass such as ``NodeConfigError``
    is kept). The one place a raising reader is turned into a problem."""
    try:
        return reader(*args, **kwargs)
    except ConfigError as err:
        problems.append(err)
        return None


def is_int(value: object, minimum: Optional[int] = None) -> TypeGuard[int]:
    """An ``int`` (not a ``bool``), at least ``minimum`` when given: the one integer test of configs."""
    return isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)
