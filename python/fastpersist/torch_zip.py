"""torch.save's zip format, laid out for the fastpersist engine.

This module turns any object ``torch.save`` accepts into a :class:`Plan`: the
exact bytes of every zip header, the pickle, and the address and length of
every tensor storage, each at its offset in the file. The Rust engine then
gathers those pieces into aligned buffers and writes them with O_DIRECT.

The file is what ``torch.save`` writes (same record names and order, same
pickle, flags 0x808 with data descriptors, uncompressed, zip64 where needed),
except that storage records start at 4096-byte aligned offsets (recorded in
``.storage_alignment``), which keeps ``torch.load(mmap=True)`` zero-copy and
lets the bulk of the file go to disk straight from page-aligned buffers.
Local headers are padded the way torch's own writer (miniz) pads them, so
readers that compute record offsets instead of reading them still agree.
CRC32s are not known when the plan is made: the data descriptors and the
central directory hold *slots* that the engine fills while it writes.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _core
from .errors import SerializationError

__all__ = ["Batch", "Plan", "TorchZipLayout", "plan_torch_save", "find_storages", "STORAGE_ALIGNMENT", "ARCHIVE_NAME"]

#: Alignment of every ``data/<key>`` record (page size; O_DIRECT block).
STORAGE_ALIGNMENT = 4096
#: Alignment of the small records (torch's own default).
SMALL_ALIGNMENT = 64
#: Prefix of every record name; torch.load ignores it.
ARCHIVE_NAME = "archive"
#: torch.save's default pickle protocol.
PICKLE_PROTOCOL = 2

_U32 = 0xFFFFFFFF
_U16 = 0xFFFF
_FLAGS = 0x0808  # bit 3: sizes and CRC in a data descriptor; bit 11: UTF-8 names
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_EOCD = struct.Struct("<IHHHHIIH")  # 22 bytes
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_LOCATOR64 = struct.Struct("<IIQI")  # 20 bytes


@dataclass
class Batch:
    """Consecutive pieces of a file, as one engine call takes them:
    ``blobs`` (offset, bytes), ``regions`` (offset, address, length,
    checksum id) and ``slots`` (offset, checksum id)."""

    blobs: List[Tuple[int, bytes]] = field(default_factory=list)
    regions: List[Tuple[int, int, int, int]] = field(default_factory=list)
    slots: List[Tuple[int, int]] = field(default_factory=list)
    #: Storages to stage from a device: (offset, storage, length, checksum id).
    device: List[Tuple[int, Any, int, int]] = field(default_factory=list)
    #: End of the last piece.
    end: int = 0

    def extend(self, other: "Batch") -> None:
        self.blobs += other.blobs
        self.regions += other.regions
        self.slots += other.slots
        self.device += other.device
        self.end = max(self.end, other.end)

    def split_at(self, offset: int) -> Tuple["Batch", "Batch"]:
        """The pieces before ``offset`` and the rest (device storages stay
        with the second part)."""
        lo, hi = Batch(), Batch()
        for o, b in self.blobs:
            (lo if o < offset else hi).blobs.append((o, b))
        for r in self.regions:
            (lo if r[0] < offset else hi).regions.append(r)
        for sl in self.slots:
            (lo if sl[0] < offset else hi).slots.append(sl)
        hi.device = list(self.device)
        hi.end = self.end
        return lo, hi


@dataclass
class Plan(Batch):
    """A whole file, for :meth:`fastpersist._core.Engine.write_file`."""

    file_len: int = 0
    #: Storages the regions point into: kept alive until the write is over.
    keepalive: List[Any] = field(default_factory=list)
    #: Record names in file order, with (data offset, length).
    records: List[Tuple[str, int, int]] = field(default_factory=list)
    #: Storage keys in checksum-id order.
    storage_keys: List[str] = field(default_factory=list)
    storage_bytes: int = 0


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"tensor(shape={tuple(obj.shape)}, dtype={obj.dtype}, device={obj.device}, layout={obj.layout})"
    return type(obj).__qualname__


def find_path(obj: Any, pred: Any, prefix: str = "") -> Optional[str]:
    """Key path (``['a'][3]``) of the first value inside containers that
    satisfies ``pred``; used to name the culprit in error messages."""
    stack: List[Tuple[str, Any]] = [(prefix, obj)]
    seen: set = set()
    while stack:
        path, o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        try:
            if pred(o):
                return path or "<root>"
        except Exception:  # noqa: BLE001 - a predicate on odd objects
            pass
        if isinstance(o, dict):
            stack.extend((f"{path}[{k!r}]", v) for k, v in reversed(list(o.items())))
        elif isinstance(o, (list, tuple)):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(o))))
    return None


def _is_meta(o: Any) -> bool:
    return isinstance(o, torch.Tensor) and o.device.type == "meta"


class _StorageRef:
    """What the fast tensor reducer puts where torch puts a TypedStorage."""

    __slots__ = ("storage", "dtype")

    def __init__(self, storage: Any, dtype: torch.dtype) -> None:
        self.storage = storage
        self.dtype = dtype


_storage_type_cache: Dict[torch.dtype, Any] = {}


def _storage_type(dtype: torch.dtype) -> Any:
    t = _storage_type_cache.get(dtype)
    if t is None:
        typed = torch.storage.TypedStorage(dtype=dtype, device="cpu", _internal=True)
        t = _storage_type_cache[dtype] = getattr(torch, typed._pickle_storage_type())
    return t


def _v3_dtypes() -> frozenset:
    new = getattr(torch.storage, "_new_dtypes", None)
    return frozenset(new()) if new is not None else frozenset()


_V3_DTYPES = _v3_dtypes()
_get_metadata = getattr(torch._utils, "get_tensor_metadata", None)
# Types persistent_id can dismiss at once (it is called for every object).
_PLAIN = frozenset({str, int, float, bool, type(None), tuple, list, dict, bytes,
                    torch.Tensor, torch.Size, torch.dtype, torch.device})


class _Pickler(pickle.Pickler):
    """torch.save's pickler (same persistent ids, same bytes), with a fast
    reducer for plain dense tensors: torch's generic ``__reduce_ex__`` costs
    tens of microseconds a tensor, which dominates checkpoints made of
    thousands of small tensors."""

    def __init__(self, file: Any, known: Optional[Dict[int, Tuple[str, Any]]] = None) -> None:
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self.storages: Dict[str, Any] = {}
        #: storage ``_cdata`` -> key; seeded with the storages found up front.
        self._keys: Dict[int, str] = {c: k for c, (k, _) in (known or {}).items()}
        self._dtypes: Dict[int, torch.dtype] = {}

    def reducer_override(self, o: Any) -> Any:  # noqa: D102
        if (
            type(o) is torch.Tensor
            and o.layout is torch.strided
            and o.device.type == "cpu"
            and o.dtype not in _V3_DTYPES
            and not o.is_quantized
            and not o.__dict__
        ):
            # Exactly what Tensor._reduce_ex_internal returns for this case.
            args: tuple = (_StorageRef(o.untyped_storage(), o.dtype), o.storage_offset(),
                           tuple(o.size()), o.stride(), o.requires_grad, OrderedDict())
            if _get_metadata is not None:
                meta = _get_metadata(o)
                if meta:
                    args = args + (meta,)
            return (torch._utils._rebuild_tensor_v2, args)
        if isinstance(o, torch.Tensor) and o.device.type == "meta":
            # torch.save would store only the shape; a checkpoint of a tensor
            # that was never materialized is almost surely a bug.
            raise SerializationError(
                "a tensor on the meta device has no data to save; "
                "materialize it (e.g. module.to_empty(device='cpu')) first"
            )
        return NotImplemented

    def persistent_id(self, o: Any) -> Any:  # noqa: D102
        t = type(o)
        if t is _StorageRef:
            storage, dtype = o.storage, o.dtype
            return self._storage_id(o, storage, dtype, _storage_type(dtype),
                                    storage.nbytes() // _element_size(dtype))
        if t in _PLAIN:
            return None
        if isinstance(o, torch.storage.TypedStorage):
            return self._storage_id(o, o._untyped_storage, o.dtype,
                                    getattr(torch, o._pickle_storage_type()), o._size())
        if torch.is_storage(o):
            return self._storage_id(o, o, torch.uint8,
                                    torch.serialization.normalize_storage_type(type(o)), o.nbytes())
        return None

    def _storage_id(self, o: Any, storage: Any, dtype: torch.dtype, storage_type: Any, numel: int) -> tuple:
        """Mirror of the storage branch of torch.serialization._save's persistent_id."""
        if storage.device.type == "meta":
            raise SerializationError("a storage on the meta device has no data to save")
        ptr = storage.data_ptr()
        if ptr != 0:
            prev = self._dtypes.setdefault(ptr, dtype)
            if prev != dtype:
                raise SerializationError(
                    "cannot save multiple tensors or storages that view the same data "
                    f"as different types ({prev} and {dtype})"
                )
        key = self._keys.setdefault(storage._cdata, str(len(self._keys)))
        fake = getattr(o, "_fake_device", None)
        location = str(fake) if fake is not None else torch.serialization.location_tag(storage)
        self.storages[key] = storage
        return ("storage", storage_type, key, location, numel)


