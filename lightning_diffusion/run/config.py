"""The one config reader: ``DiffusionCLI`` (jsonargparse through ``LightningCLI``) parses a YAML
config and its ``--group.key value`` / ``--group.key=value`` overrides for every subcommand, and
runs the weight-free checks of ``preflight`` on the result before anything is built.

``read_config(path, overrides)`` gives the parsed config (a jsonargparse ``Namespace``) without
building a Trainer: ``verify``, ``benchmark`` and ``slurm`` read their values from it, so they see
exactly what ``predict`` will run.
"""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_diffusion.strategies  # noqa: F401  (registers the strategy names)
from lightning_diffusion.core import console
from lightning_diffusion.core.context import RunContext, checked_by_launcher, first_process
from lightning_diffusion.core.errors import ConfigError, raise_problems
from lightning_diffusion.input.data import PromptDataModule
from lightning_diffusion.module import DiffusionModule
from lightning_diffusion.output.boundaries import run_strategy
from lightning_diffusion.output.writer import ImageWriter
from lightning_diffusion.run.config_guard import (
    allowed_modules,
    not_imported_message,
    unknown_keys,
    unknown_keys_message,
)
from lightning_diffusion.run.preflight import Verdict, preflight
from lightning_diffusion.run.progress import ImageProgressBar
from lightning_diffusion.strategies.accelerators import accelerator_for_job

if TYPE_CHECKING:
    from jsonargparse import Namespace
    from lightning.pytorch import LightningDataModule

console.quiet_lightning()

TRAINER_DEFAULTS = {
    "accelerator": "auto",
    "devices": "auto",
    "strategy": "data_parallel",
    "logger": False,
    "enable_checkpointing": False,
    "enable_model_summary": False,
}


def _known_keys(parser: object) -> list[str]:
    keys = []
    for action in getattr(parser, "_actions", []):
        dest = getattr(action, "dest", None)
        if isinstance(dest, str) and dest not in ("help", "config") and not dest.startswith("_"):
            keys.append(dest)
    return keys


def friendly_parser_error(message: str, keys: list[str]) -> str:
    """jsonargparse's message, problem first and short: an unknown key with the closest known one, a
    value of the wrong type as ``KEY: expected int or null, got 'abc'``."""
    unknown = re.search(r"(?:Group '([^']+)' )?does not accept options? '([^']+)'|unrecognized arguments: --?([^\s=]+)",
                        message)
    if unknown:
        key = unknown.group(2) or unknown.group(3)
        if unknown.group(1):
            key = f"{unknown.group(1)}.{key}"
        return unknown_keys_message([key], keys)
    typed = re.match(r'Parser key "([^"]+)":', message)
    denied = re.search(r"Importing '([\w.]+)' is not allowed.*?Got value: (\S+)", message, re.S)
    if denied:  # the parser's own import check (``import_policy``): an object defined outside the allowed modules
        return not_imported_message(typed.group(1) if typed else "a value", repr(denied.group(2)),
                                    denied.group(1).rpartition(".")[0] or denied.group(1))
    if typed:
        given = re.search(r"(?:Given value|Got value): (.*)", message)
        kinds = re.findall(r"Expected a <class '(\w+)'>", message)
        names = [("null" if k == "NoneType" else k) for k in dict.fromkeys(kinds)]
        if given and names:
            return f"{typed.group(1)}: expected {' or '.join(names)}, got {given.group(1).strip()!r}"
    return " ".join(line.strip() for line in message.strip().splitlines()[:3])


@contextmanager
def import_policy() -> Iterator[None]:
    """While the parser runs: its own check of the import paths a value names (jsonargparse 4.53
    and later), behind ``config_guard``'s check of the text. Only the allowed modules
    (``config_guard.allowed_modules``) may be named, and an object only where the module that
    defines it is allowed too (``torch.os.system`` is ``os.system``). The parser's settings are
    put back after, for programs that use jsonargparse themselves."""
    saved = None
    try:
        from jsonargparse import _common, set_parsing_settings

        saved = {key: _common.parsing_settings[key] for key in ("import_path_verdicts", "import_paths_enforced")}
        set_parsing_settings(import_path_denylist=["*"], import_path_allowlist=list(allowed_modules()))
    except (ImportError, AttributeError, KeyError, TypeError, ValueError):
        pass  # an older jsonargparse, or an allowed name it does not take: config_guard's check stands
    try:
        yield
    finally:
        if saved is not None:
            _common.parsing_settings.update(saved)


class _Parser(LightningArgumentParser):
    """Parse errors as one line that starts with the problem, not 70 lines of usage; every unknown
    key of the command line and its config files at once."""

    words: list[str] = []  # the command line the last parse read (set by the top parser)

    def parse_args(self, args: Any = None, *rest: Any, **kwargs: Any) -> Any:
        _Parser.words = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, *rest, **kwargs)

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        keys = _known_keys(parser)
        text = friendly_parser_error(message, keys)
        if text.startswith("unknown key "):
            unknown = unknown_keys(_Parser.words, keys)
            if len(unknown) > 1:
                text = unknown_keys_message(unknown, keys)
        sys.stderr.write(f"lightning-diffusion: error: {text}\n")
        self.exit(2)


