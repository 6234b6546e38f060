"""Parallel writes across data-parallel ranks (torch.distributed).

Replicated state (every rank of ``group`` passes the same object):
:func:`write_replicated` has every rank lay out the same file, split it into
balanced block-aligned byte ranges (``Layout::split`` in the core), checksum
and write only its own range into one shared temporary file, and commit
(truncate, fsync, rename, directory fsync) on rank 0 once every rank has
reported success. CRC32s of records that straddle ranges are combined from
the ranks' partial CRCs (crc32_combine), so the file is byte-identical to the
one a single process writes.

Sharded state (FSDP, ZeRO: each rank holds its own part):
:func:`write_sharded` has each rank write its own torch-loadable
``shard-<save>-<rank>-of-<world>.pt`` into one directory, and rank 0 commits
``index.json`` last; shards of older saves are removed only after the new
index is committed, so a crash at any point leaves the previous checkpoint
whole.

A tensor changed in place on any rank before that rank has read all of its
bytes fails the save like any other error (the rank whose tensor changed
raises :class:`DistributedTensorChangedError`, also a
:class:`~fastpersist.TensorChangedError`).

If any rank fails, no checkpoint is committed and every rank raises
:class:`DistributedCheckpointError` (after the group's collective timeout at
worst, never a hang beyond it). Checkpoint collectives run on a gloo group of
their own (:mod:`fastpersist.collectives`), so they never interleave with the
training's collectives. Files are committed with the core's one durable
commit (``_core.TempFile``, ``_core.atomic_write``), and ranks split a file
with the core's partitioner (``_core.split_ranges``).

Once the index of a sharded save is committed, the save has happened:
removing the shards of older saves is best effort (a failure is a warning,
never a rollback), and only files named exactly as this module names shards
are removed. Shard names read from an index are checked the same way, so an
index cannot make a read open a file outside its directory.
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import _core
from .collectives import (
    DistributedCheckpointError,
    DistributedTensorChangedError,
    checkpoint_group,
    describe_error,
    fail_all,
    gather,
)
from .cuda_staging import staging_setup
from .errors import CorruptCheckpointError
from .options import (
    EngineOptions,
    WriteStats,
    abandoned,
    file_identity,
    make_dirs,
    open_beneath,
    parse_json,
    use_engine,
    write_stats,
)
from .pickling import TensorVersions
from .plan import MemoryGuard, Plan, Region, split_regions
from .torch_zip import plan_torch_save

__all__ = [
    "write_replicated",
    "write_sharded",
    "read_sharded",
    "DistributedCheckpointError",
    "DistributedTensorChangedError",
    "checkpoint_group",
    "is_sharded_dir",
    "shard_name",
    "INDEX_NAME",
]

INDEX_NAME = "index.json"
#: Exactly the names :func:`shard_name` makes.
SHARD_RE = re.compile(r"shard-[0-9a-f]{1,32}-[0-9]{5}-of-[0-9]{5}\.pt")


def shard_name(save_id: str, rank: int, world: int) -> str:
    """The file name of ``rank``'s shard of save ``save_id``."""
    return f"shard-{save_id}-{rank:05d}-of-{world:05d}.pt"


def _signature(plan: Plan) -> Tuple[int, int, int, int, int]:
    """What every rank's layout of the same replicated state agrees on."""
    return (
        plan.file_len,
        len(plan.regions),
        len(plan.device),
        plan.storage_bytes,
        _core.crc32(b"".join(b for _, b in plan.blobs)),
    )


def _my_regions(plan: Plan, lo: int, hi: int) -> List[Region]:
    """Host regions of the plan, plus the parts of its device storages that
    fall in [lo, hi), copied to the host (each rank copies only its part)."""
    regions = list(plan.regions)
    for fo, storage, ln, cid in plan.device:
        a, b = max(fo, lo), min(fo + ln, hi)
        if a < b:
            host = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)[a - fo : b - fo].cpu()
            plan.keepalive.append(host)
            regions.append(Region(a, host.data_ptr(), b - a, cid))
    return regions


