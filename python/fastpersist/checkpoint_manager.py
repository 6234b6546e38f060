"""The checkpoint manager: when to checkpoint, what to keep, where it lives.

``Checkpointer(directory, keep_last=3, keep_every=None, every="auto",
max_overhead=0.035, stage_dir=None, mode="pipelined")``:

* ``step(step, state)`` once per iteration decides whether this iteration
  checkpoints (a fixed interval, or CheckFreq-style online tuning that keeps
  the measured overhead under ``max_overhead``) and starts an asynchronous
  save. In pipelined mode call ``fence()`` before ``optimizer.step()``.
* Each checkpoint (``ckpt-<step>.pt``, holding ``{"step", "state"}``) becomes
  visible only by its atomic commit. ``latest()`` is the newest one whose
  checksums verify (a damaged one is skipped); ``load_latest()`` restores it.
  Temporary files of crashed saves are removed when a Checkpointer starts.
* Retention keeps the last ``keep_last`` and every ``keep_every``-th step,
  deletes only after a newer checkpoint is committed (and, with staging, has
  reached the shared tier), and never deletes the newest valid checkpoint.
* With ``stage_dir``, committed checkpoints are copied in the background to
  that (shared) directory with the same temp/fsync/rename/fsync commit, with
  retention on each tier; ``latest()`` prefers a valid local copy.
* Telemetry per checkpoint (stall, write time, bytes, GB/s) goes to the
  ``fastpersist`` logger and to ``checkpoints.jsonl`` in the directory.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from . import _core
from .async_save import AsyncSaver, CheckpointFuture
from .errors import CorruptCheckpointError
from .reader import read_state_dict, verify_file

__all__ = ["Checkpointer", "CheckpointInfo", "FrequencyTuner", "list_checkpoints", "clean_temp_files"]

log = logging.getLogger("fastpersist")
CKPT_RE = re.compile(r"^ckpt-(\d+)\.pt$")
LOG_NAME = "checkpoints.jsonl"


def ckpt_name(step: int) -> str:
    return f"ckpt-{step:012d}.pt"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    tier: str  # "local" or "shared"
    bytes: int


def _scan(directory: Optional[str], tier: str) -> Dict[int, CheckpointInfo]:
    out: Dict[int, CheckpointInfo] = {}
    if not directory or not os.path.isdir(directory):
        return out
    for name in os.listdir(directory):
        m = CKPT_RE.match(name)
        if m:
            p = os.path.join(directory, name)
            try:
                size = os.path.getsize(p)
            except OSError:
                continue
            out[int(m.group(1))] = CheckpointInfo(int(m.group(1)), p, tier, size)
    return out


def list_checkpoints(directory: str, stage_dir: Optional[str] = None) -> List[Tuple[int, List[CheckpointInfo]]]:
    """Committed checkpoints by step (newest first), each with its copies."""
    local, shared = _scan(directory, "local"), _scan(stage_dir, "shared")
    steps = sorted(set(local) | set(shared), reverse=True)
    return [(s, [c for c in (local.get(s), shared.get(s)) if c is not None]) for s in steps]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_temp_files(directory: str) -> List[str]:
    """Remove temporary files of saves whose process is gone; returns them."""
    removed = []
    if not os.path.isdir(directory):
        return removed
    marker = _core.TEMP_MARKER
    for name in os.listdir(directory):
        if not name.endswith(marker):
            continue
        parts = name[: -len(marker)].split(".")
        try:
            pid = int(parts[-2])
        except (IndexError, ValueError):
            pid = -1
        if pid == os.getpid() or (pid > 0 and _pid_alive(pid)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


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
       mean iteration time between two checkpoints over the baseline, scales
       the interval up when it exceeds ``max_overhead`` (and back down,
       gently, when it is well under).
    4. *Re-profile* every ``reprofile_every`` checkpoints, so the baseline
       follows drift in the iteration time itself.
    """

    def __init__(self, every: Union[str, int] = "auto", max_overhead: float = 0.035,
                 profile_steps: int = 3, max_interval: int = 100_000, reprofile_every: int = 25) -> None:
        if every != "auto" and not (isinstance(every, int) and every >= 1):
            raise ValueError(f"every must be 'auto' or a positive int, not {every!r}")
        if not 0 < max_overhead < 1:
            raise ValueError("max_overhead must be in (0, 1)")
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

    def record_iteration(self, seconds: float, affected: bool) -> None:
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

    def record_checkpoint(self, cost: float, write_seconds: float) -> None:
        a = 0.5
        self.cost = cost if self.cost is None else (1 - a) * self.cost + a * cost
        self.write_time = write_seconds if self.write_time is None else (1 - a) * self.write_time + a * write_seconds
        self._retune()

    def _retune(self) -> None:
        if not self.auto or not self.clean_time or self.cost is None:
            return
        t = self.clean_time
        k_overhead = math.ceil(max(self.cost, 0.0) / (self.max_overhead * t) - 1e-9)
        k_write = math.ceil((self.write_time or 0.0) / t - 1e-9)
        self._model_interval = max(1, k_overhead)
        k = max(math.ceil(self._model_interval * self._scale - 1e-9), k_write, 1)
        self.interval = int(min(self.max_interval, k))

    def _feedback(self) -> None:
        """Called when a checkpoint is issued: judge the window since the last."""
        if self._window_n and self.baseline:
            achieved = (self._window_sum / self._window_n) / self.baseline - 1.0
            a = 0.5
            self.observed_overhead = achieved if self.observed_overhead is None else \
                (1 - a) * self.observed_overhead + a * achieved
            o = self.observed_overhead
            if o > self.max_overhead:
                self._scale = min(self._scale * min(o / self.max_overhead, 4.0), float(self.max_interval))
            elif o < 0.5 * self.max_overhead:
                self._scale = max(1.0, self._scale * 0.8)
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
            return True
        if self._since_last >= self.interval:
            self._since_last = 0
            if self.auto:
                self._feedback()
                self._checkpoints += 1
                if self.reprofile_every and self._checkpoints % self.reprofile_every == 0:
                    self._profiling, self._profiled = True, 0
            return True
        return False


