"""What the engine writes: a file described as pieces at file offsets.

A leaf module (no fastpersist imports). Formats (:mod:`fastpersist.torch_zip`,
:mod:`fastpersist.safetensors_format`) produce :class:`Batch` and
:class:`Plan` objects; writers hand their lists to the engine as they are
(the named tuples below are plain tuples to the extension).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, NamedTuple, Tuple

__all__ = ["DATA_ALIGNMENT", "Blob", "Region", "Slot", "DeviceRegion", "Batch", "Plan"]

#: Alignment of tensor data in every format fastpersist writes (the page
#: size and O_DIRECT block): the bulk of a file goes out from aligned buffers.
DATA_ALIGNMENT = 4096


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
    #: Record names in file order, with (data offset, length).
    records: List[Tuple[str, int, int]] = field(default_factory=list)
    #: Storage keys in checksum-id order.
    storage_keys: List[str] = field(default_factory=list)
    storage_bytes: int = 0
