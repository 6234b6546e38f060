"""Resumable training state: RNG states and an exactly-once sampler.

``capture_rng_state()`` returns the Python, NumPy (if installed), torch CPU and
CUDA (if initialised) generator states in a form ``torch.load(...,
weights_only=True)`` accepts; ``restore_rng_state`` puts them back.
:class:`ResumableSampler` remembers its epoch and position, so a resumed run
sees each sample exactly once per epoch (CheckFreq's resumable iterator);
iterated through :meth:`ResumableSampler.track`, a DataLoader's prefetching
(its workers draw indices ahead of the batches training has received) is not
counted as consumed.
"""

from __future__ import annotations

import random
from typing import Any, Dict, Iterable, Iterator, Optional

import torch

__all__ = ["capture_rng_state", "restore_rng_state", "ResumableSampler"]


def capture_rng_state() -> Dict[str, Any]:
    """The Python, NumPy (when installed), torch CPU and CUDA (when
    initialised) generators' states, as tensors and plain values that
    ``torch.load(..., weights_only=True)`` (and ``read_state_dict``) accept:
    save it with the checkpoint, give it to :func:`restore_rng_state`."""
    version, internal, gauss = random.getstate()
    state: Dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    numpy_state = _numpy_state()
    if numpy_state is not None:
        state["numpy"] = numpy_state
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Dict[str, Any]) -> None:
    """Put back the generators' states :func:`capture_rng_state` took (the
    CUDA ones only where CUDA is available; NumPy's bit generator made
    again when the global one is of another kind)."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        _set_numpy_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_state() -> Optional[Dict[str, Any]]:
    """NumPy's global generator state (None without NumPy). The default
    bit generator (MT19937) is kept as the legacy tuple's fields; another
    one (``np.random.set_bit_generator``) as its state dict, arrays as byte
    tensors (``weights_only`` loads no NumPy arrays)."""
    try:
        import numpy as np
    except ImportError:
        return None
    st = np.random.get_state(legacy=False)
    if st["bit_generator"] == "MT19937":
        return {
            "kind": "MT19937",
            "keys": torch.from_numpy(st["state"]["key"].astype("int64")),
            "pos": int(st["state"]["pos"]),
            "has_gauss": int(st["has_gauss"]),
            "cached": float(st["gauss"]),
        }
    encoded: Dict[str, Any] = _encode_arrays(st)
    return encoded


def _set_numpy_state(n: Dict[str, Any]) -> None:
    import numpy as np

    if "bit_generator" not in n:  # MT19937: the legacy tuple's fields
        np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"]))
        return
    st: Dict[str, Any] = _decode_arrays(n)
    name = st["bit_generator"]
    # NumPy >= 1.25 (and not in its stubs).
    get_bit_generator = getattr(np.random, "get_bit_generator", None)
    set_bit_generator = getattr(np.random, "set_bit_generator", None)
    if get_bit_generator is None or type(get_bit_generator()).__name__ != name:
        kind = getattr(np.random, name, None)
        if set_bit_generator is None or not (isinstance(kind, type) and issubclass(kind, np.random.BitGenerator)):
            raise ValueError(
                f"the saved NumPy random state is of a {name} bit generator, which NumPy {np.__version__} "
                "cannot make its global generator"
            )
        set_bit_generator(kind())
    np.random.set_state(st)


#: Marks an encoded NumPy array (dtype, shape, bytes) in a saved state dict.
_ARRAY = "__ndarray__"


def _encode_arrays(v: Any) -> Any:
    import numpy as np

    if isinstance(v, dict):
        return {k: _encode_arrays(x) for k, x in v.items()}
    if isinstance(v, np.ndarray):
        data = torch.from_numpy(np.ascontiguousarray(v).reshape(-1).view(np.uint8).copy())
        return {_ARRAY: v.dtype.str, "shape": list(v.shape), "data": data}
    return v


def _decode_arrays(v: Any) -> Any:
    import numpy as np

    if isinstance(v, dict):
        if _ARRAY in v:
            return np.frombuffer(v["data"].numpy().tobytes(), dtype=np.dtype(v[_ARRAY])).reshape(v["shape"]).copy()
        return {k: _decode_arrays(x) for k, x in v.items()}
    return v


class ResumableSampler(torch.utils.data.Sampler):
    """Indices ``0..n-1`` in a per-epoch order (a seeded permutation when
    ``shuffle``), resumable mid-epoch: ``state_dict()`` records the epoch and
    the position to go on from; after ``load_state_dict`` the sampler
    continues with the next index. Epochs advance on their own.

    Iterated directly (or by a DataLoader without workers), the position is
    the number of indices handed out. A DataLoader with workers draws
    indices ahead of the batches it has yielded (``prefetch_factor`` batches
    per worker): iterate ``sampler.track(loader)`` instead of ``loader``, and
    the position is that of the batches training has received."""

    def __init__(self, n: int, *, shuffle: bool = True, seed: int = 0) -> None:
        if n < 0:
            raise ValueError("n must be non-negative")
        self.n = n
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0
        #: track() iterations in progress: while one is, handing out
        #: indices moves neither the position nor the epoch (track() does,
        #: batch by batch as the loader yields them).
        self._tracking = 0

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=g)

    def __iter__(self) -> Iterator[int]:
        if self._tracking:
            order, start = self._order(self.epoch), self.position
            for p in range(start, self.n):
                yield int(order[p])
            return
        order = self._order(self.epoch)
        while self.position < self.n:
            i = int(order[self.position])
            self.position += 1
            yield i
        self.epoch += 1
        self.position = 0

    def __len__(self) -> int:
        return self.n - self.position

    def track(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Iterate ``loader``, a ``torch.utils.data.DataLoader`` drawing
        from this sampler (``sampler=`` with a ``batch_size``, or without
        batching), and count as consumed only the batches it has yielded:
        a ``state_dict()`` taken while training on a batch resumes at the
        next one, whatever the loader's workers have prefetched. The epoch
        advances when the loader is exhausted (with ``drop_last``, its last
        partial batch was never a batch); leaving the loop early (``break``,
        an exception) keeps the position."""
        return self._tracked(loader, self._per_batch(loader))  # (a loader it cannot count: refused at the call)

    def _tracked(self, loader: Iterable[Any], per: int) -> Iterator[Any]:
        self._tracking += 1
        try:
            for batch in loader:
                self.position = min(self.position + per, self.n)
                yield batch
            self.epoch += 1
            self.position = 0
        finally:
            self._tracking -= 1

    def _per_batch(self, loader: Any) -> int:
        """The indices each batch of ``loader`` takes from this sampler (the
        last batch of an epoch: what is left)."""
        from torch.utils.data import BatchSampler, DataLoader

        if not isinstance(loader, DataLoader):
            raise TypeError(f"track() takes a torch.utils.data.DataLoader, not {type(loader).__name__}")
        if getattr(loader, "in_order", True) is False:
            raise ValueError("track() needs a DataLoader that yields batches in order (in_order=True)")
        bs = loader.batch_sampler
        if bs is None:
            if loader.sampler is not self:
                raise ValueError("track(): the DataLoader does not draw from this sampler (pass it as sampler=)")
            return 1
        if type(bs) is not BatchSampler or bs.sampler is not self:
            raise ValueError(
                "track(): the DataLoader does not draw from this sampler through torch's BatchSampler "
                "(pass it as sampler= with a batch_size; a batch sampler of its own cannot be counted)"
            )
        return int(bs.batch_size)

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
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.n:
            raise ValueError(
                f"sampler state has epoch {epoch} and position {position}; "
                f"this sampler takes an epoch >= 0 and a position in 0..{self.n}"
            )
        self.epoch, self.position = epoch, position