def _combined_crcs(regions: List[Region], lo: int, hi: int, g: Any, guard: MemoryGuard) -> Dict[int, int]:
    """Final CRC32 of every checksum id: each rank checksums the bytes of
    its own range (caller memory in windows checked by ``guard``), and the
    partial CRCs are combined in file order."""
    pieces = []
    for fo, ptr, ln, cid in regions:
        a, b = max(fo, lo), min(fo + ln, hi)
        if a < b:
            pieces.append(Region(a, ptr + (a - fo), b - a, cid))
    mine: List[Tuple[int, int, int, int]] = []  # (crc id, start, len, crc)
    err: Optional[str] = None
    try:
        for run in split_regions(sorted(pieces)):
            # With a guard: each range read under the GIL right after its
            # storage is checked (no resize in between).
            crcs = _core.crc32_ranges([(r.address, r.length, r.crc_id) for r in run], guard if guard else None)
            mine += [(r.crc_id, r.offset, r.length, v) for r, v in zip(run, crcs)]
    except BaseException as e:  # noqa: BLE001 - every rank must reach the collective
        err = describe_error(e)
    everyone = gather((err, mine), g)
    fail_all([e for e, _ in everyone], "checksumming the checkpoint")
    parts = [p for _, ps in everyone for p in ps]
    final: Dict[int, Tuple[int, int]] = {}
    for cid, _a, n, v in sorted(parts, key=lambda p: (p[0], p[1])):
        prev = final.get(cid)
        final[cid] = (v, n) if prev is None else (_core.crc32_combine(prev[0], v, n), prev[1] + n)
    return {cid: v for cid, (v, _) in final.items()}


