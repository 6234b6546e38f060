"""fastpersist as the storage layer of PyTorch Distributed Checkpoint (DCP).

DCP (``torch.distributed.checkpoint``) plans sharded saves and reshards on
load; this module gives it fastpersist's engine as storage::

    import torch.distributed.checkpoint as dcp
    from fastpersist.dcp import FastPersistReader, FastPersistWriter

    dcp.save(state_dict, storage_writer=FastPersistWriter("ckpt/step-100"))
    dcp.load(state_dict, storage_reader=FastPersistReader("ckpt/step-100"))

The checkpoint is the one DCP's ``FileSystemWriter`` writes, so the stock
``FileSystemReader`` (where fastpersist is not installed) loads it: the same
``.metadata`` (stock ``_StorageInfo(relative_path, offset, length)`` per
item), each tensor item a ``torch.save`` blob, byte items raw. What differs:

* one file per rank (``thread_count`` files with ``thread_count`` threads),
  written by the engine (io_uring, O_DIRECT, CRC32 while copying); the data
  record of every tensor of 64 KiB or more starts on a 4096-byte boundary of
  the file (smaller ones are packed at 64 bytes, as torch.save does);
* data file names carry the save's id (``__<rank>_<n>.<id>.distcp``), so a
  save never overwrites the files the previous checkpoint at that path uses;
* the commit: every data file is committed by the engine (temporary file,
  fsync, rename, directory fsync) before ``write_data`` returns; then the
  coordinator writes the CRC32 sidecar (``.fastpersist-<id>.crc32``, which
  stock readers never open) and ``.metadata`` last, each durably, and only
  then removes the files of the checkpoint it replaced. A failed save leaves
  the previous checkpoint loadable.

:class:`FastPersistReader` reads with the engine (O_DIRECT, many reads in
flight, straight into destination tensors where the layout allows, GPU
destinations through the staging slots) and checks every item's CRC32
(:class:`~fastpersist.CorruptCheckpointError` names the item). It also
reads checkpoints written by the stock writer (without CRCs).

:func:`install` makes DCP pick fastpersist for plain local paths when the
caller names no storage (``dcp.save(sd, checkpoint_id=path)``);
:func:`uninstall` undoes it.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import copy
import dataclasses
import enum
import io
import json
import logging
import os
import pathlib
import pickle
import re
import struct
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .. import _core
from ..async_save import LEND_MIN, LEND_PAGE, SnapshotPool
from ..cuda_staging import read_staged, staging_setup
from ..errors import CorruptCheckpointError, WriteError
from ..options import (
    EngineOptions,
    FullGcDeferral,
    abandoned,
    file_identity,
    full_gc_deferral,
    gc_paused,
    make_dirs,
    names_outside,
    open_beneath,
    parse_json,
    read_with,
    use_engine,
)
from ..pickling import check_extent, check_unnamed, element_size
from ..plan import DATA_ALIGNMENT, HANDOFF_RECORDS, Batch, Blob, DeviceRegion, Plan, Region, Slot
from ..torch_zip import SMALL_ALIGNMENT, plan_torch_save
from ..writer import write_streamed

__all__ = [
    "FastPersistWriter",
    "FastPersistReader",
    "CorruptCheckpointError",
    "install",
    "uninstall",
    "installed",
    "METADATA",
    "sidecar_name",
]

log = logging.getLogger("fastpersist")

#: DCP's metadata file (committed last).
METADATA = ".metadata"
SUFFIX = ".distcp"
#: Tensors of at least this many bytes get their data at a 4096-byte
#: boundary of the file; smaller ones are packed at 64 bytes.
ALIGN_ABOVE = 64 << 10
#: Tensor bytes in the first part of a data file written while it is laid
#: out; each later part holds twice as many, up to STREAM_PART_MAX.
STREAM_FIRST_PART = 8 << 20
STREAM_PART_MAX = 512 << 20
SIDECAR_FORMAT = "fastpersist.dcp.crc32"
#: 2: each tensor item's entry also holds its blob head's CRC32 and the
#: ``_kind`` of its dtype and shape (version 1's entries have neither, and
#: their items are read by parsing each blob).
SIDECAR_VERSION = 2
_TAG_LEN = 16
#: Data files this module names: ``__<rank>_<n>.<save tag>.distcp``.
_OWN_DATA = re.compile(rf"__(\d+)_\d+\.([0-9a-f]{{{_TAG_LEN}}})\.distcp")
#: The metadata files of the checkpoints a directory holds (collective, and per rank).
_METADATA_FILE = re.compile(r"(__[0-9]+)?\.metadata")
_OWN_SIDECAR = re.compile(rf"\.fastpersist-([0-9a-f]{{{_TAG_LEN}}})\.crc32")
#: Data files of a DCP checkpoint: DCP's own (``__<rank>_<n>.distcp``) and
#: this module's. The only names a replaced checkpoint's ``.metadata`` can
#: have removed.
_DATA_FILE = re.compile(rf"__\d+_\d+(\.[0-9a-f]{{{_TAG_LEN}}})?\.distcp")
#: Bytes of temporary buffers one read call fills at most.
READ_BATCH_BYTES = 256 << 20
#: And at most this many items (what checking their destinations' memory
#: for overlaps costs grows with a batch's items).
READ_BATCH_ITEMS = 4096
#: The small pieces a read batch reads only for their CRC32s (the heads and
#: tails of items' blobs) share temporary chunks of this many bytes.
PIECE_CHUNK = 256 << 10


def _tag(save_id: Optional[str]) -> str:
    return (save_id or "").replace("-", "")[:_TAG_LEN]


def sidecar_name(save_id: Optional[str]) -> str:
    """The CRC32 sidecar of the save ``save_id`` (``metadata.storage_meta.save_id``)."""
    return f".fastpersist-{_tag(save_id)}.crc32"


def _dir(path: Any) -> str:
    if hasattr(path, "write") or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"a DCP checkpoint is a directory path (str or os.PathLike), not {type(path).__name__}")
    p = os.fsdecode(os.fspath(path))
    if not p:
        raise ValueError("empty checkpoint path")
    return p


def _not_a_directory(path: str) -> NotADirectoryError:
    return NotADirectoryError(f"{path} exists and is not a directory (a DCP checkpoint is a directory)")


# ---------------------------------------------------------------------------
# Writing: each rank's items laid out in one file for the engine.


class _Template(NamedTuple):
    """The ``torch.save`` blob of a tensor of one dtype and shape, relative
    to the blob's start: everything but the data and its CRC32."""

    head: bytes  # bytes before the data record
    data_len: int
    tail: List[Tuple[int, bytes]]  # (offset after the data, bytes), between the CRC slots
    slots: List[int]  # offsets after the data of the CRC32 slots
    tail_zero: bytes  # the bytes after the data, slots zero
    length: int
    head_crc: int
    align: int
    #: ``_kind`` of the dtype and shape the blob holds, for a plain tensor's
    #: blob; -1 for one made for a particular tensor (a subclass, quantized),
    #: whose data a reader must not take without parsing its blob.
    kind: int = -1

    @property
    def data_off(self) -> int:
        return len(self.head)

    @property
    def nbytes(self) -> int:
        """Memory the template holds (its byte strings)."""
        return len(self.head) + len(self.tail_zero) + sum(len(b) for _, b in self.tail)


