"""Asynchronous and pipelined saves that overlap training.

``save_async(obj, path, mode=...)`` returns a :class:`CheckpointFuture` at
once; the save runs on background threads (the Rust engine releases the GIL
for all I/O).

* ``mode="snapshot"`` (CheckFreq's two phases, DeepFreeze): every tensor is
  copied into host staging memory from a reusable :class:`SnapshotPool`,
  then persisted. ``wait_snapshot()`` returns once the copy is complete;
  after it the caller may change the tensors.
* ``mode="pipelined"`` (FastPersist): no full copy; the write streams the
  live tensors through the engine's bounded arena. ``wait_snapshot()``
  returns once every byte has left the tensors (the disk writes and the
  commit go on after it).

In both modes ``obj`` (its tensors and its containers) must not be changed
until ``wait_snapshot()`` returns: fence there before any in-place update,
forward included (BatchNorm statistics, ``optimizer.step()``). Each
tensor's version counter is taken at the call and checked once its bytes
are gathered: a tensor changed in between fails the save with
:class:`~fastpersist.TensorChangedError` (nothing committed, the previous
file kept), or with ``on_change="warn"`` commits with a warning. ``format="safetensors"`` (with optional
string ``metadata``) writes a flat ``{name: tensor}`` dict as a safetensors
file, as :func:`~fastpersist.write_state_dict` does. Saves run in call order. The next
``save_async`` waits for the previous save's snapshot phase, and at most
``max_pending`` saves (default 2) are between their call and their commit,
so staging memory is bounded by ``max_pending`` snapshots (snapshot mode) or
the engine's arena (pipelined mode). At interpreter exit, saves in flight are
waited for; a failure among them is logged as an error.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import operator
import os
import queue
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from . import _core
from .collectives import check_group, checkpoint_group
from .cuda_staging import ReadyEvents, active_devices, copy_stream, home_device, record_ready, side_streams, use_device
from .errors import InheritedSaveError, drop_frames
from .options import (
    EngineOptions,
    PathLike,
    WriteStats,
    env_int,
    forget_pending,
    gc_paused,
    note_pending,
    registering,
    registering_here,
    resolve_target,
    wait_for_earlier,
    with_file_mode,
)
from .pickling import ON_CHANGE, TensorVersions
from .plan import MemoryGuard, Plan, Region
from .safetensors_format import plan_safetensors
from .torch_zip import plan_torch_save
from .writer import FORMATS, write_distributed, write_plan, write_safetensors, write_state_dict, write_torch_zip

__all__ = ["save_async", "CheckpointFuture", "SnapshotPool", "AsyncSaver", "wait_all", "MODES"]

log = logging.getLogger("fastpersist")
MODES = ("pipelined", "snapshot")


#: Failed saves a saver keeps for :meth:`AsyncSaver.wait_all` at most.
MAX_UNSEEN = 64


class CheckpointFuture(concurrent.futures.Future[WriteStats]):
    """A ``concurrent.futures.Future`` whose result is the :class:`WriteStats`
    of a durable, committed checkpoint, plus the snapshot phase."""

    def __init__(self, path: str, mode: str) -> None:
        super().__init__()
        self.path = path
        self.mode = mode
        self.submitted_at = time.perf_counter()
        #: Seconds from the call until the snapshot phase ended.
        self.snapshot_seconds: Optional[float] = None
        #: Seconds from the call until the save finished (committed or failed).
        self.total_seconds: Optional[float] = None
        self._snapshot = threading.Event()
        self._snapshot_error: Optional[BaseException] = None
        #: The background workers that run this save (see _check_waiter).
        self._workers: Tuple[Any, ...] = ()
        #: When the save finished by its owner's clock (a Checkpointer's), once it has.
        self.done_at: Optional[float] = None
        # Whether its outcome was asked for (result(), exception(), a raising wait_snapshot()).
        self._seen_flag = False
        #: Callers' done-callbacks handed to the callback thread and not yet run.
        self._queued_callbacks = 0
        #: Its saver's reports of failures nobody read (see AsyncSaver._reports).
        self._reports: Optional[Dict[int, str]] = None

    def _check_waiter(self, what: str) -> None:
        """Refuse a wait that could never end: from one of the threads that
        run this save (code another save runs there, a tensor's
        ``__reduce__`` say, starting this one and waiting for it; callers'
        done-callbacks run on a thread of their own)."""
        me = threading.current_thread()
        if not self.done() and any(w._thread is me for w in self._workers):
            raise RuntimeError(
                f"{what} of the save of {self.path} on {me.name}, the thread that runs it, would never return "
                "(code a save runs, such as a tensor's __reduce__, runs on fastpersist's thread: "
                "hand the wait to a thread of your own)"
            )

    def result(self, timeout: Optional[float] = None) -> WriteStats:
        self._check_waiter("result()")
        try:
            return super().result(timeout)
        finally:
            self._seen = self._seen or self.done()

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        self._check_waiter("exception()")
        try:
            return super().exception(timeout)
        finally:
            self._seen = self._seen or self.done()

    def add_done_callback(self, fn: Callable[[concurrent.futures.Future[WriteStats]], object]) -> None:
        """``fn(future)`` once the save is done (committed, failed or
        cancelled), on fastpersist's thread for callbacks, in the order they
        were added: never on the threads that run saves, so a callback may
        save again, or wait for another save, without stalling them. On the
        calling thread, at once, when the save is done already. An error
        ``fn`` raises is logged."""
        with self._condition:
            queue_it = not self.done() or self._queued_callbacks > 0
            if queue_it:
                self._queued_callbacks += 1  # (one added later runs after it, not ahead)
        if not queue_it:
            _run_callback(fn, self)
            return

        def run(f: concurrent.futures.Future[WriteStats]) -> None:
            try:
                _run_callback(fn, f)
            finally:
                with self._condition:
                    self._queued_callbacks -= 1

        if self.done():
            _callback_worker().submit(run, self)
        else:
            super().add_done_callback(lambda f: _callback_worker().submit(run, f))

    def _on_done(self, fn: Callable[[concurrent.futures.Future[WriteStats]], object]) -> None:
        """``fn(future)`` on the thread that completes the save, before any
        caller's callback runs: fastpersist's own bookkeeping."""
        super().add_done_callback(fn)

    @property
    def _seen(self) -> bool:
        return self._seen_flag

    @_seen.setter
    def _seen(self, seen: bool) -> None:
        self._seen_flag = seen
        if seen and self._reports is not None:
            self._reports.pop(id(self), None)

    def _failed_unseen(self) -> bool:
        """Failed (not cancelled), and nobody has asked for its outcome."""
        if self._seen or not self.done() or self.cancelled():
            return False
        return concurrent.futures.Future.exception(self, 0) is not None

    def wait_snapshot(self, timeout: Optional[float] = None) -> None:
        """Block until the tensors may be changed again (snapshot copied, or
        every byte streamed out). Raises the save's error if it failed
        before that point; ``TimeoutError`` after ``timeout`` seconds."""
        if not self._snapshot.is_set():
            self._check_waiter("wait_snapshot()")
        if not self._snapshot.wait(timeout):
            raise TimeoutError(f"snapshot of {self.path} not finished after {timeout} s")
        if self._snapshot_error is not None:
            self._seen = True
            raise self._snapshot_error

    def snapshot_done(self) -> bool:
        return self._snapshot.is_set()

    def cancel(self) -> bool:
        """Cancel a save that has not started yet: nothing is written, and
        the tensors may change at once (:meth:`wait_snapshot` returns;
        :meth:`result` raises ``CancelledError``). False once it runs."""
        if not super().cancel():
            return False
        if not self._snapshot.is_set():
            self._snapshot.set()  # nothing will read the tensors
        self.total_seconds = time.perf_counter() - self.submitted_at
        return True

    def _mark_snapshot(self) -> None:
        if not self._snapshot.is_set():
            self.snapshot_seconds = time.perf_counter() - self.submitted_at
            self._snapshot.set()

    def _fail(self, e: BaseException) -> None:
        # The future may be kept (and its error) long after: the failed
        # call's buffers and tensors must not live as long as it.
        drop_frames(e)
        if not self._snapshot.is_set():
            self._snapshot_error = e
            self._snapshot.set()
        self.total_seconds = time.perf_counter() - self.submitted_at
        self.set_exception(e)

    def _succeed(self, stats: WriteStats) -> None:
        self._mark_snapshot()
        self.total_seconds = time.perf_counter() - self.submitted_at
        self.set_result(stats)

    def _inherited(self, parent: int) -> None:
        """In a child made by ``os.fork()`` while this save was in flight:
        the save is the parent's (which completes it). Here the future fails
        at once, so nothing in the child waits for it forever. Its locks
        (perhaps held by a thread of the parent at the fork), waiters and
        callbacks (of threads and bookkeeping that are the parent's) are
        dropped first."""
        self._condition = threading.Condition()
        self._waiters = []
        self._done_callbacks: List[Callable[[concurrent.futures.Future[WriteStats]], object]] = []
        snapshot = threading.Event()
        if self._snapshot.is_set():
            snapshot.set()
        self._snapshot = snapshot
        if not self.done():
            self._fail(
                InheritedSaveError(
                    f"the save of {self.path} was in flight when process {parent} forked this one "
                    f"({os.getpid()}); process {parent} completes it, this one does not"
                )
            )


def _run_callback(fn: Callable[[Any], object], fut: concurrent.futures.Future) -> None:
    try:
        fn(fut)
    except Exception:
        log.exception("fastpersist: exception calling a done-callback of the save of %s", getattr(fut, "path", fut))


_callbacks: Optional[_Worker] = None
_callbacks_lock = threading.RLock()


def _callback_worker() -> _Worker:
    """The thread that runs the callers' done-callbacks of saves."""
    global _callbacks
    with _callbacks_lock:
        if _callbacks is None:
            _callbacks = _Worker("fastpersist-callbacks", 0)
        return _callbacks


def _callback_jobs() -> List[concurrent.futures.Future]:
    """The done-callbacks queued or running (none on that thread itself,
    which cannot wait for them)."""
    w = _callbacks
    if w is None or threading.current_thread() is w._thread:
        return []
    return w.jobs()


def future_error(fut: concurrent.futures.Future, timeout: Optional[float] = None) -> Optional[BaseException]:
    """``fut.exception(timeout)``, with a cancelled future's
    ``CancelledError`` returned rather than raised."""
    try:
        return fut.exception(timeout)
    except concurrent.futures.CancelledError as e:
        return e


def _remove(bufs: List[torch.Tensor], buf: torch.Tensor) -> None:
    """Remove ``buf`` from ``bufs`` by identity (``list.remove`` compares
    tensors by value)."""
    for i, b in enumerate(bufs):
        if b is buf:
            del bufs[i]
            return
    raise ValueError("buffer not in the pool")


def _check_nbytes(nbytes: Any) -> int:
    """A buffer size: an int (numpy's too, not a bool or a float) >= 0."""
    if isinstance(nbytes, bool):
        raise TypeError("nbytes must be an int, not bool")
    try:
        n = operator.index(nbytes)
    except TypeError:
        raise TypeError(f"nbytes must be an int, not {type(nbytes).__name__}") from None
    if n < 0:
        raise ValueError(f"nbytes must be >= 0, not {n}")
    return n


class SnapshotPool:
    """Reusable host staging buffers for snapshot saves (pinned when CUDA
    tensors are saved and CUDA is available). Buffers are kept for reuse
    until :meth:`release` is called."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._free: List[torch.Tensor] = []
        self._used: List[torch.Tensor] = []
        # Buffers in use when release() was called: freed when put back.
        self._stale: List[torch.Tensor] = []

    def acquire(self, nbytes: int, pin: bool = False) -> torch.Tensor:
        nbytes = _check_nbytes(nbytes)
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes and (not pin or b.is_pinned())]
            if fits:
                buf = min(fits, key=lambda b: b.numel())
                _remove(self._free, buf)
            else:
                if self._free:  # too small: replace rather than grow the pool
                    _remove(self._free, max(self._free, key=lambda b: b.numel()))
                buf = _new_buffer(nbytes, pin)
            self._used.append(buf)
            return buf

    def reserve(self, nbytes: int, pin: bool = False) -> None:
        """Make sure an idle buffer of at least ``nbytes`` is ready (made
        now, on huge pages where the kernel gives them, and faulted in), so
        the next snapshot of that size does not allocate on its critical
        path. A smaller idle buffer is replaced."""
        nbytes = _check_nbytes(nbytes)
        with self._lock:
            if any(b.numel() >= nbytes and (not pin or b.is_pinned()) for b in self._free):
                return
        buf = _new_buffer(nbytes, pin)  # outside the lock: it can take a while
        with self._lock:
            small = [b for b in self._free if b.numel() < nbytes]
            if small:
                _remove(self._free, max(small, key=lambda b: b.numel()))
            self._free.append(buf)

    def reserve_many(self, requests: Sequence[Tuple[int, bool]]) -> None:
        """Make sure idle buffers are ready for snapshots in flight at once
        (the files of one checkpoint), one buffer each: ``requests`` are
        ``(nbytes, pin)`` pairs. Idle buffers that fit are counted (each
        once, largest request first, smallest buffer that fits), the
        missing ones are made now (faulted in), and for each one made a
        smaller idle buffer not counted is dropped. Snapshots taken in
        any order then all find a buffer: each takes the smallest that fits."""
        reqs = [(_check_nbytes(n), bool(pin)) for n, pin in requests]
        counted: List[torch.Tensor] = []
        missing: List[Tuple[int, bool]] = []
        with self._lock:
            idle = list(self._free)
            for n, pin in sorted(reqs, key=lambda r: -r[0]):
                fits = [b for b in idle if b.numel() >= n and (not pin or b.is_pinned())]
                if fits:
                    buf = min(fits, key=lambda b: b.numel())
                    _remove(idle, buf)
                    counted.append(buf)
                else:
                    missing.append((n, pin))
        for n, pin in missing:
            buf = _new_buffer(n, pin)  # outside the lock: it can take a while
            with self._lock:
                small = [b for b in self._free if b.numel() < buf.numel() and not any(b is c for c in counted)]
                if small:
                    _remove(self._free, max(small, key=lambda b: b.numel()))
                self._free.append(buf)
                counted.append(buf)

    def put_back(self, buf: torch.Tensor) -> None:
        """Return a buffer that nothing reads or writes any more (every copy
        into it has completed)."""
        with self._lock:
            if any(b is buf for b in self._stale):
                _remove(self._stale, buf)
                return
            _remove(self._used, buf)
            self._free.append(buf)

    def discard(self, buf: torch.Tensor) -> None:
        """Forget a buffer that may still be the target of copies (it is
        freed once the last reference to it goes, never reused)."""
        with self._lock:
            for bufs in (self._stale, self._used):
                if any(b is buf for b in bufs):
                    _remove(bufs, buf)
                    return

    def _after_fork(self) -> None:
        """In a fork child: buffers in use are the parent's saves'."""
        self._lock = threading.RLock()
        self._used = []
        self._stale = []

    def release(self) -> None:
        """Free every idle buffer now; those in use by saves in flight are
        freed when their save ends instead of being kept."""
        with self._lock:
            self._free.clear()
            self._stale += self._used
            self._used = []

    @property
    def nbytes(self) -> int:
        """Host memory the pool holds (in use and free)."""
        with self._lock:
            return sum(b.numel() for b in self._free + self._used + self._stale)


def _new_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A pool buffer of at least ``nbytes`` (whole MiB). A pageable one is
    advised for huge pages and faulted in at once: the first snapshot into
    it then copies at memory speed instead of faulting 4 KiB at a time."""
    size = max(1 << 20, -(-nbytes // (1 << 20)) * (1 << 20))
    buf = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
    if not pin:  # pinned memory is allocated resident
        _core.prepare_memory(buf.data_ptr(), size)
    return buf


#: Storages of at least one write block are placed in the snapshot pool at
#: their file offset's place within a page (see ``_snapshot_then_write``).
LEND_PAGE = 4096
LEND_MIN = 1 << 20


def _lendable_offsets(plan: Plan) -> Dict[int, int]:
    """Checksum id -> file offset of the storages placed at their file
    offset's place within a page in a snapshot of ``plan``."""
    found = {r.crc_id: r.offset for r in plan.regions if r.length >= LEND_MIN}
    found.update((r.crc_id, r.offset) for r in plan.device if r.length >= LEND_MIN)
    return found


def _snapshot_bytes(plan: Plan) -> int:
    """The pool bytes a snapshot of ``plan`` takes: its storages, and up to
    a page before each one placed by its file offset."""
    return plan.storage_bytes + LEND_PAGE * len(_lendable_offsets(plan))


def _as_bytes(storage: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _kept_bytes(kept: Any) -> Any:
    """What a plan keeps alive, as the storage its region starts at (torch
    zip plans keep storages), or a tensor's own bytes (safetensors plans
    keep contiguous tensors, which may start inside their storage)."""
    if not isinstance(kept, torch.Tensor):
        return kept
    n = kept.numel() * kept.element_size()
    off = kept.storage_offset() * kept.element_size()
    return _as_bytes(kept.untyped_storage())[off : off + n]


class _CopyStreams:
    """Snapshot copies: host storages with a plain copy; device storages
    with non-blocking copies on the process's copy stream of their device
    (:func:`~fastpersist.cuda_staging.copy_stream`), ordered
    after the caller's stream at the call (``ready``), never on the
    background thread's default stream (which would queue behind, and hold
    up, the caller's next kernels)."""

    def __init__(self, ready: ReadyEvents) -> None:
        self.ready = ready
        self.streams: dict = {}

    def copy(self, dst: torch.Tensor, storage: Any, guard: MemoryGuard, crc_id: int) -> None:
        src = storage if isinstance(storage, torch.Tensor) else _as_bytes(storage)
        if src.device.type == "cpu":
            # Checked and copied with the GIL held: no Python thread can
            # resize the storage in between (a storage changed before the
            # address was taken fails the check).
            _core.copy_memory(dst.data_ptr(), src.data_ptr(), min(src.numel(), dst.numel()), guard, crc_id)
            return
        if storage.device.type != "cuda":
            dst.copy_(src)
            return
        key = str(storage.device)
        with torch.cuda.device(storage.device):
            stream = self.streams.get(key)
            if stream is None:
                stream = self.streams[key] = copy_stream(storage.device)
                ev = self.ready.get(key)
                if ev is None:  # a storage found only by the pickler
                    ev = record_ready([storage.device])[key]
                stream.wait_event(ev)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=dst.is_pinned())

    def synchronize(self) -> None:
        for stream in self.streams.values():
            with torch.cuda.device(stream.device):
                ev = torch.cuda.Event(blocking=True)  # sleep, don't spin
                ev.record(stream)
            ev.synchronize()


#: What :meth:`AsyncSaver.save` takes besides ``mode`` and the engine
#: options (``options.ENGINE_OPTIONS``).
SAVE_OPTIONS = ("format", "metadata", "on_change", "group", "sharded")


def check_save_options(mode: str, options: Dict[str, Any], what: str = "save_async") -> EngineOptions:
    """The engine options of a background save with ``mode`` and
    ``options`` (as :func:`save_async` takes them); raises what the save
    would raise for them, naming the option: TypeError for a name no save
    takes, ValueError for a value it cannot. Nothing is saved, so a
    :class:`~fastpersist.Checkpointer` refuses a bad configuration when it
    is made, not at its first save, hours into a run."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    opts = EngineOptions.given(f"{what}()", options, background=True, also=SAVE_OPTIONS)
    fmt = options.get("format", "torch")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, not {fmt!r}")
    if fmt == "torch" and options.get("metadata") is not None:
        raise ValueError("metadata is only stored by format='safetensors'")
    if fmt != "torch" and (options.get("group") is not None or options.get("sharded")):
        raise ValueError("distributed saves write torch checkpoints (format='torch')")
    check_group(options.get("group"), f"{what}()")
    if options.get("sharded") and options.get("group") is None:
        # As write_state_dict says; it was a plain save of the whole object.
        raise ValueError("sharded=True needs group= (the ranks that each hold a shard)")
    on_change = options.get("on_change", "error")
    if on_change not in ON_CHANGE:
        raise ValueError(f"on_change must be one of {ON_CHANGE}, not {on_change!r}")
    return opts


class _Held:
    """A background save's object and its recorded version counters, handed
    to the background thread in a box that the save empties as it starts.
    The thread's call frames then hold only the box: they live on after the
    save (the thread keeps its last call until the next; a failed save's
    error keeps the frames it went through), while the save drops the
    object itself before it completes its future, so the caller's tensors
    are let go of while the caller still waits, not at some later point
    (when an exiting interpreter may be tearing down)."""

    __slots__ = ("obj", "registered", "versions")

    def __init__(self, obj: Any, versions: TensorVersions) -> None:
        self.obj: Any = obj
        self.versions: Any = versions
        #: Handed to its thread (which then owns the versions).
        self.registered = False

    def take(self) -> Tuple[Any, Any]:
        obj, versions = self.obj, self.versions
        self.obj = self.versions = None
        return obj, versions


def _write_held(
    held: _Held, path: str, fut: CheckpointFuture, write: Callable[[Any, TensorVersions], WriteStats]
) -> None:
    """Run a background save that writes straight from the caller's
    tensors: take the object out of its box, ``write(obj, versions)`` once
    earlier saves to ``path`` are done, and complete ``fut``, letting go of
    the tensors first (on failure too, where this frame stays in the
    traceback, and the versions release theirs)."""
    obj, versions = held.take()
    if not fut.set_running_or_notify_cancel():
        return
    try:
        wait_for_earlier(path, fut)
        stats = write(obj, versions)
    except BaseException as e:  # noqa: BLE001 - delivered through the future
        versions.release()
        obj = versions = None  # this frame stays in the traceback
        fut._fail(e)
        return
    obj = versions = None  # let go of the tensors before the caller is told
    fut._succeed(stats)


def _on(device: Any, fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` run on a background thread with ``device`` (the caller's, at
    the call) as that thread's current CUDA device."""

    def run(*args: Any) -> None:
        use_device(device)
        fn(*args)

    return run


class _Worker:
    """One background thread running submitted calls in order.

    Not a ``ThreadPoolExecutor``: those refuse new work once the
    interpreter starts shutting down, before ``atexit`` handlers run, so a
    snapshot handed to the write thread at exit would be lost. This thread
    is a daemon that takes work until the process ends; saves in flight at
    exit are waited for by an ``atexit`` handler."""

    def __init__(self, name: str, nice: int) -> None:
        self._queue: queue.SimpleQueue[Optional[Callable[[], None]]] = queue.SimpleQueue()
        self._name = name
        self._nice = nice
        self._start_lock = threading.RLock()
        self._thread: Optional[threading.Thread] = None
        # Every job queued and not finished (set.add/discard: atomic).
        self._jobs: Set[concurrent.futures.Future] = set()
        self._start()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def _after_fork(self) -> None:
        """In a fork child the thread is gone (it is the parent's) and the
        queue is the parent's work: a fresh queue, and a thread of this
        process started when work comes."""
        self._queue = queue.SimpleQueue()
        self._start_lock = threading.RLock()
        self._thread = None
        self._jobs = set()

    def _run(self) -> None:
        _lower_priority(self._nice)
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            try:
                fn()
            except BaseException:
                log.exception("fastpersist: uncaught error in a background save")
            # The job (its saver's bound methods, its arguments) is not kept
            # while the thread waits for the next: a saver dropped without
            # close() is collected, and its finalizer ends these threads.
            fn = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Queue ``fn(*args)``; the future gives its result."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        job: Optional[Tuple[Callable[..., Any], Tuple[Any, ...]]] = (fn, args)
        del fn, args

        def run() -> None:
            nonlocal job
            assert job is not None
            try:
                result = job[0](*job[1])
            except BaseException as e:
                job = None
                done.set_exception(e)
                raise
            # What the job holds (tensors, a saver) is let go here, before
            # whoever waits is released: never later on this thread, when
            # the interpreter may be finalizing (a daemon thread retaking
            # the GIL then is ended by an unwind that aborts the process).
            job = None
            done.set_result(result)

        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._start()
        self._jobs.add(done)
        done.add_done_callback(self._jobs.discard)
        self._queue.put(run)
        return done

    def jobs(self) -> List[concurrent.futures.Future]:
        """The jobs queued or running."""
        return list(self._jobs)

    def stop(self) -> None:
        """Finish the calls queued so far, then end the thread."""
        self._queue.put(None)
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join()


def _stop_workers(*workers: _Worker) -> None:
    for w in workers:
        w._queue.put(None)


def _saver_dropped(reports: Dict[int, str], *workers: _Worker) -> None:
    """A saver dropped without close(): the failures nobody read are
    logged (as close() and the exit log them), and its threads end."""
    for what in list(reports.values()):
        log.error("fastpersist: checkpoint %s", what)
    reports.clear()
    _stop_workers(*workers)


#: Default niceness of the background threads (``FASTPERSIST_BACKGROUND_NICE``).
DEFAULT_NICE = 10


def _lower_priority(nice: int) -> None:
    """Thread initializer: raise this thread's niceness to ``nice`` (Linux
    niceness is per thread, and threads it starts inherit it)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), min(nice, 19)))
    except OSError as e:  # e.g. a seccomp policy: run at normal priority
        log.debug("fastpersist: cannot lower the background threads' priority: %s", e)


def check_max_pending(max_pending: Any) -> None:
    """``max_pending``: an int, at least 1."""
    if isinstance(max_pending, bool) or not isinstance(max_pending, int):
        raise TypeError(f"max_pending must be an int, not {type(max_pending).__name__}")
    if max_pending < 1:
        raise ValueError(f"max_pending must be at least 1, not {max_pending}")


class AsyncSaver:
    """Runs asynchronous saves: a snapshot thread and a writer thread.

    ``nice`` is the niceness of those threads (and of the threads they
    start): where training keeps every core busy, a save's CPU work (the
    pickle, the copy into the arena, checksums) then fills the cores' idle
    moments instead of preempting a training thread, which in a parallel
    region stalls all of them. Default: ``FASTPERSIST_BACKGROUND_NICE`` or
    10; 0 runs them at the caller's priority. A save that is still copying
    when the caller fences on it finishes on the core the caller left."""

    def __init__(self, max_pending: int = 2, nice: Optional[int] = None) -> None:
        check_max_pending(max_pending)
        where = ""
        if nice is None:
            nice = env_int("FASTPERSIST_BACKGROUND_NICE", DEFAULT_NICE)
            if os.environ.get("FASTPERSIST_BACKGROUND_NICE"):
                where = " (from the environment variable FASTPERSIST_BACKGROUND_NICE)"
        if isinstance(nice, bool) or not isinstance(nice, int):
            # Else the threads die on os.setpriority and every save hangs.
            raise TypeError(f"nice must be an int from 0 to 19, not {type(nice).__name__}")
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be between 0 and 19, not {nice}{where}")
        self._closed = False
        self.nice = nice
        self._max_pending = max_pending
        self._pid = os.getpid()
        self.pool = SnapshotPool()
        self._snap = _Worker("fastpersist-snapshot", nice)
        self._write = _Worker("fastpersist-write", nice)
        #: Set when a save ends (a save waiting for room looks again). The
        #: saves in flight are ``_inflight``: no separate count to leak.
        self._slot_free = threading.Event()
        self._lock = threading.RLock()
        self._last: Optional[CheckpointFuture] = None
        self._inflight: List[CheckpointFuture] = []
        # Failed saves whose outcome nobody asked for (see wait_all).
        self._unseen: List[CheckpointFuture] = []
        _savers.add(self)
        #: What each failure nobody read is (the failed futures' ids):
        #: the reports of a saver dropped without close(), which its
        #: finalizer logs (the futures themselves would keep the saver
        #: alive: their callbacks, their errors' frames).
        self._reports: Dict[int, str] = {}
        # A saver dropped without close(): its threads end once idle, and
        # the failures nobody read are logged.
        fin = weakref.finalize(self, _saver_dropped, self._reports, self._snap, self._write)
        fin.atexit = False  # at exit the threads just stay idle (waking them during finalization is unsafe)

    def prepare(
        self, obj: Any, *, format: str = "torch", metadata: Optional[Any] = None, background: bool = False
    ) -> Optional[concurrent.futures.Future]:
        """Get ready for snapshot saves of ``obj`` (or of objects with the
        same tensors): the staging buffer its snapshot needs is made now,
        on huge pages where the kernel gives them, and faulted in, so the
        first ``save(..., mode="snapshot")`` blocks no longer than later
        ones. Call it once the state exists (after the model and optimizer
        are built, before the training loop). ``background=True`` does it
        on the snapshot thread (ahead of any later snapshot) and returns
        its future. Pipelined saves need no staging buffer."""
        self._check_open()
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, not {format!r}")
        planner = _planner(format, metadata)

        def run() -> None:
            plan = planner(obj, None)
            pin = bool(plan.device) and torch.cuda.is_available()
            self.pool.reserve(_snapshot_bytes(plan), pin=pin)

        if background:
            return self._queue(run)
        run()
        return None

    def prepare_many(
        self, objs: Sequence[Any], *, format: str = "torch", background: bool = False
    ) -> Optional[concurrent.futures.Future]:
        """:meth:`prepare` for several objects saved at once in snapshot
        mode (the files of one checkpoint, in flight together): each gets
        a staging buffer of its own (:meth:`SnapshotPool.reserve_many`).
        Only the sizes matter: a later state with other tensors is saved
        all the same (its snapshot then makes the buffer it needs)."""
        self._check_open()
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, not {format!r}")
        planner = _planner(format, None)
        items = list(objs)

        def run() -> None:
            requests = []
            for obj in items:
                plan = planner(obj, None)
                requests.append((_snapshot_bytes(plan), bool(plan.device) and torch.cuda.is_available()))
            self.pool.reserve_many(requests)

        if background:
            return self._queue(run)
        run()
        return None

    def save(self, obj: Any, path: PathLike, *, mode: str = "pipelined", **options: Any) -> CheckpointFuture:
        return self._save(obj, path, mode, options, "AsyncSaver.save")

    def _save(
        self, obj: Any, path: PathLike, mode: str, options: Dict[str, Any], what: str, follow_last: bool = True
    ) -> CheckpointFuture:
        """:meth:`save`, its errors naming ``what`` (the call the user made);
        ``follow_last`` False: a link at ``path`` is replaced, not followed
        (:func:`~fastpersist.options.resolve_target`)."""
        self._check_open()
        p = resolve_target(path, directory=bool(options.get("sharded")), follow_last=follow_last)
        # The files get the mode of the caller's file_mode() block, if any,
        # though the save runs on other threads.
        opts = with_file_mode(check_save_options(mode, options, what))
        if registering_here() or self._lock._is_owned():  # type: ignore[attr-defined]
            # (a signal handler's call on a thread inside this saver's
            # step: it cannot wait for what that step would let go)
            return _save_here(obj, p, mode, options)
        group = options.pop("group", None)
        on_change = options.pop("on_change", "error")
        sharded = options.pop("sharded", False)
        fmt = options.pop("format", "torch")
        metadata = options.pop("metadata", None)
        if type(metadata) is dict:
            metadata = dict(metadata)  # (its values at the call, as the tensors'; other types refused later)
        if group is not None:
            checkpoint_group(group)  # collective: made here, on every rank's calling thread
        # On the caller's thread, now: device copies made later in the
        # background are ordered after the work queued on its streams so
        # far, and the tensors' version counters are taken (an in-place
        # update issued before the save has gathered a tensor fails it).
        versions = TensorVersions(obj, on_change)
        held: Optional[_Held] = None
        try:
            devices = active_devices(obj)
            ready = record_ready(devices)
            # The background threads work under the caller's device (one
            # with a context), never device 0 by default.
            home = home_device(devices)
            held = _Held(obj, versions)
            del obj
            while True:
                # Registered only once the save before it (from any thread)
                # has left its snapshot phase, as one step with that check:
                # a snapshot save's write is queued on the write thread as
                # its snapshot ends, and a save registered after it but
                # queued there first would wait for it for ever (two
                # threads saving to one path, one of them pipelined).
                # Room is counted by the saves in flight themselves (an
                # interrupt leaves no slot taken); a save that cannot be
                # registered whole is taken back (see _register).
                with self._lock:
                    self._check_open()
                    last = self._last
                    if (last is None or last._snapshot.is_set()) and len(self._inflight) < self._max_pending:
                        return self._register(held, p, mode, opts, group, sharded, fmt, metadata, ready, home)
                # Outside the lock: wait for the save before to leave its
                # snapshot phase, or for a save in flight to end.
                if last is not None and not last._snapshot.is_set():
                    last._snapshot.wait()  # its errors surface from its own future
                else:
                    self._slot_free.wait(0.05)
                    self._slot_free.clear()
        except BaseException:
            if held is None or not held.registered:  # (a save registered runs, even if an interrupt follows)
                versions.release()
            raise

    def _register(
        self,
        held: _Held,
        p: str,
        mode: str,
        opts: EngineOptions,
        group: Any,
        sharded: bool,
        fmt: str,
        metadata: Any,
        ready: ReadyEvents,
        home: Any,
    ) -> CheckpointFuture:
        """One save registered and handed to its thread (the caller holds
        ``self._lock``); ``held.registered`` once it is."""
        fut: Optional[CheckpointFuture] = None
        try:
            fut = CheckpointFuture(p, mode)
            fut._workers = (self._snap, self._write)
            fut._reports = self._reports
            with registering(fut):  # (a signal handler's save meanwhile is made at once, see _save)
                self._inflight.append(fut)
                self._last = fut
                note_pending(p, fut)
                fut._on_done(self._finished)
                if group is not None:
                    self._write.submit(_on(home, self._distributed), held, p, opts, fut, group, sharded, ready)
                elif mode == "snapshot":
                    planner = _planner(fmt, metadata)
                    self._snap.submit(_on(home, self._snapshot_then_write), held, p, opts, fut, ready, planner)
                elif fmt == "safetensors":
                    self._write.submit(_on(home, self._pipelined_safetensors), held, p, opts, fut, metadata)
                else:
                    self._write.submit(_on(home, self._pipelined), held, p, opts, fut, ready)
                held.registered = True
        except BaseException:
            # Not handed to its thread (a thread that cannot start, an
            # interrupt): nothing is written, and nothing waits for it.
            # Unless the interrupt came once it was queued and its thread
            # has begun it: that save runs, and stays tracked.
            if fut is not None and not self._take_back(p, fut):
                held.registered = True
            raise
        return fut

    def _take_back(self, p: str, fut: CheckpointFuture) -> bool:
        """A save that was not handed to its thread, undone: off the path's
        pending list and the saver's, its snapshot phase ended (cancelled),
        each step idempotent and none left to a callback. False (nothing
        undone) when its thread has begun it already."""
        try:
            if not fut.cancel():
                return False  # (running, or done: as a save registered)
        except BaseException:
            self._untrack(p, fut)
            raise
        self._untrack(p, fut)
        return True

    def _untrack(self, p: str, fut: CheckpointFuture) -> None:
        forget_pending(p, fut)
        self._inflight = [f for f in self._inflight if f is not fut]
        if self._last is fut:
            self._last = None
        fut._snapshot.set()
        self._slot_free.set()

    def _after_fork_in_child(self) -> None:
        """In a child made by ``os.fork()``: the saves in flight are the
        parent's (it completes them; here their futures fail with
        :class:`InheritedSaveError`), the threads are gone, and the locks
        may have been held by them. The child's saver starts empty and
        starts threads of its own when it is used."""
        parent, self._pid = self._pid, os.getpid()
        inherited = self._inflight
        self._lock = threading.RLock()
        self._slot_free = threading.Event()
        self._last = None
        self._inflight = []
        self._unseen = []
        self._reports.clear()  # (the finalizer's own dict)
        self.pool._after_fork()
        self._snap._after_fork()
        self._write._after_fork()
        for f in inherited:
            f._inherited(parent)

    def _finished(self, fut: concurrent.futures.Future[WriteStats]) -> None:
        with self._lock:
            for i, f in enumerate(self._inflight):
                if f is fut:
                    del self._inflight[i]
                    break
            if self._last is fut:
                # Done: the next save has nothing to wait for, and a failed
                # one's error (with the frames of whoever raised it) is the
                # caller's to keep, not this saver's.
                self._last = None
            if isinstance(fut, CheckpointFuture) and fut._failed_unseen():
                # Kept (its error's frames dropped) until wait_all() reports it:
                # a failure nobody reads must not pass silently.
                self._unseen = [f for f in self._unseen[-(MAX_UNSEEN - 1) :] if f._failed_unseen()] + [fut]
                error = concurrent.futures.Future.exception(fut, 0)  # (not asked by a reader: not seen)
                self._reports[id(fut)] = f"{fut.path} was NOT saved: {error!r}"
                for gone in set(self._reports) - {id(f) for f in self._unseen}:
                    self._reports.pop(gone, None)
        self._slot_free.set()

    def _pipelined(
        self,
        held: _Held,
        path: str,
        opts: EngineOptions,
        fut: CheckpointFuture,
        ready: ReadyEvents,
    ) -> None:
        _write_held(
            held,
            path,
            fut,
            lambda obj, versions: write_torch_zip(
                obj, path, opts, on_gathered=fut._mark_snapshot, ready=ready, versions=versions
            ),
        )

    def _pipelined_safetensors(
        self,
        held: _Held,
        path: str,
        opts: EngineOptions,
        fut: CheckpointFuture,
        metadata: Any,
    ) -> None:
        # The tensors are written from where they are; the snapshot phase
        # ends once they are all gathered.
        _write_held(
            held,
            path,
            fut,
            lambda obj, versions: write_safetensors(obj, path, opts, metadata, versions, fut._mark_snapshot),
        )

    def _distributed(
        self,
        held: _Held,
        path: str,
        opts: EngineOptions,
        fut: CheckpointFuture,
        group: Any,
        sharded: bool,
        ready: ReadyEvents,
    ) -> None:
        # With a group the snapshot phase ends with the write (the ranks'
        # parts are written from the live tensors, then committed together).
        def write(obj: Any, versions: TensorVersions) -> WriteStats:
            with side_streams(ready):
                return write_distributed(obj, path, opts, group, sharded, "torch", versions)

        _write_held(held, path, fut, write)

    def _snapshot_then_write(
        self,
        held: _Held,
        path: str,
        opts: EngineOptions,
        fut: CheckpointFuture,
        ready: ReadyEvents,
        planner: Callable[[Any, TensorVersions], Plan],
    ) -> None:
        obj, versions = held.take()
        if not fut.set_running_or_notify_cancel():
            return
        buf = None
        plan: Optional[Plan] = None
        streams: Optional[_CopyStreams] = None
        try:
            t0 = time.perf_counter()
            # Device storages stay where they are in the plan (plan.device):
            # they are copied once, straight into the (pinned) pool.
            with gc_paused():
                plan = planner(obj, versions)
            pin = bool(plan.device) and torch.cuda.is_available()
            # A storage of a block or more is placed where its file offset
            # falls within a page, so that its whole blocks are as aligned
            # in the pool as in the file: the engine writes those straight
            # from the pool (no copy into its staging memory).
            file_offset = _lendable_offsets(plan)
            buf = self.pool.acquire(_snapshot_bytes(plan), pin=pin)
            # Copy every storage into the pool and point the plan there. A
            # region's checksum id is its storage's index in the plan's
            # storages: copies are found by storage, never by address (two
            # storages can start at the same address).
            base = buf.data_ptr()
            off = 0
            moved: List[int] = []
            streams = _CopyStreams(ready)
            for cid, kept in enumerate(plan.keepalive):
                plan.guard.check([cid])
                storage = _kept_bytes(kept)
                n = storage.numel() if isinstance(storage, torch.Tensor) else storage.nbytes()
                if cid in file_offset:
                    off += (file_offset[cid] - (base + off)) % LEND_PAGE
                if n:
                    streams.copy(buf[off : off + n], storage, plan.guard, cid)
                moved.append(base + off)
                off += n
            streams.synchronize()
            # Every copy is complete: a tensor changed in place since the
            # call may have been copied half old, half new.
            versions.check(obj)
            # The copies are ours from here on; the caller's storages may change.
            plan.guard.check()
            plan.guard = MemoryGuard()
            plan.regions = sorted(
                [Region(fo, moved[cid], ln, cid) for fo, _, ln, cid in plan.regions]
                + [Region(fo, moved[cid], ln, cid) for fo, _, ln, cid in plan.device]
            )
            plan.device = []
            plan.keepalive = [buf]
            plan_seconds = time.perf_counter() - t0
            del obj
        except BaseException as e:  # noqa: BLE001
            if buf is not None:
                self._recover(buf, streams)
            versions.release()
            obj = plan = buf = streams = versions = None  # noqa: F841 - this frame stays in the traceback
            fut._fail(e)
            return
        versions = None  # the copies are made: the tensors are the caller's again

        def write() -> None:
            # The buffer goes back to the pool before the future is done, so
            # a save made by a done-callback or right after result() reuses it.
            try:
                wait_for_earlier(path, fut)
                stats = write_plan(plan, path, opts, plan_seconds, t0)
            except BaseException as e:  # noqa: BLE001
                self.pool.put_back(buf)
                fut._fail(e)
            else:
                self.pool.put_back(buf)
                fut._succeed(stats)

        # Queued before the snapshot phase ends: a save called after it
        # (which may wait for this one to commit) queues behind it.
        self._write.submit(write)
        fut._mark_snapshot()

    def _recover(self, buf: torch.Tensor, streams: Optional[_CopyStreams]) -> None:
        """A failed snapshot's buffer goes back to the pool only once the
        copies started into it have completed; if that cannot be confirmed,
        it is never reused."""
        try:
            if streams is not None:
                streams.synchronize()
        except BaseException:  # noqa: BLE001 - the snapshot's own error is raised
            self.pool.discard(buf)
        else:
            self.pool.put_back(buf)

    def pending(self) -> List[CheckpointFuture]:
        with self._lock:
            return list(self._inflight)

    def wait_all(self, timeout: Optional[float] = None) -> List[CheckpointFuture]:
        """Wait for every save in flight; returns those that failed, and the
        earlier failures whose outcome nobody asked for yet (the last
        ``MAX_UNSEEN``), each reported once."""
        waited = self.pending()
        # (Not the done-callbacks: as concurrent.futures.wait, this does not
        # wait for them, which may need what its caller holds.)
        concurrent.futures.wait(waited, timeout=timeout)
        with self._lock:
            unseen, self._unseen = [f for f in self._unseen if f._failed_unseen()], []
            self._reports.clear()
        failed = [f for f in unseen if f not in waited]
        failed += [f for f in waited if f.done() and future_error(f) is not None]
        for f in failed:
            f._seen = True
        return failed

    def close(self) -> None:
        """Wait for every save in flight, then end the background threads and
        free the snapshot buffers. A closed saver refuses new saves (it has
        no threads left to run them); closing again does nothing."""
        with self._lock:
            self._closed = True
        for f in self.wait_all():  # (failures nobody read: not dropped with the saver)
            if not f.cancelled():
                log.error("fastpersist: checkpoint %s was NOT saved: %r", f.path, future_error(f))
        self._snap.stop()
        self._write.stop()
        self.pool.release()

    def _queue(self, fn: Callable[[], None]) -> concurrent.futures.Future:
        """``fn`` queued on the snapshot thread, unless the saver was closed
        meanwhile (by another thread): :meth:`close` ends the threads once
        the work queued before it is done, so work queued after would never
        run."""
        with self._lock:
            self._check_open()
            return self._snap.submit(fn)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this AsyncSaver is closed: its threads are gone (make a new one)")


def _save_here(obj: Any, p: str, mode: str, options: Dict[str, Any]) -> CheckpointFuture:
    """A background save asked for while this thread is registering
    another (a signal handler that interrupted ``save_async``): that one
    cannot be handed to its thread before the handler returns, and one
    registered behind it would wait for it for ever. This one is written
    here and now, synchronously (its future done on return)."""
    fut = CheckpointFuture(p, mode)
    try:
        stats = write_state_dict(obj, p, **options)
    except Exception as e:  # noqa: BLE001 - the save's error goes to its future, as a background save's
        fut._fail(e)
    else:
        fut._succeed(stats)
    return fut


def _planner(fmt: str, metadata: Any) -> Callable[[Any, Optional[TensorVersions]], Plan]:
    """The whole-file layout of a snapshot save. Torch: device storages stay
    where they are in the plan (``plan.device``), to be copied once; tensors
    the pickler finds are added to ``versions``."""
    if fmt == "safetensors":
        return lambda obj, versions: plan_safetensors(obj, metadata)
    return lambda obj, versions: plan_torch_save(obj, stage=lambda st: st.device.type == "cuda", versions=versions)


_default: Optional[AsyncSaver] = None
#: Every live saver, for the drain at exit.
_savers: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()
#: Reentrant: a signal handler that saves runs on the thread it interrupted,
#: perhaps inside this lock.
_default_lock = threading.RLock()


def default_saver() -> AsyncSaver:
    global _default
    with _default_lock:
        if _default is None:
            made = AsyncSaver()
            if _default is None:  # (a signal handler's call may have made one meanwhile)
                _default = made
        return _default


def save_async(obj: Any, path: PathLike, *, mode: str = "pipelined", **options: Any) -> CheckpointFuture:
    """Save ``obj`` to ``path`` in the background (see the module doc).
    ``options`` are those of :func:`~fastpersist.write_state_dict`; left
    unset, ``gather_threads`` is a quarter of the usable cores (at least 1:
    :func:`~fastpersist.options.default_background_gather_threads`), the
    rest left to the work the save overlaps."""
    return default_saver()._save(obj, path, mode, options, "save_async")


def wait_all(timeout: Optional[float] = None) -> List[CheckpointFuture]:
    """Wait for every asynchronous save in flight; returns the failed ones."""
    return default_saver().wait_all(timeout) if _default is not None else []


def _after_fork_in_child() -> None:
    """Every saver of a child made by ``os.fork()`` starts afresh (see
    :meth:`AsyncSaver._after_fork_in_child`)."""
    global _default_lock, _callbacks_lock
    _default_lock = threading.RLock()
    _callbacks_lock = threading.RLock()
    if _callbacks is not None:
        _callbacks._after_fork()
    for s in list(_savers):
        s._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _drain_at_exit() -> None:
    """Commit every save still in flight (of every saver) before the process
    exits; a failure among them is logged as an error."""
    savers: List[Any] = []
    try:
        # (All of it in the try: a Ctrl-C lands anywhere, in a log call too.)
        savers = list(_savers)
        pending = [f for s in savers for f in s.pending()]
        if pending:
            log.warning("fastpersist: waiting for %d checkpoint save(s) in flight before exit", len(pending))
        while True:
            for s in savers:
                for f in s.wait_all():
                    log.error("fastpersist: checkpoint %s was NOT saved: %r", f.path, future_error(f))
            # Then the rest of the background work (a snapshot buffer made
            # ahead by prepare(background=True), a save's last steps, the
            # done-callbacks): none may be inside the core when the
            # interpreter finalizes. A callback may have saved again (on
            # a saver made meanwhile too): round again until none has.
            concurrent.futures.wait([j for s in savers for j in s._snap.jobs() + s._write.jobs()] + _callback_jobs())
            savers = list(_savers)
            if not any(s.pending() for s in savers) and not _callback_jobs():
                break
    except KeyboardInterrupt:
        # Ctrl-C while waiting: the saves still in flight are given up (the
        # files at their paths stay as they were; their temporary files are
        # removed by a later save there). The process ends now: finalizing
        # with the engine's threads inside the core would end them by
        # unwinding through it, which aborts the process (SIGABRT) and, as
        # likely, ended it with status 0 and the saves silently dropped.
        try:
            left = [f.path for s in savers for f in s.pending()]
            log.error("fastpersist: interrupted at exit: checkpoint(s) NOT saved: %s", ", ".join(map(str, left)) or "-")
            for h in logging.getLogger().handlers + log.handlers:
                with contextlib.suppress(Exception):
                    h.flush()
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
        finally:
            os._exit(130)  # (also when a second Ctrl-C cuts the report short)


def register_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the process exits: at ``atexit`` (after the threads
    that are not daemons are joined), and in a process ``multiprocessing``
    started, with threading's own exit callbacks, the only ones it runs
    (it ends in ``os._exit`` without ``atexit``: a save in flight there was
    dropped without a word). Those run before the threads that are not
    daemons are joined, so elsewhere ``fn`` waits for ``atexit``."""
    atexit.register(fn)

    def in_a_worker() -> None:
        import multiprocessing

        if multiprocessing.parent_process() is not None:
            fn()

    hook = getattr(threading, "_register_atexit", None)  # (CPython 3.9+)
    if hook is not None:
        try:
            hook(in_a_worker)
        except RuntimeError:  # imported as the interpreter shuts down: atexit alone
            pass


register_exit(_drain_at_exit)
