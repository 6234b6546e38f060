"""``read_state_dict``: the fast read path for torch zip and safetensors files.

Every tensor record is read by the Rust engine (O_DIRECT into the aligned
arena, several reads in flight, GIL released) straight into freshly allocated
storages, its CRC32 computed on the way and compared with the one the zip
recorded; then the pickle is replayed exactly as ``torch.load`` would, with
those storages, so storage sharing and every tensor attribute come out the
same.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from .errors import CorruptCheckpointError
from .safetensors_format import is_safetensors, parse_header
from .serialization import ZipRecord, read_zip_directory
from .writer import EngineOptions, PathLike, _check_path, _staging_setup, get_engine

__all__ = ["read_state_dict", "ReadStats", "detect_format"]

MapLocation = Union[None, str, torch.device, Callable[..., Any], Dict[str, str]]


@dataclass(frozen=True)
class ReadStats:
    path: str
    format: str
    bytes: int
    seconds: float
    records: int
    verified: bool

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def detect_format(path: PathLike) -> str:
    """``"torch"`` (zip), ``"safetensors"``, or raises CorruptCheckpointError."""
    p = _check_path(path)
    with open(p, "rb") as f:
        head = f.read(9)
        size = os.fstat(f.fileno()).st_size
    return _detect(head, size, p)


def _detect(head: bytes, size: int, path: str) -> str:
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "torch"
    if is_safetensors(head, size):
        return "safetensors"
    raise CorruptCheckpointError(f"{path}: neither a torch zip checkpoint nor a safetensors file")


def _restore_location(map_location: MapLocation) -> Callable[[Any, str], Any]:
    get = getattr(torch.serialization, "_get_restore_location", None)
    if get is not None:
        return get(map_location)
    return lambda storage, location: torch.serialization.default_restore_location(  # pragma: no cover
        storage, location if map_location is None else str(map_location))


def _read_records(path: str, reqs: List[Tuple[int, int, int]], opts: EngineOptions) -> List[int]:
    lock, eng = get_engine(opts)
    with lock:
        raw = eng.read_into(path, reqs)
    return list(raw["crcs"])


def read_state_dict(
    path: PathLike,
    *,
    map_location: MapLocation = None,
    weights_only: bool = True,
    verify: bool = True,
    direct: Optional[bool] = None,
    io_uring: Optional[bool] = None,
    stats: Optional[List[ReadStats]] = None,
    group: Any = None,
) -> Any:
    """Load a checkpoint written by fastpersist or by ``torch.save`` (zip
    format), or a safetensors file (detected from its first bytes).

    ``weights_only`` has torch's meaning (only tensors, primitive types and
    allow-listed classes are unpickled; pass False only for files you trust).
    ``verify`` checks every record's CRC32 (zip files; safetensors has no
    checksums) and raises :class:`~fastpersist.CorruptCheckpointError`,
    naming the record, on any mismatch or structural damage: wrong data is
    never returned. ``map_location`` is torch's (a device, a string, a dict
    or a callable). ``stats``, if a list, receives a :class:`ReadStats`.
    A sharded checkpoint directory (``write_state_dict(..., sharded=True)``)
    gives this rank's shard with ``group``, else the list of every shard.
    """
    p = _check_path(path)
    from .distributed import is_sharded_dir, read_sharded

    if is_sharded_dir(p):
        return read_sharded(p, group, lambda shard: read_state_dict(
            shard, map_location=map_location, weights_only=weights_only, verify=verify,
            direct=direct, io_uring=io_uring, stats=stats))
    t0 = time.perf_counter()
    opts = EngineOptions.resolve(direct=direct, io_uring=io_uring)
    fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 9, 0)
        fmt = _detect(head, size, p)
        if fmt == "safetensors":
            obj, nbytes, nrec = _read_safetensors(fd, size, p, map_location, opts)
        else:
            obj, nbytes, nrec = _read_torch(fd, size, p, map_location, weights_only, verify, opts)
    finally:
        os.close(fd)
    if stats is not None:
        stats.append(ReadStats(p, fmt, nbytes, time.perf_counter() - t0, nrec,
                               verify and fmt == "torch"))
    return obj


def _read_torch(fd: int, size: int, path: str, map_location: MapLocation, weights_only: bool,
                verify: bool, opts: EngineOptions) -> Tuple[Any, int, int]:
    records = read_zip_directory(fd, size, path)
    if not records:
        raise CorruptCheckpointError(f"{path}: the zip holds no records")
    prefix = records[0].name.split("/", 1)[0] + "/" if "/" in records[0].name else ""
    by_name: Dict[str, ZipRecord] = {r.name: r for r in records}

    def small(name: str) -> Optional[bytes]:
        r = by_name.get(prefix + name)
        if r is None:
            return None
        data = os.pread(fd, r.size, r.data_offset)
        if len(data) != r.size:
            raise CorruptCheckpointError(f"{path}: record {r.name!r} is truncated")
        if verify and zlib.crc32(data) != r.crc32:
            raise CorruptCheckpointError(f"{path}: record {r.name!r} fails its CRC32 check")
        return data

    pkl = small("data.pkl")
    if pkl is None:
        raise CorruptCheckpointError(f"{path}: no data.pkl record: not a torch.save checkpoint "
                                     f"(TorchScript archives are read by torch.jit.load)")
    order = small("byteorder")
    if order is not None and order.decode(errors="replace") != sys.byteorder:
        raise CorruptCheckpointError(f"{path}: written on a {order!r}-endian machine; "
                                     f"use torch.load, which byte-swaps")

    # Every data record goes into a fresh storage on the device it will end
    # up on: host records all in one engine call; device records through
    # the registered staging slots with host-to-device copies (pipelined).
    data_prefix = prefix + "data/"
    data_recs = [r for r in records if r.name.startswith(data_prefix)]
    targets = _targets(pkl, map_location, path, [r.name[len(data_prefix):] for r in data_recs])
    storages: Dict[str, Any] = {}
    placed: set = set()
    host: List[Tuple[ZipRecord, Any]] = []
    staged: List[Tuple[ZipRecord, Any]] = []
    for r in data_recs:
        key = r.name[len(data_prefix):]
        dev = targets.get(key)
        st = torch.UntypedStorage(r.size, device=dev) if dev is not None else torch.UntypedStorage(r.size)
        storages[key] = st
        if dev is not None:
            if dev.type == "cuda":
                placed.add(key)
            staged.append((r, st))
        else:
            host.append((r, st))
    try:
        crcs = _read_records(path, [(r.data_offset, st.data_ptr(), r.size) for r, st in host], opts)
        if staged:
            crcs += _read_staged(path, [(r.data_offset, st, r.size) for r, st in staged], opts)
    except ValueError as e:  # the engine's own bounds checks
        raise CorruptCheckpointError(f"{path}: {e}") from None
    if verify:
        for (r, _), crc in zip(host + staged, crcs):
            if crc != r.crc32:
                raise CorruptCheckpointError(
                    f"{path}: record {r.name!r} fails its CRC32 check "
                    f"(recorded {r.crc32:08x}, data has {crc:08x})"
                )
    nbytes = sum(r.size for r in data_recs) + len(pkl)
    return _unpickle(pkl, storages, path, map_location, weights_only, placed), nbytes, len(records)


def _read_staged(path: str, items: List[Tuple[int, Any, int]], opts: EngineOptions) -> List[int]:
    """Read records into device storages through the staging slots."""
    from .cuda_staging import DeviceContext, read_to_device
    from .writer import _stage_chunk

    _, kind = _staging_setup()
    ctx = DeviceContext([], test_on_cpu=kind == "cpu", chunk=_stage_chunk())

    def reader(index: int) -> Callable[[List[Tuple[int, int, int]]], List[int]]:
        lock, eng = get_engine(opts, index)

        def read(reqs: List[Tuple[int, int, int]]) -> List[int]:
            with lock:
                return list(eng.read_into(path, reqs)["crcs"])
        return read

    try:
        # Two engines, so slot k+1 is being read while slot k's read ends:
        # the device never waits between slots.
        return read_to_device([reader(0), reader(1)], items, ctx.staging, ctx.copier)
    finally:
        ctx.close()


class _Anything:
    """Stands for every class and function while a pickle is scanned."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> "_Anything":
        return _Anything()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _LocationScan(pickle.Unpickler):
    """Replays a pickle's opcodes with every global replaced by a stand-in,
    so nothing is constructed or imported, and notes each storage's
    location (torch writes one persistent id per storage)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self.locations: Dict[str, str] = {}

    def find_class(self, module: str, name: str) -> Any:
        return _Anything

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
            self.locations[str(pid[2])] = str(pid[3])
        return _Anything()


def _device_for(map_location: MapLocation, location: str) -> Optional[torch.device]:
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


def _targets(pkl: bytes, map_location: MapLocation, path: str, keys: List[str]) -> Dict[str, torch.device]:
    """The storages (by key) to read straight to a CUDA device, and where."""
    _, kind = _staging_setup()
    if kind == "cpu":  # test hook: every storage through the staging path
        return {k: torch.device("cpu") for k in keys}
    if callable(map_location) or not keys:
        return {}
    if isinstance(map_location, (str, torch.device)):
        dev = _device_for(map_location, "cpu")
        return {k: dev for k in keys} if dev is not None else {}
    if b"cuda" not in pkl and not (isinstance(map_location, dict)
                                    and any("cuda" in str(v) for v in map_location.values())):
        return {}
    scan = _LocationScan(pkl)
    try:
        scan.load()
    except Exception:  # noqa: BLE001 - the real unpickling reports damage
        return {}
    out: Dict[str, torch.device] = {}
    for k, loc in scan.locations.items():
        dev = _device_for(map_location, loc)
        if dev is not None:
            out[k] = dev
    return out


class _RestoreError(Exception):
    """Carries an error raised by ``map_location`` through the unpickler."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _unpickle(pkl: bytes, storages: Dict[str, Any], path: str, map_location: MapLocation,
              weights_only: bool, placed: Optional[set] = None) -> Any:
    """Replay the pickle with ``storages``; those in ``placed`` are already
    where ``map_location`` sends them (torch's restore is skipped)."""
    placed = placed or set()
    restore = _restore_location(map_location)
    typed: Dict[str, Any] = {}

    def persistent_load(saved_id: Any) -> Any:
        if not isinstance(saved_id, tuple) or len(saved_id) != 5 or saved_id[0] != "storage":
            raise pickle.UnpicklingError(f"unknown persistent id {saved_id!r}")
        _, storage_type, key, location, numel = saved_id
        if key in typed:
            return typed[key]
        if key not in storages:
            raise CorruptCheckpointError(f"{path}: the pickle refers to storage {key!r}, "
                                         f"which the file does not hold")
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        st = storages[key]
        need = int(numel) * torch._utils._element_size(dtype)
        if need > st.nbytes():
            raise CorruptCheckpointError(f"{path}: storage {key!r} holds {st.nbytes()} bytes, "
                                         f"the pickle needs {need}")
        if key not in placed:
            try:
                st = restore(st, location)
            except Exception as e:  # noqa: BLE001 - the user's map_location, not the file
                raise _RestoreError(e) from e
        ts = torch.storage.TypedStorage(wrap_storage=st, dtype=dtype, _internal=True)
        if ts._data_ptr() != 0:
            typed[key] = ts
        return ts

    if weights_only:
        from torch import _weights_only_unpickler

        unpickler: Any = _weights_only_unpickler.Unpickler(io.BytesIO(pkl), encoding="utf-8")
    else:
        unpickler = pickle.Unpickler(io.BytesIO(pkl), encoding="utf-8")
    unpickler.persistent_load = persistent_load
    state = getattr(torch._utils, "_thread_local_state", None)
    old = getattr(state, "map_location", None) if state is not None else None
    if state is not None:
        state.map_location = map_location
    try:
        obj = unpickler.load()
    except CorruptCheckpointError:
        raise
    except _RestoreError as e:  # e.g. map_location="cuda" without a GPU: torch's own error
        raise e.error from None
    except pickle.UnpicklingError as e:
        hint = " (pass weights_only=False if you trust this file)" if weights_only else ""
        raise pickle.UnpicklingError(f"{path}: {e}{hint}") from None
    except Exception as e:  # noqa: BLE001 - a damaged pickle can raise anything
        raise CorruptCheckpointError(f"{path}: the pickle (data.pkl) cannot be loaded: "
                                     f"{type(e).__name__}: {e}") from None
    finally:
        if state is not None:
            state.map_location = old
    validate = getattr(torch._utils, "_validate_loaded_sparse_tensors", None)
    if validate is not None:
        validate()
    return obj


