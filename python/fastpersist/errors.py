"""Exceptions raised by fastpersist."""

from __future__ import annotations

import pickle
import traceback

from ._core import ReadError, WriteError

__all__ = [
    "FastPersistError",
    "SerializationError",
    "NoDataError",
    "UnpicklableError",
    "CorruptCheckpointError",
    "UnsupportedFormatError",
    "StorageChangedError",
    "TensorChangedError",
    "TensorChangedWarning",
    "InheritedSaveError",
    "WriteError",
    "ReadError",
    "FallbackWarning",
    "drop_frames",
]


class FastPersistError(Exception):
    """Base class of fastpersist's own (non-OS) errors."""


class SerializationError(FastPersistError, TypeError, ValueError, RuntimeError, pickle.PicklingError):
    """The object cannot be written in the requested format (an object that
    cannot be pickled, one storage viewed as two dtypes, a tensor larger
    than its storage, a value safetensors cannot hold, ...). Raised before
    any file is created.

    Catchable as what ``torch.save`` and safetensors raise in the same
    situations: ``RuntimeError`` (torch: two dtypes over one storage;
    safetensors: non-contiguous or sparse tensors), ``TypeError`` and
    ``pickle.PicklingError`` (objects pickle refuses), ``ValueError``
    (safetensors: non-tensor values, non-dicts)."""

    #: Whether torch.save refuses the object alike (pickle's own refusal,
    #: met while pickling it): not worth trying torch.save after.
    torch_refuses: bool = False


class NoDataError(SerializationError, NotImplementedError):
    """A storage on the ``meta`` device saved as such (not a meta tensor,
    which is saved as torch.save saves it: shape and dtype, no data). A
    ``NotImplementedError``, as torch.save's."""


class UnpicklableError(SerializationError, AttributeError):
    """pickle refused an object of the state with an ``AttributeError``
    (a local function or class: "Can't pickle local object"), which is
    what torch.save raises there. Other refusals are plain
    :class:`SerializationError` (a ``TypeError`` and ``PicklingError``, as
    pickle's)."""


class CorruptCheckpointError(FastPersistError, ValueError, RuntimeError):
    """The file is not a readable checkpoint: truncated, a bad header, a
    record outside the file, a CRC32 that does not match. The message names
    the record. Never raised for a file that reads correctly. A
    ``RuntimeError`` too, as torch.load's errors for damaged zip files."""


class UnsupportedFormatError(FastPersistError, ValueError, RuntimeError):
    """The file is valid but not one fastpersist reads: a TorchScript
    archive (``torch.jit.save``; read it with ``torch.jit.load``). The
    message says what the file is. A ``RuntimeError``, as torch.load's
    refusal of such files with ``weights_only=True``."""


class StorageChangedError(FastPersistError, RuntimeError):
    """A tensor's storage was resized or freed while a save was reading it
    (breaking the rule that tensors stay as they are until the save has
    gathered them). Checked before each window of memory is read and once
    more before the commit: the save is abandoned and whatever the path
    held before is left as it was."""


class TensorChangedError(StorageChangedError):
    """A tensor being saved was changed in place (its version counter
    moved: an optimizer step, a forward that updates buffers such as
    BatchNorm's ``num_batches_tracked``, a ``copy_``) between the save's
    call and the moment its bytes had all been gathered. The file could
    mix values from before and after the change, so nothing is committed
    and whatever the path held before is left as it was. The message names
    the tensor. Fence with ``future.wait_snapshot()`` before any in-place
    update, forward included (or pass ``on_change="warn"``)."""


class TensorChangedWarning(RuntimeWarning):
    """``on_change="warn"``: a tensor was changed in place while a save
    read it, and the file was committed anyway (it may mix old and new
    values of that tensor)."""


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


class SharedTensorsError(SerializationError, RuntimeError):
    """``format="safetensors"`` was given tensors that share memory (a tied
    weight, a view of another entry). safetensors stores each name as its
    own copy, so the tie would be lost on reload: refused, as
    ``safetensors.torch.save_file`` refuses it (a ``RuntimeError``). The
    message names the groups."""


class NoSafetensorsDtypeError(SerializationError, KeyError):
    """``format="safetensors"`` was given a tensor of a dtype safetensors
    has no name for (complex, quantized, bits): refused, as
    ``safetensors.torch.save_file`` refuses it (a ``KeyError``). The
    message names the entry and the dtype."""

    def __str__(self) -> str:  # (not KeyError's quoted repr)
        return str(self.args[0]) if self.args else ""


class UnsupportedDtypeError(FastPersistError, TypeError):
    """A valid file holds a tensor whose dtype this torch cannot represent
    (safetensors' ``F6_E2M3``/``F6_E3M2``, a dtype newer than the installed
    torch, ``F4`` with an odd last dimension). ``inspect``/``verify`` still
    read the file; loading it into torch tensors cannot."""
