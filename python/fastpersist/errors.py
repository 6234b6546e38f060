"""Exceptions raised by fastpersist."""

from __future__ import annotations

import traceback

from ._core import WriteError

__all__ = [
    "FastPersistError",
    "SerializationError",
    "CorruptCheckpointError",
    "StorageChangedError",
    "InheritedSaveError",
    "WriteError",
    "FallbackWarning",
    "drop_frames",
]


class FastPersistError(Exception):
    """Base class of fastpersist's own (non-OS) errors."""


class SerializationError(FastPersistError, TypeError):
    """The object cannot be written in the requested format (an object that
    cannot be pickled, a tensor on the meta device, ...). Raised before any
    file is created."""


class CorruptCheckpointError(FastPersistError, ValueError):
    """The file is not a readable checkpoint: truncated, a bad header, a
    record outside the file, a CRC32 that does not match. The message names
    the record. Never raised for a file that reads correctly."""


class StorageChangedError(FastPersistError, RuntimeError):
    """A tensor's storage was resized or freed while a save was reading it
    (breaking the rule that tensors stay as they are until the save has
    gathered them). Checked before each window of memory is read and once
    more before the commit: the save is abandoned and whatever the path
    held before is left as it was."""


class InheritedSaveError(FastPersistError, RuntimeError):
    """The future of a background save that was in flight when this process
    was made by ``os.fork()``: the save belongs to the parent process, which
    completes and commits it; in the child its future fails with this at
    once (nothing in the child waits for, writes, commits or removes it)."""


class FallbackWarning(RuntimeWarning):
    """A fast path was unavailable (O_DIRECT refused, io_uring disabled) and
    a slower, equally safe one was used. Emitted once per reason."""


def drop_frames(exc: BaseException) -> None:
    """Clear the local variables of the finished frames in ``exc``'s
    traceback (and in those of its cause and context), so an error that a
    caller keeps does not keep a failed call's buffers alive: device
    storages of a read, pinned staging, the tensors of a save. The message
    and the traceback's lines stay."""
    seen = set()
    todo: list = [exc]
    while todo:
        e = todo.pop()
        if isinstance(e, BaseException) and id(e) not in seen:
            seen.add(id(e))
            traceback.clear_frames(e.__traceback__)
            todo += [e.__cause__, e.__context__]
