"""The ``lightning-diffusion`` command.

    lightning-diffusion predict --config configs/tiny.yaml [--data.prompts p.jsonl] [--writer.output_dir out]
    lightning-diffusion make-tiny flux DIR
    lightning-diffusion verify --config X.yaml [--num-prompts K]
    lightning-diffusion benchmark --config X.yaml [--compare-diffusers] [--json out.json]
    lightning-diffusion plan --model ID --gpus N --gpu-memory 80GB [--interconnect pcie] [--height H --width W]
    lightning-diffusion slurm --config X.yaml [--nodes N] [--gpus-per-node G] [--time T] [--submit] [--wait]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_diffusion.strategies  # noqa: F401  (registers the strategy names)
from lightning_diffusion import preemption, specs
from lightning_diffusion.data import PromptDataModule
from lightning_diffusion.errors import ConfigError, raise_problems
from lightning_diffusion.preflight import preflight
from lightning_diffusion.module import DiffusionModule
from lightning_diffusion.progress import ImageProgressBar
from lightning_diffusion.writer import ImageWriter

TRAINER_DEFAULTS = {
    "accelerator": "auto",
    "devices": "auto",
    "strategy": "data_parallel",
    "logger": False,
    "enable_checkpointing": False,
    "enable_model_summary": False,
}


class DiffusionCLI(LightningCLI):
    """``LightningCLI`` with the prompt data module, the diffusion module and a top-level ``writer``."""

    def __init__(self, args: Optional[list[str]] = None, run: bool = True) -> None:
        super().__init__(
            DiffusionModule,
            PromptDataModule,
            save_config_callback=None,
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
        config = self.config[self.subcommand] if self.subcommand else self.config
        raise_problems(preflight(config))

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        configured = list(config.get("callbacks") or []) + list(callbacks)
        if config.get("enable_progress_bar", True) is not False and not any(
            isinstance(c, ProgressBar) for c in configured
        ):
            callbacks = [*callbacks, ImageProgressBar()]
        return super()._instantiate_trainer(config, callbacks)

    def predict(self, model: DiffusionModule, datamodule: Any = None, return_predictions: Optional[bool] = None, **kwargs: Any):
        # Returning predictions would keep every image of the run in memory; the writer has them.
        return self.trainer.predict(
            model, datamodule=datamodule, return_predictions=bool(return_predictions), **kwargs
        )


def config_with_overrides(config: str, extra: list[str]) -> dict[str, Any]:
    """A YAML config as a dict with ``--group.key value`` flags applied, the last one winning as in
    the CLI itself (for the subcommands that read a few values before running ``predict``)."""
    import yaml

    loaded = yaml.safe_load(Path(config).read_text()) or {}
    for i, word in enumerate(extra[:-1]):
        if word.startswith("--") and "." in word:
            group, _, key = word[2:].partition(".")
            if "." not in key:
                loaded.setdefault(group, {})[key] = yaml.safe_load(extra[i + 1])
    return loaded


def make_tiny(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-diffusion make-tiny",
        description="Write a tiny random pipeline (no download) with save_pretrained, in safetensors.",
    )
    builders = specs.tiny_builders()
    parser.add_argument("kind", choices=sorted(builders))
    parser.add_argument("directory")
    args = parser.parse_args(argv)
    path = builders[args.kind](args.directory)
    print(f"wrote tiny {args.kind} pipeline to {path}")


def main(argv: Optional[list[str]] = None) -> None:
    words = list(sys.argv[1:] if argv is None else argv)
    if words and words[0] == "make-tiny":
        make_tiny(words[1:])
        return
    if words and words[0] == "verify":
        from lightning_diffusion.verify import main as verify

        sys.exit(verify(words[1:]))
    if words and words[0] == "plan":
        from lightning_diffusion.plan import main as plan

        sys.exit(plan(words[1:]))
    if words and words[0] == "benchmark":
        from lightning_diffusion.benchmark import main as benchmark

        sys.exit(benchmark(words[1:]))
    if words and words[0] == "slurm":
        from lightning_diffusion.slurm import main as slurm

        sys.exit(slurm(words[1:]))
    if preemption.in_slurm_job():
        preemption.install()  # before the weights load: SIGUSR1's default action kills the process
    try:
        cli = DiffusionCLI(args=argv)
    except ValueError as err:
        message = config_error_message(err)
        if message is None:
            raise
        # Input that cannot work: the message says what to change; a traceback adds nothing.
        # Every rank finds the same problem; the first process of each node says it.
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"lightning-diffusion: error: {message}", file=sys.stderr)
        sys.exit(2)
    # Stopped on SLURM's signal with images left: requeue the job (global rank 0).
    code = preemption.finish_job(cli.trainer.strategy)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # Left to interpreter exit, gloo's extra groups can abort the process ("terminate called").
        dist.destroy_process_group()
    sys.exit(code)


def config_error_message(err: BaseException) -> Optional[str]:
    """The message of the ConfigError behind ``err`` (itself or in its chain), if there is one."""
    seen = set()
    current: Optional[BaseException] = err
    while current is not None and id(current) not in seen:
        if isinstance(current, ConfigError):
            return str(current)
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


if __name__ == "__main__":
    main()