def _kind(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """A checksum of a tensor's dtype and shape: a sidecar entry records the
    one its blob holds, and a reader takes the data without parsing the
    blob only where the ``.metadata`` says the same."""
    return _core.crc32(f"{dtype}{tuple(int(n) for n in shape)}".encode())


def _make_template(t: torch.Tensor, align: int, plain: bool = False) -> _Template:
    """Lay out ``torch.save(t)`` once (its bytes do not depend on values).
    ``plain``: ``t`` stands for every tensor of its dtype and shape."""
    plan = plan_torch_save(t, alignment=align)
    data = [r for r in plan.records if r[0].startswith("data/")]
    if len(data) != 1:
        raise AssertionError(f"a tensor's torch.save blob has {len(data)} storage records")
    _, data_off, data_len = data[0]
    end = data_off + data_len
    head = bytearray(data_off)
    tail = bytearray(plan.file_len - end)
    for off, b in plan.blobs:
        if off < data_off:
            head[off : off + len(b)] = b
        else:
            tail[off - end : off - end + len(b)] = b
    slots = sorted(off - end for off, _ in plan.slots)
    pieces: List[Tuple[int, bytes]] = []
    pos = 0
    for s in [*slots, len(tail)]:
        if s > pos:
            pieces.append((pos, bytes(tail[pos:s])))
        pos = s + 4
    kind = _kind(t.dtype, t.shape) if plain else -1
    return _Template(
        bytes(head), data_len, pieces, slots, bytes(tail), plan.file_len, _core.crc32(bytes(head)), align, kind
    )


#: Bytes of per-shape templates kept (most recently used first). A model
#: has a few hundred distinct (dtype, shape) pairs at most; a state of many
#: differently shaped small tensors is bound by this, not by a count.
TEMPLATE_CACHE_BYTES = 64 << 20


class _Templates:
    """Templates by (dtype, shape, alignment), for plain tensors (the
    blob of a tensor subclass or a tensor with extra state is made for it),
    least recently used dropped past ``TEMPLATE_CACHE_BYTES``. Shared by
    the writer's threads."""

    def __init__(self) -> None:
        self._cache: OrderedDict[Tuple[Any, ...], _Template] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, t: torch.Tensor, align: int) -> _Template:
        if type(t) is not torch.Tensor or _lazy(t) or t.is_quantized:
            return _make_template(t, align)
        key = (t.dtype, t.shape, align)  # torch.Size hashes as the tuple it is
        with self._lock:
            tpl = self._cache.get(key)
            if tpl is not None:
                self._cache.move_to_end(key)
                return tpl
        tpl = _make_template(torch.empty(t.shape, dtype=t.dtype), align, plain=True)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = tpl
                self._bytes += tpl.nbytes
                while self._bytes > TEMPLATE_CACHE_BYTES and len(self._cache) > 1:
                    _, old = self._cache.popitem(last=False)
                    self._bytes -= old.nbytes
        return tpl


_templates = _Templates()


class _ItemInfo(NamedTuple):
    """What a rank reports for one item (turned into a stock ``_StorageInfo``
    plus a sidecar entry by the coordinator)."""

    relative_path: str
    offset: int
    length: int
    crc32: int
    data_offset: int  # of the tensor data inside the item; -1 for byte items
    data_length: int
    head_crc: int = -1  # of the bytes before the data
    kind: int = -1  # _kind of the blob's dtype and shape; -1: parse the blob


def _lazy(t: torch.Tensor) -> bool:
    """A conjugate or negative view: its storage holds other values than
    it shows (data read into the storage would be conjugated or negated)."""
    return t.is_conj() or t.is_neg()


def _in_place(t: torch.Tensor) -> bool:
    """``t``'s bytes are one run of its storage, in order (a contiguous view
    counts: its record is written from where it lies, no copy)."""
    return t.is_contiguous() and t.layout == torch.strided


def _exact(t: torch.Tensor) -> bool:
    """``t``'s storage is exactly its data, in order (its bytes are the record)."""
    # int(): torch >= 2.15's stubs type storage_offset() as int | SymInt,
    # whose == is a SymBool (a plain tensor's offset is an int).
    return (
        t.is_contiguous()
        and int(t.storage_offset()) == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        and t.layout == torch.strided
    )


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class _FileLayout:
    """One data file: byte items, then tensors, each placed in the plan."""

    def __init__(self, name: str, owned: Optional[Callable[[Any], bool]] = None) -> None:
        self.name = name
        # Whether a storage is the writer's own memory (its stager's), which
        # no guard needs to watch (and which the engine may then lend).
        self.owned = owned
        self.plan = Plan()
        self.cursor = 0
        # (write item, offset, length, template or None, crc id or -1, crc for bytes)
        self.items: List[Tuple[WriteItem, int, int, Optional[_Template], int, int]] = []
        self.stage, _ = staging_setup()

    def add_bytes(self, item: WriteItem, data: Any) -> None:
        b = bytes(data.getbuffer()) if isinstance(data, io.BytesIO) else bytes(data)
        off = self.cursor = _align(self.cursor, SMALL_ALIGNMENT)
        if b:
            self.plan.blobs.append(Blob(off, b))
        self.cursor += len(b)
        self.items.append((item, off, len(b), None, -1, _core.crc32(b)))

    def add_tensor(self, item: WriteItem, t: torch.Tensor) -> int:
        """Lay out the record of ``t``; returns its length in the file."""
        # Run once per item (10,000 small tensors: 10,000 times): each
        # attribute and tensor call is paid per item, so they are spared.
        t = t.detach()
        check_extent(t, f"DCP item {item.index.fqn!r}")
        if _lazy(t):
            # Its storage holds the values before the lazy conjugation or
            # negation: the record holds them after (a reader that takes the
            # data as it lies gets the tensor's values).
            t = t.resolve_conj().resolve_neg()
        staged = self._staged(t)
        if not staged and not t.is_cpu:
            t = t.cpu()
        # A device storage is staged whole, so it must be exactly the data;
        # a host tensor only needs its bytes in one run: a contiguous view
        # (every tensor of a state dict that DCP's async_save staged through
        # this writer is one, into the staging buffer) is written in place.
        if not (_exact(t) if staged else _in_place(t)):
            t = t.clone(memory_format=torch.contiguous_format)
        nbytes = t.nbytes
        align = DATA_ALIGNMENT if nbytes >= ALIGN_ABOVE else SMALL_ALIGNMENT
        tpl = _templates.get(t, align)
        plan = self.plan
        base = self.cursor = _align(self.cursor, align)
        cid = len(plan.storage_keys)
        plan.storage_keys.append(str(cid))
        plan.blobs.append(Blob(base, tpl.head))
        data_at = base + len(tpl.head)
        if nbytes:
            storage = t.untyped_storage()
            if staged:
                plan.device.append(DeviceRegion(data_at, storage, nbytes, cid))
            else:
                at = storage.data_ptr() + int(t.storage_offset()) * t.element_size()
                plan.regions.append(Region(data_at, at, nbytes, cid))
            plan.keepalive.append(storage)
            if self.owned is None or not self.owned(storage):
                plan.guard.watch(cid, storage, f"DCP item {item.index.fqn!r}")
            plan.storage_bytes += nbytes
        end = data_at + nbytes
        plan.blobs += [Blob(end + o, b) for o, b in tpl.tail]
        plan.slots += [Slot(end + s, cid) for s in tpl.slots]
        self.cursor = base + tpl.length
        self.items.append((item, base, tpl.length, tpl, cid, 0))
        return tpl.length

    def _staged(self, t: torch.Tensor) -> bool:
        if self.stage is None:  # the common case first: one attribute, no device object
            return t.is_cuda
        if t.is_cuda:
            return True
        return t.numel() > 0 and bool(self.stage(t.untyped_storage()))

    def finish(self) -> Plan:
        self.plan.file_len = self.cursor
        return self.plan

    def take(self) -> Batch:
        """The pieces laid out since the last take (none of them a device
        storage's: those stay in the plan, to be staged at the end)."""
        plan, part = self.plan, Batch()
        part.blobs, plan.blobs = plan.blobs, []
        part.regions, plan.regions = plan.regions, []
        part.slots, plan.slots = plan.slots, []
        part.end = self.cursor
        return part

    def results(self, crcs: Dict[str, int]) -> List[WriteResult]:
        out = []
        for item, off, length, tpl, cid, byte_crc in self.items:
            crc = byte_crc
            data_off = data_len = head_crc = kind = -1
            if tpl is not None:
                d = crcs.get(str(cid), 0) if tpl.data_len else 0
                tail = bytearray(tpl.tail_zero)
                for s in tpl.slots:
                    struct.pack_into("<I", tail, s, d)
                crc = _core.crc32_combine(tpl.head_crc, d, tpl.data_len)
                crc = _core.crc32_combine(crc, _core.crc32(bytes(tail)), len(tail))
                if tpl.kind >= 0:
                    data_off, data_len, head_crc, kind = tpl.data_off, tpl.data_len, tpl.head_crc, tpl.kind
            info = _ItemInfo(self.name, off, length, crc, data_off, data_len, head_crc, kind)
            out.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
        return out


