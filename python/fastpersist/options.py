"""Options, environment defaults, the engine cache, path checks and stats.

A leaf module: it imports only the extension and :mod:`fastpersist.errors`.
Every other module takes its engines and options from here.

Environment variables set the defaults (a parameter wins over them):

``FASTPERSIST_DIRECT=0``       never use O_DIRECT (buffered writes)
``FASTPERSIST_IO_URING=0``     never use io_uring (pwrite thread pool)
``FASTPERSIST_ARENA_BYTES``    staging memory, bytes (default 128 MiB)
``FASTPERSIST_BLOCK_SIZE``     bytes per write and per read (default 4 MiB)
``FASTPERSIST_QUEUE_DEPTH``    writes (and reads) in flight (default 16)
``FASTPERSIST_GATHER_THREADS`` threads copying into the staging memory and
                               checksumming; for reads, copying out of it into
                               the destinations (default: the usable cores, at most 8)
``FASTPERSIST_ZERO_COPY=0``    always copy into the staging memory (by default
                               whole blocks of a storage are written straight
                               from its memory where the file takes that)

Engines (staging arena + io_uring ring) are expensive to make and cheap to
reuse, so one per distinct option set is kept per process; the cache holds
the :data:`MAX_OPTION_SETS` option sets used most recently, and engines of
older ones are released (their memory freed once no save uses them).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import contextvars
import ctypes
import dataclasses
import errno
import functools
import gc
import inspect
import json
import logging
import os
import re
import stat
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, TypeVar, Union, cast

from . import _core
from .errors import CorruptCheckpointError, FallbackWarning, WriteError

__all__ = [
    "parse_json",
    "PathLike",
    "EngineOptions",
    "WriteStats",
    "get_engine",
    "use_engine",
    "release_engines",
    "cached_option_sets",
    "check_path",
    "resolve_target",
    "ABANDONED_SAVE_AGE",
    "is_special_file",
    "note_pending",
    "has_pending",
    "gc_paused",
    "RangeBuffer",
    "wait_for_earlier",
    "env_int",
    "env_flag",
    "warn_fallback",
    "write_stats",
    "read_with",
    "read_records",
    "checksums",
    "remove_stale_temps",
    "make_dirs",
    "sweep_leftovers",
    "sweep_due",
    "SWEEP_EVERY",
    "MAX_OPTION_SETS",
    "TEMP_MIN_AGE",
]

log = logging.getLogger("fastpersist")

PathLike = Union[str, "os.PathLike[str]"]

#: 4 MiB writes and reads, 16 in flight: fio's best shape on the
#: development machine's disk, and, interleaved in one process there, 1.09x
#: (GPT-like 2 GiB saves), 1.07x (10,000 small tensors) and 1.04x (cold
#: reads) the 1 MiB x 32 used before.
DEFAULT_BLOCK_SIZE = 4 << 20
#: Twice the bytes in flight (16 x 4 MiB): while 16 buffers are with the
#: device, 16 more are being filled or emptied (with every buffer in flight
#: the device idles while completed ones are refilled; measured +17% writes
#: and +18% reads of 2 GiB with the arena twice, not once, what is in flight).
DEFAULT_ARENA_BYTES = 128 << 20
DEFAULT_QUEUE_DEPTH = 16
#: Distinct option sets whose engines are kept.
MAX_OPTION_SETS = 4


def parse_size(s: str) -> int:
    """A size in bytes: a number with an optional binary unit (``2GiB``,
    ``512M``, ``64 KiB``, ``1.5G``; K, M, G and T are powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([KMGT]?)(i?B)?\s*", s, re.I | re.ASCII)
    if not m:
        raise ValueError(f"bad size {s!r} (use e.g. 2GiB, 512MiB)")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * mult)


def env_int(name: str, default: int, size: bool = False) -> int:
    """An integer from the environment: decimal (leading zeros too), or
    0x/0o/0b prefixed; ``size``: bytes, where a unit may follow
    (:func:`parse_size`: ``32MiB``). Anything else is a ValueError naming
    the variable."""
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    text = v.strip()
    parsers: List[Callable[[str], int]] = [lambda t: int(t, 0), lambda t: int(t, 10)]  # (int(t, 0) refuses "010")
    if size:
        parsers.append(parse_size)
    for parse in parsers if text.isascii() else ():  # (int() takes other scripts' digits)
        try:
            return parse(text)
        except ValueError:
            continue
    kind = "a size in bytes (e.g. 33554432 or 32MiB)" if size else "an integer"
    raise ValueError(f"environment variable {name}={v!r} is not {kind}")


#: How an on/off environment variable may be spelled (case aside).
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """A boolean from the environment: 1, true, yes, on or 0, false, no,
    off (any case); anything else is a ValueError naming the variable (a
    typo such as ``FASTPERSIST_DIRECT=of`` would otherwise mean on)."""
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    word = v.strip().lower()
    if word in _ON or word in _OFF:
        return word in _ON
    raise ValueError(f"environment variable {name}={v!r} is not on or off (1, true, yes, on / 0, false, no, off)")


def _flag(name: str, given: Any, env: Optional[str]) -> bool:
    """An on/off option (the parameter, else ``env``, else on): True, False
    (or 1, 0), or None for the default; anything else is a TypeError (a
    string such as "no" would otherwise read as on)."""
    if given is None:
        return env_flag(env, True) if env is not None else True
    if isinstance(given, bool) or (type(given) is int and given in (0, 1)):
        return bool(given)
    raise TypeError(f"{name} must be True, False or None (the default), not {given!r}")


