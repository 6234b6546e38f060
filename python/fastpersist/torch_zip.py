"""torch.save's zip format, laid out for the fastpersist engine.

This module turns any object ``torch.save`` accepts into a
:class:`~fastpersist.plan.Plan`: the
exact bytes of every zip header, the pickle, and the address and length of
every tensor storage, each at its offset in the file. The Rust engine then
gathers those pieces into aligned buffers and writes them with O_DIRECT.

The file is what ``torch.save`` writes (same record names, same pickle,
flags 0x808 with data descriptors (an empty record: 0x800 and none, as
torch's writer writes it), uncompressed, zip64 where needed, storage
records 64-byte aligned as torch aligns them by default), except that the
storage records come first, so their bytes can be on their way to disk while
the pickle is made. The engine cuts the file into block-aligned extents
whatever the records' alignment (their bytes are gathered into aligned
buffers, or written from memory placed to match, as a snapshot's is).
Local headers are padded the way torch's own writer (miniz) pads them, so
readers that compute record offsets instead of reading them still agree.
CRC32s are not known when the plan is made: the data descriptors and the
central directory hold *slots* that the engine fills while it writes.
"""

from __future__ import annotations

import os
import struct
import sys
from dataclasses import dataclass
from typing import Any, Iterator, List, NamedTuple, Optional, Set, Tuple

from . import _core
from .errors import CorruptCheckpointError, UnsupportedFormatError
from .options import EngineOptions, RangeBuffer, read_records
from .pickling import CPU_DEVICE, TensorVersions, pickle_obj, survey_storages
from .plan import HANDOFF_RECORDS, Batch, Blob, DeviceRegion, MemoryGuard, Plan, Region, Slot

__all__ = [
    "TorchZipLayout",
    "plan_torch_save",
    "ZipRecord",
    "read_zip_directory",
    "read_central_directory",
    "resolve_records",
    "predict_records",
    "confirm_predicted",
    "overlap_of",
    "ZipDirectory",
    "serialization_id",
    "written_by_fastpersist",
    "unrecorded_crcs",
    "STORAGE_ALIGNMENT",
    "SMALL_ALIGNMENT",
    "ARCHIVE_NAME",
]

#: Alignment of the small records (torch's own default).
SMALL_ALIGNMENT = 64
#: Alignment of every ``data/<key>`` record: torch's own default
#: (``torch.utils.serialization.config.save.storage_alignment``), recorded
#: in ``.storage_alignment``. Page alignment (``DATA_ALIGNMENT``) would pad
#: each record by 2 KiB on average, 2% of a file of 10,000 small tensors,
#: and gains nothing: records are gathered into aligned buffers, and memory
#: written in place (a snapshot, a staging slot) is placed to match.
STORAGE_ALIGNMENT = SMALL_ALIGNMENT
#: Prefix of every record name; torch.load ignores it.
ARCHIVE_NAME = "archive"


#: Storage bytes in the first part of a head laid out in parts; each later
#: part holds twice as many, up to HEAD_PART_MAX.
HEAD_FIRST_PART = 8 << 20
HEAD_PART_MAX = 512 << 20
#: Records of storages in host memory laid out between two chances for an
#: engine thread waiting for the GIL (a chunk costs about what
#: HANDOFF_RECORDS records laid out one by one do).
HOST_CHUNK = 4 * HANDOFF_RECORDS

_U32 = 0xFFFFFFFF
_U16 = 0xFFFF
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
_SIGNATURE = struct.pack("<I", 0x08074B50)  # of a data descriptor
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_EOCD = struct.Struct("<IHHHHIIH")  # 22 bytes
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_LOCATOR64 = struct.Struct("<IIQI")  # 20 bytes


def _on_cuda(storage: Any) -> bool:
    """The default staging predicate: a CUDA storage."""
    dev = storage.device
    return bool(dev != CPU_DEVICE and dev.type == "cuda")


