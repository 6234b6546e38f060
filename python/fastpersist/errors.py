"""Exceptions raised by fastpersist."""

from __future__ import annotations

from ._core import WriteError

__all__ = [
    "FastPersistError",
    "SerializationError",
    "CorruptCheckpointError",
    "WriteError",
    "FallbackWarning",
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


class FallbackWarning(RuntimeWarning):
    """A fast path was unavailable (O_DIRECT refused, io_uring disabled) and
    a slower, equally safe one was used. Emitted once per reason."""
