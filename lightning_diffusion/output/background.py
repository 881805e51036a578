"""Writing off the prediction thread: batches go to a bounded queue that writers drain.

Two kinds of writers take batches from the queue and call ``OutputFiles.write_batch`` (every file
written, synced and renamed, then its manifest line):

* ``WriterProcess`` (``writer.write_in: process``, the default): a child process of the rank with
  ``workers`` threads. The prediction thread shares nothing with it but a pipe, so the writer's
  Python (metadata, PNG chunks, file calls) never holds the rank's GIL; its batches are sent
  as pickles whose arrays go through the pipe without a copy (protocol 5, out of band). The child
  ignores SIGINT, SIGTERM and SIGUSR1 (the rank decides when writing stops and drains it first)
  and dies with the rank (Linux: ``PR_SET_PDEATHSIG``), so a killed rank leaves no writer behind
  that records images after a resume has begun.
* ``WriterThreads`` (``writer.write_in: thread``): ``workers`` threads in the rank itself (Pillow's
  encoders and zlib release the GIL; the rest competes with the prediction thread for it).

Both hold at most ``queue_size`` batches waiting plus one per worker being written; ``put`` blocks
when the queue is full. ``close(wait=True)`` writes everything queued, ``close(wait=False)`` (Ctrl-C)
drops what still waits (it has no manifest line, so a resume makes it) and finishes what is being
written. The first error of any batch is kept and handed out by ``take_error``. A ``put`` or a
``close`` that waits for the writers longer than ``STALL_WARNING`` seconds says so, again each
time as long (a stalled network file system hangs the writers' file calls, and with them the rank).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from typing import IO, Any, Optional, cast

from lightning_diffusion.core.console import log
from lightning_diffusion.core.records import ImageResult
from lightning_diffusion.output.files import OutputFiles

STALL_WARNING = 300.0  # seconds a put or a close waits for the writers before it says so


class WriteFailed(Exception):
    """A batch could not be written: ``kind`` and ``message`` of the error where it happened."""

    def __init__(self, kind: str, message: str, details: str = "") -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message, self.details = kind, message, details


def _failure(err: BaseException) -> WriteFailed:
    return err if isinstance(err, WriteFailed) else WriteFailed(type(err).__name__, str(err), traceback.format_exc())


class _Writers:
    def __init__(self, queue_size: int, name: str) -> None:
        self.jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self.name = name  # who waits, in the stall warnings ("rank 3's image writers")
        self._error: Optional[WriteFailed] = None
        self._error_lock = threading.Lock()
        self._ends_queued = 0  # ends put in the queue by close

    def fail(self, err: BaseException) -> None:
        with self._error_lock:
            self._error = self._error or _failure(err)

    def take_error(self) -> Optional[WriteFailed]:
        with self._error_lock:
            error, self._error = self._error, None
        return error

    def put(self, prediction: Optional[list[ImageResult]], waiting: str = "prediction waits") -> None:
        """Queue a batch (None: a writer's end); blocks while the queue is full: memory stays bounded."""
        waited = 0.0
        while True:
            try:
                return self.jobs.put(prediction, timeout=STALL_WARNING)
            except queue.Full:
                waited += STALL_WARNING
                self._stalled(f"have taken no batch for {waited:g} s (their queue of {self.jobs.maxsize} is full): "
                              f"{waiting} for them")

    def _join(self, thread: threading.Thread) -> None:
        waited = 0.0
        thread.join(STALL_WARNING)
        while thread.is_alive():
            waited += STALL_WARNING
            self._stalled(f"are still writing the batches they hold after {waited:g} s of waiting for them")
            thread.join(STALL_WARNING)

    def _stalled(self, what: str) -> None:
        log.warning(f"{self.name} {what}. A stalled file system (the output folder's network mount, say) "
                    "hangs their file calls.", extra={"all_ranks": True})

    def _drop_waiting(self) -> None:
        """Drop the batches that wait (an end already queued stays queued)."""
        ends = 0
        while True:
            try:
                item = self.jobs.get_nowait()
            except queue.Empty:
                break
            ends += item is None
            self.jobs.task_done()
        for _ in range(ends):
            self.jobs.put(None)

    def close(self, wait: bool = True) -> None:
        """Stop the writers: after everything queued (``wait``) or after the batches being written.
        Safe to call again after an interrupted close (a second Ctrl-C), with ``wait=False``."""
        if not wait:
            self._drop_waiting()
        self._stop()

    def _stop(self) -> None:
        raise NotImplementedError


class WriterThreads(_Writers):
    def __init__(self, files: OutputFiles, workers: int, queue_size: int, name: str = "the image writers") -> None:
        super().__init__(queue_size, name)
        self.files = files
        self.threads = [threading.Thread(target=self._work, name=f"image-writer-{n}", daemon=True)
                        for n in range(workers)]
        for thread in self.threads:
            thread.start()

    def _work(self) -> None:
        while True:
            prediction = self.jobs.get()
            try:
                if prediction is None:
                    return
                self.files.write_batch(prediction)
            except BaseException as err:
                self.fail(err)
            finally:
                self.jobs.task_done()

    def _stop(self) -> None:
        while self._ends_queued < len(self.threads):  # counted once queued: an interrupted close goes on
            self.put(None, "the run's end waits")  # after the batches queued (taken in order): a thread ends at one
            self._ends_queued += 1
        for thread in self.threads:
            self._join(thread)
        try:
            self.files.finish()  # the open tar shard, if any: its samples' lines follow
        except BaseException as err:
            self.fail(err)


# ----------------------------------------------------------------------------------- the pipe's frames
# A frame: <Q pickle length><I buffer count>, <Q length> per buffer, the pickle, the buffers.

def frame(value: object) -> tuple[bytes, list[memoryview]]:
    """``value`` as a frame's pickle and its out-of-band buffers (raises if it cannot be pickled)."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return data, [buffer.raw() for buffer in buffers]


def write_frame(stream: IO[bytes], data: bytes, views: list[memoryview]) -> None:
    stream.write(struct.pack(f"<QI{len(views)}Q", len(data), len(views), *(view.nbytes for view in views)))
    stream.write(data)
    for view in views:  # written straight from the arrays' memory, without the GIL
        stream.write(view)
    stream.flush()


def send(stream: IO[bytes], value: object) -> None:
    write_frame(stream, *frame(value))


def _read_exactly(stream: io.BufferedIOBase, size: int) -> Optional[bytearray]:
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        n = stream.readinto(view[got:])
        if not n:
            return None
        got += n
    return data


def receive(stream: io.BufferedIOBase) -> Any:
    """The next value, or ``EOFError`` when the other end closed (between frames or inside one)."""
    head = _read_exactly(stream, 12)
    if head is None:
        raise EOFError
    length, count = struct.unpack("<QI", head)
    table = _read_exactly(stream, 8 * count)
    if table is None:
        raise EOFError
    sizes = struct.unpack(f"<{count}Q", table)
    data = _read_exactly(stream, length)
    buffers = [_read_exactly(stream, size) for size in sizes]
    if data is None or any(buffer is None for buffer in buffers):
        raise EOFError
    return pickle.loads(data, buffers=buffers)


# ----------------------------------------------------------------------------------- the process

# The stop signals are ignored first of all (a SIGTERM to the job's processes while this imports).
_CHILD = ("import signal; [signal.signal(getattr(signal, name), signal.SIG_IGN) for name in "
          "('SIGINT', 'SIGTERM', 'SIGUSR1') if hasattr(signal, name)]; "
          "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
          "from lightning_diffusion.output.background import child_main; child_main(sys.argv[2:])")


# The writer in a session (so a process group) of its own: a terminal's Ctrl-C (SIGINT to the
# foreground group) does not reach it while its interpreter starts, before ``_CHILD`` ignores the
# signal (there it ended the child with "Fatal Python error: init_import_site"). It stops with its
# rank: the rank drains it, and it dies with its parent (``child_main``).


class WriterProcess(_Writers):
    def __init__(self, files: OutputFiles, workers: int, queue_size: int, name: str = "the image writers") -> None:
        super().__init__(queue_size, name)
        self.slots = threading.Semaphore(workers)  # batches the child holds at most
        self.workers = workers
        self._ended = threading.Event()  # the child is gone (or its pipe broke): nothing more is sent
        acks, child_end = os.pipe()
        path = [os.fspath(entry) for entry in sys.path if isinstance(entry, (str, os.PathLike))]
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, json.dumps(path), str(child_end), str(os.getpid()), str(workers)],
                stdin=subprocess.PIPE, pass_fds=(child_end,), start_new_session=True)
        except BaseException:
            os.close(acks)
            raise
        finally:
            os.close(child_end)
        self.acks = os.fdopen(acks, "rb")
        assert self.proc.stdin is not None
        self.stdin = self.proc.stdin
        self.feeder = threading.Thread(target=self._feed, args=(files,), name="image-writer-feed", daemon=True)
        self.reader = threading.Thread(target=self._read, name="image-writer-acks", daemon=True)
        self.feeder.start()
        self.reader.start()

    def _feed(self, files: OutputFiles) -> None:
        try:
            self._send(files, batch=False)
            while True:
                if not self._ended.is_set():  # a free worker in the child first, so that this thread
                    self.slots.acquire()  # holds no batch while it waits (_end releases it)
                prediction = self.jobs.get()
                try:
                    if prediction is None:
                        return
                    self._send(prediction)
                finally:
                    prediction = None
                    self.jobs.task_done()
        except BaseException as err:  # whatever broke here, the queue is still drained: put never hangs
            self.fail(err)
            self._end()
            while True:
                item = self.jobs.get()
                self.jobs.task_done()
                if item is None:
                    return
        finally:
            try:  # an end frame, not only EOF: forked DataLoader workers hold this pipe's write end too
                send(self.stdin, None)
                self.stdin.close()  # the child writes what it holds, then exits
            except OSError:
                pass

    def _send(self, value: object, batch: bool = True) -> None:
        if self._ended.is_set():
            return  # the child is gone: the reader says why; what waits is dropped
        try:
            data, views = frame(value)
        except Exception as err:  # this batch cannot be pickled: it fails, the others go on
            if not batch:
                raise
            self.fail(err)
            self.slots.release()
            return
        try:
            write_frame(self.stdin, data, views)
        except OSError:
            self._end()

    def _read(self) -> None:
        while True:
            try:
                message = receive(self.acks)
            except EOFError:
                break
            if message[0] == "error":
                self.fail(WriteFailed(*message[1:]))
            self.slots.release()
        code = self.proc.wait()
        if code != 0:
            self.fail(WriteFailed("WriterProcessDied", f"the writer process ended with exit code {code}"))
        self._end()

    def _end(self) -> None:
        if not self._ended.is_set():
            self._ended.set()
            for _ in range(self.workers + 1):  # a feeder waiting for a slot goes on (and drops)
                self.slots.release()

    def _stop(self) -> None:
        if not self._ends_queued:
            self.put(None, "the run's end waits")  # after everything queued (or alone, after a drop)
            self._ends_queued = 1
        self._join(self.feeder)
        self._join(self.reader)
        self.acks.close()


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)

    def watch() -> None:  # elsewhere (and as a second guard): noticed within a second
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def child_main(argv: list[str]) -> None:
    """The writer process: batches from stdin, one ``("done",)`` or ``("error", ...)`` per batch."""
    acks_fd, parent, workers = (int(value) for value in argv)
    _die_with_parent(parent)  # the stop signals were ignored by _CHILD: the rank stops the writing
    acks = os.fdopen(acks_fd, "wb")
    ack_lock = threading.Lock()
    stdin = cast(io.BufferedReader, sys.stdin.buffer)  # typed BinaryIO, which has no readinto
    try:
        files = receive(stdin)
    except BaseException as err:  # e.g. an OutputFiles subclass that cannot be imported here
        with ack_lock:
            send(acks, ("error", type(err).__name__, f"the writer process could not start: {err}",
                        traceback.format_exc()))
        os._exit(3)
    jobs: queue.Queue = queue.Queue()

    def work() -> None:
        while True:
            prediction = jobs.get()
            if prediction is None:
                return
            try:
                files.write_batch(prediction)
                reply: tuple = ("done",)
            except BaseException as err:
                reply = ("error", type(err).__name__, str(err), traceback.format_exc())
            del prediction
            with ack_lock:
                send(acks, reply)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for thread in threads:
        thread.start()
    while True:
        try:
            value = receive(stdin)
        except EOFError:
            break
        except Exception as err:  # a batch that cannot be unpickled here (its frame was read whole)
            with ack_lock:
                send(acks, ("error", type(err).__name__, f"the writer process could not read a batch: {err}",
                            traceback.format_exc()))
            continue
        if value is None:  # the rank's end frame
            break
        jobs.put(value)
    for _ in threads:
        jobs.put(None)
    for thread in threads:
        thread.join()
    try:
        files.finish()  # the open tar shard, if any: its samples' lines follow
    except BaseException as err:
        with ack_lock:
            send(acks, ("error", type(err).__name__, str(err), traceback.format_exc()))
    acks.close()
    os._exit(0)