@dataclass
class _InFlight:
    step: int
    future: CheckpointFuture
    issued_at: float
    stall: float
    extra: float = 0.0


class Checkpointer:
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
        **options: Any,
    ) -> None:
        if keep_last < 1:
            raise ValueError("keep_last must be at least 1 (the newest checkpoint is always kept)")
        if keep_every is not None and keep_every < 1:
            raise ValueError("keep_every must be a positive int")
        self.directory = os.fspath(directory)
        self.stage_dir = os.fspath(stage_dir) if stage_dir is not None else None
        os.makedirs(self.directory, exist_ok=True)
        if self.stage_dir:
            os.makedirs(self.stage_dir, exist_ok=True)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.mode = mode
        self.options = options
        self.clock = clock
        self.tuner = FrequencyTuner(every, max_overhead)
        self._saver = AsyncSaver(max_pending=2)
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="fastpersist-stage") if self.stage_dir else None
        self._lock = threading.RLock()
        self._inflight: Optional[_InFlight] = None
        self._last_step_at: Optional[float] = None
        self._staged: set = set(_scan(self.stage_dir, "shared"))
        self._stage_futures: List[Any] = []
        for d in filter(None, (self.directory, self.stage_dir)):
            for name in clean_temp_files(d):
                log.warning("fastpersist: removed %s, left by a save that did not finish", os.path.join(d, name))

    # -- the training loop -------------------------------------------------

    def step(self, step: int, state: Any) -> Optional[CheckpointFuture]:
        """Call once per iteration (after ``optimizer.step()``); returns the
        save's future when this iteration checkpoints."""
        now = self.clock()
        if self._last_step_at is not None:
            dur = now - self._last_step_at
            fl = self._inflight
            self.tuner.record_iteration(dur, affected=fl is not None)
            if fl is not None and self.tuner.clean_time is not None:
                fl.extra += max(0.0, dur - self.tuner.clean_time)
        self._poll()
        fut = None
        if self.tuner.should_checkpoint():
            fut = self._start(step, state)
        self._last_step_at = self.clock()
        return fut

    def pause(self) -> None:
        """Call after a break in training (evaluation, a stall in data
        loading) so the break is not measured as an iteration."""
        self._last_step_at = None

    def fence(self) -> None:
        """Wait until the checkpoint in flight has left the tensors; call it
        before ``optimizer.step()`` (pipelined mode)."""
        fl = self._inflight
        if fl is not None:
            t = self.clock()
            fl.future.wait_snapshot()
            fl.stall += self.clock() - t

    def save(self, step: int, state: Any) -> CheckpointFuture:
        """Checkpoint now, whatever the interval."""
        return self._start(step, state)

    def _start(self, step: int, state: Any) -> CheckpointFuture:
        t0 = self.clock()
        if self._inflight is not None:
            # One checkpoint at a time: the previous must be committed first.
            self._finish(self._inflight, wait=True)
        path = os.path.join(self.directory, ckpt_name(step))
        fut = self._saver.save({"step": step, "state": state}, path, mode=self.mode, **self.options)
        self._inflight = _InFlight(step, fut, t0, self.clock() - t0)
        return fut

    def _poll(self) -> None:
        fl = self._inflight
        if fl is not None and fl.future.done():
            self._finish(fl, wait=False)

    def _finish(self, fl: _InFlight, wait: bool, tune: bool = True) -> None:
        t = self.clock()
        exc = fl.future.exception() if wait else fl.future.exception(timeout=0)
        waited = self.clock() - t
        self._inflight = None
        if exc is not None:
            log.error("fastpersist: checkpoint of step %d failed: %r", fl.step, exc)
            self._log_event({"event": "failed", "step": fl.step, "error": repr(exc)})
            return
        st = fl.future.result()
        stall = fl.stall + waited
        if tune:  # not when drained by wait()/close(): no iteration ran beside it
            write_s = fl.future.total_seconds if fl.future.total_seconds is not None else st.seconds
            self.tuner.record_checkpoint(max(fl.extra, stall), write_s)
        log.info("fastpersist: checkpoint step %d: %d bytes, stall %.1f ms, write %.3f s (%.2f GB/s), interval %d",
                 fl.step, st.bytes, stall * 1e3, st.seconds, st.gbps, self.tuner.interval)
        self._log_event({"event": "commit", "step": fl.step, "path": st.path, "bytes": st.bytes,
                         "stall_s": stall, "write_s": st.seconds, "gbps": st.gbps, "tier": "local",
                         "interval": self.tuner.interval})
        if self._stager is not None:
            self._stage_futures.append(self._stager.submit(self._stage, fl.step, st.path))
        self._retain()

    def wait(self) -> None:
        """Wait for the checkpoint in flight and for staging to drain."""
        if self._inflight is not None:
            self._finish(self._inflight, wait=True, tune=False)
        for f in list(self._stage_futures):
            f.result()
        self._stage_futures.clear()

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.shutdown(wait=True)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- staging and retention ----------------------------------------------

    def _stage(self, step: int, src: str) -> None:
        assert self.stage_dir is not None
        dst = os.path.join(self.stage_dir, ckpt_name(step))
        tmp = os.path.join(self.stage_dir, f".{ckpt_name(step)}.{os.getpid()}.{threading.get_ident()}{_core.TEMP_MARKER}")
        t0 = time.perf_counter()
        try:
            with open(src, "rb") as fi, open(tmp, "wb") as fo:
                shutil.copyfileobj(fi, fo, 8 << 20)
                fo.flush()
                os.fsync(fo.fileno())
            os.rename(tmp, dst)
            dfd = os.open(self.stage_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except BaseException as e:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            log.error("fastpersist: staging step %d to %s failed: %r", step, self.stage_dir, e)
            self._log_event({"event": "stage_failed", "step": step, "error": repr(e)})
            return
        with self._lock:
            self._staged.add(step)
        self._log_event({"event": "staged", "step": step, "path": dst, "seconds": time.perf_counter() - t0,
                         "tier": "shared"})
        self._retain()

    def _keep(self, steps: List[int]) -> set:
        steps = sorted(steps, reverse=True)
        keep = set(steps[: self.keep_last])
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        return keep

    def _retain(self) -> None:
        with self._lock:
            local = _scan(self.directory, "local")
            staged = set(self._staged)
            newest_local = max(local, default=None)
            keep = self._keep(list(local))
            for s, info in local.items():
                if s in keep or newest_local is None or s >= newest_local:
                    continue
                # With staging, a local copy goes only once it (or a newer
                # checkpoint) has reached the shared tier.
                if self.stage_dir and not any(x >= s for x in staged):
                    continue
                self._delete(info)
            if self.stage_dir:
                shared = _scan(self.stage_dir, "shared")
                keep_s = self._keep(list(shared))
                newest_shared = max(shared, default=None)
                for s, info in shared.items():
                    if s in keep_s or newest_shared is None or s >= newest_shared:
                        continue
                    self._delete(info)
                    self._staged.discard(s)

    def _delete(self, info: CheckpointInfo) -> None:
        try:
            os.unlink(info.path)
        except FileNotFoundError:
            return
        self._log_event({"event": "deleted", "step": info.step, "path": info.path, "tier": info.tier})

    # -- restore -------------------------------------------------------------

    def checkpoints(self) -> List[Tuple[int, List[CheckpointInfo]]]:
        return list_checkpoints(self.directory, self.stage_dir)

    def latest(self, verify: bool = True) -> Optional[CheckpointInfo]:
        """The newest committed checkpoint whose checksums verify (local copy
        first, else the shared one); damaged copies are skipped."""
        for _, copies in self.checkpoints():
            for c in copies:
                if not verify:
                    return c
                try:
                    verify_file(c.path)
                    return c
                except (CorruptCheckpointError, OSError) as e:
                    log.warning("fastpersist: skipping damaged checkpoint %s: %s", c.path, e)
        return None

    def load_latest(self, *, map_location: Any = None, weights_only: bool = True) -> Optional[Tuple[int, Any]]:
        """``(step, state)`` of the newest checkpoint that loads and verifies,
        or None when there is none."""
        for _, copies in self.checkpoints():
            for c in copies:
                try:
                    payload = read_state_dict(c.path, map_location=map_location, weights_only=weights_only)
                    return int(payload["step"]), payload["state"]
                except (CorruptCheckpointError, OSError, KeyError, TypeError) as e:
                    log.warning("fastpersist: skipping damaged checkpoint %s: %s", c.path, e)
        return None

    # -- telemetry -----------------------------------------------------------

    def _log_event(self, ev: Dict[str, Any]) -> None:
        ev = {"time": time.time(), **ev}
        with self._lock:
            with open(os.path.join(self.directory, LOG_NAME), "a") as f:
                f.write(json.dumps(ev) + "\n")
