"""Type stubs for the Rust extension ``fastpersist._core``.

Checked against the built extension with
``python -m mypy.stubtest fastpersist._core`` (no allowlist needed).

Argument shapes: wherever a list of tuples is taken, any sequence of
tuples works, and tuple subclasses (``NamedTuple``) are accepted as tuples.
"""

from collections.abc import Callable, Sequence
from os import PathLike
from types import TracebackType
from typing import Any, Protocol, TypedDict, final

from typing_extensions import Buffer, Self, TypeAlias

_StrPath: TypeAlias = str | PathLike[str]

# A byte range of the file with where its bytes come from:
# (file offset, bytes) for owned bytes (headers, small records),
_Blob: TypeAlias = tuple[int, bytes]
# (file offset, address, length, checksum id or -1) for caller memory the
# caller keeps alive and unchanged for the call,
_Region: TypeAlias = tuple[int, int, int, int]
# (file offset, checksum id) for a 4-byte little-endian CRC32 slot.
_Slot: TypeAlias = tuple[int, int]

class _Guard(Protocol):
    """``fastpersist.plan.MemoryGuard``: raises when a storage changed."""

    def check(self, crc_ids: list[int] | None = ...) -> None: ...

# (file offset, destination address, length) of a record to read.
_ReadRequest: TypeAlias = tuple[int, int, int]
# (file offset, length) of a range to checksum.
_Range: TypeAlias = tuple[int, int]

class _ReadConsumer(Protocol):
    """What ``Engine.read_handed`` hands its completed arena buffers to."""

    def filled(self, buf: int, addr: int, n: int, pieces: list[tuple[int, int, int, int]]) -> None: ...
    def released(self, wait: bool) -> list[int]: ...

__version__: str
TEMP_MARKER: str
# Target names longer than this (bytes) are cut and hashed in temporary names.
TEMP_NAME_PART_MAX: int
__all__ = [
    "Engine",
    "WriteSession",
    "HostBuffer",
    "TempFile",
    "WriteError",
    "ReadError",
    "DurabilityError",
    "partition",
    "dio_alignment",
    "check_engine_options",
    "copy_kernel",
    "let_engines_in",
    "engines_waiting",
    "crc32",
    "zip_local_header",
    "zip_local_header_len",
    "zip_descriptor_sizes",
    "zip_storage_records",
    "zip_central_directory",
    "zip_central_entries",
    "crc32_ranges",
    "copy_memory",
    "crc32_combine",
    "atomic_write",
    "split_ranges",
    "temp_file_in_use",
    "fallocate_zero_fills",
    "is_temp_name",
    "temp_name_part",
    "wait_for_frees",
    "prepare_memory",
    "remove_file",
    "fast_pickle",
    "survey",
    "SurveyRest",
    "pickle_memo_bound",
    "json_depth",
    "fast_unpickle",
    "TEMP_MARKER",
    "TEMP_NAME_PART_MAX",
    "RawWriteStats",
    "RawReadStats",
    "__version__",
]

class RawWriteStats(TypedDict):
    """What one write (``write_file``, ``finish``, ``write_part``) did."""

    bytes: int
    seconds: float
    direct: bool
    io_uring: bool
    registered: bool
    locked: bool
    block: int
    direct_note: str | None
    uring_note: str | None
    crcs: list[int]
    open_seconds: float
    io_seconds: float
    commit_seconds: float
    zero_copy_bytes: int

class RawReadStats(TypedDict):
    """What one read (``read_into``, ``read_into_fd``) did."""

    bytes: int
    seconds: float
    file_len: int
    direct: bool
    io_uring: bool
    crcs: list[int]

class WriteError(OSError):
    """An I/O error while writing a checkpoint (errno, strerror, filename)."""

class ReadError(WriteError):
    """An I/O error while reading a checkpoint (errno, strerror, filename);
    a ``WriteError`` too, the class such errors had before."""

class DurabilityError(WriteError):
    """The commit renamed the new file onto the target, but the directory
    fsync that makes the rename durable failed: the new file IS in place at
    the target, its durability is not confirmed (errno, strerror, target)."""

