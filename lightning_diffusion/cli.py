"""The ``lightning-diffusion`` command: ``lightning-diffusion [--verbose] COMMAND [options]``, one
module per command in ``lightning_diffusion.commands``, dispatched from ``commands.COMMANDS``.
``lightning-diffusion --help`` prints ``usage``, which lists every command of that table with its
one line; ``lightning-diffusion COMMAND --help`` shows a command's options.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from typing import NoReturn, Optional

from lightning_diffusion.commands import COMMANDS
from lightning_diffusion.core import console

# The commands that read a predict config (their words carry its keys and --config files).
CONFIG_COMMANDS = ("predict", "verify", "benchmark", "slurm", "k8s", "download")
# Of those, the ones whose prompt set is read on this machine (k8s's is the pods').
LOCAL_DATA_COMMANDS = ("predict", "verify", "benchmark", "slurm")
from lightning_diffusion.core import interrupt, system
from lightning_diffusion.core.system import process_started_at

_process_start: Optional[float] = None  # set by ``run`` for the ``main`` it calls


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return (
        "usage: lightning-diffusion [--verbose] COMMAND [options]\n\ncommands:\n" + "\n".join(lines)
        + "\n\n`lightning-diffusion COMMAND --help` shows a command's options; --verbose keeps the third-party "
        "start-up messages that are hidden by default."
    )


def expand_prompts(words: list[str]) -> list[str]:
    """A config command's ``--prompt TEXT`` (``--prompt=TEXT``, repeatable) as the one flag it
    stands for, ``--data.prompts '[{"prompt": "TEXT"}, ...]'`` (JSON, which the parser reads as
    YAML; records, not strings, which the parser would read again: ``a dog: brown`` as a mapping),
    last, so that it wins over a config's prompts; other words as they are."""
    import json

    command = next((w for w in words if w != "--verbose"), None)
    if command not in CONFIG_COMMANDS or not any(w == "--prompt" or w.startswith("--prompt=") for w in words):
        return words
    kept, prompts = [], []
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--prompt" and i + 1 < len(words):
            prompts.append(words[i + 1])
            i += 2
            continue
        if word.startswith("--prompt="):
            prompts.append(word.split("=", 1)[1])
        else:
            kept.append(word)
        i += 1
    return [*kept, "--data.prompts", json.dumps([{"prompt": p} for p in prompts])] if prompts else words


def main(argv: Optional[list[str]] = None) -> None:
    global _process_start
    system.set_command_start(_process_start or time.time())
    _process_start = None
    words = expand_prompts(list(sys.argv[1:] if argv is None else argv))
    if argv is None:  # the ranks Lightning starts re-run sys.argv: the expanded words, as checked here
        sys.argv[1:] = words
    # Before anything heavy is imported: the environment it sets is read at import time.
    verbose = "--verbose" in words
    words = [word for word in words if word != "--verbose"]
    console.quiet(verbose)
    if not words or words[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if words else 2)
    if words[0] not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(words[0], list(COMMANDS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        print(f"lightning-diffusion: error: unknown command {words[0]!r}.{hint}\n\n{usage()}", file=sys.stderr)
        sys.exit(2)
    from lightning_diffusion.run.config_guard import (
        config_file_missing,
        key_problems,
        prompt_problems,
        value_problems,
        words_problems,
    )

    problems = words_problems(words[1:])  # before any parser quotes a file or imports a class_path
    # Help and --print_config ask for no run: the parser answers them as it always did.
    asks = any(word in ("-h", "--help") or word.startswith("--print_config") for word in words[1:])
    if not problems and words[0] in CONFIG_COMMANDS and not asks:
        # Before the imports that the parser needs: a missing config file, unknown keys, then values
        # of the wrong type, each as the parser would say it.
        problems = config_file_missing(words[1:]) or key_problems(words[1:]) or value_problems(words[1:])
    if not problems and words[0] in LOCAL_DATA_COMMANDS and not asks:
        found = prompt_problems(words[1:])  # said as the command says it after its parse
        if found:
            prog = "lightning-diffusion" if words[0] == "predict" else f"lightning-diffusion {words[0]}"
            print(f"{prog}: error: {found[0]}", file=sys.stderr)
            sys.exit(2)
    if problems:
        text = problems[0] if len(problems) == 1 else f"{len(problems)} problems:\n  - " + "\n  - ".join(problems)
        print(f"lightning-diffusion: error: {text}", file=sys.stderr)
        sys.exit(2)
    command = importlib.import_module(COMMANDS[words[0]][0])
    sys.exit(command.main(words[1:]))


def run() -> None:
    """The console script and ``python -m lightning_diffusion``: ``main``, then the process ends
    without the interpreter's teardown. When ``main`` returns, every output is written, synced and
    recorded and the process groups are destroyed; what is left is torch's C++ threads, whose
    destruction at interpreter exit can abort a finished run ("terminate called without an active
    exception": exit -6 after every image is written), which SLURM and shells read as a failed
    job; a failed run ends the same way, with its traceback and exit code 1. In-process callers
    use ``main``."""
    interrupt.take_start_up(sys.argv[1:])  # done already where the package was imported as the command line
    global _process_start
    _process_start = process_started_at()
    try:
        main()
        code = 0
    except SystemExit as done:
        if isinstance(done.code, str):
            print(done.code, file=sys.stderr)
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BrokenPipeError:  # ``status DIR | head -1``: the reader has what it wanted
        sys.stdout = open(os.devnull, "w")  # nothing more to flush into the closed pipe
        code = 128 + 13  # as a process killed by SIGPIPE (what git and coreutils exit with)
    except BaseException as err:  # a failure ends the same way: its traceback, then exit 1 (130: Ctrl-C)
        from lightning_diffusion.core.errors import PeerLost, RecordFailure, WritingFailed

        if isinstance(err, (RecordFailure, WritingFailed, PeerLost)):  # the message says it all, no traceback
            details = getattr(err, "details", "")
            if details:  # a writer's bug, not the file system: its traceback, for a report
                print(details.rstrip(), file=sys.stderr)
            cause = err.__cause__ if isinstance(err, RecordFailure) else None
            if cause is not None and console.verbose():  # the pipeline's own traceback, to debug it
                import traceback

                traceback.print_exception(cause, file=sys.stderr)
            print(f"lightning-diffusion: error: {err}", file=sys.stderr)
            if cause is not None and not console.verbose():
                print("lightning-diffusion: the traceback of the failed call: run again with --verbose "
                      "(lightning-diffusion --verbose predict ...) or LIGHTNING_DIFFUSION_VERBOSE=1.", file=sys.stderr)
        elif isinstance(err, KeyboardInterrupt):  # a second Ctrl-C, through the run's own handling
            print(console.INTERRUPTED_LINE, file=sys.stderr)
        else:
            import traceback

            traceback.print_exc()
        code = 130 if isinstance(err, KeyboardInterrupt) else 1
    end_process(code)


def end_process(code: int) -> NoReturn:
    """End this process with ``code`` once its logs and streams are flushed, without the
    interpreter's teardown (see ``run``)."""
    import logging
    import os

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
