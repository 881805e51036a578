"""``lightning-diffusion predict --config X.yaml [--group.key value ...]``: the main job."""

from __future__ import annotations

import os
import re
import socket
import sys
import textwrap
import time
from collections.abc import Mapping
from typing import Optional

from lightning_diffusion.core import preemption
from lightning_diffusion.core.context import RunContext, first_process, first_process_of_node
from lightning_diffusion.core.errors import ConfigError, NodeConfigError
from lightning_diffusion.run.config import DiffusionCLI, config_error

SILENT_EXIT_DELAY = 2.0  # seconds a process that does not print a refusal waits before it exits


def error_line(error: ConfigError, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """What this process prints for a refusal, or None where another process says it. Every
    process finds a problem of the config: the job's first one says it. A problem of one machine
    (``NodeConfigError``: too few GPUs, say) may be found on some nodes only, whose processes are
    not the job's first: the first process of each node that finds it says it, naming the host."""
    if isinstance(error, NodeConfigError):
        if not first_process_of_node(environ):
            return None
        return f"lightning-diffusion: error: on {socket.gethostname()}: {error}"
    return f"lightning-diffusion: error: {error}" if first_process(environ) else None


# The Trainer's options an inference run uses (the others train: epochs, optimizers, clipping...).
INFERENCE_TRAINER_KEYS = ("accelerator", "strategy", "devices", "num_nodes", "callbacks", "enable_progress_bar",
                          "limit_predict_batches")
# The sections of the help, by their option prefix, in the order shown.
SECTIONS = (("--model", "model: the pipeline and how it is called (DiffusionModule)"),
            ("--data", "data: the prompt records (PromptDataModule)"),
            ("--writer", "writer: the output folder, formats and manifest (ImageWriter)"),
            ("--trainer", "trainer: processes, devices and strategy (Lightning's Trainer)"))
# Options of the parser left to --help-all: Lightning's global seed (images take their seeds from
# data.seed and the records), each group's "read this group from a file" entry (said once, in the
# introduction) and the help of Lightning's classes.
HIDDEN = ("--seed_everything", "--model", "--data", "--writer", "--trainer", "--trainer.callbacks.help",
          "--trainer.accelerator.help", "--trainer.strategy.help")
HELP_COLUMN = 24  # where descriptions start, as argparse places them


def short_help(full: str, width: Optional[int] = None) -> str:
    """``predict --help``: what a prediction run can use (this project's keys, the Trainer's
    inference keys, the parser's own options), as plain text wrapped to ``width`` (the terminal's);
    the Trainer's training options and the whole parser's help are left to ``--help-all``. ``full``:
    jsonargparse's help, printed unwrapped (``print_help``)."""
    from lightning_diffusion.commands import help_text, terminal_width

    width = width or terminal_width()
    blocks = full.split("\n\n")
    options = next((b for b in blocks if b.startswith("options:")), "")
    by_prefix: dict[str, list[tuple[str, str]]] = {"": [e for e in _entries(options) if e[0].split()[0] != "-c"]}
    by_prefix[""][:0] = [("-c CONFIG, --config CONFIG", "a YAML config (configs/tiny.yaml); given again, each "
                          "later one overrides the earlier"),
                         ("--prompt TEXT", "a prompt to make, in place of the config's data.prompts, with no YAML "
                          "quoting; repeat it for several (--prompt 'a red circle' --prompt 'a blue star')")]
    for block in blocks:
        entries = _entries(block)
        prefixes = {entry[0].split()[0].split(".")[0] for entry in entries if entry[0].startswith("--")}
        if len(prefixes) == 1:
            by_prefix.setdefault(prefixes.pop(), []).extend(entries)
    keep = tuple(f"--trainer.{key}" for key in INFERENCE_TRAINER_KEYS)
    trainer = [e for e in by_prefix.get("--trainer", []) if _option(e).startswith(keep)]
    by_prefix["--trainer"] = [strategy_entry() if _option(e) == "--trainer.strategy" else
                              callbacks_entry() if _option(e) == "--trainer.callbacks" else e for e in trainer]
    intro = ("Make images (or videos) from prompt records with a diffusers pipeline. Every key below also goes in "
             "the YAML config (model:, data:, writer:, trainer:), and a group may come from a file of its own "
             "(--model model.yaml). Examples: configs/, docs/config.md.")
    usage = textwrap.fill("usage: lightning-diffusion predict --config CONFIG [--GROUP.KEY VALUE ...]", width - 2,
                          subsequent_indent=" " * 7, break_on_hyphens=False)
    parts = [usage, help_text(intro, width), "options:\n" + _format(by_prefix[""], width)]
    for prefix, title in SECTIONS:
        if by_prefix.get(prefix):
            parts.append(help_text(title + ":", width) + "\n" + _format(by_prefix[prefix], width))
    parts.append(help_text("--help-all shows every option, Lightning's training options included.", width))
    return "\n\n".join(part.rstrip() for part in parts) + "\n"


def _option(entry: tuple[str, str]) -> str:
    """An entry's option name (``--trainer.devices``), without its metavar or its ``+`` form."""
    return entry[0].split()[0].rstrip(",")


def strategy_entry() -> tuple[str, str]:
    """``--trainer.strategy`` as this project names it (Lightning's own text says "auto" and lists
    its training strategies)."""
    from lightning_diffusion.strategies import STRATEGY_NAMES

    return ("--trainer.strategy",
            f"{', '.join(STRATEGY_NAMES)} (default: data_parallel), or a strategy's class_path with init_args "
            "(ulysses_degree, tp_degree, ...; docs/strategies.md).")


def callbacks_entry() -> tuple[str, str]:
    """``--trainer.callbacks`` for a prediction run (Lightning's lists its training callbacks)."""
    return ("--trainer.callbacks, --trainer.callbacks+",
            "callbacks of your own beside the writer: a class_path with init_args, or a list of them "
            "(docs/callbacks.md). (default: null)")


def _entries(block: str) -> list[tuple[str, str]]:
    """A help section's options as (invocation, description), the description in one line
    (the title line dropped); the options of ``HIDDEN`` left out. A metavar that repeats the key
    (``--model.height HEIGHT``) is dropped: the description ends with the type."""
    entries: list[tuple[str, str]] = []
    for line in block.splitlines()[1:]:
        if line.startswith("  -"):
            head, _, text = line.strip().partition("  ")
            head = re.sub(r"(--[\w.]*?(\w+)\+?) (\w+)\b", lambda m: m.group(1) if m.group(3) == m.group(2).upper()
                          else m.group(0), head.strip())
            entries.append((head, text.strip()))
        elif entries:
            head, text = entries[-1]
            entries[-1] = (head, f"{text} {line.strip()}".strip())
    return [e for e in entries if _option(e) not in HIDDEN]


def _brief_type(text: str) -> str:
    """jsonargparse's ``(type: Optional[int], default: null)`` as ``(int or null; default: null)``;
    the known subclasses it lists are left to ``--help-all``."""
    def kinds(match: re.Match) -> str:
        required, kind, default = match.group(1), match.group(2), match.group(3)
        optional = re.fullmatch(r"Optional\[(.*)\]", kind)
        if optional:
            kind = f"{optional.group(1)} or null"
        union = re.fullmatch(r"Union\[(.*)\]", kind)
        if union:
            names = [n.strip() for n in re.split(r",(?![^\[]*\])", union.group(1))]
            kind = ", ".join(names[:-1]) + " or " + names[-1]
        said = [w for w in (required and "required", kind, default is not None and f"default: {default}") if w]
        return "(" + "; ".join(said) + ")"

    return re.sub(r"\((required, )?type: (.*?)(?:, default: (.*?))?(?:, known subclasses: [^)]*)?\)$", kinds, text)


def _format(entries: list[tuple[str, str]], width: int) -> str:
    """Options as argparse lays them out (description at column ``HELP_COLUMN``, on the option's line
    when it fits), in plain text wrapped to ``width``."""
    from lightning_diffusion.commands import plain_text

    indent = " " * HELP_COLUMN
    lines = []
    for head, text in entries:
        description = _brief_type(plain_text(text))
        wrapped = textwrap.wrap(description, max(20, width - HELP_COLUMN), break_on_hyphens=False,
                                break_long_words=False) or [""]
        if len(head) <= HELP_COLUMN - 4:
            lines.append(f"  {head:<{HELP_COLUMN - 2}}{wrapped[0]}".rstrip())
            wrapped = wrapped[1:]
        else:
            lines.append(f"  {head}")
        lines.extend(indent + line for line in wrapped)
    return "\n".join(lines)


def print_help(argv: list[str]) -> int:
    """``--help`` (short, see ``short_help``) or ``--help-all`` (jsonargparse's whole help)."""
    import contextlib
    import io

    every = "--help-all" in argv
    captured = io.StringIO()
    columns = os.environ.get("COLUMNS")
    if not every:
        os.environ["COLUMNS"] = "100000"  # one line a description: short_help wraps it to the terminal
    try:
        with contextlib.redirect_stdout(captured):
            try:
                DiffusionCLI(args=["predict", "--help"])
            except SystemExit:
                pass
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    print(captured.getvalue() if every else short_help(captured.getvalue()), end="")
    return 0


def say_start_up(cli: DiffusionCLI) -> None:
    """After the run's summary (``made ...; wall W s``, which counts from the writer's setup), the
    time before it: Python, the imports, the config and its checks, from the command's start."""
    from lightning_diffusion.core.console import log
    from lightning_diffusion.core.system import command_start
    from lightning_diffusion.output.writer import ImageWriter

    trainer = getattr(cli, "trainer", None)
    writer = next((c for c in getattr(trainer, "callbacks", []) if isinstance(c, ImageWriter)), None)
    summary = getattr(writer, "summary", None)
    if trainer is None or writer is None or not summary or not trainer.is_global_zero:
        return
    start_up = max(0.0, writer.started_at - command_start())
    log.info(f"start-up {start_up:.1f} s (Python, imports, the config and its checks), wall {summary['wall_s']:.1f} s "
             f"(loading and the run): {start_up + summary['wall_s']:.1f} s from the command to its end")


def main(argv: list[str]) -> int:
    if any(word in ("-h", "--help", "--help-all") for word in argv):
        return print_help(argv)
    if not any(word.split("=")[0] in ("--config", "-c", "--data", "--data.prompts") for word in argv):
        print("lightning-diffusion: error: predict needs a config: lightning-diffusion predict --config "
              "configs/tiny.yaml (or --data.prompts or --prompt, and --model.* flags); predict --help lists the keys.",
              file=sys.stderr)
        return 2
    context = RunContext()
    if preemption.in_slurm_job():
        context.stop.install()  # before the weights load: SIGUSR1's default action kills the process
    try:
        cli = DiffusionCLI(args=["predict", *argv], exit_when_complete=True, run_context=context)
        say_start_up(cli)
        # Stopped on SLURM's signal with images left: requeue the job (global rank 0).
        return context.finish_job()
    except SystemExit as exit_info:
        # A second Ctrl-C: Lightning's shutdown exits with 1; the shell's convention is 128 + SIGINT.
        if isinstance(exit_info.__context__, KeyboardInterrupt):
            return preemption.INTERRUPT_EXIT_CODE
        raise
    except ValueError as err:
        error = config_error(err)
        if error is None:
            raise
        # Input that cannot work: the message says what to change; a traceback adds nothing.
        line = error_line(error)
        if line is not None:
            print(line, file=sys.stderr)
        elif preemption.in_slurm_job() or "LOCAL_RANK" in os.environ:
            # The process that says it finds it at about the same time: exit after it, or srun's
            # --kill-on-bad-exit (or a launcher) could stop it before it has said it.
            time.sleep(SILENT_EXIT_DELAY)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # Left to interpreter exit, gloo's groups can abort the process ("terminate called"); a
            # refusal after the group started (a folder in use) must not leave it to the next run.
            dist.destroy_process_group()
