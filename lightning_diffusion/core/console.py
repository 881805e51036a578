"""What the project prints: one ``logging`` logger for the package, rank-aware, and a quiet start-up.

Every module logs through ``log``, the ``lightning_diffusion`` logger configured here on import (as
Lightning configures its own): INFO and above, on global rank 0 only unless a record says
``extra={"all_ranks": True}`` (a rank's own placement, its stop). The rank filter is on the logger
itself, so it holds wherever the records go: to stderr, or where the application has configured
logging before importing the package (the root logger has handlers), to the root's handlers.

``quiet()`` is for the command line: third-party start-up notices (transformers' torchvision
notice, Lightning's accelerator and process-group banners and tips, deprecation warnings from
Lightning's internals) are hidden, so that a run shows our mesh line, the progress bar and the
summary. ``lightning-diffusion --verbose ...`` keeps all of it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import warnings

from lightning_diffusion.core.interrupt import INTERRUPTED_LINE as INTERRUPTED_LINE  # the last line of a Ctrl-C

LOGGER = "lightning_diffusion"

# Third-party start-up messages hidden by ``quiet`` (message patterns, matched from the start).
_QUIET_WARNINGS = (
    r".*isinstance\(treespec, LeafSpec\)` is deprecated",
    r"The `srun` command is available on your system but is not used",
    # torch's notice about the collectives diffusers' context parallelism calls: once a rank, a run's
    # worth of repeats of a line no user can act on.
    r"`torch\.distributed\._functional_collectives\.\w+` is deprecated",
)
_QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning")


class RankZeroFilter(logging.Filter):
    """Pass records on global rank 0, and records marked ``all_ranks`` on every rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        return getattr(rank_zero_only, "rank", 0) == 0 or bool(getattr(record, "all_ranks", False))


log = logging.getLogger(LOGGER)
# The user's own ``OMP_NUM_THREADS`` (None: unset), read as the package is first imported, before a
# launcher sets one for its ranks: a strategy then sets the threads per process itself.
USER_THREADS = os.environ.get("OMP_NUM_THREADS")


def counted(number: int, one: str, many: str = "") -> str:
    """``1 batch``, ``2 batches``: a count and its noun (``many`` where the plural is not ``one`` + s)."""
    return f"{number:,} {one if number == 1 else many or one + 's'}"


def configure() -> None:
    if getattr(log, "_lightning_diffusion_configured", False):
        return
    log._lightning_diffusion_configured = True  # type: ignore[attr-defined]
    log.setLevel(logging.INFO)
    log.addFilter(RankZeroFilter())  # one logger for the package: its filter sees every record
    if not logging.getLogger().hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.propagate = False


_VERBOSE_ENV = "LIGHTNING_DIFFUSION_VERBOSE"


@contextlib.contextmanager
def no_progress_bars():
    """diffusers' and transformers' loading and saving bars ("Loading pipeline components...",
    "Loading weights", "Writing model shards") off for a while: a tool's output, not a run's."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    shown = [(lib, lib.is_progress_bar_enabled()) for lib in (diffusers_logging, transformers_logging)]
    for lib, _ in shown:
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib, was in shown:
            if was:
                lib.enable_progress_bar()


def verbose() -> bool:
    """``--verbose`` or ``LIGHTNING_DIFFUSION_VERBOSE=1``: third-party messages and full tracebacks."""
    return os.environ.get(_VERBOSE_ENV) == "1"


def quiet(verbose: bool = False) -> None:
    """Hide third-party start-up noise for a command-line run (nothing when ``verbose``). Call it
    before transformers, diffusers and Lightning are imported; the ranks a run starts inherit it."""
    if verbose:
        os.environ[_VERBOSE_ENV] = "1"
    if os.environ.get(_VERBOSE_ENV) == "1":
        return
    # Read when transformers and diffusers are imported, here and in the ranks started later. A
    # library imported before (Lightning imports transformers) has read its variable already: set
    # its level too, unless the user chose one.
    for library in ("transformers", "diffusers"):
        variable = f"{library.upper()}_VERBOSITY"
        if variable in os.environ:
            continue
        os.environ[variable] = "error"
        if library in sys.modules:
            levels = importlib.import_module(f"{library}.utils.logging")
            if levels.get_verbosity() == logging.WARNING:  # the library's default: not one set in code
                levels.set_verbosity_error()
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    for pattern in _QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    # torchao, when installed, is imported by diffusers and warns at import about CUDA extensions
    # built for other Pythons and about enum registration in torch's pytree: not about this run.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def quiet_lightning() -> None:
    """Lightning's start-up banners (accelerators, process group, tips) to WARNING, unless verbose.
    Lightning sets its loggers' levels when it is imported: call this after that."""
    if os.environ.get(_VERBOSE_ENV) == "1" or os.environ.get("TRANSFORMERS_VERBOSITY") is None:
        return  # not a quiet command-line run
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
