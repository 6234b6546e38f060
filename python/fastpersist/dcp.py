"""``fastpersist.dcp``: fastpersist as PyTorch Distributed Checkpoint's
storage layer (:mod:`fastpersist.integrations.dcp`). Imported on demand, so
``import fastpersist`` does not import ``torch.distributed.checkpoint``."""

from __future__ import annotations

from .integrations.dcp import (
    METADATA,
    CorruptCheckpointError,
    FastPersistReader,
    FastPersistWriter,
    install,
    installed,
    sidecar_name,
    uninstall,
)

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