class TorchZipLayout:
    """Lays out a torch.save file in two steps: :meth:`head` (the storages
    found before pickling, at the start of the file; or :meth:`head_parts`,
    the same in parts, which another thread can lay out and write while
    this one pickles) and :meth:`tail` (the pickle, storages found only by
    the pickler, the small records and the central directory). Between the
    two, the head can be written."""

    def __init__(
        self,
        obj: Any,
        stage: Optional[Any] = None,
        alignment: int = STORAGE_ALIGNMENT,
        versions: Optional[TensorVersions] = None,
    ) -> None:
        """``stage(storage)`` says which storages are copied from a device
        through the staging path (default: CUDA storages). ``alignment``:
        of the ``data/<key>`` records (a power of two, at least 64; recorded
        in ``.storage_alignment``). ``versions``: tensors the pickler finds
        that it does not know yet are added to it."""
        if alignment < SMALL_ALIGNMENT or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two >= {SMALL_ALIGNMENT}, not {alignment}")
        self.obj = obj
        self.versions = versions
        self.alignment = alignment
        self.stage = stage if stage is not None else _on_cuda
        self.cursor = 0
        self.file_len = 0
        # (name, header offset, size, crc value or None, crc id or None)
        self.entries: List[Tuple[bytes, int, int, Optional[int], Optional[int]]] = []
        self.records: List[Tuple[str, int, int]] = []
        self.keepalive: List[Any] = []
        #: What the regions point into, checked before it is read.
        self.guard = MemoryGuard()
        self.storage_keys: List[str] = []
        self.storage_bytes = 0
        self._batch = Batch()
        survey = versions.survey_of(obj) if versions is not None else None
        if survey is None:
            survey = survey_storages(obj)
        # Laid out before pickling: only the storages the pickler is sure to
        # meet first, in this order. torch's own files number and place
        # storages in the order the pickle first meets them, and torch.load
        # relies on it where it computes offsets instead of reading each
        # record's header (the meta device, a FakeTensorMode,
        # calculate_storage_offsets); the pickler numbers the rest as it
        # meets them, and they follow in that order.
        self._known = survey.first()
        self._survey = survey
        self._known_keys = {k for k, _ in self._known.values()}
        # Set once head_parts has laid out its last part.
        self._head_started = False
        self._head_complete = False

    def head(self) -> Batch:
        """Records of the storages found up front."""
        whole = Batch()
        for part in self.head_parts():
            whole.extend(part)
        return whole

    def head_parts(self, first: int = HEAD_FIRST_PART) -> Iterator[Batch]:
        """:meth:`head` in parts, in file order: the first holds about
        ``first`` storage bytes, each later one twice as many (at most
        ``HEAD_PART_MAX``), so the first part can be on its way to disk
        while the rest is laid out. :meth:`tail` refuses to go on unless
        every part was laid out."""
        if self._head_started:
            raise RuntimeError("the head is laid out once")
        self._head_started = True
        # Every storage found up front in host memory and none to stage: laid
        # out a chunk at a time (the common case), else one by one.
        host = self.stage is _on_cuda and not self._survey.off_cpu
        yield from self._parts(list(self._known.values()), first, host)
        more, reserve = self._rest_of_survey()
        if more:
            # From a small part again: the device has work soon after the
            # reservation, which waits for the writes in flight.
            parts = self._parts(more, first, host)
            part = next(parts)
            part.reserve = reserve
            yield part
            yield from parts
        self._head_complete = True

    def _parts(self, items: List[Tuple[str, Any]], first: int, host: bool) -> Iterator[Batch]:
        """The records of ``items`` in parts (see :meth:`head_parts`)."""
        budget, pending = first, 0
        batch: List[Tuple[str, Any]] = []
        for i, item in enumerate(items):
            if not i % HANDOFF_RECORDS:
                _core.let_engines_in()  # the writer may wait to gather earlier parts
            batch.append(item)
            pending += item[1].nbytes()
            if pending >= budget:
                self._add_storages(batch, host)
                batch = []
                yield self._take()
                budget, pending = min(budget * 2, HEAD_PART_MAX), 0
        self._add_storages(batch, host)
        part = self._take()
        if part.blobs or part.regions or part.device:
            yield part

    def _rest_of_survey(self) -> Tuple[List[Tuple[str, Any]], int]:
        """For a survey stopped early (``writer.SURVEY_FIRST``), once the storages
        found at the call are laid out: the rest of the storages the pickler
        meets first, in order, and where the head will end at most (the
        space to reserve before they are written). None to add when those
        found at the call end before the pickler's order does, or when the
        rest may hold storages to stage (the pickler numbers them, after the
        ones laid out, and the tail stages them)."""
        survey = self._survey
        if survey.rest is None or (survey.ordered is not None and survey.ordered < len(survey.storages)):
            return [], 0
        whole = survey.whole()
        if whole.off_cpu or self.stage is not _on_cuda:
            return [], 0
        first = whole.first()
        more = list(first.values())[len(self._known) :]
        self._known = first
        self._survey = whole
        self._known_keys.update(key for key, _ in more)
        if len(first) == len(whole.storages):
            nbytes = whole.nbytes - survey.nbytes
        else:
            nbytes = sum(st.nbytes() for _, st in more)
        return more, self.cursor + nbytes + len(more) * (self.alignment + 128)

    def head_hints(self) -> Tuple[int, Set[Any]]:
        """Before the head is laid out: an upper bound of where it ends (to
        reserve the file's space) and the devices of the storages it will
        stage (their copy streams are set up at the call)."""
        # Each record's bytes, header, name, zip64 and padding fields, descriptor.
        nbytes = self._survey.nbytes
        if len(self._known) < len(self._survey.storages):
            nbytes = sum(st.nbytes() for _, st in self._known.values())
        end = nbytes + len(self._known) * (self.alignment + 128)
        # Only storages off the CPU are staged, unless a test stages them all.
        staged = self._survey.off_cpu if self.stage is _on_cuda else [st for _, st in self._known.values()]
        return end, {storage.device for storage in staged if self.stage(storage)}

    def tail(self) -> Batch:
        """Pickle the object, then lay out everything else. Raises
        :class:`SerializationError` when the object cannot be saved."""
        if self._known and not self._head_complete:
            raise RuntimeError("the head of the file was not laid out to its end")
        try:
            data_pkl, storages = pickle_obj(self.obj, self._known, self.versions)
        except Exception:
            # A storage laid out in the head and resized or freed since (under
            # the save) is the cause, whether or not the engine met it yet;
            # else the error is the pickle's own (or the saved object's).
            self.guard.check()
            raise
        self._add_storages([(key, st) for key, st in storages.items() if key not in self._known_keys])
        self._add("data.pkl", data_pkl)
        self._add(".format_version", b"1")
        align_b = str(self.alignment).encode()
        self._add(".storage_alignment", align_b)
        order = sys.byteorder.encode()
        self._add("byteorder", order)
        self._add("version", b"3\n")
        # torch's writer stores a 40-digit id; ours is derived from the content
        # so the same state writes the same bytes (ranks writing parts agree).
        sid = serialization_id(data_pkl, len(self.storage_keys), self.storage_bytes)
        self._add(".data/serialization_id", sid.encode())
        self._central_directory()
        self.file_len = self.cursor
        return self._take()

    def laid_out(self) -> None:
        """Every byte of the file has been gathered: let go of what only
        laying it out needed (the records' and entries' bookkeeping, the
        storages found up front); :attr:`guard`, :attr:`storage_keys` and
        :attr:`storage_bytes` stay."""
        self.records = []
        self.entries = []
        self._known = {}
        self._known_keys = set()
        del self.keepalive[:]

    def _take(self) -> Batch:
        b, self._batch = self._batch, Batch()
        b.end = self.cursor
        return b

    def _add_storages(self, items: List[Tuple[str, Any]], host: bool = False) -> None:
        """Lay out the records of ``items`` ((key, storage), in file order);
        ``host``: every storage is in host memory and none is staged."""
        if not items:
            return
        recs, staged_at = (self._host_records(items), []) if host else self._records_one_by_one(items)
        blobs, regions, slots, offsets, self.cursor = _core.zip_storage_records(
            self.cursor, self.alignment, recs, (Blob, Region, Slot)
        )
        b = self._batch
        b.blobs += blobs
        b.regions += regions
        b.slots += slots
        for i, storage in staged_at:
            _, n, _, crc_id, _ = recs[i]
            b.device.append(DeviceRegion(offsets[i][1], storage, n, crc_id))
        self.records += [(f"data/{key}", data_off, n) for (key, _), (_, n, _, _, _), (_, data_off) in
                         zip(items, recs, offsets)]  # fmt: skip
        self.entries += [(name_b, header_off, n, None, crc_id) for (name_b, n, _, crc_id, _), (header_off, _) in
                         zip(recs, offsets)]  # fmt: skip

    def _host_records(self, items: List[Tuple[str, Any]]) -> List[Tuple[bytes, int, int, int, bool]]:
        """The records of storages in host memory, none staged, and their
        bookkeeping, a chunk at a time (list comprehensions, an engine
        thread let in between chunks)."""
        recs: List[Tuple[bytes, int, int, int, bool]] = []
        prefix = f"{ARCHIVE_NAME}/data/"
        for lo in range(0, len(items), HOST_CHUNK):
            _core.let_engines_in()  # the writer may wait to gather earlier parts
            chunk = items[lo : lo + HOST_CHUNK]
            keys = [key for key, _ in chunk]
            storages = [storage for _, storage in chunk]
            sizes: List[int] = [storage.nbytes() for storage in storages]
            ptrs: List[int] = [storage.data_ptr() for storage in storages]
            ids = range(len(self.storage_keys), len(self.storage_keys) + len(chunk))
            self.keepalive += storages
            self.guard.watch_many(ids, storages, ptrs, sizes, [f"storage {key} (cpu)" for key in keys])
            self.storage_keys += keys
            self.storage_bytes += sum(sizes)
            recs += zip([(prefix + key).encode() for key in keys], sizes, ptrs, ids, [False] * len(chunk))
        return recs

    def _records_one_by_one(self, items: List[Tuple[str, Any]]) -> Tuple[list, List[Tuple[int, Any]]]:
        """The records of any storages and their bookkeeping, one by one:
        staged ones (``stage``) stay on their device, others off the CPU are
        copied to it; also the indices of the staged records."""
        recs: List[Tuple[bytes, int, int, int, bool]] = []
        staged_at: List[Tuple[int, Any]] = []
        for i, (key, found) in enumerate(items):
            if not i % HANDOFF_RECORDS:
                _core.let_engines_in()  # the writer may wait to gather earlier parts
            staged = self.stage(found)
            # Other devices: copy to host memory (what torch.save does); the
            # pickle keeps the original location.
            storage = found if staged or found.device == CPU_DEVICE else found.cpu()
            crc_id = len(self.storage_keys)
            self.keepalive.append(storage)
            self.guard.watch(crc_id, storage, f"storage {key} ({storage.device.type if staged else 'cpu'})")
            self.storage_keys.append(key)
            n: int = storage.nbytes()
            self.storage_bytes += n
            recs.append((f"{ARCHIVE_NAME}/data/{key}".encode(), n, storage.data_ptr(), crc_id, staged))
            if staged and n:
                staged_at.append((len(recs) - 1, storage))
        return recs, staged_at

    def _add(self, name: str, data: bytes) -> None:
        """A small record holding ``data``, 64-byte aligned as torch aligns
        its own: header, data and descriptor are one blob."""
        name_b = f"{ARCHIVE_NAME}/{name}".encode()
        header_off = self.cursor
        size = len(data)
        head = _core.zip_local_header(name_b, header_off, size, SMALL_ALIGNMENT)
        crc = _core.crc32(data)
        # (torch's writer ends an empty record with no data descriptor)
        tail = (
            b"".join((_SIGNATURE, struct.pack("<I", crc), _core.zip_descriptor_sizes(header_off, size)))
            if size
            else b""
        )
        self._batch.blobs.append(Blob(header_off, b"".join((head, data, tail))))
        self.cursor += len(head) + size + len(tail)
        self.records.append((name, header_off + len(head), size))
        self.entries.append((name_b, header_off, size, crc, None))

    def _central_directory(self) -> None:
        blobs, slots, self.cursor = _core.zip_central_directory(self.cursor, self.entries, (Blob, Slot))
        self._batch.blobs += blobs
        self._batch.slots += slots


