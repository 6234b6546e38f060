"""Device staging: tensor storages that live on a GPU are copied, in chunks,
on a dedicated CUDA stream with non-blocking copies through page-locked host
memory (a Rust mapping registered with ``cudaHostRegister``).

Writing (device to host): each chunk is copied straight into a buffer of
the engine's own arena (registered with CUDA once per engine), which the
write session lends (``WriteSession.take_buffer``) and then writes from
where it lies (``write_buffer``: the engine checksums it in place and puts
the rest of its first block in front of it), so no byte is copied again on
the CPU. While chunk k is being written (the session call releases the
GIL), chunk k+1 is already being copied into the next buffer; the writes
stay in flight across calls, so the disk never idles between chunks.
Without the arena (``FASTPERSIST_STAGE_INTO_ARENA=0``, an arena of fewer
than four buffers, or CUDA refusing to register it) chunks go through three
staging slots instead, each gathered into the arena by the session's write.

Reading (host to device): an engine reads a slot's worth of records into a
slot (O_DIRECT, CRC32 on the way), then a non-blocking host-to-device copy
empties it. Two engines on two worker threads read consecutive slots, so
two reads are always in flight while the third slot is being copied.

Staging memory (reads, and writes not into the arena) is ``3 * chunk``
bytes, whatever the model. It is made once per process (registering memory with CUDA is slow) and reused by every save
and load; :func:`release_staging` frees it.

The copy stream first waits on an event recorded on the caller's current
stream at the time of the call (:func:`record_ready`, on the caller's own
thread, also for saves that run in the background), so the file holds the
tensor values as of the call, and the caller's stream is never blocked.

Devices: every thread that works for a save or a read first makes a device
of that work its current device (:func:`use_device`), and per-device work
runs under ``torch.cuda.device(d)``, so no thread ever switches to a device
without a context (a fresh thread's current device is 0, where leaving a
``torch.cuda.stream`` block would otherwise make a context: 0.3-0.5 GiB per
rank under torchrun). Staging memory is registered (portable, so every
context sees it pinned) under a device of the call, and unregistered under
the same device, with the result checked. Copies run on one dedicated
non-blocking stream per device per process (:func:`copy_stream`), never on
one of torch's pooled streams, which NCCL or the caller may be using.

Nothing here runs, or initialises CUDA, unless a storage is on a CUDA device.
The copier is an interface so the pipeline's bookkeeping can be tested
without a GPU (``ThreadCopier``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from . import _core
from .options import EngineOptions, env_flag, env_int, read_with, use_engine
from .pickling import LocationScan, MapLocation, find_storages
from .plan import DATA_ALIGNMENT, Batch, DeviceRegion, MemoryGuard

__all__ = [
    "Staging",
    "CudaCopier",
    "ThreadCopier",
    "DEFAULT_CHUNK",
    "SLOTS",
    "stream_device_region",
    "stream_into_arena",
    "Stopped",
    "arena_pieces",
    "ArenaSlots",
    "arena_slots",
    "read_to_device",
    "HandedCopies",
    "read_handed",
    "wait_copies",
    "to_the_end",
    "record_ready",
    "cuda_devices",
    "active_devices",
    "side_streams",
    "release_staging",
    "DeviceContext",
    "staging_setup",
    "stage_chunk",
    "send",
    "read_staged",
    "device_for",
    "read_targets",
    "copy_stream",
    "use_device",
    "home_device",
    "device_scope",
]

log = logging.getLogger("fastpersist")

DEFAULT_CHUNK = 16 << 20
#: The largest ``FASTPERSIST_STAGE_CHUNK`` taken (three such chunks are pinned).
MAX_CHUNK = 1 << 30
SLOTS = 3

#: Events recorded on the caller's current stream of each device, by device.
ReadyEvents = Dict[str, Any]


def _bytes_view(storage: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


#: cudaHostRegisterPortable: pinned for every CUDA context, not only the
#: registering one (a staging buffer serves every device of the process).
_HOST_REGISTER_PORTABLE = 1

#: Registered mappings whose unregistration failed: never unmapped (CUDA may
#: still treat the range as pinned), kept until the process ends.
_leaked: List[Any] = []

#: Engines whose arena was offered to CUDA, by ``id``: whether it was
#: registered. An entry goes when its engine is freed (``Engine.at_close``).
_arenas: Dict[int, bool] = {}
_arenas_lock = threading.RLock()  # re-entrant: signal handlers


@contextlib.contextmanager
def device_scope(device: Optional[torch.device]) -> Iterator[None]:
    """``torch.cuda.device(device)`` for the block (nothing when ``device``
    is None): CUDA calls in it run with a device that has a context."""
    if device is None or device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


def home_device(devices: Iterable[torch.device] = ()) -> Optional[torch.device]:
    """On the caller's thread, at the call: the device a save's background
    threads work under: the caller's current device when it has a context
    (under torchrun, its ``local_rank``), else the first of ``devices`` that
    has one; None when CUDA was never initialised."""
    if not torch.cuda.is_initialized():
        return None
    has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    for i in [torch.cuda.current_device()] + [d.index for d in devices if d.type == "cuda"]:
        if i is not None and (has is None or has(i)):
            return torch.device("cuda", i)
    return None


def use_device(device: Optional[torch.device]) -> None:
    """Make ``device`` the calling thread's current CUDA device. For the
    background threads (head, write, snapshot), before their first CUDA
    call: a thread starts on device 0, and switching back to it (leaving a
    ``torch.cuda.stream`` block does) would make a context there."""
    if device is None or device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.current_device() != index:
        torch.cuda.set_device(index)


class Staging:
    """``SLOTS`` chunks of page-locked host memory from the Rust core,
    registered with CUDA under ``device`` (one with a context already)."""

    def __init__(self, chunk: int = DEFAULT_CHUNK, register_cuda: bool = True, device: Any = None) -> None:
        self.chunk = chunk
        buf = _core.HostBuffer(chunk * SLOTS)
        n = buf.nbytes
        raw = (ctypes.c_uint8 * n).from_address(buf.ptr)
        #: None once closed.
        self._buf: Optional[_core.HostBuffer] = buf
        self.tensor: Optional[torch.Tensor] = torch.frombuffer(raw, dtype=torch.uint8)
        self._registered = False
        self._device: Optional[torch.device] = None
        self._next = 0
        #: release_staging() generation it was handed out in.
        self.generation = -1
        if register_cuda:
            dev = torch.device(device) if device is not None else None
            with device_scope(dev):
                rc = torch.cuda.cudart().cudaHostRegister(buf.ptr, n, _HOST_REGISTER_PORTABLE)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of {n} bytes failed (error {int(rc)})")
            self._registered = True
            self._device = dev

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.nbytes

    def slot(self, i: int) -> Tuple[torch.Tensor, int]:
        """Slot ``i``: a uint8 tensor view and its address."""
        off = (i % SLOTS) * self.chunk
        if self.tensor is None or self._buf is None:
            raise RuntimeError("fastpersist: a staging buffer was used after it was closed")
        return self.tensor[off : off + self.chunk], self._buf.ptr + off

    def take(self) -> int:
        """The next chunk number. Numbering runs across storages, so a slot
        is reused only three chunks later (the session keeps no reference
        to a slot once its write call has returned)."""
        i = self._next
        self._next += 1
        return i

    def close(self) -> None:
        """Unregister (under the device it was registered under, whatever
        thread this runs on) and unmap. When CUDA refuses to unregister, the
        mapping is kept for the life of the process rather than unmapped
        while CUDA may still treat it as pinned."""
        buf = self._buf
        if self._registered and buf is not None:
            self._registered = False
            with device_scope(self._device):
                rc = int(torch.cuda.cudart().cudaHostUnregister(buf.ptr))
            if rc != 0:
                log.warning(
                    "fastpersist: cudaHostUnregister of %d bytes of staging memory failed (error %d); "
                    "the memory is kept, not freed",
                    buf.nbytes,
                    rc,
                )
                _leaked.append(buf)
        self.tensor = None
        self._buf = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


# One idle staging buffer per (chunk, registered), kept for the next call.
_idle: Dict[Tuple[int, bool], List[Staging]] = {}
_idle_lock = threading.RLock()  # re-entrant: signal handlers
# Bumped by release_staging(): buffers handed out before it are freed when
# their call ends instead of going back to the idle pool.
_generation = 0


# The parent's staging buffers, in a child made by os.fork(): their memory is
# not mapped there (MADV_DONTFORK), so they are never used nor freed.
_inherited: List[Staging] = []


def _after_fork_in_child() -> None:
    global _idle, _idle_lock, _inherited, _arenas, _arenas_lock
    _inherited = [st for free in _idle.values() for st in free]
    _idle = {}
    _idle_lock = threading.RLock()
    # The parent's engines are not used here (a child makes its own, whose
    # ids may be those of the parent's copies once those are freed).
    _arenas = {}
    _arenas_lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def acquire_staging(chunk: int, register_cuda: bool, device: Optional[torch.device] = None) -> Staging:
    """A staging buffer for one call: a kept one when idle, else a new one
    (registered under ``device``, a device of the call)."""
    with _idle_lock:
        gen = _generation
        free = _idle.get((chunk, register_cuda))
        st = free.pop() if free else None
    if st is None:
        st = Staging(chunk, register_cuda, device)
    st.generation = gen
    return st


def return_staging(st: Staging) -> None:
    """Keep ``st`` for the next call (one idle buffer per kind; extra ones,
    left by concurrent calls, and those handed out before the last
    :func:`release_staging`, are freed)."""
    key = (st.chunk, st._registered)
    with _idle_lock:
        free = _idle.setdefault(key, [])
        if not free and st.generation == _generation:
            free.append(st)
            return
    st.close()


def release_staging() -> int:
    """Free the idle staging buffers (unregistering them from CUDA); returns
    the bytes freed. Buffers in use by a call in flight are freed when it
    ends (not kept for reuse)."""
    global _generation
    with _idle_lock:
        _generation += 1
        bufs = [b for free in _idle.values() for b in free]
        _idle.clear()
    n = sum(b.nbytes for b in bufs)
    for b in bufs:
        b.close()
    return n


def staging_bytes() -> int:
    """Host memory held by idle staging buffers."""
    with _idle_lock:
        return sum(b.nbytes for free in _idle.values() for b in free)


def cuda_devices(obj: Any) -> List[torch.device]:
    """The CUDA devices of the tensors in ``obj``'s plain containers. Free
    (no walk, no CUDA call) when CUDA was never initialised: then no tensor
    can be on a GPU."""
    if not torch.cuda.is_initialized():
        return []
    return sorted({st.device for _, st in find_storages(obj).values() if st.device.type == "cuda"}, key=str)


def active_devices(obj: Any) -> List[torch.device]:
    """The devices whose streams a save of ``obj`` must be ordered after:
    those of its tensors found in plain containers, and every device this
    process has a CUDA context on (a tensor only the pickler finds, inside
    an object, may live there). Free when CUDA was never initialised."""
    devs = set(cuda_devices(obj))
    if devs or torch.cuda.is_initialized():
        has_ctx = getattr(torch._C, "_cuda_hasPrimaryContext", None)
        if has_ctx is not None:
            for i in range(torch.cuda.device_count()):
                if has_ctx(i):
                    devs.add(torch.device("cuda", i))
    return sorted(devs, key=str)


@contextlib.contextmanager
def side_streams(ready: ReadyEvents) -> Iterator[None]:
    """Make a fresh stream, ordered after ``ready``'s event, the current
    stream of each device in ``ready`` for the block: copies the block
    makes (``.cpu()``) see the values as of the call, and neither wait
    behind nor hold up the work the caller queued since."""
    with contextlib.ExitStack() as stack:
        for key, ev in ready.items():
            stream = copy_stream(torch.device(key))
            stream.wait_event(ev)
            stack.enter_context(torch.cuda.stream(stream))
        yield


_streams: Dict[int, Any] = {}
_streams_lock = threading.RLock()  # (reentrant: a signal handler's save)
#: CU_STREAM_NON_BLOCKING: no implicit ordering with the legacy default stream.
_CU_STREAM_NON_BLOCKING = 1


def copy_stream(device: torch.device) -> Any:
    """This process's copy stream on ``device``: made once, non-blocking,
    and its own (``torch.cuda.Stream()`` hands out one of 32 pooled streams
    per device, which NCCL or the caller may hold, so copies would queue
    behind their kernels). Made through the driver; where that is not
    possible (ROCm, no ``libcuda``), a pooled stream, with a warning."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        s = _streams.get(index)
        if s is None:
            ptr = _driver_stream(index)
            if ptr is None:
                log.warning(
                    "fastpersist: no dedicated copy stream on cuda:%d; copies use one of torch's pooled streams",
                    index,
                )
                s = torch.cuda.Stream(device=torch.device("cuda", index))
            else:
                s = torch.cuda.ExternalStream(ptr, device=torch.device("cuda", index))
            _streams[index] = s
    return s


