"""The run's top: reading the config and checking all of it before anything loads.

Entry point: ``config.read_config`` (the one config reader). Beside it: ``config_guard`` (a config
file's class paths, keys and value types before any parser reads or imports them), ``preflight``
(every weight-free rule, one message for all) and ``progress`` (the job's bar). The run's shared
state (``RunContext``, the stop controller, Ctrl-C at start-up) lives in ``core``, which every layer
below this one reads; ``RunContext`` is still importable from here.

Nothing is imported here.
"""

from typing import Any

__all__ = ["RunContext"]


def __getattr__(name: str) -> Any:
    if name == "RunContext":
        from lightning_diffusion.core.context import RunContext
        return RunContext
    raise AttributeError(f"module 'lightning_diffusion.run' has no attribute {name!r}")