def _count(name: str, given: Optional[int], env: str, default: int, size: bool = False) -> int:
    """A positive integer option (the parameter, else ``env``, else the
    default; ``size``: bytes, the variable may give a unit), or a
    ValueError/TypeError that says where the value came from."""
    value = given if given is not None else env_int(env, default, size)
    where = "" if given is not None or not os.environ.get(env) else f" (from the environment variable {env})"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, not {value}{where}")
    if value >= 1 << 63:
        raise ValueError(f"{name}={value} is out of range{where}")
    return value


#: The environment variable of each count option.
_ENV = {
    "block_size": "FASTPERSIST_BLOCK_SIZE",
    "arena_bytes": "FASTPERSIST_ARENA_BYTES",
    "queue_depth": "FASTPERSIST_QUEUE_DEPTH",
    "gather_threads": "FASTPERSIST_GATHER_THREADS",
}


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_gather_threads() -> int:
    """The cores this process may use, at most 8 (the core's default)."""
    return max(1, min(_usable_cores(), 8))


def default_background_gather_threads() -> int:
    """For saves that run while the caller goes on (``save_async``,
    ``AsyncSaver``, ``Checkpointer``): a quarter of the cores this process
    may use, at least 1 and at most 8, leaving the rest to the training the
    save overlaps. Handing each extent to another thread costs CPU of its
    own (two thread wake-ups an extent): a pipelined save of 119 MiB on 2
    cores took 19.5 ms of CPU with 2 gather threads and 12.1 ms with 1, in
    the same time, since the disk bounds it; one thread copies and checksums
    faster than one drive writes."""
    return max(1, min(_usable_cores() // 4, 8))


@dataclass(frozen=True)
class EngineOptions:
    """The options an engine is made with (see :func:`write_state_dict`)."""

    block_size: int
    arena_bytes: int
    queue_depth: int
    direct: bool
    io_uring: bool
    durable: bool
    gather_threads: int = 1
    zero_copy: bool = True
    #: The mode of the files committed, where a :func:`file_mode` block gave
    #: one when the save was called (carried to a background save's
    #: threads); None: the running thread's block, if any.
    file_mode: Optional[int] = None

    @classmethod
    def resolve(
        cls,
        block_size: Optional[int] = None,
        arena_bytes: Optional[int] = None,
        queue_depth: Optional[int] = None,
        direct: Optional[bool] = None,
        io_uring: Optional[bool] = None,
        durable: Optional[bool] = True,
        gather_threads: Optional[int] = None,
        zero_copy: Optional[bool] = None,
        background: bool = False,
    ) -> EngineOptions:
        """Parameters where given, else the environment, else the defaults
        (``background``: those of a save that overlaps the caller's work,
        :func:`default_background_gather_threads`). Raises ValueError for
        values no engine can take (negative or zero, and the engine's own
        limits: see ``_core.check_engine_options``), TypeError for a count
        that is not an int or an on/off option that is not a bool or None."""
        threads = default_background_gather_threads() if background else default_gather_threads()
        opts = cls(
            block_size=_count("block_size", block_size, _ENV["block_size"], DEFAULT_BLOCK_SIZE, size=True),
            arena_bytes=_count("arena_bytes", arena_bytes, _ENV["arena_bytes"], DEFAULT_ARENA_BYTES, size=True),
            queue_depth=_count("queue_depth", queue_depth, _ENV["queue_depth"], DEFAULT_QUEUE_DEPTH),
            direct=_flag("direct", direct, "FASTPERSIST_DIRECT"),
            io_uring=_flag("io_uring", io_uring, "FASTPERSIST_IO_URING"),
            # No environment variable: a checkpoint is durable unless the
            # call says otherwise (None is that default, never "off").
            durable=_flag("durable", durable, None),
            gather_threads=_count("gather_threads", gather_threads, _ENV["gather_threads"], threads),
            zero_copy=_flag("zero_copy", zero_copy, "FASTPERSIST_ZERO_COPY"),
        )
        # The engine's own limits (block size a multiple of the page, an arena
        # of at least one block and no more than the machine's memory, queue
        # depth, gather threads), here where the options are given rather
        # than when the first save makes the engine; a limit a variable's
        # value is past names the variable.
        counts = dict(
            block_size=block_size, arena_bytes=arena_bytes, queue_depth=queue_depth, gather_threads=gather_threads
        )
        try:
            _core.check_engine_options(**{k: getattr(opts, k) for k in counts})
        except ValueError as e:
            envs = [_ENV[k] for k, given in counts.items() if given is None and os.environ.get(_ENV[k]) and k in str(e)]
            if not envs:
                raise
            raise ValueError(f"{e} (from the environment variable {', '.join(envs)})") from None
        # (read by the core itself: checked here, where a bad value can be named)
        env_flag("FASTPERSIST_FUSED_COPY", True)
        return opts

    @classmethod
    def given(
        cls, what: str, options: Dict[str, Any], background: bool = False, also: Tuple[str, ...] = ()
    ) -> EngineOptions:
        """:meth:`resolve` of the keyword arguments a public call ``what``
        took as options: the engine's, plus the names in ``also`` (the
        call's own, left to it). One it does not know is a TypeError that
        names ``what``, the option and those it takes (not this method)."""
        takes = also + ENGINE_OPTIONS
        unknown = sorted(set(options) - set(takes))
        if unknown:
            names = ", ".join(map(repr, unknown))
            raise TypeError(f"{what} got unknown option(s) {names}; it takes {', '.join(takes)}")
        return cls.resolve(background=background, **{k: v for k, v in options.items() if k in ENGINE_OPTIONS})


#: The engine options a save takes (:meth:`EngineOptions.resolve`'s parameters).
ENGINE_OPTIONS = tuple(p for p in inspect.signature(EngineOptions.resolve).parameters if p != "background")


class _OwnedLock:
    """A lock that knows whether the calling thread holds it (to tell a
    re-entrant call, e.g. from a signal handler, from contention). The
    ownership is the C lock's own (an RLock), taken in the same step as the
    lock: an interrupt (Ctrl-C) landing right after the acquire still
    finds the lock owned, and the release in a ``finally`` frees it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def held_here(self) -> bool:
        """Whether the calling thread holds the lock."""
        return bool(self._lock._is_owned())  # type: ignore[attr-defined]  # the C RLock's

    def __enter__(self) -> _OwnedLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


EngineEntry = Tuple[_OwnedLock, _core.Engine]
# Option set -> {index: (lock, engine)}, most recently used last.
_engines: OrderedDict[EngineOptions, Dict[int, EngineEntry]] = OrderedDict()
# Re-entrant: a signal handler may run while this thread holds it.
_engines_lock = threading.RLock()


def _new_engine(opts: EngineOptions) -> _core.Engine:
    return _core.Engine(
        block_size=opts.block_size,
        arena_bytes=opts.arena_bytes,
        queue_depth=opts.queue_depth,
        direct=opts.direct,
        io_uring=opts.io_uring,
        durable=opts.durable,
        gather_threads=opts.gather_threads,
        zero_copy=opts.zero_copy,
    )


def get_engine(opts: EngineOptions, index: int = 0) -> EngineEntry:
    """The process-wide engine for these options (made on first use), with
    the lock that serialises its use. ``index`` > 0 gives further engines,
    for work that keeps two files' I/O in flight at once (the staged read
    to a GPU uses two)."""
    # One engine (and arena) whatever the gather threads, which each use
    # sets (use_engine): background saves gather on fewer.
    key = dataclasses.replace(opts, gather_threads=1, file_mode=None)
    with _engines_lock:
        byidx = _engines.get(key)
        if byidx is None:
            byidx = _engines[key] = {}
        _engines.move_to_end(key)
        hit = byidx.get(index)
        if hit is None or hit[1].retired:
            # A retired engine (its ring failed with I/O in flight) is used
            # no more: a save still holding it lets go of it when it ends.
            hit = byidx[index] = (_OwnedLock(), _new_engine(opts))
        # Engines of option sets not used lately are dropped from the cache;
        # one still in use by a save is freed when that save lets go of it.
        while len(_engines) > MAX_OPTION_SETS:
            _engines.popitem(last=False)
        return hit


#: The mode of the files this thread's saves make, when not the replaced
#: file's (see :func:`file_mode`).
_FILE_MODE: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("fastpersist_file_mode", default=None)


@contextlib.contextmanager
def file_mode(mode: Optional[int]) -> Iterator[None]:
    """Within the block, the files this thread's saves commit get exactly
    ``mode`` and the writer's owner, whatever was at the path (what a writer
    that makes a new file and renames it onto the path leaves: the patched
    ``save_file``); None, the default: a replaced file's owner, group and
    mode are kept, a new file follows the umask."""
    token = _FILE_MODE.set(mode)
    try:
        yield
    finally:
        _FILE_MODE.reset(token)


def with_file_mode(opts: EngineOptions) -> EngineOptions:
    """``opts`` carrying the calling thread's :func:`file_mode`, for a save
    that another thread runs."""
    mode = _FILE_MODE.get()
    return opts if mode is None else dataclasses.replace(opts, file_mode=mode)


#: :func:`counted_for_exit` calls in progress, and the condition the exit
#: waits on for them (see :func:`_quiesce_at_exit`).
_calls_in_progress = 0
_calls = threading.Condition(threading.RLock())  # (reentrant: a signal handler's save)
#: The thread that exits the process, once it waits for those calls: a
#: call any other thread makes then waits until the end.
_exiting_thread: Optional[int] = None


#: This thread's :func:`counted_for_exit` calls, nested (a read inside a
#: save: the inner one never waits for the exit).
_counted = threading.local()

#: The longest the exit waits for daemon threads' calls (a call blocked on
#: a file system that stopped answering must not hold the process for ever).
EXIT_WAIT = 120.0


def _enter_counted() -> None:
    global _calls_in_progress
    depth = getattr(_counted, "depth", 0)
    with _calls:
        while depth == 0 and _exiting_thread is not None and threading.get_ident() != _exiting_thread:
            _calls.wait()  # (a daemon thread at exit: ended with the process, outside the core)
        _calls_in_progress += 1
    _counted.depth = depth + 1


def _leave_counted() -> None:
    global _calls_in_progress
    _counted.depth = getattr(_counted, "depth", 1) - 1
    with _calls:
        _calls_in_progress -= 1
        _calls.notify_all()


def counted_for_exit(fn: _F) -> _F:
    """``fn`` (a public save, read or check) counted for the exit: a daemon
    thread's call in progress is waited for whole (a save committed, as a
    background save in flight is; a read back in its caller's code, not in
    the core or in the torch calls it makes), and one made once the process
    exits waits there, outside the core, until it ends."""

    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        _enter_counted()
        try:
            return fn(*args, **kwargs)
        finally:
            _leave_counted()

    return cast(_F, counted)


def _quiesce_at_exit() -> None:
    """At exit, after the saves in flight are committed (registered first,
    this runs after every other exit hook of the package): wait for the
    saves and reads daemon threads are making (:func:`counted_for_exit`)
    and keep any other from beginning. A thread the interpreter finds taking
    the GIL back from the core as it finalizes is ended by unwinding through
    it, which aborts the process (SIGABRT), a file half written. (Other
    calls into the core, and a daemon thread's own torch calls, at exit can
    still abort it so.)"""
    global _exiting_thread
    try:
        with _calls:
            _exiting_thread = threading.get_ident()
            if _calls_in_progress:
                log.warning("fastpersist: waiting for %d call(s) in other threads before exit", _calls_in_progress)
            end = time.monotonic() + EXIT_WAIT
            while _calls_in_progress and time.monotonic() < end:
                _calls.wait(0.1)
            if _calls_in_progress:
                log.error("fastpersist: exiting with %d call(s) in other threads still running", _calls_in_progress)
    except KeyboardInterrupt:
        os._exit(130)  # (finalizing with them inside the core would abort)


atexit.register(_quiesce_at_exit)


@contextlib.contextmanager
def use_engine(opts: EngineOptions, index: int = 0) -> Iterator[_core.Engine]:
    """The engine for ``opts``, held for this thread for the block (one
    file at a time per engine). A call made while this very thread already
    holds it (a save from a signal handler that interrupted a save) gets an
    engine of its own instead of waiting for itself forever. The files it
    begins get ``opts.file_mode``, else the mode :func:`file_mode` gives
    this thread."""
    lock, eng = get_engine(opts, index)
    mode = opts.file_mode if opts.file_mode is not None else _FILE_MODE.get()
    if lock.held_here():
        own = _new_engine(opts)
        own.set_file_mode(mode)
        yield own
        return
    try:
        # Inside the try: an interrupt landing as the lock is taken still
        # lets it go (a lock kept by the main thread would hang every
        # background save with these options, and the exit's drain).
        lock.acquire()
        eng.set_gather_threads(opts.gather_threads)
        eng.set_file_mode(mode)
        yield eng
    finally:
        # One call into the C lock, no Python frame in between: an interrupt
        # (Ctrl-C) lands before this finally or after the release, never
        # between a check and the release (it did, 1 in 5,000 saves, and
        # the lock stayed with the main thread: every other thread's save
        # with these options, and the exit's drain, waited for ever). The C
        # RLock's release checks the owner: a lock another thread holds
        # (this one's acquire was interrupted while it waited) is left alone.
        try:
            lock._lock.release()
        except RuntimeError:
            pass  # not held here: the acquire itself was interrupted


def _after_fork_in_child() -> None:
    """In a child made by ``os.fork()`` (a DataLoader worker, a user's own
    fork): the parent's engines, and the locks that threads of the parent
    may have held at the fork, are not this process's. The child starts
    with no engines (it makes its own on first use); the core leaves the
    copies it inherited alone when they are freed (their ring is shared with
    the parent, their threads do not exist here, their temporary files are
    the parent's). Saves pending in the parent are not waited for here."""
    global _engines, _engines_lock, _order_lock, _pending_by_path, _gc_lock, _gc_depth, _defer_lock, _defer_depth
    global _calls_in_progress, _calls, _exiting_thread
    _calls_in_progress, _calls, _exiting_thread = 0, threading.Condition(threading.RLock()), None
    _engines_lock = threading.RLock()
    _engines = OrderedDict()
    _order_lock = threading.RLock()
    _pending_by_path = {}
    # A save of the parent's other threads may have paused the collector
    # (or deferred full collections) at the fork: the child has no such
    # save, and would run without a collector for ever.
    _gc_lock = threading.RLock()
    if _gc_depth:
        _gc_depth = 0
        if _gc_was_enabled:
            gc.enable()
    _defer_lock = threading.RLock()
    if _defer_depth:
        _defer_depth = 0
        _end_deferral()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def cached_option_sets() -> List[EngineOptions]:
    """The option sets whose engines are cached, least recently used first
    (with ``gather_threads=1``: one engine serves every thread count)."""
    with _engines_lock:
        return list(_engines)


ReadReq = Tuple[int, int, int]


def read_with(eng: _core.Engine, fd: int, reqs: List[ReadReq], merge_gap: Optional[int] = None) -> List[int]:
    """Read (file offset, address, bytes) requests of the open file ``fd``
    with ``eng`` (whose lock the caller holds); returns each one's CRC32.
    The engine reads the file ``fd`` is open on, even if its path has been
    replaced since (one open file from start to end of a read).
    ``merge_gap``: requests are read as one only across gaps of at most
    this many bytes (None: the engine's default, 256 KiB)."""
    if not reqs:
        return []
    return list(eng.read_into_fd(fd, reqs, merge_gap)["crcs"])


def read_records(fd: int, reqs: List[ReadReq], opts: EngineOptions, merge_gap: Optional[int] = None) -> List[int]:
    """:func:`read_with` on the engine for ``opts``."""
    with use_engine(opts) as eng:
        return read_with(eng, fd, reqs, merge_gap)


def _first_byte(buf: Any) -> ctypes.c_char:
    """The first byte of the writable buffer ``buf`` as a ctypes object
    (``ctypes.addressof`` gives the buffer's address); the buffer stays
    exported while it lives. One byte's type for any length: an array type
    made per length (``c_char * n``) is cached weakly by ctypes and left as
    cyclic garbage by every read of a new length."""
    return ctypes.c_char.from_buffer(buf)


class RangeBuffer:
    """One buffer for many small (file offset, length) ranges: the engine's
    read requests into it (:attr:`reqs`, to read on their own or along with
    other requests), then the bytes of each range (:meth:`parts`)."""

    def __init__(self, ranges: List[Tuple[int, int]]) -> None:
        self._lens = [n for _, n in ranges]
        self._buf = bytearray(sum(self._lens) or 1)
        # The buffer stays exported (it cannot be resized) while this lives.
        self._view = _first_byte(self._buf)
        at = ctypes.addressof(self._view)
        self.reqs: List[ReadReq] = []
        for off, n in ranges:
            self.reqs.append((off, at, n))
            at += n

    def parts(self) -> List[bytes]:
        out, at = [], 0
        for n in self._lens:
            out.append(bytes(self._buf[at : at + n]))
            at += n
        return out


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write all of ``data`` (any buffer) at ``offset`` of the open file
    (pwrite may write less than it is given)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view, offset = view[n:], offset + n


def read_range(fd: int, offset: int, buf: Any, opts: Optional[EngineOptions] = None) -> int:
    """Fill the writable buffer ``buf`` (a bytearray, or a memoryview of
    one) with the bytes of the open file ``fd`` from ``offset``, read by
    the engine (O_DIRECT where the file system allows it: a file read once,
    to be sent elsewhere, does not fill the page cache); returns their
    CRC32. ValueError when the file is too short."""
    view = memoryview(buf).cast("B")
    n = view.nbytes
    if n == 0:
        return 0
    if view.readonly:
        raise TypeError("read_range needs a writable buffer")
    c = _first_byte(view)
    try:
        return read_records(fd, [(offset, ctypes.addressof(c), n)], opts or EngineOptions.resolve())[0]
    finally:
        del c
        view.release()


def checksums(fd: int, ranges: List[Tuple[int, int]], opts: EngineOptions) -> List[int]:
    """CRC32 of each (file offset, bytes) range of the open file ``fd``,
    read through the engine's arena (bounded memory)."""
    with use_engine(opts) as eng:
        return list(eng.crc_ranges_fd(fd, ranges))


def release_engines() -> None:
    """Free every cached engine (their staging memory and rings)."""
    with _engines_lock:
        _engines.clear()


_warned: set = set()


def warn_fallback(reason: Optional[str], asked: bool) -> None:
    """One :class:`FallbackWarning` per reason per process, when the fast
    path was asked for and not available."""
    if not reason or not asked or reason in _warned:
        return
    _warned.add(reason)
    warnings.warn(f"fastpersist: {reason}; using a slower fallback", FallbackWarning, stacklevel=4)


def fsync_dir(path: str) -> None:
    """fsync a directory (its entries are then durable)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_identity(path: str) -> Optional[Tuple[int, int, int, int]]:
    """What tells the file at ``path`` (not following a link at it) from
    another one put there later: device, inode, size and change time; None
    when there is none."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns)


def put_marker(path: str) -> None:
    """Create the empty file ``path`` (one of fastpersist's own names),
    durably: its directory is fsynced. A link at the name is replaced,
    never followed."""
    if os.path.islink(path):
        os.unlink(path)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def remove_durably(path: str) -> bool:
    """Remove the file ``path`` and fsync its directory; False when there
    was none. Other errors are raised."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return True


def make_dirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, durably: each directory made is
    fsynced into its parent (on a file system that does not order metadata
    a new directory, and every checkpoint committed in it, could otherwise
    be gone after a power loss)."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    os.makedirs(path, exist_ok=True)
    for d in reversed(missing):
        _fsync_parent(os.path.dirname(d))
    if missing:
        fsync_dir(missing[0])


def _fsync_parent(path: str) -> None:
    """fsync an existing directory a new one was made in, where it can be
    opened: a directory one may write into and enter but not list (a
    drop box, mode 1733) cannot be, and os.makedirs worked there."""
    try:
        fsync_dir(path)
    except PermissionError:
        pass


def check_path(path: Any) -> str:
    """A file path as ``str``; TypeError for file objects and other types,
    ValueError for an empty path."""
    if hasattr(path, "write") or not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"fastpersist writes to a file path (str or os.PathLike), not {type(path).__name__}")
    p = os.fsdecode(os.fspath(path))
    if p == "":
        raise ValueError("empty path")
    if "\0" in p:
        raise ValueError(f"path {p!r} contains a NUL byte")
    return p


def open_for_read(path: str) -> int:
    """An fd of the checkpoint file ``path``, opened for reading; a
    directory is an ``IsADirectoryError`` naming it (``open`` takes a
    directory, and the first read would fail without its name); a FIFO or
    a socket (no checkpoint can be read at offsets from one) is an OSError
    naming it, at once: the open does not wait for a writer."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket"
            raise OSError(errno.ESPIPE, f"{kind}, not a checkpoint file (it cannot be read at offsets)", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def names_outside(name: Any) -> bool:
    """Whether ``name``, a path a checkpoint's index or metadata gives
    relative to its directory, names something outside it (absolute, or
    through ``..``; not a name that only begins with ".."), or is no str."""
    if not isinstance(name, str):
        return True
    norm = os.path.normpath(name)
    return os.path.isabs(norm) or norm == ".." or norm.startswith(".." + os.sep)


def open_beneath(directory: str, name: str) -> int:
    """:func:`open_for_read` of the file ``name`` of a checkpoint
    ``directory`` (a data file its index or metadata names), refusing one
    that is, or resolves through a link to, anything outside it
    (CorruptCheckpointError naming both): a checkpoint's files are read,
    nothing else it points at."""
    path = os.path.join(directory, name)
    if names_outside(name):
        raise CorruptCheckpointError(f"{directory}: {name!r} names a file outside it")
    fd = open_for_read(path)
    try:
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")  # (where the open landed: no race with a rename)
        except OSError:
            real = os.path.realpath(path)
        root = os.path.realpath(directory)
        if os.path.commonpath([root, real]) != root:
            raise CorruptCheckpointError(f"{directory}: {name!r} resolves to {real}, outside it (a link)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def resolve_target(path: Any, directory: bool = False, follow_last: bool = True) -> str:
    """The absolute path a save to ``path`` writes, fixed at the call (a
    later ``os.chdir`` changes nothing). A symbolic link is followed to its
    final target, as ``torch.save``'s ``open()`` does: the file is
    committed in the target's directory and the link still points to it; a
    dangling link's target is created. Unless the save writes a
    ``directory`` (a sharded save), a path that ends with a separator is a
    ValueError (``torch.save`` refuses it too), where the separator would
    otherwise be dropped and a file written. With ``follow_last`` False
    (a name a caller owns, such as a Checkpointer's), a link at the last
    component is not followed: the save replaces the link itself."""
    p = check_path(path)
    if not directory and (p.endswith(os.sep) or (os.altsep and p.endswith(os.altsep))):
        raise ValueError(f"{p!r} ends with a path separator: a save needs a file name, not a directory")
    if ".." in p.split(os.sep) and not parent_exists(p):
        # realpath would drop "missing/.." as text; the kernel (torch.save's
        # open) finds no such directory.
        raise WriteError(errno.ENOENT, f"no such directory: {os.path.dirname(p)!r}", p)
    # Links first, then "..", component by component, as the kernel
    # resolves them ("link/../x" is beside the link's target, not the link).
    if not follow_last:
        head, tail = os.path.split(p)
        if tail not in ("", ".", ".."):
            return os.path.join(os.path.realpath(head or "."), tail)
    return os.path.realpath(p)


def parent_exists(path: Any) -> bool:
    """Whether the directory that would hold ``path`` exists, as the kernel
    finds it (links followed before each ``..``)."""
    p = os.fspath(path)
    parent = os.path.dirname(p) or (b"." if isinstance(p, bytes) else ".")
    return os.path.isdir(parent)


def is_special_file(path: str) -> bool:
    """Whether ``path`` exists and is neither a regular file nor a
    directory (a character or block device, a FIFO, a socket): such a file
    is never replaced, only written into."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode))


#: A leftover temporary file younger than this (seconds) is never removed.
TEMP_MIN_AGE = 600.0
#: A finished file of another save to the same directory (a DCP data file
#: or a shard no committed index names) untouched for less than this is
#: never removed: that save may still be committing it (a slow rank, an
#: async save); one older is a killed save's.
ABANDONED_SAVE_AGE = 24 * 3600.0


def aside_name(path: str, suffix: str) -> str:
    """A free name to set the file ``path`` aside under: ``<path><suffix>``,
    or ``<path><suffix>-1``, ``-2``, ... when taken (what an earlier set-aside
    left is kept)."""
    dst, n = path + suffix, 1
    while os.path.lexists(dst):
        dst, n = f"{path}{suffix}-{n}", n + 1
    return dst


def abandoned(path: str, now: Optional[float] = None) -> bool:
    """Whether the file ``path`` (not following a link) has been untouched
    for ``ABANDONED_SAVE_AGE``: a save's file that no index or metadata
    names and no save still in flight can be writing. False when it cannot
    be inspected."""
    try:
        mtime = os.lstat(path).st_mtime
    except OSError:
        return False
    return (time.time() if now is None else now) - mtime >= ABANDONED_SAVE_AGE


def remove_stale_temps(directory: str, matches: Callable[[str], Any], min_age: float = TEMP_MIN_AGE) -> List[str]:
    """Remove the temporary files in ``directory`` that saves left when
    their process died: names for which ``matches(name)`` is true (the
    caller's exact pattern of fastpersist's own names), regular files, not
    locked by a live writer (on any host, in any PID namespace: the core's
    ``temp_file_in_use``) and older than ``min_age`` seconds. Returns the
    names removed; a file that cannot be inspected or removed is left (and
    logged)."""
    removed: List[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not matches(name) or not _core.is_temp_name(name):
            continue
        p = os.path.join(directory, name)
        try:
            st = os.lstat(p)
            if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < min_age:
                continue
            if _core.temp_file_in_use(p):
                continue
            os.unlink(p)
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("fastpersist: cannot remove the leftover temporary file %s: %s", p, e)
    return removed


#: Seconds between two sweeps of one directory's or target's leftovers by
#: this process (each a listing of the directory).
SWEEP_EVERY = 60.0
# Targets (and directories) -> when this process last swept their leftovers.
_swept: Dict[str, float] = {}


def sweep_due(key: str) -> bool:
    """Whether ``key`` (a target or a directory) was not swept by this
    process in the last :data:`SWEEP_EVERY` seconds; marks it swept."""
    now = time.monotonic()
    last = _swept.get(key)
    if last is not None and now - last < SWEEP_EVERY:
        return False
    if len(_swept) >= 4096:
        _swept.clear()
    _swept[key] = now
    return True


def sweep_leftovers(path: str) -> None:
    """Before a save to ``path`` reserves its room: remove what earlier
    saves to it left when their process was killed
    (``.<name>.<pid>.<n>.fptmp`` of this very name, see
    :func:`remove_stale_temps`), at most once every :data:`SWEEP_EVERY`
    seconds per target (a long-running process also removes leftovers that
    were too young at its first save; leftovers that filled the disk do not
    fail the save that removes them). Never raises."""
    if not sweep_due(path):
        return
    directory, name = os.path.split(path)
    part = os.fsdecode(_core.temp_name_part(os.fsencode(name)))  # a long name is cut and hashed
    marker = re.escape(_core.TEMP_MARKER)
    pattern = re.compile(r"\." + re.escape(part) + r"\.[0-9]{1,10}\.[0-9]{1,20}" + marker, re.DOTALL)
    try:
        for n in remove_stale_temps(directory, pattern.fullmatch):
            log.warning("fastpersist: removed %s, left by a save that did not finish", os.path.join(directory, n))
    except Exception as e:  # noqa: BLE001 - housekeeping never fails a save
        log.warning("fastpersist: cannot sweep the leftovers of %s: %r", path, e)


_order_lock = threading.RLock()
# Resolved path -> futures of saves to it not yet finished, in call order.
_pending_by_path: Dict[str, List[Any]] = {}


def note_pending(path: str, fut: Any) -> None:
    """Record, at the call, a background save to ``path`` (saves to one
    path commit in the order of their calls)."""
    with _order_lock:
        _pending_by_path.setdefault(path, []).append(fut)
    # (on the thread that completes it, before the caller's callbacks)
    getattr(fut, "_on_done", fut.add_done_callback)(functools.partial(forget_pending, path))


def forget_pending(path: str, fut: Any) -> None:
    """``fut`` no longer pending at ``path`` (done, or never handed to its
    thread); idempotent."""
    with _order_lock:
        lst = _pending_by_path.get(path, [])
        if fut in lst:
            lst.remove(fut)
        if not lst:
            _pending_by_path.pop(path, None)


#: Reentrant: a signal handler that saves runs on the thread it interrupted,
#: perhaps inside this lock.
_gc_lock = threading.RLock()
_gc_depth = 0
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a save plans and
    pickles. A save of many tensors allocates tens of thousands of objects
    that all live until it ends; they would trigger full collections of the
    whole heap (measured: two, 0.27 s of a 1.3 s save of 10,000 tensors),
    which cannot free any of them. Reference counting frees as usual, and
    collection resumes (running when due) once the last save in flight
    leaves. Saves on several threads nest."""
    global _gc_depth, _gc_was_enabled
    try:
        # All inside the try: an interrupt (Ctrl-C) landing anywhere here
        # still runs the finally. The depth counts before the collector is
        # disabled, so an interrupt between the two leaves it counted, and
        # the finally enables the collector again (an interrupt right after
        # gc.disable() left it off for the rest of the process).
        with _gc_lock:
            _gc_depth += 1
            if _gc_depth == 1:
                _gc_was_enabled = gc.isenabled()
                gc.disable()
        yield
    finally:
        with _gc_lock:
            # Whether to enable it, read before the depth drops: a signal
            # handler's save landing after that takes the collector for
            # off and records so, and this one enables it all the same.
            # (Enabled last: a collection it sets off is not inside a save.)
            was_enabled = _gc_was_enabled
            _gc_depth = max(0, _gc_depth - 1)
            if _gc_depth == 0 and was_enabled:
                gc.enable()


_F = TypeVar("_F", bound=Callable[..., Any])


def without_gc(fn: _F) -> _F:
    """``fn`` run inside :func:`gc_paused`, its frame gone before collection
    resumes. A save's own objects (tens of thousands for many tensors: the
    version counters recorded, the storages found, the layout) are
    referenced from the frame of the function that made them; still alive
    when collection resumes, the first allocation after it would set off a
    collection that walks every one of them, only for them to be freed
    right after (5-8 ms at the end of a 0.35 s save of 10,000 tensors).
    Returned, they are freed first (reference counting), and nothing is
    left to walk."""

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        with gc_paused():
            return fn(*args, **kwargs)

    return cast(_F, paused)


#: Generation-2 threshold while full collections are deferred: never
#: reached within one checkpoint (it counts generation-1 collections).
_DEFERRED_THRESHOLD2 = 1 << 30
# Re-entrant: a collection set off inside begin/end (the tuples of
# gc.get_threshold) may run a dropped owner's finalizer, which ends its
# deferral (a no-op there: none other is held when the depth is 0).
_defer_lock = threading.RLock()
_defer_depth = 0
_defer_saved: Optional[Tuple[int, int]] = None  # (threshold 2 before, as set)


class FullGcDeferral:
    """Python's full (generation 2) collections deferred across the calls
    of one framework save or load that this library does not drive end to
    end (DCP: from ``set_up_storage_writer`` to ``finish``), where
    :func:`gc_paused` cannot span them. DCP plans 10,000 small tensors with
    hundreds of thousands of objects, each plan pickled and unpickled;
    those allocations set off full collections of the whole heap, 0.3 s
    each in a process holding torch (measured: 1.1-1.8 s of a 3.2 s save at
    one gloo rank). Young generations are still collected, and reference
    counting frees as usual; only the threshold of the oldest generation is
    raised, and set back when the last deferral ends (unless the caller set
    thresholds of their own meanwhile). A deferral that is not ended (a
    save that failed between the hooks) ends with its owner's next save or
    load, or when the owner is closed or dropped: collections are late
    meanwhile, never off.

    ``begin`` and ``end`` are idempotent; deferrals of several owners nest."""

    __slots__ = ("__weakref__", "_held")

    def __init__(self) -> None:
        self._held = False

    def __reduce__(self) -> Tuple[Any, ...]:
        return (FullGcDeferral, ())  # a copy elsewhere defers nothing yet

    @property
    def held(self) -> bool:
        return self._held

    def begin(self) -> None:
        global _defer_depth, _defer_saved
        with _defer_lock:
            if self._held:
                return
            self._held = True
            if _defer_depth == 0:
                before = gc.get_threshold()
                deferred = max(before[2], _DEFERRED_THRESHOLD2)
                gc.set_threshold(before[0], before[1], deferred)
                _defer_saved = (before[2], deferred)
            _defer_depth += 1

    def end(self) -> None:
        global _defer_depth
        with _defer_lock:
            if not self._held:
                return
            self._held = False
            _defer_depth = max(0, _defer_depth - 1)  # (a deferral a forked child inherited held)
            if _defer_depth == 0:
                _end_deferral()


def _end_deferral() -> None:
    """The oldest generation's threshold set back (unless the caller set
    one of their own since the deferral began)."""
    global _defer_saved
    if _defer_saved is not None:
        old2, deferred = _defer_saved
        _defer_saved = None
        now = gc.get_threshold()
        if now[2] == deferred:
            gc.set_threshold(now[0], now[1], old2)


def full_gc_deferral(owner: Any) -> FullGcDeferral:
    """A :class:`FullGcDeferral` that ends when ``owner`` is dropped."""
    d = FullGcDeferral()
    weakref.finalize(owner, d.end)
    return d


def has_pending(path: Any) -> bool:
    """Whether a background save to ``path`` (resolved as saves resolve it)
    has been called and has not finished: the file may not exist yet, but
    it will."""
    try:
        p = resolve_target(path, directory=True)
    except (OSError, TypeError, ValueError):
        return False
    with _order_lock:
        return bool(_pending_by_path.get(p))


def wait_for_earlier(path: str, fut: Any = None) -> None:
    """Wait until every save to ``path`` called before ``fut`` (every one
    still pending, when ``fut`` is None: a synchronous save) has finished,
    so the last call to a path wins. A save this thread is registering (a
    signal handler's save interrupted its registration) is not waited for:
    it cannot run before the handler returns, and is ordered after."""
    with _order_lock:
        lst = list(_pending_by_path.get(path, ()))
    if fut is not None:
        lst = lst[: lst.index(fut)] if fut in lst else lst
    mine = getattr(_registering, "futures", ())
    for f in lst:
        if f is not fut and not any(f is m for m in mine):
            concurrent.futures.wait([f])


#: The background saves this thread is registering (see :func:`registering`).
_registering = threading.local()


@contextlib.contextmanager
def registering(fut: Any) -> Iterator[None]:
    """``fut``'s save is being registered by this thread, from when it is
    noted pending until it is handed to its thread: a save a signal handler
    makes meanwhile (on this thread) must not wait for it."""
    mine = getattr(_registering, "futures", None)
    if mine is None:
        mine = _registering.futures = []
    mine.append(fut)
    try:
        yield
    finally:
        mine.remove(fut)


def registering_here() -> bool:
    """Whether this thread is registering a background save (a signal
    handler's call interrupted it)."""
    return bool(getattr(_registering, "futures", None))


@dataclass(frozen=True)
class WriteStats:
    """What one save did."""

    path: str
    #: Bytes in the file.
    bytes: int
    #: Wall time from the call to the durable commit.
    seconds: float
    #: O_DIRECT was used for the bulk of the file.
    direct: bool
    #: io_uring was used (else the pwrite thread pool).
    io_uring: bool
    #: The arena was registered with io_uring (WriteFixed).
    registered_buffers: bool
    #: The arena was mlocked.
    locked_memory: bool
    #: O_DIRECT block size (alignment) in use.
    block: int
    #: Tensor storage bytes written.
    storage_bytes: int
    #: CRC32 of each storage record, by storage key.
    crc32: Dict[str, int] = field(default_factory=dict, repr=False)
    #: Seconds spent pickling and laying out the rest of the file (while the
    #: storages found up front were being written), inside ``seconds``.
    plan_seconds: float = 0.0
    #: Seconds spent gathering and writing the data, inside ``seconds``.
    io_seconds: float = 0.0
    #: Seconds spent on truncate, fsync, rename and directory fsync.
    commit_seconds: float = 0.0
    #: Bytes written straight from the storages' memory (no copy into the
    #: staging memory), inside ``bytes``.
    zero_copy_bytes: int = 0

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10**9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def write_stats(
    raw: _core.RawWriteStats,
    path: str,
    storage_bytes: int,
    keys: List[str],
    plan_seconds: float,
    seconds: float,
) -> WriteStats:
    """:class:`WriteStats` from the engine's raw stats."""
    return WriteStats(
        path=path,
        bytes=raw["bytes"],
        seconds=seconds,
        direct=raw["direct"],
        io_uring=raw["io_uring"],
        registered_buffers=raw["registered"],
        locked_memory=raw["locked"],
        block=raw["block"],
        storage_bytes=storage_bytes,
        crc32=dict(zip(keys, raw["crcs"])),
        plan_seconds=plan_seconds,
        io_seconds=raw["io_seconds"],
        commit_seconds=raw["commit_seconds"],
        zero_copy_bytes=raw["zero_copy_bytes"],
    )


#: How deep the JSON fastpersist reads back (sidecars, markers, records,
#: log lines: a few levels) may nest.
MAX_JSON_DEPTH = 128


def parse_json(raw: Union[str, bytes]) -> Any:
    """``json.loads``, where nesting too deep (a damaged or hostile file: a
    sidecar, a marker, a log line) is a ValueError like any other malformed
    JSON: counted before the decoder, which recurses once per level (past a
    raised recursion limit, text nested a million deep would overflow the
    C stack), not a RecursionError either."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if _core.json_depth(data, MAX_JSON_DEPTH) >= MAX_JSON_DEPTH:
        raise ValueError(f"JSON nested {MAX_JSON_DEPTH} or more deep")
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deeply to parse") from None
