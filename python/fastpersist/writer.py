"""``write_state_dict``: the torch.save replacement.

One save of one file: the object is laid out (:mod:`fastpersist.torch_zip`
or :mod:`fastpersist.safetensors_format`), its storages found up front are
streamed to the engine by a helper thread while this one pickles, device
storages go through :mod:`fastpersist.cuda_staging`, and the engine commits
the file (temporary file, fsync, rename, directory fsync). Saves across
ranks are handed to :mod:`fastpersist.distributed`. Options and their
environment defaults are described in :mod:`fastpersist.options`.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import queue
import struct
import threading
import time
import zlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from . import _core, distributed
from .collectives import check_group
from .cuda_staging import DeviceContext, ReadyEvents, send, stage_chunk, staging_setup, to_the_end
from .errors import WriteError
from .options import (
    EngineOptions,
    PathLike,
    WriteStats,
    counted_for_exit,
    is_special_file,
    resolve_target,
    sweep_leftovers,
    use_engine,
    wait_for_earlier,
    warn_fallback,
    without_gc,
    write_stats,
)
from .pickling import TensorVersions
from .plan import Batch, MemoryGuard, Plan, split_regions
from .safetensors_format import plan_safetensors
from .torch_zip import TorchZipLayout, plan_torch_save

#: A save of many storages finds, at the call, only the first ones (at
#: least this many bytes in at least this many storages); the layout finds
#: the rest while the first are written (10,000 storages: about 10 ms of
#: the call otherwise spent before the first write). Every tensor's version
#: is still recorded at the call.
SURVEY_FIRST: Optional[Tuple[int, int]] = (32 << 20, 1024)


__all__ = [
    "WriteStats",
    "write_state_dict",
    "write_torch_zip",
    "write_plan",
    "write_streamed",
    "PartWriter",
    "write_safetensors",
    "write_distributed",
    "FORMATS",
]

FORMATS = ("torch", "safetensors")

log = logging.getLogger("fastpersist")


class PartWriter:
    """Writes the parts of a file (consecutive :class:`Batch` es, in file
    order) to an engine session while the calling thread lays out the next
    part, or pickles; :meth:`join` waits for the last and raises the first
    failure. The session is the caller's again after the join (to finish
    it, or abort it).

    Parts in host memory go to the session's write-behind thread
    (``WriteSession.write_behind``), which runs no Python: it never waits
    for the GIL between parts, only to gather caller memory, and the
    layout's native loops hand the GIL to it. Parts with device storages to
    stage (``ctx``) go through a Python thread that streams them through the
    staging slots."""

    def __init__(self, session: Any, ctx: Optional[DeviceContext], guard: MemoryGuard) -> None:
        self._session = session
        self._guard = guard
        self._staged = ctx is not None
        self._parts: queue.SimpleQueue[Optional[Batch]] = queue.SimpleQueue()
        self._failure: List[BaseException] = []
        # The thread is handed what it uses, not this object: a bound method
        # as its target would make a cycle (writer -> thread -> writer) that
        # keeps the guard, and every storage it watches, alive after the save
        # until the cyclic collector runs.
        self._thread = threading.Thread(
            target=PartWriter._run,
            args=(self._parts, self._failure, session, ctx, guard),
            name="fastpersist-parts",
            daemon=True,
        )

    @staticmethod
    def _run(
        parts: queue.SimpleQueue[Optional[Batch]],
        failure: List[BaseException],
        session: Any,
        ctx: Optional[DeviceContext],
        guard: MemoryGuard,
    ) -> None:
        try:
            if ctx is not None:
                ctx.use()  # a fresh thread: on the call's device, never device 0 by default
            while (part := parts.get()) is not None:
                if part.reserve:
                    session.reserve(part.reserve)
                send(session, part, ctx, guard=guard)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            failure.append(e)

    def put(self, part: Batch) -> None:
        if not self._staged:
            if self._session.behind_failed:  # no use laying out more: raise it now
                self._session.join_behind()
            if part.device:  # its device storages would go unwritten
                raise ValueError("a part with device storages needs a DeviceContext to stage them")
            # The guard as of this part (an empty one watches nothing yet).
            guard = self._guard if self._guard else None
            self._session.write_behind(part.blobs, part.regions, part.slots, guard, part.reserve)
            return
        if self._failure:  # no use laying out more: the join raises it
            raise self._failure[0]
        self._parts.put(part)
        if self._thread.ident is None:
            self._thread.start()  # on the first part: no thread for a file without a head

    def join(self, cancel: bool = False) -> None:
        """Wait for the parts put so far and raise the first failure. With
        ``cancel`` (the caller is giving the file up on an exception of its
        own): drop the parts not begun, abort the session and raise nothing,
        so the caller's exception is the one that propagates."""
        if not self._staged:
            if cancel:
                self._session.abort()  # drops the parts not begun, removes the file
            else:
                self._session.join_behind()
            return
        if self._thread.ident is None:
            return
        while cancel:  # drop the parts not begun
            try:
                self._parts.get_nowait()
            except queue.Empty:
                break
        self._parts.put(None)
        self._thread.join()
        if self._failure and not cancel:
            raise self._failure[0]


