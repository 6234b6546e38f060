"""fastpersist: write deep-learning checkpoints at the speed of the disk.

>>> import fastpersist
>>> stats = fastpersist.write_state_dict(model.state_dict(), "ckpt.pt")  # doctest: +SKIP
>>> torch.load("ckpt.pt")                                                # doctest: +SKIP
"""

from __future__ import annotations

from ._core import __version__
from .checkpoint_manager import CheckpointInfo, Checkpointer
from .resume import ResumableSampler, capture_rng_state, restore_rng_state
from .async_save import CheckpointFuture, SnapshotPool, save_async, wait_all
from .cuda_staging import release_staging
from .distributed import DistributedCheckpointError
from .errors import (
    CorruptCheckpointError,
    FallbackWarning,
    FastPersistError,
    SerializationError,
    WriteError,
)
from .reader import ReadStats, detect_format, read_state_dict
from .writer import WriteStats, release_engines, write_state_dict

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
    "WriteError",
    "SerializationError",
    "FastPersistError",
    "FallbackWarning",
    "release_engines",
    "release_staging",
]