def serialization_id(data_pkl: bytes, storages: int, storage_bytes: int) -> str:
    """The ``.data/serialization_id`` fastpersist writes: 40 digits, like
    torch's (a random 64-bit number and a counter), but derived from the
    content: the CRC32 of the pickle, then the count and total size of the
    storage records. It is also how a reader tells fastpersist's own files
    (:func:`written_by_fastpersist`)."""
    return f"{_core.crc32(data_pkl):020d}{storages * 1000003 + storage_bytes:020d}"


def written_by_fastpersist(sid: Optional[bytes], data_pkl: bytes, records: List[ZipRecord]) -> bool:
    """Whether a torch zip file is one fastpersist wrote: its serialization
    id is the one :func:`serialization_id` derives from its pickle and its
    ``data/`` records (a torch-written id, random, matches by chance with
    odds of about 2**-64). fastpersist always computes CRC32s, so in its
    files a CRC of 0 is a CRC like any other."""
    if sid is None:
        return False
    data = [r for r in records if _is_data_record(r.name)]
    return sid == serialization_id(data_pkl, len(data), sum(r.size for r in data)).encode()


def unrecorded_crcs(records: List[ZipRecord], own: bool) -> set:
    """Names of the records whose CRC field may mean "not computed": a CRC
    of 0 in a file fastpersist did not write. torch writes 0 when it skips
    the CRC: ``torch.serialization.set_crc32_options(False)``, the data
    records of ``torch.serialization.skip_data()``, records written by
    ``PyTorchFileWriter.write_record_metadata``. Such a record is checked
    anyway when its data's CRC is 0 too; otherwise it is reported as not
    checked (a real CRC of 0 is possible but rare, 1 in 2**32)."""
    return set() if own else {r.name for r in records if r.crc32 == 0}