def _driver_stream(index: int) -> Optional[int]:
    """A new non-blocking stream in device ``index``'s primary context (which
    the caller's tensors there have made), or None."""
    if getattr(torch.version, "hip", None):
        return None
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        dev = ctypes.c_int()
        ctx = ctypes.c_void_p()
        stream = ctypes.c_void_p()
        if cu.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(index)) != 0:
            return None
        if cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
            return None
        try:
            if cu.cuCtxPushCurrent_v2(ctx) != 0:
                return None
            try:
                if cu.cuStreamCreate(ctypes.byref(stream), ctypes.c_uint(_CU_STREAM_NON_BLOCKING)) != 0:
                    return None
            finally:
                cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        finally:
            # The runtime holds the context too (the tensors live in it).
            cu.cuDevicePrimaryCtxRelease_v2(dev)
        return stream.value
    except (OSError, AttributeError):
        return None


def record_ready(devices: Iterable[torch.device]) -> ReadyEvents:
    """On the calling thread: an event on each device's current stream, so
    copies made later, from any thread, see the values as of now."""
    out: ReadyEvents = {}
    for d in devices:
        ev = torch.cuda.Event(blocking=True)
        ev.record(torch.cuda.current_stream(d))
        out[str(d)] = ev
    return out


class CudaCopier:
    """Non-blocking copies between a device and staging memory on a stream
    of their own, ordered after the caller's stream (``ready``, recorded
    at the call; recorded now when not given)."""

    def __init__(self, device: torch.device, ready: Optional[Any] = None) -> None:
        self.device = device
        with device_scope(device):
            self.stream = copy_stream(device)
            if ready is None:
                ready = torch.cuda.Event(blocking=True)
                ready.record(torch.cuda.current_stream(device))
            self.stream.wait_event(ready)

    def copy(self, dst: torch.Tensor, storage: Any, start: int, end: int) -> Any:
        """Device to host: ``storage[start:end]`` into ``dst``."""
        with device_scope(self.device), torch.cuda.stream(self.stream):
            dst[: end - start].copy_(_bytes_view(storage)[start:end], non_blocking=True)
            # Blocking: the writer thread sleeps in synchronize() rather
            # than spinning on a core the training loop needs.
            ev = torch.cuda.Event(blocking=True)
            ev.record(self.stream)
        return ev

    def copy_in(self, storage: Any, start: int, src: torch.Tensor) -> Any:
        """Host to device: ``src`` into ``storage[start:start + len(src)]``."""
        with device_scope(self.device), torch.cuda.stream(self.stream):
            _bytes_view(storage)[start : start + src.numel()].copy_(src, non_blocking=True)
            ev = torch.cuda.Event(blocking=True)
            ev.record(self.stream)
        return ev

    def wait(self, handle: Any) -> None:
        handle.synchronize()

    def done(self, handle: Any) -> bool:
        """Whether the copy ``handle`` stands for has ended (no wait)."""
        return bool(handle.query())

    def drain(self) -> None:
        """Wait (sleeping, not spinning) for every copy queued so far."""
        with device_scope(self.device):
            ev = torch.cuda.Event(blocking=True)
            ev.record(self.stream)
        ev.synchronize()

    def hand_over(self) -> None:
        """After host-to-device copies: the caller's current stream waits
        for them, and the copy stream's work is complete (the storages were
        allocated on the caller's stream, so their memory is the caller's)."""
        with device_scope(self.device):
            ev = torch.cuda.Event(blocking=True)
            ev.record(self.stream)
            torch.cuda.current_stream(self.device).wait_event(ev)
        ev.synchronize()


