"""The collectives of distributed saves, on process groups of their own.

Checkpoint collectives never run on a group the training uses: a save in a
background thread would otherwise interleave its ``all_gather_object``
calls with the training's collectives on the same group (undefined order,
hangs). :func:`checkpoint_group` makes a gloo group with the same ranks as
the caller's group, once per distinct set of ranks.

Making groups is collective over the whole world: ``new_group`` must be
called by every process, in the same order, with the same ranks. When the
caller's group is not the whole world (data-parallel subgroups of a 2-D
mesh: each rank passes a different group), the ranks of every process's
group are gathered first and every process makes every distinct group, in
the same order. So the first save with a given ``group=`` (or an explicit
:func:`checkpoint_group` call) must be made on every rank of the world,
from the thread that runs the training's collectives; later saves with the
same group, in the foreground or in the background, reuse it.

A leaf module apart from :mod:`fastpersist.errors`.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any, Dict, List, Optional, Tuple

from .errors import FastPersistError, TensorChangedError

__all__ = [
    "DistributedCheckpointError",
    "DistributedTensorChangedError",
    "check_group",
    "checkpoint_group",
    "dedicated_groups",
    "group_ranks",
    "gather",
    "fail_all",
    "describe_error",
]


class DistributedCheckpointError(FastPersistError, RuntimeError):
    """A rank failed during a distributed save; nothing was committed."""


class DistributedTensorChangedError(DistributedCheckpointError, TensorChangedError):
    """Raised on the rank whose tensor was changed in place during a
    distributed save: every rank gets a :class:`DistributedCheckpointError`
    (nothing was committed), and this rank's is also a
    :class:`~fastpersist.TensorChangedError`, as a save without a group
    would raise."""


_groups: Dict[Tuple[int, ...], Any] = {}
_groups_lock = threading.RLock()  # (reentrant: a signal handler's save)


def check_group(group: Any, what: str) -> None:
    """Refuse a ``group=`` given to ``what`` before torch.distributed is
    initialized (ValueError), or one that is not a process group
    (TypeError): at the call, naming it, not as a KeyError from inside
    torch.distributed once a save is under way."""
    if group is None:
        return
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        raise ValueError(f"{what}: group= needs torch.distributed") from None
    if not dist.is_available():  # pragma: no cover - torch without distributed
        raise ValueError(f"{what}: group= needs torch.distributed, which this torch does not have")
    shown = repr(group)
    shown = f"{type(group).__name__} {shown if len(shown) <= 60 else shown[:57] + '...'}"
    if not dist.is_initialized():
        raise ValueError(f"{what}: group= needs torch.distributed initialized first (init_process_group); got {shown}")
    if group is not dist.group.WORLD and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{what}: group must be a torch.distributed ProcessGroup (torch.distributed.group.WORLD "
            f"for every rank) or None, not {shown}"
        )


def _ranks(group: Any) -> Tuple[int, ...]:
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _every_rank_set(ranks: Tuple[int, ...]) -> List[Tuple[int, ...]]:
    """The distinct sets of ranks that the processes of the world pass
    (this one passes ``ranks``), sorted: the groups every process must make,
    in the same order. Collective over the world (``all_gather_object`` on
    the default group) unless ``ranks`` is the whole world."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if len(ranks) == world:
        return [ranks]
    every: List[Optional[Tuple[int, ...]]] = [None] * world
    dist.all_gather_object(every, ranks)
    return sorted({r for r in every if r is not None})


def _timeout() -> Dict[str, Any]:
    """``new_group``'s ``timeout`` argument: the one the default group was
    made with (``init_process_group(timeout=...)``), which torch does not
    carry over to new groups; nothing where it cannot be told."""
    import torch
    import torch.distributed as dist

    try:
        pg = dist.distributed_c10d._get_default_group()
    except Exception:  # noqa: BLE001 - not initialised, or another torch: its default
        return {}
    for device in ("cpu", "cuda"):
        try:
            t = pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - no backend for that device, or another torch
            continue
        if not isinstance(t, datetime.timedelta) or t.total_seconds() <= 0:
            continue
        # torch's own default for that backend (NCCL's is shorter than
        # gloo's): not one the user chose; the gloo groups keep theirs.
        defaults = {getattr(dist.constants, n, None) for n in ("default_pg_timeout", "default_pg_nccl_timeout")}
        return {} if t in defaults else {"timeout": t}
    return {}