def _read_safetensors(fd: int, size: int, path: str, map_location: MapLocation,
                      opts: EngineOptions) -> Tuple[Any, int, int]:
    import struct

    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    raw = os.pread(fd, 8 + min(n, size), 0)
    data_start, entries, _meta = parse_header(raw, size, path)
    out: Dict[str, torch.Tensor] = {}
    reqs: List[Tuple[int, int, int]] = []
    staged: List[Tuple[int, Any, int]] = []
    _, kind = _staging_setup()
    dev = torch.device("cpu") if kind == "cpu" else _device_for(map_location, "cpu")
    for name, dtype, shape, begin, end in entries:
        t = torch.empty(shape, dtype=dtype, device=dev)
        out[name] = t
        if end > begin:
            if dev is not None:
                staged.append((data_start + begin, t.untyped_storage(), end - begin))
            else:
                reqs.append((data_start + begin, t.data_ptr(), end - begin))
    try:
        _read_records(path, reqs, opts)
        if staged:
            _read_staged(path, staged, opts)
    except ValueError as e:
        raise CorruptCheckpointError(f"{path}: {e}") from None
    if map_location is not None and (dev is None or dev.type != "cuda"):
        restore = _restore_location(map_location)
        out = {k: _relocate(t, restore) for k, t in out.items()}
    return out, sum(r[2] for r in reqs) + sum(r[2] for r in staged), len(entries)


