"""The checkpoint manager: when to checkpoint, what to keep, where it lives.

``Checkpointer(directory, keep_last=3, keep_every=None, every="auto",
max_overhead=0.035, stage_dir=None, mode="pipelined")``:

* ``step(step, state)`` once per iteration decides whether this iteration
  checkpoints (a fixed interval, or CheckFreq-style online tuning that keeps
  the measured overhead under ``max_overhead``) and starts an asynchronous
  save. Call ``fence()`` before any in-place update of the state (in
  pipelined mode the forward pass included; in snapshot mode the fence
  returns once the snapshot is taken, so the optimizer step waits only
  that long): an update the save sees fails it with TensorChangedError.
* Each checkpoint (``ckpt-<step>.pt``, the step zero-padded to 12 digits,
  holding ``{"step", "state"}``) becomes visible only by its atomic commit.
  ``latest()`` is the newest one whose checksums verify (a damaged one is
  skipped); ``load_latest()`` restores it. Another process may call them
  while training saves: a file deleted by retention between listing and
  reading makes them list again, so they return a valid checkpoint whenever
  one exists.
* Temporary files of crashed saves are removed when a Checkpointer starts:
  only names a checkpoint save makes (``.ckpt-<step>.pt.<pid>.<n>.fptmp``),
  only when no process holds the file's lock (a save in progress on any
  host or in any container holds it) and only when the file is older than
  :data:`TEMP_MIN_AGE` seconds and than any save this process has seen.
* One Checkpointer saves into a directory at a time (:data:`WRITER_LOCK`,
  taken at its first save): a second one's first save is refused.
* Retention keeps the last ``keep_last`` *valid* checkpoints and one every
  ``keep_every`` steps (a multiple of it, or the first checkpoint after
  one where the multiple was not checkpointed), deletes only files older than a committed, valid
  newer checkpoint (and, with staging, one that has reached the shared
  tier), never the newest valid one, and only files named exactly as it
  names checkpoints. Validity is known for saves this process committed and
  checked (CRCs, structure) once for files it did not write.
* With ``stage_dir``, committed checkpoints are copied in the background to
  that (shared) directory with the same temp/fsync/rename/fsync commit, with
  retention on each tier; ``latest()`` prefers a valid local copy. A
  ``stage_dir`` URL (``s3://bucket/prefix``, any fsspec URL) is an object
  store tier (:mod:`fastpersist.tiers`): uploads in the background, data
  first and a commit marker last; a checkpoint missing or damaged locally is
  downloaded (CRCs verified) by ``latest()``/``load_latest()``. When the
  tier is slower than the checkpoints, a checkpoint that a newer one has
  overtaken in the queue is not copied (``stage_skipped`` in the log;
  ``keep_every`` steps are always copied), so the backlog, and the local
  copies retention keeps for it, stay bounded.
* With ``group=`` (a torch.distributed process group; the Checkpointer is
  then made on every rank, and its methods called on every rank), all ranks
  checkpoint the same steps and ``latest()``/``load_latest()`` agree on one
  step for all. With ``replicate=n`` as well, each rank's committed
  checkpoints are also kept by ``n`` ranks on other nodes (the peer tier,
  :mod:`fastpersist.replicas`): sent in the background over a gloo group of
  the Checkpointer's own, committed durably in the holder's
  ``replicas/rank-<r>/``; a rank whose copy is missing or damaged gets it
  back from its holder before trying the shared or object tier.
* Telemetry per checkpoint (stall, write time, bytes, GB/s) goes to the
  ``fastpersist`` logger and to ``checkpoints.jsonl`` in the directory.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import functools
import json
import logging
import math
import os
import re
import socket
import stat
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    Deque,
    Dict,
    Hashable,
    Iterable,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Set,
    Tuple,
    TypeVar,
    Union,
    overload,
)

from . import _core
from .async_save import AsyncSaver, CheckpointFuture, check_save_options, future_error, register_exit
from .collectives import (
    DistributedCheckpointError,
    agree_outcome,
    check_group,
    dedicated_groups,
    fail_all,
    gather,
    group_ranks,
)
from .errors import CorruptCheckpointError, FastPersistError
from .options import (
    TEMP_MIN_AGE,
    aside_name,
    fsync_dir,
    make_dirs,
    parse_json,
    remove_durably,
    remove_stale_temps,
    sweep_due,
)
from .pickling import resolve_weights_only
from .reader import read_state_dict
from .replicas import ReplicaError, Ring, exchange, held_ranks, replica_dir
from .tiers import ObjectStore, StoreListing, TierError, is_url
from .verify import verify_file

__all__ = [
    "Checkpointer",
    "CheckpointInfo",
    "FrequencyTuner",
    "list_checkpoints",
    "list_replicas",
    "clean_temp_files",
    "ckpt_name",
]

log = logging.getLogger("fastpersist")
#: Checkpoint file names, exactly as :func:`ckpt_name` makes them.
CKPT_RE = re.compile(r"ckpt-([0-9]{12,20})\.pt")
#: Temporary files of checkpoint saves (and of the records of going back,
#: ``Checkpointer._went_back``), exactly as the core names them.
TEMP_RE = re.compile(
    r"\.(ckpt-[0-9]{12,20}\.pt|\.went-back-[0-9]+(-[0-9]+)?\.json)\.[0-9]+\.[0-9]+" + re.escape(_core.TEMP_MARKER)
)
LOG_NAME = "checkpoints.jsonl"
#: The lock a Checkpointer that saves holds on its directory (the holder's
#: pid and host inside, for the message of one refused).
WRITER_LOCK = ".fastpersist-writer.lock"


def _holder() -> str:
    """This process, as :data:`WRITER_LOCK` names its holder: pid and host."""
    return f"{os.getpid()} {socket.gethostname()}"


#: How often latest()/load_latest() list again when listed files vanish.
_RELIST = 20
#: How often a restore asks an object store that fails to answer, and the
#: first wait between two tries (doubled each time).
FETCH_TRIES = 3
FETCH_BACKOFF = 0.5
_T = TypeVar("_T")


def ckpt_name(step: int) -> str:
    """The file name of the checkpoint of ``step``."""
    return f"ckpt-{step:012d}.pt"


#: The largest step a checkpoint's file name holds (20 digits).
MAX_STEP = 10**20 - 1


def _check_step(step: Any) -> None:
    """A step is an int from 0 to :data:`MAX_STEP`: any other would be
    written under a name that :meth:`Checkpointer.latest` and retention do
    not recognise (never found, never removed)."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, not {step!r}")
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be in 0..{MAX_STEP}, not {step}")


def _parse_ckpt(name: str) -> Optional[int]:
    m = CKPT_RE.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if ckpt_name(step) == name else None


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint file."""

    #: The training step it holds.
    step: int
    #: Where it is.
    path: str
    #: ``"local"`` (the Checkpointer's directory), ``"shared"`` (a
    #: ``stage_dir`` directory), ``"object"`` (a ``stage_dir`` URL; ``path``
    #: is then the object's URL) or ``"peer"`` (a replica of another rank's
    #: checkpoint, in ``replicas/rank-<r>/``).
    tier: str
    #: Its size in bytes.
    bytes: int


def _listing(directory: Optional[str]) -> Optional[List[str]]:
    """The names in ``directory``, listed once for the several looks a step
    takes at it (its records of going back, its checkpoints: one listing
    where each is a round trip, on a network file system); None when it
    cannot be listed (each look then goes on as alone)."""
    try:
        return os.listdir(directory) if directory else None
    except OSError:
        return None


def _scan(
    directory: Optional[str], tier: str, unreadable: bool = False, names: Optional[List[str]] = None
) -> Dict[int, CheckpointInfo]:
    """The checkpoints in ``directory``: regular files of a checkpoint's
    name (a link, a folder or a FIFO at the name is no checkpoint: neither
    read nor removed; ``unreadable`` lists folders and FIFOs too, for
    ``fastpersist ls`` to flag them). ``names``: its listing, when taken
    (see :func:`_listing`)."""
    out: Dict[int, CheckpointInfo] = {}
    if not directory or (names is None and not os.path.isdir(directory)):
        return out
    for name in os.listdir(directory) if names is None else names:
        step = _parse_ckpt(name)
        if step is not None:
            p = os.path.join(directory, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) or (unreadable and not stat.S_ISLNK(st.st_mode)):
                out[step] = CheckpointInfo(step, p, tier, st.st_size)
    return out


def _copy_durably(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` with the core's durable commit (temporary
    file, fsync, rename, directory fsync): ``dst`` is whole or absent."""
    with open(src, "rb") as fi, _core.TempFile(dst) as tmp:
        size = os.fstat(fi.fileno()).st_size
        off = 0
        fast = True
        while off < size:
            want = min(size - off, 64 << 20)
            n = 0
            if fast:
                try:
                    n = os.copy_file_range(fi.fileno(), tmp.fd, want, off, off)
                except OSError as e:
                    if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        raise
                    fast = False
            if not fast:
                data = os.pread(fi.fileno(), min(want, 8 << 20), off)
                n = len(data) and os.pwrite(tmp.fd, data, off)
            if n == 0:
                raise OSError(errno.EIO, f"{src} shrank while it was being copied")
            off += n
        tmp.commit(size, durable=True)


def _scan_store(store: Optional[ObjectStore], listing: Optional[StoreListing] = None) -> Dict[int, CheckpointInfo]:
    out: Dict[int, CheckpointInfo] = {}
    if store is None:
        return out
    # Unconfirmed ones too (a store copied or restored: the identities its
    # markers recorded are gone): listed, not swept, and their downloads
    # checked by their CRC32s (retention does not count them).
    if listing is None:
        listing = store.scan()
    for name, size in {**listing.committed, **listing.unconfirmed}.items():
        step = _parse_ckpt(name)
        if step is not None:
            out[step] = CheckpointInfo(step, store.url_of(name), "object", size)
    return out


#: What parsing a damaged (or hostile) record of going back raises: JSON
#: errors (nesting too deep for the decoder among them: ``parse_json``),
#: missing or mistyped fields, ``Infinity`` for an int.
_DAMAGED_RECORD = (ValueError, KeyError, TypeError, OverflowError)


def _names(back: int, staged: Optional[Tuple[int, ...]], step: int) -> bool:
    """Whether a going back to ``back`` that sets aside the staged steps
    ``staged`` (None: every one past ``back``) sets ``step`` aside."""
    return step > back and (staged is None or step in staged)


def _remove_quietly(path: str) -> None:
    """Remove this Checkpointer's own bookkeeping file ``path``; one
    already gone, or that cannot be removed (logged), is left."""
    try:
        remove_durably(path)
    except OSError as e:
        log.warning("fastpersist: cannot remove %s: %s", path, e)


def _unpack(payload: Any, path: str) -> Tuple[int, Any]:
    """``(step, state)`` of a checkpoint's payload; CorruptCheckpointError
    for a file of a checkpoint's name that a Checkpointer did not write."""
    _check_payload(payload, path)
    return payload["step"], payload["state"]


def is_payload(payload: Any) -> bool:
    """Whether ``payload`` is a Checkpointer's: a dict ``{'step': int,
    'state': ...}`` (a loaded one, or the top level :func:`verify_file`
    saw)."""
    return isinstance(payload, dict) and "state" in payload and type(payload.get("step")) is int


def _check_payload(payload: Any, path: str) -> None:
    """:func:`is_payload`, or CorruptCheckpointError naming ``path``."""
    if not is_payload(payload):
        raise CorruptCheckpointError(f"{path} is not a Checkpointer's checkpoint ({{'step': int, 'state': ...}})")


def verify_checkpoint(path: str) -> None:
    """:func:`verify_file`, and the file holds a Checkpointer's payload (as
    :meth:`Checkpointer.load_latest` takes it): what ``latest()`` and
    retention count as a checkpoint (a torch file of another shape at a
    checkpoint's name is not one)."""
    _check_payload(verify_file(path).top_level, path)