def _is_data_record(name: str) -> bool:
    head, sep, key = name.rpartition("data/")
    return bool(sep) and bool(key) and "/" not in key and head.count("/") <= 1 and not head.endswith(".")


def plan_torch_save(
    obj: Any, stage: Optional[Any] = None, alignment: int = STORAGE_ALIGNMENT, versions: Optional[TensorVersions] = None
) -> Plan:
    """Describe the whole ``torch.save`` file of ``obj`` at once. Without
    ``stage`` every storage is in host memory (device storages are copied to
    the host); with it, the storages it selects are left on their device, in
    ``plan.device``. ``alignment``: of the storage records (64 by default, as torch)."""
    z = TorchZipLayout(obj, stage=stage or (lambda st: False), alignment=alignment, versions=versions)
    plan = Plan()
    plan.extend(z.head())
    plan.extend(z.tail())
    plan.file_len = z.file_len
    plan.keepalive = z.keepalive
    plan.guard = z.guard
    plan.records = z.records
    plan.storage_keys = z.storage_keys
    plan.storage_bytes = z.storage_bytes
    return plan


# ---------------------------------------------------------------------------
# Reading: the central directory of a torch zip checkpoint.


class ZipRecord(NamedTuple):
    """One stored record of a zip file (a named tuple: made once per record,
    ten thousand times for a file of small tensors, at a third of a frozen
    dataclass's cost)."""

    name: str
    header_offset: int
    data_offset: int
    size: int
    crc32: int


_EOCD_SIG = b"PK\x05\x06"
_EOCD64_LOC_SIG = b"PK\x06\x07"