class ThreadCopier:
    """Stand-in for tests: copies host memory on a worker thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1)

    def copy(self, dst: torch.Tensor, storage: Any, start: int, end: int) -> Future:
        src = _bytes_view(storage)[start:end]
        return self._pool.submit(lambda: dst[: end - start].copy_(src))

    def copy_in(self, storage: Any, start: int, src: torch.Tensor) -> Future:
        dst = _bytes_view(storage)[start : start + src.numel()]
        return self._pool.submit(lambda: dst.copy_(src))

    def wait(self, handle: Future) -> None:
        handle.result()

    def done(self, handle: Future) -> bool:
        return handle.done()

    def hand_over(self) -> None:
        self._pool.submit(lambda: None).result()

    def drain(self) -> None:
        """Wait for every copy submitted so far (one worker: in order)."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def chunk_record(file_off: int, n: int, chunk: int) -> List[Tuple[int, int, int]]:
    """How a record of ``n`` bytes at ``file_off`` goes through staging slots
    of ``chunk`` bytes (whole pages): ``(at, a, b)`` for each chunk, its
    bytes ``a:b`` of the record, placed at ``at`` in its slot, where its file
    offset falls within a page (so memory and file agree on which bytes
    share a block). A record that fits its slot is one chunk. A larger one
    that does not start on a page starts with the bytes up to the next page
    boundary (less than a page, written with the record's header from the
    engine's arena); every later chunk starts on a page, in the file and in
    its slot, and the engine writes the slots' whole blocks from where they
    lie, whatever the record's alignment."""
    out: List[Tuple[int, int, int]] = []
    a = 0
    while a < n:
        at = (file_off + a) % DATA_ALIGNMENT
        b = n if n - a <= chunk - at else a + (DATA_ALIGNMENT - at if at else chunk)
        out.append((at, a, b))
        a = b
    return out


