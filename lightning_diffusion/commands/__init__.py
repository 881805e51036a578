"""The subcommands of ``lightning-diffusion``, one module each, dispatched from ``COMMANDS``.

Each module has ``main(argv: list[str]) -> int``; ``cli.main`` imports only the one it runs.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    import argparse

# name -> (module, one line for ``lightning-diffusion --help``)
COMMANDS: dict[str, tuple[str, str]] = {
    "predict": ("lightning_diffusion.commands.predict", "make the images of a config (the main job)"),
    "verify": ("lightning_diffusion.commands.verify", "compare a parallel config's images with one device's"),
    "benchmark": ("lightning_diffusion.commands.benchmark",
                  "time a config, optionally against diffusers called directly"),
    "plan": ("lightning_diffusion.commands.plan", "recommend a strategy and write its config for a model and GPUs"),
    "slurm": ("lightning_diffusion.commands.slurm", "render, submit and follow a SLURM batch job for a config"),
    "k8s": ("lightning_diffusion.commands.k8s", "render a Kubernetes job of torchrun nodes for a config (no operator)"),
    "download": ("lightning_diffusion.commands.download",
                 "fetch a config's hub weights ahead of a job (offline nodes)"),
    "status": ("lightning_diffusion.commands.status", "how far the run writing an output folder is (read-only)"),
    "eval": ("lightning_diffusion.commands.eval",
             "metrics of an output folder: against a reference, prompt adherence, FID/KID"),
    "audit": ("lightning_diffusion.commands.audit",
              "re-make a sample of an output folder's images without accelerators and compare"),
    "report": ("lightning_diffusion.commands.report_page", "one HTML page of a run: its pictures, pace and cost"),
    "make-tiny": ("lightning_diffusion.commands.make_tiny", "write a tiny random pipeline (no download)"),
}


def add_json_option(parser: argparse.ArgumentParser, what: str) -> None:
    """Every subcommand's ``--json``: alone, ``what`` as JSON on stdout instead of the human
    report; ``--json FILE.json`` (or ``--json=FILE`` for any name), written to FILE beside the
    report. Parse with ``json_argv(argv)`` so that ``status --json DIR`` keeps DIR positional."""
    parser.add_argument("--json", nargs="?", const="-", metavar="FILE.json",
                        help=f"{what} as JSON: on stdout instead of the report (--json alone), or into "
                             "FILE.json (--json=FILE for a name not ending in .json)")


def json_argv(argv: Optional[list[str]]) -> Optional[list[str]]:
    """``argv`` with a bare ``--json`` that is followed by a word not ending in ``.json`` made
    ``--json=-`` (stdout), so ``status --json outputs/run`` reads the folder as the folder, not as
    the file to write."""
    if argv is None:
        argv = sys.argv[1:]
    out = list(argv)
    for i, word in enumerate(out[:-1]):
        if word == "--json" and not out[i + 1].lower().endswith(".json"):
            out[i] = "--json=-"
    return out


def report(json_to: Optional[str], result: object, human: Callable[[], None],
           default: Optional[Callable[[object], object]] = None,
           repeats_json: bool = False) -> None:
    """Print the human report (``human``) and the JSON as ``--json`` asks: on stdout alone (the
    report then goes to stderr, so that stdout parses, or nowhere where it ``repeats_json``), or
    into a file."""
    if json_to == "-":
        if not repeats_json:
            with contextlib.redirect_stdout(sys.stderr):
                human()
        print(json.dumps(result, indent=2, default=default))
        return
    human()
    if json_to:
        Path(json_to).write_text(json.dumps(result, indent=2, default=default) + "\n")


def terminal_width() -> int:
    """The columns help text is wrapped to: the terminal's (``COLUMNS`` where set), at least 40."""
    return max(40, shutil.get_terminal_size((100, 24)).columns)


def plain_text(text: str) -> str:
    """A docstring's reStructuredText as terminal text: ````literal```` as literal, ``:role:`x``` as
    x, ``::`` as ``:``."""
    text = re.sub(r"``(.+?)``", r"\1", text, flags=re.S)
    text = re.sub(r":\w+:`([^`]+)`", r"\1", text)
    return re.sub(r"(\S)::$", r"\1:", text, flags=re.M)


def help_text(doc: Optional[str], width: Optional[int] = None) -> str:
    """A command's docstring as its ``--help`` description (``RawDescriptionHelpFormatter``): plain
    text (``plain_text``), each paragraph and bullet wrapped to the terminal (``terminal_width``);
    indented lines (a command shown as an example) are kept as they are."""
    width = (width or terminal_width()) - 2
    blocks: list[str] = []
    for paragraph in textwrap.dedent(plain_text(doc or "")).strip().split("\n\n"):
        lines = paragraph.splitlines()
        if all(line.startswith("    ") for line in lines):  # an example, as written
            blocks.append(paragraph)
            continue
        items: list[str] = []
        for line in lines:  # bullets ("* ", "- ") start items; other lines continue the last one
            if line.lstrip().startswith(("* ", "- ")) or not items:
                items.append(line.strip())
            else:
                items[-1] += " " + line.strip()
        blocks.append("\n".join(
            textwrap.fill(item, width, subsequent_indent="  " if item.startswith(("* ", "- ")) else "",
                          break_on_hyphens=False, break_long_words=False)
            for item in items))
    return "\n\n".join(blocks)