def _corrupt(msg: str) -> Exception:
    return CorruptCheckpointError(msg)


def _end_of_directory(fd: int, file_len: int, where: str) -> Tuple[int, int, int, int, int]:
    """(entries, central directory size, its offset, end record offset, the
    end of the zip: past the end record and its comment), from the end
    record, and the zip64 one where its locator comes before it (torch's
    reader then takes the zip64 record's numbers: they must be the end
    record's wherever that one does not say "see zip64"). A split
    (multi-disk) archive, which torch's reader refuses, is refused too."""
    tail_len = min(file_len, _EOCD.size + 0xFFFF)
    tail = os.pread(fd, tail_len, file_len - tail_len)
    if len(tail) != tail_len:
        raise _corrupt(f"{where}short read of the end of the file")
    pos = tail.rfind(_EOCD_SIG)
    if pos < 0 or pos + _EOCD.size > len(tail):
        raise _corrupt(f"{where}no zip end-of-central-directory record (truncated or not a checkpoint)")
    eocd_off = file_len - tail_len + pos
    _, disk, cd_disk, n_here, n, cd_size, cd_off, clen = _EOCD.unpack_from(tail, pos)
    end = eocd_off + _EOCD.size + clen
    loc_at = eocd_off - _LOCATOR64.size
    loc = os.pread(fd, _LOCATOR64.size, loc_at) if loc_at >= 0 else b""
    if len(loc) == _LOCATOR64.size and loc[:4] == _EOCD64_LOC_SIG:
        _, _, e64_off, disks = _LOCATOR64.unpack(loc)
        if e64_off + _EOCD64.size > loc_at:
            raise _corrupt(f"{where}zip64 end record points outside the file")
        e64 = os.pread(fd, _EOCD64.size, e64_off)
        if len(e64) != _EOCD64.size or e64[:4] != b"PK\x06\x06":
            raise _corrupt(f"{where}bad zip64 end record")
        (_, rec_size, _, _, disk64, cd_disk64, n_here64, n64, cd_size64, cd_off64) = _EOCD64.unpack(e64)
        if rec_size < _EOCD64.size - 12:
            raise _corrupt(f"{where}zip64 end record gives its size as {rec_size}")
        if disks != 1:
            raise _corrupt(f"{where}zip64 locator counts {disks} disks: a split archive torch.load cannot read")
        for name, short, full, sat in (
            ("entries", n, n64, _U16),
            ("entries on this disk", n_here, n_here64, _U16),
            ("central directory size", cd_size, cd_size64, _U32),
            ("central directory offset", cd_off, cd_off64, _U32),
            ("disk", disk, disk64, _U16),
            ("central directory disk", cd_disk, cd_disk64, _U16),
        ):
            if short != sat and short != full:
                raise _corrupt(f"{where}the end record gives the {name} as {short}, the zip64 end record {full}")
        disk, cd_disk, n_here, n, cd_size, cd_off = disk64, cd_disk64, n_here64, n64, cd_size64, cd_off64
        eocd_off = e64_off
    elif n == _U16 or cd_size == _U32 or cd_off == _U32:
        raise _corrupt(f"{where}zip64 locator missing")
    if n_here != n or ((disk | cd_disk) != 0 and (disk, cd_disk) != (1, 1)):
        raise _corrupt(
            f"{where}the end record describes a split archive (disk {disk}, central directory on disk {cd_disk}, "
            f"{n_here} of {n} entries here), which torch.load cannot read"
        )
    if cd_off + cd_size > eocd_off or n * _CENTRAL.size > cd_size:
        raise _corrupt(f"{where}central directory ({n} entries, {cd_size} bytes at {cd_off}) does not fit in the file")
    return n, cd_size, cd_off, eocd_off, end


#: General purpose flags of a record torch's reader does not read:
#: encrypted (bit 0), compressed patch data (bit 5), strong encryption
#: (bit 6), masked local header (bit 13).
_UNREAD_FLAGS = 0x0001 | 0x0020 | 0x0040 | 0x2000

#: The MS-DOS "directory" bit of a central entry's external attributes:
#: torch's reader takes such a record for a folder and reads no data from it.
_DOS_DIRECTORY = 0x10


