"""A command's start-up without Python's cycle collector.

A run's start imports torch, Lightning, diffusers and transformers and loads the pipeline: objects
that live as long as the process, made faster than the cycle collector's thresholds, so its
collections walk them again and again while they are made. Without it a one-process ``predict``
of ``configs/tiny.yaml`` takes about 12% less CPU time (8.4 -> 7.4 s of user time, the means of five
runs each, alternating, on a 2-core machine), and every rank of a run and every test that starts one
saves as much.

The command line pauses the collector first thing (``pause``); it is resumed as it was once the
prediction loop starts (``ImageWriter.on_predict_start`` and ``DiffusionModule.on_predict_start``,
either), or, for another command than ``predict``, once that command is imported (``verify`` and
``benchmark`` compare runs, one of them diffusers called directly: both with the collector on).
Reference counting frees what it always frees meanwhile; only garbage cycles wait. A run from Python
(``Trainer.predict``) never pauses it.
"""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """Stop the cycle collector until ``resume`` (where it runs: one the caller stopped stays so)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Start the cycle collector again where ``pause`` stopped it; otherwise nothing."""
    global _paused
    if _paused:
        _paused = False
        gc.enable()
