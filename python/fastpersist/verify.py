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
from typing import List, Optional, Tuple

from .errors import CorruptCheckpointError
from .options import EngineOptions, PathLike, check_path, checksums
from .pickling import LocationScan, storage_element_size
from .reader import detect
from .safetensors_format import parse_header, torch_shape
from .torch_zip import read_zip_directory

__all__ = ["RecordInfo", "inspect_file", "verify_file"]


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


def _inspect_fd(fd: int, size: int, path: str) -> Tuple[str, List[RecordInfo]]:
    fmt = detect(os.pread(fd, 9, 0), size, path)
    if fmt == "torch":
        return fmt, [
            RecordInfo(r.name, r.data_offset, r.size, r.crc32, _alignment(r.data_offset))
            for r in read_zip_directory(fd, size, path)
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
    (safetensors), without reading the data."""
    p = check_path(path)
    fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _inspect_fd(fd, os.fstat(fd).st_size, p)
    finally:
        os.close(fd)


def _check_pickle(data: bytes, recs: List[RecordInfo], path: str) -> None:
    """The pickle is well formed, and every storage it names is a record
    of the file holding at least the bytes the pickle needs."""
    try:
        for _ in pickletools.genops(data):
            pass
    except Exception as e:  # noqa: BLE001 - a damaged pickle can raise anything
        raise CorruptCheckpointError(f"{path}: data.pkl is not a well-formed pickle: {e}") from None
    sizes = {}
    for r in recs:
        head, sep, key = r.name.rpartition("data/")
        if sep and "/" not in key and head.count("/") <= 1:
            sizes[key] = r.bytes
    scan = LocationScan(data)
    try:
        scan.load()
    except Exception as e:  # noqa: BLE001
        raise CorruptCheckpointError(f"{path}: data.pkl cannot be replayed: {type(e).__name__}: {e}") from None
    for key, (type_name, numel) in scan.storages.items():
        if key not in sizes:
            raise CorruptCheckpointError(f"{path}: the pickle refers to storage {key!r}, which the file does not hold")
        need = numel * storage_element_size(type_name)
        if need > sizes[key]:
            raise CorruptCheckpointError(f"{path}: storage {key!r} holds {sizes[key]} bytes, the pickle needs {need}")


def verify_file(path: PathLike, *, direct: Optional[bool] = None) -> Tuple[str, int]:
    """Check a checkpoint without loading it: the structure parses, every
    record's CRC32 matches (zip), the pickle is well formed and names only
    storages the file holds, large enough. Memory stays bounded (records
    are checksummed through the engine's arena). Returns (format, records
    checked); raises CorruptCheckpointError."""
    p = check_path(path)
    opts = EngineOptions.resolve(direct=direct)
    fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        fmt, recs = _inspect_fd(fd, size, p)
        try:
            crcs = checksums(fd, [(r.offset, r.bytes) for r in recs], opts)
        except ValueError as e:
            raise CorruptCheckpointError(f"{p}: {e}") from None
        if fmt == "torch":
            for r, crc in zip(recs, crcs):
                if crc != r.crc32:
                    raise CorruptCheckpointError(
                        f"{p}: record {r.name!r} fails its CRC32 check (recorded {r.crc32:08x}, data has {crc:08x})"
                    )
            pkl = [r for r in recs if r.name.endswith("data.pkl")]
            if not pkl:
                raise CorruptCheckpointError(f"{p}: no data.pkl record")
            data = os.pread(fd, pkl[0].bytes, pkl[0].offset)
            _check_pickle(data, recs, p)
    finally:
        os.close(fd)
    return fmt, len(recs)
