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

If any rank fails, no checkpoint is committed and every rank raises
:class:`DistributedCheckpointError` (after the group's collective timeout at
worst, never a hang beyond it). Checkpoint collectives run on a gloo group of
their own, so they never interleave with the training's collectives.
"""

from __future__ import annotations

import json
import os
import struct
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _core
from .errors import CorruptCheckpointError, FastPersistError
from .serialization import plan_torch_save
from .writer import EngineOptions, WriteStats, _stats, get_engine

__all__ = ["write_replicated", "write_sharded", "read_sharded", "DistributedCheckpointError",
           "is_sharded_dir", "INDEX_NAME"]

INDEX_NAME = "index.json"
_groups: Dict[Any, Any] = {}


class DistributedCheckpointError(FastPersistError, RuntimeError):
    """A rank failed during a distributed save; nothing was committed."""


def checkpoint_group(group: Any) -> Any:
    """A gloo group with the same ranks as ``group``, made once (collectively)."""
    import torch.distributed as dist

    key = id(group)
    g = _groups.get(key)
    if g is None:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        g = dist.new_group(ranks=ranks, backend="gloo") if dist.get_backend(group) != "gloo" else group
        _groups[key] = g
    return g


def _gather(obj: Any, group: Any) -> List[Any]:
    import torch.distributed as dist

    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _fail_all(statuses: List[Any], what: str) -> None:
    bad = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if bad:
        detail = "; ".join(f"rank {r}: {s}" for r, s in bad)
        raise DistributedCheckpointError(f"{what} failed on {len(bad)} rank(s): {detail}")


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _ranges(file_len: int, block: int, n: int) -> List[Tuple[int, int]]:
    """Same split as the core's Layout::split."""
    blocks = -(-file_len // block)
    return [((blocks * i // n) * block, (blocks * (i + 1) // n) * block) for i in range(n)]


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_replicated(obj: Any, path: str, group: Any, opts: EngineOptions) -> WriteStats:
    import torch.distributed as dist

    g = checkpoint_group(group)
    rank, world = dist.get_rank(g), dist.get_world_size(g)
    t0 = time.perf_counter()
    plan = None
    tmp: Optional[str] = None
    err: Optional[str] = None
    sig = None
    try:
        from .writer import _staging_setup

        stage, _ = _staging_setup()
        # Device storages stay on their device: each rank copies only the
        # bytes of its own part to the host.
        plan = plan_torch_save(obj, stage=stage or (lambda st: st.device.type == "cuda"))
        sig = (plan.file_len, len(plan.regions), len(plan.device), plan.storage_bytes,
               _core.crc32(b"".join(b for _, b in plan.blobs)))
        if rank == 0:
            d, name = os.path.split(os.path.abspath(path))
            if os.path.isdir(path):
                raise IsADirectoryError(path)
            tmp = os.path.join(d, f".{name}.{os.getpid()}.{time.monotonic_ns()}{_core.TEMP_MARKER}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                if plan.file_len:
                    os.posix_fallocate(fd, 0, -(-plan.file_len // 4096) * 4096)
            finally:
                os.close(fd)
    except BaseException as e:  # noqa: BLE001 - every rank must reach the collective
        err = _err(e)
    try:
        first = _gather((err, sig, tmp), g)
        errors = [f[0] for f in first]
        if len({f[1] for f in first if f[0] is None}) > 1:
            errors = [e or "ranks passed different objects (their layouts differ); pass the same "
                      "replicated state on every rank, or use sharded=True" for e in errors]
        _fail_all(errors, "planning the checkpoint")
        tmp = first[0][2]
        assert plan is not None and tmp is not None
        # Partial CRCs of this rank's byte range, combined across ranks.
        block = _core.dio_alignment(tmp)[2]
        lo, hi = _ranges(plan.file_len, block, world)[rank]
        mine: List[Tuple[int, int, int, int]] = []  # (crc id, start, len, crc)
        ranges = []
        regions = list(plan.regions)
        for fo, storage, ln, cid in plan.device:
            a, b = max(fo, lo), min(fo + ln, hi)
            if a < b:
                host = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)[a - fo:b - fo].cpu()
                plan.keepalive.append(host)
                regions.append((a, host.data_ptr(), b - a, cid))
        for fo, ptr, ln, cid in regions:
            a, b = max(fo, lo), min(fo + ln, hi)
            if a < b:
                ranges.append((ptr + (a - fo), b - a))
                mine.append((cid, a, b - a, 0))
        crcs = _core.crc32_ranges(ranges)
        mine = [(c, a, n, v) for (c, a, n, _), v in zip(mine, crcs)]
        parts = [p for ps in _gather(mine, g) for p in ps]
        final: Dict[int, Tuple[int, int]] = {}
        for cid, _a, n, v in sorted(parts, key=lambda p: (p[0], p[1])):
            prev = final.get(cid)
            final[cid] = (v, n) if prev is None else (_core.crc32_combine(prev[0], v, n), prev[1] + n)
        blobs = list(plan.blobs) + [(off, struct.pack("<I", final.get(cid, (0, 0))[0])) for off, cid in plan.slots]
        err = None
        raw = None
        try:
            lock, eng = get_engine(opts)
            with lock:
                raw = eng.write_part(tmp, blobs, regions, plan.file_len, rank, world)
        except BaseException as e:  # noqa: BLE001
            err = _err(e)
        statuses = _gather(err, g)
        commit_err = None
        if rank == 0:
            if all(s is None for s in statuses):
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
                    try:
                        os.ftruncate(fd, plan.file_len)
                        if opts.durable:
                            os.fsync(fd)
                    finally:
                        os.close(fd)
                    os.rename(tmp, path)
                    if opts.durable:
                        _fsync_dir(os.path.dirname(os.path.abspath(path)))
                except BaseException as e:  # noqa: BLE001
                    commit_err = _err(e)
            if commit_err is not None or any(s is not None for s in statuses):
                _unlink(tmp)
        _fail_all(statuses, "writing the checkpoint")
        _fail_all(_gather(commit_err, g), "committing the checkpoint")
    except DistributedCheckpointError:
        if rank == 0 and tmp is not None:
            _unlink(tmp)
        raise
    assert raw is not None
    raw = dict(raw, bytes=plan.file_len)
    return _stats(raw, path, plan.storage_bytes, plan.storage_keys, 0.0, time.perf_counter() - t0)


def _unlink(p: Optional[str]) -> None:
    if p:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def is_sharded_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, INDEX_NAME))


def write_sharded(obj: Any, dirpath: str, group: Any, opts: EngineOptions, write: Any) -> WriteStats:
    """Each rank writes its own shard with ``write(obj, shard_path)``; the
    index is committed last by rank 0."""
    import torch.distributed as dist

    g = checkpoint_group(group)
    rank, world = dist.get_rank(g), dist.get_world_size(g)
    err = None
    save_id = None
    if rank == 0:
        try:
            os.makedirs(dirpath, exist_ok=True)
            save_id = f"{time.time_ns():x}"
        except BaseException as e:  # noqa: BLE001
            err = _err(e)
    first = _gather((err, save_id), g)
    _fail_all([f[0] for f in first], "creating the checkpoint directory")
    save_id = first[0][1]
    name = f"shard-{save_id}-{rank:05d}-of-{world:05d}.pt"
    shard = os.path.join(dirpath, name)
    stats: Optional[WriteStats] = None
    err = None
    try:
        stats = write(obj, shard)
    except BaseException as e:  # noqa: BLE001
        err = _err(e)
    results = _gather((err, name, stats.bytes if stats else 0, stats.crc32 if stats else {}), g)
    statuses = [r[0] for r in results]
    commit_err = None
    if any(s is not None for s in statuses):
        _unlink(shard)
    elif rank == 0:
        try:
            index = {"format": "fastpersist-sharded", "version": 1, "world_size": world, "save_id": save_id,
                     "shards": [{"rank": r, "file": res[1], "bytes": res[2]} for r, res in enumerate(results)]}
            tmp = os.path.join(dirpath, f".{INDEX_NAME}.{os.getpid()}{_core.TEMP_MARKER}")
            with open(tmp, "w") as f:
                json.dump(index, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, os.path.join(dirpath, INDEX_NAME))
            _fsync_dir(dirpath)
            keep = {r[1] for r in results}
            for n in os.listdir(dirpath):
                if n.startswith("shard-") and n not in keep:
                    _unlink(os.path.join(dirpath, n))
        except BaseException as e:  # noqa: BLE001
            commit_err = _err(e)
    _fail_all(statuses, "writing the shards")
    final = _gather(commit_err, g)
    if final[0] is not None:
        _unlink(shard)
    _fail_all(final, "committing the index")
    assert stats is not None
    return stats


def read_sharded(dirpath: str, group: Any, read: Any) -> Any:
    """With a group: this rank's shard. Without: every shard, in rank order."""
    try:
        with open(os.path.join(dirpath, INDEX_NAME)) as f:
            index = json.load(f)
        shards = sorted(index["shards"], key=lambda s: s["rank"])
        world = int(index["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{dirpath}: unreadable {INDEX_NAME}: {e}") from None
    if group is None:
        return [read(os.path.join(dirpath, s["file"])) for s in shards]
    import torch.distributed as dist

    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if n != world:
        raise ValueError(f"{dirpath} holds {world} shards; the group has {n} ranks "
                         f"(read without a group to get every shard)")
    return read(os.path.join(dirpath, shards[rank]["file"]))

