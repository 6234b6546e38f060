"""``read_state_dict``: the fast read path for torch zip and safetensors files.

Every tensor record is read by the Rust engine (O_DIRECT into the aligned
arena, several reads in flight, GIL released) straight into freshly allocated
storages, its CRC32 computed on the way and compared with the one the zip
recorded; then the pickle is replayed exactly as ``torch.load`` would, with
those storages, so storage sharing and every tensor attribute come out the
same.
"""

from __future__ import annotations

import os
import pickle
import pickletools
import re
import struct
import sys
import threading
import time
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from .collectives import check_group
from .cuda_staging import DeviceRead, device_for, read_staged, read_targets, staging_setup
from .distributed import is_sharded_dir, read_sharded
from .errors import CorruptCheckpointError, UnsupportedFormatError, drop_frames
from .options import (
    EngineOptions,
    PathLike,
    RangeBuffer,
    ReadReq,
    check_path,
    checksums,
    counted_for_exit,
    gc_paused,
    open_for_read,
    read_records,
)
from .pickling import (
    LocationScan,
    MapLocation,
    is_legacy_torch,
    load_plain,
    resolve_weights_only,
    restore_location,
    storage_element_size,
    unpickle,
    unpickle_before_data,
)
from .safetensors_format import Entry, empty_of_shape, is_safetensors, parse_header, torch_dtype_error, torch_shape
from .torch_zip import (
    HEADERS_BY_ENGINE,
    CompressedRecords,
    ZipDirectory,
    ZipRecord,
    archive_prefix,
    confirm_predicted,
    overlap_of,
    predict_records,
    read_central_directory,
    resolve_records,
    unrecorded_crcs,
    written_by_fastpersist,
)

__all__ = ["read_state_dict", "ReadStats", "detect_format", "detect", "MapLocation", "HEAD_BYTES"]

#: Bytes from the start of a file that :func:`detect` needs.
HEAD_BYTES = 512


@dataclass(frozen=True)
class ReadStats:
    """What one read did."""

    #: The file read.
    path: str
    #: ``"torch"`` (zip), ``"torch-legacy"`` (torch's pre-1.6 format) or ``"safetensors"``.
    format: str
    #: Bytes of tensor data and pickle read.
    bytes: int
    #: Wall time of the read, parsing and unpickling included.
    seconds: float
    #: Records (zip) or tensors (safetensors) in the file (0 for legacy files).
    records: int
    #: Every record's CRC32 was checked.
    verified: bool
    #: Records whose CRC32 could not be checked: files torch wrote without
    #: computing CRCs (``set_crc32_options(False)``, ``skip_data()``,
    #: ``write_record_metadata``) record 0. Always empty for fastpersist's files.
    unchecked: Tuple[str, ...] = ()

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10**9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def detect_format(path: PathLike) -> str:
    """``"torch"`` (zip), ``"torch-legacy"``, ``"safetensors"``, or raises CorruptCheckpointError."""
    p = check_path(path)
    with os.fdopen(open_for_read(p), "rb") as f:
        head = f.read(HEAD_BYTES)
        size = os.fstat(f.fileno()).st_size
    return detect(head, size, p)


def detect(head: bytes, size: int, path: str) -> str:
    """The format of a file from its first :data:`HEAD_BYTES` bytes and its
    size. safetensors first: a header length can read as a zip signature
    (0x04034B50 bytes), where a zip's bytes from 8 on (a local header's
    compression method, or an end record's counts) never start JSON."""
    if is_safetensors(head, size):
        return "safetensors"
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "torch"
    if is_legacy_torch(head):
        return "torch-legacy"
    raise CorruptCheckpointError(f"{path}: neither a torch checkpoint (zip or legacy) nor a safetensors file")