@dataclasses.dataclass(frozen=True)
class _FileNames:
    """A rank's data file names: ``<prefix><n>.<tag>.distcp``."""

    prefix: str
    tag: str

    def name(self, n: int) -> str:
        return f"{self.prefix}{n}.{self.tag}{SUFFIX}"


def _item_size(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    n = 1
    for s in item.tensor_data.size:
        n *= s
    return n * element_size(item.tensor_data.properties.dtype)


def _buckets(items: Sequence[WriteItem], n: int) -> List[List[WriteItem]]:
    """``n`` files of balanced tensor bytes; byte items spread round-robin.
    No file for no items (a rank with nothing to write makes none: each
    save's names are its own, so an empty file nothing names would be left
    behind by every save)."""
    if n <= 1:
        return [list(items)] if items else []
    out: List[List[WriteItem]] = [[] for _ in range(n)]
    sizes = [0] * n
    byte_items = [it for it in items if it.type == WriteItemType.BYTE_IO]
    for i, it in enumerate(byte_items):
        out[i % n].append(it)
    for it in sorted((it for it in items if it.type != WriteItemType.BYTE_IO), key=_item_size, reverse=True):
        k = min(range(n), key=sizes.__getitem__)
        out[k].append(it)
        sizes[k] += _item_size(it)
    return [b for b in out if b]


def _in_background(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """``fn(*args)`` on a daemon thread; its result (or error) in the future."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed over through the future
            fut.set_exception(e)

    threading.Thread(target=run, name="fastpersist-dcp-replaced", daemon=True).start()
    return fut


class _MetadataUnpickler(pickle.Unpickler):
    """Reads a ``.metadata`` only to learn which files it names: the
    classes of DCP's metadata, torch's dtypes, layouts and memory formats,
    paths and plain containers, nothing else (a file in the directory being
    saved to is not trusted to run code: DCP's own writer never reads it)."""

    _TORCH = (torch.dtype, torch.layout, torch.memory_format)

    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch" and name in ("Size", "device"):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":  # how a torch.layout pickles
            return torch.serialization._get_layout
        if module == "pathlib" and name in ("Path", "PosixPath", "PurePath", "PurePosixPath"):
            return getattr(pathlib, name)  # a checkpoint_id given as a path
        # A dotted name (protocol 4) reaches anything a module imports:
        # ``io.FileIO`` through DCP's filesystem module opens any file.
        if "." not in name and (module == "torch" or module.startswith("torch.distributed.checkpoint.")):
            obj = super().find_class(module, name)
            if module == "torch" and isinstance(obj, self._TORCH):
                return obj
            if (
                module != "torch"
                and isinstance(obj, type)
                and obj.__module__ == module  # defined there, not imported
                and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))  # DCP's records of data
            ):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def _referenced(directory: str, metadata_file: str) -> Tuple[set, Optional[str]]:
    """Files the checkpoint committed at ``directory`` uses (its data files,
    by the names data files have, and its sidecar), or nothing when there
    is none or it cannot be read."""
    try:
        with open(os.path.join(directory, metadata_file), "rb") as f:
            md = _MetadataUnpickler(f).load()
        files = {getattr(v, "relative_path", None) for v in (getattr(md, "storage_data", None) or {}).values()}
        save_id = getattr(getattr(md, "storage_meta", None), "save_id", None)
        sidecar = sidecar_name(save_id) if isinstance(save_id, str) and save_id else None
        if sidecar is not None and not _OWN_SIDECAR.fullmatch(sidecar):
            sidecar = None  # not a name this module gives its sidecars: not ours to remove
        return {f for f in files if isinstance(f, str) and _DATA_FILE.fullmatch(f)}, sidecar
    except Exception:  # noqa: BLE001 - no usable previous checkpoint: nothing is removed on its account
        return set(), None


# ---------------------------------------------------------------------------
# Staging for dcp.async_save: copies into the writer's reusable pool.


def _map_tensors(obj: Any, fn: Any) -> Any:
    """``obj`` with every tensor (DTensor local shards, ShardedTensor local
    shards included) replaced by ``fn(tensor)``; other leaves copied."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return DTensor(fn(obj._local_tensor), obj._spec, requires_grad=False)
    sharded = _sharded_tensor_type()
    if sharded is not None and isinstance(obj, sharded):
        from torch.distributed._shard.sharded_tensor import Shard

        shards = [Shard(fn(s.tensor), s.metadata) for s in obj.local_shards()]
        return sharded._init_from_local_shards_and_global_metadata(
            shards, obj.metadata(), process_group=obj._process_group
        )
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        items = [(k, _map_tensors(v, fn)) for k, v in obj.items()]
        if type(obj) is dict:
            return dict(items)
        try:
            # A dict subclass keeps its type and what it was made with (a
            # defaultdict's factory): a shallow copy, its values replaced.
            out = copy.copy(obj)
            for k, v in items:
                dict.__setitem__(out, k, v)
            return out
        except Exception:  # noqa: BLE001 - a subclass that cannot be copied
            return dict(items)  # (as DCP's own stager stages one)
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_map_tensors(v, fn) for v in obj)
    if obj is None or isinstance(obj, (int, float, str, bytes, bool)):
        return obj
    return copy.deepcopy(obj)


def _sharded_tensor_type() -> Any:
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except Exception:  # noqa: BLE001 - not in every build
        return None
    return ShardedTensor


class _Stager:
    """Copies of a state dict's tensors in one buffer of a
    :class:`~fastpersist.SnapshotPool` (pinned when CUDA tensors are
    staged); the buffer goes back to the pool once the staged state dict
    (every tensor of it) is gone, i.e. once DCP is done with it. A tensor of
    1 MiB or more starts on a page, as its data does in the file, so the
    engine writes its whole blocks straight from the buffer (zero copy);
    memory the stager holds is the writer's own (:meth:`owns`), so no guard
    watches it."""

    def __init__(self) -> None:
        self.pool = SnapshotPool()
        # Addresses of the buffers leased to staged state dicts still alive.
        self._live: set = set()

    def owns(self, storage: Any) -> bool:
        """Whether ``storage`` is a staging buffer leased to a live staged
        state dict (the storage of every tensor :meth:`stage` returned)."""
        return storage.data_ptr() in self._live

    def _returned(self, buf: torch.Tensor) -> None:
        self._live.discard(buf.data_ptr())
        self.pool.put_back(buf)

    def stage(self, state_dict: Any) -> Any:
        sizes: List[int] = []
        cuda = [False]

        def measure(t: torch.Tensor) -> torch.Tensor:
            check_unnamed(t)
            check_extent(t)
            n = t.numel() * t.element_size()
            sizes.append(_align(n, SMALL_ALIGNMENT) + (LEND_PAGE if n >= LEND_MIN else 0))
            cuda[0] |= t.device.type == "cuda"
            return t

        _map_tensors(state_dict, measure)
        pin = cuda[0] and torch.cuda.is_available()
        buf = self.pool.acquire(max(sum(sizes), 1), pin=pin)
        # A tensor of its own over the buffer, which every staged tensor
        # holds (an attribute: a view does not keep its base's Python object
        # alive, so without it the buffer went back to the pool as soon as
        # this returned, and the next stage overwrote a staged state dict
        # still being written): the buffer goes back once they are all gone.
        lease = torch.empty(0, dtype=torch.uint8).set_(buf.untyped_storage())
        base = buf.data_ptr()
        self._live.add(base)
        weakref.finalize(lease, self._returned, buf)
        pos = [0]

        def copy_one(t: torch.Tensor) -> torch.Tensor:
            n = t.numel() * t.element_size()
            if n >= LEND_MIN:
                pos[0] += -(base + pos[0]) % LEND_PAGE
            dst = lease[pos[0] : pos[0] + n].view(t.dtype).view(t.shape) if n else torch.empty(t.shape, dtype=t.dtype)
            pos[0] += _align(n, SMALL_ALIGNMENT)
            if n:
                dst.copy_(t.detach(), non_blocking=pin and t.device.type == "cuda")
                dst._fastpersist_lease = lease  # type: ignore[attr-defined]
            return dst

        staged = _map_tensors(state_dict, copy_one)
        if pin:
            torch.cuda.synchronize()
        return staged

    def close(self) -> None:
        self.pool.release()


# ---------------------------------------------------------------------------
# The writer


class FastPersistWriter(StorageWriter, AsyncStager):
    """A DCP ``StorageWriter`` (and ``AsyncStager``) that writes with
    fastpersist's engine. See the module documentation for the files.

    ``single_file_per_rank``: one file per rank (else one per item);
    ``sync_files``: data, sidecar and ``.metadata`` durable (fsync of files
    and directory; leave it on); ``thread_count``: files per rank written at
    once (default 1: one file saturates a disk); ``overwrite``: replace a
    checkpoint at the path (else refuse, like DCP's ``overwrite=False``);
    ``defer_gc``: Python's full collections deferred on this rank from
    the save's first call into the writer to its last (DCP's own planning
    of many items, between those calls, sets them off; see
    :class:`fastpersist.options.FullGcDeferral`); ``engine_options``: those
    of :func:`fastpersist.write_state_dict` (``block_size``,
    ``arena_bytes``, ``queue_depth``, ``direct``, ``io_uring``). Engines
    are made on first use in the process that writes, so the writer
    pickles (DCP's process-based ``async_save``).
    """

    _synchronize_after_execute: bool = True

    def __init__(
        self,
        path: Any,
        *,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: Optional[int] = None,
        overwrite: bool = True,
        defer_gc: bool = True,
        **engine_options: Any,
    ) -> None:
        super().__init__()
        self.path = _dir(path)
        self.defer_gc = bool(defer_gc)
        self._gc: Optional[FullGcDeferral] = None  # made by the first save
        self.single_file_per_rank = bool(single_file_per_rank)
        self.sync_files = bool(sync_files)
        self.thread_count = 1 if thread_count is None else int(thread_count)
        if self.thread_count < 1:
            raise ValueError(f"thread_count must be at least 1, not {thread_count}")
        self.overwrite = bool(overwrite)
        self.engine_options = dict(engine_options)
        if "durable" in engine_options:
            raise TypeError("FastPersistWriter() takes sync_files=, not durable= (DCP's name for it)")
        # ValueError (TypeError for an unknown name) now, not mid-save.
        self.opts = EngineOptions.given("FastPersistWriter()", {**engine_options, "durable": self.sync_files})
        self.save_id = str(uuid.uuid4())
        self.rank: Optional[int] = None
        self.is_coordinator = False
        self.use_collectives = True
        self._stager: Optional[_Stager] = None
        # The files of the checkpoint this save replaces, read from its
        # .metadata on a thread of its own while the data is written.
        self._replaced: Optional[concurrent.futures.Future] = None
        #: The :class:`fastpersist.WriteStats` of this rank's files in the last save.
        self.last_stats: List[Any] = []

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_stager"] = None  # the pool stays with the process that staged
        state["_gc"] = None  # a deferral is this process's
        state["_replaced"] = None  # a thread's result: read again where it is needed
        state["last_stats"] = []
        return state

    # -- StorageWriter ------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self.path = _dir(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # Every save gets names of its own (DCP calls reset() only when given
        # a checkpoint_id): a writer used again, or a cached plan, must never
        # write, nor remove on failure, the committed checkpoint's files.
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        _begin_gc_deferral(self)  # until this rank's last call: write_data, or finish on the coordinator

    def _metadata_file(self) -> str:
        if not self.use_collectives and self.rank is not None:
            return f"__{self.rank}{METADATA}"
        return METADATA

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise _not_a_directory(self.path)
        make_dirs(self.path)
        if not self.overwrite and os.path.exists(os.path.join(self.path, self._metadata_file())):
            raise RuntimeError(f"a checkpoint exists at {self.path} and overwrite=False")
        if not self.use_collectives and self.rank is not None:
            plan = dataclasses.replace(plan, storage_data=_FileNames(f"__{self.rank}_", _tag(self.save_id)))
        if self.is_coordinator or not self.use_collectives:  # this rank commits a .metadata
            self._replaced = _in_background(_referenced, self.path, self._metadata_file())
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        tag = _tag(self.save_id)
        return [
            dataclasses.replace(p, storage_data=_FileNames(f"__{i}_", tag)) if p.storage_data is None else p
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        # Python's cyclic GC paused (as in every fastpersist save): the items'
        # layout allocates tens of thousands of objects that live until the
        # files are written; full collections of the heap (DCP's plans
        # included) cost more than the layout itself on 10,000 small tensors.
        try:
            with gc_paused():
                fut = self._write_data(plan, planner)
        except BaseException:
            _end_gc_deferral(self)
            raise
        if not self.is_coordinator:  # else finish is still to come
            _end_gc_deferral(self)
        return fut

    def _write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        # The plan's prefix (this rank's place in the global plan), with this
        # save's own tag: a cached plan (DefaultSavePlanner's plan caching)
        # carries the tag of the save it was made for.
        names = _FileNames(plan.storage_data.prefix, _tag(self.save_id))
        if self.single_file_per_rank:
            groups = _buckets(plan.items, self.thread_count)
        else:
            groups = [[it] for it in plan.items]
        results: List[List[WriteResult]] = [[] for _ in groups]
        stats: List[Any] = [None] * len(groups)
        errors: List[BaseException] = []
        lock = threading.Lock()
        queue = list(enumerate(groups))

        def worker(engine_index: int) -> None:
            while True:
                with lock:
                    if errors or not queue:
                        return
                    n, items = queue.pop(0)
                try:
                    results[n], stats[n] = self._write_file(names.name(n), items, planner, engine_index)
                except BaseException as e:  # noqa: BLE001 - raised on the calling thread
                    with lock:
                        errors.append(e)
                    return

        threads = [
            threading.Thread(target=worker, args=(i,), name=f"fastpersist-dcp-{i}", daemon=True)
            for i in range(1, min(self.thread_count, len(groups)))
        ]
        for t in threads:
            t.start()
        worker(0)
        for t in threads:
            t.join()
        if errors:
            # This save's files written before the failure are of no use
            # (nothing will name them): removed now, not at the next save.
            for n, done in enumerate(stats):
                if done is not None:
                    with contextlib.suppress(OSError):
                        _core.remove_file(os.path.join(self.path, names.name(n)))
            raise errors[0]
        self.last_stats = [s for s in stats if s is not None]
        fut: Future = Future()
        fut.set_result([r for rs in results for r in rs])
        return fut

    def _write_file(
        self, name: str, items: List[WriteItem], planner: SavePlanner, engine_index: int
    ) -> Tuple[List[WriteResult], Any]:
        layout = _FileLayout(name, self._stager.owns if self._stager is not None else None)
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                layout.add_bytes(item, planner.resolve_data(item))

        def parts() -> Iterator[Batch]:
            # Tensors laid out in parts (8 MiB, then twice as much each time),
            # each written while the next is resolved and laid out; once a
            # device tensor comes, the rest is written at the end (staged).
            budget, pending = STREAM_FIRST_PART, 0
            for i, item in enumerate(items):
                if item.type == WriteItemType.BYTE_IO:
                    continue
                if not i % HANDOFF_RECORDS:
                    _core.let_engines_in()  # the writer may wait to gather earlier parts
                data = planner.resolve_data(item)
                if not isinstance(data, torch.Tensor):
                    raise TypeError(
                        f"the save planner resolved the tensor item {item.index.fqn!r} "
                        f"to a {type(data).__name__}, not a tensor"
                    )
                check_unnamed(data)  # (as torch.save refuses it)
                pending += layout.add_tensor(item, data)
                if pending >= budget and not layout.plan.device:
                    yield layout.take()
                    budget, pending = min(2 * budget, STREAM_PART_MAX), 0
            layout.finish()  # the file's length, for the rest written last

        hint = sum(_item_size(it) + SMALL_ALIGNMENT + DATA_ALIGNMENT for it in items)
        try:
            st = write_streamed(layout.plan, parts(), os.path.join(self.path, name), self.opts, hint, engine_index)
        finally:
            del layout.plan.keepalive[:]
        return layout.results(st.crc32), st

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        """The commit: CRC sidecar, then ``.metadata`` (each written to a
        temporary file, fsynced, renamed, directory fsynced); then the files
        of the checkpoint this one replaces are removed."""
        try:
            with gc_paused():
                self._finish(metadata, results)
        finally:
            _end_gc_deferral(self)

    def _finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        from torch.distributed.checkpoint import filesystem

        storage_md: Dict[MetadataIndex, Any] = {}
        files: Dict[str, List[List[int]]] = {}
        for wr in (w for ws in results for w in ws):
            info = wr.storage_data
            storage_md[wr.index] = _StorageInfo(info.relative_path, info.offset, info.length)
            files.setdefault(info.relative_path, []).append(
                [info.offset, info.length, info.crc32, info.data_offset, info.data_length, info.head_crc, info.kind]
            )
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        if hasattr(filesystem, "CURRENT_DCP_VERSION"):
            metadata.version = filesystem.CURRENT_DCP_VERSION
        md_file = self._metadata_file()
        replaced, self._replaced = self._replaced, None
        old_files, old_sidecar = replaced.result() if replaced is not None else _referenced(self.path, md_file)
        sidecar = {"format": SIDECAR_FORMAT, "version": SIDECAR_VERSION, "save_id": self.save_id, "files": files}
        md_path = os.path.join(self.path, md_file)
        before, writing = file_identity(md_path), "sidecar"
        try:
            _core.atomic_write(
                os.path.join(self.path, sidecar_name(self.save_id)),
                json.dumps(sidecar, separators=(",", ":")).encode(),
                durable=self.sync_files,
            )
            writing = "metadata"
            _core.atomic_write(md_path, pickle.dumps(metadata), durable=self.sync_files)
        except BaseException as e:
            renamed = writing == "metadata" and isinstance(e, _core.DurabilityError)
            if renamed or file_identity(md_path) != before:
                # The metadata was renamed in (its directory fsync failed,
                # or an interrupt came after it): the checkpoint now, its
                # files are kept; the replaced one's are left to a later
                # save's sweep.
                raise
            # Not committed: this save's files (every rank's, by the names
            # its results give) are of no use, nothing names them.
            for n in sorted(set(files) | {sidecar_name(self.save_id)}):
                if os.sep not in n and (_OWN_DATA.fullmatch(n) or _OWN_SIDECAR.fullmatch(n)):
                    with contextlib.suppress(OSError):
                        _core.remove_file(os.path.join(self.path, n))
            if isinstance(e, _core.DurabilityError):
                # The sidecar's: the checkpoint was not committed.
                raise WriteError(e.errno, f"the checkpoint was not committed: {e.strerror}", e.filename) from e
            raise
        self._remove_replaced(old_files, old_sidecar, set(files))

    def _remove_replaced(self, old_files: set, old_sidecar: Optional[str], keep: set) -> None:
        """After the commit: the replaced checkpoint's files, and data files
        and sidecars of saves that failed before their commit (named by this
        module, untouched for ``ABANDONED_SAVE_AGE``: a younger one may be
        another save's to this directory still in flight, whose ``.metadata``
        would then name a missing file). Nothing another committed metadata
        file of the directory names (``.metadata``, ``__<rank>.metadata``)
        is removed."""
        mine = _tag(self.save_id)
        rank_only = None if self.use_collectives or self.rank is None else f"__{self.rank}_"
        doomed = {f for f in old_files if os.sep not in f and f not in keep}
        if old_sidecar and old_sidecar != sidecar_name(self.save_id):
            doomed.add(old_sidecar)
        try:
            names = os.listdir(self.path)
        except OSError:
            names = []
        now = time.time()
        named: set = set()  # by the other checkpoints committed here
        for n in names:
            if _METADATA_FILE.fullmatch(n) and n != self._metadata_file():
                files, car = _referenced(self.path, n)
                named |= files | ({car} if car else set())

        for n in names:
            if n in doomed:
                continue
            m, s = _OWN_DATA.fullmatch(n), _OWN_SIDECAR.fullmatch(n)
            data = m is not None and m.group(2) != mine and n not in keep
            data = data and (rank_only is None or n.startswith(rank_only))
            sidecar = s is not None and s.group(1) != mine and rank_only is None
            if (data or sidecar) and abandoned(os.path.join(self.path, n), now):
                doomed.add(n)
        for n in sorted(doomed - named):
            try:
                # The name goes now; a big file's blocks are freed (and
                # discarded) on a background thread, not inside the save.
                _core.remove_file(os.path.join(self.path, n))
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("fastpersist: could not remove %s of a replaced checkpoint: %s", n, e)

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return _local_path(checkpoint_id)

    # -- AsyncStager ----------------------------------------------------------

    def stage(self, state_dict: Any) -> Any:
        """A copy of ``state_dict`` in the writer's reusable staging pool
        (pinned host memory when CUDA tensors are staged): training may
        change the tensors once this returns. The pool's buffer is reused by
        the next stage once DCP has dropped this copy."""
        if self._stager is None:
            self._stager = _Stager()
        return self._stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        """Staging is complete when :meth:`stage` returns."""

    def close(self) -> None:
        """Free the staging pool's buffers not in use."""
        _end_gc_deferral(self)
        if self._stager is not None:
            self._stager.close()


def _begin_gc_deferral(owner: Any) -> None:
    """Full collections deferred from a writer's or reader's first call in
    a save or load (``owner.defer_gc``; the deferral made on first use, and
    ended when the owner is dropped, should no later call end it)."""
    if owner.defer_gc:
        if owner._gc is None:
            owner._gc = full_gc_deferral(owner)
        owner._gc.begin()


def _end_gc_deferral(owner: Any) -> None:
    if owner._gc is not None:
        owner._gc.end()


def _local_path(checkpoint_id: Any) -> bool:
    """A plain local path whose nearest existing parent is writable."""
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        return False
    p = os.fsdecode(os.fspath(checkpoint_id))
    if "://" in p or not p:
        return False
    return FileSystemWriter.validate_checkpoint_id(p)


# ---------------------------------------------------------------------------
# The reader


class _Pending(NamedTuple):
    """A read item whose bytes are being read in the current batch."""

    req: Any
    info: Any  # _StorageInfo
    crc: Optional[List[int]]  # sidecar entry
    parts: List[int]  # request indexes whose CRCs make the item's
    lengths: List[int]
    target: Any  # tensor read into, or a byte buffer
    direct: bool  # read straight into the destination
    dest: Any = None  # the destination, when resolved already (resolved once)


class _ReadBatch:
    """The reads of one engine call: (file offset, address, bytes) requests,
    device reads staged, the items they make, the temporary buffers they
    fill (kept alive until the call returns) and those buffers' bytes."""

    def __init__(self) -> None:
        self.reqs: List[Tuple[int, int, int]] = []
        self.staged: List[Tuple[int, Any, int]] = []
        self.pending: List[_Pending] = []
        self.keep: List[Any] = []
        self.temp_bytes = 0
        # The items' file offsets: one engine call reads a range once (two
        # read items of one saved item, such as two shards cut from one
        # saved chunk, or tied weights, go to two calls).
        self.items: Set[int] = set()
        # The chunk small pieces are cut from: its address and bytes left.
        self._piece_at = 0
        self._piece_room = 0
        # The memory of the destinations resolved for its items, by device:
        # sorted, disjoint (start, end) byte spans.
        self._dests: Dict[Any, Tuple[List[int], List[int]]] = {}

    def claims(self, dest: Optional[torch.Tensor]) -> bool:
        """Take ``dest``'s memory for an item of this batch; False (nothing
        taken) when an item of it already has some of that memory. A
        planner may resolve every item to one scratch buffer and copy it
        out at ``commit_tensor``: such items go to separate batches, each
        read and committed before the next is resolved into."""
        span = _span(dest) if dest is not None else None
        if span is None:
            return True
        key, lo, hi = span
        starts, ends = self._dests.setdefault(key, ([], []))
        i = bisect.bisect_right(starts, lo)
        if (i > 0 and ends[i - 1] > lo) or (i < len(starts) and starts[i] < hi):
            return False
        starts.insert(i, lo)
        ends.insert(i, hi)
        return True

    def add(self, off: int, n: int, addr: Optional[int] = None) -> int:
        """A request for ``n`` bytes at ``off`` into ``addr`` (else into a
        temporary buffer); returns its index."""
        if addr is None:
            addr = self._temp(n)
        self.reqs.append((off, addr, n))
        return len(self.reqs) - 1

    def _temp(self, n: int) -> int:
        """The address of ``n`` bytes of temporary memory, kept until the
        batch is read. The heads and tails of items' blobs (read only for
        their CRC32s; two per item, a few hundred bytes each) are cut from
        shared chunks: one allocation for thousands of them."""
        if n > PIECE_CHUNK // 16:
            buf = torch.empty(n, dtype=torch.uint8)
            self.keep.append(buf)
            self.temp_bytes += n
            return buf.data_ptr()
        if n > self._piece_room:
            chunk = torch.empty(PIECE_CHUNK, dtype=torch.uint8)
            self.keep.append(chunk)
            self._piece_at, self._piece_room = chunk.data_ptr(), PIECE_CHUNK
        # The bound counts the bytes cut (a chunk's unused rest, less than
        # PIECE_CHUNK per batch, is not counted).
        self.temp_bytes += n
        addr = self._piece_at
        self._piece_at += n
        self._piece_room -= n
        return addr


class _Unreadable:
    """Metadata that could not be read, standing in where DCP's loader does
    not let read_metadata's error through: any use raises that error (DCP
    then reports it, message included, in its CheckpointException)."""

    def __init__(self, err: BaseException) -> None:
        object.__setattr__(self, "_err", err)

    def __getattr__(self, name: str) -> Any:
        raise object.__getattribute__(self, "_err")

    def __bool__(self) -> bool:
        return True


class FastPersistReader(StorageReader):
    """A DCP ``StorageReader`` that reads with fastpersist's engine and, with
    ``verify`` (the default), checks each item's CRC32 against the sidecar
    the writer committed (checkpoints without one, e.g. from DCP's own
    writer, are read unchecked). ``defer_gc`` and ``engine_options`` as for
    the writer (full collections deferred from ``set_up_storage_reader`` to
    the end of ``read_data``). Items DCP's writer stored through its
    extensions (compressed, say) are read by DCP's ``FileSystemReader``,
    with ``_extension_registry`` as it takes it (experimental in DCP)."""

    def __init__(
        self,
        path: Any,
        *,
        verify: bool = True,
        defer_gc: bool = True,
        _extension_registry: Any = None,
        **engine_options: Any,
    ) -> None:
        super().__init__()
        self._extension_registry = _extension_registry
        self.path = _dir(path)
        self.verify = bool(verify)
        self.defer_gc = bool(defer_gc)
        self._gc: Optional[FullGcDeferral] = None
        self.opts = EngineOptions.given("FastPersistReader()", engine_options)
        self.load_id = str(uuid.uuid4())
        self.storage_data: Dict[Any, Any] = {}
        self.crcs: Dict[Tuple[str, int], List[int]] = {}
        self.chunks: Dict[Tuple[str, Tuple[int, ...]], Tuple[Tuple[int, ...], torch.dtype]] = {}
        #: Whether the last load checked CRC32s (a sidecar was found).
        self.verified = False
        self.rank: Optional[int] = None
        #: read_metadata's error (handed to DCP's rank-local retry).
        self._unreadable: Optional[Exception] = None

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}
        self.crcs = {}
        self.chunks = {}
        if checkpoint_id:
            self.path = _dir(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def _check_dir(self) -> None:
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"no checkpoint at {self.path}")
        if not os.path.isdir(self.path):
            raise _not_a_directory(self.path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA if rank is None else f"__{rank}{METADATA}"
        path = os.path.join(self.path, name)
        bad = getattr(self, "_unreadable", None)
        try:
            self._check_dir()
            md = self._load_metadata(path, name)
        except Exception as e:
            if rank is None:
                self._unreadable = e
            elif bad is not None:
                # torch >= 2.11 swallows read_metadata's error, asks for
                # rank-local metadata, then reports only "metadata is None":
                # hand it a stand-in that raises the first error when used.
                return _Unreadable(bad)  # type: ignore[return-value]
            raise
        self._unreadable = None
        return md

    def _load_metadata(self, path: str, name: str) -> Metadata:
        try:
            with open(path, "rb") as f, gc_paused():  # an entry (several objects) per item
                md = pickle.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.path} is not a DCP checkpoint: {name} is missing") from None
        except Exception as e:
            raise CorruptCheckpointError(f"{path}: damaged or unknown DCP metadata ({type(e).__name__}: {e})") from e
        if not isinstance(md, Metadata) or not isinstance(getattr(md, "storage_data", None), dict):
            raise CorruptCheckpointError(f"{path}: not DCP metadata (a {type(md).__name__})")
        meta = getattr(md, "storage_meta", None)
        if meta is None:
            meta = md.storage_meta = StorageMeta()
        meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        _begin_gc_deferral(self)  # until read_data, this rank's last call
        self.rank = kwargs.get("rank")
        self.metadata = metadata
        self.storage_data = metadata.storage_data
        self.chunks = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):  # byte items have no chunks
                for ch in md.chunks:
                    self.chunks[(fqn, tuple(ch.offsets))] = (tuple(ch.sizes), md.properties.dtype)
        self.crcs = self._load_sidecar(getattr(metadata.storage_meta, "save_id", None))
        self.verified = self.verify and bool(self.crcs)

    def _load_sidecar(self, save_id: Optional[str]) -> Dict[Tuple[str, int], List[int]]:
        if not isinstance(save_id, str) or not save_id or not _OWN_SIDECAR.fullmatch(sidecar_name(save_id)):
            return {}  # a save that never had one of this module's sidecars
        path = os.path.join(self.path, sidecar_name(save_id))
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return {}
        try:
            doc = parse_json(raw)
            if doc.get("format") != SIDECAR_FORMAT or doc.get("save_id") != save_id:
                raise ValueError("not this checkpoint's sidecar")
            out: Dict[Tuple[str, int], List[int]] = {}
            for rel, entries in doc["files"].items():
                for entry in entries:
                    # offset, length, CRC32 (version 1); data offset and
                    # length, head CRC32, kind (version 2)
                    if not isinstance(entry, list) or len(entry) not in (5, 7):
                        raise ValueError(f"an entry of {rel!r} is {entry!r}, not 5 or 7 numbers")
                    crc = [int(x) for x in entry]
                    if crc[1] != 0:  # (an empty item has nothing to check; the next item begins where it lies)
                        out[(rel, crc[0])] = crc
            return out
        except Exception as e:
            raise CorruptCheckpointError(f"{path}: damaged CRC32 sidecar ({e})") from e

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return FileSystemReader.validate_checkpoint_id(checkpoint_id) if _local_path(checkpoint_id) else False

    # -- reading --------------------------------------------------------------

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        try:
            with gc_paused():  # as for the writer: many objects, none garbage
                return self._read_data(plan, planner)
        finally:
            _end_gc_deferral(self)

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: Dict[str, List[Any]] = {}
        transformed = []
        for req in plan.items:
            info = self.storage_data.get(req.storage_index)
            if info is None:
                raise CorruptCheckpointError(f"{self.path}: .metadata has no storage entry for {req.storage_index}")
            rel = info.relative_path
            if names_outside(rel):
                raise CorruptCheckpointError(f"{self.path}: item {req.storage_index.fqn} names a file outside it")
            if getattr(info, "transform_descriptors", None):
                transformed.append(req)  # (compressed, say, by DCP's writer's extensions)
            else:
                per_file.setdefault(rel, []).append(req)
        if transformed:
            self._read_transformed(transformed, planner)
        for rel, reqs in per_file.items():
            self._read_file(rel, sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset), planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_transformed(self, reqs: List[Any], planner: LoadPlanner) -> None:
        """Items that DCP's writer stored through its extensions (their
        ``transform_descriptors``: a compression, say) are read by DCP's
        own reader, which undoes them (fastpersist's writer uses none)."""
        for rel in {self.storage_data[r.storage_index].relative_path for r in reqs}:
            # A file of the checkpoint, not a link out of it (DCP's reader
            # opens it by path); and one that fastpersist's sidecar, when
            # there is one, would have covered (its writer uses no
            # extensions).
            os.close(open_beneath(self.path, rel))
        if self.verified:
            raise CorruptCheckpointError(
                f"{self.path}: item {reqs[0].storage_index.fqn!r} was stored through DCP's extensions, which the "
                "CRC32 sidecar's writer does not use: the sidecar and .metadata disagree"
            )
        reader = FileSystemReader(self.path, _extension_registry=self._extension_registry)
        reader.set_up_storage_reader(self.metadata, False)
        reader.read_data(dataclasses.replace(LoadPlan(items=[]), items=reqs), planner).wait()

    def _read_file(self, rel: str, reqs: List[Any], planner: LoadPlanner) -> None:
        path = os.path.join(self.path, rel)
        try:
            fd = open_beneath(self.path, rel)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: data file missing (named by {self.path}/{METADATA})") from None

        try:
            size = os.fstat(fd).st_size
            batch = _ReadBatch()
            for req in reqs:
                info = self.storage_data[req.storage_index]
                if info.offset < 0 or info.length < 0 or info.offset + info.length > size:
                    raise CorruptCheckpointError(
                        f"{path}: item {_name(req)} ({info.length} bytes at {info.offset}) lies outside the file "
                        f"({size} bytes): truncated?"
                    )
                crc = self.crcs.get((rel, info.offset)) if info.length else None
                if crc is None and info.length and self.verified:
                    # The sidecar covers every item its save wrote: one it
                    # does not name is not that save's (or the sidecar is).
                    raise CorruptCheckpointError(
                        f"{path}: item {_name(req)} ({info.length} bytes at {info.offset}) has no CRC32 in the "
                        "sidecar: the sidecar and .metadata disagree"
                    )
                fast = self._fast_target(req, crc, planner) if req.type != LoadItemType.BYTE_IO else None
                # Every tensor item's destination, resolved now (once) and
                # claimed: a batch holds no two items whose destinations
                # share memory (one read in, the other copied in at its
                # finish, would overwrite it before its commit).
                dest = None
                if req.type != LoadItemType.BYTE_IO:
                    dest = fast[2] if fast is not None and fast[2] is not None else planner.resolve_tensor(req).detach()
                if (
                    (info.length and info.offset in batch.items)
                    or len(batch.pending) >= READ_BATCH_ITEMS
                    or not batch.claims(dest)
                ):
                    self._read_batch(fd, path, batch, planner)
                    batch = _ReadBatch()
                    batch.claims(dest)
                batch.items.add(info.offset)
                self._plan_item(batch, path, req, info, crc, fast, dest)
                # Items read straight into their destinations cost no memory:
                # only the temporary buffers bound a batch.
                if batch.temp_bytes >= READ_BATCH_BYTES:
                    self._read_batch(fd, path, batch, planner)
                    batch = _ReadBatch()
            if batch.pending:
                self._read_batch(fd, path, batch, planner)
        finally:
            os.close(fd)

    def _plan_item(
        self,
        batch: _ReadBatch,
        path: str,
        req: Any,
        info: Any,
        crc: Optional[List[int]],
        fast: Optional[Tuple[torch.Tensor, bool, Optional[torch.Tensor]]],
        dest: Optional[torch.Tensor] = None,
    ) -> None:
        """Add the reads of one item to ``batch`` (``fast``: its
        :meth:`_fast_target`; ``dest``: its destination, resolved)."""
        if crc is not None and crc[1] != info.length:
            raise CorruptCheckpointError(f"{path}: item {_name(req)}: sidecar and .metadata disagree on its size")
        if fast is None:
            buf = torch.empty(info.length, dtype=torch.uint8)
            i = batch.add(info.offset, info.length, buf.data_ptr() if info.length else None)
            batch.keep.append(buf)
            batch.temp_bytes += info.length
            batch.pending.append(_Pending(req, info, crc, [i], [info.length], buf, False, dest))
            return
        target, direct, _ = fast
        assert crc is not None
        data_off, data_len = crc[3], crc[4]
        tail = info.length - data_off - data_len
        parts = [batch.add(info.offset, data_off)]
        if not direct:
            batch.temp_bytes += data_len
        if target.is_cpu:
            parts.append(batch.add(info.offset + data_off, data_len, target.data_ptr() if data_len else None))
        else:
            batch.staged.append((info.offset + data_off, target.untyped_storage(), data_len))
            parts.append(-len(batch.staged))  # a staged read's CRC, by its index
        parts.append(batch.add(info.offset + data_off + data_len, tail))
        batch.pending.append(_Pending(req, info, crc, parts, [data_off, data_len, tail], target, direct, dest))

    def _read_batch(self, fd: int, path: str, batch: _ReadBatch, planner: Any) -> None:
        reqs, staged = batch.reqs, batch.staged
        with use_engine(self.opts) as eng:
            sent = [r for r in reqs if r[2]]
            crcs = iter(read_with(eng, fd, sent) if sent else [])
        # zero-length requests are not sent: theirs is the CRC of nothing
        got = [next(crcs) if r[2] else 0 for r in reqs]
        staged_crcs = read_staged(fd, [s for s in staged if s[2]], self.opts) if staged else []
        it = iter(staged_crcs)
        staged_got = [next(it) if s[2] else 0 for s in staged]
        for p in batch.pending:
            self._finish_item(path, p, got, staged_got, planner)

    def _fast_target(
        self, req: Any, crc: Optional[List[int]], planner: Any
    ) -> Optional[Tuple[torch.Tensor, bool, Optional[torch.Tensor]]]:
        """Where an item's tensor data is read to without parsing its blob
        (the sidecar says where the data lies): the destination itself when
        the item is all of it, dense, of the same dtype (``True``); else a
        fresh tensor of the saved chunk on the destination's device. Third:
        the destination, when resolved here (each item's is resolved once,
        as DCP's own reader does)."""
        # The sidecar entry: offset, length, CRC32, data offset and length,
        # head CRC32, kind (version 2).
        if crc is None or crc[3] < 0 or len(crc) < 7:
            return None
        chunk = self.chunks.get((req.storage_index.fqn, tuple(req.storage_index.offset or ())))
        if chunk is None:
            return None
        sizes, dtype = chunk
        n = 1
        for s in sizes:
            n *= s
        if n * element_size(dtype) != crc[4] or crc[3] + crc[4] > crc[1] or crc[6] != _kind(dtype, sizes):
            # The .metadata and the blob disagree: torch parses the blob.
            return None
        whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == sizes
        dest = planner.resolve_tensor(req).detach() if whole else None
        # is_cpu / is_cuda: no device object made (this runs once per item).
        if dest is not None and dest.dtype == dtype and tuple(dest.shape) == sizes and not _lazy(dest):
            if dest.is_cpu and dest.is_contiguous():
                return dest, True, dest
            if dest.is_cuda and _exact(dest):
                return dest, True, dest
        if dest is not None and dest.is_cuda:
            return torch.empty(sizes, dtype=dtype, device=dest.device), False, dest
        return torch.empty(sizes, dtype=dtype), False, dest

    def _finish_item(self, path: str, p: _Pending, got: List[int], staged_crcs: List[int], planner: Any) -> None:
        crc_parts = [staged_crcs[-i - 1] if i < 0 else got[i] for i in p.parts]
        if len(p.parts) > 1 and p.crc is not None and crc_parts[0] != p.crc[5]:
            # The data was taken where the sidecar says it lies: the bytes
            # before it must be the blob head it recorded.
            raise CorruptCheckpointError(
                f"{path}: item {_name(p.req)} ({p.info.length} bytes at {p.info.offset}): the bytes before its data "
                f"are not the blob head the CRC32 sidecar recorded (a damaged sidecar or data file)"
            )
        if p.crc is not None and self.verify:
            crc = crc_parts[0]
            for c, n in zip(crc_parts[1:], p.lengths[1:]):
                crc = _core.crc32_combine(crc, c, n)
            if crc != p.crc[2]:
                raise CorruptCheckpointError(
                    f"{path}: item {_name(p.req)} ({p.info.length} bytes at {p.info.offset}): CRC32 {crc:#010x}, "
                    f"the checkpoint recorded {p.crc[2]:#010x}"
                )
        req = p.req
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(p.target.numpy().tobytes()))
            return
        if p.direct:
            planner.commit_tensor(req, p.target)
            return
        if len(p.parts) == 1:  # the whole blob, parsed by torch
            try:
                t = torch.load(io.BytesIO(p.target.numpy().tobytes()), map_location="cpu", weights_only=True)
            except Exception as e:
                raise CorruptCheckpointError(f"{path}: item {_name(req)} is not a readable tensor ({e})") from e
        else:
            t = p.target
        t = _narrow(t, req.storage_offsets, req.lengths)
        dest = p.dest if p.dest is not None else planner.resolve_tensor(req).detach()
        if dest.size() != t.size():
            raise CorruptCheckpointError(
                f"{path}: item {_name(req)} has size {tuple(t.size())}, expected {tuple(dest.size())}"
            )
        dest.copy_(t)
        planner.commit_tensor(req, dest)


