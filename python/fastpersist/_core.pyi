"""Type stubs for the Rust extension ``fastpersist._core``."""

from os import PathLike
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

__version__: str
TEMP_MARKER: str

class WriteError(OSError):
    """An I/O error while writing a checkpoint (errno, strerror, filename)."""

class Engine:
    def __init__(
        self,
        *,
        block_size: int = ...,
        arena_bytes: int = ...,
        queue_depth: int = ...,
        direct: bool = ...,
        io_uring: bool = ...,
        register_buffers: bool = ...,
        lock_memory: bool = ...,
        pool_threads: int = ...,
        durable: bool = ...,
        flush_every: int = ...,
    ) -> None: ...
    @property
    def arena_ptr(self) -> int: ...
    @property
    def arena_bytes(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def uses_io_uring(self) -> bool: ...
    @property
    def locked(self) -> bool: ...
    def set_fault(self, offset: Optional[int] = None, errno: int = ..., refuse_direct: bool = ...) -> None: ...
    def write_file(
        self,
        path: Union[str, PathLike[str]],
        blobs: List[Tuple[int, bytes]],
        regions: List[Tuple[int, int, int, int]],
        slots: List[Tuple[int, int]],
        file_len: int,
    ) -> Dict[str, Any]: ...
    def read_into(
        self, path: Union[str, PathLike[str]], reqs: List[Tuple[int, int, int]]
    ) -> Dict[str, Any]: ...
    def write_part(
        self,
        path: Union[str, PathLike[str]],
        blobs: List[Tuple[int, bytes]],
        regions: List[Tuple[int, int, int, int]],
        file_len: int,
        index: int,
        parts: int,
    ) -> Dict[str, Any]: ...
    def crc_ranges(self, path: Union[str, PathLike[str]], ranges: List[Tuple[int, int]]) -> List[int]: ...
    def begin(self, path: Union[str, PathLike[str]], size_hint: int = 0) -> "WriteSession": ...

class HostBuffer:
    """Page-aligned, locked host memory (for CUDA staging)."""

    def __init__(self, nbytes: int) -> None: ...
    @property
    def ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

class WriteSession:
    """A file written in order; see Engine.begin."""

    @property
    def block(self) -> int: ...
    def write(
        self,
        blobs: List[Tuple[int, bytes]],
        regions: List[Tuple[int, int, int, int]],
        slots: List[Tuple[int, int]],
    ) -> None: ...
    def finish(
        self,
        blobs: List[Tuple[int, bytes]],
        regions: List[Tuple[int, int, int, int]],
        slots: List[Tuple[int, int]],
        file_len: int,
        on_gathered: Optional[Callable[[], None]] = None,
    ) -> Dict[str, Any]: ...
    def abort(self) -> None: ...

def partition(
    segments: List[Tuple[int, int]],
    file_len: int,
    block: int,
    max_len: int,
    parts: int = 1,
) -> List[Tuple[Tuple[int, int], List[Tuple[int, int, List[Tuple[int, int, int, int]]]]]]: ...
def dio_alignment(path: Union[str, PathLike[str]]) -> Tuple[int, int, int, bool]: ...
def crc32(data: bytes) -> int: ...
def crc32_ranges(ranges: List[Tuple[int, int]]) -> List[int]: ...
def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int: ...