@counted_for_exit
def read_state_dict(
    path: PathLike,
    *,
    map_location: MapLocation = None,
    weights_only: Optional[bool] = None,
    verify: bool = True,
    direct: Optional[bool] = None,
    io_uring: Optional[bool] = None,
    stats: Optional[List[ReadStats]] = None,
    group: Any = None,
) -> Any:
    """Load a checkpoint written by fastpersist or by ``torch.save`` (zip
    format), or a safetensors file (detected from its first bytes).

    ``weights_only`` has torch's meaning (only tensors, primitive types and
    allow-listed classes are unpickled; pass False only for files you trust;
    None, the default, is torch's default, True; torch's
    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` and ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
    act as they act on torch.load).
    ``verify`` checks every record's CRC32 (zip files; safetensors has no
    checksums) and raises :class:`~fastpersist.CorruptCheckpointError`,
    naming the record, on any mismatch or structural damage: wrong data is
    never returned. ``map_location`` is torch's (a device, a string, a dict
    or a callable). ``stats``, if a list, receives a :class:`ReadStats`.
    A sharded checkpoint directory (``write_state_dict(..., sharded=True)``)
    gives this rank's shard with ``group``, else the list of every shard.
    """
    p = check_path(path)
    if stats is not None and not callable(getattr(stats, "append", None)):
        raise TypeError(f"stats must be a list (it receives a ReadStats), not {type(stats).__name__}")
    check_group(group, "read_state_dict()")
    weights_only = resolve_weights_only(weights_only)
    # A read of many tensors makes objects that all live on (storages,
    # tensors, the containers): cyclic collections meanwhile free nothing
    # and cost (10,000 tensors: 80 of 220 ms of unpickling), as for saves.
    with gc_paused():
        if is_sharded_dir(p):
            return read_sharded(
                p,
                group,
                lambda shard, fd: _read_file(shard, map_location, weights_only, verify, direct, io_uring, stats, fd),
                with_fd=True,
            )
        return _read_file(p, map_location, weights_only, verify, direct, io_uring, stats)


def _read_file(
    p: str,
    map_location: MapLocation,
    weights_only: bool,
    verify: bool,
    direct: Optional[bool],
    io_uring: Optional[bool],
    stats: Optional[List[ReadStats]],
    fd: Optional[int] = None,
) -> Any:
    """Read the checkpoint file ``p``, from ``fd`` when given (an fd of it
    already opened and checked, which this closes)."""
    try:
        t0 = time.perf_counter()
        opts = EngineOptions.resolve(direct=direct, io_uring=io_uring)
        if fd is None:
            fd = open_for_read(p)
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, HEAD_BYTES, 0)
        fmt = detect(head, size, p)
        unchecked: List[str] = []
        if fmt == "safetensors":
            obj, nbytes, nrec = _read_safetensors(fd, size, p, map_location, opts)
        elif fmt == "torch-legacy":
            obj, nbytes, nrec = _read_legacy(fd, size, p, map_location, weights_only)
        else:
            obj, nbytes, nrec = _read_torch(fd, size, p, map_location, weights_only, verify, opts, unchecked)
    except BaseException as e:
        # The storages allocated for the read (GPU memory) go now, not
        # when the caller drops the exception.
        drop_frames(e)
        raise
    finally:
        os.close(fd)
    if stats is not None:
        checked = verify and fmt == "torch" and not unchecked
        stats.append(ReadStats(p, fmt, nbytes, time.perf_counter() - t0, nrec, checked, tuple(unchecked)))
    return obj


def _small_record(fd: int, rec: Optional[ZipRecord], path: str) -> Optional[bytes]:
    """The bytes of a small record (the pickle, byteorder); checked later."""
    if rec is None:
        return None
    data = os.pread(fd, rec.size, rec.data_offset)
    if len(data) != rec.size:
        raise CorruptCheckpointError(f"{path}: record {rec.name!r} is truncated")
    return data


