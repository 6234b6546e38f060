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
import pickle
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _core
from .errors import SerializationError

__all__ = ["Plan", "plan_torch_save", "STORAGE_ALIGNMENT", "ARCHIVE_NAME"]

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
class Plan:
    """A file described for :meth:`fastpersist._core.Engine.write_file`."""

    blobs: List[Tuple[int, bytes]] = field(default_factory=list)
    regions: List[Tuple[int, int, int, int]] = field(default_factory=list)
    slots: List[Tuple[int, int]] = field(default_factory=list)
    file_len: int = 0
    #: Storages (and copies of non-CPU storages) the regions point into: kept
    #: alive until the write is over.
    keepalive: List[Any] = field(default_factory=list)
    #: Record names in file order, with (data offset, length).
    records: List[Tuple[str, int, int]] = field(default_factory=list)
    #: Storage keys in checksum-id order.
    storage_keys: List[str] = field(default_factory=list)

    @property
    def storage_bytes(self) -> int:
        return sum(r[2] for r in self.regions)


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


def _pickle(obj: Any) -> Tuple[bytes, Dict[str, Any]]:
    """Pickle ``obj`` exactly as ``torch.serialization._save`` does, returning
    the pickle and the storages it refers to, by key."""
    storages: Dict[str, Any] = {}
    id_map: Dict[int, str] = {}
    storage_dtypes: Dict[int, torch.dtype] = {}

    def persistent_id(o: Any) -> Any:
        if isinstance(o, torch.Tensor) and o.device.type == "meta":
            # torch.save would store only the shape; a checkpoint of a tensor
            # that was never materialized is almost surely a bug.
            raise SerializationError(
                "a tensor on the meta device has no data to save; "
                "materialize it (e.g. module.to_empty(device='cpu')) first"
            )
        if isinstance(o, torch.storage.TypedStorage) or torch.is_storage(o):
            if isinstance(o, torch.storage.TypedStorage):
                storage = o._untyped_storage
                storage_dtype = o.dtype
                storage_type = getattr(torch, o._pickle_storage_type())
                storage_numel = o._size()
            else:
                storage = o
                storage_dtype = torch.uint8
                storage_type = torch.serialization.normalize_storage_type(type(o))
                storage_numel = storage.nbytes()
            if storage.device.type == "meta":
                raise SerializationError(
                    "a tensor on the meta device has no data to save; "
                    "materialize it (e.g. .to_empty(device='cpu')) first"
                )
            if storage.data_ptr() != 0:
                prev = storage_dtypes.setdefault(storage.data_ptr(), storage_dtype)
                if prev != storage_dtype:
                    raise SerializationError(
                        "cannot save multiple tensors or storages that view the same data "
                        f"as different types ({prev} and {storage_dtype})"
                    )
            key = id_map.setdefault(storage._cdata, str(len(id_map)))
            fake = getattr(o, "_fake_device", None)
            location = str(fake) if fake is not None else torch.serialization.location_tag(storage)
            storages[key] = storage
            return ("storage", storage_type, key, location, storage_numel)
        return None

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:  # noqa: D102
            return persistent_id(o)

    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=PICKLE_PROTOCOL).dump(obj)
    except SerializationError as e:
        where = find_path(obj, _is_meta)
        if where is not None:
            raise SerializationError(f"{where}: {e}") from None
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise SerializationError(
            f"cannot serialize {_describe(obj)}: {type(e).__name__}: {e}"
        ) from e
    return buf.getvalue(), storages


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


class _ZipBuilder:
    """Lays out records one after another and the central directory after."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.cursor = 0
        # (name, header offset, size, crc value or None, crc id or None)
        self.entries: List[Tuple[bytes, int, int, Optional[int], Optional[int]]] = []

    def _blob(self, data: bytes) -> None:
        self.plan.blobs.append((self.cursor, data))
        self.cursor += len(data)

    def add(
        self,
        name: str,
        size: int,
        align: int,
        data: Optional[bytes] = None,
        region: Optional[Tuple[int, int]] = None,
    ) -> None:
        """A record holding ``data`` (small, bytes) or ``region`` (address,
        checksum id), ``size`` bytes either way."""
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
            if size:
                self.plan.regions.append((data_off, ptr, size, crc_id))
            self.cursor += size
        self.plan.records.append((name, data_off, size))
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
            self.plan.slots.append((self.cursor, crc_id))
            self.cursor += 4

    def finish(self) -> None:
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
        self.plan.file_len = self.cursor


def plan_torch_save(obj: Any) -> Plan:
    """Describe the ``torch.save`` file of ``obj`` (see the module doc)."""
    data_pkl, storages = _pickle(obj)
    plan = Plan()
    z = _ZipBuilder(plan)
    z.add("data.pkl", len(data_pkl), SMALL_ALIGNMENT, data=data_pkl)
    z.add(".format_version", 1, SMALL_ALIGNMENT, data=b"1")
    align_b = str(STORAGE_ALIGNMENT).encode()
    z.add(".storage_alignment", len(align_b), SMALL_ALIGNMENT, data=align_b)
    order = sys.byteorder.encode()
    z.add("byteorder", len(order), SMALL_ALIGNMENT, data=order)
    for crc_id, (key, storage) in enumerate(storages.items()):
        if storage.device.type != "cpu":
            # Until the CUDA staging path handles it, copy to host memory
            # (what torch.save does); the pickle keeps the original location.
            storage = storage.cpu()
        plan.keepalive.append(storage)
        plan.storage_keys.append(key)
        z.add(f"data/{key}", storage.nbytes(), STORAGE_ALIGNMENT,
              region=(storage.data_ptr(), crc_id))
    z.add("version", 2, SMALL_ALIGNMENT, data=b"3\n")
    # torch's writer stores a 40-digit id; ours is derived from the content so
    # the same state writes the same bytes (ranks writing parts must agree).
    sid = f"{_core.crc32(data_pkl):020d}{len(storages) * 1000003 + plan.storage_bytes:020d}"[:40]
    z.add(".data/serialization_id", len(sid), SMALL_ALIGNMENT, data=sid.encode())
    z.finish()
    return plan