def stream_device_region(write: Any, region: DeviceRegion, staging: Staging, copier: Any) -> None:
    """Write one device storage (file offset, storage, length, checksum id)
    through the staging slots: ``write(regions)`` is the session's write."""
    file_off, storage, n, crc_id = region
    chunks = [(staging.take(), at, a, b) for at, a, b in chunk_record(file_off, n, staging.chunk)]
    pending: Optional[Any] = None
    try:
        for j, (k, at, a, b) in enumerate(chunks):
            if j == 0:
                pending = copier.copy(staging.slot(k)[0][at:], storage, a, b)
            copier.wait(pending)
            pending = None
            if j + 1 < len(chunks):
                # Chunk k+1's slot last held chunk k-2, which the write of
                # chunk k-1 consumed: it is free, and the copy overlaps this
                # write.
                nk, nat, na, nb = chunks[j + 1]
                pending = copier.copy(staging.slot(nk)[0][nat:], storage, na, nb)
            write([(file_off + a, staging.slot(k)[1] + at, b - a, crc_id)])
    finally:
        # Even when the write failed: no copy may still be filling a slot
        # that the next call will reuse.
        if pending is not None:
            copier.wait(pending)


def stage_into_arena() -> bool:
    """Whether device storages are copied straight into the engine's arena
    (``FASTPERSIST_STAGE_INTO_ARENA``, default on) rather than through the
    staging slots."""
    return env_flag("FASTPERSIST_STAGE_INTO_ARENA", True)


#: Arena buffers an engine needs for copies straight into it: two lent (one
#: being written while the next is filled) plus the two it keeps.
MIN_ARENA_BUFFERS = 4


class ArenaSlots:
    """An engine's arena as the destination of device-to-host copies: a
    uint8 tensor over the whole mapping, cut into ``size``-byte buffers
    that a write session lends one at a time."""

    def __init__(self, engine: _core.Engine) -> None:
        n = engine.arena_bytes
        raw = (ctypes.c_uint8 * n).from_address(engine.arena_ptr)
        self.tensor = torch.frombuffer(raw, dtype=torch.uint8)
        self.size: int = engine.block_size
        self.base: int = engine.arena_ptr

    def take(self, session: Any) -> Tuple[int, torch.Tensor]:
        """A buffer the session lends: its index and a tensor over it."""
        k, addr = session.take_buffer()
        off = addr - self.base
        return k, self.tensor[off : off + self.size]


def _register_arena(engine: _core.Engine, device: Optional[torch.device]) -> bool:
    """Register ``engine``'s arena with CUDA (portable, under ``device``)
    and have it unregistered when the engine is freed, before the arena is
    unmapped. False (and a debug log) when CUDA refuses."""
    key = id(engine)
    ptr, n = engine.arena_ptr, engine.arena_bytes
    with device_scope(device):
        rc = int(torch.cuda.cudart().cudaHostRegister(ptr, n, _HOST_REGISTER_PORTABLE))
    ok = rc == 0
    if not ok:
        log.debug("fastpersist: cudaHostRegister of a %d-byte arena failed (error %d): staging slots instead", n, rc)

    def closed() -> None:
        try:
            with _arenas_lock:
                _arenas.pop(key, None)
            if not ok:
                return
            with device_scope(device):
                rc = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        except Exception:  # noqa: BLE001 - interpreter shutdown: the process's end frees it
            return
        if rc != 0:
            log.warning("fastpersist: cudaHostUnregister of a %d-byte engine arena failed (error %d)", n, rc)

    engine.at_close(closed)
    return ok


