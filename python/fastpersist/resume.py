"""Resumable training state: RNG states and an exactly-once sampler.

``capture_rng_state()`` returns the Python, NumPy (if installed), torch CPU and
CUDA (if initialised) generator states in a form ``torch.load(...,
weights_only=True)`` accepts; ``restore_rng_state`` puts them back.
:class:`ResumableSampler` remembers its epoch and position, so a resumed run
sees each sample exactly once per epoch (CheckFreq's resumable iterator).
"""

from __future__ import annotations

import random
from typing import Any, Dict, Iterator, Optional

import torch

__all__ = ["capture_rng_state", "restore_rng_state", "ResumableSampler"]


def capture_rng_state() -> Dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: Dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class ResumableSampler(torch.utils.data.Sampler):
    """Indices ``0..n-1`` in a per-epoch order (a seeded permutation when
    ``shuffle``), resumable mid-epoch: ``state_dict()`` records the epoch and
    how many indices were handed out; after ``load_state_dict`` the sampler
    continues with the next one. Epochs advance on their own."""

    def __init__(self, n: int, *, shuffle: bool = True, seed: int = 0) -> None:
        if n < 0:
            raise ValueError("n must be non-negative")
        self.n = n
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=g)

    def __iter__(self) -> Iterator[int]:
        order = self._order(self.epoch)
        while self.position < self.n:
            i = int(order[self.position])
            self.position += 1
            yield i
        self.epoch += 1
        self.position = 0

    def __len__(self) -> int:
        return self.n - self.position

    def state_dict(self) -> Dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "n": self.n,
            "shuffle": int(self.shuffle),
        }

    def load_state_dict(self, state: Dict[str, int], *, strict: Optional[bool] = True) -> None:
        if strict and (state["n"] != self.n or state["seed"] != self.seed or bool(state["shuffle"]) != self.shuffle):
            raise ValueError(
                f"sampler state is for n={state['n']}, seed={state['seed']}, "
                f"shuffle={bool(state['shuffle'])}; this sampler has n={self.n}, "
                f"seed={self.seed}, shuffle={self.shuffle}"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
