"""``OutputStore.status``: a folder's, with what a scheduler knows of the job array submitted into it."""

from pathlib import Path

import pytest

from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.output.store import open_store


class QueuedArray:
    """A scheduler that holds an array of 2 shards over 4 images submitted into the folder (job 7),
    whose shard 1 still waits its turn."""

    active_states = {"PENDING", "RUNNING"}

    def submitted(self, folder: Path) -> dict:
        return {"job": "7", "num_shards": 2, "shards": [0, 1], "expected": 4}

    def states(self, folder: Path) -> dict:
        return {2: {1: {"job": "7_1", "state": "PENDING"}}}


def test_a_folder_with_only_a_submitted_array_reads_as_running_with_its_queued_task(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    status = open_store(out).status(arrays=QueuedArray())
    assert status["expected"] == 4 and status["done"] == 0 and status["running"] and not status["complete"]
    assert [(s["shard"], s["expected"], s.get("slurm_state"), s["slurm_job"]) for s in status["shards"]] == [
        (0, 2, None, None), (1, 2, "PENDING", "7_1")]
    with pytest.raises(ConfigError, match="is not an output folder of lightning-diffusion"):
        open_store(out).status()  # without the scheduler's record, nothing marks it as an output folder


def test_a_buckets_rejected_images_are_read_from_its_rejected_lines():
    """``rejected.jsonl``'s lines name their record and images, not an index: each counts (fsspec's
    memory file system stands for the bucket)."""
    import json

    from lightning_diffusion.output.object_store import ObjectStore

    store = ObjectStore("memory://bucket/rejected-run", None)
    fs, root = store.fs
    lines = [{"record": 2, "line": "prompts.jsonl:2", "reason": "no prompt", "images": [2, 3]},
             {"record": 5, "line": "prompts.jsonl:5", "reason": "no prompt", "images": [8, 9]}]
    fs.pipe_file(f"{root}/rejected.jsonl", "".join(json.dumps(line) + "\n" for line in lines).encode())
    assert store.rejected_images() == {2, 3, 8, 9}
