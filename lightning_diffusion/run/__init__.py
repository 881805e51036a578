"""One run from its config to its end: reading and checking the config, then stopping it well.

Entry point: ``RunContext`` (``context``), the state one run shares between its parts. Beside it:
``config`` (the one config reader), ``config_guard`` and ``preflight`` with ``validation`` (every
check before weights load), ``failures`` (a pipeline call's failures), ``progress`` (the job's bar),
``interrupt`` (Ctrl-C while the command starts) and ``preemption`` (stopping at a batch boundary).

Nothing is imported here: ``interrupt`` is the package's first import.
"""

from typing import Any

__all__ = ["RunContext"]


def __getattr__(name: str) -> Any:
    if name == "RunContext":
        from lightning_diffusion.run.context import RunContext
        return RunContext
    raise AttributeError(f"module 'lightning_diffusion.run' has no attribute {name!r}")