def abandon(session: Any, parts: Optional[PartWriter], ctx: Optional[DeviceContext]) -> None:
    """Give a file up on an exception: the parts not begun are dropped,
    the parts thread is joined and no device copy is left in flight before
    the session is aborted. Aborting gives the arena buffers it lent back
    to the engine, which the next save takes once this one lets the engine
    go: a copy landing in one late would overwrite that save's bytes after
    their checksum was taken. Each step runs to its end whatever Ctrl-C
    does meanwhile (the interrupt is raised after them); any other failure
    of a step is logged, and the session is aborted all the same."""
    if ctx is not None:
        ctx.stop.set()  # no further copy is begun
    steps: List[Callable[[], None]] = []
    if parts is not None:
        steps.append(lambda: parts.join(cancel=True))
    if ctx is not None:
        steps.append(ctx.quiesce)
    steps.append(session.abort)
    # Giving up already: the caller's error propagates, the steps' are logged.
    to_the_end(steps, lambda e: log.warning("fastpersist: while giving up a save: %s", e))


@without_gc
def write_torch_zip(
    obj: Any,
    path: str,
    opts: EngineOptions,
    on_gathered: Optional[Callable[[], None]] = None,
    ready: Optional[ReadyEvents] = None,
    versions: Optional[TensorVersions] = None,
) -> WriteStats:
    """Write ``obj`` as a torch zip checkpoint at ``path`` and commit it.

    The storages found up front are written by a second thread while this
    one pickles; the rest follows. Storages on a CUDA device are staged
    chunk by chunk (cuda_staging); the copies wait on ``ready`` (events
    recorded on the caller's streams at the call, by device) or, without
    it, on the current streams now. ``versions``: the tensors' version
    counters as of the call (taken now when not given); once no tensor
    memory will be read again they are checked (a tensor changed in place
    meanwhile: :class:`~fastpersist.TensorChangedError`, nothing is
    committed), then ``on_gathered()`` is called."""
    t0 = time.perf_counter()
    if is_special_file(path):
        plan = plan_torch_save(obj)
        return stream_plan(plan, path, time.perf_counter() - t0, t0)
    sweep_leftovers(path)
    if versions is None:
        versions = TensorVersions(obj, storages=True)
    stage, kind = staging_setup()
    layout = TorchZipLayout(obj, stage=stage, versions=versions)
    gathered = _checked(versions, obj, on_gathered, layout.laid_out)
    head_end, head_devices = layout.head_hints()
    ctx: Optional[DeviceContext] = None
    if head_devices:
        # Made here, at the call: the copy streams wait on the caller's streams now.
        ctx = DeviceContext(sorted(head_devices, key=str), test_on_cpu=kind == "cpu", chunk=stage_chunk(), ready=ready)
    try:
        with use_engine(opts) as eng:
            if ctx is not None:
                ctx.bind(eng)
            session: Any = None
            head: Optional[PartWriter] = None
            try:
                session = eng.begin(path, head_end)
                head = PartWriter(session, ctx, layout.guard)
                tp = time.perf_counter()
                for part in layout.head_parts():
                    head.put(part)
                tail = layout.tail()
                plan_seconds = time.perf_counter() - tp
                if not tail.device:
                    # Gathered behind the head's last writes: the device
                    # has them in flight while this thread joins.
                    head.put(tail)
                    tail = Batch()
                head.join()
                if tail.device and ctx is None:
                    devices = sorted({r.storage.device for r in tail.device}, key=str)
                    ctx = DeviceContext(devices, test_on_cpu=kind == "cpu", chunk=stage_chunk(), ready=ready)
                    ctx.bind(eng)
                raw = send(session, tail, ctx, layout.file_len, gathered, layout.guard)
            except BaseException:
                if session is not None:
                    abandon(session, head, ctx)  # the parts not begun are not written
                raise
            finally:
                del layout.keepalive[:]
    finally:
        # Also when the engine or the file could not be made.
        if ctx is not None:
            ctx.close()
    warn_fallback(raw["direct_note"], opts.direct)
    warn_fallback(raw["uring_note"], opts.io_uring)
    stats = write_stats(raw, path, layout.storage_bytes, layout.storage_keys, plan_seconds, time.perf_counter() - t0)
    return stats


