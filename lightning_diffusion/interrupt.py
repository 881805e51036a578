"""Ctrl-C while the command line starts: one line and exit 130, from the first line of the package.

A terminal's Ctrl-C sends SIGINT to every process of the job. Until a run takes Ctrl-C over
(``StopController.watch_interrupt``), ``lightning-diffusion predict`` ends at once on it: a
KeyboardInterrupt raised inside a half-done import leaves modules half-initialised, and the next
import of them fails in ways no handler can word (a RecursionError in numpy's); nothing is written
yet. The handler is installed by the package's ``__init__`` before anything else is imported, so
only the interpreter's own start-up is left uncovered; this module imports nothing but the standard
library's ``os`` and ``signal``.

The ranks that the launching process starts (``strategies.watchdog.Launcher``) begin with SIGINT
blocked (a signal mask is inherited through fork and exec) and unblock it once they stand where it
is handled, so a Ctrl-C during their interpreter start-up waits for them instead of printing a
traceback from the middle of an import.
"""

from __future__ import annotations

import os
import signal

# The last line of a run that Ctrl-C ended before it could stop at a batch boundary.
INTERRUPTED_LINE = ("lightning-diffusion: interrupted (Ctrl-C); the images recorded are kept, and the same command "
                    "resumes.")


def interrupted_while_starting(signum: int, frame: object) -> None:
    """``predict``'s Ctrl-C until the run takes it over: the line, written with ``os.write`` (the
    main thread may be inside a print), and exit 130 without the interpreter's teardown."""
    os.write(2, (INTERRUPTED_LINE + "\n").encode())
    os._exit(130)


interrupted_while_starting.starting_only = True  # type: ignore[attr-defined]  # for StopController


def command_line(argv: list[str]) -> bool:
    """Whether this process is the command line: the console script, or ``python -m
    lightning_diffusion`` (whose ``argv[0]`` is ``-m`` while the package imports)."""
    return bool(argv) and (argv[0] == "-m" or os.path.basename(argv[0]) == "lightning-diffusion")


def take_start_up(words: list[str]) -> None:
    """Install ``interrupted_while_starting`` for ``[--verbose] predict ...`` (main thread only),
    where Ctrl-C has Python's default handler (an inherited "ignore" stays); the other commands and
    Python callers keep Ctrl-C's default."""
    if [word for word in words if word != "--verbose"][:1] == ["predict"] and (
            signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        signal.signal(signal.SIGINT, interrupted_while_starting)
        unblock()  # a child rank: its Ctrl-C is handled from here


def block_for_children() -> set:
    """Block SIGINT in the calling thread while it starts child ranks (they inherit the mask);
    returns the mask to restore. A Ctrl-C meanwhile waits, it is not lost."""
    return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def restore(mask: set) -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def unblock() -> None:
    """In a child rank, where Ctrl-C is handled (the command line's handler, or the strategy's set
    up in a Python script's ranks): a SIGINT that arrived while it started is delivered now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
