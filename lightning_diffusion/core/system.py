"""Small helpers of the operating system and files that parts of every layer use."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Optional

# When the command began (``cli.main``'s call; the process's own start where the console script runs
# it): a run's summary says its start-up beside its wall time (``commands.predict``).
_command_start = time.time()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host lives (a pid no process can have, from a corrupt record,
    is taken as alive: only a proven death frees a lock or a pool's batch)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def sha256(path: str) -> str:
    """The SHA-256 of the file at ``path``, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_stat(path: str) -> dict[str, int]:
    """What a file's metadata records to tell it unchanged without reading it: size and modification time."""
    stat = Path(path).stat()
    return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def set_command_start(at: float) -> None:
    global _command_start
    _command_start = at


def command_start() -> float:
    """When the command began (``set_command_start``; this module's import where nothing set it)."""
    return _command_start


def process_started_at() -> Optional[float]:
    """When this process started (Linux: ``/proc``), its interpreter's start-up and first imports
    included; None where the system does not say."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command's name
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