@final
class Engine:
    """A reusable writer and reader: staging arena, io_uring ring, fallback pool.

    Out-of-range option values (negative, huge) raise ``ValueError`` naming
    the option.
    """

    def __new__(
        cls,
        *,
        block_size: int = ...,
        arena_bytes: int = ...,
        queue_depth: int = ...,
        direct: bool = True,
        io_uring: bool = True,
        register_buffers: bool = True,
        lock_memory: bool = True,
        pool_threads: int = ...,
        durable: bool = True,
        flush_every: int = ...,
        gather_threads: int | None = None,
        zero_copy: bool = True,
    ) -> Self: ...
    @property
    def arena_ptr(self) -> int: ...
    @property
    def arena_bytes(self) -> int: ...
    def at_close(self, callback: Callable[[], object]) -> None: ...
    @property
    def block_size(self) -> int: ...
    @property
    def uses_io_uring(self) -> bool: ...
    @property
    def locked(self) -> bool: ...
    @property
    def retired(self) -> bool: ...
    def set_gather_threads(self, threads: int) -> None: ...
    def set_file_mode(self, mode: int | None) -> None: ...
    def set_fault(
        self,
        offset: int | None = None,
        errno: int = ...,
        refuse_direct: bool = False,
        dir_fsync_errno: int | None = None,
        min_block: int | None = None,
    ) -> None: ...
    def write_file(
        self,
        path: _StrPath,
        blobs: Sequence[_Blob],
        regions: Sequence[_Region],
        slots: Sequence[_Slot],
        file_len: int,
        guard: _Guard | None = None,
    ) -> RawWriteStats: ...
    def read_into(self, path: _StrPath, reqs: Sequence[_ReadRequest]) -> RawReadStats: ...
    def read_into_fd(self, fd: int, reqs: Sequence[_ReadRequest], merge_gap: int | None = None) -> RawReadStats: ...
    def read_handed(
        self, fd: int, ranges: Sequence[_Range], consumer: _ReadConsumer, merge_gap: int | None = None
    ) -> RawReadStats: ...
    def crc_ranges(self, path: _StrPath, ranges: Sequence[_Range]) -> list[int]: ...
    def crc_ranges_fd(self, fd: int, ranges: Sequence[_Range]) -> list[int]: ...
    def write_part(
        self,
        path: _StrPath,
        blobs: Sequence[_Blob],
        regions: Sequence[_Region],
        file_len: int,
        index: int,
        parts: int,
        guard: _Guard | None = None,
    ) -> RawWriteStats: ...
    def begin(self, path: _StrPath, size_hint: int = ...) -> WriteSession: ...

@final
class WriteSession:
    """A file written in order; made by ``Engine.begin``."""

    @property
    def block(self) -> int: ...
    def take_buffer(self) -> tuple[int, int]: ...
    def write_buffer(self, index: int, offset: int, nbytes: int, crc_id: int | None = ...) -> None: ...
    def give_back(self, index: int) -> None: ...
    def write(
        self,
        blobs: Sequence[_Blob],
        regions: Sequence[_Region],
        slots: Sequence[_Slot],
        guard: _Guard | None = None,
        lend: bool = True,
    ) -> None: ...
    def write_behind(
        self,
        blobs: Sequence[_Blob],
        regions: Sequence[_Region],
        slots: Sequence[_Slot],
        guard: _Guard | None = None,
        reserve: int = ...,
    ) -> None: ...
    def reserve(self, nbytes: int) -> None: ...
    def join_behind(self) -> None: ...
    @property
    def behind_failed(self) -> bool: ...
    @property
    def behind_pending(self) -> int: ...
    def finish(
        self,
        blobs: Sequence[_Blob],
        regions: Sequence[_Region],
        slots: Sequence[_Slot],
        file_len: int,
        on_gathered: Callable[[], object] | None = None,
        guard: _Guard | None = None,
    ) -> RawWriteStats: ...
    def abort(self) -> None: ...

@final
class HostBuffer:
    """Page-aligned, locked host memory (for CUDA staging)."""

    def __new__(cls, nbytes: int) -> Self: ...
    @property
    def ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

