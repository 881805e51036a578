"""``lightning-diffusion make-tiny KIND DIR``: write a tiny random pipeline with ``save_pretrained``."""

from __future__ import annotations

import argparse

from lightning_diffusion.pipelines import specs


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-diffusion make-tiny",
        description="Write a tiny random pipeline (no download) with save_pretrained, in safetensors.",
    )
    parser.add_argument("kind", choices=sorted(specs.tiny_names()))
    parser.add_argument("directory")
    args = parser.parse_args(argv)
    from lightning_diffusion.core.console import no_progress_bars

    with no_progress_bars():
        path = specs.tiny_builders()[args.kind](args.directory)
    print(f"wrote tiny {args.kind} pipeline to {path}")
    return 0