def _relocate(t: torch.Tensor, restore: Callable[[Any, str], Any]) -> torch.Tensor:
    st = restore(t.untyped_storage(), "cpu")
    if st.device == t.device:
        return t
    return torch.empty((0,), dtype=t.dtype, device=st.device).set_(st, 0, t.shape, t.stride())


@dataclass(frozen=True)
class RecordInfo:
    name: str
    offset: int
    bytes: int
    crc32: Optional[int]
    #: Largest power of two (up to 4096) dividing the data offset.
    alignment: int
    dtype: Optional[str] = None
    shape: Optional[Tuple[int, ...]] = None


def _alignment(off: int) -> int:
    a = 1
    while a < 4096 and off % (a * 2) == 0:
        a *= 2
    return a


def inspect_file(path: PathLike) -> Tuple[str, List[RecordInfo]]:
    """The format of a checkpoint and its records (zip) or tensors
    (safetensors), without reading the data."""
    p = _check_path(path)
    fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        fmt = _detect(os.pread(fd, 9, 0), size, p)
        if fmt == "torch":
            return fmt, [RecordInfo(r.name, r.data_offset, r.size, r.crc32, _alignment(r.data_offset))
                         for r in read_zip_directory(fd, size, p)]
        import struct

        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        start, entries, _ = parse_header(os.pread(fd, 8 + min(n, size), 0), size, p)
        return fmt, [RecordInfo(name, start + b, e - b, None, _alignment(start + b),
                                str(dt).replace("torch.", ""), tuple(shape))
                     for name, dt, shape, b, e in sorted(entries, key=lambda x: x[3])]
    finally:
        os.close(fd)