def check_crcs(checked: List[Tuple[ZipRecord, int]], unrecorded: Set[str], path: str) -> List[str]:
    """Compare each record's CRC32 with the one the zip recorded; raises
    CorruptCheckpointError naming the first that differs. Records in
    ``unrecorded`` (CRC field 0 where it may mean "not computed", see
    :func:`~fastpersist.torch_zip.unrecorded_crcs`) whose data's CRC is not
    0 are returned instead: they could not be checked."""
    skipped = []
    for r, crc in checked:
        if crc == r.crc32:
            continue
        if r.name in unrecorded:
            skipped.append(r.name)
            continue
        raise CorruptCheckpointError(
            f"{path}: record {r.name!r} fails its CRC32 check (recorded {r.crc32:08x}, data has {crc:08x})"
        )
    return skipped


#: Host records from which ``while_reading`` runs while they are read
#: (fewer: a thread of its own would cost more than the overlap saves).
MAKE_WHILE_READING = 64


def _read_data_records(
    fd: int,
    path: str,
    keyed: List[Tuple[str, ZipRecord]],
    targets: Dict[str, torch.device],
    opts: EngineOptions,
    headers: Optional[List[Tuple[int, int]]] = None,
    while_reading: Optional[Callable[[Dict[str, Any]], Any]] = None,
) -> Tuple[Dict[str, Any], set, List[Tuple[ZipRecord, int]], List[bytes], Any]:
    """Every data record into a fresh storage on the device it will end up
    on: host records all in one engine call; device records by
    host-to-device copies out of the engine's arena as each read lands
    there (or through the staging slots: ``cuda_staging.read_staged``).
    ``headers``: (offset, length) ranges read in the host call too (the
    local headers of predicted records). ``while_reading(storages)``: run
    on this thread while an engine thread reads the host records (where
    there are no device records and at least ``MAKE_WHILE_READING`` host
    ones); it must not read the storages' bytes.
    Returns the storages by key, the keys already on their CUDA device,
    each record with the CRC32 of the bytes read, the bytes of
    ``headers``, and what ``while_reading`` returned (else None)."""
    storages: Dict[str, Any] = {}
    placed: set = set()
    host: List[Tuple[ZipRecord, Any]] = []
    staged: List[Tuple[ZipRecord, Any]] = []
    for key, r in keyed:
        dev = targets.get(key)
        st = torch.UntypedStorage(r.size, device=dev) if dev is not None else torch.UntypedStorage(r.size)
        storages[key] = st
        if dev is None:
            host.append((r, st))
            continue
        if dev.type == "cuda":
            placed.add(key)
        staged.append((r, st))
    heads = RangeBuffer(headers or [])
    early = None
    try:
        reqs = [(r.data_offset, st.data_ptr(), r.size) for r, st in host] + heads.reqs
        if while_reading is not None and not staged and len(host) >= MAKE_WHILE_READING:
            crcs, early = _read_meanwhile(fd, reqs, opts, (host, heads), lambda: while_reading(storages))
        else:
            crcs = read_records(fd, reqs, opts)
        crcs = crcs[: len(host)]
        if staged:
            crcs += read_staged(fd, [(r.data_offset, st, r.size) for r, st in staged], opts)
    except ValueError as e:  # the engine's own bounds checks
        raise CorruptCheckpointError(f"{path}: {e}") from None
    return storages, placed, [(r, crc) for (r, _), crc in zip(host + staged, crcs)], heads.parts(), early


def _read_meanwhile(
    fd: int, reqs: List[ReadReq], opts: EngineOptions, keep: Any, meanwhile: Callable[[], Any]
) -> Tuple[List[int], Any]:
    """``read_records(fd, reqs, opts)`` on an engine thread while this one
    runs ``meanwhile()``; returns both results once the read is done (also
    when ``meanwhile`` raised: it waits for the read first). The thread
    holds ``keep`` (the memory read into) until the read has ended, so not
    even an interrupted wait frees memory the engine is writing."""
    out: List[Any] = []

    def read(_keep: Any) -> None:
        try:
            out.append(read_records(fd, reqs, opts))
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
            out.append(e)

    t = threading.Thread(target=read, args=(keep,), name="fastpersist-read", daemon=True)
    t.start()
    try:
        early = meanwhile()
    finally:
        t.join()
    got = out[0]
    if isinstance(got, BaseException):
        raise got
    return got, early


