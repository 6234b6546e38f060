"""``write_state_dict``: the torch.save replacement, and the engine cache.

Engines (staging arena + io_uring ring) are expensive to make and cheap to
reuse, so one per distinct option set is kept per process. Environment
variables set the defaults (a parameter wins over them):

``FASTPERSIST_DIRECT=0``       never use O_DIRECT (buffered writes)
``FASTPERSIST_IO_URING=0``     never use io_uring (pwrite thread pool)
``FASTPERSIST_ARENA_BYTES``    staging memory, bytes (default 32 MiB)
``FASTPERSIST_BLOCK_SIZE``     bytes per write (default 1 MiB)
``FASTPERSIST_QUEUE_DEPTH``    writes in flight (default 32)
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from . import _core
from .errors import FallbackWarning
from .serialization import TorchZipLayout

__all__ = ["WriteStats", "write_state_dict", "get_engine", "EngineOptions"]

PathLike = Union[str, "os.PathLike[str]"]

DEFAULT_BLOCK_SIZE = 1 << 20
DEFAULT_ARENA_BYTES = 32 << 20
DEFAULT_QUEUE_DEPTH = 32


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

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10**9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v, 0)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an integer") from None


def _env_flag(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    return v.strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class EngineOptions:
    block_size: int
    arena_bytes: int
    queue_depth: int
    direct: bool
    io_uring: bool
    durable: bool

    @classmethod
    def resolve(
        cls,
        block_size: Optional[int] = None,
        arena_bytes: Optional[int] = None,
        queue_depth: Optional[int] = None,
        direct: Optional[bool] = None,
        io_uring: Optional[bool] = None,
        durable: bool = True,
    ) -> "EngineOptions":
        return cls(
            block_size=block_size if block_size is not None
            else _env_int("FASTPERSIST_BLOCK_SIZE", DEFAULT_BLOCK_SIZE),
            arena_bytes=arena_bytes if arena_bytes is not None
            else _env_int("FASTPERSIST_ARENA_BYTES", DEFAULT_ARENA_BYTES),
            queue_depth=queue_depth if queue_depth is not None
            else _env_int("FASTPERSIST_QUEUE_DEPTH", DEFAULT_QUEUE_DEPTH),
            direct=direct if direct is not None else _env_flag("FASTPERSIST_DIRECT", True),
            io_uring=io_uring if io_uring is not None else _env_flag("FASTPERSIST_IO_URING", True),
            durable=bool(durable),
        )


_engines: Dict[Tuple[EngineOptions, int], Tuple[threading.Lock, _core.Engine]] = {}
_engines_lock = threading.Lock()
_warned: set = set()


def get_engine(opts: EngineOptions, index: int = 0) -> Tuple[threading.Lock, _core.Engine]:
    """The process-wide engine for these options (made on first use).
    ``index`` > 0 gives further engines, for work that keeps two files'
    I/O in flight at once (the staged read to a GPU uses two)."""
    with _engines_lock:
        hit = _engines.get((opts, index))
        if hit is None:
            eng = _core.Engine(
                block_size=opts.block_size,
                arena_bytes=opts.arena_bytes,
                queue_depth=opts.queue_depth,
                direct=opts.direct,
                io_uring=opts.io_uring,
                durable=opts.durable,
            )
            hit = (threading.Lock(), eng)
            _engines[(opts, index)] = hit
        return hit


def release_engines() -> None:
    """Free every cached engine (their staging memory and rings)."""
    with _engines_lock:
        _engines.clear()


def _warn_once(reason: Optional[str], asked: bool) -> None:
    if not reason or not asked or reason in _warned:
        return
    _warned.add(reason)
    warnings.warn(f"fastpersist: {reason}; using a slower fallback", FallbackWarning, stacklevel=4)


def _check_path(path: Any) -> str:
    if hasattr(path, "write") or not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(
            f"fastpersist writes to a file path (str or os.PathLike), not {type(path).__name__}"
        )
    p = os.fsdecode(os.fspath(path))
    if p == "":
        raise ValueError("empty path")
    return p


def _stats(raw: Dict[str, Any], path: str, storage_bytes: int, keys: List[str],
           plan_seconds: float, seconds: float) -> WriteStats:
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
    )


def _send(session: Any, batch: Any, ctx: Any, file_len: Optional[int] = None,
          on_gathered: Optional[Any] = None) -> Any:
    """Hand a batch to the session in file order, streaming its device
    storages through the staging slots; with ``file_len``, finish the file."""
    from .cuda_staging import stream_device_region

    rest = batch
    for region in sorted(batch.device, key=lambda r: r[0]):
        before, rest = rest.split_at(region[0])
        if before.blobs or before.regions or before.slots:
            session.write(before.blobs, before.regions, before.slots)
        stream_device_region(lambda regs: session.write([], regs, []), region, ctx.staging,
                             ctx.copier(region[1].device))
        _, rest = rest.split_at(region[0] + region[2])
        rest.device = []
    if file_len is None:
        session.write(rest.blobs, rest.regions, rest.slots)
        return None
    return session.finish(rest.blobs, rest.regions, rest.slots, file_len, on_gathered)


def _stage_chunk() -> int:
    """Bytes per device-to-host copy (``FASTPERSIST_STAGE_CHUNK``, default
    16 MiB, a multiple of 4096); three chunks of staging memory are used."""
    from .cuda_staging import DEFAULT_CHUNK

    n = _env_int("FASTPERSIST_STAGE_CHUNK", DEFAULT_CHUNK)
    if n <= 0 or n % 4096:
        raise ValueError(f"FASTPERSIST_STAGE_CHUNK={n} must be a positive multiple of 4096")
    return n


def _staging_setup() -> Tuple[Any, str]:
    """The staging predicate and a lazily made device context. The test
    hook ``FASTPERSIST_TEST_STAGE_CPU=1`` stages CPU storages through the
    same path (with a thread standing in for the copy engine)."""
    test_cpu = _env_flag("FASTPERSIST_TEST_STAGE_CPU", False)
    if test_cpu:
        return (lambda st: st.nbytes() > 0), "cpu"
    return None, "cuda"


def _write_torch_zip(obj: Any, path: str, opts: EngineOptions,
                     on_gathered: Optional[Any] = None, ready: Optional[Dict[str, Any]] = None) -> WriteStats:
    """The storages found up front are written by a second thread (the
    engine releases the GIL) while this one pickles; the rest follows.
    Storages on a CUDA device are staged chunk by chunk (cuda_staging); the
    copies wait on ``ready`` (events recorded on the caller's streams at the
    call, by device) or, without it, on the current streams now.
    ``on_gathered()`` is called once no tensor memory will be read again."""
    t0 = time.perf_counter()
    stage, kind = _staging_setup()
    layout = TorchZipLayout(obj, stage=stage)
    head = layout.head()
    ctx = None
    if head.device:
        from .cuda_staging import DeviceContext

        # Made here, at the call: the copy streams wait on the caller's streams now.
        ctx = DeviceContext(sorted({r[1].device for r in head.device}, key=str), test_on_cpu=kind == "cpu",
                            chunk=_stage_chunk(), ready=ready)
    try:
        lock, eng = get_engine(opts)
        with lock:
            session = eng.begin(path, head.end)
            try:
                failure: List[BaseException] = []
                writer = None
                if head.regions or head.blobs or head.device:
                    def write_head() -> None:
                        try:
                            _send(session, head, ctx)
                        except BaseException as e:  # noqa: BLE001 - handed to the caller
                            failure.append(e)

                    writer = threading.Thread(target=write_head, name="fastpersist-head", daemon=True)
                    writer.start()
                try:
                    tp = time.perf_counter()
                    tail = layout.tail()
                    plan_seconds = time.perf_counter() - tp
                finally:
                    if writer is not None:
                        writer.join()
                if failure:
                    raise failure[0]
                if tail.device and ctx is None:
                    from .cuda_staging import DeviceContext

                    ctx = DeviceContext([], test_on_cpu=kind == "cpu", chunk=_stage_chunk(), ready=ready)
                raw = _send(session, tail, ctx, layout.file_len, on_gathered)
            except BaseException:
                session.abort()
                raise
            finally:
                del layout.keepalive[:]
    finally:
        # Also when the engine or the file could not be made.
        if ctx is not None:
            ctx.close()
    _warn_once(raw["direct_note"], opts.direct)
    _warn_once(raw["uring_note"], opts.io_uring)
    return _stats(raw, path, layout.storage_bytes, layout.storage_keys, plan_seconds,
                  time.perf_counter() - t0)


def write_plan(plan: Any, path: str, opts: EngineOptions, plan_seconds: float = 0.0,
               t0: Optional[float] = None) -> WriteStats:
    """Write a whole :class:`~fastpersist.serialization.Plan` and commit it."""
    t0 = time.perf_counter() if t0 is None else t0
    lock, eng = get_engine(opts)
    with lock:
        raw = eng.write_file(path, plan.blobs, plan.regions, plan.slots, plan.file_len)
    _warn_once(raw["direct_note"], opts.direct)
    _warn_once(raw["uring_note"], opts.io_uring)
    return _stats(raw, path, plan.storage_bytes, plan.storage_keys, plan_seconds,
                  time.perf_counter() - t0)


def _write_safetensors(obj: Any, path: str, opts: EngineOptions,
                       metadata: Optional[Dict[str, str]]) -> WriteStats:
    from .safetensors_format import plan_safetensors

    t0 = time.perf_counter()
    plan = plan_safetensors(obj, metadata)
    return write_plan(plan, path, opts, time.perf_counter() - t0, t0)


FORMATS = ("torch", "safetensors")


def _write_distributed(obj: Any, path: str, opts: EngineOptions, group: Any, sharded: bool,
                       format: str) -> WriteStats:
    from . import distributed

    if group is None:
        raise ValueError("sharded=True needs group= (the ranks that each hold a shard)")
    if format != "torch":
        raise ValueError("distributed saves write torch checkpoints (format='torch')")
    if sharded:
        return distributed.write_sharded(obj, path, group, opts,
                                         write=lambda o, p: _write_torch_zip(o, p, opts))
    return distributed.write_replicated(obj, path, group, opts)


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
    durable: bool = True,
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
    ``path`` is untouched.

    Options (``None`` takes the environment default, see the module doc):
    ``block_size`` bytes per write, ``arena_bytes`` staging memory (bounded,
    independent of the checkpoint's size), ``queue_depth`` writes in flight,
    ``direct`` O_DIRECT, ``io_uring`` the io_uring back end, ``durable``
    fsync file and directory (leave it on for checkpoints).

    Raises :class:`~fastpersist.SerializationError` for objects that cannot
    be saved, :class:`~fastpersist.WriteError` (an ``OSError`` with
    ``errno`` and ``filename``) for I/O failures, ``ValueError`` for bad
    options, ``TypeError`` when ``path`` is not a path.
    """
    p = _check_path(path)
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, not {format!r}")
    opts = EngineOptions.resolve(block_size, arena_bytes, queue_depth, direct, io_uring, durable)
    if group is not None or sharded:
        return _write_distributed(obj, p, opts, group, sharded, format)
    if format == "safetensors":
        return _write_safetensors(obj, p, opts, metadata)
    if metadata is not None:
        raise ValueError("metadata is only stored by format='safetensors'")
    return _write_torch_zip(obj, p, opts)
