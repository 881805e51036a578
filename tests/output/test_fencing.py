"""Exactly once under every timing (``output.fence``): a pool's worker frozen at each step of a
batch, past its lease, while another worker takes its batches over, then continued. Driven
deterministically: the pool's clock is injected (the lease lapses when the test says so), the
freeze is placed at a named step of the publication (``fence.PAUSE``), and the outputs are the
real files, tar shards, manifest and claims in a folder and in a bucket (the local S3 server)."""

import json
import os
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from lightning_diffusion.input.batching import BatchPlan
from lightning_diffusion.input.data import BatchDataset, PromptDataset
from lightning_diffusion.input.pull import PullSampler, claim_of
from lightning_diffusion.output import fence
from lightning_diffusion.output.bucket_pool import BucketPoolFiles
from lightning_diffusion.output.files import OutputFiles
from lightning_diffusion.output.folder_store import FolderStore
from lightning_diffusion.output.manifest import MANIFEST
from lightning_diffusion.output.object_store import ObjectStore
from lightning_diffusion.output.pool import SEAL_GRACE, FolderPoolFiles, Pool
from lightning_diffusion.output.recorded import litdata_members
from lightning_diffusion.output.settings import WriterSettings
from tests.output.test_object_store import s3  # noqa: F401  (the local S3 server)

IMAGES, BATCH, LEASE, DIGEST = 8, 2, 5.0, "fencetest"
RECORDS = [{"prompt": f"fenced prompt {i}"} for i in range(IMAGES)]
# Where worker A stops: before writing (its claim made; its images made, in memory), then at each
# step of the publication (files under temporary names or the tar closed; inside the fence;
# renamed into place or uploaded, before the lines), and after its lines.
STEPS = ["claimed", "made", "written", "locked", "published", "recorded"]
LAYOUTS = {"files": ("files", "flat"), "sharded": ("files", "sharded"), "webdataset": ("webdataset", "flat"),
           "parquet": ("parquet", "flat"), "litdata": ("litdata", "flat")}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _plan() -> BatchPlan:
    batches = IMAGES // BATCH
    return BatchPlan(order=np.arange(IMAGES), starts=np.arange(0, IMAGES + 1, BATCH), buckets=np.zeros(batches),
                     costs=np.ones(batches), batch_size=BATCH)


def _items(indices) -> list[dict]:
    """The images of ``indices`` as a pipeline hands them over (each a function of its seed)."""
    return [{"index": int(i), "prompt": RECORDS[i]["prompt"], "seed": int(i), "params": {"num_inference_steps": 2},
             "image": np.random.default_rng(int(i)).random((16, 16, 3), dtype=np.float32)} for i in indices]


def _settings(kind: str) -> WriterSettings:
    fmt, layout = LAYOUTS[kind]
    return WriterSettings(format=fmt, layout=layout, files_per_folder=4, samples_per_shard=3, fsync="off",
                          write_workers=0)