_elem_sizes: Dict[torch.dtype, int] = {}


def _element_size(dtype: torch.dtype) -> int:
    n = _elem_sizes.get(dtype)
    if n is None:
        n = _elem_sizes[dtype] = torch.empty((), dtype=dtype).element_size()
    return n


def _pickle(obj: Any, known: Optional[Dict[int, Tuple[str, Any]]] = None) -> Tuple[bytes, Dict[str, Any]]:
    """Pickle ``obj`` exactly as ``torch.serialization._save`` does, returning
    the pickle and the storages it refers to, by key. ``known`` storages
    (``_cdata`` -> (key, storage)) keep their keys."""
    buf = io.BytesIO()
    pickler = _Pickler(buf, known)
    try:
        pickler.dump(obj)
    except SerializationError as e:
        where = find_path(obj, _is_meta)
        if where is not None:
            raise SerializationError(f"{where}: {e}") from None
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise SerializationError(
            f"cannot serialize {_describe(obj)}: {type(e).__name__}: {e}"
        ) from e
    return buf.getvalue(), pickler.storages


def _local_extra(header_off: int, size: int, align: int, name_len: int) -> bytes:
    """Extra field of a local header: zip64 (when needed) plus padding that
    puts the data at a multiple of ``align``, computed as torch's writer does."""
    z64 = b""
    if size >= _U32 or header_off >= _U32:
        fields = b""
        if size >= _U32:
            fields += struct.pack("<QQ", 0, 0)  # sizes live in the data descriptor
        if header_off >= _U32:
            fields += struct.pack("<Q", header_off)
        z64 = struct.pack("<HH", 0x0001, len(fields)) + fields
    start = header_off + _LOCAL.size + name_len + len(z64) + 4
    pad = (-start) % align
    return z64 + struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB" padding field