def _no_overlap(records: List[ZipRecord], path: str) -> None:
    clash = overlap_of(records)
    if clash:
        raise CorruptCheckpointError(f"{path}: {clash}")


def _locate_data(
    fd: int, d: ZipDirectory, entries: List[Tuple[str, int, int, int, bytes]], alignment: Optional[bytes],
    opts: EngineOptions,
) -> Tuple[List[ZipRecord], Optional[List[Tuple[int, int]]]]:  # fmt: skip
    """The data records of ``entries``. Many records: where torch's padding
    rule puts them (``alignment``: the ``.storage_alignment`` record, else
    torch's 64), with their local headers to read along with the data and
    confirm (one read of each header fewer; a file of 10,000 small tensors
    spent 0.25 s on them); few, or a prediction that cannot hold: read."""
    if len(entries) > HEADERS_BY_ENGINE:
        try:
            align = int(alignment) if alignment is not None else 64
        except ValueError:
            align = 0
        if 64 <= align <= 1 << 15 and align & (align - 1) == 0:
            predicted = predict_records(d, entries, align)
            if predicted is not None:
                return predicted
    return resolve_records(fd, d, entries, opts), None


def _read_torch(
    fd: int,
    size: int,
    path: str,
    map_location: MapLocation,
    weights_only: bool,
    verify: bool,
    opts: EngineOptions,
    unchecked: List[str],
) -> Tuple[Any, int, int]:
    try:
        d = read_central_directory(fd, size, path)
    except CompressedRecords:  # valid (CRCs checked), and torch.load reads it: its answer
        _check_zip(fd, path)
        return _read_by_torch(fd, size, path, map_location, weights_only, 0)
    if not d.entries:
        raise CorruptCheckpointError(f"{path}: the zip holds no records")
    prefix = archive_prefix(d.entries[0][0], f"{path}: ")
    data_prefix = prefix + "data/"
    data_entries = [e for e in d.entries if e[0].startswith(data_prefix)]
    small = resolve_records(fd, d, [e for e in d.entries if not e[0].startswith(data_prefix)], opts)
    by_name: Dict[str, ZipRecord] = {r.name: r for r in small}
    align_rec = by_name.get(prefix + ".storage_alignment")
    alignment = _small_record(fd, align_rec, path) if align_rec is not None and align_rec.size <= 16 else None
    data_recs, headers = _locate_data(fd, d, data_entries, alignment, opts)
    records = small + data_recs
    if headers is not None and overlap_of(records):  # the prediction cannot hold: where the headers say
        data_recs, headers = resolve_records(fd, d, data_entries, opts), None
        records = small + data_recs
    if headers is None:  # (predicted records were just found apart)
        _no_overlap(records, path)
    pkl_rec, order_rec = by_name.get(prefix + "data.pkl"), by_name.get(prefix + "byteorder")
    pkl = _small_record(fd, pkl_rec, path)
    if pkl is None or pkl_rec is None:
        raise CorruptCheckpointError(
            f"{path}: no data.pkl record: not a torch.save checkpoint (TorchScript archives are read by torch.jit.load)"
        )
    order = _small_record(fd, order_rec, path)
    # The format version, where torch's reader looks for it.
    version_rec = by_name.get(prefix + ".data/version") or by_name.get(prefix + "version")
    if version_rec is None:
        raise CorruptCheckpointError(f"{path}: no version record (torch.load refuses such a file too)")
    if version_rec.size > 4096:
        raise CorruptCheckpointError(f"{path}: a version record of {version_rec.size} bytes")
    version = _small_record(fd, version_rec, path)
    unrecorded: Set[str] = set()
    if verify:
        sid = _small_record(fd, by_name.get(prefix + ".data/serialization_id"), path)
        own = written_by_fastpersist(sid, pkl, records)
        unrecorded = unrecorded_crcs(records, own)
        first_checks = [(pkl_rec, zlib.crc32(pkl))]
        few = ((order_rec, order), (version_rec, version))
        first_checks += [(r, zlib.crc32(b)) for r, b in few if r is not None and b is not None]
        unchecked += check_crcs(first_checks, unrecorded, path)
    if _torch_reads(order, version, map_location):
        # (torch.load checks no CRC32: every record's here, first)
        checked_recs = None if headers is not None else data_recs  # (predicted records: read where the headers say)
        unchecked += _check_records(verify, fd, d, small, data_entries, checked_recs, unrecorded, path, opts)
        return _read_by_torch(fd, size, path, map_location, weights_only, len(records))
    keyed = [(r.name[len(data_prefix) :], r) for r in data_recs]
    targets = read_targets(pkl, map_location, [k for k, _ in keyed])
    # Plain state dicts for the host: their objects are made while the
    # bytes are read (they read none of them); used once the read is done.
    meanwhile = None if map_location is not None else (lambda sts: unpickle_before_data(pkl, sts, path, weights_only))
    storages, placed, checked, read_headers, early = _read_data_records(
        fd, path, keyed, targets, opts, headers, meanwhile
    )
    if headers is not None and not confirm_predicted(data_entries, data_recs, read_headers):
        # Not laid out as torch lays out records: read where the headers say.
        data_recs = resolve_records(fd, d, data_entries, opts)
        records = small + data_recs
        _no_overlap(records, path)
        keyed = [(r.name[len(data_prefix) :], r) for r in data_recs]
        storages, placed, checked, _, early = _read_data_records(fd, path, keyed, targets, opts, None, meanwhile)
    if verify:
        unchecked += check_crcs(checked, unrecorded, path)
    nbytes = sum(r.size for _, r in keyed) + len(pkl)
    obj, fast = early if early is not None else (None, True)
    if obj is None:
        intact = verify and pkl_rec.name not in unrecorded
        obj = unpickle(pkl, storages, path, map_location, weights_only, placed, fast, intact)
    return obj, nbytes, len(records)


