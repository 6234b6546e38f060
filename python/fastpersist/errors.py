"""Exceptions raised by fastpersist."""

from __future__ import annotations

from ._core import WriteError

__all__ = ["FastPersistError", "SerializationError", "WriteError", "FallbackWarning"]


class FastPersistError(Exception):
    """Base class of fastpersist's own (non-OS) errors."""


class SerializationError(FastPersistError, TypeError):
    """The object cannot be written in the requested format (an object that
    cannot be pickled, a tensor on the meta device, ...). Raised before any
    file is created."""


class FallbackWarning(RuntimeWarning):
    """A fast path was unavailable (O_DIRECT refused, io_uring disabled) and
    a slower, equally safe one was used. Emitted once per reason."""
