"""The peer tier: each rank's checkpoints also kept by ranks on other nodes.

A *ring* over the ranks of a group: with ``replicate=n``, rank ``i`` (its
index in the group) sends each committed checkpoint to the ranks
``i + k_1, ..., i + k_n`` (mod the group's size), where ``k_1 < ... < k_n``
are the smallest shifts that put, for every rank, itself and its ``n``
holders on ``n + 1`` different nodes (``LOCAL_WORLD_SIZE`` ranks per node
in rank order: ``k_j = j * LOCAL_WORLD_SIZE``). Each shift is a bijection,
so every rank holds exactly ``n`` other ranks' replicas and sends and
receives the same number of bytes.

Bytes move over torch.distributed (gloo, CPU tensors) in chunks of
:data:`CHUNK_BYTES` (memory bounded: two buffers each way, so that one chunk
moves while the previous one is read or written), in four phases that every
pair runs in the same order: a header (step, size),
the chunks, a trailer (the CRC32 of every byte sent) and an acknowledgement
back from the holder. The holder writes the bytes into a
:class:`~fastpersist._core.TempFile` next to
``<its directory>/replicas/rank-<sender>/ckpt-<step>.pt`` and commits it
(fsync, rename, directory fsync) only after the trailer's CRC matched and
the file's own CRCs verified: a transfer cut short (a killed rank) leaves at
most a ``.fptmp`` file, never a checkpoint name.

A leaf module apart from :mod:`fastpersist.collectives`, :mod:`fastpersist.options`,
:mod:`fastpersist.verify` and the core.
"""

from __future__ import annotations

import os
import re
import stat
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Hashable, List, Optional, Sequence, Tuple

from . import _core
from .errors import CorruptCheckpointError, FastPersistError
from .options import make_dirs, pwrite_all, read_range
from .verify import verify_file

__all__ = [
    "CHUNK_BYTES",
    "REPLICA_DIR",
    "Ring",
    "Received",
    "ReplicaError",
    "exchange",
    "node_ids",
    "replica_dir",
    "ring_shifts",
    "held_ranks",
]

#: The subdirectory of a Checkpointer's directory that holds other ranks'
#: replicas (``replicas/rank-<global rank>/ckpt-<step>.pt``).
REPLICA_DIR = "replicas"
#: Bytes per message (read at each transfer; one transfer holds four
#: buffers of this size: two each way).
CHUNK_BYTES = 8 << 20
_RANK_RE = re.compile(r"rank-(0|[1-9][0-9]{0,8})")


class ReplicaError(FastPersistError, OSError):
    """A replica could not be sent or received (a peer died, the group
    timed out, the bytes did not verify). The local checkpoint is kept."""


def replica_dir(directory: str, rank: int) -> str:
    """Where the checkpoint directory ``directory`` keeps the replicas of
    global rank ``rank``."""
    return os.path.join(directory, REPLICA_DIR, f"rank-{rank}")


def held_ranks(directory: str) -> List[int]:
    """The ranks whose replicas ``directory`` holds (subdirectories named
    exactly as :func:`replica_dir` names them; a link at either name is
    none: what it points at is not this directory's to list, sweep or
    prune)."""
    root = os.path.join(directory, REPLICA_DIR)
    try:
        if not stat.S_ISDIR(os.lstat(root).st_mode):
            return []
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(int(n[5:]) for n in names if _RANK_RE.fullmatch(n) and _is_folder(os.path.join(root, n)))


