"""Ctrl-C while the command line starts: one line and exit 130, from the first line of the package.

A terminal's Ctrl-C sends SIGINT to every process of the job. Until a run takes Ctrl-C over
(``StopController.watch_interrupt``), ``lightning-diffusion predict`` ends at once on it: a
KeyboardInterrupt raised inside a half-done import leaves modules half-initialised, and the next
import of them fails in ways no handler can word (a RecursionError in numpy's); nothing is written
yet. The handler is installed by the package's ``__init__`` before anything else is imported, so
only the interpreter's own start-up is left uncovered; this module imports nothing but the standard
library's ``os``, ``signal`` and ``sys``.

The ranks that the launching process starts (``strategies.watchdog.Launcher``) begin with SIGINT
blocked (a signal mask is inherited through fork and exec) and unblock it when they import the
package: a command-line rank once the handler is in place, so a Ctrl-C during its interpreter's
start-up waits milliseconds instead of printing a traceback from the middle of an import; a rank of
a Python script at once, where Ctrl-C is Python's as usual.
"""

from __future__ import annotations

import os
import signal
import sys

# The last line of a run that Ctrl-C ended before it could stop at a batch boundary.
INTERRUPTED_LINE = ("lightning-diffusion: interrupted (Ctrl-C); the images recorded are kept, and the same command "
                    "resumes.")
# The launching process's pid, in the environment of the ranks it starts (``strategies.watchdog``).
LAUNCHER_PID = "LIGHTNING_DIFFUSION_LAUNCHER_PID"
_MODULES = ("lightning_diffusion", "lightning_diffusion.cli")
# Whether the launcher started this process (its variable, read as the package is imported: the
# watchdog takes it out of the environment later, while the rank may still be starting).
LAUNCHED = LAUNCHER_PID in os.environ
_SCRIPT = "lightning-diffusion"


def interrupted_while_starting(signum: int, frame: object) -> None:
    """``predict``'s Ctrl-C until the run takes it over: the line, written with ``os.write`` (the
    main thread may be inside a print), and exit 130 without the interpreter's teardown. A rank the
    launcher started ends without it: the terminal's Ctrl-C reached the launcher too, which says it."""
    if not LAUNCHED:
        os.write(2, (INTERRUPTED_LINE + "\n").encode())
    os._exit(130)


interrupted_while_starting.starting_only = True  # type: ignore[attr-defined]  # for StopController


def command_line(argv: list[str], orig_argv: list[str]) -> bool:
    """Whether this interpreter was started as the command line: the console script, or ``python -m
    lightning_diffusion`` (whose ``argv[0]`` is ``-m`` while the package imports). Asked of the
    interpreter's own command line (``orig_argv``) too: another module run with ``-m`` that imports
    the package, or a worker that multiprocessing spawns with its parent's ``argv``, is not it."""
    if argv[:1] == ["-m"]:
        return any(flag == "-m" and module in _MODULES for flag, module in zip(orig_argv, orig_argv[1:]))
    return bool(argv) and os.path.basename(argv[0]) == _SCRIPT and any(
        os.path.basename(word) == _SCRIPT for word in orig_argv[1:])


def take_start_up(words: list[str]) -> None:
    """Install ``interrupted_while_starting`` for ``[--verbose] predict ...`` (main thread only),
    where Ctrl-C has Python's default handler (an inherited "ignore" stays), then let a Ctrl-C
    through; the other commands and Python callers keep Ctrl-C's default."""
    if [word for word in words if word != "--verbose"][:1] == ["predict"] and (
            signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        signal.signal(signal.SIGINT, interrupted_while_starting)
    unblock()


def on_import() -> None:
    """The package's first line: the command line takes Ctrl-C over; a rank that the launcher
    started unblocks it (a script's rank as soon as it imports the package)."""
    if command_line(sys.argv, list(getattr(sys, "orig_argv", []))):
        take_start_up(sys.argv[1:])
    elif LAUNCHER_PID in os.environ:
        unblock()


def block_for_children() -> set:
    """Block SIGINT in the calling thread while it starts child ranks (they inherit the mask);
    returns the mask to restore. A Ctrl-C meanwhile is taken by another thread of this process, or
    waits for the restore."""
    return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def restore(mask: set, children: list) -> None:
    """Give back the mask ``block_for_children`` took. A Ctrl-C that waited meanwhile did not reach
    the ranks started after it: it is passed on to every child first (one that has it already
    keeps one: a signal waiting twice is delivered once), then this process takes it."""
    if signal.SIGINT in signal.sigpending():
        for child in children:
            try:
                child.send_signal(signal.SIGINT)
            except ProcessLookupError:
                pass
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def unblock() -> None:
    """A SIGINT that arrived while this rank started (blocked by the launcher) is delivered now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
