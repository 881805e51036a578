"""A third kind of storage in one file (``output/memory_storage.py``, ``writer.output_dir:
memory://...``): the bucket's run, resume and status on it unchanged. Its objects live in this
process, so the runs are made here (``run_here``) with the writer in a thread."""

import io
import json
import tarfile
import threading
import uuid

from lightning_diffusion.output.memory_storage import MemoryStorage
from lightning_diffusion.output.object_store import ObjectStore
from lightning_diffusion.output.storage import open_storage
from tests.conftest import run_here

PROMPTS = "[" + ", ".join(f"memory prompt {i}" for i in range(6)) + "]"


def _url() -> str:
    return f"memory://bucket-{uuid.uuid4().hex[:8]}/out"


def _args(out: str) -> list[str]:
    return ["predict", "--config", "configs/tiny-flux.yaml", "--writer.output_dir", out, "--writer.format",
            "webdataset", "--writer.samples_per_shard", "2", "--writer.write_in", "thread", "--data.prompts",
            PROMPTS, "--data.batch_size", "2", "--model.num_inference_steps", "2",
            "--trainer.enable_progress_bar", "false"]


def _indices(url: str) -> list[int]:
    """Every manifest line's index, each line once (an image written twice shows twice)."""
    storage = open_storage(url)
    names = list(storage.stat("manifest", recursive=True))
    return sorted(json.loads(raw)["index"] for blob in storage.read_many(names).values() for raw in blob.splitlines())


def _members(url: str) -> dict[str, bytes]:
    storage = open_storage(url)
    found = {}
    for name in storage.names():
        if name.endswith(".tar"):
            with tarfile.open(fileobj=io.BytesIO(storage.read(name))) as tar:
                found.update({m.name: tar.extractfile(m).read() for m in tar.getmembers()})  # type: ignore[union-attr]
    return found


def test_memory_urls_open_the_memory_storage_and_its_create_is_made_once():
    url = _url()
    storage = open_storage(url)
    assert isinstance(storage, MemoryStorage)
    won: list[bool] = []
    threads = [threading.Thread(target=lambda n=n: won.append(storage.create("slot", str(n).encode())))
               for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(won) == [False] * 15 + [True]
    assert not storage.create("slot", b"again") and storage.read("slot") in {str(n).encode() for n in range(16)}
    storage.write("folder/a", b"1")
    storage.write("folder/b", b"22")
    assert storage.names() == ["folder", "slot"] and storage.names("folder") == ["a", "b"]
    assert {name: stat.size for name, stat in storage.stat("folder", recursive=True).items()} == {
        "folder/a": 1, "folder/b": 2}
    assert storage.read_many(["folder/a", "folder/gone"]) == {"folder/a": b"1"}
    storage.delete("folder/a")
    assert not storage.exists("folder/a") and storage.exists("folder/b")


def test_a_run_into_memory_resumes_each_image_once_and_status_reads_it():
    url = _url()
    run_here(*_args(url))
    assert _indices(url) == list(range(6))
    assert ObjectStore.open(url, None).recorded()[0].tolist() == list(range(6))
    made = _members(url)
    status = run_here("status", url, check=False)
    assert status.returncode == 0 and f"{url}: 6 of 6 (100%) outputs, complete" in status.stdout

    storage = open_storage(url)  # as if the last shard's upload never ended: its manifest object is gone
    storage.delete("manifest/shard-000000002.tar.rank-0.jsonl")
    partial = json.loads(run_here("status", url, "--json", check=False).stdout)
    assert partial["done"] == 4 and not partial["running"]

    run_here(*_args(url))  # the resume makes the two again, and nothing else
    assert _indices(url) == list(range(6))
    assert _members(url) == made
    assert run_here("status", url, check=False).returncode == 0
    again = run_here(*_args(url))  # a rerun of a complete output makes nothing
    assert _indices(url) == list(range(6)) and again.returncode == 0


def test_a_report_reads_a_memory_output_through_its_store(tmp_path):
    from lightning_diffusion.commands.report_page import build

    url = _url()
    run_here(*_args(url))
    result = build(url, html=str(tmp_path / "run.html"))
    assert result["images"] == result["thumbs_made"] == 6


def test_a_pool_in_memory_claims_each_batch_by_a_create_and_records_each_image_once():
    url = _url()
    run_here(*_args(url), "--data.schedule", "pull")
    assert _indices(url) == list(range(6))
    storage = open_storage(url)
    assert storage.names("pool") and any(name.startswith("claims-") for name in storage.names("pool"))
    assert json.loads(run_here("status", url, "--json", check=False).stdout)["done"] == 6
