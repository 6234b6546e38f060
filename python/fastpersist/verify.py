"""Looking at a checkpoint without loading it: ``inspect`` and ``verify``.

Both read one open file from start to end (a file replaced at its path
meanwhile is not mixed with its successor). :func:`verify_file` checks what
a load would check, in bounded memory: the structure, every record's CRC32
(read through the engine's arena), the pickle's opcodes, and that every
storage the pickle names is in the file and large enough.
"""

from __future__ import annotations

import os
import pickletools
import struct
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

from .distributed import INDEX_NAME, read_sharded
from .errors import CorruptCheckpointError
from .options import EngineOptions, PathLike, check_path, checksums, counted_for_exit, open_for_read
from .pickling import LocationScan, storage_element_size
from .reader import HEAD_BYTES, check_crcs, check_legacy, detect
from .safetensors_format import parse_header, torch_shape
from .torch_zip import ZipRecord, archive_prefix, read_zip_directory, unrecorded_crcs, written_by_fastpersist

__all__ = ["RecordInfo", "VerifyResult", "inspect_file", "verify_file"]


class VerifyResult(Tuple[str, int]):
    """What :func:`verify_file` returns: ``(format, records checked)``
    (unpacks as before), with :attr:`unchecked`, the names of the records
    whose CRC32 could not be checked (CRC fields that torch left 0: see
    :attr:`fastpersist.ReadStats.unchecked`)."""

    unchecked: Tuple[str, ...]
    #: A torch zip's top-level object, when it is a dict: its str keys,
    #: each with its value when that is an int or a str (else None).
    #: (What the Checkpointer tells its own payloads by, without a load.)
    top_level: Optional[Dict[str, Any]]

    def __new__(
        cls, fmt: str, records: int, unchecked: Iterable[str] = (), top_level: Optional[Dict[str, Any]] = None
    ) -> VerifyResult:
        self = super().__new__(cls, (fmt, records))
        self.unchecked = tuple(unchecked)
        self.top_level = top_level
        return self

    @property
    def format(self) -> str:
        return self[0]

    @property
    def records(self) -> int:
        return self[1]


@dataclass(frozen=True)
class RecordInfo:
    """One record of a torch zip checkpoint, or one tensor of a safetensors file."""

    name: str
    #: Offset of the data in the file.
    offset: int
    bytes: int
    #: CRC32 recorded in the zip (None for safetensors, which has none).
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


def _inspect_fd(fd: int, size: int, path: str, whole: bool = False) -> Tuple[str, List[RecordInfo]]:
    """The format and records of the file at ``fd``; ``whole``: a zip must
    end where the file does (nothing appended)."""
    fmt = detect(os.pread(fd, HEAD_BYTES, 0), size, path)
    if fmt == "torch-legacy":
        return fmt, []
    if fmt == "torch":
        return fmt, [
            RecordInfo(r.name, r.data_offset, r.size, r.crc32, _alignment(r.data_offset))
            for r in read_zip_directory(fd, size, path, whole=whole)
        ]
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    start, entries, _ = parse_header(os.pread(fd, 8 + min(n, size), 0), size, path)
    return fmt, [
        RecordInfo(
            e.name,
            start + e.begin,
            e.end - e.begin,
            None,
            _alignment(start + e.begin),
            str(e.dtype).replace("torch.", "") if e.dtype is not None else e.code,
            tuple(torch_shape(e) or e.shape),
        )
        for e in sorted(entries, key=lambda x: x.begin)
    ]


def inspect_file(path: PathLike) -> Tuple[str, List[RecordInfo]]:
    """The format of a checkpoint and its records (zip) or tensors
    (safetensors), without reading the data (none for torch's legacy
    format, which has no directory)."""
    p = check_path(path)
    fd = open_for_read(p)
    try:
        return _inspect_fd(fd, os.fstat(fd).st_size, p)
    finally:
        os.close(fd)


def _check_pickle(data: bytes, recs: List[RecordInfo], prefix: str, path: str) -> Optional[Dict[str, Any]]:
    """The pickle is well formed, and every storage it names is a record
    of the file holding exactly the bytes of the storage its first
    reference, and each reference as another type, describes (as
    torch.load wants), at least those every other reference needs, and
    the bytes every tensor laid over it reaches."""
    try:
        for _ in pickletools.genops(data):
            pass
    except Exception as e:  # noqa: BLE001 - a damaged pickle can raise anything
        raise CorruptCheckpointError(f"{path}: data.pkl is not a well-formed pickle: {e}") from None
    sizes, names = {}, {}
    under = prefix + "data/"
    for r in recs:
        key = r.name[len(under) :]
        if r.name.startswith(under):  # (a key may hold "/": torch reads f"data/{key}")
            sizes[key], names[key] = r.bytes, r.name
    scan = LocationScan(data)
    try:
        top = scan.load()
    except Exception as e:  # noqa: BLE001
        raise CorruptCheckpointError(f"{path}: data.pkl cannot be replayed: {type(e).__name__}: {e}") from None
    for key, (type_name, numel) in scan.storages.items():
        if key not in sizes:
            raise CorruptCheckpointError(f"{path}: the pickle refers to storage {key!r}, which the file does not hold")
        need = numel * storage_element_size(type_name)
        if need > sizes[key]:
            raise CorruptCheckpointError(
                f"{path}: record {names[key]!r} holds {sizes[key]} bytes, the pickle needs {need} for storage {key!r}"
            )
        retyped = scan.retyped.get(key, sizes[key])
        if retyped != sizes[key]:  # a reference of another type: a storage torch.load makes of the record
            raise CorruptCheckpointError(
                f"{path}: record {names[key]!r} holds {sizes[key]} bytes, a reference to storage {key!r} in the "
                f"pickle describes {retyped} (a record holds exactly its storage's bytes)"
            )
        first_type, first_numel = scan.first[key]
        first = first_numel * storage_element_size(first_type)
        if first != sizes[key]:  # the storage torch.load makes of the record: exactly its bytes
            raise CorruptCheckpointError(
                f"{path}: record {names[key]!r} holds {sizes[key]} bytes, the pickle needs {first} for storage "
                f"{key!r} (a record holds exactly its storage's bytes)"
            )
        reach = scan.reach.get(key, 0)
        if reach > sizes[key]:
            raise CorruptCheckpointError(
                f"{path}: a tensor in the pickle reaches {reach} bytes into storage {key!r}, which holds {sizes[key]}"
            )
    if not isinstance(top, dict):
        return None
    return {k: v if type(v) in (int, str) else None for k, v in top.items() if type(k) is str}