def verify_file(path: PathLike, *, direct: Optional[bool] = None) -> Tuple[str, int]:
    """Check a checkpoint without loading it: the structure parses, every
    record's CRC32 matches (zip), the pickle is well formed. Memory stays
    bounded (records are checksummed through the engine's arena). Returns
    (format, records checked); raises CorruptCheckpointError."""
    import pickletools

    p = _check_path(path)
    fmt, recs = inspect_file(p)
    opts = EngineOptions.resolve(direct=direct)
    lock, eng = get_engine(opts)
    with lock:
        try:
            crcs = eng.crc_ranges(p, [(r.offset, r.bytes) for r in recs])
        except ValueError as e:
            raise CorruptCheckpointError(f"{p}: {e}") from None
    if fmt == "torch":
        for r, crc in zip(recs, crcs):
            if crc != r.crc32:
                raise CorruptCheckpointError(f"{p}: record {r.name!r} fails its CRC32 check "
                                             f"(recorded {r.crc32:08x}, data has {crc:08x})")
        pkl = [r for r in recs if r.name.endswith("data.pkl")]
        if not pkl:
            raise CorruptCheckpointError(f"{p}: no data.pkl record")
        with open(p, "rb") as f:
            f.seek(pkl[0].offset)
            data = f.read(pkl[0].bytes)
        try:
            for _ in pickletools.genops(data):
                pass
        except Exception as e:  # noqa: BLE001
            raise CorruptCheckpointError(f"{p}: data.pkl is not a well-formed pickle: {e}") from None
    return fmt, len(recs)