def checkpoint_group(group: Any) -> Any:
    """The gloo group for checkpoint collectives among the ranks of
    ``group`` (None: the world). Collective over the world the first time
    for a set of ranks (see the module doc); cached after that."""
    import torch.distributed as dist

    ranks = _ranks(group)
    with _groups_lock:
        hit = _groups.get(ranks)
    if hit is not None:
        return hit
    wanted = [rs for rs in _every_rank_set(ranks) if rs not in _groups]
    made: Dict[Tuple[int, ...], Any] = {}
    for rs in wanted:
        # Every process makes every group, in the same (sorted) order.
        made[rs] = dist.new_group(ranks=list(rs), backend="gloo", **_timeout())
    with _groups_lock:
        for rs, g in made.items():
            _groups.setdefault(rs, g)
        return _groups[ranks]


def dedicated_groups(group: Any, count: int) -> List[Any]:
    """``count`` new gloo groups with the ranks of ``group`` (None: the
    world), shared with nothing else (not cached): for a user of the
    groups that runs collectives or transfers on threads of its own.
    Collective over the world, like :func:`checkpoint_group` (every process
    calls it, in the same order)."""
    import torch.distributed as dist

    ranks = _ranks(group)
    mine: List[Any] = []
    for rs in _every_rank_set(ranks):
        made = [dist.new_group(ranks=list(rs), backend="gloo", **_timeout()) for _ in range(count)]
        if rs == ranks:
            mine = made
    return mine


def group_ranks(group: Any) -> Tuple[int, ...]:
    """The global ranks of ``group`` (None: the world), in group order."""
    return _ranks(group)


def gather(obj: Any, group: Any) -> List[Any]:
    """``all_gather_object`` of a small picklable object over ``group``. A
    peer that is gone (its connection reset, the group's timeout passed)
    is a :class:`DistributedCheckpointError`, as a rank's failure is."""
    import torch.distributed as dist

    out: List[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, obj, group=group)
    except RuntimeError as e:
        if isinstance(e, DistributedCheckpointError):
            raise
        raise DistributedCheckpointError(f"a rank of the checkpoint's group is gone: {e}") from e
    return out


def agree_outcome(step: int, ok: bool, group: Any) -> Tuple[int, int, bool]:
    """One all-reduce over ``group``: the smallest and largest ``step`` the
    ranks gave, and whether every rank's ``ok`` was true. A peer that is
    gone is a :class:`DistributedCheckpointError`."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([step, -step, int(bool(ok))], dtype=torch.int64)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    except RuntimeError as e:
        if isinstance(e, DistributedCheckpointError):
            raise
        raise DistributedCheckpointError(f"a rank of the checkpoint's group is gone: {e}") from e
    return int(t[0]), -int(t[1]), bool(int(t[2]))


def describe_error(e: BaseException) -> str:
    """An exception as one line, to send to the other ranks."""
    return f"{type(e).__name__}: {e}"


def fail_all(statuses: List[Optional[str]], what: str, mine: Optional[BaseException] = None) -> None:
    """Raise :class:`DistributedCheckpointError` on every rank when any
    rank reported an error (statuses gathered from every rank). ``mine``
    is this rank's own exception, if any: it is chained, and when it is a
    :class:`~fastpersist.TensorChangedError` the error raised here is one
    too (:class:`DistributedTensorChangedError`)."""
    bad = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if bad:
        detail = "; ".join(f"rank {r}: {s}" for r, s in bad)
        cls = DistributedTensorChangedError if isinstance(mine, TensorChangedError) else DistributedCheckpointError
        raise cls(f"{what} failed on {len(bad)} rank(s): {detail}") from mine