def list_checkpoints(
    directory: str,
    stage_dir: Optional[str] = None,
    storage_options: Optional[Dict[str, Any]] = None,
    unreadable: bool = False,
    names: Optional[List[str]] = None,
) -> List[Tuple[int, List[CheckpointInfo]]]:
    """Committed checkpoints by step (newest first), each with its copies.
    ``stage_dir`` may be an object store URL (only checkpoints whose upload
    completed are listed). ``unreadable``: folders and FIFOs of a
    checkpoint's name too (no checkpoints: a Checkpointer passes them by).
    ``names``: ``directory``'s listing, when taken."""
    local = _scan(directory, "local", unreadable, names)
    if stage_dir is not None and is_url(stage_dir):
        shared = _scan_store(ObjectStore(stage_dir, storage_options))
    else:
        shared = _scan(stage_dir, "shared", unreadable)
    steps = sorted(set(local) | set(shared), reverse=True)
    return [(s, [c for c in (local.get(s), shared.get(s)) if c is not None]) for s in steps]


def list_replicas(directory: str) -> Dict[int, Dict[int, CheckpointInfo]]:
    """The peer tier held in a Checkpointer's ``directory``: global rank ->
    step -> its committed replica (tier ``"peer"``)."""
    return {r: _scan(replica_dir(directory, r), "peer") for r in held_ranks(directory)}


def clean_temp_files(directory: str, min_age: float = TEMP_MIN_AGE) -> List[str]:
    """Remove temporary files of checkpoint saves that are over: named as a
    checkpoint save names them, not locked by a live writer (on any host or
    in any PID namespace), and older than ``min_age`` seconds. Returns the
    names removed."""
    return remove_stale_temps(directory, TEMP_RE.fullmatch, min_age)


#: How many times its estimate one checkpoint's measured cost may count
#: for, and one window's overhead the target (see
#: :meth:`FrequencyTuner.record_checkpoint` and ``_feedback``).
OUTLIER = 4.0
#: An iteration this many times the baseline, with no checkpoint in flight,
#: is a stall, not an iteration (see :meth:`FrequencyTuner.record_iteration`).
STALL = 10.0
#: Where the feedback steers the achieved overhead, as a share of
#: ``max_overhead`` (under it by the noise of one window's measure), and how
#: far under the model's interval it may go (none: the model's interval
#: comes from costs measured directly; a baseline off by the noise of its
#: samples must not make checkpoints denser than that).
FEEDBACK_AIM = 0.85
MIN_SCALE = 1.0
#: At most this many samples for a re-profile (the newest).
TAIL_SAMPLES = 2048
#: The fewest quiet samples whose median may move the baseline between
#: re-profiles (see ``FrequencyTuner._feedback``).
DRIFT_SAMPLES = 11