def _is_folder(path: str) -> bool:
    """A directory itself, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def node_ids(ranks: Sequence[int], nodes: Optional[Sequence[Hashable]] = None) -> List[Hashable]:
    """The node of each rank of a group (``ranks``: the group's global
    ranks, in group order): ``nodes`` given (one id per rank of the group,
    any hashable: host names, integers), else global rank //
    ``LOCAL_WORLD_SIZE`` (torchrun's numbering)."""
    if nodes is not None:
        if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Sequence):
            raise TypeError(f"nodes must be a list with one node id per rank of the group, not {nodes!r}")
        if len(nodes) != len(ranks):
            raise ValueError(
                f"nodes has {len(nodes)} entries but the group has {len(ranks)} ranks: give one node id per rank"
            )
        return list(nodes)
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None:
        raise ValueError(
            "replicate needs the node of each rank: set LOCAL_WORLD_SIZE (torchrun does) "
            "or pass nodes=[node id per rank]"
        )
    try:
        lws = int(raw)
    except ValueError:
        lws = 0
    if lws < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={raw!r} is not a positive int")
    return [r // lws for r in ranks]


def ring_shifts(node_of: Sequence[Hashable], replicate: int) -> List[int]:
    """The ``replicate`` smallest shifts ``k`` such that every rank ``i``
    and its holders ``i + k`` (mod the group's size) are all on different
    nodes. Raises ValueError when there is no such ring."""
    n = len(node_of)
    distinct = len(set(node_of))
    if distinct < 2:
        raise ValueError(
            f"replicate needs ranks on at least two nodes, but all {n} ranks of the group are on one node "
            "(check LOCAL_WORLD_SIZE or nodes=): a replica on the same node does not survive its loss"
        )
    if replicate > distinct - 1:
        raise ValueError(
            f"replicate={replicate} needs {replicate} other nodes per rank, but the group spans only "
            f"{distinct} nodes (at most replicate={distinct - 1})"
        )
    shifts: List[int] = []
    for k in range(1, n):
        cand = shifts + [k]
        if all(len({node_of[i]} | {node_of[(i + s) % n] for s in cand}) == len(cand) + 1 for i in range(n)):
            shifts = cand
            if len(shifts) == replicate:
                return shifts
    raise ValueError(
        f"no ring puts each rank's {replicate} replica(s) on other nodes for the node layout {list(node_of)}: "
        "give every node the same number of ranks, in the same order"
    )


@dataclass(frozen=True)
class Ring:
    """Who holds whose replicas, in global ranks."""

    #: The group's global ranks, in group order.
    ranks: Tuple[int, ...]
    #: This process's index in ``ranks``.
    index: int
    shifts: Tuple[int, ...]

    @classmethod
    def build(cls, ranks: Sequence[int], me: int, replicate: int, nodes: Optional[Sequence[Hashable]]) -> Ring:
        if me not in ranks:
            raise ValueError(f"rank {me} is not in the group {list(ranks)}")
        shifts = ring_shifts(node_ids(ranks, nodes), replicate)
        return cls(tuple(ranks), list(ranks).index(me), tuple(shifts))

    @property
    def rank(self) -> int:
        return self.ranks[self.index]

    def holders_of(self, rank: int) -> List[int]:
        """The global ranks that hold ``rank``'s replicas, in shift order."""
        i, n = self.ranks.index(rank), len(self.ranks)
        return [self.ranks[(i + k) % n] for k in self.shifts]

    def sources(self) -> List[int]:
        """The global ranks whose replicas this rank holds, in shift order."""
        n = len(self.ranks)
        return [self.ranks[(self.index - k) % n] for k in self.shifts]


@dataclass(frozen=True)
class Received:
    """One checkpoint received from a peer."""

    step: int
    #: The committed file, or None when nothing was committed.
    path: Optional[str]
    bytes: int
    seconds: float
    #: Why nothing was committed (None when ``path`` is set, or when the
    #: sender had nothing to send).
    error: Optional[str] = None

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _write_chunk(tmp: Any, data: memoryview, offset: int) -> None:
    pwrite_all(tmp.fd, data, offset)


def _post(group: Any, send: Optional[Tuple[Any, int]], recv: Optional[Tuple[Any, int]]) -> List[Any]:
    """Start sending ``send[0]`` to global rank ``send[1]`` and receiving
    into ``recv[0]`` from ``recv[1]`` (either may be None)."""
    import torch.distributed as dist

    works = []
    if send is not None:
        works.append(dist.isend(send[0], dst=send[1], group=group))
    if recv is not None:
        works.append(dist.irecv(recv[0], src=recv[1], group=group))
    return works


def _pairwise(group: Any, send: Optional[Tuple[Any, int]], recv: Optional[Tuple[Any, int]]) -> None:
    for w in _post(group, send, recv):
        w.wait()


def exchange(
    group: Any,
    *,
    send_to: Optional[int] = None,
    send_step: int = -1,
    send_path: Optional[str] = None,
    recv_from: Optional[int] = None,
    recv_target: Optional[Callable[[int], Optional[str]]] = None,
) -> Tuple[Optional[bool], Optional[Received]]:
    """One transfer in each direction at once over the gloo ``group``:
    the checkpoint at ``send_path`` (of ``send_step``; None: nothing to
    send, the peer is told so) to global rank ``send_to``, and one from
    ``recv_from`` committed at ``recv_target(step)`` (None: refused, there
    is nowhere to put it). Both peers must make
    the matching call. Returns (whether ``send_to`` committed it: None when
    nothing was sent; what was received: None when ``recv_from`` is None).
    A failure of the transport raises :class:`ReplicaError` (the pair is
    then out of step: stop using the group)."""
    import torch

    t0 = time.perf_counter()
    chunk = int(CHUNK_BYTES)
    fd = -1
    size = 0
    try:
        if send_to is not None and send_path is not None:
            try:
                fd = os.open(send_path, os.O_RDONLY | os.O_CLOEXEC)
                size = os.fstat(fd).st_size
            except OSError:
                fd = -1
        try:
            return _exchange(torch, group, chunk, t0, send_to, send_step, fd, size, recv_from, recv_target)
        except (RuntimeError, ValueError) as e:  # gloo: a peer gone, a timeout
            raise ReplicaError(f"replica transfer failed: {type(e).__name__}: {e}") from e
    finally:
        if fd >= 0:
            os.close(fd)


def _exchange(  # noqa: C901 - the four phases of one transfer, in order
    torch: Any,
    group: Any,
    chunk: int,
    t0: float,
    send_to: Optional[int],
    send_step: int,
    fd: int,
    size: int,
    recv_from: Optional[int],
    recv_target: Optional[Callable[[int], Optional[str]]],
) -> Tuple[Optional[bool], Optional[Received]]:
    # 1. Headers: (step, size, present).
    hs = torch.tensor([send_step, size, int(fd >= 0)], dtype=torch.int64)
    hr = torch.zeros(3, dtype=torch.int64)
    _pairwise(group, None if send_to is None else (hs, send_to), None if recv_from is None else (hr, recv_from))
    r_step, r_size, r_present = (int(x) for x in hr) if recv_from is not None else (-1, 0, 0)
    n_send = -(-size // chunk) if fd >= 0 else 0
    n_recv = -(-r_size // chunk) if r_present else 0
    # Two buffers each way: chunk i moves while chunk i - 1 is written out.
    sbufs = [bytearray(min(chunk, size) or 1) for _ in range(2)] if n_send else []
    rbufs = [bytearray(min(chunk, r_size) or 1) for _ in range(2)] if n_recv else []
    sts = [torch.frombuffer(b, dtype=torch.uint8) for b in sbufs]
    rts = [torch.frombuffer(b, dtype=torch.uint8) for b in rbufs]
    s_crc = r_crc = 0
    s_bad = 0
    tmp = None
    received: Optional[Received] = None
    r_error: Optional[str] = None
    target = recv_target(r_step) if r_present and recv_target is not None else None
    if r_present and target is None:
        r_error = "nowhere to put it"
    if target is not None:
        try:
            make_dirs(os.path.dirname(target))
            tmp = _core.TempFile(target)
        except OSError as e:
            r_error = f"cannot create a file next to {target}: {e}"
    try:
        # 2. Chunks (a local read or write error keeps the pair in step:
        # the bytes still move, the trailer or the holder rejects them).
        # Chunk i's buffers were last used by chunk i - 2, finished at the
        # previous iteration.
        pending: List[Any] = []
        last = max(n_send, n_recv)
        for i in range(last + 1):
            works: List[Any] = []
            if i < last:
                send = recv = None
                if i < n_send:
                    assert send_to is not None  # n_send > 0: exchange() opened send_path for send_to
                    off = i * chunk
                    n = min(chunk, size - off)
                    view = memoryview(sbufs[i % 2])[:n]
                    try:
                        # The engine reads (O_DIRECT: the file is not pulled
                        # into the page cache) and checksums the chunk.
                        s_crc = _core.crc32_combine(s_crc, read_range(fd, off, view), n)
                    except (OSError, ValueError):
                        s_bad = 1
                    send = (sts[i % 2][:n], send_to)
                if i < n_recv:
                    assert recv_from is not None  # n_recv > 0: a header came from recv_from
                    recv = (rts[i % 2][: min(chunk, r_size - i * chunk)], recv_from)
                works = _post(group, send, recv)
            for w in pending:
                w.wait()
            j = i - 1  # the chunk that has just arrived
            if 0 <= j < n_recv:
                view = memoryview(rbufs[j % 2])[: min(chunk, r_size - j * chunk)]
                r_crc = zlib.crc32(view, r_crc)
                if tmp is not None and r_error is None:
                    try:
                        _write_chunk(tmp, view, j * chunk)
                    except OSError as e:
                        r_error = f"writing {target} failed: {e}"
            pending = works
        # 3. Trailers: (crc32 of the bytes sent, read error).
        ts = torch.tensor([s_crc, s_bad], dtype=torch.int64)
        tr = torch.zeros(2, dtype=torch.int64)
        _pairwise(
            group,
            (ts, send_to) if send_to is not None and fd >= 0 else None,
            (tr, recv_from) if recv_from is not None and r_present else None,
        )
        if recv_from is not None:
            path = None
            if r_present:
                if r_error is None and int(tr[1]):
                    r_error = "the sender could not read its checkpoint"
                if r_error is None and int(tr[0]) != r_crc:
                    r_error = f"CRC32 {r_crc:#010x} of the bytes received is not the sender's {int(tr[0]):#010x}"
                if r_error is None and tmp is not None:
                    try:
                        verify_file(tmp.temp_path)
                        tmp.commit(r_size, durable=True)
                        path = target
                    except (CorruptCheckpointError, OSError, FastPersistError) as e:
                        r_error = f"{target} (received from rank {recv_from}) did not verify: {e}"
            received = Received(r_step, path, r_size, time.perf_counter() - t0, r_error)
    finally:
        if tmp is not None and (received is None or received.path is None):
            tmp.abort()  # the temporary file goes; nothing was committed
    # 4. Acknowledgement from the holder back to the sender.
    a_s = torch.tensor([int(received is not None and received.path is not None)], dtype=torch.int64)
    a_r = torch.zeros(1, dtype=torch.int64)
    _pairwise(
        group,
        (a_s, recv_from) if recv_from is not None and r_present else None,
        (a_r, send_to) if send_to is not None and fd >= 0 else None,
    )
    acked = bool(int(a_r[0])) if send_to is not None and fd >= 0 else None
    return acked, received