def _check_records(
    verify: bool,
    fd: int,
    d: ZipDirectory,
    small: List[ZipRecord],
    data_entries: List[Tuple[str, int, int, int, bytes]],
    recs: Optional[List[ZipRecord]],
    unrecorded: Set[str],
    path: str,
    opts: EngineOptions,
) -> List[str]:
    """Check the CRC32 of every data record (``recs``, located where their
    headers say already; None: ``data_entries`` located now; ``small``:
    the other records, checked apart), see :func:`check_crcs`; nothing
    without ``verify``."""
    if not verify:
        return []
    if recs is None:  # (predicted so far: located now, and checked for overlaps)
        recs = resolve_records(fd, d, data_entries, opts)
        _no_overlap(small + recs, path)
    try:
        crcs = checksums(fd, [(r.data_offset, r.size) for r in recs], opts)
    except ValueError as e:
        raise CorruptCheckpointError(f"{path}: {e}") from None
    return check_crcs(list(zip(recs, crcs)), unrecorded, path)


#: The zip format versions (the ``version`` record) read here: those torch
#: reads (``kMinSupportedFileFormatVersion`` to ``kMaxSupportedFileFormatVersion``).
_VERSIONS = range(1, 11)


def _readable_version(raw: Optional[bytes]) -> bool:
    """Whether the file's format version record (its bytes) is a number
    torch reads; an odd or other one is torch.load's to answer."""
    m = re.fullmatch(rb"([0-9]{1,3})\n?", raw) if raw is not None else None
    return m is not None and int(m.group(1)) in _VERSIONS


