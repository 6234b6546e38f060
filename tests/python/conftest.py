from __future__ import annotations

import os
import sys

import pytest

# The package under test is the installed wheel, never the source tree.
_here = os.path.dirname(os.path.abspath(__file__))
_src = os.path.normpath(os.path.join(_here, "..", "..", "python"))
sys.path[:] = [p for p in sys.path if os.path.normpath(os.path.abspath(p or ".")) != _src]

import fastpersist  # noqa: E402

assert not os.path.normpath(fastpersist.__file__).startswith(_src), fastpersist.__file__


def is_root() -> bool:
    return os.geteuid() == 0


@pytest.fixture
def engine_fault():
    """Set an injected fault on the engine that a given option set uses,
    and clear it afterwards."""
    from fastpersist.options import EngineOptions, get_engine

    touched = []

    def set_fault(offset, errno: int = 5, refuse_direct: bool = False, **opts):
        _, eng = get_engine(EngineOptions.resolve(**opts))
        eng.set_fault(offset, errno, refuse_direct)
        touched.append(eng)

    yield set_fault
    for eng in touched:
        eng.set_fault(None)


@pytest.fixture(autouse=True)
def _torch_global_modes():
    """Tests that build frameworks (Lightning's ``deterministic=True``) turn on
    process-wide torch modes; put them back so later tests run as usual."""
    import torch

    det = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(det, warn_only=warn_only)