def arena_slots(engine: _core.Engine, test_on_cpu: bool, device: Optional[torch.device]) -> Optional[ArenaSlots]:
    """The arena of ``engine`` as the destination of this call's copies
    (registered with CUDA under ``device`` on first use), or None: staging
    slots instead (turned off, too few buffers, CUDA refused it)."""
    if not stage_into_arena() or engine.arena_bytes // engine.block_size < MIN_ARENA_BUFFERS:
        return None
    if not test_on_cpu:
        with _arenas_lock:
            ok = _arenas.get(id(engine))
            if ok is None:
                ok = _arenas[id(engine)] = _register_arena(engine, device)
        if not ok:
            return None
    return ArenaSlots(engine)


def arena_pieces(file_off: int, n: int, size: int, block: int) -> List[Tuple[int, int, int]]:
    """How a record of ``n`` bytes at ``file_off`` goes through arena
    buffers of ``size`` bytes for a file of ``block``-byte blocks: ``(at,
    a, b)`` for each buffer, its bytes ``a:b`` of the record, placed at
    ``at``, where their file offset falls in its block (the engine puts the
    rest of that block in front). Only the first piece can start inside a
    block; every buffer is filled to its end but the last."""
    out: List[Tuple[int, int, int]] = []
    a = 0
    while a < n:
        at = (file_off + a) % block
        b = min(n, a + size - at)
        out.append((at, a, b))
        a = b
    return out


class Stopped(RuntimeError):
    """A device write found its call given up (:meth:`DeviceContext.quiesce`)."""


def stream_into_arena(
    session: Any, region: DeviceRegion, arena: ArenaSlots, copier: Any, stop: Optional[threading.Event] = None
) -> None:
    """Write one device storage (file offset, storage, length, checksum id)
    by copying it straight into arena buffers the session lends; the copy
    into buffer k+1 runs while buffer k is written. Once ``stop`` is set no
    further copy is begun (:class:`Stopped`)."""
    file_off, storage, n, crc_id = region
    pieces = arena_pieces(file_off, n, arena.size, session.block)
    taken: List[int] = []  # buffers lent and not yet handed back
    pending: Optional[Any] = None

    def fill(j: int) -> Any:
        if stop is not None and stop.is_set():
            raise Stopped("the save was given up")
        at, a, b = pieces[j]
        k, dst = arena.take(session)
        taken.append(k)
        return copier.copy(dst[at:], storage, a, b)

    try:
        for j, (_, a, b) in enumerate(pieces):
            if j == 0:
                pending = fill(0)
            copier.wait(pending)
            pending = None
            if j + 1 < len(pieces):
                pending = fill(j + 1)  # overlaps this buffer's write
            # The engine's once handed over, whatever the write's outcome.
            session.write_buffer(taken.pop(0), file_off + a, b - a, crc_id)
    finally:
        # No copy may still be filling a buffer that goes back to the engine.
        if pending is not None:
            copier.wait(pending)
        for k in taken:
            session.give_back(k)


#: A record read to a device: (file offset, device storage, bytes).
DeviceRead = Tuple[int, Any, int]


def pack_pieces(records: Sequence[Tuple[int, int]], chunk: int) -> List[List[Tuple[int, int, int, int]]]:
    """Cut records (file offset, bytes) into slot loads: each load is a list
    of pieces (record index, start within the record, length, offset in the
    slot) whose lengths add up to at most ``chunk``. Records are cut only
    where they cross a load's end, so small records share a load."""
    loads: List[List[Tuple[int, int, int, int]]] = []
    cur: List[Tuple[int, int, int, int]] = []
    used = 0
    for i, (_, n) in enumerate(records):
        a = 0
        while a < n:
            take = min(n - a, chunk - used)
            cur.append((i, a, take, used))
            used += take
            a += take
            if used == chunk:
                loads.append(cur)
                cur, used = [], 0
    if cur:
        loads.append(cur)
    return loads


Read = Callable[[List[Tuple[int, int, int]]], List[int]]


def to_the_end(steps: Iterable[Callable[[], None]], on_error: Callable[[BaseException], None]) -> None:
    """Run each step to its end, whatever Ctrl-C does meanwhile (a step
    interrupted runs again; the interrupt is raised once all have run) and
    whatever another step raised (``on_error`` gets each such error)."""
    interrupted: Optional[BaseException] = None
    for step in steps:
        while True:
            try:
                step()
                break
            except KeyboardInterrupt as e:  # run it again
                interrupted = e
            except BaseException as e:  # noqa: BLE001 - handed to on_error; the other steps still run
                on_error(e)
                break
    if interrupted is not None:
        raise interrupted