def _central_entries(
    cd: bytes, n: int, where: str, fd: int = -1, cd_off: int = 0
) -> List[Tuple[str, int, int, int, bytes]]:
    """(name, local header offset, size, crc, name as stored) of every
    central entry. Records a load reads must be ones torch's reader reads
    as written: not encrypted, on this disk, not marked a folder. ``fd``
    (with ``cd_off``): the file, to tell a compressed record from a
    central entry whose method is damaged (its local header says stored)."""
    entries: List[Tuple[str, int, int, int, bytes]] = []
    compressed: List[Tuple[str, int, int]] = []
    prefix = ""  # (the archive's folder: the first record's)
    p = 0
    for i in range(n):
        if p + _CENTRAL.size > len(cd):
            raise _corrupt(f"{where}central directory entry {i} is truncated")
        (sig, _, _, flags, method, _, _, crc, csize, usize, nlen, xlen, clen, disk, _, attrs, hoff) = (
            _CENTRAL.unpack_from(cd, p)
        )
        if sig != 0x02014B50:
            raise _corrupt(f"{where}central directory entry {i} has a bad signature")
        end = p + _CENTRAL.size + nlen + xlen + clen
        if end > len(cd):
            raise _corrupt(f"{where}central directory entry {i} is truncated")
        raw_name = cd[p + _CENTRAL.size : p + _CENTRAL.size + nlen]
        try:
            name = raw_name.decode("utf-8" if flags & 0x800 else "cp437")
        except UnicodeDecodeError:
            raise _corrupt(f"{where}central directory entry {i} has an undecodable name") from None
        extra = cd[p + _CENTRAL.size + nlen : p + _CENTRAL.size + nlen + xlen]
        if usize == _U32 or csize == _U32 or hoff == _U32:
            usize, csize, hoff = _zip64_fields(extra, usize, csize, hoff, name, where)
        if method != 0:
            compressed.append((name, method, hoff))
        elif csize != usize:
            raise _corrupt(f"{where}record {name!r} is stored (not compressed) but gives {csize} bytes as {usize}")
        prefix = prefix if entries else _folder(name)
        why = _unread(flags, disk, attrs) if _loaded(name, prefix) else ""
        if why:
            raise _corrupt(f"{where}record {name!r} {why}")
        entries.append((name, hoff, usize, crc, raw_name))
        p = end
    if _is_torchscript([e[0] for e in entries]):
        raise UnsupportedFormatError(
            f"{where}a TorchScript archive (torch.jit.save), not a torch.save checkpoint: load it with torch.jit.load"
        )
    _refuse_compressed(compressed, fd, cd_off, where)
    return entries


def _unread(flags: int, disk: int, attrs: int) -> str:
    """Why torch's reader would not read the record of a central entry
    (its general purpose flags, disk and external attributes) as written,
    or ""."""
    if flags & _UNREAD_FLAGS:
        return f"is marked encrypted (flags {flags:#06x})"
    if disk > 1:
        return f"is on disk {disk} of a split archive"
    if attrs & _DOS_DIRECTORY:
        return "is marked a folder: torch.load reads no data from it"
    return ""


def _refuse_compressed(compressed: List[Tuple[str, int, int]], fd: int, cd_off: int, where: str) -> None:
    """Central entries that say compressed (name, method, local header
    offset): a CompressedRecords, or CorruptCheckpointError where a local
    header says stored (a damaged central entry, not a zip tool's
    compressed record; ``fd`` -1: not checked)."""
    for name, method, hoff in compressed:
        head = os.pread(fd, _LOCAL.size, hoff) if fd >= 0 and hoff + _LOCAL.size <= cd_off else b""
        if len(head) == _LOCAL.size and head[:4] == b"PK\x03\x04" and _LOCAL.unpack(head)[3] == 0:
            raise _corrupt(
                f"{where}record {name!r}: its central entry says compressed (method {method}), its local header stored"
            )
    if compressed:
        name, method, _ = compressed[0]
        raise CompressedRecords(
            f"{where}record {name!r} is compressed (method {method}): fastpersist reads and verifies records "
            "stored uncompressed, as torch.save stores them (a zip tool made this file); torch.load reads it"
        )


class CompressedRecords(UnsupportedFormatError):
    """A zip whose records are compressed (torch.save stores them; a zip
    tool re-packing a checkpoint compresses them): valid, and read by
    torch.load, which ``read_state_dict`` hands it to."""


def archive_prefix(first: str, where: str = "") -> str:
    """The folder of a torch zip's records, as torch's reader takes it:
    that of its first record, named ``first`` (``"archive/"``, a file's
    stem). Its ``data.pkl`` and ``data/<key>`` records are the
    checkpoint's; others of those names elsewhere are not read. A first
    record in no folder is a CorruptCheckpointError: torch.load refuses
    such a file ("file in archive is not in a subdirectory")."""
    prefix = _folder(first)
    if not prefix:
        raise _corrupt(
            f"{where}record {first!r} is not in a folder: torch.load refuses such a zip (torch.save writes "
            "every record in one)"
        )
    return prefix


def _folder(first: str) -> str:
    """The folder of the record ``first`` (``"archive/"``), or ``""``."""
    return first.split("/", 1)[0] + "/" if "/" in first else ""


#: The records a load reads (under the archive's folder), besides ``data/<key>``.
_LOADED = frozenset(
    (
        "data.pkl",
        "byteorder",
        "version",
        ".data/version",
        ".format_version",
        ".data/serialization_id",
        ".storage_alignment",
    )
)


def _loaded(name: str, prefix: str) -> bool:
    """Whether a load reads the record ``name`` (of an archive whose folder
    is ``prefix``)."""
    rest = name[len(prefix) :] if name.startswith(prefix) else None
    # (a folder's own entry, "archive/data/", which zip tools write, is none)
    return rest is not None and not rest.endswith("/") and (rest in _LOADED or rest.startswith("data/"))