def find_storages(obj: Any) -> Dict[int, Tuple[str, Any]]:
    """The storages of the dense tensors inside plain containers (dict,
    list, tuple), keyed as torch.save will key them: by first encounter in
    pickling order. Found before pickling, so their bytes can be on their
    way to disk while the pickle is made. Storages inside other objects are
    found by the pickler later."""
    found: Dict[int, Tuple[str, Any]] = {}
    stack: List[Any] = [obj]
    seen: set = set()
    while stack:
        o = stack.pop()
        t = type(o)
        if t is dict or t is OrderedDict or t is list or t is tuple:
            if id(o) in seen:
                continue
            seen.add(id(o))
            if t is list or t is tuple:
                stack.extend(reversed(o))
            else:
                for k, v in reversed(list(o.items())):
                    stack.append(v)
                    stack.append(k)
        elif isinstance(o, torch.Tensor) and o.layout is torch.strided and o.device.type != "meta":
            st = o.untyped_storage()
            if st._cdata not in found:
                found[st._cdata] = (str(len(found)), st)
    return found


class TorchZipLayout:
    """Lays out a torch.save file in two steps: :meth:`head` (the storages
    found before pickling, at the start of the file) and :meth:`tail` (the
    pickle, storages found only by the pickler, the small records and the
    central directory). Between the two, the head can be written."""

    def __init__(self, obj: Any, stage: Optional[Any] = None) -> None:
        """``stage(storage)`` says which storages are copied from a device
        through the staging path (default: CUDA storages)."""
        self.obj = obj
        self.stage = stage if stage is not None else (lambda st: st.device.type == "cuda")
        self.cursor = 0
        self.file_len = 0
        # (name, header offset, size, crc value or None, crc id or None)
        self.entries: List[Tuple[bytes, int, int, Optional[int], Optional[int]]] = []
        self.records: List[Tuple[str, int, int]] = []
        self.keepalive: List[Any] = []
        self.storage_keys: List[str] = []
        self.storage_bytes = 0
        self._batch = Batch()
        self._known = find_storages(obj)
        self._known_keys = {k for k, _ in self._known.values()}

    def head(self) -> Batch:
        """Records of the storages found up front."""
        for key, storage in self._known.values():
            self._add_storage(key, storage)
        return self._take()

    def tail(self) -> Batch:
        """Pickle the object, then lay out everything else. Raises
        :class:`SerializationError` when the object cannot be saved."""
        data_pkl, storages = _pickle(self.obj, self._known)
        for key, storage in storages.items():
            if key not in self._known_keys:
                self._add_storage(key, storage)
        self._add("data.pkl", len(data_pkl), SMALL_ALIGNMENT, data=data_pkl)
        self._add(".format_version", 1, SMALL_ALIGNMENT, data=b"1")
        align_b = str(STORAGE_ALIGNMENT).encode()
        self._add(".storage_alignment", len(align_b), SMALL_ALIGNMENT, data=align_b)
        order = sys.byteorder.encode()
        self._add("byteorder", len(order), SMALL_ALIGNMENT, data=order)
        self._add("version", 2, SMALL_ALIGNMENT, data=b"3\n")
        # torch's writer stores a 40-digit id; ours is derived from the content
        # so the same state writes the same bytes (ranks writing parts agree).
        sid = f"{_core.crc32(data_pkl):020d}{len(self.storage_keys) * 1000003 + self.storage_bytes:020d}"
        self._add(".data/serialization_id", len(sid), SMALL_ALIGNMENT, data=sid.encode())
        self._central_directory()
        self.file_len = self.cursor
        return self._take()

    def _take(self) -> Batch:
        b, self._batch = self._batch, Batch()
        b.end = self.cursor
        return b

    def _add_storage(self, key: str, storage: Any) -> None:
        staged = self.stage(storage)
        if not staged and storage.device.type != "cpu":
            # Other devices: copy to host memory (what torch.save does); the
            # pickle keeps the original location.
            storage = storage.cpu()
        crc_id = len(self.storage_keys)
        self.keepalive.append(storage)
        self.storage_keys.append(key)
        n = storage.nbytes()
        self.storage_bytes += n
        self._add(f"data/{key}", n, STORAGE_ALIGNMENT, region=(storage.data_ptr(), crc_id),
                  device=storage if staged else None)

    def _blob(self, data: bytes) -> None:
        self._batch.blobs.append((self.cursor, data))
        self.cursor += len(data)

    def _add(
        self,
        name: str,
        size: int,
        align: int,
        data: Optional[bytes] = None,
        region: Optional[Tuple[int, int]] = None,
        device: Optional[Any] = None,
    ) -> None:
        """A record holding ``data`` (small, bytes) or ``region`` (address,
        checksum id), ``size`` bytes either way; with ``device``, the region
        is that storage, to be staged from its device."""
        name_b = f"{ARCHIVE_NAME}/{name}".encode()
        header_off = self.cursor
        extra = _local_extra(header_off, size, align, len(name_b))
        head = _LOCAL.pack(0x04034B50, 20 if size < _U32 and header_off < _U32 else 45,
                           _FLAGS, 0, 0, 0, 0, 0, 0, len(name_b), len(extra))
        self._blob(head + name_b + extra)
        data_off = self.cursor
        crc: Optional[int] = None
        crc_id: Optional[int] = None
        if data is not None:
            crc = _core.crc32(data)
            if size:
                self._blob(data)
        else:
            assert region is not None
            ptr, crc_id = region
            if size and device is not None:
                self._batch.device.append((data_off, device, size, crc_id))
            elif size:
                self._batch.regions.append((data_off, ptr, size, crc_id))
            self.cursor += size
        self.records.append((name, data_off, size))
        # Data descriptor: signature, CRC, compressed and uncompressed sizes
        # (64-bit when the record or its offset needs zip64, as miniz does).
        wide = size >= _U32 or header_off >= _U32
        sizes = struct.pack("<QQ", size, size) if wide else struct.pack("<II", size, size)
        self._blob(struct.pack("<I", 0x08074B50))
        self._crc(crc, crc_id)
        self._blob(sizes)
        self.entries.append((name_b, header_off, size, crc, crc_id))

    def _crc(self, value: Optional[int], crc_id: Optional[int]) -> None:
        if crc_id is None:
            self._blob(struct.pack("<I", value or 0))
        else:
            self._batch.slots.append((self.cursor, crc_id))
            self.cursor += 4

    def _central_directory(self) -> None:
        cd_start = self.cursor
        for name_b, header_off, size, crc, crc_id in self.entries:
            fields = b""
            if size >= _U32:
                fields += struct.pack("<QQ", size, size)
            if header_off >= _U32:
                fields += struct.pack("<Q", header_off)
            extra = struct.pack("<HH", 0x0001, len(fields)) + fields if fields else b""
            small = min(size, _U32)
            head = _CENTRAL.pack(
                0x02014B50, (3 << 8) | 45, 45 if fields else 20, _FLAGS, 0, 0, 0,
                0, small, small, len(name_b), len(extra), 0, 0, 0, 0, min(header_off, _U32),
            )
            # CRC sits at byte 16 of the central header.
            self._blob(head[:16])
            self._crc(crc, crc_id)
            self._blob(head[20:] + name_b + extra)
        cd_size = self.cursor - cd_start
        n = len(self.entries)
        if n >= _U16 or cd_size >= _U32 or cd_start >= _U32:
            eocd64_off = self.cursor
            self._blob(_EOCD64.pack(0x06064B50, 44, (3 << 8) | 45, 45, 0, 0, n, n, cd_size, cd_start))
            self._blob(_LOCATOR64.pack(0x07064B50, 0, eocd64_off, 1))
        self._blob(_EOCD.pack(0x06054B50, 0, 0, min(n, _U16), min(n, _U16),
                              min(cd_size, _U32), min(cd_start, _U32), 0))