def _check_crcs(fd: int, recs: List[RecordInfo], crcs: List[int], prefix: str, path: str) -> List[str]:
    """CRC32s of a zip's records against the directory, with the reader's
    rule for CRC fields torch left 0 (returned: not checked)."""
    zr = [ZipRecord(r.name, 0, r.offset, r.bytes, r.crc32 or 0) for r in recs]
    unrecorded: set = set()
    if any(r.crc32 == 0 for r in zr):
        pkl = [r for r in zr if r.name == prefix + "data.pkl"]
        sid = [r for r in zr if r.name == prefix + ".data/serialization_id"]
        data = os.pread(fd, pkl[0].size, pkl[0].data_offset) if pkl else b""
        sid_b = os.pread(fd, sid[0].size, sid[0].data_offset) if sid else None
        unrecorded = unrecorded_crcs(zr, written_by_fastpersist(sid_b, data, zr))
    return check_crcs(list(zip(zr, crcs)), unrecorded, path)


@counted_for_exit
def verify_file(path: PathLike, *, direct: Optional[bool] = None) -> VerifyResult:
    """Check a checkpoint without loading it: the structure parses, every
    record's CRC32 matches (zip), the pickle is well formed and names only
    storages the file holds, large enough. Memory stays bounded (records
    are checksummed through the engine's arena). Returns a
    :class:`VerifyResult`: (format, records checked), and the records whose
    CRC32 torch did not record (``unchecked``). torch's legacy format has
    no checksums: its structure is checked (format ``"torch-legacy"``,
    records: its storages). A sharded checkpoint's directory: its index
    and every shard (format ``"sharded"``). Raises CorruptCheckpointError,
    or UnsupportedFormatError for a TorchScript archive."""
    p = check_path(path)
    if os.path.isdir(p) and os.path.lexists(os.path.join(p, INDEX_NAME)):
        return _verify_sharded(p, direct)
    fd = open_for_read(p)
    try:
        return verify_fd(fd, p, direct=direct)
    finally:
        os.close(fd)


def _verify_sharded(dirpath: str, direct: Optional[bool]) -> VerifyResult:
    """A sharded checkpoint (a directory with an index): the index, and
    every shard it names (each a file of the directory) verified; format
    ``"sharded"``, the records of all of them."""

    def one(path: str, fd: int) -> VerifyResult:
        try:
            return verify_fd(fd, path, direct=direct)
        finally:
            os.close(fd)

    results = read_sharded(dirpath, None, one, with_fd=True)
    return VerifyResult("sharded", sum(r.records for r in results), [u for r in results for u in r.unchecked])


def verify_fd(fd: int, path: str, *, direct: Optional[bool] = None) -> VerifyResult:
    """:func:`verify_file` of the file open at ``fd`` (``path`` names it in
    errors): whoever goes on to read the file through the same descriptor
    reads exactly the bytes that verified."""
    opts = EngineOptions.resolve(direct=direct)
    unchecked: List[str] = []
    size = os.fstat(fd).st_size
    fmt, recs = _inspect_fd(fd, size, path, whole=True)
    if fmt == "torch-legacy":
        return VerifyResult(fmt, check_legacy(fd, size, path))
    try:
        crcs = checksums(fd, [(r.offset, r.bytes) for r in recs], opts)
    except ValueError as e:
        raise CorruptCheckpointError(f"{path}: {e}") from None
    if fmt == "torch":
        # The records' folder, as torch's reader takes it (the first record's).
        prefix = archive_prefix(recs[0].name if recs else "", f"{path}: ")
        unchecked = _check_crcs(fd, recs, crcs, prefix, path)
        pkl_name = prefix + "data.pkl"
        pkl = [r for r in recs if r.name == pkl_name]
        if not pkl:
            raise CorruptCheckpointError(f"{path}: no data.pkl record where torch.load looks for it")
        data = os.pread(fd, pkl[0].bytes, pkl[0].offset)
        top = _check_pickle(data, recs, prefix, path)
        return VerifyResult(fmt, len(recs) - len(unchecked), unchecked, top)
    return VerifyResult(fmt, len(recs) - len(unchecked), unchecked)
