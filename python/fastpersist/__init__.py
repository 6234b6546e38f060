"""fastpersist: write deep-learning checkpoints at the speed of the disk.

>>> import fastpersist
>>> stats = fastpersist.write_state_dict(model.state_dict(), "ckpt.pt")  # doctest: +SKIP
>>> torch.load("ckpt.pt")                                                # doctest: +SKIP
"""

from __future__ import annotations

from ._core import __version__
from .async_save import CheckpointFuture, SnapshotPool, save_async, wait_all
from .checkpoint_manager import Checkpointer, CheckpointInfo
from .collectives import DistributedCheckpointError, DistributedTensorChangedError
from .cuda_staging import release_staging
from .errors import (
    CorruptCheckpointError,
    FallbackWarning,
    FastPersistError,
    InheritedSaveError,
    NoSafetensorsDtypeError,
    ReadError,
    SerializationError,
    SharedTensorsError,
    StorageChangedError,
    TensorChangedError,
    TensorChangedWarning,
    UnsupportedDtypeError,
    UnsupportedFormatError,
    WriteError,
)
from .options import WriteStats, release_engines
from .patching import Patch, PatchStats, patch
from .reader import ReadStats, detect_format, read_state_dict
from .resume import ResumableSampler, capture_rng_state, restore_rng_state
from .tiers import TierError, upload
from .writer import write_state_dict

__all__ = [
    "__version__",
    "write_state_dict",
    "read_state_dict",
    "save_async",
    "Checkpointer",
    "CheckpointInfo",
    "ResumableSampler",
    "capture_rng_state",
    "restore_rng_state",
    "wait_all",
    "CheckpointFuture",
    "SnapshotPool",
    "detect_format",
    "WriteStats",
    "ReadStats",
    "CorruptCheckpointError",
    "DistributedCheckpointError",
    "DistributedTensorChangedError",
    "WriteError",
    "ReadError",
    "SerializationError",
    "StorageChangedError",
    "UnsupportedFormatError",
    "TensorChangedError",
    "TensorChangedWarning",
    "InheritedSaveError",
    "FastPersistError",
    "FallbackWarning",
    "release_engines",
    "release_staging",
    "patch",
    "upload",
    "TierError",
    "Patch",
    "PatchStats",
    "NoSafetensorsDtypeError",
    "SharedTensorsError",
    "UnsupportedDtypeError",
]


def __getattr__(name: str) -> object:
    # ``fastpersist.dcp`` is imported on first use: it imports
    # torch.distributed.checkpoint, which ``import fastpersist`` does not need.
    if name == "dcp":
        import importlib

        return importlib.import_module(".dcp", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