class FrequencyTuner:
    """Picks the checkpoint interval (in iterations).

    With a fixed ``every``, that is the interval. With ``"auto"`` (CheckFreq's
    profiling and adaptive rate tuning):

    1. *Profile*: after ``profile_steps`` quiet iterations (for the effects
       of the last save to die out), the median of the next ``profile_steps``
       is the clean iteration time (the baseline).
    2. *Model*: each checkpoint's cost ``C`` is the extra time of the
       iterations it was in flight for; the interval is the smallest ``k``
       with ``C / (k T) <= max_overhead`` that also lets each save finish
       before the next (``k T >= write time``).
    3. *Feedback*: the model misses costs that outlast the save (CPU and
       cache contention around it), so the overhead actually achieved, the
       mean iteration time between two checkpoints (their stalls included)
       over the baseline, scales the interval: up at once when it exceeds
       ``max_overhead``, down by half steps when it is under (the interval
       settles where the achieved overhead is just under the bound, not
       anywhere below it).
    4. *Re-profile* every ``reprofile_every`` checkpoints, so the baseline
       follows drift in the iteration time itself: the median of the quiet
       iterations in the last eighths of the intervals since the last
       re-profile (the furthest from each save; at most ``TAIL_SAMPLES``,
       the newest), with no extra checkpoint and no pause in the schedule.
       Again when a second window in a row is over the bound (at least
       ``DRIFT_SAMPLES`` quiet iterations gathered): when they moved off the
       baseline by more than ``max_overhead``, the iterations themselves
       got slower (or faster), the overhead is measured against what they
       take now and the interval goes back to where it was (otherwise a
       lasting rise read as a checkpoint cost no interval could bring down,
       and the interval ran away to ``max_interval``).
    """

    def __init__(
        self,
        every: Union[str, int] = "auto",
        max_overhead: float = 0.035,
        profile_steps: int = 3,
        max_interval: int = 100_000,
        reprofile_every: int = 25,
    ) -> None:
        if every != "auto" and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be 'auto' or a positive int, not {every!r}")
        if isinstance(max_overhead, bool) or not isinstance(max_overhead, (int, float)):
            raise TypeError(f"max_overhead must be a number in (0, 1), not {type(max_overhead).__name__}")
        if not 0 < max_overhead < 1:
            raise ValueError(f"max_overhead must be in (0, 1), not {max_overhead!r}")
        self.auto = every == "auto"
        self.interval = 1 if self.auto else int(every)
        self.max_overhead = max_overhead
        self.profile_steps = profile_steps
        self.max_interval = max_interval
        self.reprofile_every = reprofile_every
        #: EMA of iterations with no checkpoint in flight (for the model).
        self.clean_time: Optional[float] = None
        #: Clean iteration time from the profiling windows (for the feedback).
        self.baseline: Optional[float] = None
        self.cost: Optional[float] = None
        self.write_time: Optional[float] = None
        #: Overhead achieved between the last two checkpoints (EMA).
        self.observed_overhead: Optional[float] = None
        self._scale = 1.0
        self._model_interval = 1
        self._since_last = 0
        self._profiling = self.auto
        self._profiled = 0
        self._checkpoints = 0
        self._window_sum = 0.0
        self._window_n = 0
        self._samples: List[float] = []
        #: Quiet iterations in the last eighths of the intervals since the
        #: last re-profile (its samples; the newest ``TAIL_SAMPLES``).
        self._tail: Deque[float] = collections.deque(maxlen=TAIL_SAMPLES)
        #: The profiling checkpoint is in flight and nothing is measured yet.
        self._awaiting = False
        #: Windows in a row over the bound, and the scale before the first
        #: (see ``_feedback``).
        self._over = 0
        self._scale_before = 1.0

    def record_iteration(self, seconds: float, affected: bool) -> None:
        if not affected and self.baseline and seconds > STALL * self.baseline:
            # A stall no checkpoint was in flight for (an evaluation, a wait
            # for data, not reported with pause()): not the checkpoints'
            # cost, nor a clean iteration. It is a quiet sample all the
            # same (one moves no median; iterations that all take this long
            # from now on are the new baseline, see _feedback).
            self._sample_tail(seconds)
            return
        self._window_sum += seconds
        self._window_n += 1
        if affected:
            return
        a = 0.3
        self.clean_time = seconds if self.clean_time is None else (1 - a) * self.clean_time + a * seconds
        if self._profiling:
            # The first profile_steps quiet iterations let the effects of the
            # last save die out; the next profile_steps are the baseline.
            self._profiled += 1
            if self._profiled > self.profile_steps:
                self._samples.append(seconds)
        else:
            self._sample_tail(seconds)

    def _sample_tail(self, seconds: float) -> None:
        """Keep a quiet iteration's time when it is in the last eighth of the
        interval (iteration ``_since_last + 1`` after the last checkpoint:
        the furthest from the last save's effects)."""
        if self._profiling or not self.reprofile_every:
            return
        n = self._since_last + 1
        if n > self.profile_steps and 8 * n > 7 * self.interval:
            self._tail.append(seconds)

    def record_unmeasured(self) -> None:
        """A checkpoint ended without a measure of its cost (it failed, or
        it was waited for with no iteration beside it)."""
        self._awaiting = False

    def record_checkpoint(self, cost: float, write_seconds: float) -> None:
        self._awaiting = False
        a = 0.5
        # One sample moves the cost estimate at most OUTLIER times over: a
        # single stalled iteration (a data-loader hiccup, a pause not
        # reported with pause()) must not stretch the interval a
        # thousandfold. (A slow write is taken as it is: the next save must
        # not queue behind it.)
        if self.cost is not None:
            cost = min(cost, OUTLIER * max(self.cost, self.max_overhead * (self.clean_time or 0.0)))
        self.cost = cost if self.cost is None else (1 - a) * self.cost + a * cost
        self.write_time = write_seconds if self.write_time is None else (1 - a) * self.write_time + a * write_seconds
        self._retune()

    def _retune(self) -> None:
        if not self.auto or not self.clean_time or self.cost is None:
            return
        t = self.clean_time
        self._model_interval = self._iterations(max(self.cost, 0.0), self.max_overhead * t)
        k_write = self._iterations(self.write_time or 0.0, t)
        self.interval = max(self._iterations(self._model_interval * self._scale, 1.0), k_write)

    def _iterations(self, num: float, den: float) -> int:
        """``ceil(num / den)``, at least 1 and at most ``max_interval``: also
        where the quotient is past a float's range or ``den`` is 0 (a tiny
        ``max_overhead`` times a short iteration)."""
        q = num / den if den > 0 else (math.inf if num > 0 else 0.0)
        if not q < self.max_interval:  # (inf, nan)
            return self.max_interval
        return max(1, math.ceil(q - 1e-9))

    def _feedback(self, reprofile: bool) -> None:
        """Called when a checkpoint is due: judge the window since the last
        (``reprofile``: the baseline is first the median of the quiet
        iterations gathered since the last re-profile)."""
        tail = self._tail
        if reprofile and len(tail) >= self.profile_steps:
            self.baseline = sorted(tail)[len(tail) // 2]
            tail.clear()
        if self._window_n and self.baseline:
            mean = self._window_sum / self._window_n
            if self._over >= 1 and mean > (1.0 + self.max_overhead) * self.baseline and len(tail) >= DRIFT_SAMPLES:
                # Over the bound again: before the interval grows once more,
                # the baseline is taken again from the quiet iterations
                # gathered since (the furthest from the saves). When they no
                # longer take its time (the model, the data or the machine
                # changed), the window is judged against what they take
                # now, and the interval goes back to where it was before
                # (a lasting rise read as a checkpoint cost ran the interval
                # away to max_interval).
                quiet = sorted(tail)[len(tail) // 2]
                tail.clear()
                if abs(quiet / self.baseline - 1.0) > self.max_overhead:
                    self.baseline = quiet
                    self.observed_overhead = None
                    self._scale = min(self._scale, self._scale_before)
                    self._over = 0
            # At most OUTLIER times the target: one stalled iteration in the
            # window must not multiply the interval for many checkpoints.
            achieved = min(mean / self.baseline - 1.0, OUTLIER * self.max_overhead)
            a = 0.5
            self.observed_overhead = (
                achieved if self.observed_overhead is None else (1 - a) * self.observed_overhead + a * achieved
            )
            ratio = self.observed_overhead / self.max_overhead
            if ratio > 1.0:
                if not self._over:
                    self._scale_before = self._scale
                self._over += 1
                # Over the bound: the interval the window says meets it.
                self._scale = min(self._scale * min(ratio, 2.0), float(self.max_interval))
            else:
                self._over = 0
                if ratio < FEEDBACK_AIM:
                    # Under: half the way (in log terms) to the interval that
                    # would reach the aim, so noise does not make it oscillate.
                    step = math.sqrt(max(ratio, 0.0) / FEEDBACK_AIM) if ratio > 0 else 0.5
                    self._scale = max(MIN_SCALE, self._scale * max(step, 0.5))
            self._retune()
        self._window_sum, self._window_n = 0.0, 0

    def should_checkpoint(self) -> bool:
        """Call once per iteration."""
        self._since_last += 1
        if self._profiling:
            if self._profiled < 2 * self.profile_steps:
                return False
            # Profiled: checkpoint now (this also measures one checkpoint).
            self.baseline = sorted(self._samples)[len(self._samples) // 2]
            self._samples = []
            self._profiling = False
            self._window_sum, self._window_n = 0.0, 0
            self._since_last = 0
            self._checkpoints += 1
            self._awaiting = self.cost is None
            return True
        if self._awaiting:
            # The first save's cost is not known yet (it is in flight): no
            # interval yet, and a second save now would wait for the first.
            return False
        if self._since_last >= self.interval:
            self._since_last = 0
            if self.auto:
                self._checkpoints += 1
                c, every = self._checkpoints, self.reprofile_every
                # Soon after the first profile (a few samples), then every `every`.
                self._feedback(bool(every) and (c % every == 0 or (c < every and c & (c - 1) == 0)))
            return True
        return False


class _Later(NamedTuple):
    """A checkpoint of a later step than a save's, when the save began."""

    info: CheckpointInfo
    #: Its file's identity (``Checkpointer._identity``) then.
    ident: Tuple[int, ...]
    #: -1: the Checkpointer's directory; else the rank whose replica it is.
    holder: int


@dataclass
class _InFlight:
    step: int
    future: CheckpointFuture
    issued_at: float
    stall: float
    extra: float = 0.0


#: What a checkpoint set aside by a run that went back on it is renamed
#: with (``Checkpointer._went_back``).
ABANDONED = ".abandoned"
#: An object set aside (``<checkpoint name>.abandoned``, ``-1``, ...).
_ASIDE = re.compile(r"(.+)" + re.escape(ABANDONED) + r"(?:-[0-9]+)?")

#: The record of a run going back (``Checkpointer._went_back``), in its
#: directory until every tier's later checkpoints are set aside
#: (``-<n>``: going back to a step again while its first record is kept).
_WENT_BACK = re.compile(r"\.went-back-(\d+)(-\d+)?\.json")


def _per_rank(stage_dir: str, rank: int) -> str:
    """The place under the shared ``stage_dir`` (a folder or an object
    store URL) where global rank ``rank`` of a group stages."""
    return f"{stage_dir.rstrip('/')}/rank-{rank}" if is_url(stage_dir) else os.path.join(stage_dir, f"rank-{rank}")


def _check_peer_args(replicate: Any, group: Any, nodes: Any) -> None:
    if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 0:
        raise ValueError(f"replicate must be a non-negative int (peer replicas per checkpoint), not {replicate!r}")
    if replicate and group is None:
        raise ValueError(
            "replicate needs group= (the process group whose ranks keep each other's replicas; "
            "torch.distributed.group.WORLD for all ranks)"
        )
    if nodes is not None and not replicate:
        raise ValueError("nodes= (the node of each rank) is used only with replicate=")
    check_group(group, "Checkpointer()")


def _local_dir(name: str, value: Any) -> str:
    """A directory argument as a local path: ``file://`` URLs are their
    path (not a directory named ``file:``); an empty one is refused (it
    would be the current directory, whatever that is when written)."""
    path: str = os.fsdecode(os.fspath(value))
    if path.startswith("file://"):
        path = path[len("file://") :]
    if not path:
        raise ValueError(f"{name} must name a directory, not {value!r}")
    if is_url(path):
        # (not a local folder named "s3:")
        raise ValueError(
            f"{name} must be a local directory, not the URL {path!r}: an object store is a tier, give it as stage_dir="
        )
    return path


def _archived(steps: Iterable[int], keep_every: Optional[int]) -> Set[int]:
    """The steps of a tier (holding ``steps``) that ``keep_every`` keeps:
    its multiples, and the first checkpoint after a multiple (and before
    the next one) where the multiple itself was not checkpointed: an
    interval that does not divide ``keep_every`` (``every=5`` from step 0
    checkpoints 4, 9, 14, ...), or ``every="auto"``, keeps one checkpoint
    per ``keep_every`` steps too."""
    if not keep_every:
        return set()
    first: Dict[int, int] = {}
    for s in sorted(steps, reverse=True):
        first[s // keep_every] = s
    return {s for w, s in first.items() if w >= 1} | {s for s in steps if s % keep_every == 0}


def _check_options(mode: str, options: Dict[str, Any], keep_last: Any, keep_every: Any) -> None:
    """Refuse, when a Checkpointer is made, the options its saves would
    refuse (not at its first save, hours into a run), and retention counts
    that are not whole (``keep_last=2.5`` would never remove anything)."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int):
        raise TypeError(f"keep_last must be an int, not {keep_last!r}")
    if keep_last < 1:
        raise ValueError("keep_last must be at least 1 (the newest checkpoint is always kept)")
    if keep_every is not None and (isinstance(keep_every, bool) or not isinstance(keep_every, int)):
        raise TypeError(f"keep_every must be an int or None, not {keep_every!r}")
    if keep_every is not None and keep_every < 1:
        raise ValueError("keep_every must be a positive int")
    check_save_options(mode, options, "Checkpointer")
    if options.get("format", "torch") != "torch":
        raise ValueError(
            "a Checkpointer writes torch checkpoints (ckpt-<step>.pt holds {'step': ..., 'state': ...}), "
            f"not format={options['format']!r}"
        )


class Checkpointer:
    """Checkpoints a training loop: when, where, what to keep, and resume.

    ``directory`` (node-local, fast) receives ``ckpt-<step>.pt`` files, each
    holding ``{"step": step, "state": state}``, committed atomically.
    ``every`` is a fixed interval in iterations or ``"auto"`` (CheckFreq's
    tuning, keeping the measured overhead under ``max_overhead``).
    ``keep_last`` valid checkpoints are kept, plus one every ``keep_every``
    steps (a multiple of it, or the first checkpoint after one where the
    multiple itself was not checkpointed). ``stage_dir`` (a shared file system) receives a copy of each
    committed checkpoint in the background (one that a newer checkpoint
    overtook while it waited is skipped, unless ``keep_every`` keeps it). ``mode`` is that of
    :func:`~fastpersist.save_async`; in either mode call :meth:`fence`
    before any in-place update of the state (``optimizer.step()``). Other keyword arguments
    are engine options of :func:`~fastpersist.write_state_dict`. ``clock``
    is for tests.

    ``group`` (a torch.distributed process group, ``dist.group.WORLD`` for
    all ranks): the Checkpointer is made on every rank of the world at the
    same point (it makes gloo groups of its own with ``new_group``), with
    the same arguments and a directory of its own per rank; ``step()``,
    ``save()``, ``latest()`` and ``load_latest()`` are then called on every
    rank. All ranks checkpoint the same steps (with ``every="auto"`` the
    group's first rank decides: one 8-byte broadcast per ``step()``; a fixed
    ``every`` costs nothing), and ``latest()``/``load_latest()`` return the
    same step on every rank: the newest one every rank can obtain.
    Retention then counts only the steps every rank committed (agreed by
    one 24-byte all-reduce as the next save starts), and the newest of them
    always survives: a rank whose saves failed keeps a step in common with
    the others. Each rank stages into ``<stage_dir>/rank-<global rank>/`` (a prefix of
    its own in an object store), so ranks never take each other's copies.
    ``replicate=n`` (with ``group``): each committed checkpoint is also sent,
    in the background, to ``n`` ranks on other nodes (the ring of
    :mod:`fastpersist.replicas`), which commit it durably in
    ``<their directory>/replicas/rank-<r>/`` (with the same retention). The
    node of each rank is global rank // ``LOCAL_WORLD_SIZE``, or
    ``nodes[i]`` (``nodes``: one node id per rank of ``group``, in group
    order). A rank whose checkpoint is missing or damaged locally gets it
    from a holder before trying ``stage_dir``.

    Directories are resolved to absolute paths when the Checkpointer is
    made: a later ``os.chdir`` does not move its checkpoints. Use it as a
    context manager, or call :meth:`close`, to wait for the last save.
    """

    def __init__(
        self,
        directory: str,
        *,
        keep_last: int = 3,
        keep_every: Optional[int] = None,
        every: Union[str, int] = "auto",
        max_overhead: float = 0.035,
        stage_dir: Optional[str] = None,
        mode: str = "pipelined",
        clock: Callable[[], float] = time.perf_counter,
        storage_options: Optional[Dict[str, Any]] = None,
        replicate: int = 0,
        group: Any = None,
        nodes: Optional[Sequence[Hashable]] = None,
        **options: Any,
    ) -> None:
        _check_peer_args(replicate, group, nodes)
        _check_options(mode, options, keep_last, keep_every)
        if not callable(clock):
            raise TypeError(f"clock must be a function returning seconds, not {type(clock).__name__}")
        self.tuner = FrequencyTuner(every, max_overhead)  # checked before any directory is made
        self._closed = False
        #: Finishing at exit (see _at_exit).
        self._exiting = False
        #: The directory's writer lock, once taken (-1: not checked there).
        self._writer_fd: Optional[int] = None
        self._writer_release: Optional[weakref.finalize] = None
        self.directory = os.path.abspath(_local_dir("directory", directory))
        self.replicate = replicate
        self.group = group
        self._ring: Optional[Ring] = None
        self._ctl: Any = None  # agreement and restore transfers (the caller's thread)
        self._wire: Any = None  # replication (the replication thread)
        self._ctl_root = 0
        if group is not None:
            self._join_group(group, replicate, nodes)
            if stage_dir:
                # Every rank has a state of its own: each stages into a
                # folder (or prefix) of its own under the shared one.
                import torch.distributed as dist

                stage_dir = _per_rank(os.fspath(stage_dir), dist.get_rank())
        #: The object store tier, when ``stage_dir`` is a URL.
        self.store = ObjectStore(os.fspath(stage_dir), storage_options) if stage_dir and is_url(stage_dir) else None
        self.stage_url = self.store.url if self.store is not None else None
        if self.store is not None:
            stage_dir = None
        self.stage_dir = os.path.abspath(_local_dir("stage_dir", stage_dir)) if stage_dir is not None else None
        if self.stage_dir and os.path.realpath(self.stage_dir) == os.path.realpath(self.directory):
            # (one copy, listed twice: a tier that is no second copy)
            raise ValueError(f"stage_dir {self.stage_dir!r} is the Checkpointer's directory itself")
        make_dirs(self.directory)
        if self.stage_dir:
            make_dirs(self.stage_dir)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.mode = mode
        self.options = options
        self.clock = clock
        self._saver = AsyncSaver(max_pending=2)
        self._prepared = False
        staged = self.stage_dir or self.store is not None
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="fastpersist-stage") if staged else None
        self._lock = threading.RLock()
        #: errnos of failed writes of the checkpoint log (warned once each).
        self._log_errors: set = set()
        self._inflight: Optional[_InFlight] = None
        self._last_step_at: Optional[float] = None
        self._staged: set = set(_scan(self.stage_dir, "shared"))
        #: Whether ``_staged`` holds every step staged before this process:
        #: not when the store could not be listed here (a going back then
        #: lists it, see _went_back).
        self._staged_known = True
        if self.store is not None:
            try:
                self._staged = set(_scan_store(self.store))
            except OSError as e:
                self._staged_known = False
                log.error("fastpersist: cannot list %s: %s", self.stage_url, e)
        #: Going back whose staging tier part is not done (the tier could not
        #: be listed, or a checkpoint not moved): its record -> (the step
        #: gone back to, the staged steps to set aside, or None: every one
        #: past that step). The stager tries again before each stage and
        #: stages nothing past the step until it is done; the steps it names
        #: are neither restored nor counted by retention meanwhile.
        self._unfinished: Dict[str, Tuple[int, Optional[Tuple[int, ...]]]] = {}
        #: Records of going back in the directory that are not this
        #: process's (another live process's, or a dead one's not carried
        #: out yet), read at each restore, retention and stage: the steps
        #: they name are held back as this process's own unfinished ones.
        self._others: Dict[str, Tuple[int, Optional[Tuple[int, ...]]]] = {}
        #: A going back in progress on the caller's thread, before its
        #: record is handed to the stager (held back meanwhile too).
        self._going_back: Dict[str, Tuple[int, Optional[Tuple[int, ...]]]] = {}
        self._stage_futures: List[Any] = []
        #: Steps queued for staging, not started, when a save set later
        #: checkpoints aside (a run this one went back on): their stages
        #: are skipped (see _went_back); a later commit of such a step is
        #: staged.
        self._abandoned_stages: Set[int] = set()
        #: Records of going back this process wrote and has not carried out
        #: yet -> the descriptor that holds each one's lock.
        self._records: Dict[str, int] = {}
        #: Steps handed to the stager that it has not started on.
        self._stage_queue: set = set()
        #: The step the stager is copying or uploading now.
        self._staging_now: Optional[int] = None
        #: File identity (dev, ino, size, mtime_ns) -> whether it verified.
        self._valid: Dict[Tuple[int, int, int, int], bool] = {}
        self._replicator: Optional[ThreadPoolExecutor] = (
            ThreadPoolExecutor(1, thread_name_prefix="fastpersist-replicate") if self._ring is not None else None
        )
        self._replica_futures: List[Any] = []
        #: Steps whose replicas every holder acknowledged (this process).
        self._replicated: Set[int] = set()
        #: Why replication stopped (a peer gone: the pairs are out of step).
        self._replica_broken: Optional[str] = None
        #: With ``group``: the steps every rank committed (agreed at the
        #: next save's start), or that a group restore obtained on every rank;
        #: retention counts only these, so a rank whose saves failed keeps a
        #: step in common with the others.
        self._agreed: Set[int] = set()
        #: The last save started here and its outcome, not yet agreed.
        self._outcome: Optional[Tuple[int, bool]] = None
        _checkpointers.add(self)
        names = _listing(self.directory)
        self._resume_going_back(names=names)
        self._refresh_others(names)
        self._sweep_leftovers(every_time=True)
        if self._stager is not None:
            # Catch up: local checkpoints newer than any staged one (an upload
            # or copy cut short by a crash) are staged again, newest last.
            # Retention is left to this Checkpointer's own saves: one made
            # only to read (an evaluator's load_latest) deletes nothing.
            newest = max(self._staged, default=-1)
            for step, info in sorted(_scan(self.directory, "local").items()):
                if step > newest:
                    self._queue_stage(step, info.path, retain=False)

    def _join_group(self, group: Any, replicate: int, nodes: Optional[Sequence[Hashable]]) -> None:
        import torch.distributed as dist

        ranks = group_ranks(group)
        if replicate:
            self._ring = Ring.build(ranks, dist.get_rank(), replicate, nodes)  # checks before any collective
        made = dedicated_groups(group, 2 if replicate else 1)
        self._ctl = made[0]
        self._wire = made[1] if replicate else None
        self._ctl_root = ranks[0]

    def _after_fork_in_child(self) -> None:
        """In a child made by ``os.fork()``: the checkpoint in flight and the
        copies to ``stage_dir`` are the parent's (its saver's future fails
        here with :class:`~fastpersist.InheritedSaveError`); the child
        neither waits for them nor logs them, and stages with threads of
        its own."""
        self._lock = threading.RLock()
        if self._writer_release is not None and self._writer_release.detach() is not None:
            # The parent's lock (it stays held there): this process saving
            # here too would be a second writer, and is refused as one.
            os.close(self._writer_fd)  # type: ignore[arg-type]
        self._writer_fd, self._writer_release = None, None
        for held in self._records.values():
            os.close(held)  # the parent's: it carries them out (the lock stays its own)
        self._records = {}
        self._unfinished = {}  # (the parent's records: held back as others', see _refresh_others)
        self._going_back = {}
        if self._inflight is not None:
            self.tuner.record_unmeasured()  # the parent's save: never measured here
        self._inflight = None
        _saving.pop(id(self), None)
        self._last_step_at = None
        self._stage_futures = []
        self._stage_queue = set()
        if self._stager is not None:
            self._stager = ThreadPoolExecutor(1, thread_name_prefix="fastpersist-stage")
        self._replica_futures = []
        if self._replicator is not None:
            self._replicator = ThreadPoolExecutor(1, thread_name_prefix="fastpersist-replicate")

    # -- the training loop -------------------------------------------------

    def step(self, step: int, state: Any) -> Optional[CheckpointFuture]:
        """Call once per iteration (after ``optimizer.step()``); returns the
        save's future when this iteration checkpoints."""
        self._check_open()
        _check_step(step)
        now = self.clock()
        if self._last_step_at is not None:
            dur = now - self._last_step_at
            fl = self._inflight
            # A save that had finished before this iteration began costs it nothing.
            done_at = fl.future.done_at if fl is not None else None
            affected = fl is not None and (done_at is None or done_at > self._last_step_at)
            self.tuner.record_iteration(dur, affected=affected)
            if fl is not None and affected and self.tuner.clean_time is not None:
                fl.extra += max(0.0, dur - self.tuner.clean_time)
        self._poll()
        if not self._prepared:
            # Snapshot mode: make the staging buffer in the background now,
            # not on the first checkpoint's critical path.
            self.prepare(state)
        fut = None
        want = self.tuner.should_checkpoint()
        if self._ctl is not None and self.tuner.auto:
            want = self._decide_together(want)
        if want:
            fut = self._start(step, state)
        # An iteration is measured from here to the next call: its time
        # includes this call's (a save's stall is part of what it costs).
        self._last_step_at = now
        return fut

    def _decide_together(self, want: bool) -> bool:
        """The group's first rank's decision, on every rank (with
        ``every="auto"`` each rank's tuner measures its own iterations)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(want)], dtype=torch.int64)
        dist.broadcast(t, src=self._ctl_root, group=self._ctl)
        return bool(int(t[0]))

    def pause(self) -> None:
        """Call after a break in training (evaluation, a stall in data
        loading) so the break is not measured as an iteration."""
        self._last_step_at = None

    def fence(self) -> None:
        """Wait until the checkpoint in flight has left the tensors (in
        snapshot mode: until its snapshot is taken); call it before any
        in-place update of the state, ``optimizer.step()`` included, in
        either mode."""
        fl = self._inflight
        if fl is not None:
            t = self.clock()
            try:
                fl.future.wait_snapshot()
            except Exception:
                if not fl.future.snapshot_done():
                    raise
                # The save failed (in pipelined mode, its write is what the
                # fence waits for): the tensors are free, and the failure
                # is logged where the save is finished, as every failed
                # checkpoint's is; training goes on.
            fl.stall += self.clock() - t

    def prepare(self, state: Any, background: bool = True) -> None:
        """In snapshot mode: make the staging buffer that ``state``'s
        snapshot needs ahead of the first checkpoint (in the background by
        default), so the first save blocks the loop no longer than the
        rest. Nothing to do in pipelined mode. ``step()`` calls it (in the
        background) on its first call if it was not called before."""
        self._check_open()
        self._prepared = True
        if self.mode == "snapshot":
            self._saver.prepare({"step": 0, "state": state}, background=background)

    def save(self, step: int, state: Any) -> CheckpointFuture:
        """Checkpoint now, whatever the interval (with ``replicate``: on
        every rank, with the same step)."""
        return self._start(step, state)

    def _take_directory(self) -> None:
        """At the first save: the directory's writer lock (every rank's, with
        a group: one refused is every rank's error). Two Checkpointers
        saving into one directory (two jobs, or ranks given one path without
        ``group=``) would each take the other's newer checkpoints for a run
        it went back on and set them aside, and readers would find none."""
        if self._writer_fd is not None:
            return  # (with a group, every rank took its lock at the same first save)
        why = self._lock_writer()
        if self._ctl is None:
            if why is not None:
                raise RuntimeError(why)
            return
        try:
            fail_all(gather(why, self._ctl), "taking the checkpoint directories")
        except BaseException:
            self._release_writer()  # (every rank tries again at its next save)
            raise

    def _release_writer(self) -> None:
        """Let go of the directory's writer lock, if held."""
        if self._writer_release is not None:
            self._writer_release()
        self._writer_fd, self._writer_release = None, None

    def _lock_writer(self) -> Optional[str]:
        """Take :data:`WRITER_LOCK` (held until close(), or until this
        Checkpointer is gone); why not, when another holds it. A file system
        without locks is not checked (a warning)."""
        path = os.path.join(self.directory, WRITER_LOCK)
        try:
            # Read-only, held: a descriptor open for writing would keep the
            # file system from being remounted read-only.
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644))
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as e:
            # (a read-only or full file system: the save fails on its own,
            # logged, and the loop goes on; the lock is tried again next save)
            log.warning("fastpersist: cannot take %s: %s", path, e)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "?"
            os.close(fd)
            mine = holder == _holder()
            who = "another Checkpointer of this process" if mine else f"another Checkpointer (pid and host: {holder})"
            return f"{who} is saving into {self.directory}: one Checkpointer saves into a directory at a time " + (
                "(close() the other first)" if mine else "(give each process its own, or the ranks of a job group=)"
            )
        except OSError as e:
            os.close(fd)
            log.warning(
                "fastpersist: %s has no file locks (%s): another Checkpointer saving there is not seen", path, e
            )
            self._writer_fd = -1
            return None
        try:  # (who holds it, for the message of one refused: best effort)
            with open(path, "r+b", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW | os.O_CLOEXEC)) as w:
                w.truncate(0)
                w.write(f"{_holder()}\n".encode())
        except OSError:
            pass
        self._writer_fd = fd
        self._writer_release = weakref.finalize(self, os.close, fd)
        return None

    def _start(self, step: int, state: Any) -> CheckpointFuture:
        self._check_open()
        _check_step(step)
        self._take_directory()
        t0 = self.clock()
        try:
            if self._inflight is not None:
                # One checkpoint at a time: the previous must be committed first.
                self._finish(self._inflight, wait=True)
        finally:
            if self._ctl is not None:
                # Every rank reaches the all-reduce, even one whose
                # bookkeeping of the previous save raised.
                self._agree_previous()
        path = os.path.join(self.directory, ckpt_name(step))
        later = self._later_than(step)
        if later or self._staged_after(step):
            self._went_back(step, later)
        try:
            # A link at the checkpoint's name (this Checkpointer's own) is
            # replaced, not followed out of the directory.
            payload, what = {"step": step, "state": state}, "Checkpointer.save"
            fut = self._saver._save(payload, path, self.mode, dict(self.options), what, follow_last=False)
        except BaseException:
            self._outcome = (step, False)
            self.tuner.record_unmeasured()  # (the tuner waits for no measure of it)
            raise
        self._inflight = _InFlight(step, fut, t0, self.clock() - t0)
        _saving[id(self)] = self
        clock, key = self.clock, id(self)  # (the callbacks hold neither self nor the _InFlight: no cycle)
        fut._on_done(lambda f: setattr(f, "done_at", clock()))
        fut._on_done(lambda f: _saving.pop(key, None))
        return fut

    def _agree_previous(self) -> None:
        """With ``group``, at a save's start (every rank starts the same
        saves, in the same order, after the previous one finished): one
        all-reduce of the previous save's step and outcome. A step every
        rank committed joins ``_agreed``; retention then counts it."""
        step, ok = self._outcome if self._outcome is not None else (-1, False)
        self._outcome = None
        lo, hi, all_ok = agree_outcome(step, ok, self._ctl)
        if lo != hi:
            log.warning(
                "fastpersist: the ranks' previous checkpoints were of different steps (%d to %d): "
                "all ranks must checkpoint the same steps; retention keeps them",
                lo,
                hi,
            )
        elif all_ok and lo >= 0:
            with self._lock:
                self._agreed.add(lo)
            self._retain()

    def _poll(self) -> None:
        fl = self._inflight
        if fl is not None and fl.future.done():
            self._finish(fl, wait=False)

    def _finish(self, fl: _InFlight, wait: bool, tune: bool = True) -> None:
        t = self.clock()
        exc = future_error(fl.future, None if wait else 0)
        waited = self.clock() - t
        self._inflight = None
        _saving.pop(id(self), None)
        self._outcome = (fl.step, exc is None)
        if exc is not None:
            log.error("fastpersist: checkpoint of step %d failed: %r", fl.step, exc)
            self._log_event({"event": "failed", "step": fl.step, "error": repr(exc)})
            self._submit_replica(fl.step, None)  # the holder is told: nothing this time
            self.tuner.record_unmeasured()
            return
        st = fl.future.result()
        stall = fl.stall + waited
        if tune:  # not when drained by wait()/close(): no iteration ran beside it
            write_s = fl.future.total_seconds if fl.future.total_seconds is not None else st.seconds
            self.tuner.record_checkpoint(max(fl.extra, stall), write_s)
        else:
            self.tuner.record_unmeasured()
        log.info(
            "fastpersist: checkpoint step %d: %d bytes, stall %.1f ms, write %.3f s (%.2f GB/s), interval %d",
            fl.step,
            st.bytes,
            stall * 1e3,
            st.seconds,
            st.gbps,
            self.tuner.interval,
        )
        self._log_event(
            {
                "event": "commit",
                "step": fl.step,
                "path": st.path,
                "bytes": st.bytes,
                "stall_s": stall,
                "write_s": st.seconds,
                "gbps": st.gbps,
                "tier": "local",
                "interval": self.tuner.interval,
            }
        )
        with self._lock:
            self._mark_valid(st.path)
        if self._stager is not None:
            self._queue_stage(fl.step, st.path)
        self._submit_replica(fl.step, st.path)
        self._retain()

    def _holder_dir(self, holder: int) -> str:
        """This Checkpointer's directory (``holder`` -1), or the one of the
        replicas it holds of rank ``holder``."""
        return self.directory if holder < 0 else replica_dir(self.directory, holder)

    def _later_than(self, step: int) -> Tuple[_Later, ...]:
        """The checkpoints (local, and replicas held) of steps after
        ``step`` there now, each with its file's identity and holder."""
        holders = [-1] + (list(self._ring.sources()) if self._ring is not None else [])
        out = []
        for h in holders:
            for i in sorted(_scan(self._holder_dir(h), "local").values(), key=lambda i: i.step):
                ident = self._identity(i.path) if i.step > step else None
                if ident is not None:
                    out.append(_Later(i, ident, h))
        return tuple(out)

    def _staged_after(self, step: int) -> Tuple[int, ...]:
        """The steps after ``step`` staged by this process, and the one its
        stager copies now unless it is set aside once it lands (the caller
        holds ``_lock`` where it acts on them)."""
        with self._lock:
            now = self._staging_now
            copying = {now} - self._abandoned_stages if now is not None else set()
            return tuple(sorted(s for s in self._staged | copying if s > step))

    def _went_back(self, step: int, later: Tuple[_Later, ...]) -> None:
        """A save of ``step`` begins while checkpoints of later steps are
        there (``later``: this directory's and the replicas held here; and
        the staging tier's, :meth:`_staged_after`): they are from a run this one went
        back on (resumed from an earlier step after a loss spike, or past a
        damaged newest one). They are set aside before the save is written,
        not deleted: renamed ``<name>.abandoned`` (an object's commit marker
        moved likewise), so neither ``latest()`` nor retention counts them
        any more, and a process that dies from now on is restored from this
        run, not from the one it left. What this takes is recorded first,
        durably (``.went-back-<step>.json``, steps and file identities, no
        paths): the next Checkpointer made on the directory carries out
        what a dying process left undone.
        Checkpoints written meanwhile (another process's) are left alone.
        The staging tier's are set aside on the staging thread, after any
        copy it has begun (that one by the stager itself, once it lands);
        while that cannot be done (the tier cannot be listed, or a move
        fails), the record is kept and tried again before each stage,
        nothing past ``step`` is staged, and the tier's checkpoints it
        names are neither restored nor counted by retention."""
        record, n = os.path.join(self.directory, f".went-back-{step}.json"), 0
        with self._lock:
            while record in self._records or os.path.lexists(record):  # this step's earlier record, still kept
                n += 1
                record = os.path.join(self.directory, f".went-back-{step}-{n}.json")
            # What the staging tier has past the step, taken in the same
            # hold as the stager's bookkeeping is changed: a stage that
            # lands or starts from here on sees it.
            # (None: the tier could not be listed when this process
            # began; every staged step past this one is the abandoned run's,
            # listed on the stager.)
            after = self._staged_after(step)
            staged: Optional[Tuple[int, ...]] = after if self._staged_known else None
            was_staged = self._staged & set(after)
            if self._stager is not None and (staged is None or staged):
                self._going_back[record] = (step, staged)  # (retention and restore pass them by from now on)
            if self._stager is not None:
                self._abandoned_stages |= {s for s in self._stage_queue if s > step}
                if self._staging_now is not None and self._staging_now > step:
                    self._abandoned_stages.add(self._staging_now)  # (set aside by the stager when it lands)
                self._staged -= was_staged
                self._stage_queue = {s for s in self._stage_queue if s <= step}
        entry = {
            "step": step,
            "later": [[x.holder, x.info.step, list(x.ident)] for x in later],
            "staged": list(staged) if staged is not None else None,
        }
        try:
            self._carry_out(step, later, staged, record, was_staged, entry)
        finally:
            with self._lock:
                self._going_back.pop(record, None)

    def _write_record(self, record: str, entry: Dict[str, Any]) -> None:
        """Write the record of a going back, durably, and keep its lock."""
        try:
            with _core.TempFile(record) as tmp:
                data = json.dumps(entry).encode()
                tmp.write(data, 0)
                # The temporary file's lock, kept by this descriptor past the
                # commit: the record is this live process's to carry out
                # (another Checkpointer on the directory leaves it alone).
                held = os.dup(tmp.fd)
                with self._lock:
                    self._records[record] = held
                tmp.commit(len(data))
        except OSError as e:  # the set-aside goes on; only a crash's recovery is lost
            log.warning("fastpersist: cannot record going back to step %d in %s: %s", entry["step"], record, e)

    def _carry_out(
        self,
        step: int,
        later: Tuple[_Later, ...],
        staged: Optional[Tuple[int, ...]],
        record: str,
        was_staged: Set[int],
        entry: Dict[str, Any],
    ) -> None:
        """:meth:`_went_back`'s record, then its setting aside."""
        handed = False  # to the staging thread, which releases the record
        try:
            self._write_record(record, entry)
            for x in later:
                self._set_aside(x.info, x.ident)
            if self._stager is not None and (staged is None or staged):  # (a listing costs a request per checkpoint)
                with self._lock:
                    # Unfinished from here on: the stager carries it out
                    # before it stages anything past the step, and keeps
                    # the record (and stages nothing past it) while it cannot.
                    self._unfinished[record] = (step, staged)
                    handed = True
                self._stage_futures.append(self._stager.submit(self._settle_going_back, step))
                return
        except BaseException:
            # Interrupted (Ctrl-C) or failed part-way, in a process that
            # lives on: its record must not outlive it (the next Checkpointer
            # on the directory would carry it out over what this run stages
            # from now on). The save raises; a retry goes back again, the
            # staging tier's part included.
            if not handed:
                with self._lock:
                    self._staged |= was_staged
                self._release_record(record)
            raise
        self._release_record(record)

    def _release_record(self, record: str) -> None:
        """Remove a record of going back this process wrote, then let go of
        its lock."""
        _remove_quietly(record)  # (first: while it is there, it is this process's, not another's)
        with self._lock:
            held = self._records.pop(record, None)
        if held is not None:
            os.close(held)

    def _records_here(self, names: Optional[List[str]] = None) -> List[str]:
        """The records of going back in the directory that are not this
        process's own (``names``: its listing, when taken)."""
        if names is None:
            names = _listing(self.directory)
        if names is None:
            return []
        with self._lock:
            mine = set(self._records)
        paths = (os.path.join(self.directory, n) for n in sorted(names) if _WENT_BACK.fullmatch(n))
        return [p for p in paths if p not in mine]

    @staticmethod
    def _open_record(record: str) -> Optional[int]:
        """A descriptor of the record ``record``, a regular file (not
        followed through a link; a folder or a FIFO at the name: None)."""
        try:
            fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        except OSError as e:  # (a link, or not readable now: left for later)
            log.warning("fastpersist: cannot read the record %s: %s", record, e)
            return None
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
        except OSError:
            regular = False
        if not regular:
            os.close(fd)
            return None
        return fd

    def _parse_record(self, data: bytes) -> Tuple[int, List[_Later], Optional[Tuple[int, ...]]]:
        """A record's step, its later local checkpoints and its staged steps
        (None: every staged step past the step); one of
        :data:`_DAMAGED_RECORD` for a damaged one."""
        entry = parse_json(data)
        step = int(entry["step"])
        _check_step(step)
        later = []
        for h, s, ident in entry["later"]:
            holder, later_step = int(h), int(s)
            _check_step(later_step)
            path = os.path.join(self._holder_dir(holder), ckpt_name(later_step))
            info = CheckpointInfo(later_step, path, "local", 0)
            later.append(_Later(info, tuple(int(x) for x in ident), holder))
        # (None: the process did not know what was staged before it; it
        # staged nothing past the step since, see _settle_going_back.)
        staged = None if entry["staged"] is None else tuple(int(s) for s in entry["staged"])
        for s in staged or ():
            _check_step(s)
        return step, later, staged

    def _refresh_others(self, names: Optional[List[str]] = None) -> None:
        """Read the records of going back that are not this process's (no
        lock taken): the staging tier's steps they name are held back.
        ``names``: the directory's listing, when taken."""
        found: Dict[str, Tuple[int, Optional[Tuple[int, ...]]]] = {}
        for record in self._records_here(names):
            fd = self._open_record(record)
            if fd is None:
                continue
            with open(fd, "rb") as f:
                try:
                    step, _, staged = self._parse_record(f.read(1 << 20))
                except (OSError, *_DAMAGED_RECORD):
                    continue
            if staged is None or staged:
                found[record] = (step, staged)
        with self._lock:
            self._others = found

    def _resume_going_back(self, adopt: bool = False, names: Optional[List[str]] = None) -> None:
        """Carry out the records of going back that a process left (it died
        before every tier's later checkpoints were set aside): at
        construction, and on the stager before each stage (``adopt``: one
        whose staging tier part still cannot be done is then taken on, kept
        locked and tried again before each stage, as this process's own).
        A record whose process lives (its lock held) is that process's. A
        local checkpoint is set aside only if it is still the file recorded
        (a record names steps, not paths: whatever it holds, only this
        Checkpointer's checkpoint files are renamed); the staging tier's
        steps are those the dead process staged, none of which it, or a
        process that took its record on, staged again since (nothing past
        the step is staged while a record of it is there). ``names``: the
        directory's listing, when taken."""
        for record in self._records_here(names):
            fd = self._open_record(record)
            if fd is None:
                continue
            with open(fd, "rb") as f:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until the record is done
                    st, now = os.fstat(fd), os.lstat(record)
                except OSError:
                    continue  # its process lives and carries it out (or another recovers it now), or it is gone
                if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
                    continue  # (carried out and removed as it was opened)
                self._recover_going_back(record, f, adopt)

    def _recover_going_back(self, record: str, f: Any, adopt: bool) -> None:
        """Carry out the record of going back ``record`` (open as ``f``,
        locked) that a dead process left."""
        try:
            step, later, staged = self._parse_record(f.read(1 << 20))
        except OSError as e:
            log.warning("fastpersist: cannot read the record %s: %s", record, e)
            return
        except _DAMAGED_RECORD as e:
            log.warning("fastpersist: ignoring the damaged record %s: %s", record, e)
            _remove_quietly(record)
            return
        log.warning("fastpersist: %s: a run that went back to step %d died before it was done", record, step)
        for x in later:
            self._set_aside(x.info, x.ident)
        if staged is None or staged:
            if self._stager is None:
                return  # the staging tier's part: for a Checkpointer that has it
            done = self._abandon_staged(step, staged, None)
            with self._lock:
                self._staged = {s for s in self._staged if not _names(step, staged, s)}
                if not done and adopt:
                    # Taken on: tried again before each stage, nothing past
                    # the step staged until it is done.
                    self._records[record] = os.dup(f.fileno())  # (the lock, kept)
                    self._unfinished[record] = (step, staged)
            if not done:
                return  # (else kept for the next to try; held back meanwhile, see _refresh_others)
        _remove_quietly(record)

    def _abandon_staged(self, step: int, staged: Optional[Tuple[int, ...]], record: Optional[str]) -> bool:
        """Set the staged steps ``staged`` aside (None: every staged step
        past ``step``); whether all of it is done. ``record``: this
        process's record, released once it is, else kept unfinished
        (:meth:`_settle_going_back` tries again)."""
        where = self.stage_url or self.stage_dir
        done = False
        try:
            if self.store is None and not os.path.isdir(str(self.stage_dir)):
                raise FileNotFoundError(errno.ENOENT, "not a directory now", where)
            found = _scan_store(self.store) if self.store is not None else _scan(self.stage_dir, "shared")
        except OSError as e:
            log.warning("fastpersist: cannot list %s to set aside checkpoints past step %d: %s", where, step, e)
        else:
            done = True
            for s, info in sorted(found.items()):
                if _names(step, staged, s):
                    done = self._set_aside(info) and done
        if record is not None:
            with self._lock:
                if record not in self._unfinished:
                    return done  # (released already)
                if done:
                    self._unfinished.pop(record, None)
                else:
                    self._unfinished[record] = (step, staged)
            if done:
                self._release_record(record)
            else:
                log.warning(
                    "fastpersist: %s is kept: nothing past step %d is staged until the checkpoints of the run "
                    "this one went back on are set aside there",
                    record,
                    step,
                )
        return done

    def _settle_going_back(self, step: int) -> Optional[int]:
        """On the stager, before staging ``step``: try the unfinished going
        back again (this process's, then those a dead one left); the step
        of one still unfinished that ``step`` is past (it may not be staged:
        it would be set aside with the abandoned run's checkpoints, or
        replace one of them), else None."""
        with self._lock:
            todo = sorted(self._unfinished.items(), key=lambda kv: kv[1][0])
        for record, (back, staged) in todo:
            self._abandon_staged(back, staged, record)
        names = _listing(self.directory)
        self._resume_going_back(adopt=True, names=names)
        self._refresh_others(names)  # (a record carried out meanwhile is gone: passed by)
        with self._lock:
            blocking = [b for b, _ in (*self._unfinished.values(), *self._others.values()) if step > b]
        return min(blocking, default=None)

    def _held_back(self, step: int) -> bool:
        """Whether the staging tier's ``step`` is one an unfinished going
        back (this process's, or a record another left) is to set aside:
        not restored, not counted, not deleted."""
        with self._lock:
            pending = (*self._unfinished.values(), *self._others.values(), *self._going_back.values())
        return any(_names(back, staged, step) for back, staged in pending)

    def _set_aside(self, info: CheckpointInfo, ident: Optional[Tuple[int, ...]] = None) -> bool:
        """Rename ``info`` (an object: move it) to ``<name>.abandoned``
        (``-1``, ``-2``, ... when taken); a file whose identity is no
        longer ``ident`` (replaced since) is left. Whether it is done (or
        there is nothing to do): False when the move failed (logged)."""
        try:
            if info.tier == "object":
                assert self.store is not None
                moved = self.store.set_aside(ckpt_name(info.step), ABANDONED)
                if moved is None:
                    return True
                dst = self.store.url_of(moved)
            else:
                if ident is not None and self._identity(info.path) != tuple(ident):
                    return True
                dst = aside_name(info.path, ABANDONED)
                os.rename(info.path, dst)
                fsync_dir(os.path.dirname(info.path))
        except FileNotFoundError:
            return True
        except OSError as e:
            log.warning("fastpersist: cannot set aside %s: %s", info.path, e)
            return False
        log.warning(
            "fastpersist: %s is from a run this one went back on (an earlier step is committed since): set aside as %s",
            info.path,
            dst,
        )
        self._log_event({"event": "abandoned", "step": info.step, "path": dst, "tier": info.tier})
        return True

    def wait(self) -> None:
        """Wait for the checkpoint in flight and for staging and replication
        to drain."""
        if self._inflight is not None:
            self._finish(self._inflight, wait=True, tune=False)
        for f in list(self._stage_futures):
            f.result()
        self._stage_futures.clear()
        for f in list(self._replica_futures):
            f.result()
        self._replica_futures.clear()

    def _at_exit(self) -> None:
        """At exit, not closed: the checkpoint in flight is waited for and
        committed (its ``commit`` line, retention, and its copy to the
        staging tier, made on this thread: the stager takes no work once
        the interpreter is shutting down). Not replicated: the peers are
        exiting too."""
        if self._closed or self._inflight is None:
            return
        for f in list(self._stage_futures):  # (the copies queued before it, in order)
            f.result()
        self._exiting = True
        self._finish(self._inflight, wait=True, tune=False)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Checkpointer is closed: make a new one to checkpoint again")

    def close(self) -> None:
        """Wait for everything in flight, then release the background threads
        (and the snapshot buffers). A closed Checkpointer refuses new saves;
        :meth:`latest` and :meth:`load_latest` still work; closing again
        does nothing."""
        self._closed = True
        self.wait()
        self._saver.close()
        if self._stager is not None:
            self._stager.shutdown(wait=True)
        with self._lock:
            # A going back still unfinished: its record stays, unlocked, for
            # the next Checkpointer made on the directory.
            for record in self._unfinished:
                held = self._records.pop(record, None)
                if held is not None:
                    os.close(held)
        if self._replicator is not None:
            self._replicator.shutdown(wait=True)
        self._release_writer()  # (another Checkpointer may save here now)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- staging and retention ----------------------------------------------

    def _queue_stage(self, step: int, src: str, retain: bool = True) -> None:
        assert self._stager is not None
        if self._exiting:
            self._stage(step, src, retain)
            return
        with self._lock:
            self._stage_queue.add(step)
            self._abandoned_stages.discard(step)
        self._stage_futures = [f for f in self._stage_futures if not f.done()]
        self._stage_futures.append(self._stager.submit(self._stage, step, src, retain))

    def _stage(self, step: int, src: str, retain: bool = True) -> None:
        # A tier slower than the checkpoints would otherwise fall further
        # behind at every one, and the local copies it has not taken (which
        # retention keeps) would fill the disk: a checkpoint superseded by a
        # newer one already queued is skipped, unless keep_every keeps it.
        with self._lock:
            self._stage_queue.discard(step)
            newer = max(self._stage_queue, default=step)
            if step in self._abandoned_stages:
                self._abandoned_stages.discard(step)
                return  # set aside meanwhile: a run this one went back on
            skip = newer > step and step not in _archived(self._local_steps() | {step}, self.keep_every)
            if not skip:
                self._staging_now = step
        if skip:
            self._log_event({"event": "stage_skipped", "step": step, "newer": newer})
            return
        t0 = time.perf_counter()
        where = self.stage_url or self.stage_dir
        try:
            back = self._settle_going_back(step)
            if back is not None:
                raise TierError(
                    f"{where} still holds checkpoints past step {back} of a run that went back to it: "
                    f"they are set aside before step {step} is staged"
                )
            if self.store is not None:
                dst = self.store.upload(src, ckpt_name(step)).url
            else:
                assert self.stage_dir is not None
                dst = os.path.join(self.stage_dir, ckpt_name(step))
                try:
                    _copy_durably(src, dst)
                except OSError as e:
                    if e.errno not in (errno.ENOSPC, errno.EDQUOT) or not self._make_room(step):
                        raise
                    log.warning("fastpersist: %s was full; made room for step %d and copying it again", where, step)
                    _copy_durably(src, dst)
        except BaseException as e:  # noqa: BLE001 - logged; the local copy stays
            with self._lock:
                self._staging_now = None
            log.error("fastpersist: staging step %d to %s failed: %r", step, where, e)
            self._log_event({"event": "stage_failed", "step": step, "error": repr(e)})
            return
        tier = "object" if self.store is not None else "shared"
        with self._lock:
            self._staging_now = None
            gone_back = step in self._abandoned_stages
            if gone_back:
                self._abandoned_stages.discard(step)
            else:
                self._staged.add(step)
                if self.store is None:
                    self._mark_valid(dst)
        if gone_back:
            # A save went back past it while it was copied: set aside here,
            # before anything this thread does next.
            self._set_aside(CheckpointInfo(step, dst, tier, 0))
            return
        self._log_transfer("staged", step, src, time.perf_counter() - t0, tier, path=dst)
        if retain:
            self._retain()

    # -- the peer tier -------------------------------------------------------

    def _submit_replica(self, step: int, path: Optional[str]) -> None:
        """Queue the replication of ``step`` (``path`` None: the save
        failed; the holders still take part, so the pairs stay in step).
        Every rank queues one per checkpointed step, in step order."""
        if self._replicator is None:
            return
        if self._exiting:
            log.warning("fastpersist: step %d is not replicated: the process exits with its Checkpointer open", step)
            return
        self._replica_futures = [f for f in self._replica_futures if not f.done()]
        self._replica_futures.append(self._replicator.submit(self._replicate, step, path))

    def _replica_target(self, source: int, step: int) -> Optional[str]:
        return os.path.join(replica_dir(self.directory, source), ckpt_name(step)) if step >= 0 else None

    def _replicate(self, step: int, path: Optional[str]) -> None:
        """On the replication thread: send ``step`` to each holder while
        receiving the same step from each rank this one holds for."""
        ring = self._ring
        assert ring is not None
        for holder, source in zip(ring.holders_of(ring.rank), ring.sources()):
            if self._replica_broken is not None:
                return
            t0 = time.perf_counter()
            try:
                acked, got = exchange(
                    self._wire,
                    send_to=holder,
                    send_step=step,
                    send_path=path,
                    recv_from=source,
                    recv_target=functools.partial(self._replica_target, source),
                )
            except (ReplicaError, OSError, RuntimeError) as e:
                self._replica_broken = repr(e)
                log.error("fastpersist: replication of step %d stopped (local checkpoints are kept): %r", step, e)
                self._log_event(
                    {"event": "replicate_failed", "step": step, "to_rank": holder, "error": repr(e), "tier": "peer"}
                )
                return
            seconds = time.perf_counter() - t0
            if got is not None and got.path is not None:
                with self._lock:
                    self._mark_valid(got.path)
                self._log_event(
                    {
                        "event": "replica_received",
                        "step": got.step,
                        "from_rank": source,
                        "path": got.path,
                        "bytes": got.bytes,
                        "seconds": got.seconds,
                        "gbps": got.gbps,
                        "tier": "peer",
                    }
                )
            elif got is not None and got.error is not None:
                log.error("fastpersist: replica of step %d from rank %d rejected: %s", got.step, source, got.error)
                self._log_event(
                    {"event": "replica_rejected", "step": got.step, "from_rank": source, "error": got.error}
                )
            if acked is not None:
                event = "replicated" if acked else "replicate_failed"
                self._log_transfer(event, step, path, seconds, "peer", to_rank=holder)
                if not acked:
                    return
        if path is not None:
            with self._lock:
                self._replicated.add(step)
        self._retain()

    @staticmethod
    def _identity(path: str) -> Optional[Tuple[int, int, int, int]]:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def _mark_valid(self, path: str) -> None:
        """``path`` was just committed by this process (its CRCs computed
        while writing): valid without reading it back."""
        ident = self._identity(path)
        if ident is not None:
            self._valid[ident] = True

    def _is_valid(self, path: str) -> bool:
        """Whether ``path`` verifies (checked once per file identity)."""
        ident = self._identity(path)
        if ident is None:
            return False
        ok = self._valid.get(ident)
        if ok is None:
            try:
                verify_checkpoint(path)
                ok = True
            except (FastPersistError, OSError) as e:  # damaged, or not a checkpoint we read
                log.warning("fastpersist: %s is damaged; retention keeps newer valid checkpoints: %s", path, e)
                ok = False
            self._valid[ident] = ok
        return ok

    def _local_steps(self) -> Set[int]:
        """The steps of the checkpoints in this Checkpointer's directory
        (none listed without ``keep_every``, which alone asks)."""
        return set(_scan(self.directory, "local")) if self.keep_every else set()

    def _doomed(
        self,
        infos: Dict[int, CheckpointInfo],
        may_delete: Callable[[int], bool],
        agreed: Optional[Set[int]] = None,
        pending: Optional[int] = None,
        uncounted: Optional[Set[int]] = None,
        keep: Optional[int] = None,
    ) -> List[CheckpointInfo]:
        """The checkpoints of one tier that retention removes: those older
        than the ``keep_last``-th newest *valid* one, not kept by
        ``keep_every``, and allowed by ``may_delete``. Files newer than that
        (valid or damaged) are never removed, so the newest valid checkpoint
        always survives and a reader always finds a valid one. With a group
        (``agreed``: the steps every rank committed; ``pending``: this
        rank's newest commit, whose outcome elsewhere is not known yet) only
        those steps count, and the newest valid agreed one always survives:
        the ranks keep a step in common. Steps in ``uncounted`` are never
        counted as valid. ``keep`` in place of ``keep_last``: fewer, to
        make room for one more."""
        keep = self.keep_last if keep is None else keep
        valid = 0
        cutoff: Optional[int] = None
        anchored = agreed is None
        for s in sorted(infos, reverse=True):
            if agreed is not None and s not in agreed and s != pending:
                continue
            # An object is listed only once its upload completed, and only a
            # verified file is uploaded.
            if uncounted and s in uncounted:
                continue
            if infos[s].tier == "object" or self._is_valid(infos[s].path):
                valid += 1
                anchored = anchored or (agreed is not None and s in agreed)
                if valid >= keep and anchored:
                    cutoff = s
                    break
        if cutoff is None:
            return []
        archived = _archived(infos, self.keep_every)
        return [info for s, info in sorted(infos.items()) if s < cutoff and s not in archived and may_delete(s)]

    def _sweep_leftovers(self, every_time: bool = False) -> None:
        """Remove the temporary files killed saves left in this
        Checkpointer's directories (see :func:`clean_temp_files`): when it
        starts, and again at its retention at most once every
        ``SWEEP_EVERY`` seconds per directory (a long run also removes
        those too young at its start)."""
        held = [replica_dir(self.directory, r) for r in held_ranks(self.directory)]
        for d in filter(None, (self.directory, self.stage_dir, *held)):
            if not sweep_due("dir:" + d) and not every_time:
                continue
            for name in clean_temp_files(d):
                log.warning("fastpersist: removed %s, left by a save that did not finish", os.path.join(d, name))

    def _retain(self) -> None:
        self._sweep_leftovers()
        names = _listing(self.directory)  # (a checkpoint committed since is not deleted now: safe)
        if self._stager is not None:
            self._refresh_others(names)
        with self._lock:
            staged = set(self._staged)
            # With staging, a local copy goes only once it (or a newer
            # checkpoint) has reached the shared tier.
            tiered = self.stage_dir or self.store is not None
            # With replicas, likewise once it (or a newer one) is on its
            # holders; unless replication has stopped (a peer gone).
            replicated = set(self._replicated)
            peered = self._ring is not None and self._replica_broken is None
            # With a group, only steps every rank committed are counted (and
            # this rank's newest, not agreed yet): a rank whose saves failed
            # still shares a step with the others, and a group restore finds it.
            agreed, pending = self._counted()

            def local_ok(s: int) -> bool:
                return (not tiered or any(x >= s for x in staged)) and (not peered or any(x >= s for x in replicated))

            for info in self._doomed(_scan(self.directory, "local", names=names), local_ok, agreed, pending):
                self._delete(info)
            if self._ring is not None:
                for src in self._ring.sources():
                    for info in self._doomed(
                        _scan(replica_dir(self.directory, src), "peer"), lambda s: True, agreed, pending
                    ):
                        self._delete(info)
            if self.stage_dir:
                self._retain_shared(agreed, pending, self.keep_last)
            if self.store is not None:
                try:
                    listing: Optional[StoreListing] = self.store.scan()
                    remote = _scan_store(self.store, listing)
                except OSError as e:
                    log.warning("fastpersist: retention cannot list %s: %s", self.stage_url, e)
                    listing, remote = None, {}
                # An object whose marker does not confirm it (a store copied
                # or restored, or an upload again of the name killed before
                # its marker: whole or not, its CRC32s tell at its download)
                # is kept, and not counted for a checkpoint kept.
                unconfirmed = {s for s in remote if listing and ckpt_name(s) in listing.unconfirmed}
                held = {s for s in remote if self._held_back(s)}
                for info in self._doomed(remote, lambda s: s not in held, agreed, pending, unconfirmed | held):
                    self._delete(info)
                    self._staged.discard(info.step)
                    remote.pop(info.step, None)
                if remote:
                    self._sweep_store(min(remote), listing)

    def _counted(self) -> Tuple[Optional[Set[int]], Optional[int]]:
        """(Under the lock.) The steps retention counts with a group: those
        every rank committed, and this rank's newest commit, whose outcome
        elsewhere is not known yet (None, None without a group)."""
        agreed = set(self._agreed) if self._ctl is not None else None
        mine = self._outcome
        return agreed, (mine[0] if mine is not None and mine[1] else None)

    def _retain_shared(self, agreed: Optional[Set[int]], pending: Optional[int], keep: int) -> int:
        """(Under the lock.) Retention on the shared tier, keeping the
        ``keep`` newest valid checkpoints; how many it removed. Those an
        unfinished going back is to set aside are left to it."""
        shared = _scan(self.stage_dir, "shared")
        held = {s for s in shared if self._held_back(s)}
        doomed = self._doomed(shared, lambda s: s not in held, agreed, pending, held, keep)
        for info in doomed:
            self._delete(info)
            self._staged.discard(info.step)
        return len(doomed)

    def _make_room(self, step: int) -> bool:
        """The shared tier was full (ENOSPC, EDQUOT) as ``step`` was copied
        to it: remove there what the copy, once there, would retire (all
        but the ``keep_last - 1`` newest valid checkpoints, ``keep_every``'s
        kept), so that a tier with room for ``keep_last`` checkpoints goes
        on taking them; whether anything was removed. Never the newest
        valid one: with ``keep_last=1`` nothing is (such a tier needs room
        for two: the new copy is made before the old one goes)."""
        if self.keep_last < 2:
            return False
        with self._lock:
            agreed, pending = self._counted()
            removed = self._retain_shared(agreed, pending, self.keep_last - 1)
        if removed:
            self._log_event({"event": "stage_made_room", "step": step, "removed": removed})
        return removed > 0

    def _sweep_store(self, oldest: int, listing: Optional[StoreListing] = None) -> None:
        """Remove what uploads of steps before ``oldest`` (the oldest
        committed step the store keeps) left there: objects no marker
        commits, unfinished multipart uploads (a killed process's), a failed
        deletion's data. No upload of such a step is still to come; nor a
        set-aside of one (the temporary file of a killed one's marker for
        ``<name>.abandoned``; its data is kept)."""

        def doomed(name: str) -> bool:
            s = _parse_ckpt(name)
            return s is not None and s < oldest

        def doomed_temp(name: str) -> bool:
            m = _ASIDE.fullmatch(name)
            return doomed(m.group(1) if m is not None else name)

        assert self.store is not None
        try:
            removed = self.store.sweep(doomed, listing, doomed_temp)
        except OSError as e:
            log.warning("fastpersist: retention cannot clean up %s: %s", self.stage_url, e)
            return
        for url in removed:
            log.info("fastpersist: removed %s, left behind by an upload or a deletion that did not finish", url)

    def _delete(self, info: CheckpointInfo) -> None:
        try:
            if info.tier == "object":
                assert self.store is not None
                self.store.delete(ckpt_name(info.step))  # marker first, then data
            else:
                os.unlink(info.path)
        except FileNotFoundError:
            return
        except OSError as e:
            log.warning("fastpersist: retention cannot remove %s: %s", info.path, e)
            return
        self._log_event({"event": "deleted", "step": info.step, "path": info.path, "tier": info.tier})

    # -- restore -------------------------------------------------------------

    def checkpoints(self) -> List[Tuple[int, List[CheckpointInfo]]]:
        """Committed checkpoints by step (newest first), each with its copies."""
        # (Not the staging tier's checkpoints an unfinished going back is to
        # set aside: the run this one went back on.)
        names = _listing(self.directory)
        self._refresh_others(names)
        if self.store is not None:
            local, remote = _scan(self.directory, "local", names=names), _scan_store(self.store)
            remote = {s: c for s, c in remote.items() if not self._held_back(s)}
            steps = sorted(set(local) | set(remote), reverse=True)
            return [(s, [c for c in (local.get(s), remote.get(s)) if c is not None]) for s in steps]
        out = []
        for s, copies in list_checkpoints(self.directory, self.stage_dir, names=names):
            kept = [c for c in copies if c.tier == "local" or not self._held_back(s)]
            if kept:
                out.append((s, kept))
        return out

    def _first_good(self, attempt: Callable[[CheckpointInfo], Optional[_T]]) -> Optional[_T]:
        """``attempt`` on each copy, newest first, until one succeeds (not
        None). A copy that vanished since the listing (retention in another
        process) makes the listing start again: retention deletes only
        files older than a committed newer one, which the new listing has.
        An empty listing is confirmed by a second one: reading a directory
        while another process renames a new checkpoint into it and removes
        the old one can miss both names."""
        empty_before = False
        for _ in range(_RELIST):
            vanished = False
            listing = self.checkpoints()
            for _, copies in listing:
                for c in copies:
                    try:
                        out = attempt(c)
                    except FileNotFoundError:
                        vanished = True
                        break
                    if out is not None:
                        return out
                if vanished:
                    break
            if not vanished and (listing or empty_before):
                return None
            empty_before = not listing
        return None

    def latest(self, verify: bool = True) -> Optional[CheckpointInfo]:
        """The newest committed checkpoint whose checksums verify (local copy
        first, else the shared one); damaged copies are skipped. With
        ``group``: the same step on every rank (the newest one every rank
        can obtain), fetched into this rank's directory from its replica
        holder when missing or damaged here (see the class doc)."""
        if self._ctl is not None:
            return self._group_restore(verify, None)

        def attempt(c: CheckpointInfo) -> Optional[CheckpointInfo]:
            if c.tier == "object":
                return self._fetch(c)
            if not verify:
                if not os.path.exists(c.path):
                    raise FileNotFoundError(c.path)
                return c
            try:
                verify_checkpoint(c.path)
                return c
            except FileNotFoundError:
                raise
            except (FastPersistError, OSError) as e:
                log.warning("fastpersist: skipping damaged checkpoint %s: %s", c.path, e)
                return None

        return self._first_good(attempt)

    def load_latest(
        self, *, map_location: Any = None, weights_only: Optional[bool] = None
    ) -> Optional[Tuple[int, Any]]:
        """``(step, state)`` of the newest checkpoint that loads and verifies,
        or None when there is none. With ``group``: the same step on every
        rank (None on every rank when they have no step in common).
        ``weights_only`` as :func:`~fastpersist.read_state_dict` takes it."""
        weights_only = resolve_weights_only(weights_only)
        if self._ctl is not None:
            return self._group_restore(True, {"map_location": map_location, "weights_only": weights_only})

        def attempt(c: CheckpointInfo) -> Optional[Tuple[int, Any]]:
            if c.tier == "object":
                got = self._fetch(c)
                if got is None:
                    return None
                c = got
            try:
                payload = read_state_dict(c.path, map_location=map_location, weights_only=weights_only)
                return _unpack(payload, c.path)
            except FileNotFoundError:
                raise
            except (FastPersistError, OSError) as e:
                log.warning("fastpersist: skipping damaged checkpoint %s: %s", c.path, e)
                return None

        return self._first_good(attempt)

    # -- restore across a group ------------------------------------------------

    def _offer(self) -> Dict[str, Any]:
        """What this rank has, by listing (verified later, only for the
        step chosen): its own steps, the replicas it holds, the shared or
        object tier's steps."""
        remote: List[int] = []
        names = _listing(self.directory)
        self._refresh_others(names)
        try:
            found = _scan_store(self.store) if self.store is not None else _scan(self.stage_dir, "shared")
            remote = sorted(s for s in found if not self._held_back(s))
        except OSError as e:
            log.warning("fastpersist: cannot list %s: %s", self.stage_url, e)
        held: Dict[int, List[int]] = {}
        if self._ring is not None:
            for src in self._ring.sources():
                held[src] = sorted(_scan(replica_dir(self.directory, src), "peer"))
        ring = self._ring
        return {
            "rank": ring.rank if ring is not None else None,
            "replicate": self.replicate,
            "local": sorted(_scan(self.directory, "local", names=names)),
            "held": held,
            "remote": remote,
        }

    @staticmethod
    def _common_step(offers: List[Dict[str, Any]], excluded: Set[int]) -> Optional[int]:
        held_for: Dict[Any, Set[int]] = {}
        for o in offers:
            for src, steps in o["held"].items():
                held_for.setdefault(src, set()).update(steps)
        common: Optional[Set[int]] = None
        for o in offers:
            can = set(o["local"]) | held_for.get(o["rank"], set()) | set(o["remote"])
            common = can if common is None else common & can
        common = (common or set()) - excluded
        return max(common) if common else None

    @overload
    def _group_restore(self, verify: bool, load: None) -> Optional[CheckpointInfo]: ...

    @overload
    def _group_restore(self, verify: bool, load: Dict[str, Any]) -> Optional[Tuple[int, Any]]: ...

    def _group_restore(
        self, verify: bool, load: Optional[Dict[str, Any]]
    ) -> Union[CheckpointInfo, Tuple[int, Any], None]:
        """Agree on the newest step every rank can obtain, obtain it, and
        (``load``: read_state_dict's arguments) load it; a step that some
        rank fails to obtain or load is dropped and the next one tried.
        Collective over the group."""
        excluded: Set[int] = set()
        for _ in range(_RELIST):
            offers = gather(self._offer(), self._ctl)
            if len({o["replicate"] for o in offers}) != 1:
                raise ValueError(
                    f"the ranks of the group were given different replicate= values: {[o['replicate'] for o in offers]}"
                )
            step = self._common_step(offers, excluded)
            if step is None:
                return None
            info, err = self._obtain(step, offers, verify)
            out: Union[CheckpointInfo, Tuple[int, Any], None] = info
            raised: Optional[Exception] = None
            if info is not None and load is not None:
                try:
                    payload = read_state_dict(info.path, **load)
                    out = _unpack(payload, info.path)
                except (FastPersistError, OSError) as e:
                    err = f"{info.path} does not load: {e}"
                except Exception as e:  # noqa: BLE001 - not damage (weights_only refusing a class): every rank raises
                    raised = e
                    err = {"raised": f"{type(e).__name__}: {e}"}
            errors = gather(err, self._ctl)
            if all(e is None for e in errors):
                with self._lock:
                    self._agreed.add(step)  # obtained (and verified) on every rank: it counts for retention
                return out
            fatal = [(r, e["raised"]) for r, e in enumerate(errors) if isinstance(e, dict)]
            if fatal:
                # The same error on every rank, so all can handle it alike
                # (retry with other arguments) and none is left waiting.
                said = "; ".join(f"rank {r}: {m}" for r, m in fatal)
                raise DistributedCheckpointError(f"step {step} cannot be loaded ({said})") from raised
            bad = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None)
            log.warning("fastpersist: step %d cannot be restored on every rank (%s); trying an older one", step, bad)
            excluded.add(step)
        return None

    def _obtain(self, step: int, offers: List[Dict[str, Any]], verify: bool) -> Tuple[Optional[CheckpointInfo], Any]:
        """Make ``step`` available here: the local copy if it is whole, else
        from a replica holder (collective: every rank takes part in the
        transfers, in the same order), else from the shared or object tier.
        Returns (its info, None) or (None, why not)."""
        local = os.path.join(self.directory, ckpt_name(step))
        mine: Optional[CheckpointInfo] = None
        try:
            if verify:
                verify_checkpoint(local)
            mine = CheckpointInfo(step, local, "local", os.path.getsize(local))
        except FileNotFoundError:
            pass
        except (FastPersistError, OSError) as e:
            log.warning("fastpersist: %s is damaged: %s", local, e)
        ring = self._ring
        if ring is not None:
            mine = self._from_peers(ring, step, offers, mine)
        if mine is None:
            mine = self._from_remote(step, verify)
        if mine is None:
            return None, f"step {step} is neither here, nor on a peer, nor in the shared or object tier"
        return mine, None

    def _from_peers(
        self, ring: Ring, step: int, offers: List[Dict[str, Any]], mine: Optional[CheckpointInfo]
    ) -> Optional[CheckpointInfo]:
        """The transfers of a group restore (collective): each rank without
        ``step`` fetches it from its first holder that has it; one whose
        fetch fails tries the next holder in another round (every rank
        decides the rounds from the same gathered facts, so all take part
        in the same transfers, in the same order)."""
        held = {o["rank"]: o["held"] for o in offers}
        holders = {r: [h for h in ring.holders_of(r) if step in held.get(h, {}).get(r, ())] for r in ring.ranks}
        for attempt in range(max((len(h) for h in holders.values()), default=0)):
            needs = gather(mine is None, self._ctl)
            tries = [
                (r, holders[r][attempt]) for r, need in zip(ring.ranks, needs) if need and attempt < len(holders[r])
            ]
            if not tries:
                break
            for r, holder in tries:
                if ring.rank == holder:
                    try:
                        exchange(
                            self._ctl,
                            send_to=r,
                            send_step=step,
                            send_path=self._replica_target(r, step),
                        )
                    except ReplicaError as e:
                        log.warning("fastpersist: sending the replica of step %d to rank %d failed: %s", step, r, e)
                elif ring.rank == r:
                    mine = self._from_peer(step, holder)
        return mine

    def _from_peer(self, step: int, holder: int) -> Optional[CheckpointInfo]:
        local = os.path.join(self.directory, ckpt_name(step))
        try:
            _, got = exchange(self._ctl, recv_from=holder, recv_target=lambda s: local if s == step else None)
        except ReplicaError as e:
            log.warning("fastpersist: fetching step %d from rank %d failed: %s", step, holder, e)
            return None
        if got is None or got.path is None:
            why = got.error if got is not None else "nothing received"
            log.warning("fastpersist: rank %d could not restore step %d: %s", holder, step, why)
            return None
        with self._lock:
            self._mark_valid(local)
        self._log_event(
            {
                "event": "fetched",
                "step": step,
                "path": local,
                "from_rank": holder,
                "bytes": got.bytes,
                "seconds": got.seconds,
                "gbps": got.gbps,
                "tier": "peer",
            }
        )
        return CheckpointInfo(step, local, "local", got.bytes)

    def _from_remote(self, step: int, verify: bool) -> Optional[CheckpointInfo]:
        self._refresh_others()
        if self._held_back(step):
            return None  # (the staging tier's copy is the run this one went back on's)
        if self.store is not None:
            try:
                remote = _scan_store(self.store).get(step)
            except OSError as e:
                log.warning("fastpersist: cannot list %s: %s", self.stage_url, e)
                return None
            if remote is None:
                return None
            try:
                return self._fetch(remote, raise_unavailable=False)
            except FileNotFoundError as e:  # (gone since the listing)
                log.warning("fastpersist: cannot restore %s: %s", remote.path, e)
                return None
        if self.stage_dir is None:
            return None
        shared = os.path.join(self.stage_dir, ckpt_name(step))
        try:
            if verify:
                verify_checkpoint(shared)
            return CheckpointInfo(step, shared, "shared", os.path.getsize(shared))
        except (FastPersistError, OSError) as e:
            log.warning("fastpersist: skipping %s: %s", shared, e)
            return None

    def _fetch(self, c: CheckpointInfo, raise_unavailable: bool = True) -> Optional[CheckpointInfo]:
        """Download an object-tier checkpoint into the local directory (its
        CRCs verified before it replaces a damaged local copy); the local
        copy's info, or None when it is damaged. FileNotFoundError when it
        is gone since the listing (the caller lists again). A store that
        fails to answer is asked ``FETCH_TRIES`` times, then its TierError
        is raised (with ``raise_unavailable``; else None): taking an older
        checkpoint for it would resume the run from there, and its next
        save would set the newer progress aside as abandoned."""
        assert self.store is not None
        local = os.path.join(self.directory, ckpt_name(c.step))
        for attempt in range(FETCH_TRIES):
            try:
                st = self.store.download(ckpt_name(c.step), local, require_identity=False)
                break
            except CorruptCheckpointError as e:
                log.warning("fastpersist: cannot restore %s: %s", c.path, e)
                return None
            except TierError as e:
                log.warning("fastpersist: cannot restore %s (try %d of %d): %s", c.path, attempt + 1, FETCH_TRIES, e)
                if attempt + 1 == FETCH_TRIES:
                    if raise_unavailable:
                        raise
                    return None
                time.sleep(FETCH_BACKOFF * 2**attempt)
        else:  # pragma: no cover - the loop breaks or returns
            return None
        with self._lock:
            self._mark_valid(local)
        self._log_event(
            {
                "event": "fetched",
                "step": c.step,
                "path": c.path,
                "bytes": st.bytes,
                "seconds": st.seconds,
                "tier": "object",
            }
        )
        return CheckpointInfo(c.step, local, "local", st.bytes)

    # -- telemetry -----------------------------------------------------------

    def _log_transfer(self, event: str, step: int, src: Optional[str], seconds: float, tier: str, **extra: Any) -> None:
        """Telemetry of one copy of checkpoint ``step`` (the local file
        ``src``) to another tier: bytes, seconds, GB/s and how far the tier
        is behind (steps from this checkpoint to the newest one committed
        locally when the copy got there)."""
        size = os.path.getsize(src) if src and os.path.exists(src) else None
        ev: Dict[str, Any] = {"event": event, "step": step, **extra}
        ev.update(
            seconds=seconds,
            bytes=size,
            gbps=size / seconds / 1e9 if size and seconds > 0 else None,
            lag_steps=max(_scan(self.directory, "local"), default=step) - step,
            tier=tier,
        )
        self._log_event(ev)

    def _log_event(self, ev: Dict[str, Any]) -> None:
        """Append ``ev`` to ``checkpoints.jsonl``. Telemetry never fails a
        checkpoint nor the training loop: on a directory that has become
        read-only or full the line is dropped, with one warning per errno."""
        ev = {"time": time.time(), **ev}
        path = os.path.join(self.directory, LOG_NAME)
        with self._lock:
            try:
                # Not through a link, nor into a FIFO or device: the log is
                # this Checkpointer's own file.
                flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                fd = os.open(path, flags, 0o666)
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    os.close(fd)
                    raise OSError(errno.EINVAL, "not a regular file", path)
                with open(fd, "a+b") as f:
                    # A line cut short (a crash mid-append) is ended first:
                    # this event stays a line of its own.
                    torn = f.tell() > 0 and f.seek(-1, os.SEEK_END) >= 0 and f.read(1) != b"\n"
                    f.write((b"\n" if torn else b"") + json.dumps(ev).encode() + b"\n")
            except OSError as e:
                if e.errno not in self._log_errors:
                    self._log_errors.add(e.errno)
                    log.warning("fastpersist: cannot write the checkpoint log %s (%s); events are dropped", path, e)


#: Every live Checkpointer, for the reset in a fork child.
_checkpointers: weakref.WeakSet[Checkpointer] = weakref.WeakSet()

#: Checkpointers with a save in flight (by id), kept alive until it is
#: done: one dropped without close() as its save runs still logs, retains
#: and stages it if the process exits meanwhile (and lets go of its
#: directory once done).
_saving: Dict[int, Checkpointer] = {}


def _after_fork_in_child() -> None:
    for ck in list(_checkpointers):
        ck._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _finish_at_exit() -> None:
    """Checkpointers not closed at exit: each one's checkpoint in flight is
    committed as close() would, logged, retained and staged (registered
    after ``async_save``'s drain, so it runs before it)."""
    for ck in list(_checkpointers):  # (those with a save in flight among them: kept alive)
        try:
            ck._at_exit()
        except KeyboardInterrupt:
            log.error("fastpersist: interrupted at exit: the Checkpointer on %s was not finished", ck.directory)
            return  # (the saves in flight are the drain's)
        except Exception as e:  # noqa: BLE001 - logged: the process is ending
            log.error("fastpersist: finishing the Checkpointer on %s at exit failed: %r", ck.directory, e)


register_exit(_finish_at_exit)