def _checked(
    versions: TensorVersions,
    obj: Any,
    on_gathered: Optional[Callable[[], None]],
    laid_out: Optional[Callable[[], None]] = None,
) -> Callable[[], None]:
    """The engine's ``on_gathered`` hook: every byte of caller memory is in
    the arena and nothing is committed yet. A tensor changed in place since
    the call raises (the engine then commits nothing) or warns; then
    ``on_gathered()`` (the end of an async save's snapshot phase). Then the
    versions, and with ``laid_out()`` the layout's bookkeeping, are let go:
    freed here, while the file's last writes are still in flight, rather
    than after the commit (10,000 tensors: 3-5 ms of deallocation)."""

    def gathered() -> None:
        versions.check(obj)
        if on_gathered is not None:
            on_gathered()
        versions.release()
        if laid_out is not None:
            laid_out()

    return gathered


def write_plan(
    plan: Plan,
    path: str,
    opts: EngineOptions,
    plan_seconds: float = 0.0,
    t0: Optional[float] = None,
    index: int = 0,
    on_gathered: Optional[Callable[[], None]] = None,
) -> WriteStats:
    """Write a whole :class:`~fastpersist.plan.Plan` and commit it. Its
    device storages (``plan.device``) are streamed through the staging slots
    (:mod:`fastpersist.cuda_staging`); ``index`` picks one of several engines
    for the same options (files written at once from several threads).
    ``on_gathered()`` is called once no caller memory will be read again,
    before the commit; when it raises, nothing is committed."""
    t0 = time.perf_counter() if t0 is None else t0
    if is_special_file(path) and not plan.device:
        return stream_plan(plan, path, plan_seconds, t0)
    sweep_leftovers(path)
    if plan.device or on_gathered is not None:
        return write_streamed(plan, iter(()), path, opts, plan.file_len, index, on_gathered, plan_seconds, t0)
    with use_engine(opts, index) as eng:
        raw = eng.write_file(
            path, plan.blobs, plan.regions, plan.slots, plan.file_len, plan.guard if plan.guard else None
        )
    return _committed(raw, plan, path, opts, plan_seconds, t0)


def _committed(raw: Any, plan: Plan, path: str, opts: EngineOptions, plan_seconds: float, t0: float) -> WriteStats:
    """The stats of a committed plan (fallback notes warned about)."""
    warn_fallback(raw["direct_note"], opts.direct)
    warn_fallback(raw["uring_note"], opts.io_uring)
    stats = write_stats(raw, path, plan.storage_bytes, plan.storage_keys, plan_seconds, time.perf_counter() - t0)
    return stats


def write_streamed(
    plan: Plan,
    parts: Iterator[Batch],
    path: str,
    opts: EngineOptions,
    size_hint: int,
    index: int = 0,
    on_gathered: Optional[Callable[[], None]] = None,
    plan_seconds: float = 0.0,
    t0: Optional[float] = None,
) -> WriteStats:
    """Write and commit a file that is laid out while it is written:
    ``parts`` yields its pieces in file order (each written by a helper
    thread while the next is laid out on this one); once it is exhausted,
    ``plan`` holds the rest (pieces not yielded, device storages, which are
    staged, ``file_len``), written last. ``plan.guard`` watches the memory
    of every region, also of those yielded (it is consulted as they are
    written); ``size_hint``: about the file's length, reserved up front;
    ``index`` and ``on_gathered``: as for :func:`write_plan`."""
    t0 = time.perf_counter() if t0 is None else t0
    sweep_leftovers(path)
    ctx: Optional[DeviceContext] = None
    try:
        with use_engine(opts, index) as eng:
            session: Any = None
            writer: Optional[PartWriter] = None
            try:
                session = eng.begin(path, size_hint)
                writer = PartWriter(session, None, plan.guard)
                for part in parts:
                    writer.put(part)
                writer.join()
                if plan.device:
                    _, kind = staging_setup()
                    devices = sorted({r.storage.device for r in plan.device}, key=str)
                    ctx = DeviceContext(devices, test_on_cpu=kind == "cpu", chunk=stage_chunk())
                    ctx.bind(eng)
                raw = send(session, plan, ctx, plan.file_len, on_gathered, plan.guard if plan.guard else None)
            except BaseException:
                if session is not None:
                    abandon(session, writer, ctx)  # the parts not begun are not written
                raise
    finally:
        if ctx is not None:
            ctx.close()
    return _committed(raw, plan, path, opts, plan_seconds, t0)


