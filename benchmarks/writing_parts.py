"""Writer-process stand-ins for ``writing.py --paths ipc encode``: the hand-over to the writer
process alone, and the writer's encoding without its file calls. In a module of their own, so that
the writer process imports them (benchmarks/ is on its path as on the benchmark's), and importing
``lightning_diffusion.output.files`` only, as the writer process does: not torch or Lightning, whose
import (seconds of CPU) would land on the first pairs."""

from __future__ import annotations

import io
from typing import Any

from PIL import Image

from lightning_diffusion.output.files import OutputFiles, to_uint8


class HandOverFiles(OutputFiles):
    """Receives each batch (the pipe, the unpickling, the acknowledgement) and writes nothing."""

    def write_batch(self, prediction: list[dict[str, Any]]) -> None:
        return None


class EncodeFiles(OutputFiles):
    """Encodes each picture with its metadata as ``write_output`` does, into memory: no file calls."""

    def write_batch(self, prediction: list[dict[str, Any]]) -> None:
        for item in prediction:
            self.encode(Image.fromarray(to_uint8(item["image"])), self.metadata(item), io.BytesIO())

