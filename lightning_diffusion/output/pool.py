"""The pool of workers that pull batches (``data.schedule: pull``): their registrations and their
claims, kept in the output location beside the manifest.

Every process that writes (one a data-parallel replica) of every job that joins is a *worker*. The
batch plan is the whole prompt set's (a pure function of the records, the pipeline's facts and
``data.batch_size``: every worker plans the same batches, named by their position), and its digest
names the claims' folder, so workers of one plan share claims and a plan of other batches cannot be
mixed in. Layout, under ``pool/`` of the output location::

    pool/workers/JOB-R.json     worker R of job JOB: host, pid, SLURM job, plan digest, state
                                (working, ended, failed); renewed every lease/4 while it works
    pool/plan-DIGEST.json       the plan: batches, images, batch size (for status)
    pool/claims-DIGEST/B        batch B claimed: made by an atomic create (``O_EXCL`` in a folder,
                                a conditional PUT in a bucket), holding the worker's name
    pool/claims-DIGEST/B.G      the G-th takeover of batch B, made the same way: exactly one
                                worker makes each, so exactly one holds the batch at a time

A claim is settled by the manifest, never by the claim: a worker takes over a batch whose holder is
not working any more (ended, failed, its lease lapsed, or its pid gone on this host) when some of
the batch's images are not recorded, and makes only those. A worker whose batch was taken over
while it still ran (its renewals stopped for longer than the lease: a frozen node) finds a newer
claim before it hands the batch to its writer, and drops it.

Kept free of torch and Lightning: ``status`` reads it from a login node.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, TypedDict, Union

import numpy as np

from lightning_diffusion.core.checks import LEASE_S
from lightning_diffusion.core.console import counted, log
from lightning_diffusion.core.system import pid_alive
from lightning_diffusion.output.fence import pause, slot_name

if TYPE_CHECKING:
    from lightning_diffusion.output.shard import Batches

POOL = "pool"
WORKERS = f"{POOL}/workers"
# A pool's records are JSON files that other jobs read (and ``status`` shows), hence TypedDicts.
class WorkerRecord(TypedDict, total=False):
    """A worker's registration (``pool/workers/JOB-R.json``): its name, ``job``, ``host``, ``pid``,
    SLURM job, the ``plan`` it pulls from, its ``state`` (``WorkerState``), ``lease_s``, when it
    started (``since``) and its last renewal (``beat``)."""

    worker: str
    job: str
    host: str
    pid: int
    slurm_job: Optional[str]
    plan: Optional[str]
    state: str
    lease_s: float
    since: float
    beat: float


class PlanRecord(TypedDict, total=False):
    """A batch plan of the pool (``pool/plan-DIGEST.json``): its ``batches``, the ``images`` they
    hold, ``batch_size`` and whether it ``bucket``s by shape."""

    batches: int
    images: int
    batch_size: int
    bucket: bool


class WorkerStatus(TypedDict):
    """A worker as ``status`` shows it: its registration's facts, whether it is ``live``, the
    batches it holds (``claims``) and those it holds by a takeover (``took_over``)."""

    worker: str
    state: Optional[str]
    live: bool
    host: Optional[str]
    pid: Optional[int]
    slurm_job: Optional[str]
    claims: int
    took_over: int
    since: Optional[float]


class PlanStatus(TypedDict):
    """A plan as ``status`` shows it: its ``batches``, those ``claimed`` and the takeovers made."""

    plan: str
    batches: Optional[int]
    claimed: int
    taken_over: int


class PoolSummary(TypedDict):
    """What ``status`` shows of a pool (``pool_summary``)."""

    workers: list[WorkerStatus]
    plans: list[PlanStatus]


class WorkerState(str, Enum):
    """A worker's state as its registration records it (the value is the JSON text)."""

    WORKING = "working"
    WAITING = "waiting"  # every batch is claimed; it holds at most the one its loader fetched ahead
    ENDED = "ended"  # its batches are recorded (or, after a stop, left for others)
    FAILED = "failed"  # taken over at once
    SILENT = "silent"  # shown by ``status``: recorded as working, its lease lapsed