class DiffusionCLI(LightningCLI):
    """``LightningCLI`` with the prompt data module, the diffusion module and a top-level ``writer``."""

    def __init__(self, args: Optional[list[str]] = None, run: bool = True,
                 exit_when_complete: Optional[bool] = None, run_context: Optional[RunContext] = None) -> None:
        """``exit_when_complete``: whether an output folder that already holds every image ends the
        process at once (exit 0, one line) instead of running an empty loop; by default only when
        this parses the process's own command line (``lightning-diffusion predict`` passes True), so a
        program calling ``DiffusionCLI(args=[...])`` is not ended. ``run_context``: the run's shared
        state (``run_context``), handed to the strategy it builds; a new one by default."""
        # The ranks Lightning starts re-run this process's command line: they may trust its checks.
        self._parses_argv = args is None or list(args) == [w for w in sys.argv[1:] if w != "--verbose"]
        self._exit_when_complete = self._parses_argv if exit_when_complete is None else exit_when_complete
        self.run_context = run_context if run_context is not None else RunContext()
        # LightningCLI warns when it is given args while sys.argv has words: by design here, and said
        # even under --verbose, since it is about this package's own call, not the run.
        warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter is intended to run from within")
        if self._parses_argv and checked_by_launcher():
            self.run_context.checked = True
        with import_policy():
            super().__init__(
                DiffusionModule,
                PromptDataModule,
                save_config_callback=None,
                parser_class=_Parser,
                trainer_defaults=TRAINER_DEFAULTS,
                seed_everything_default=False,
                args=args,
                run=run,
            )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {"predict": {"model", "dataloaders", "datamodule"}}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ImageWriter, "writer")

    def before_instantiate_classes(self) -> None:
        if self.run_context.checked:
            return  # checked by the process that started this rank, on the same command line
        verdict = check_config(self.config[self.subcommand] if self.subcommand else self.config)
        if verdict.nothing_left and self._exit_when_complete:
            # A folder that holds every image: said before any weight loads (Lightning would load the
            # model and then run an empty loop).
            if first_process():  # one process of the job says it
                print(f"lightning-diffusion: {verdict.nothing_left}", file=sys.stderr)
            sys.exit(0)
        if self._parses_argv and verdict.complete:
            self.run_context.mark_checked()

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        strategy = run_strategy(self.trainer.strategy)
        if strategy is not None:  # one of ours: the run's stop, counts and checks are this CLI's
            strategy.run_context = self.run_context

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        configured = list(config.get("callbacks") or []) + list(callbacks)
        if config.get("enable_progress_bar", True) is not False and not any(
            isinstance(c, ProgressBar) for c in configured
        ):
            callbacks = [*callbacks, ImageProgressBar()]
        # A site that shows each SLURM task only its own GPU(s): devices counts the node's tasks.
        per_task = getattr(config.get("strategy"), "devices_per_process", 1)
        config = {**config, "accelerator": accelerator_for_job(config.get("accelerator", "auto"), config.get("devices"),
                                                               per_task)}
        try:
            return super()._instantiate_trainer(config, callbacks)
        except MisconfigurationException as err:  # devices this machine does not have: one line, exit code 2
            raise ConfigError("trainer: " + " ".join(str(err).split())) from err

    def predict(self, model: DiffusionModule, datamodule: Optional[LightningDataModule] = None,
                return_predictions: Optional[bool] = None,
                **kwargs: Any):
        # Returning predictions would keep every image of the run in memory; the writer has them.
        return self.trainer.predict(
            model, datamodule=datamodule, return_predictions=bool(return_predictions), **kwargs
        )


class _ParseOnly(DiffusionCLI):
    def before_instantiate_classes(self) -> None:  # the caller decides when to check
        pass

    def instantiate_classes(self) -> None:  # build nothing
        pass


def read_config(config: str, overrides: Optional[list[str]] = None, check: bool = True) -> Namespace:
    """Parse ``config`` with ``overrides`` (any ``predict`` flag) exactly as ``predict`` does and,
    with ``check``, run its weight-free checks (``check_config``); returns the config namespace
    (``cfg.model.height``, ``cfg.data.prompts``, ``cfg.trainer.strategy``...). Problems raise one
    ``ConfigError``."""
    with warnings.catch_warnings():  # "args given while sys.argv has words": by design here
        warnings.simplefilter("ignore")
        parsed = _ParseOnly(args=["--config", str(config), *(overrides or [])], run=False).config
    if check:
        check_config(parsed)
    return parsed


def check_config(config: Namespace, here: bool = True) -> Verdict:
    """Every weight-free check of a parsed config (``preflight``), reported in one ``ConfigError``;
    returns the verdict (whether the checks were complete, whether anything is left to make)."""
    verdict = preflight(config, here)
    raise_problems(verdict.problems)
    return verdict


def report_config_error(err: ValueError, prog: str) -> int:
    """For a command's ``except ValueError``: print the ConfigError behind ``err`` as
    ``PROG: error: MESSAGE`` (no traceback) and return exit code 2; anything else is re-raised."""
    error = config_error(err)
    if error is None:
        raise err
    print(f"{prog}: error: {error}", file=sys.stderr)
    return 2


def config_error(err: BaseException) -> Optional[ConfigError]:
    """The ConfigError behind ``err`` (itself or in its chain), if there is one."""
    seen = set()
    current: Optional[BaseException] = err
    while current is not None and id(current) not in seen:
        if isinstance(current, ConfigError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None
