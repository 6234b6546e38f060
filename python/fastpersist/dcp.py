"""``fastpersist.dcp``: fastpersist as PyTorch Distributed Checkpoint's
storage layer (:mod:`fastpersist.integrations.dcp`). Imported on demand, so
``import fastpersist`` does not import ``torch.distributed.checkpoint``.

The public names are the adapter's own ``__all__``: listed once, there."""

from __future__ import annotations

import fastpersist.integrations.dcp as _adapter
from fastpersist.integrations.dcp import *  # noqa: F403 - exactly the names of the adapter's __all__

__all__ = _adapter.__all__