def plan_torch_save(obj: Any, stage: Optional[Any] = None) -> Plan:
    """Describe the whole ``torch.save`` file of ``obj`` at once. Without
    ``stage`` every storage is in host memory (device storages are copied to
    the host); with it, the storages it selects are left on their device, in
    ``plan.device``."""
    z = TorchZipLayout(obj, stage=stage or (lambda st: False))
    plan = Plan()
    plan.extend(z.head())
    plan.extend(z.tail())
    plan.file_len = z.file_len
    plan.keepalive = z.keepalive
    plan.records = z.records
    plan.storage_keys = z.storage_keys
    plan.storage_bytes = z.storage_bytes
    return plan


# ---------------------------------------------------------------------------
# Reading: the central directory of a torch zip checkpoint.


@dataclass(frozen=True)
class ZipRecord:
    """One stored record of a zip file."""

    name: str
    header_offset: int
    data_offset: int
    size: int
    crc32: int


_EOCD_SIG = b"PK\x05\x06"
_EOCD64_LOC_SIG = b"PK\x06\x07"


def _corrupt(msg: str) -> Exception:
    from .errors import CorruptCheckpointError

    return CorruptCheckpointError(msg)


def read_zip_directory(fd: int, file_len: int, path: str = "") -> List[ZipRecord]:
    """Parse the central directory (zip64 included) and every local header.
    Every offset and length is checked against the file; anything odd raises
    :class:`~fastpersist.CorruptCheckpointError` naming what is wrong."""
    where = f"{path}: " if path else ""
    tail_len = min(file_len, _EOCD.size + 0xFFFF)
    tail = os.pread(fd, tail_len, file_len - tail_len)
    if len(tail) != tail_len:
        raise _corrupt(f"{where}short read of the end of the file")
    pos = tail.rfind(_EOCD_SIG)
    if pos < 0 or pos + _EOCD.size > len(tail):
        raise _corrupt(f"{where}no zip end-of-central-directory record (truncated or not a checkpoint)")
    eocd_off = file_len - tail_len + pos
    _, _, _, _, n, cd_size, cd_off, _ = _EOCD.unpack_from(tail, pos)
    if n == _U16 or cd_size == _U32 or cd_off == _U32:
        loc_at = eocd_off - _LOCATOR64.size
        if loc_at < 0:
            raise _corrupt(f"{where}zip64 locator missing")
        loc = os.pread(fd, _LOCATOR64.size, loc_at)
        if len(loc) != _LOCATOR64.size or loc[:4] != _EOCD64_LOC_SIG:
            raise _corrupt(f"{where}zip64 locator missing")
        _, _, e64_off, _ = _LOCATOR64.unpack(loc)
        if e64_off + _EOCD64.size > loc_at:
            raise _corrupt(f"{where}zip64 end record points outside the file")
        e64 = os.pread(fd, _EOCD64.size, e64_off)
        if len(e64) != _EOCD64.size or e64[:4] != b"PK\x06\x06":
            raise _corrupt(f"{where}bad zip64 end record")
        (_, _, _, _, _, _, _, n, cd_size, cd_off) = _EOCD64.unpack(e64)
    if cd_off + cd_size > eocd_off or n * _CENTRAL.size > cd_size:
        raise _corrupt(f"{where}central directory ({n} entries, {cd_size} bytes at {cd_off}) "
                       f"does not fit in the file")
    cd = os.pread(fd, cd_size, cd_off)
    if len(cd) != cd_size:
        raise _corrupt(f"{where}short read of the central directory")
    entries = []
    p = 0
    for i in range(n):
        if p + _CENTRAL.size > cd_size:
            raise _corrupt(f"{where}central directory entry {i} is truncated")
        (sig, _, _, flags, method, _, _, crc, csize, usize, nlen, xlen, clen,
         _, _, _, hoff) = _CENTRAL.unpack_from(cd, p)
        if sig != 0x02014B50:
            raise _corrupt(f"{where}central directory entry {i} has a bad signature")
        end = p + _CENTRAL.size + nlen + xlen + clen
        if end > cd_size:
            raise _corrupt(f"{where}central directory entry {i} is truncated")
        raw_name = cd[p + _CENTRAL.size:p + _CENTRAL.size + nlen]
        try:
            name = raw_name.decode("utf-8" if flags & 0x800 else "cp437")
        except UnicodeDecodeError:
            raise _corrupt(f"{where}central directory entry {i} has an undecodable name") from None
        extra = cd[p + _CENTRAL.size + nlen:p + _CENTRAL.size + nlen + xlen]
        if usize == _U32 or csize == _U32 or hoff == _U32:
            usize, csize, hoff = _zip64_fields(extra, usize, csize, hoff, name, where)
        if method != 0 or csize != usize:
            raise _corrupt(f"{where}record {name!r} is compressed (method {method}); "
                           f"checkpoints store records uncompressed")
        entries.append((name, hoff, usize, crc))
        p = end
    records = []
    for name, hoff, size, crc in entries:
        if hoff + _LOCAL.size > file_len:
            raise _corrupt(f"{where}record {name!r}: local header at {hoff} is outside the file")
        lh = os.pread(fd, _LOCAL.size, hoff)
        sig, *_rest = _LOCAL.unpack(lh)
        if sig != 0x04034B50:
            raise _corrupt(f"{where}record {name!r}: bad local header signature at {hoff}")
        nlen, xlen = _rest[-2], _rest[-1]
        data_off = hoff + _LOCAL.size + nlen + xlen
        if data_off + size > file_len:
            raise _corrupt(f"{where}record {name!r}: {size} bytes at {data_off} extend past the end "
                           f"of the file ({file_len} bytes)")
        local_name = os.pread(fd, nlen, hoff + _LOCAL.size)
        if local_name != name.encode("utf-8") and local_name.decode("cp437", "replace") != name:
            raise _corrupt(f"{where}record {name!r}: local header names {local_name!r}")
        records.append(ZipRecord(name, hoff, data_off, size, crc))
    return records


def _zip64_fields(extra: bytes, usize: int, csize: int, hoff: int, name: str, where: str) -> Tuple[int, int, int]:
    p = 0
    while p + 4 <= len(extra):
        tag, ln = struct.unpack_from("<HH", extra, p)
        body = extra[p + 4:p + 4 + ln]
        if tag == 0x0001:
            vals = [struct.unpack_from("<Q", body, 8 * k)[0] for k in range(len(body) // 8)]
            k = 0
            try:
                if usize == _U32:
                    usize, k = vals[k], k + 1
                if csize == _U32:
                    csize, k = vals[k], k + 1
                if hoff == _U32:
                    hoff, k = vals[k], k + 1
            except IndexError:
                break
            return usize, csize, hoff
        p += 4 + ln
    raise _corrupt(f"{where}record {name!r}: zip64 sizes missing")