def stream_plan(plan: Plan, path: str, plan_seconds: float = 0.0, t0: Optional[float] = None) -> WriteStats:
    """Write a plan into a file that is not a regular one (a device, a
    FIFO) in file order with buffered writes, as ``torch.save`` does: no
    temporary file, no rename, no fsync. Checksum slots are filled from the
    bytes as they are written (a record's data comes before its slots)."""
    t0 = time.perf_counter() if t0 is None else t0
    pieces: List[Tuple[int, int, Any]] = [(b[0], 0, b[1]) for b in plan.blobs]
    pieces += [(r.offset, 1, r) for run in split_regions(sorted(plan.regions)) for r in run]
    pieces += [(sl.offset, 2, sl.crc_id) for sl in plan.slots]
    pieces.sort(key=lambda x: (x[0], x[1]))
    crcs: Dict[int, int] = {}
    tio = time.perf_counter()
    try:
        with open(path, "wb", buffering=1 << 20) as f:
            pos = 0
            for off, kind, what in pieces:
                if off > pos:
                    f.write(bytes(off - pos))
                if kind == 0:
                    data = what
                elif kind == 1:
                    # Checked and copied with the GIL held: the storage cannot
                    # be resized in between.
                    data = bytearray(what.length)
                    dst = ctypes.addressof(ctypes.c_char.from_buffer(data))
                    _core.copy_memory(dst, what.address, what.length, plan.guard, what.crc_id)
                    crcs[what.crc_id] = zlib.crc32(data, crcs.get(what.crc_id, 0))
                else:
                    data = struct.pack("<I", crcs.get(what, 0))
                f.write(data)
                pos = off + len(data)
            if plan.file_len > pos:
                f.write(bytes(plan.file_len - pos))
    except WriteError:
        raise
    except OSError as e:  # /dev/full's ENOSPC, a FIFO's reader gone (EPIPE): the library's I/O error
        raise WriteError(e.errno or errno.EIO, e.strerror or str(e), path) from e
    del plan.keepalive[:]
    now = time.perf_counter()
    raw: _core.RawWriteStats = {
        "bytes": plan.file_len,
        "seconds": now - tio,
        "direct": False,
        "io_uring": False,
        "registered": False,
        "locked": False,
        "block": 0,
        "direct_note": None,
        "uring_note": None,
        "crcs": [crcs.get(i, 0) for i in range(len(plan.storage_keys))],
        "open_seconds": 0.0,
        "io_seconds": now - tio,
        "commit_seconds": 0.0,
        "zero_copy_bytes": 0,
    }
    return write_stats(raw, path, plan.storage_bytes, plan.storage_keys, plan_seconds, now - t0)


def write_safetensors(
    obj: Any,
    path: str,
    opts: EngineOptions,
    metadata: Optional[Dict[str, str]],
    versions: Optional[TensorVersions] = None,
    on_gathered: Optional[Callable[[], None]] = None,
) -> WriteStats:
    """Write a flat ``{name: tensor}`` dict as a safetensors file and commit
    it; ``versions`` and ``on_gathered`` as for :func:`write_torch_zip`."""
    t0 = time.perf_counter()
    if versions is None:
        versions = TensorVersions(obj)
    plan = plan_safetensors(obj, metadata)
    return write_plan(plan, path, opts, time.perf_counter() - t0, t0, on_gathered=_checked(versions, obj, on_gathered))


