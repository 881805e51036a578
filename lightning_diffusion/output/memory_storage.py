"""``writer.output_dir: memory://bucket/prefix``: a run's records in this process's memory, through
fsspec's memory file system, for tests and trials: what every ``storage.Storage`` must give, shown in
one file. The objects live as long as the process, and are seen by no other process: write with
``writer.write_in: thread`` on one process (the writer process would upload into its own memory).

fsspec's memory file system checks that an object is absent and then makes it as two steps; here
one lock over every change makes a create atomic, as a conditional PUT is.
"""

from __future__ import annotations

import threading
from pathlib import Path

from lightning_diffusion.output.storage import FsspecStorage

_CHANGES = threading.Lock()  # one for the process: the memory file system's objects are the process's


class MemoryStorage(FsspecStorage):
    """``storage.Storage`` in this process's memory (fsspec's ``memory://``)."""

    def write(self, name: str, data: bytes) -> None:
        with _CHANGES:
            super().write(name, data)

    def create(self, name: str, data: bytes) -> bool:
        with _CHANGES:
            fs = self.fs[0]
            if fs.exists(self.path(name)):
                return False
            fs.pipe_file(self.path(name), data)
            return True

    def upload(self, local: Path, name: str) -> None:
        with _CHANGES:
            super().upload(local, name)

    def delete(self, name: str) -> None:
        with _CHANGES:
            super().delete(name)