def _is_torchscript(names: List[str]) -> bool:
    """torch.load's test (a ``constants.pkl`` record), or TorchScript code."""
    for name in names:
        _, _, rest = name.partition("/")
        if rest == "constants.pkl" or rest.startswith("code/"):
            return True
    return False


def _check_extents(entries: List[Tuple[str, int, int, int, bytes]], cd_off: int, where: str) -> None:
    """Before any local header is read or any memory is sized from the
    directory: names are unique and every record (its local header and
    data, at the least) lies before the central directory without
    overlapping another, so the records add up to less than the file."""
    names = set()
    spans = []
    prefix = _folder(entries[0][0]) if entries else ""
    for name, hoff, size, _, _ in entries:
        if name in names and _loaded(name, prefix):
            # (one a load does not read, twice, torch.load takes: a zip
            # tool appended a file again)
            raise _corrupt(f"{where}record {name!r} appears twice in the central directory")
        names.add(name)
        end = hoff + _LOCAL.size + size  # at the least: the name and extra field come on top
        if end > cd_off:
            raise _corrupt(
                f"{where}record {name!r}: {size} bytes at {hoff} lie outside the file's data area (the central "
                f"directory starts at {cd_off})"
            )
        spans.append((hoff, end, name))
    spans.sort()
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise _corrupt(f"{where}records {n0!r} and {n1!r} overlap")


#: Above this many records, their local headers are read by the engine,
#: many in flight and without the page cache's read-ahead (one buffered
#: ``pread`` each, cold, pulled about the whole file through the cache for
#: 10,000 small records); below it, one ``pread`` each.
HEADERS_BY_ENGINE = 64


def _local_headers(
    fd: int, entries: List[Tuple[str, int, int, int, bytes]], opts: Optional[EngineOptions], where: str
) -> List[bytes]:
    """The fixed part and the name of every entry's local header (as many
    name bytes as its central entry has), in ``entries``' order."""
    ranges = [(hoff, _LOCAL.size + len(raw)) for _, hoff, _, _, raw in entries]
    if len(entries) <= HEADERS_BY_ENGINE:
        return [os.pread(fd, ln, hoff) for hoff, ln in ranges]
    heads = RangeBuffer(ranges)
    try:
        read_records(fd, heads.reqs, opts or EngineOptions.resolve(), merge_gap=0)
    except ValueError as e:  # the engine's bounds and overlap checks
        raise _corrupt(f"{where}local headers: {e}") from None
    return heads.parts()


@dataclass
class ZipDirectory:
    """A zip's central directory, checked against the file: each entry's
    (name, local header offset, size, CRC32, name as stored), and where
    the directory starts (every record lies before it)."""

    entries: List[Tuple[str, int, int, int, bytes]]
    cd_offset: int
    where: str
    #: Where the zip ends: past its end record and that record's comment
    #: (torch.save writes nothing after it).
    end: int = 0


#: Whether the central directory of a plainly well-formed file is parsed and
#: checked by the extension (``_core.zip_central_entries``); anything else,
#: or with this off, by :func:`_central_entries` and :func:`_check_extents`.
FAST_DIRECTORY = True


def read_central_directory(fd: int, file_len: int, path: str = "") -> ZipDirectory:
    """The central directory (zip64 included), every offset and length
    checked against the file and the records against each other (names
    unique, no overlaps) before anything is sized from them."""
    where = f"{path}: " if path else ""
    n, cd_size, cd_off, _, end = _end_of_directory(fd, file_len, where)
    cd = os.pread(fd, cd_size, cd_off)
    if len(cd) != cd_size:
        raise _corrupt(f"{where}short read of the central directory")
    entries = _core.zip_central_entries(cd, n, cd_off) if FAST_DIRECTORY else None
    if entries is None:  # not plainly well-formed: parsed here, to name what is wrong
        entries = _central_entries(cd, n, where, fd, cd_off)
        _check_extents(entries, cd_off, where)
    return ZipDirectory(entries, cd_off, where, end)


def _local_record(
    d: ZipDirectory, entry: Tuple[str, int, int, int, bytes], lh: bytes, fd: int
) -> Tuple[Optional[ZipRecord], str]:
    """The record ``entry`` is, from ``lh``: the fixed part and the name of
    its local header. (None, what is wrong) when the header does not fit."""
    name, hoff, size, crc, raw_name = entry
    where = d.where
    if len(lh) < _LOCAL.size:
        return None, f"{where}record {name!r}: short read of its local header at {hoff}"
    sig, *_rest = _LOCAL.unpack_from(lh)
    if sig != 0x04034B50:
        return None, f"{where}record {name!r}: bad local header signature at {hoff}"
    nlen, xlen = _rest[-2], _rest[-1]
    data_off = hoff + _LOCAL.size + nlen + xlen
    if data_off + size > d.cd_offset:
        return None, (
            f"{where}record {name!r}: {size} bytes at {data_off} extend past the start of the central directory "
            f"({d.cd_offset})"
        )
    local_name = lh[_LOCAL.size :] if nlen == len(raw_name) else os.pread(fd, nlen, hoff + _LOCAL.size)
    if local_name != name.encode("utf-8") and local_name.decode("cp437", "replace") != name:
        return None, f"{where}record {name!r}: local header names {local_name!r}"
    return ZipRecord(name, hoff, data_off, size, crc), ""