def _plan_replicated(obj: Any, path: str, rank: int) -> Tuple[Plan, Any, Tuple[int, int, int, int, int]]:
    stage, _ = staging_setup()
    # Device storages stay on their device: each rank copies only the
    # bytes of its own part to the host.
    plan = plan_torch_save(obj, stage=stage or (lambda st: st.device.type == "cuda"))
    tmp = None
    if rank == 0:
        tmp = _core.TempFile(path, direct=False)
        if plan.file_len:
            tmp.preallocate(-(-plan.file_len // 4096) * 4096)
    return plan, tmp, _signature(plan)


def write_replicated(
    obj: Any, path: str, group: Any, opts: EngineOptions, versions: Optional[TensorVersions] = None
) -> WriteStats:
    """Every rank passes the same ``obj``; each writes its balanced part of
    one file, rank 0 commits it once every part is in (see the module doc).
    ``versions`` (the tensors' version counters at the call) are checked on
    every rank once its part is written: a tensor changed in place on any
    rank fails the save on all of them, before the commit."""
    import torch.distributed as dist

    g = checkpoint_group(group)
    rank, world = dist.get_rank(g), dist.get_world_size(g)
    t0 = time.perf_counter()
    plan = tmp = sig = None
    committed = False
    err: Optional[str] = None
    try:
        plan, tmp, sig = _plan_replicated(obj, path, rank)
    except BaseException as e:  # noqa: BLE001 - every rank must reach the collective
        err = describe_error(e)
    try:
        first = gather((err, sig, tmp.temp_path if tmp is not None else None), g)
        errors = [f[0] for f in first]
        if len({f[1] for f in first if f[0] is None}) > 1:
            errors = [
                e
                or "ranks passed different objects (their layouts differ); pass the same "
                "replicated state on every rank, or use sharded=True"
                for e in errors
            ]
        fail_all(errors, "planning the checkpoint")
        tmp_path = first[0][2]
        assert plan is not None and tmp_path is not None
        block = _core.dio_alignment(tmp_path)[2]
        lo, hi = _core.split_ranges(plan.file_len, block, world)[rank]
        regions = _my_regions(plan, lo, hi)
        crcs = _combined_crcs(regions, lo, hi, g, plan.guard)
        blobs = list(plan.blobs) + [(off, struct.pack("<I", crcs.get(cid, 0))) for off, cid in plan.slots]
        raw = None
        err = None
        mine: Optional[BaseException] = None
        try:
            with use_engine(opts) as eng:
                raw = eng.write_part(
                    tmp_path, blobs, regions, plan.file_len, rank, world, plan.guard if plan.guard else None
                )
            if versions is not None:
                # Every byte of this rank's part (and its checksums) has
                # been read from the tensors: had one changed in the
                # meantime, the part could mix values or not match its CRC.
                versions.check(obj)
        except BaseException as e:  # noqa: BLE001
            err, mine = describe_error(e), e
        statuses = gather(err, g)
        fail_all(statuses, "writing the checkpoint", mine)
        commit_err = None
        if tmp is not None:
            try:
                committed = True  # from here on the temporary name may be gone
                tmp.commit(plan.file_len, durable=opts.durable)
            except BaseException as e:  # noqa: BLE001
                commit_err = describe_error(e)
        fail_all(gather(commit_err, g), "committing the checkpoint")
    finally:
        if tmp is not None and not committed:
            tmp.abort()
    assert raw is not None and plan is not None
    whole: _core.RawWriteStats = {**raw, "bytes": plan.file_len}
    return write_stats(whole, path, plan.storage_bytes, plan.storage_keys, 0.0, time.perf_counter() - t0)


def is_sharded_dir(path: str) -> bool:
    """Whether ``path`` is a directory holding a sharded checkpoint's index."""
    return os.path.isdir(path) and os.path.exists(os.path.join(path, INDEX_NAME))


def _commit_index(dirpath: str, save_id: str, world: int, results: List[Any]) -> None:
    index = {
        "format": "fastpersist-sharded",
        "version": 1,
        "world_size": world,
        "save_id": save_id,
        "shards": [{"rank": r, "file": res[1], "bytes": res[2]} for r, res in enumerate(results)],
    }
    _core.atomic_write(os.path.join(dirpath, INDEX_NAME), json.dumps(index, indent=1).encode(), durable=True)


def _indexed_shards(dirpath: str) -> set:
    """The shard files the index committed at ``dirpath`` names (nothing
    when there is none or it cannot be read)."""
    try:
        # (a file of the directory: not a link out of it, nor a FIFO a read would wait on)
        with os.fdopen(open_beneath(dirpath, INDEX_NAME), "rb") as f:
            index = parse_json(f.read(1 << 24))
        return {s["file"] for s in index["shards"] if isinstance(s.get("file"), str) and SHARD_RE.fullmatch(s["file"])}
    except Exception:  # noqa: BLE001 - no usable index: nothing is removed on its account
        return set()


def _remove_old_shards(dirpath: str, keep: set, replaced: set) -> None:
    """Best effort, after the index is committed: the shards of the index
    it replaced, and shards no save has touched for ``ABANDONED_SAVE_AGE`` (a
    failed or killed save's). A younger shard of no index may be another
    save's to this directory still in flight: removing it would leave that
    save's index naming a missing file."""
    try:
        names = os.listdir(dirpath)
    except OSError as e:
        warnings.warn(f"fastpersist: cannot list {dirpath} to remove old shards: {e}", RuntimeWarning, stacklevel=3)
        return
    now = time.time()
    for n in names:
        if n in keep or not SHARD_RE.fullmatch(n):
            continue
        if n not in replaced and not abandoned(os.path.join(dirpath, n), now):
            continue
        try:
            os.unlink(os.path.join(dirpath, n))
        except FileNotFoundError:
            pass
        except OSError as e:
            warnings.warn(
                f"fastpersist: cannot remove the old shard {n} in {dirpath}: {e}", RuntimeWarning, stacklevel=3
            )


def write_sharded(
    obj: Any, dirpath: str, group: Any, opts: EngineOptions, write: Callable[[Any, str], WriteStats]
) -> WriteStats:
    """Each rank writes its own shard with ``write(obj, shard_path)``; the
    index is committed last by rank 0."""
    import torch.distributed as dist

    g = checkpoint_group(group)
    rank, world = dist.get_rank(g), dist.get_world_size(g)
    err = None
    save_id = None
    if rank == 0:
        try:
            make_dirs(dirpath)
            save_id = f"{time.time_ns():x}"
        except BaseException as e:  # noqa: BLE001
            err = describe_error(e)
    first = gather((err, save_id), g)
    fail_all([f[0] for f in first], "creating the checkpoint directory")
    save_id = first[0][1]
    name = shard_name(save_id, rank, world)
    shard = os.path.join(dirpath, name)
    stats: Optional[WriteStats] = None
    err = None
    mine: Optional[BaseException] = None
    try:
        stats = write(obj, shard)
    except BaseException as e:  # noqa: BLE001
        err, mine = describe_error(e), e
    results = gather((err, name, stats.bytes if stats else 0), g)
    statuses = [r[0] for r in results]
    commit_err: Optional[Tuple[str, str, BaseException]] = None
    if all(s is None for s in statuses) and rank == 0:
        replaced = _indexed_shards(dirpath)
        index = os.path.join(dirpath, INDEX_NAME)
        before = file_identity(index)
        try:
            _check_shards_here(dirpath, results)
            _commit_index(dirpath, save_id, world, results)
        except BaseException as e:  # noqa: BLE001
            # Renamed in (its directory fsync failed, or an interrupt came
            # after it): the new save is the checkpoint now.
            renamed = isinstance(e, _core.DurabilityError) or file_identity(index) != before
            commit_err = ("in place" if renamed else "failed", describe_error(e), e)
        if commit_err is None or commit_err[0] == "in place":
            _remove_old_shards(dirpath, {r[1] for r in results}, replaced)
    final = gather(commit_err[:2] if commit_err else None, g)[0]
    if any(s is not None for s in statuses) or (final is not None and final[0] == "failed"):
        _unlink(shard)
    fail_all(statuses, "writing the shards", mine)
    if final is not None:
        what = (
            "committing the index (it is in place: the new save is the checkpoint)"
            if final[0] == "in place"
            else "committing the index"
        )
        fail_all([final[1]] + [None] * (world - 1), what, commit_err[2] if commit_err else None)
    assert stats is not None
    return stats


def _check_shards_here(dirpath: str, results: List[Tuple[Any, str, int]]) -> None:
    """Before rank 0 commits the index (and removes the shards it
    replaces): every rank's shard is a file of ``dirpath`` as rank 0 sees
    it. Ranks that were given different directories, or the same path on
    disks of their own, would otherwise commit an index that names shards
    rank 0 has not got (and lose the previous checkpoint)."""
    for r, (_, name, _) in enumerate(results):
        try:
            ok = stat.S_ISREG(os.lstat(os.path.join(dirpath, name)).st_mode)
        except FileNotFoundError:
            ok = False
        if not ok:
            raise DistributedCheckpointError(
                f"{dirpath}: rank {r}'s shard {name} is not in this directory as rank 0 sees it: every rank must "
                "pass the same directory, on a file system they all share (nothing was committed)"
            )


def _unlink(p: str) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


def _count(v: Any, what: str) -> int:
    """An index's rank or world size: a JSON integer >= 0 (the index holds
    nothing else; ``Infinity`` or ``1e400`` are not counts)."""
    if type(v) is not int or v < 0:
        raise ValueError(f"{what} {v!r} is not a count")
    return v


def _load_index(dirpath: str) -> Tuple[List[Dict[str, Any]], int]:
    try:
        # (a file of the directory: not a link out of it, nor a FIFO a read would wait on)
        with os.fdopen(open_beneath(dirpath, INDEX_NAME), "rb") as f:
            index = parse_json(f.read(1 << 24))
        world = _count(index["world_size"], "world_size")
        shards = sorted(index["shards"], key=lambda s: _count(s["rank"], "rank"))
        names = [s["file"] for s in shards]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(f"{dirpath}: unreadable {INDEX_NAME}: {type(e).__name__}: {e}") from None
    if [s["rank"] for s in shards] != list(range(len(shards))):
        raise CorruptCheckpointError(f"{dirpath}: {INDEX_NAME} does not list ranks 0 to {len(shards) - 1} once each")
    for n in names:
        if not isinstance(n, str) or not SHARD_RE.fullmatch(n):
            raise CorruptCheckpointError(
                f"{dirpath}: {INDEX_NAME} names {n!r}, which is not a shard file name "
                f"(shards are files of this directory named shard-<id>-<rank>-of-<world>.pt)"
            )
    if len(shards) != world:
        raise CorruptCheckpointError(f"{dirpath}: {INDEX_NAME} lists {len(shards)} shards for a world of {world}")
    return shards, world


def read_sharded(dirpath: str, group: Any, read: Callable[..., Any], *, with_fd: bool = False) -> Any:
    """With a group: this rank's shard. Without: every shard, in rank order.
    ``read(path)`` reads a shard; with ``with_fd``, ``read(path, fd)`` reads
    it from ``fd``, which it closes: the file checked to be the
    directory's, not one a link swapped in since."""
    shards, world = _load_index(dirpath)

    def read_shard(name: str) -> Any:
        # A shard is a file of the directory: not a folder (read as a
        # sharded checkpoint of its own), nor a link out of it.
        fd = open_beneath(dirpath, name)
        if with_fd:
            return read(os.path.join(dirpath, name), fd)
        os.close(fd)
        return read(os.path.join(dirpath, name))

    if group is None:
        return [read_shard(s["file"]) for s in shards]
    import torch.distributed as dist

    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if n != world:
        raise ValueError(
            f"{dirpath} holds {world} shards; the group has {n} ranks (read without a group to get every shard)"
        )
    return read_shard(shards[rank]["file"])