def _torch_reads(order: Optional[bytes], version: Optional[bytes], map_location: MapLocation) -> bool:
    """The files torch.load reads otherwise than fastpersist's reader would,
    handed to it (after the pickle's and these records' CRCs are checked):"""
    if order is not None and order.decode(errors="replace") != sys.byteorder:
        # saved on a machine of the other byte order (torch.load swaps the
        # bytes), or a value torch refuses in its own words;
        return True
    if order is None and _default_order() != sys.byteorder:
        # no byteorder record: torch.load takes the order its default load
        # endianness names (set_default_load_endianness), swapping bytes;
        return True
    if _to_meta(map_location) or _fake_mode():
        # the meta device: torch.load reads no data, and gives each storage
        # its record's offset (_checkpoint_offset); likewise under a
        # FakeTensorMode (its tensors take no real storage);
        return True
    # a format version torch may not read (the record as written): its
    # answer, either way.
    return not _readable_version(version)


def _check_zip(fd: int, path: str) -> None:
    """A zip of compressed records, read whole with each record's CRC32
    checked (Python's zipfile), before torch.load, which does not check
    them all, reads it."""
    try:
        with os.fdopen(os.dup(fd), "rb") as f, zipfile.ZipFile(f) as z:
            bad = z.testzip()
    except Exception as e:  # noqa: BLE001 - a damaged compressed record raises its codec's own error
        raise CorruptCheckpointError(f"{path}: a zip of compressed records that does not read: {e}") from None
    if bad is not None:
        raise CorruptCheckpointError(f"{path}: record {bad!r} fails its CRC32 check")


def _fake_mode() -> bool:
    """Whether a FakeTensorMode is active (torch.load then makes fake
    tensors)."""
    try:
        from torch._guards import detect_fake_mode
    except ImportError:  # pragma: no cover - torch without it
        return False
    return detect_fake_mode(None) is not None


def _default_order() -> str:
    """The byte order torch.load takes for a zip without a byteorder
    record: its default load endianness (little when unset)."""
    get = getattr(torch.serialization, "get_default_load_endianness", None)
    order = get() if get is not None else None
    name = getattr(order, "name", None)
    return {"BIG": "big", "NATIVE": sys.byteorder}.get(name or "", "little")


def _to_meta(map_location: MapLocation) -> bool:
    """``map_location`` names the meta device (a string or a device)."""
    if isinstance(map_location, torch.device):
        return map_location.type == "meta"
    if isinstance(map_location, str):
        try:
            return torch.device(map_location).type == "meta"
        except RuntimeError:
            return False
    return False


def _read_by_torch(
    fd: int, size: int, path: str, map_location: MapLocation, weights_only: bool, records: int
) -> Tuple[Any, int, int]:
    """A zip file read by torch.load itself, from the file already open
    (what it reads, fastpersist reads; what it refuses, in its words)."""
    return _torch_load(fd, map_location, weights_only), size, records


def _torch_load(fd: int, map_location: MapLocation, weights_only: bool) -> Any:
    """torch.load of the open file, from its start."""
    with os.fdopen(os.dup(fd), "rb") as f:
        f.seek(0)
        return torch.load(f, map_location=map_location, weights_only=weights_only)


def _read_legacy(fd: int, size: int, path: str, map_location: MapLocation, weights_only: bool) -> Tuple[Any, int, int]:
    """torch's format before 1.6 (``_use_new_zipfile_serialization=False``):
    read by torch.load itself (its legacy path, same ``weights_only`` rules
    and messages), from the file already open. It has no checksums: the
    structure check runs after a load too (torch.load hands out a storage
    the pickle names and the file does not hold without filling it)."""
    try:
        obj = _torch_load(fd, map_location, weights_only)
    except Exception as e:
        why = f"{type(e).__name__}: {e}"
        if _truncated(e):
            raise CorruptCheckpointError(f"{path}: the legacy torch file is truncated ({why})") from None
        if isinstance(e, pickle.UnpicklingError) and weights_only:
            raise  # torch's refusal, in its words
        # A damaged file raises anything from inside torch.load (a
        # KeyError, an AssertionError, ...): the structure check names
        # the damage; an intact file's error is torch's own.
        try:
            check_legacy(fd, size, path)
        except CorruptCheckpointError as c:
            raise CorruptCheckpointError(f"{c} (torch.load: {why})") from None
        except UnsupportedFormatError:
            pass  # torch's tar format: the check cannot tell, torch's error stands
        raise
    try:
        check_legacy(fd, size, path)
    except UnsupportedFormatError:
        pass  # torch's tar format: what torch.load made of it
    return obj, size, 0


