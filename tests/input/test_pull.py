"""``PullSampler``'s claims and leases, in one process: two workers' samplers stepped by hand over
one pool in a folder, time the pool's injected clock. No subprocess and no pipeline: the batches
are written by the writer's own files (``OutputFiles``), so what counts as recorded is what a run
records. The whole path (jobs, signals, kills) is tests/output/test_pool.py's."""

import json
import threading

import numpy as np
import pytest

from lightning_diffusion.input.data import BatchDataset, PromptDataset
from lightning_diffusion.input.pull import PullSampler, claim_of
from lightning_diffusion.output.manifest import MANIFEST
from tests.output.test_fencing import BATCH, IMAGES, LEASE, RECORDS, Clock, Worker, _plan, _prepare

BATCHES = IMAGES // BATCH


def _sampler(worker: Worker, **kwargs) -> PullSampler:
    pending = np.setdiff1d(np.arange(IMAGES), worker.pool.files.recorded())
    return PullSampler(BatchDataset(PromptDataset(RECORDS, indices=pending), _plan()), worker.pool, poll_s=0.01,
                       **kwargs)


def _pool(tmp_path, *jobs: str) -> tuple[Clock, list[Worker]]:
    clock = Clock()
    out = tmp_path / "out"
    _prepare(str(out), tmp_path)
    return clock, [Worker(str(out), job, "files", clock, tmp_path) for job in jobs]


def _recorded(tmp_path, workers: list[Worker]) -> list[int]:
    for worker in workers:
        worker.files.finish()
        worker.store.merge(np.zeros(0, dtype=np.int64))
    out = tmp_path / "out"
    return sorted(json.loads(line)["index"] for line in (out / MANIFEST).read_text().splitlines())


def _pull(worker: Worker, keys: list, **kwargs) -> threading.Thread:
    """The worker's loader in a thread of its own: each claimed batch written as it is yielded (a
    sampler that waits for other workers blocks its thread, as it blocks a job's loader)."""
    def run() -> None:
        for key in _sampler(worker, **kwargs):
            keys.append(key)
            worker.write(key)
            worker.pool.beat()

    thread = threading.Thread(target=run, name=f"worker-{worker.pool.worker}", daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("round_", range(10))
def test_two_workers_claim_each_batch_once_and_both_end_when_all_are_recorded(tmp_path, round_):
    """Rounds of two workers racing for the same batches: a claim is read only with its holder's
    name in it (``FolderPoolFiles.create``), so no batch is taken from a worker that works."""
    clock, (a, b) = _pool(tmp_path, "aaaa0000", "bbbb1111")
    keys: dict[str, list] = {"a": [], "b": []}
    threads = [_pull(a, keys["a"]), _pull(b, keys["b"])]
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a worker never ended"
    claimed = keys["a"] + keys["b"]
    assert sorted(key[0] for key in claimed) == list(range(BATCHES))  # each batch once, between them
    assert all(generation == 0 and recorded == () for _, generation, recorded in claimed)
    assert _recorded(tmp_path, [a, b]) == list(range(IMAGES))


def test_a_silent_workers_batch_is_taken_over_once_its_lease_lapses_and_its_late_result_adds_nothing(tmp_path):
    clock, (a, b) = _pool(tmp_path, "aaaa0000", "bbbb1111")
    a_pull = iter(_sampler(a))  # kept: a loader that ends says its worker waits (nothing to take over)
    first = next(a_pull)  # A claims the costliest batch, then goes silent
    assert first[1] == 0
    keys: list = []
    thread = _pull(b, keys)
    thread.join(1.0)  # B makes every other batch, then waits for A's while A's lease holds
    assert thread.is_alive() and sorted(k[0] for k in keys) == sorted(set(range(BATCHES)) - {first[0]})
    clock.now += LEASE + 1  # A renewed nothing for longer than its lease
    thread.join(60)
    assert not thread.is_alive(), "B never took the batch over"
    assert keys[-1] == (first[0], 1, ())  # the next generation; none of its images was recorded
    assert claim_of(a.pool, [first]) is False  # A, continued, finds its batch lost before writing
    a.write(first)  # and its late write publishes nothing
    assert _recorded(tmp_path, [a, b]) == list(range(IMAGES))


def test_a_worker_that_only_waits_ends_when_the_batches_left_are_held_by_workers_that_wait(tmp_path):
    """End of the pool: A holds a batch it has not made yet (the loader fetched it ahead) and waits
    for the others; B, with nothing left to claim, sees only waiting holders and ends instead of
    waiting for A forever."""
    clock, (a, b) = _pool(tmp_path, "aaaa0000", "bbbb1111")
    a_pull = iter(_sampler(a))
    held = [next(a_pull) for _ in range(BATCHES)]  # A claims every batch
    a.pool.wait(True)  # and says it waits (as its sampler does once every batch is claimed)
    b_keys = list(_sampler(b))
    assert b_keys == []  # every holder waits: B ends with nothing
    for key in held:
        a.write(key)
    assert next(a_pull, None) is None
    assert _recorded(tmp_path, [a, b]) == list(range(IMAGES))


def test_a_stop_ends_the_claims_and_the_worker_claims_nothing_more(tmp_path):
    clock, (a, b) = _pool(tmp_path, "aaaa0000", "bbbb1111")
    stopping = threading.Event()
    pull = iter(_sampler(a, stopping=stopping))
    key = next(pull)
    a.write(key)
    stopping.set()
    assert next(pull, None) is None  # the loader ends after the batch in flight
    rest = list(_sampler(b))  # everything else is B's, claimed at generation 0 (A never held it)
    assert sorted(k[0] for k in rest) == sorted(set(range(BATCHES)) - {key[0]})
    for other in rest:
        b.write(other)
    assert _recorded(tmp_path, [a, b]) == list(range(IMAGES))