@final
class TempFile:
    """The one durable-commit primitive: a locked temporary file
    ``.<name>.<pid>.<n>.fptmp`` next to ``target``, committed by fsync,
    rename and directory fsync; removed by ``abort``, by leaving a ``with``
    block without committing, or when dropped."""

    def __new__(cls, target: _StrPath, *, direct: bool = False) -> Self: ...
    @property
    def fd(self) -> int: ...
    @property
    def temp_path(self) -> str: ...
    @property
    def target(self) -> str: ...
    @property
    def direct(self) -> bool: ...
    def preallocate(self, nbytes: int) -> None: ...
    def write(self, data: Buffer, offset: int) -> None: ...
    def commit(self, length: int | None = None, durable: bool = True) -> None: ...
    def set_fault(self, dir_fsync_errno: int | None = None) -> None: ...
    def abort(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> bool: ...

def partition(
    segments: Sequence[tuple[int, int]],
    file_len: int,
    block: int,
    max_len: int,
    parts: int = 1,
) -> list[tuple[tuple[int, int], list[tuple[int, int, list[tuple[int, int, int, int]]]]]]: ...
def dio_alignment(path: _StrPath) -> tuple[int, int, int, bool]: ...
def check_engine_options(*, block_size: int, arena_bytes: int, queue_depth: int, gather_threads: int) -> None:
    """Raise the ValueError that making an engine with these options would."""

def copy_kernel() -> str | None:
    """The one-pass copy and CRC32's instruction set ("avx512", "avx2",
    "sse"), or None where gathers copy and checksum in two passes."""

def let_engines_in() -> bool:
    """Hand the GIL to an engine thread waiting for it to gather caller
    memory, if one is (for loops that lay out a file while its earlier
    parts are written); an atomic load when none waits. Returns whether
    one waited."""

def engines_waiting() -> int:
    """How many engine threads wait for the GIL now (0 in a fork child)."""

def crc32(data: bytes) -> int: ...
def zip_local_header(name: bytes, header_off: int, size: int, align: int) -> bytes: ...
def zip_local_header_len(name_len: int, header_off: int, size: int, align: int) -> int: ...
def zip_descriptor_sizes(header_off: int, size: int) -> bytes: ...
def zip_storage_records(
    cursor: int,
    align: int,
    records: Sequence[tuple[bytes, int, int, int, bool]],
    pieces: tuple[Any, Any, Any],
) -> tuple[list[Any], list[Any], list[Any], list[tuple[int, int]], int]: ...
def zip_central_directory(
    cursor: int,
    entries: Sequence[tuple[bytes, int, int, int | None, int | None]],
    pieces: tuple[Any, Any],
) -> tuple[list[Any], list[Any], int]: ...
def zip_central_entries(cd: bytes, n: int, cd_offset: int) -> list[tuple[str, int, int, int, bytes]] | None: ...
def crc32_ranges(ranges: Sequence[tuple[int, int, int]], guard: _Guard | None = None) -> list[int]: ...
def copy_memory(dst: int, src: int, n: int, guard: _Guard, crc_id: int) -> None: ...
def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int: ...
def atomic_write(path: _StrPath, data: Buffer, *, durable: bool = True) -> None: ...
def split_ranges(file_len: int, block: int, parts: int) -> list[tuple[int, int]]: ...
def temp_file_in_use(path: _StrPath) -> bool: ...
def fallocate_zero_fills(path: _StrPath) -> bool: ...
def is_temp_name(name: _StrPath) -> bool: ...
def temp_name_part(name: bytes) -> bytes:
    """The ``<part>`` of the temporary file names of a target named ``name``
    (the name, or its first bytes and a hash of it when it is long)."""

def wait_for_frees(timeout: float) -> bool: ...
def remove_file(path: _StrPath) -> None: ...
def prepare_memory(addr: int, nbytes: int) -> None: ...

# fastpersist.pickling._fast_context(): torch.Tensor, OrderedDict,
# torch.strided, "storage", the CPU location tag, (_rebuild_tensor_v2, its
# GLOBAL bytes), OrderedDict's GLOBAL bytes, get_tensor_metadata or None,
# dtype -> (storage class, its GLOBAL bytes, element size) or None.
_PickleContext: TypeAlias = tuple[
    type,
    type,
    object,
    str,
    str,
    tuple[object, bytes],
    bytes,
    Callable[[object], dict[str, bool]] | None,
    Callable[[object], tuple[object, bytes, int] | None],
]

def fast_pickle(
    obj: object,
    ctx: _PickleContext,
    known: dict[int, tuple[str, object]] | None = None,
    add: tuple[Callable[[Any], object], dict[int, Any]] | None = None,
) -> tuple[bytes, dict[str, object]] | None: ...

# What fastpersist.pickling._survey_context() builds: torch.Tensor,
# torch.nn.Parameter, OrderedDict, torch.strided,
# pickling._has_data, pickling._version, pickling._ATOMS,
# pickling._may_hold_storages.
_SurveyContext: TypeAlias = tuple[
    type,
    type,
    type,
    object,
    Callable[[Any], bool],
    Callable[[Any], int | None],
    tuple[type, ...],
    Callable[[Any], bool],
]

_SurveyFound: TypeAlias = tuple[dict[int, tuple[str, Any]], int, list[Any], int]

@final
class SurveyRest:
    def finish(self, ctx: _SurveyContext) -> _SurveyFound: ...
    def __len__(self) -> int: ...

def pickle_memo_bound(data: bytes) -> int | None: ...
def json_depth(data: bytes, limit: int) -> int: ...
def survey(
    obj: object,
    ctx: _SurveyContext,
    seen: dict[int, Any] | None,
    find: bool,
    limit: tuple[int, int] | None = None,
) -> tuple[dict[int, tuple[str, Any]], int, list[Any], int, SurveyRest | None]: ...

# What fastpersist.pickling._fast_unpickle_context() builds: (module, name,
# object) of each GLOBAL resolved, torch._utils._rebuild_tensor_v2,
# OrderedDict, torch.storage.TypedStorage, torch.empty.
_UnpickleContext: TypeAlias = tuple[
    list[tuple[bytes, bytes, object]],
    object,
    type,
    type,
    Callable[..., object],
]

def fast_unpickle(
    data: Buffer,
    ctx: _UnpickleContext,
    persistent_load: Callable[[Any], object],
) -> object | None: ...