#: The first two pickles of torch's legacy format.
LEGACY_MAGIC, LEGACY_PROTOCOL = 0x1950A86A20F9469CFC6C, 1001


def check_legacy(fd: int, size: int, path: str) -> int:
    """torch's legacy format, without loading it: five pickles (magic
    number, protocol, system info, the object, the storage keys), then
    each storage as its element count and its bytes, ending at the end of
    the file; the object's pickle names exactly the storages the file
    holds (torch's loader would hand out one it names and the file does
    not hold without ever filling it), each of the size its first
    reference says, every tensor within its storage and given the
    arguments torch's ``set_`` takes. Returns the number of storages. No
    checksums exist."""
    if os.pread(fd, 262, 0)[257:262] == b"ustar":
        raise UnsupportedFormatError(
            f"{path}: torch's oldest (tar) format: verify cannot check it; torch.load reads it"
        )
    with os.fdopen(os.dup(fd), "rb") as f:
        # From the start: a duplicate shares the descriptor's offset, which
        # a torch.load through another duplicate may have left anywhere.
        f.seek(0)
        scan, keys = _scan_legacy(f, fd, path)
        held = set(keys)
        for key in scan.first:
            if key not in held:
                raise CorruptCheckpointError(f"{path}: the pickle names storage {key!r}, which the file does not hold")
        for key in keys:
            if key not in scan.first:
                raise CorruptCheckpointError(f"{path}: storage {key!r} is not named by the pickle")
            type_name, numel = scan.first[key]
            raw = f.read(8)
            if len(raw) != 8:
                raise CorruptCheckpointError(f"{path}: the legacy torch file is truncated (storage {key!r})")
            (n,) = struct.unpack("<q", raw)
            if n != numel:
                raise CorruptCheckpointError(f"{path}: storage {key!r} holds {n} elements, the pickle needs {numel}")
            nbytes = n * storage_element_size(type_name)
            if scan.reach.get(key, 0) > nbytes:
                raise CorruptCheckpointError(
                    f"{path}: a tensor in the pickle reaches {scan.reach[key]} bytes into storage {key!r}, "
                    f"which holds {nbytes}"
                )
            f.seek(nbytes, os.SEEK_CUR)
        if f.tell() != size:
            raise CorruptCheckpointError(f"{path}: the storages end at byte {f.tell()}, the file at {size}")
    return len(keys)


class _Capped:
    """A file read no further than ``size``: a pickle opcode that claims a
    length past the end is a short read, not an allocation of that length
    (a 200-byte file can claim 6 GiB)."""

    def __init__(self, f: Any, size: int) -> None:
        self.f, self.size = f, size

    def _left(self, n: Optional[int]) -> int:
        left = max(0, self.size - int(self.f.tell()))
        return left if n is None or n < 0 else min(n, left)

    def read(self, n: Optional[int] = -1) -> bytes:
        return bytes(self.f.read(self._left(n)))

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        return int(self.f.readinto(view[: self._left(len(view))]))

    def readline(self, n: Optional[int] = -1) -> bytes:
        return bytes(self.f.readline(self._left(n)))

    def tell(self) -> int:
        return int(self.f.tell())

    def seek(self, *args: Any) -> int:
        return int(self.f.seek(*args))