ACTIVE = (WorkerState.WORKING.value, WorkerState.WAITING.value)  # the states of a worker that may hold batches
SEALED = "sealed "  # a bucket's seal of a batch (``fence.BucketFence``): ``sealed WORKER``
# Leases of silence after which a bucket's batch sealed by a worker is taken over (``Pool.seal_lapsed``).
SEAL_GRACE = 20



def plan_digest(order: np.ndarray, starts: np.ndarray, batch_size: int) -> str:
    """The digest of a batch plan (its images batch after batch, where each batch starts, the batch
    size): equal plans, and only they, share claims."""
    digest = hashlib.sha256(str(batch_size).encode())
    digest.update(np.ascontiguousarray(order, dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(starts, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def exclusive_create(path: Path, data: bytes) -> bool:
    """Make ``path`` holding ``data`` unless it exists (``O_EXCL``): whether this call made it. The
    file exists empty until the write ends; ``FolderPoolFiles.create`` links a written file instead."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return True


class PoolFiles(Protocol):
    """The few operations a pool needs of its storage (``FolderPoolFiles``, ``bucket_pool.BucketPoolFiles``)."""

    where: str

    def create(self, name: str, data: bytes) -> bool:
        """Make ``name`` holding ``data`` unless it exists (atomic): whether this call made it."""
        ...

    def read(self, name: str) -> Optional[bytes]:
        ...

    def put(self, name: str, data: bytes) -> None:
        """Write ``name`` whole (made or replaced)."""
        ...

    def exists(self, name: str) -> bool:
        ...

    def names(self, folder: str) -> list[str]:
        """The names of the files in ``folder`` (none where it does not exist)."""
        ...

    def renew(self, name: str, data: bytes) -> None:
        """Say that ``name``'s writer still lives (a folder: its time; a bucket: written again)."""
        ...

    def age(self, name: str, content: WorkerRecord) -> float:
        """Seconds since ``name`` (read as ``content``) was last renewed."""
        ...

    def recorded(self) -> np.ndarray:
        """Every image recorded in the location now (its manifest and the parts being appended)."""
        ...

    def take_over(self, name: str, data: bytes, images: np.ndarray) -> tuple[bool, np.ndarray]:
        """Make the claim ``name`` (a takeover) unless every one of ``images`` is recorded: (whether
        this call made it, the images of ``images`` whose records stay valid after it), at a moment
        no publication of the batch interleaves with (``fence``)."""
        ...


class FolderPoolFiles:
    """A pool in a folder every worker sees: creates by ``O_EXCL``, renewals by the file's time."""

    def __init__(self, folder: Path, clock: Callable[[], float] = time.time) -> None:
        self.folder = Path(folder)
        self.where = str(folder)
        self.clock = clock  # the time renewals are stamped with and ages are read against

    def create(self, name: str, data: bytes) -> bool:
        """The file appears with its content or not at all: written under a temporary name, then
        linked to ``name``, which fails where ``name`` exists (a hard link is atomic on local file
        systems and NFS alike). A file made empty and then written would let a reader between the
        two see a claim without a holder, which reads as a stopped worker's: a needless takeover."""
        from lightning_diffusion.output.manifest import temporary_name

        path = self.folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            return False
        temporary = temporary_name(path)  # pid and random bytes: unique across the nodes and threads
        try:
            temporary.write_bytes(data)
            try:
                os.link(temporary, path)
            except FileExistsError:  # held; or, over NFS, a retried link that had made it: two names then
                return os.stat(temporary).st_nlink == 2
            except OSError:  # a file system without hard links: made exclusively, then written
                return exclusive_create(path, data)
            return True
        finally:
            temporary.unlink(missing_ok=True)

    def read(self, name: str) -> Optional[bytes]:
        try:
            return (self.folder / name).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def put(self, name: str, data: bytes) -> None:
        from lightning_diffusion.output.manifest import atomic_write

        path = self.folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(data), fsync=False)

    def exists(self, name: str) -> bool:
        return (self.folder / name).exists()

    def names(self, folder: str) -> list[str]:
        try:
            return sorted(entry.name for entry in os.scandir(self.folder / folder) if not entry.name.startswith("."))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def renew(self, name: str, data: bytes) -> None:
        now = self.clock()
        try:
            os.utime(self.folder / name, (now, now))
        except FileNotFoundError:  # removed by hand: made again
            self.put(name, data)
            os.utime(self.folder / name, (now, now))

    def age(self, name: str, content: WorkerRecord) -> float:
        try:
            return max(0.0, self.clock() - (self.folder / name).stat().st_mtime)
        except OSError:
            return float("inf")

    def recorded(self) -> np.ndarray:
        from lightning_diffusion.output.manifest import merge_lock
        from lightning_diffusion.output.recorded import finished

        with merge_lock(self.folder):  # a merge moves lines from a part into the manifest: read neither half-way
            return finished(self.folder).indices

    def take_over(self, name: str, data: bytes, images: np.ndarray) -> tuple[bool, np.ndarray]:
        from lightning_diffusion.output.manifest import merge_lock
        from lightning_diffusion.output.recorded import finished

        with merge_lock(self.folder):  # what publishes a batch holds it too (``fence.FolderFence``)
            recorded = images[np.isin(images, finished(self.folder).indices)]
            if len(images) and len(recorded) == len(images):
                return False, recorded
            pause("taking over")
            return self.create(name, data), recorded


def worker_live(files: PoolFiles, name: str, worker: WorkerRecord, lease_s: float) -> bool:
    """Whether ``worker`` (its registration, read from ``name``) still works: its state says so, its
    lease has not lapsed, and, on this host, its process is there."""
    if worker.get("state") not in ACTIVE:
        return False
    if worker.get("host") == socket.gethostname() and not pid_alive(int(worker.get("pid") or 0)):
        return False
    return files.age(name, worker) <= float(worker.get("lease_s") or lease_s)


def read_workers(files: PoolFiles) -> dict[str, WorkerRecord]:
    """Every worker registered in the location, by name (``JOB-R``)."""
    found: dict[str, WorkerRecord] = {}
    for name in files.names(WORKERS):
        if not name.endswith(".json"):
            continue
        raw = files.read(f"{WORKERS}/{name}")
        try:
            found[name.removesuffix(".json")] = json.loads(raw) if raw else {}
        except ValueError:
            continue
    return found


def live_workers(files: PoolFiles, lease_s: float = LEASE_S) -> dict[str, WorkerRecord]:
    """The workers of the location that still work, by name."""
    return {name: worker for name, worker in read_workers(files).items()
            if worker_live(files, f"{WORKERS}/{name}.json", worker, lease_s)}


def proven_gone(files: PoolFiles, name: str, worker: Optional[WorkerRecord], lease_s: float) -> bool:
    """Whether worker ``name`` (its registration ``worker``) will write nothing more: it ended or
    failed, its process is gone from this host, or it has been silent for ``SEAL_GRACE`` leases
    (a worker that comes back after that finds its claims taken and what it uploads not counted)."""
    if worker is None or worker.get("state") not in ACTIVE:
        return True
    if worker.get("host") == socket.gethostname() and not pid_alive(int(worker.get("pid") or 0)):
        return True
    return files.age(f"{WORKERS}/{name}.json", worker) > SEAL_GRACE * float(worker.get("lease_s") or lease_s)


def gone_workers(files: PoolFiles, lease_s: float = LEASE_S) -> set[str]:
    """The registered workers proven gone (``proven_gone``): what they left half-written is nobody's."""
    return {name for name, worker in read_workers(files).items() if proven_gone(files, name, worker, lease_s)}


def live_jobs(files: PoolFiles) -> set[str]:
    """The jobs of the location's live workers (their manifest parts are still being appended to)."""
    return {str(worker.get("job")) for worker in live_workers(files).values()}


def pool_summary(files: PoolFiles) -> PoolSummary:
    """What ``status`` shows of a pool: each worker (state, live, host, pid, its claims, those it
    holds by a takeover) and each plan's claims and takeovers."""
    workers = read_workers(files)
    claims_by_worker: dict[str, int] = {}
    took_over: dict[str, int] = {}  # the batches each worker holds by a takeover
    plans: list[PlanStatus] = []
    for folder in files.names(POOL):
        if not folder.startswith("claims-"):
            continue
        digest = folder.removeprefix("claims-")
        names = files.names(f"{POOL}/{folder}")
        holders: dict[str, tuple[int, str]] = {}
        for name in names:  # the latest claim of each batch holds it
            batch, _, generation = name.partition(".")
            if batch not in holders or int(generation or 0) > holders[batch][0]:
                holders[batch] = (int(generation or 0), name)
        for taken, name in holders.values():
            holder = (files.read(f"{POOL}/{folder}/{name}") or b"").decode().removeprefix(SEALED)
            claims_by_worker[holder] = claims_by_worker.get(holder, 0) + 1
            if taken:  # the batch's holder took it over
                took_over[holder] = took_over.get(holder, 0) + 1
        plan = json.loads(files.read(f"{POOL}/plan-{digest}.json") or b"{}")
        # every takeover made (a batch taken over twice counts twice), named B.G with G from 1
        plans.append({"plan": digest, "batches": plan.get("batches"),
                      "claimed": len(holders), "taken_over": sum(1 for name in names if "." in name)})
    shown: list[WorkerStatus] = []
    for name, worker in sorted(workers.items()):
        live = worker_live(files, f"{WORKERS}/{name}.json", worker, LEASE_S)
        state = worker.get("state") if live or worker.get("state") not in ACTIVE else WorkerState.SILENT.value
        shown.append({"worker": name, "state": state, "live": live, "host": worker.get("host"),
                      "pid": worker.get("pid"), "slurm_job": worker.get("slurm_job"),
                      "claims": claims_by_worker.get(name, 0), "took_over": took_over.get(name, 0),
                      "since": worker.get("since")})
    return {"workers": shown, "plans": plans}


class Pool:
    """One worker's view of the pool: its registration and renewals, its claims, and what it reads
    of the others'. ``job``: this job's name (the same on its ranks), ``worker``: ``JOB-R``."""

    def __init__(self, files: PoolFiles, job: str, replica: int, lease_s: float, digest: str = "",
                 clock: Callable[[], float] = time.time) -> None:
        self.files = files
        self.clock = clock  # the time of renewals and of the judgements of others (tests drive it)
        self.since = round(clock(), 3)  # when this worker joined (``status``'s rate of a pool)
        self.job = job
        self.worker = f"{job}-{replica}"
        self.lease_s = float(lease_s)
        self.digest = digest
        self.claims = f"{POOL}/claims-{digest}"
        self._record = f"{WORKERS}/{self.worker}.json"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._workers: dict[str, WorkerRecord] = {}
        self._read_at = -float("inf")
        self.state = WorkerState.WORKING
        self.took_over = 0  # batches this worker took over from another
        self.slow_renewal = False  # warned once: a renewal took longer than half the lease
        self._left = True  # nothing to record at ``leave``: not started, or its end recorded

    # --- this worker -------------------------------------------------------------------------

    def _content(self, state: WorkerState) -> bytes:
        return json.dumps({"worker": self.worker, "job": self.job, "host": socket.gethostname(), "pid": os.getpid(),
                           "slurm_job": os.environ.get("SLURM_JOB_ID"), "plan": self.digest or None,
                           "state": WorkerState(state).value,
                           "lease_s": self.lease_s, "since": self.since, "beat": self.clock()}).encode()

    def start(self, renew: bool = True) -> None:
        """Say this worker works, renewed every lease/4 by a thread until ``leave`` (a job registers
        its first worker this way when it joins, before its weights load); ``renew=False``: by
        ``beat`` calls only (tests that drive the clock)."""
        self.files.put(self._record, self._content(self.state))
        self.files.renew(self._record, self._content(self.state))
        self._left = False
        if self._thread is None and renew:
            self._thread = threading.Thread(target=self._renew, name="pool-lease", daemon=True)
            self._thread.start()

    def register(self, digest: str, plan: PlanRecord, renew: bool = True) -> None:
        """Work on the batches of the plan ``digest`` (``plan``: its size, for ``status``), and say so."""
        self.digest = digest
        self.claims = f"{POOL}/claims-{digest}"
        self.files.create(f"{POOL}/plan-{digest}.json", json.dumps(plan).encode())
        self.start(renew)

    def beat(self) -> None:
        """Renew this worker's registration once (what the renewal thread does every lease/4)."""
        self.files.renew(self._record, self._content(self.state))

    def _renew(self) -> None:
        period = self.lease_s / 4
        while not self._stop.wait(period):
            started = time.monotonic()
            try:
                self.beat()
            except Exception as err:  # the next renewal tries again; the lease is four of them
                log.warning(f"{self.files.where}: renewing this worker's claims failed ({type(err).__name__}: {err})")
            took = time.monotonic() - started
            if took > self.lease_s / 2 and not self.slow_renewal:
                self.slow_renewal = True
                log.warning(f"{self.files.where}: renewing this worker's claims took {took:.1f} s, over half of "
                            f"data.lease_s ({self.lease_s:g} s): other workers may take its batches over; raise "
                            "data.lease_s.")

    def wait(self, waiting: bool) -> None:
        """Say whether this worker waits (has claimed every batch it could, and holds at most the one
        its loader fetched ahead), or works again (it took a batch over)."""
        state = WorkerState.WAITING if waiting else WorkerState.WORKING
        if state != self.state:
            self.state = state
            self.files.put(self._record, self._content(state))

    def leave(self, ended: bool) -> None:
        """Stop renewing, and say how this worker ended: ``ended`` (its batches are recorded; those it
        did not finish, after a stop, are for others to take) or failed (taken over at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if not self._left:
            self._left = True
            try:
                self.files.put(self._record, self._content(WorkerState.ENDED if ended else WorkerState.FAILED))
            except Exception as err:
                log.warning(f"{self.files.where}: this worker's end could not be recorded ({type(err).__name__}: "
                            f"{err}); its batches are taken over once its lease lapses.")

    # --- claims ------------------------------------------------------------------------------

    def claim(self, batch: int) -> bool:
        """Claim a batch nobody claimed yet."""
        return self.files.create(f"{self.claims}/{batch}", self.worker.encode())

    def holder(self, batch: int) -> tuple[int, str]:
        """(the generation of the batch's latest slot, the worker holding it): a claim's content is
        its worker's name; a bucket's seal (``fence.BucketFence``) reads ``sealed WORKER``."""
        generation = 0
        while self.files.exists(f"{self.claims}/{slot_name(batch, generation + 1)}"):
            generation += 1
        raw = self.files.read(f"{self.claims}/{slot_name(batch, generation)}")
        return generation, (raw or b"").decode()

    def take_over(self, batch: int, generation: int, images: Optional[np.ndarray] = None) -> tuple[bool, np.ndarray]:
        """Claim the batch after its slot of ``generation`` unless all of ``images`` (the batch's
        images left to make) are recorded (``PoolFiles.take_over``): one worker only succeeds.
        Returns (taken, the images whose records stay valid: left out of the batch)."""
        left = np.zeros(0, dtype=np.int64) if images is None else np.asarray(images, dtype=np.int64)
        taken, recorded = self.files.take_over(f"{self.claims}/{slot_name(batch, generation + 1)}",
                                               self.worker.encode(), left)
        self.took_over += taken
        return taken, recorded

    def lost(self, batch: int, generation: int) -> bool:
        """Whether the batch's slot after this worker's claim of ``generation`` is another worker's
        (a takeover; this worker's own seal is not)."""
        raw = self.files.read(f"{self.claims}/{slot_name(batch, generation + 1)}")
        return raw is not None and raw.decode() != f"{SEALED}{self.worker}"

    def seal_lapsed(self, worker: str) -> bool:
        """Whether a batch ``worker`` sealed (a bucket's: sealed, then uploaded) may be taken over:
        the worker is proven gone (``proven_gone``; a seal cannot be fenced again)."""
        return proven_gone(self.files, worker, self._workers.get(worker), self.lease_s)

    # --- the others ----------------------------------------------------------------------------

    def refresh(self, every: float = 0.0) -> None:
        """Read the workers' registrations again (at most once in ``every`` seconds)."""
        if self.clock() - self._read_at >= every:
            self._workers = read_workers(self.files)
            self._read_at = self.clock()

    def working(self, worker: str) -> bool:
        """Whether ``worker`` still works: as last read, and read again before it is judged stopped
        (a registration read a while ago holds an old renewal)."""
        found = self._workers.get(worker)
        name = f"{WORKERS}/{worker}.json"
        if found is None or not worker_live(self.files, name, found, self.lease_s):
            raw = self.files.read(name) if worker else None
            try:
                found = json.loads(raw) if raw else None
            except ValueError:
                found = None
            if found is not None:
                self._workers[worker] = found
        return found is not None and worker_live(self.files, name, found, self.lease_s)

    def stopped_before(self, worker: str, moment: float) -> bool:
        """Whether ``worker`` last renewed (or wrote) its registration before ``moment`` (a time):
        everything it recorded was recorded by then."""
        found = self._workers.get(worker)
        if found is None:
            return False
        return self.clock() - self.files.age(f"{WORKERS}/{worker}.json", found) < moment - 1.0

    def waiting(self, worker: str) -> bool:
        """Whether ``worker`` (as last read) waits too: the batch it holds is made as soon as its
        wait ends."""
        return (self._workers.get(worker) or {}).get("state") == WorkerState.WAITING.value

    def others_live(self) -> dict[str, WorkerRecord]:
        """The other workers that work now, read afresh."""
        self.refresh()
        return {name: worker for name, worker in self._workers.items()
                if name != self.worker and worker_live(self.files, f"{WORKERS}/{name}.json", worker, self.lease_s)}


def plan_conflict(files: PoolFiles, digest: str, plan: Batches) -> Optional[str]:
    """Why a job whose batch plan has ``digest`` cannot join the pool in ``files``: its live workers
    pull the batches of another plan (another batch size or bucketing, another pipeline's buckets)."""
    theirs = sorted({str(worker["plan"]) for worker in live_workers(files).values() if worker.get("plan")} - {digest})
    if not theirs:
        return None
    other = json.loads(files.read(f"{POOL}/plan-{theirs[0]}.json") or b"{}")
    return (f"{files.where}: the pool's workers pull the batches of another plan ({other.get('batches')} batches of "
            f"{other.get('batch_size')} images) than this job's ({len(plan)} batches of {plan.batch_size}): join with "
            "the same data.batch_size and data.bucket, or wait for the pool to end.")


def batching_conflict(files: PoolFiles, batch_size: int, bucket: bool) -> Optional[str]:
    """Why a job batching with ``batch_size`` and ``bucket`` cannot join the pool in ``files``: its
    live workers pull batches of another size or bucketing (judged when the job joins, before its
    weights load; ``plan_conflict`` judges the plans themselves once the batches are planned)."""
    for worker in live_workers(files).values():
        if not worker.get("plan"):
            continue
        theirs = json.loads(files.read(f"{POOL}/plan-{worker['plan']}.json") or b"{}")
        if theirs.get("batch_size", batch_size) != batch_size or theirs.get("bucket", bucket) != bucket:
            return (f"{files.where}: the pool's workers pull batches of {theirs.get('batch_size')} images"
                    f"{'' if theirs.get('bucket', True) else ' without buckets'}, this job plans batches of "
                    f"{batch_size}{'' if bucket else ' without buckets'}: join with the same data.batch_size and "
                    "data.bucket, or wait for the pool to end.")
    return None


def claim_order(costs: np.ndarray) -> np.ndarray:
    """The order workers claim batches in: the costliest first (ties: the earlier batch), so that the
    pool ends together."""
    return np.argsort(-np.asarray(costs), kind="stable")


def quit_join(store: Any, refusal: str) -> str:
    """A pool's job refused while joining (``FolderStore._join``, ``bucket_pool.join_pool``): its registration
    says it failed, and the store holds no worker; returns ``refusal``."""
    if store.worker is not None:
        store.worker.leave(ended=False)
        store.worker = None
    return refusal


def log_joined(where: Union[str, Path], others: list[str], total: Optional[int], made: int) -> None:
    """Say that a job joined a pool that other jobs work, and what is left to make."""
    if others:
        left = max(0, (total or 0) - made)
        log.info(f"joined the pool writing {where} ({counted(len(others), 'other job')} working): "
                 f"{left:,} of {total or 0:,} images left to make.")