def write_distributed(
    obj: Any,
    path: str,
    opts: EngineOptions,
    group: Any,
    sharded: bool,
    format: str,
    versions: Optional[TensorVersions] = None,
) -> WriteStats:
    """A save by every rank of ``group``: replicated (one file, each rank
    writes a part) or sharded (a directory of shards and an index).
    ``versions``: the tensors' version counters as of the call (taken now
    when not given), checked on every rank before anything is committed."""
    if group is None:
        raise ValueError("sharded=True needs group= (the ranks that each hold a shard)")
    if format != "torch":
        raise ValueError("distributed saves write torch checkpoints (format='torch')")
    if versions is None:
        versions = TensorVersions(obj)
    if sharded:
        return distributed.write_sharded(
            obj, path, group, opts, write=lambda o, p: write_torch_zip(o, p, opts, versions=versions)
        )
    return distributed.write_replicated(obj, path, group, opts, versions)


@counted_for_exit
@without_gc
def write_state_dict(
    obj: Any,
    path: PathLike,
    *,
    format: str = "torch",
    metadata: Optional[Dict[str, str]] = None,
    group: Any = None,
    sharded: bool = False,
    block_size: Optional[int] = None,
    arena_bytes: Optional[int] = None,
    queue_depth: Optional[int] = None,
    direct: Optional[bool] = None,
    io_uring: Optional[bool] = None,
    durable: Optional[bool] = True,
    gather_threads: Optional[int] = None,
    on_change: str = "error",
    zero_copy: Optional[bool] = None,
) -> WriteStats:
    """Save ``obj`` to ``path`` like ``torch.save``, at the speed of the disk.

    ``obj`` is anything ``torch.save`` accepts. The file is a torch zip
    checkpoint that ``torch.load`` (and ``torch.load(mmap=True)``) reads.
    With ``format="safetensors"``, ``obj`` is a flat ``{name: tensor}`` dict
    (plus optional string ``metadata``) and the file is one that
    ``safetensors.torch.load_file`` and ``safe_open`` read.
    The write is atomic and durable: data goes to a temporary file in the
    same directory, which is fsynced and renamed over ``path`` (then the
    directory is fsynced). On any error no file appears and an existing
    ``path`` is untouched. The path is resolved at the call; a symbolic
    link is followed (the file it points to is replaced, the link stays);
    a device or FIFO at ``path`` is written into, never replaced. A save
    to a path with background saves to it still pending waits for them:
    the last call wins.

    Options (``None`` takes the environment default, see :mod:`fastpersist.options`):
    ``block_size`` bytes per write, ``arena_bytes`` staging memory (bounded,
    independent of the checkpoint's size), ``queue_depth`` writes in flight,
    ``direct`` O_DIRECT, ``io_uring`` the io_uring back end, ``durable``
    fsync file and directory (leave it on for checkpoints),
    ``gather_threads`` threads that copy into the staging memory and
    checksum (default: the usable cores, at most 8), ``zero_copy`` write
    whole blocks of a storage straight from its memory where the file
    takes writes from that address (default on; the stats'
    ``zero_copy_bytes`` says how much was).

    A tensor changed in place (by another thread) while the save reads it
    raises :class:`~fastpersist.TensorChangedError` and nothing is
    committed; ``on_change="warn"`` warns and commits instead.

    Raises :class:`~fastpersist.SerializationError` for objects that cannot
    be saved, :class:`~fastpersist.WriteError` (an ``OSError`` with
    ``errno`` and ``filename``) for I/O failures, ``ValueError`` for bad
    options, ``TypeError`` when ``path`` is not a path.
    """
    p = resolve_target(path, directory=sharded)
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, not {format!r}")
    check_group(group, "write_state_dict()")
    opts = EngineOptions.resolve(
        block_size, arena_bytes, queue_depth, direct, io_uring, durable, gather_threads, zero_copy
    )
    # At the call, one walk: the version counters and, for a torch file
    # laid out from this object, its storages.
    torch_file = format == "torch" and not sharded
    versions = TensorVersions(obj, on_change, storages=torch_file, limit=SURVEY_FIRST if torch_file else None)
    try:
        wait_for_earlier(p)
        if group is not None or sharded:
            return write_distributed(obj, p, opts, group, sharded, format, versions)
        if format == "safetensors":
            return write_safetensors(obj, p, opts, metadata, versions)
        if metadata is not None:
            raise ValueError("metadata is only stored by format='safetensors'")
        return write_torch_zip(obj, p, opts, versions=versions)
    finally:
        # A failed save's traceback keeps this frame: its versions no longer
        # watch optimizer steps.
        versions.unwatch()