def overlap_of(records: List[ZipRecord]) -> Optional[str]:
    """Names two records whose data overlap, if any do."""
    spans = sorted((r.data_offset, r.data_offset + r.size, r.name) for r in records)
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            return f"records {n0!r} and {n1!r} overlap"
    return None


def resolve_records(
    fd: int, d: ZipDirectory, entries: List[Tuple[str, int, int, int, bytes]], opts: Optional[EngineOptions] = None
) -> List[ZipRecord]:
    """The records of ``entries`` (of ``d``), each located by reading its
    local header; anything odd raises
    :class:`~fastpersist.CorruptCheckpointError` naming what is wrong."""
    records = []
    for entry, lh in zip(entries, _local_headers(fd, entries, opts, d.where)):
        rec, why = _local_record(d, entry, lh, fd)
        if rec is None:
            raise _corrupt(why)
        records.append(rec)
    clash = overlap_of(records)
    if clash:
        raise _corrupt(f"{d.where}{clash}")
    return records


def read_zip_directory(
    fd: int, file_len: int, path: str = "", opts: Optional[EngineOptions] = None, whole: bool = False
) -> List[ZipRecord]:
    """Parse the central directory (zip64 included) and every local header.
    Every offset and length is checked against the file, and the records
    against each other, before anything is sized from them; anything odd
    raises :class:`~fastpersist.CorruptCheckpointError` naming what is wrong.
    ``opts``: of the engine that reads the local headers of a file with
    many records (default: the environment's). ``whole``: bytes after the
    zip's end (appended to it: not as it was written) are corrupt too
    (a read takes the zip they follow, as torch.load does)."""
    d = read_central_directory(fd, file_len, path)
    if whole and d.end > file_len:
        raise _corrupt(f"{d.where}the end record's comment runs {d.end - file_len} bytes past the end of the file")
    if whole and d.end != file_len:
        raise _corrupt(f"{d.where}{file_len - d.end} bytes follow the zip's end record (the file was appended to)")
    return resolve_records(fd, d, d.entries, opts)


def predict_records(
    d: ZipDirectory, entries: List[Tuple[str, int, int, int, bytes]], alignment: int
) -> Optional[Tuple[List[ZipRecord], List[Tuple[int, int]]]]:
    """The records of ``entries`` as torch's writer (and fastpersist's) lay
    them out, data aligned to ``alignment`` right after the local header,
    without reading the headers: the records, and each header's (offset,
    length of its fixed part and name), to be read along with the data and
    then confirmed by :func:`confirm_predicted`. None when the prediction
    cannot be right (records or headers would overlap or run past the
    central directory): the headers must be read."""
    records, headers = [], []
    spans = []
    for name, hoff, size, crc, raw in entries:
        data_off = hoff + _core.zip_local_header_len(len(raw), hoff, size, alignment)
        if data_off + size > d.cd_offset:
            return None
        records.append(ZipRecord(name, hoff, data_off, size, crc))
        headers.append((hoff, _LOCAL.size + len(raw)))
        spans.append((hoff, hoff + _LOCAL.size + len(raw)))
        spans.append((data_off, data_off + size))
    spans.sort()
    for (_, e0), (b1, _) in zip(spans, spans[1:]):
        if b1 < e0:
            return None
    return records, headers


def confirm_predicted(
    entries: List[Tuple[str, int, int, int, bytes]], records: List[ZipRecord], headers: List[bytes]
) -> bool:
    """Whether every predicted record is where its local header (``headers``:
    their fixed parts and names, as read) puts it: a header naming the
    record with the central directory's very bytes, whose name and extra
    field end where the data was read from. (A header that differs in any
    other way is left to :func:`resolve_records`, which accepts or names it.)"""
    local = _LOCAL
    for entry, rec, lh in zip(entries, records, headers):
        raw = entry[4]
        if len(lh) < local.size:
            return False
        sig, *_rest, nlen, xlen = local.unpack_from(lh)
        if sig != 0x04034B50 or nlen != len(raw) or rec.header_offset + local.size + nlen + xlen != rec.data_offset:
            return False
        if lh[local.size :] != raw:
            return False
    return True


def _zip64_fields(extra: bytes, usize: int, csize: int, hoff: int, name: str, where: str) -> Tuple[int, int, int]:
    p = 0
    while p + 4 <= len(extra):
        tag, ln = struct.unpack_from("<HH", extra, p)
        body = extra[p + 4 : p + 4 + ln]
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