class Worker:
    """One job of the pool with one replica: its registration (renewed when the test says), its
    claims, its writer, in a folder or a bucket."""

    def __init__(self, where: str, job: str, kind: str, clock: Clock, staging: Path) -> None:
        self.bucket = where.startswith("s3://")
        settings = _settings(kind)
        if self.bucket:
            self.store = ObjectStore.open(where, None, pool=job, lease_s=LEASE, staging_dir=str(staging))
            files = BucketPoolFiles(self.store, clock)
            publisher = self.store.publisher(0)
            local = self.store.local_dir
        else:
            self.store = FolderStore(Path(where), None, pool=job, lease_s=LEASE)
            files = FolderPoolFiles(Path(where), clock)
            publisher, local = None, Path(where)
        self.pool = Pool(files, job, 0, LEASE, clock=clock)
        self.pool.register(DIGEST, {"batches": IMAGES // BATCH, "images": IMAGES, "batch_size": BATCH}, renew=False)
        self.files = OutputFiles(local, settings, self.store.part(0), settings.layout, publisher,
                                 self.store.fence(publisher))

    def write(self, key: tuple) -> None:
        """Write one claimed batch (``ImageWriter.write_on_batch_end``'s path: the claim checked, then
        the files written under it)."""
        claim = claim_of(self.pool, [key])
        if claim is False:
            return
        images = [i for i in _plan().batch(key[0]).tolist() if i not in key[2]]
        self.files.write_batch([{**item, "claim": claim} for item in _items(images)])

    def run_pool(self) -> None:
        """Pull batches until the pool has none left (``PullSampler``), renewing between batches."""
        recorded = self.pool.files.recorded()
        pending = np.setdiff1d(np.arange(IMAGES), recorded)
        sampler = PullSampler(BatchDataset(PromptDataset(RECORDS, indices=pending), _plan()), self.pool, poll_s=0.02)
        for key in sampler:
            self.write(key)
            self.pool.beat()
        self.files.finish()
        self.pool.leave(ended=True)


def _prepare(where: str, staging: Path) -> None:
    """run.json, as the first job of the pool makes it (its registration given back at once)."""
    if where.startswith("s3://"):
        store = ObjectStore.open(where, None, pool="first", lease_s=LEASE, staging_dir=str(staging))
    else:
        store = FolderStore(Path(where), None, pool="first", lease_s=LEASE)
    assert store.prepare({"data.seed": 0}, IMAGES, IMAGES)[0] is None
    store.worker.leave(ended=True)


def _reference(tmp_path: Path, kind: str) -> dict[str, bytes]:
    """What one process writes: each output's bytes by name (a file, or a tar member)."""
    out = tmp_path / "reference"
    out.mkdir()
    settings = _settings(kind)
    files = OutputFiles(out, settings, out / "manifest.part-0.jsonl", settings.layout)
    for start in range(0, IMAGES, BATCH):
        files.write_batch(_items(range(start, start + BATCH)))
    files.finish()
    return _outputs(_named(out, (".", "manifest")))


def _named(out: Path, left_out: tuple[str, ...]) -> dict[str, bytes]:
    """The folder's files by name (none whose name starts with ``left_out``, none in a hidden folder
    or the pool's), a LitData shard's chunk as its samples' images (``shard-....litdata/MEMBER``)."""
    named: dict[str, bytes] = {}
    for p in out.rglob("*"):
        relative = p.relative_to(out)
        if (not p.is_file() or p.name.startswith(left_out) or "pool" in relative.parts
                or any(part.startswith(".") for part in relative.parts)):
            continue
        if p.parent.name.endswith(".litdata"):
            if p.suffix == ".bin":
                named.update({f"{relative.parent.as_posix()}/{member}": data
                              for member, data in litdata_members(p).items()})
            continue
        named[relative.as_posix()] = p.read_bytes()
    return named


def _outputs(named: dict[str, bytes]) -> dict[str, bytes]:
    """Loose files as they are; a tar shard's members, each once (a member twice fails here)."""
    found: dict[str, bytes] = {}
    for name, blob in named.items():
        if ".litdata/" in name:  # a LitData shard's sample (``_named``)
            member = name.rpartition("/")[2]
            assert member not in found, f"{member} is in two shards"
            found[member] = blob
            continue
        if name.endswith(".parquet"):
            import io

            import pyarrow.parquet as pq

            column = pq.read_table(io.BytesIO(blob), columns=["image"]).column("image").combine_chunks()
            for member, data in zip(column.field("path").to_pylist(), column.field("bytes").to_pylist()):
                assert member not in found, f"{member} is in two shards"
                found[member] = data
            continue
        if not name.endswith(".tar"):
            found[name] = blob
            continue
        import io

        with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
            for member in tar.getmembers():
                assert member.name not in found, f"{member.name} is in two tar shards"
                found[member.name] = tar.extractfile(member).read()
    return found


def _freeze_at(step: str, thread_name: str):
    """A ``fence.PAUSE`` that stops the thread ``thread_name`` at ``step`` until released."""
    reached, release = threading.Event(), threading.Event()

    def pause(name: str) -> None:
        if name == step and threading.current_thread().name == thread_name:
            reached.set()
            assert release.wait(60), "never released"

    return pause, reached, release


def _interleave(where: str, kind: str, step: str, tmp_path: Path, lapse: float = 2 * LEASE) -> tuple[Worker, Worker]:
    """Worker A claims batch 0 and stops at ``step``; its lease lapses (``lapse`` seconds of the
    pool's clock); worker B pulls every batch; A continues. Returns (A, B), both ended."""
    clock = Clock()
    _prepare(where, tmp_path)
    a = Worker(where, "aaaa0000", kind, clock, tmp_path)
    assert a.pool.claim(0)
    key = (0, 0, ())
    pause, reached, release = _freeze_at(step, "worker-a")
    fence.PAUSE = pause
    try:
        def finish_a() -> None:
            a.write(key)
            a.files.finish()

        a_thread = threading.Thread(target=finish_a, name="worker-a")
        if step == "recorded":  # A's lines are in its part before it stops
            finish_a()
        elif step not in ("claimed", "made"):  # stopped inside the publication
            a_thread.start()
            assert reached.wait(30), f"worker A never reached {step}"
        clock.now += lapse
        b = Worker(where, "bbbb1111", kind, clock, tmp_path)
        b_thread = threading.Thread(target=b.run_pool, name="worker-b")
        b_thread.start()
        # B waits for A where A holds the folder's lock (inside the fence), or a seal that has not lapsed
        b_waits = step in ("locked", "published") and lapse < SEAL_GRACE * LEASE
        b_thread.join(0.5 if b_waits else 60)
        assert b_thread.is_alive() == b_waits, f"B {'did not wait' if b_waits else 'did not end'} with A at {step}"
        release.set()
        if step in ("claimed", "made"):  # continued: it makes its batch now
            finish_a()
        elif a_thread.is_alive() or step != "recorded":
            a_thread.join(60)
        a.pool.leave(ended=True)  # its job ends once its writing has (a bucket's B waits for that on a seal)
        b_thread.join(60)
        assert not b_thread.is_alive() and not a_thread.is_alive()
    finally:
        fence.PAUSE = None
        release.set()
    for worker in (a, b):
        worker.store.merge(np.zeros(0, dtype=np.int64))
    return a, b


def _check_folder(out: Path, reference: dict[str, bytes]) -> None:
    lines = [json.loads(line) for line in (out / MANIFEST).read_text().splitlines()]
    assert sorted(line["index"] for line in lines) == list(range(IMAGES))  # every index once
    outputs = _outputs(_named(out, (".", "manifest", "run", "failed")))
    assert outputs == reference  # every file or member once, the bytes of one process
    status = FolderStore(out, None).status()
    assert status["complete"] and status["done"] == IMAGES and not status["not_counted"]


@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("step", STEPS)
def test_a_worker_frozen_at_any_step_of_a_folder_pool_adds_nothing_twice(tmp_path, kind, step):
    if kind == "litdata":
        pytest.importorskip("litdata")
    out = tmp_path / "out"
    _interleave(str(out), kind, step, tmp_path)
    _check_folder(out, _reference(tmp_path, kind))


def _check_bucket(fs, prefix: str, reference: dict[str, bytes]) -> None:
    fs.invalidate_cache()
    store = ObjectStore.open(f"s3://{prefix}", None)
    indices, _, _ = store.recorded()
    assert indices.tolist() == list(range(IMAGES))
    counted = [line["index"] for _, line in store._recorded_lines()]
    assert sorted(counted) == list(range(IMAGES))  # one line that counts an index
    tars = {Path(name).name: fs.cat_file(name) for name in fs.glob(f"{prefix}/shard-*")}
    ours = _outputs(tars)
    assert ours == reference  # every member once in the bucket's objects, the bytes of one process
    status = store.status()
    assert status["complete"] and status["done"] == IMAGES


@pytest.mark.parametrize("kind, step", [("webdataset", step) for step in STEPS]
                         + [("parquet", "written"), ("parquet", "published")])
def test_a_worker_frozen_at_any_step_of_a_bucket_pool_adds_nothing_twice(s3, tmp_path, kind, step):  # noqa: F811
    prefix = f"runs/fenced-{kind}-{step}"
    _interleave(f"s3://{prefix}", kind, step, tmp_path)
    _check_bucket(s3.fs(), prefix, _reference(tmp_path, kind))


def test_a_bucket_worker_silent_past_the_seal_grace_uploads_nothing_that_counts(s3, tmp_path):  # noqa: F811
    """Frozen after its seal for longer than ``SEAL_GRACE`` leases: its batch is taken over, and
    what it uploads when it comes back counts for nothing and is removed by the merge."""
    prefix = "runs/fenced-lapsed"
    a, b = _interleave(f"s3://{prefix}", "webdataset", "published", tmp_path, lapse=(SEAL_GRACE + 1) * LEASE)
    assert b.pool.took_over == 1
    _check_bucket(s3.fs(), prefix, _reference(tmp_path, "webdataset"))


def test_a_takeover_waits_for_a_publication_in_progress_and_then_finds_it_recorded(tmp_path):
    """The folder's argument, directly: a publication holds the merge lock through its look and its
    lines; a takeover of the same batch looks at the records under that lock, so it sees them."""
    out = tmp_path / "out"
    a, b = _interleave(str(out), "files", "published", tmp_path)
    assert b.pool.took_over == 0  # it found A's lines: nothing to take over
    lines = [json.loads(line) for line in (out / MANIFEST).read_text().splitlines()]
    assert {line["index"]: line["claim"] for line in lines if line["index"] < BATCH} == {0: f"{DIGEST}/0.0",
                                                                                       1: f"{DIGEST}/0.0"}


def test_a_takeover_made_before_the_publication_leaves_nothing_of_the_frozen_worker(tmp_path):
    out = tmp_path / "out"
    a, b = _interleave(str(out), "webdataset", "written", tmp_path)
    assert b.pool.took_over == 1
    lines = [json.loads(line) for line in (out / MANIFEST).read_text().splitlines()]
    assert {line["claim"] for line in lines if line["index"] < BATCH} == {f"{DIGEST}/0.1"}
    assert not list(out.glob(".*.tmp-*"))  # A's closed tar, never published, is gone


def test_time_is_the_pools_clock(tmp_path):
    """A registration's age is read against the injected clock: the lease lapses when it says."""
    clock = Clock()
    files = FolderPoolFiles(tmp_path, clock)
    pool = Pool(files, "job", 0, LEASE, clock=clock)
    pool.start(renew=False)
    other = Pool(files, "other", 0, LEASE, clock=clock)
    other.refresh()
    assert other.working("job-0")
    clock.now += LEASE + 1
    assert not other.working("job-0")
    pool.beat()
    assert other.working("job-0")
    time.sleep(0.01)  # the real time moves; the pool's does not
    assert other.working("job-0")


def test_a_publication_waits_for_a_takeover_in_progress_and_then_finds_its_batch_lost(tmp_path):
    """The other side of the folder's argument: a takeover holds the merge lock from its look at
    the records to its slot, so a publication of that batch cannot slip between them."""
    out = tmp_path / "out"
    clock = Clock()
    _prepare(str(out), tmp_path)
    a = Worker(str(out), "aaaa0000", "files", clock, tmp_path)
    assert a.pool.claim(0)
    pause, reached, release = _freeze_at("taking over", "worker-b")
    fence.PAUSE = pause
    try:
        clock.now += 2 * LEASE
        b = Worker(str(out), "bbbb1111", "files", clock, tmp_path)
        b_thread = threading.Thread(target=b.run_pool, name="worker-b")
        b_thread.start()
        assert reached.wait(30), "B never took batch 0 over"
        a_thread = threading.Thread(target=lambda: a.write((0, 0, ())), name="worker-a")
        a_thread.start()
        a_thread.join(0.5)
        assert a_thread.is_alive(), "A published while B was taking its batch over"
        release.set()
        a_thread.join(60)
        b_thread.join(60)
    finally:
        fence.PAUSE = None
        release.set()
    a.pool.leave(ended=True)
    for worker in (a, b):
        worker.store.merge(np.zeros(0, dtype=np.int64))
    assert b.pool.took_over == 1
    _check_folder(out, _reference(tmp_path, "files"))


# ----------------------------------------------------------------------------- a run that deals, and a resume


def _dealt(out: Path, settings: WriterSettings) -> tuple[FolderStore, OutputFiles, np.ndarray]:
    """A run that deals its work into ``out``: its lock taken (a resume's takeover of a stale one),
    its writer publishing through its fence."""
    store = FolderStore(out, None)
    refusal, done = store.prepare({"data.seed": 0}, IMAGES, IMAGES)
    assert refusal is None, refusal
    files = OutputFiles(out, settings, store.part(0), settings.layout, None, store.fence(None))
    return store, files, done


def _stale(out: Path) -> None:
    """The folder's lock as a run frozen past the lock's staleness leaves it (its heartbeat stopped)."""
    old = time.time() - 10 * 60
    os.utime(out / ".lock", (old, old))


@pytest.mark.parametrize("kind", ["files", "webdataset", "litdata"])
def test_a_run_frozen_past_its_lock_publishes_nothing_once_a_resume_took_the_lock_over(tmp_path, kind):
    if kind == "litdata":
        pytest.importorskip("litdata")
    out = tmp_path / "out"
    out.mkdir()
    zombie, zombie_files, _ = _dealt(out, _settings(kind))
    zombie_files.write_batch(_items(range(0, 2)))  # published (a tar shard closes at 3 samples)
    zombie_files.write_batch(_items(range(2, 4)))
    _stale(out)
    resume, files, done = _dealt(out, _settings(kind))
    made_before = set(done.tolist())
    with pytest.raises(fence.LockLost, match="took this run's lock over"):
        zombie_files.write_batch(_items(range(4, 6)))
        zombie_files.finish()
    zombie.release()  # as its run ends on the error: the lock it gives back is no longer its own
    assert resume._lock is not None and resume._lock.ours(), "the frozen run removed the resume's lock"
    for start in range(0, IMAGES, BATCH):
        files.write_batch(_items([i for i in range(start, start + BATCH) if i not in made_before]))
    files.finish()
    resume.merge(done)
    resume.release()
    _check_folder(out, _reference(tmp_path, kind))


def test_a_lock_takeover_waits_for_a_publication_in_progress_and_counts_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    zombie, zombie_files, _ = _dealt(out, _settings("files"))
    pause, reached, release = _freeze_at("published", "zombie")
    fence.PAUSE = pause
    resumed: dict = {}
    try:
        writing = threading.Thread(target=lambda: zombie_files.write_batch(_items(range(0, 2))), name="zombie")
        writing.start()
        assert reached.wait(30)
        _stale(out)
        taking = threading.Thread(target=lambda: resumed.update(zip(("store", "files", "done"),
                                                                     _dealt(out, _settings("files")))))
        taking.start()
        taking.join(0.5)
        assert taking.is_alive(), "the lock was taken over while a publication held the merge lock"
        release.set()
        writing.join(60)
        taking.join(60)
    finally:
        fence.PAUSE = None
        release.set()
    assert resumed["done"].tolist() == [0, 1]  # the publication it waited for is counted: not made again


@pytest.mark.parametrize("kind", ["webdataset", "parquet", "litdata"])
def test_a_pools_batch_is_never_split_over_two_shards(tmp_path, kind):
    """Shards of 3 samples, batches of 2: a pool's shard closes after a whole batch (4 samples), so a
    batch is sealed and published whole or not at all (a takeover of it then makes all of it)."""
    if kind == "litdata":
        pytest.importorskip("litdata")
    out = tmp_path / "out"
    clock = Clock()
    _prepare(str(out), tmp_path)
    worker = Worker(str(out), "aaaa0000", kind, clock, tmp_path)
    for batch in (0, 1):
        assert worker.pool.claim(batch)
        worker.write((batch, 0, ()))
    worker.files.finish()
    lines = [json.loads(line) for line in next(out.glob("manifest.pool-*.part-0.jsonl")).read_text().splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 2, 3] and len({line["file"] for line in lines}) == 1
