"""What the engine writes: a file described as pieces at file offsets.

A leaf module (it imports only :mod:`fastpersist.errors`). Formats (:mod:`fastpersist.torch_zip`,
:mod:`fastpersist.safetensors_format`) produce :class:`Batch` and
:class:`Plan` objects; writers hand their lists to the engine as they are
(the named tuples below are plain tuples to the extension).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple

from .errors import StorageChangedError

__all__ = [
    "DATA_ALIGNMENT",
    "GUARD_WINDOW",
    "HANDOFF_RECORDS",
    "Blob",
    "Region",
    "Slot",
    "DeviceRegion",
    "Batch",
    "Plan",
    "MemoryGuard",
    "split_regions",
]

#: Alignment of tensor data in every format fastpersist writes (the page
#: size and O_DIRECT block): the bulk of a file goes out from aligned buffers.
DATA_ALIGNMENT = 4096


#: Most bytes of caller memory gathered between two checks of the storages
#: they come from (:meth:`MemoryGuard.windows`).
GUARD_WINDOW = 64 << 20

#: Records a layout loop lays out between two chances for an engine thread
#: that waits for the GIL (to gather the parts laid out before) to take it
#: (``_core.let_engines_in``).
HANDOFF_RECORDS = 32


class Blob(NamedTuple):
    """Bytes the plan owns (headers, the pickle, small records)."""

    offset: int
    data: bytes


class Region(NamedTuple):
    """Caller memory written to the file: ``length`` bytes at ``address``
    (kept alive by the plan's ``keepalive``), checksummed as ``crc_id``."""

    offset: int
    address: int
    length: int
    crc_id: int


class Slot(NamedTuple):
    """Four bytes that receive the final CRC32 of checksum ``crc_id``."""

    offset: int
    crc_id: int


class DeviceRegion(NamedTuple):
    """A storage on a device, staged to the host chunk by chunk."""

    offset: int
    storage: Any
    length: int
    crc_id: int


class MemoryGuard:
    """The storages that a plan's regions point into, as they were when the
    plan was made (checksum id -> storage, its data pointer and size).

    The plan holds the storage objects, so they cannot be freed; what holding
    them cannot stop is ``storage.resize_()`` (or a tensor grown in place)
    replacing their memory. So caller memory is read only under the GIL
    (which a resize called from Python code needs to begin), right after
    the storage it lies in was found unchanged: the engine does that for
    each extent it gathers (the extension's GIL guard reads ``_owners``
    without running Python code, so the GIL cannot move in between), as do
    ``_core.copy_memory`` and ``_core.crc32_ranges``. A changed storage
    raises :class:`StorageChangedError`; the save is abandoned. torch gives
    the GIL up inside ``resize_()``, so a resize begun by another thread
    before the check can free the memory during the read: the core's reads
    of caller memory then go on over zero pages and fail the save with the
    same error (``src/vanish.rs``; see the README for what is left).
    """

    def __init__(self) -> None:
        self._owners: Dict[int, Tuple[Any, int, int, str]] = {}

    def watch(self, crc_id: int, storage: Any, name: str) -> None:
        """Remember ``storage`` (anything with ``data_ptr()`` and
        ``nbytes()``) as the memory behind checksum ``crc_id``."""
        self._owners[crc_id] = (storage, storage.data_ptr(), storage.nbytes(), name)

    def watch_many(self, crc_ids: Iterable[int], storages: Iterable[Any], ptrs: Iterable[int],
                   sizes: Iterable[int], names: Iterable[str]) -> None:  # fmt: skip
        """:meth:`watch` for many storages at once, their data pointers and
        sizes already read (under the GIL, as a caller laying out records
        reads them)."""
        self._owners.update(zip(crc_ids, zip(storages, ptrs, sizes, names)))

    def __bool__(self) -> bool:
        return bool(self._owners)

    def check(self, crc_ids: Optional[Iterable[int]] = None) -> None:
        """Raise :class:`StorageChangedError` when a watched storage (those of
        ``crc_ids``, or all of them when none are given) no longer has the
        data pointer and size it had when planned."""
        ids = self._owners.keys() if crc_ids is None else set(crc_ids)
        for cid in ids:
            owner = self._owners.get(cid)
            if owner is None:
                continue
            storage, ptr, nbytes, name = owner
            now_ptr, now_n = storage.data_ptr(), storage.nbytes()
            if now_ptr != ptr or now_n != nbytes:
                raise StorageChangedError(
                    f"the storage of {name} changed while it was being saved ({nbytes} bytes at {ptr:#x}, "
                    f"now {now_n} bytes at {now_ptr:#x}): it was resized or freed; tensors must stay as they "
                    "are until the save has gathered them (the file was not written)"
                )


def split_regions(regions: Iterable[Region], window: int = GUARD_WINDOW) -> Iterator[List[Region]]:
    """``regions`` (in file order) cut into runs of at most ``window`` bytes;
    a region larger than that is split (its checksum runs on over the pieces,
    which stay in order)."""
    run: List[Region] = []
    size = 0
    for r in regions:
        off, addr, length = r.offset, r.address, r.length
        while length:
            take = min(length, window - size)
            run.append(Region(off, addr, take, r.crc_id))
            off, addr, length, size = off + take, addr + take, length - take, size + take
            if size == window:
                yield run
                run, size = [], 0
    if run:
        yield run


@dataclass
class Batch:
    """Consecutive pieces of a file, as one engine call takes them."""

    blobs: List[Blob] = field(default_factory=list)
    regions: List[Region] = field(default_factory=list)
    slots: List[Slot] = field(default_factory=list)
    #: Storages to stage from a device.
    device: List[DeviceRegion] = field(default_factory=list)
    #: End of the last piece.
    end: int = 0
    #: Bytes of the file (from its start) to reserve before this batch is
    #: written: where the whole file's size was not known when it was begun.
    reserve: int = 0

    def extend(self, other: Batch) -> None:
        self.blobs += other.blobs
        self.regions += other.regions
        self.slots += other.slots
        self.device += other.device
        self.end = max(self.end, other.end)

    def split_at(self, offset: int) -> Tuple[Batch, Batch]:
        """The pieces before ``offset`` and the rest (device storages stay
        with the second part)."""
        lo, hi = Batch(), Batch()
        for b in self.blobs:
            (lo if b[0] < offset else hi).blobs.append(b)
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
    #: The same storages, checked before their memory is read.
    guard: MemoryGuard = field(default_factory=MemoryGuard)
    #: Record names in file order, with (data offset, length).
    records: List[Tuple[str, int, int]] = field(default_factory=list)
    #: Storage keys in checksum-id order.
    storage_keys: List[str] = field(default_factory=list)
    storage_bytes: int = 0
