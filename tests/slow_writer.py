"""ImageWriters for the background-writing tests (used by tests only): one whose encoding is slow,
so that the queue fills, and one whose encoding fails. Their files classes live in this module, so
that the writer process imports them as the rank does."""

import time
from pathlib import Path

from lightning_diffusion import ImageWriter
from lightning_diffusion.output.files import OutputFiles


class SlowFiles(OutputFiles):
    def encode(self, picture, metadata, file):
        time.sleep(1.0)
        super().encode(picture, metadata, file)


class SlowWriter(ImageWriter):
    """Encodes each picture a second late and counts the batches handed to it in ``submitted.txt``."""

    files_class = SlowFiles

    def write_on_batch_end(self, trainer, pl_module, prediction, *args, **kwargs):
        with open(Path(self.output_dir) / "submitted.txt", "a") as f:
            f.write(f"{len(prediction)}\n")
        super().write_on_batch_end(trainer, pl_module, prediction, *args, **kwargs)


class FailingFiles(OutputFiles):
    @staticmethod
    def fails(metadata):
        return metadata["index"] == 2

    def encode(self, picture, metadata, file):
        if self.fails(metadata):
            raise OSError("disk full (on purpose)")
        super().encode(picture, metadata, file)


class FailingWriter(ImageWriter):
    files_class = FailingFiles


class LastFailsFiles(FailingFiles):
    @staticmethod
    def fails(metadata):
        return metadata["prompt"] == "the last one fails"


class LastFailsWriter(ImageWriter):
    files_class = LastFailsFiles


class PacedWriter(ImageWriter):
    """Holds each batch ``seconds[global rank]`` seconds before writing it (a slower replica, or a
    job that stays open long enough to be joined, killed or frozen mid-batch)."""

    def __init__(self, *args, seconds=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.seconds = seconds or {}

    def write_on_batch_end(self, trainer, pl_module, prediction, *args, **kwargs):
        time.sleep(self.seconds.get(trainer.global_rank, 0.0))
        super().write_on_batch_end(trainer, pl_module, prediction, *args, **kwargs)
