"""A callback of your own beside ImageWriter: one CSV line per image (index, seed, mean brightness),
written once per image under any strategy. Run as a script (Lightning starts the other ranks by
re-running the command line):

    python examples/image_stats.py OUTPUT_DIR [--devices 2] [--ulysses 2]

See docs/callbacks.md for what ``predict_step`` returns and which rank writes.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from lightning.pytorch import Callback, Trainer

from lightning_diffusion import DiffusionModule, ImageWriter, PromptDataModule


class ImageStats(Callback):
    """Mean brightness of every image, in ``stats.part-RANK.csv`` of the writing ranks."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = Path(output_dir)
        self.rows: list[tuple[int, int, float]] = []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        # Every rank of a model-parallel group (Ulysses, Ring, TP, CFG) returns the same outputs;
        # the strategy names one rank per group to write, as ImageWriter does.
        if not ImageWriter.writes_outputs(trainer):
            return
        for item in outputs:  # dicts: index, prompt, seed, negative_prompt, image, params
            self.rows.append((item["index"], item["seed"], float(item["image"].mean())))

    def on_predict_end(self, trainer, pl_module) -> None:
        if self.rows:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            with open(self.output_dir / f"stats.part-{trainer.global_rank}.csv", "w", newline="") as f:
                csv.writer(f).writerows(self.rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--ulysses", type=int, default=1, help="Ulysses degree (1: data parallel)")
    args = parser.parse_args()

    strategy = "data_parallel"
    if args.ulysses > 1:
        from lightning_diffusion.strategies import ContextParallelStrategy

        strategy = ContextParallelStrategy(ulysses_degree=args.ulysses)
    trainer = Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, logger=False,
                      enable_progress_bar=False,
                      callbacks=[ImageWriter(args.output_dir), ImageStats(args.output_dir)])
    trainer.predict(
        DiffusionModule("tiny:flux", height=64, width=64, num_inference_steps=4),
        datamodule=PromptDataModule(["a red fox", "a lighthouse", "a bowl of ramen", "an astronaut"], batch_size=2),
        return_predictions=False,
    )


if __name__ == "__main__":
    main()