def wait_copies(copies: Iterable[Tuple[Any, Any]], drain: Iterable[Any] = ()) -> None:
    """Wait for each copy (copier, handle) to end, then for everything the
    copiers ``drain`` were given, whatever Ctrl-C or a failed copy does
    meanwhile (then the interrupt, else the first error, is raised): a
    copy left running after its call gave up would write device memory the
    caching allocator hands to the next tensor."""
    errors: List[BaseException] = []
    steps: List[Callable[[], None]] = [functools.partial(c.wait, h) for c, h in copies]
    steps += [c.drain for c in drain]
    to_the_end(steps, errors.append)
    if errors:
        raise errors[0]


def _quiesce(
    reading: Dict[int, Tuple[int, Future]],
    pool: Optional[ThreadPoolExecutor],
    in_flight: Dict[int, List[Tuple[Any, Any]]],
) -> None:
    """Even on an error: no read may still be filling, and no copy still
    emptying, a slot that the next call will reuse."""
    for _, done in reading.values():
        try:
            done.result()
        except BaseException:  # noqa: BLE001 - the first error is already on its way
            pass
    if pool is not None:
        pool.shutdown(wait=True)
    wait_copies(c for copies in in_flight.values() for c in copies)


def read_to_device(
    reads: Union[Read, Sequence[Read]],
    items: Sequence[DeviceRead],
    staging: Staging,
    copier_for: Callable[[torch.device], Any],
) -> List[int]:
    """Fill device storages from the file through the staging slots.
    ``reads`` are the engines' reads of (file offset, address, bytes)
    requests, each returning its requests' CRC32s; with two or more, slot
    loads are read by them in turn on worker threads, two at a time, so
    the device is never idle between loads. Returns each record's CRC32.

    With two readers, loads k and k+1 are read while the copies out of
    slot k-1 run; before a slot is read again, the copies that last
    emptied it are waited for. With one, the loads are read in turn."""
    readers: List[Read] = [reads] if callable(reads) else list(reads)
    if not readers:
        raise ValueError("read_to_device needs at least one reader")
    ahead = 2 if len(readers) > 1 else 1  # loads being read at once
    loads = pack_pieces([(off, n) for off, _, n in items], staging.chunk)
    crcs = [0] * len(items)
    in_flight: Dict[int, List[Tuple[Any, Any]]] = {}  # slot -> its copies (copier, handle)
    copiers: Dict[int, Any] = {}
    reading: Dict[int, Tuple[int, Future]] = {}  # load -> (chunk number, its read)
    pool = ThreadPoolExecutor(ahead, thread_name_prefix="fastpersist-read") if ahead > 1 else None

    def start(j: int) -> None:
        k = staging.take()
        for c, h in in_flight.pop(k % SLOTS, []):
            c.wait(h)
        base = staging.slot(k)[1]
        reqs = [(items[i][0] + a, base + so, n) for i, a, n, so in loads[j]]
        read = readers[j % len(readers)]
        if pool is None:
            done: Future = Future()
            done.set_result(read(reqs))
        else:
            done = pool.submit(read, reqs)
        reading[j] = (k, done)

    try:
        for j in range(min(ahead, len(loads))):
            start(j)
        for j, load in enumerate(loads):
            k, done = reading.pop(j)
            got = done.result()
            view = staging.slot(k)[0]
            copies = in_flight[k % SLOTS] = []
            for (i, a, n, so), crc in zip(load, got):
                crcs[i] = crc if a == 0 else _core.crc32_combine(crcs[i], crc, n)
                storage = items[i][1]
                c = copier_for(storage.device)
                copiers[id(c)] = c
                copies.append((c, c.copy_in(storage, a, view[so : so + n])))
            if j + ahead < len(loads):
                start(j + ahead)
    except BaseException:
        # The read's own error is the one raised (a copy's on the way is logged).
        try:
            _quiesce(reading, pool, in_flight)
        except Exception as e:  # noqa: BLE001 - the read's error propagates
            log.debug("fastpersist: a copy failed as a read to the device gave up: %s", e)
        raise
    _quiesce(reading, pool, in_flight)
    for c in copiers.values():
        c.hand_over()
    return crcs


class DeviceContext:
    """Staging memory and one copier per device, for one call. Copy streams
    wait on ``ready`` (events recorded at the call) where given."""

    def __init__(
        self,
        devices: List[torch.device],
        test_on_cpu: bool = False,
        chunk: int = DEFAULT_CHUNK,
        ready: Optional[ReadyEvents] = None,
    ) -> None:
        self.test_on_cpu = test_on_cpu
        self.ready = ready or {}
        cuda = [d for d in devices if d.type == "cuda"]
        #: The device this call's own threads work under (None: no CUDA
        #: device); the caller's thread is left on its device.
        self.home: Optional[torch.device] = None if test_on_cpu or not cuda else cuda[0]
        self.chunk = chunk
        #: Staging slots, made on first use (``live_staging``); None until
        #: then and once closed.
        self.staging: Optional[Staging] = None
        self._closed = False
        #: The engine's arena, when copies go straight into it (``bind``).
        self.arena: Optional[ArenaSlots] = None
        #: Set once the call is given up: no further copy into the arena.
        self.stop = threading.Event()
        self.copiers: Dict[str, Any] = {}
        for d in devices:
            self.copier(d)

    def use(self) -> None:
        """Make this call's device the current device of the calling thread
        (each thread that stages for the call, before its first CUDA call)."""
        use_device(self.home)

    def live_staging(self) -> Staging:
        """The call's staging buffer, made (or taken from the idle ones) on
        first use; an error once the context is closed."""
        if self._closed:
            raise RuntimeError("fastpersist: a device context was used after it was closed")
        if self.staging is None:
            self.staging = acquire_staging(self.chunk, not self.test_on_cpu, self.home)
        return self.staging

    def bind(self, engine: _core.Engine) -> None:
        """Copy device storages straight into ``engine``'s arena, where it
        can be (see :func:`arena_slots`), for the writes of this call; else
        take the staging slots now (before the save's work begins)."""
        self.arena = arena_slots(engine, self.test_on_cpu, self.home)
        if self.arena is None:
            self.live_staging()

    def copier(self, device: torch.device) -> Any:
        key = str(device)
        c = self.copiers.get(key)
        if c is None:
            c = self.copiers[key] = ThreadCopier() if self.test_on_cpu else CudaCopier(device, self.ready.get(key))
        return c

    def quiesce(self) -> None:
        """The call is given up: begin no further copy into the arena, and
        wait until none is in flight (before its session gives the arena
        buffers it lent back to the engine, where the next save takes them:
        a copy landing late would overwrite that save's bytes after their
        checksum was taken)."""
        self.stop.set()
        for c in list(self.copiers.values()):
            c.drain()

    def close(self) -> None:
        for c in self.copiers.values():
            if isinstance(c, ThreadCopier):
                c.close()
            else:
                # Nothing may still be copying into the staging slots when
                # they are handed to the next call.
                c.drain()
        self.copiers.clear()
        self._closed = True
        self.arena = None
        st, self.staging = self.staging, None
        if st is not None:
            return_staging(st)


