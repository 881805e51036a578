"""``lightning-diffusion predict --config X.yaml [--group.key value ...]``: the main job."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Mapping
from typing import Optional

from lightning_diffusion.errors import ConfigError, NodeConfigError
from lightning_diffusion.run import preemption
from lightning_diffusion.run.config import DiffusionCLI, config_error
from lightning_diffusion.run.context import RunContext, first_process, first_process_of_node

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
# The sections of the full help, by their option prefix, in the order shown.
SECTIONS = (("--model", "model: the pipeline and how it is called (DiffusionModule)"),
            ("--data", "data: the prompt records (PromptDataModule)"),
            ("--writer", "writer: the output folder, formats and manifest (ImageWriter)"),
            ("--trainer", "trainer: processes, devices and strategy (Lightning's Trainer; --help-all shows its "
                          "training options too)"))


def short_help(full: str) -> str:
    """``predict --help``: this project's keys first, the Trainer's inference keys, then the rest
    of the options; the Trainer's training-only options, optimizers, schedulers and checkpoint
    arguments are left to ``--help-all`` (jsonargparse's help, which lists Lightning's first)."""
    blocks = full.split("\n\n")
    options = next((b for b in blocks if b.startswith("options:")), "")
    by_prefix: dict[str, list[str]] = {}
    for block in blocks:
        entries = _entries(block)
        prefixes = {entry.split()[0].split(".")[0] for entry in entries if entry.lstrip().startswith("--")}
        if len(prefixes) == 1:
            by_prefix.setdefault(prefixes.pop(), []).extend(entries)
    keep = tuple(f"--trainer.{key}" for key in INFERENCE_TRAINER_KEYS)
    by_prefix["--trainer"] = [strategy_entry() if e.split()[0] == "--trainer.strategy" else e
                              for e in by_prefix.get("--trainer", [])
                              if e.split()[0].rstrip(",").split(" ")[0].startswith(keep)]
    parts = ["usage: lightning-diffusion predict --config CONFIG [--GROUP.KEY VALUE ...]",
             "Make images (or videos) from prompt records with a diffusers pipeline; the same keys go in the YAML "
             "config (model:, data:, writer:, trainer:). Examples: configs/, docs/config.md.",
             options]
    for prefix, title in SECTIONS:
        if by_prefix.get(prefix):
            parts.append(title + ":\n" + "\n".join(by_prefix[prefix]))
    parts.append("--help-all shows every option, Lightning's training options included.")
    return "\n\n".join(part.rstrip() for part in parts) + "\n"


def strategy_entry() -> str:
    """``--trainer.strategy`` as this project's names it (Lightning's own text says "auto" and lists
    its training strategies)."""
    import textwrap

    from lightning_diffusion.strategies import STRATEGY_NAMES

    text = (f"{', '.join(STRATEGY_NAMES)} (default: data_parallel), or a strategy's class_path with init_args "
            "(ulysses_degree, tp_degree, ...; docs/strategies.md).")
    return "  --trainer.strategy STRATEGY\n" + textwrap.fill(text, 80, initial_indent=" " * 24,
                                                            subsequent_indent=" " * 24)


def _entries(block: str) -> list[str]:
    """A help section's options, each with its wrapped description lines (the title line dropped)."""
    entries: list[str] = []
    for line in block.splitlines()[1:]:
        if line.startswith("  -"):
            entries.append(line)
        elif entries:
            entries[-1] += "\n" + line
    return entries


def print_help(argv: list[str]) -> int:
    """``--help`` (short, see ``short_help``) or ``--help-all`` (jsonargparse's whole help)."""
    import contextlib
    import io

    every = "--help-all" in argv
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        try:
            DiffusionCLI(args=["predict", "--help"])
        except SystemExit:
            pass
    print(captured.getvalue() if every else short_help(captured.getvalue()), end="")
    return 0


def main(argv: list[str]) -> int:
    if any(word in ("-h", "--help", "--help-all") for word in argv):
        return print_help(argv)
    if not any(word.split("=")[0] in ("--config", "-c", "--data", "--data.prompts") for word in argv):
        print("lightning-diffusion: error: predict needs a config: lightning-diffusion predict --config "
              "configs/tiny.yaml (or --data.prompts and --model.* flags); predict --help lists the keys.",
              file=sys.stderr)
        return 2
    context = RunContext()
    if preemption.in_slurm_job():
        context.stop.install()  # before the weights load: SIGUSR1's default action kills the process
    try:
        DiffusionCLI(args=["predict", *argv], exit_when_complete=True, run_context=context)
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