def _scan_legacy(f: Any, fd: int, path: str) -> Tuple[LocationScan, List[str]]:
    """The pickles of a legacy file (``f``, at its start): the object's
    scanned and the storage keys, ``f`` left at the first storage."""
    f = _Capped(f, os.fstat(fd).st_size)
    try:
        magic, protocol = load_plain(f), load_plain(f)
        if magic != LEGACY_MAGIC or protocol != LEGACY_PROTOCOL:
            raise ValueError(f"magic number {magic!r} and protocol {protocol!r} are not torch's")
        load_plain(f)  # system info
        start = f.tell()
        for _ in pickletools.genops(f):
            pass
        end = f.tell()
        keys = load_plain(f)
        if not isinstance(keys, list):
            raise ValueError(f"the storage keys are a {type(keys).__name__}")
        scan = LocationScan(os.pread(fd, end - start, start))
        scan.legacy = True
        scan.load()
    except Exception as e:  # noqa: BLE001 - a damaged pickle can raise anything
        raise CorruptCheckpointError(f"{path}: not a well-formed legacy torch file: {type(e).__name__}: {e}") from None
    return scan, [str(key) for key in keys]


def _truncated(e: BaseException) -> bool:
    """Whether torch.load's error on a legacy file is its data ending early
    (depending on where it ends: EOFError, a short struct or index, the
    pickle's or the storage reader's "truncated"/"unexpected EOF"), not a
    refusal to load (weights_only) or a class that is not there."""
    if isinstance(e, (EOFError, struct.error, IndexError)):
        return True
    msg = str(e)
    return isinstance(e, (RuntimeError, pickle.UnpicklingError)) and (
        "unexpected EOF" in msg or "pickle data was truncated" in msg
    )


def _read_safetensors(
    fd: int, size: int, path: str, map_location: MapLocation, opts: EngineOptions
) -> Tuple[Any, int, int]:
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    raw = os.pread(fd, 8 + min(n, size), 0)
    data_start, entries, _meta = parse_header(raw, size, path)
    out: Dict[str, torch.Tensor] = {}
    reqs: List[ReadReq] = []
    staged: List[DeviceRead] = []
    _, kind = staging_setup()
    dev = torch.device("cpu") if kind == "cpu" else device_for(map_location, "cpu")
    typed: List[Tuple[Entry, List[int], torch.dtype]] = []
    for e in entries:
        shape = torch_shape(e)
        if shape is None or e.dtype is None:
            raise torch_dtype_error(e, path)
        typed.append((e, shape, e.dtype))
    # In file order, as safetensors' load_file gives them.
    for e, shape, dtype in sorted(typed, key=lambda x: (x[0].begin, x[0].end)):
        t = torch.empty(shape, dtype=dtype, device=dev) if e.end > e.begin else empty_of_shape(shape, dtype, dev)
        out[e.name] = t
        if e.end > e.begin:
            if dev is not None:
                staged.append((data_start + e.begin, t.untyped_storage(), e.end - e.begin))
            else:
                reqs.append((data_start + e.begin, t.data_ptr(), e.end - e.begin))
    try:
        read_records(fd, reqs, opts)
        if staged:
            read_staged(fd, staged, opts)
    except ValueError as e:
        raise CorruptCheckpointError(f"{path}: {e}") from None
    if map_location is not None and (dev is None or dev.type != "cuda"):
        restore = restore_location(map_location)
        out = {k: _relocate(t, restore) for k, t in out.items()}
    return out, sum(r[2] for r in reqs) + sum(r[2] for r in staged), len(entries)


def _relocate(t: torch.Tensor, restore: Callable[[Any, str], Any]) -> torch.Tensor:
    st = restore(t.untyped_storage(), "cpu")
    if st.device == t.device:
        return t
    return torch.empty((0,), dtype=t.dtype, device=st.device).set_(st, 0, t.shape, t.stride())