# ---------------------------------------------------------------------------
# Entry points for the writers and readers


def send(
    session: Any,
    batch: Batch,
    ctx: Optional[DeviceContext],
    file_len: Optional[int] = None,
    on_gathered: Optional[Callable[[], None]] = None,
    guard: Optional[MemoryGuard] = None,
) -> Any:
    """Hand a batch to the session in file order, streaming its device
    storages through the staging slots; with ``file_len``, finish the file.

    With ``guard``, the engine reads caller memory only while holding the
    GIL, right after the guard said its storage is as planned (no Python
    thread can resize it in between); device storages are checked before
    they are staged."""
    g = guard if guard else None
    rest = batch
    for region in sorted(batch.device, key=lambda r: r.offset):
        assert ctx is not None
        before, rest = rest.split_at(region.offset)
        if before.blobs or before.regions or before.slots:
            session.write(before.blobs, before.regions, before.slots, g)
        if g is not None:
            g.check([region.crc_id])
        copier = ctx.copier(region.storage.device)
        if ctx.arena is not None:
            stream_into_arena(session, region, ctx.arena, copier, ctx.stop)
        else:
            # Gathered, not lent: a lent write ends with its call, so the
            # disk would drain after every chunk; the arena's writes stay in
            # flight.
            stream_device_region(
                lambda regs: session.write([], regs, [], lend=False),
                region,
                ctx.live_staging(),
                copier,
            )
        _, rest = rest.split_at(region.offset + region.length)
        rest.device = []
    if file_len is None:
        session.write(rest.blobs, rest.regions, rest.slots, g)
        return None
    return session.finish(rest.blobs, rest.regions, rest.slots, file_len, on_gathered, g)


def stage_chunk() -> int:
    """Bytes per device-to-host copy (``FASTPERSIST_STAGE_CHUNK``, default
    16 MiB, a multiple of 4096 of at most 1 GiB; ``32MiB`` spelled so
    too); three chunks of staging memory are used."""
    n = env_int("FASTPERSIST_STAGE_CHUNK", DEFAULT_CHUNK, size=True)
    if n <= 0 or n % 4096 or n > MAX_CHUNK:
        raise ValueError(f"FASTPERSIST_STAGE_CHUNK={n} must be a positive multiple of 4096 of at most 1 GiB")
    return n


def staging_setup() -> Tuple[Any, str]:
    """The staging predicate and a lazily made device context. The test
    hook ``FASTPERSIST_TEST_STAGE_CPU=1`` stages CPU storages through the
    same path (with a thread standing in for the copy engine)."""
    test_cpu = env_flag("FASTPERSIST_TEST_STAGE_CPU", False)
    if test_cpu:
        return (lambda st: st.nbytes() > 0), "cpu"
    return None, "cuda"


class HandedCopies:
    """The consumer of a read handed over in the arena
    (``Engine.read_handed``): each completed buffer's pieces are copied
    from where they lie to their storages (host-to-device), and the buffer
    is released once those copies have ended."""

    def __init__(self, arena: ArenaSlots, items: Sequence[DeviceRead], copier_for: Callable[[torch.device], Any]):
        self.arena = arena
        self.items = items
        self.copier_for = copier_for
        #: Buffers held, oldest first: their copies (copier, handle).
        self.held: Dict[int, List[Tuple[Any, Any]]] = {}
        self.copiers: Dict[int, Any] = {}

    def filled(self, buf: int, addr: int, n: int, pieces: List[Tuple[int, int, int, int]]) -> None:
        off = addr - self.arena.base
        view = self.arena.tensor[off : off + n]
        # Held before the first copy is begun: whatever raises part-way,
        # every copy begun is waited for before the buffer is read into.
        copies = self.held[buf] = []
        for i, start, length, at in pieces:
            storage = self.items[i][1]
            c = self.copier_for(storage.device)
            self.copiers[id(c)] = c
            copies.append((c, c.copy_in(storage, start, view[at : at + length])))

    def released(self, wait: bool) -> List[int]:
        """The buffers whose copies have all ended (with ``wait``: the
        oldest, once they have). A copy that failed raises here, as it
        would have on a wait."""
        out = [b for b, copies in self.held.items() if all(c.done(h) for c, h in copies)]
        if not out and wait and self.held:
            out = [next(iter(self.held))]
        for b in out:
            for c, h in self.held[b]:
                c.wait(h)  # at once where done; raises the copy's error
            del self.held[b]
        return out

    def quiesce(self) -> None:
        """Wait for every copy out of a buffer still held, and for anything
        else the copiers were given (a copy begun whose handle an interrupt
        lost), whatever Ctrl-C or a failed copy does meanwhile: after a
        read that failed, before the engine, and the storages' memory, go
        to anyone else. Raises the first copy's error, once all ended."""
        try:
            wait_copies([c for copies in self.held.values() for c in copies], list(self.copiers.values()))
        finally:
            self.held.clear()