def _span(t: torch.Tensor) -> Optional[Tuple[Any, int, int]]:
    """The bytes ``t``'s elements lie in: (device, first, past the last);
    None for no element, or no memory (a meta tensor)."""
    if t.numel() == 0 or t.is_meta or t.data_ptr() == 0:
        return None
    reach = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1
    lo = t.data_ptr()
    return (t.device, lo, lo + reach * t.element_size())


def _narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.size(dim):
            t = t.narrow(dim, o, n)
    return t


def _name(req: Any) -> str:
    idx = req.storage_index
    off = tuple(idx.offset) if idx.offset is not None else ()
    return f"{idx.fqn!r}" + (f" (chunk at {list(off)})" if off else "")


# ---------------------------------------------------------------------------
# install / uninstall


_installed: Dict[str, Any] = {}


def install() -> None:
    """Make DCP pick fastpersist (:class:`FastPersistWriter`,
    :class:`FastPersistReader`) for plain local paths when the caller passes
    only ``checkpoint_id`` (as torchtitan and Lightning's FSDP and
    ModelParallel strategies do). Idempotent; :func:`uninstall` undoes it."""
    from torch.distributed.checkpoint import _storage_utils

    if _installed:
        return
    _installed["FileSystemWriter"] = _storage_utils.FileSystemWriter
    _installed["FileSystemReader"] = _storage_utils.FileSystemReader
    # The ignores: mypy forbids assigning to a class name (this patch's purpose).
    _storage_utils.FileSystemWriter = FastPersistWriter  # type: ignore[misc,assignment]
    _storage_utils.FileSystemReader = FastPersistReader  # type: ignore[misc,assignment]


def uninstall() -> None:
    """Give DCP its own file system storage back."""
    from torch.distributed.checkpoint import _storage_utils

    if not _installed:
        return
    # The ignores: mypy forbids assigning to a class name (this patch's purpose).
    _storage_utils.FileSystemWriter = _installed.pop("FileSystemWriter")  # type: ignore[misc]
    _storage_utils.FileSystemReader = _installed.pop("FileSystemReader")  # type: ignore[misc]


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_installed)