def read_handed(
    eng: _core.Engine, fd: int, items: Sequence[DeviceRead], arena: ArenaSlots, copier_for: Any
) -> List[int]:
    """Read records (file offset, storage, bytes) of ``fd`` with ``eng``
    (held by the caller) straight out of its arena into the storages: the
    reads stay ``queue_depth`` deep and no byte is copied on the CPU.
    Returns each record's CRC32; the copies are handed over to the caller's
    streams (see :meth:`CudaCopier.hand_over`)."""
    consumer = HandedCopies(arena, items, copier_for)
    try:
        crcs = list(eng.read_handed(fd, [(off, n) for off, _, n in items], consumer)["crcs"])
    except BaseException:
        # Even on Ctrl-C: no copy may still read a buffer the engine reuses
        # or write a storage freed as this error leaves. The read's own
        # error is the one raised (a copy's error on the way is logged).
        try:
            consumer.quiesce()
        except Exception as e:  # noqa: BLE001 - the read's error propagates
            log.debug("fastpersist: a copy failed as a read to the device gave up: %s", e)
        raise
    for c in consumer.copiers.values():
        c.hand_over()
    return crcs


def read_staged(fd: int, items: List[DeviceRead], opts: EngineOptions) -> List[int]:
    """Read records (file offset, device storage, bytes) of the open file
    ``fd`` into device storages: out of the engine's arena where it can be
    registered with CUDA (:func:`read_handed`), else through the staging
    slots; returns their CRC32s."""
    _, kind = staging_setup()
    # Staging is registered under a target device (which has a context).
    devices = sorted({st.device for _, st, _ in items}, key=str)
    ctx = DeviceContext(devices, test_on_cpu=kind == "cpu", chunk=stage_chunk())

    def reader(index: int) -> Callable[[List[Tuple[int, int, int]]], List[int]]:
        def read(reqs: List[Tuple[int, int, int]]) -> List[int]:
            with use_engine(opts, index) as eng:
                return read_with(eng, fd, reqs)

        return read

    try:
        with use_engine(opts) as eng:
            arena = arena_slots(eng, ctx.test_on_cpu, ctx.home)
            if arena is not None:
                try:
                    return read_handed(eng, fd, items, arena, ctx.copier)
                except BaseException:
                    # Before the engine goes to anyone else, also where an
                    # interrupt cut read_handed's own wait short.
                    to_the_end([c.drain for c in ctx.copiers.values()], lambda e: None)
                    raise
        # Two engines, so slot k+1 is being read while slot k's read ends:
        # the device never waits between slots.
        return read_to_device([reader(0), reader(1)], items, ctx.live_staging(), ctx.copier)
    finally:
        ctx.close()


def device_for(map_location: MapLocation, location: str) -> Optional[torch.device]:
    """Where torch's restore would put a storage saved at ``location``, when
    that is a CUDA device this read can place it on directly (else None:
    read to host memory, then torch's restore moves it)."""
    if map_location is None:
        where = location
    elif isinstance(map_location, (str, torch.device)):
        where = str(map_location)
    elif isinstance(map_location, dict):
        where = map_location.get(location, location)
    else:
        return None
    if not isinstance(where, str) or not where.startswith("cuda"):
        return None
    try:
        dev = torch.device(where)
    except (RuntimeError, ValueError):
        return None
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None  # torch's restore raises its own error
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        return None
    return torch.device("cuda", index)


def read_targets(pkl: bytes, map_location: MapLocation, keys: List[str]) -> Dict[str, torch.device]:
    """The storages (by key) to read straight to a CUDA device, and where."""
    _, kind = staging_setup()
    if kind == "cpu":  # test hook: every storage through the staging path
        return {k: torch.device("cpu") for k in keys}
    if callable(map_location) or not keys:
        return {}
    if isinstance(map_location, (str, torch.device)):
        dev = device_for(map_location, "cpu")
        return {k: dev for k in keys} if dev is not None else {}
    if b"cuda" not in pkl and not (
        isinstance(map_location, dict) and any("cuda" in str(v) for v in map_location.values())
    ):
        return {}
    scan = LocationScan(pkl)
    try:
        scan.load()
    except Exception:  # noqa: BLE001 - the real unpickling reports damage
        return {}
    out: Dict[str, torch.device] = {}
    for k, loc in scan.locations.items():
        dev = device_for(map_location, loc)
        if dev is not None:
            out[k] = dev
    return out
