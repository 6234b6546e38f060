"""The checkpoint manager: retention, tiers, crash safety, tuning, resume."""

from __future__ import annotations

import errno
import json
import math
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import time
from typing import Optional, Tuple

import fastpersist
import pytest
import torch
from fastpersist.checkpoint_manager import FrequencyTuner, ckpt_name
from helpers import cli_exe, small_tmpfs
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st


def state(i: int) -> dict:
    return {"w": torch.full((1000,), float(i)), "i": i}


def steps_in(d) -> list:
    return sorted(int(n[5:-3]) for n in os.listdir(d) if n.startswith("ckpt-") and n.endswith(".pt"))


def test_fixed_interval_and_retention(tmp_path):
    with fastpersist.Checkpointer(tmp_path, every=1, keep_last=2, keep_every=5) as ck:
        for s in range(1, 13):
            ck.fence()
            ck.step(s, state(s))
    assert steps_in(tmp_path) == [5, 10, 11, 12]
    step, st_ = fastpersist.Checkpointer(tmp_path).load_latest()
    assert step == 12 and st_["i"] == 12 and torch.all(st_["w"] == 12)
    with fastpersist.Checkpointer(tmp_path / "b", every=3, keep_last=10) as ck:
        for s in range(1, 10):
            ck.step(s, state(s))
    assert steps_in(tmp_path / "b") == [3, 6, 9]


def test_a_look_at_the_checkpoints_lists_the_directory_once(tmp_path, monkeypatch):
    """Regression: ``checkpoints()`` listed the local directory twice (for
    records of going back, then for the checkpoints), and so did the
    stager before each stage: each listing is a round trip on a network
    file system."""
    local, shared = tmp_path / "local", tmp_path / "shared"
    with fastpersist.Checkpointer(local, every=1, keep_last=2, stage_dir=shared) as ck:
        ck.save(1, state(1)).result()
        ck.wait()
        listed = []
        real = os.listdir

        def counting(d="."):
            listed.append(os.path.realpath(d))
            return real(d)

        monkeypatch.setattr(os, "listdir", counting)
        ck.checkpoints()
        assert listed.count(os.path.realpath(local)) == 1
        del listed[:]
        ck._settle_going_back(2)
        assert listed.count(os.path.realpath(local)) == 1
    monkeypatch.undo()
    assert [s for s, _ in fastpersist.Checkpointer(local, stage_dir=shared).checkpoints()] == [1]


@pytest.mark.parametrize("mode", ["pipelined", "snapshot"])
def test_a_failed_checkpoint_does_not_stop_the_loop_at_its_fence(tmp_path, engine_fault, mode, caplog, monkeypatch):
    """Regression (found in a hunt): in pipelined mode (the default) the
    fence waits for the write (of a checkpoint larger than the arena), and
    a failed write (ENOSPC, EIO, a read-only file system) was raised from
    ``fence()`` into the training loop; a Checkpointer logs a failed
    checkpoint and goes on."""
    from fastpersist.options import EngineOptions, get_engine

    monkeypatch.setenv("FASTPERSIST_ARENA_BYTES", str(4 << 20))
    with fastpersist.Checkpointer(tmp_path, every=1, keep_last=5, mode=mode) as ck:
        for s in range(1, 4):
            if s == 2:
                ck.wait()
                engine_fault(4 << 20, errno.EIO)
            ck.step(s, {"w": torch.full((4 << 20,), float(s))})
            ck.fence()  # the documented loop: before optimizer.step()
            if s == 2:
                ck.wait()
                get_engine(EngineOptions.resolve())[1].set_fault(None)
    assert steps_in(tmp_path) == [1, 3]
    assert "checkpoint of step 2 failed" in caplog.text


def test_latest_skips_damaged_and_cleans_temp_files(tmp_path):
    with fastpersist.Checkpointer(tmp_path, every=1, keep_last=5) as ck:
        for s in range(1, 4):
            ck.step(s, state(s))
    newest = tmp_path / ckpt_name(3)
    raw = bytearray(newest.read_bytes())
    raw[4096 + 100] ^= 0xFF
    newest.write_bytes(bytes(raw))
    leftover = tmp_path / f".{ckpt_name(4)}.999999999.0.fptmp"
    record = tmp_path / "..went-back-4.json.999999999.1.fptmp"  # a record of going back, cut short
    for p in (leftover, record):
        p.write_bytes(b"partial")
        os.utime(p, (time.time() - 86400, time.time() - 86400))  # left by a save long ago
    ck = fastpersist.Checkpointer(tmp_path)
    assert not leftover.exists() and not record.exists()
    assert ck.latest().step == 2
    step, st_ = ck.load_latest()
    assert step == 2 and st_["i"] == 2


def test_staging_to_shared_tier(tmp_path):
    local, shared = tmp_path / "local", tmp_path / "shared"
    with fastpersist.Checkpointer(local, every=1, keep_last=2, stage_dir=shared) as ck:
        for s in range(1, 6):
            ck.step(s, state(s))
    assert steps_in(local) == [4, 5] and steps_in(shared) == [4, 5]
    ck = fastpersist.Checkpointer(local, stage_dir=shared)
    assert ck.latest().tier == "local"
    os.unlink(local / ckpt_name(5))
    info = ck.latest()
    assert info.step == 5 and info.tier == "shared"
    assert ck.load_latest()[0] == 5
    lines = (local / "checkpoints.jsonl").read_text().splitlines()
    assert any('"staged"' in line for line in lines) and any('"commit"' in line for line in lines)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small file system")
def test_a_shared_tier_with_room_for_keep_last_checkpoints_goes_on_taking_them(tmp_path):
    """Regression: a shared tier with room for ``keep_last`` checkpoints
    and not one more failed every copy after it filled (ENOSPC), for ever:
    its retention ran only after a copy that succeeded, and the local
    copies it had not taken were kept, so the local disk filled too. Now a
    copy that finds the tier full first removes what the copy would retire
    there (never the newest valid one) and is tried again."""
    sd = lambda i: {"w": torch.full((1 << 18,), float(i)), "i": i}  # noqa: E731 - 1 MiB
    local = tmp_path / "local"
    with small_tmpfs(tmp_path, size="2600k") as shared:
        with fastpersist.Checkpointer(local, every=1, keep_last=2, stage_dir=shared) as ck:
            for s in range(1, 7):
                ck.step(s, sd(s))
                ck.fence()
                for f in ck._stage_futures:
                    f.result(timeout=60)
        assert steps_in(shared) == [5, 6]
        assert steps_in(local) == [5, 6]
        ck = fastpersist.Checkpointer(local, stage_dir=shared)
        os.unlink(local / ckpt_name(6))
        step, got = ck.load_latest()
        assert step == 6 and got["i"] == 6 and torch.equal(got["w"], sd(6)["w"])
    events = [json.loads(line) for line in (local / "checkpoints.jsonl").read_text().splitlines()]
    assert not [e for e in events if e.get("event") == "stage_failed"]


def test_a_checkpointer_left_open_at_exit_commits_stages_and_retains_its_last_checkpoint(tmp_path):
    """Regression: a Checkpointer never closed left its last save to the
    saver's drain at exit: the file was committed, but with no ``commit``
    line in its log, no retention (``keep_last`` exceeded) and no copy to
    the staging tier, which never had the run's last checkpoint."""
    local, shared = tmp_path / "local", tmp_path / "shared"
    script = textwrap.dedent(
        """
        import sys, torch, fastpersist
        ck = fastpersist.Checkpointer(sys.argv[1], every=1, keep_last=1, stage_dir=sys.argv[2])
        for s in range(1, 4):
            ck.step(s, {"w": torch.full((1000,), float(s)), "i": s})
        """
    )
    r = subprocess.run([sys.executable, "-c", script, str(local), str(shared)], capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    assert steps_in(local) == [3] and steps_in(shared) == [3]
    events = [json.loads(line) for line in (local / "checkpoints.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "commit"] == [1, 2, 3]
    assert 3 in [e["step"] for e in events if e["event"] == "staged"]


class _Renamed:
    """A class whose state no longer loads (changed since it was saved)."""

    def __init__(self):
        self.field = 1

    def __setstate__(self, state):
        raise KeyError("field renamed")


@pytest.mark.parametrize("how", ["map_location", "unpickle"])
def test_load_latest_raises_an_error_that_is_not_damage(tmp_path, how):
    """Regression: load_latest() took a KeyError, TypeError or IndexError
    for damage: a map_location that raised one skipped every valid
    checkpoint (None: a resume from scratch, whose first save set them all
    aside), and an object whose class changed made it load an older
    checkpoint without a word. Only damage (and I/O errors) is skipped."""
    with fastpersist.Checkpointer(tmp_path, every=1, keep_last=3) as ck:
        for s in (1, 2, 3):
            st_ = state(s)
            if how == "unpickle" and s == 3:
                st_["obj"] = _Renamed()
            ck.step(s, st_)
            ck.fence()
    ck = fastpersist.Checkpointer(tmp_path)
    with pytest.raises(KeyError):
        if how == "map_location":
            ck.load_latest(map_location=lambda storage, loc: storage.to({"cuda:0": "cpu"}[loc]))
        else:
            ck.load_latest(weights_only=False)
    assert steps_in(tmp_path) == [1, 2, 3]
    assert ck.latest().step == 3


def test_a_url_or_the_directory_itself_is_refused_where_a_local_directory_goes(tmp_path, monkeypatch):
    """Regression: Checkpointer("s3://bucket/run") wrote to a local folder
    ``./s3:/bucket/run``; a stage_dir that is the directory itself was
    taken (no second copy, each file listed as both tiers)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="local directory"):
        fastpersist.Checkpointer("s3://bucket/run")
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="stage_dir"):
        fastpersist.Checkpointer(tmp_path / "a", stage_dir=tmp_path / "a" / ".." / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    with pytest.raises(ValueError, match="stage_dir"):
        fastpersist.Checkpointer(tmp_path / "a", stage_dir=tmp_path / "b")


def test_keep_every_keeps_one_checkpoint_per_period_whatever_the_interval_s_phase(tmp_path):
    """Regression: keep_every kept only steps that are its multiples; a
    fixed interval counted from step 0 (every=5: steps 4, 9, 14, ...) or
    every="auto" never lands on them, so nothing was ever kept. The first
    checkpoint after each multiple is kept where the multiple was not
    checkpointed."""
    with fastpersist.Checkpointer(tmp_path / "a", every=5, keep_last=2, keep_every=10) as ck:
        for s in range(50):
            ck.fence()
            ck.step(s, state(s))
    assert steps_in(tmp_path / "a") == [14, 24, 34, 44, 49]
    with fastpersist.Checkpointer(tmp_path / "b", every=1, keep_last=1, keep_every=10) as ck:
        for s in range(1, 40, 3):  # 1, 4, 7, 10, 13, ...: 10 is checkpointed, 20 and 30 are not
            ck.fence()
            ck.step(s, state(s))
    assert steps_in(tmp_path / "b") == [10, 22, 31, 37]


def test_a_second_checkpointer_saving_into_a_directory_is_refused(tmp_path):
    """Regression: two Checkpointers saving into one directory (two jobs, or
    every rank given one path without group=) each took the other's newer
    checkpoints for a run it went back on and set them aside, and a reader
    found no checkpoint about one time in ten. The second one's first save
    is refused, naming the first; one that only reads is not."""
    first = fastpersist.Checkpointer(tmp_path, every=1)
    first.step(1, state(1))
    first.wait()
    second = fastpersist.Checkpointer(tmp_path, every=1)
    with pytest.raises(RuntimeError, match="another Checkpointer of this process .*close"):
        second.step(2, state(2))
    assert second.load_latest()[0] == 1  # reading is never refused
    first.fence()
    first.step(3, state(3))
    first.close()
    second.step(4, state(4))
    second.close()
    assert steps_in(tmp_path) == [1, 3, 4]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".abandoned")]


def test_a_checkpointer_dropped_with_a_save_in_flight_lets_go_of_its_directory_once_done(tmp_path):
    """Found in review: a Checkpointer dropped (no close()) with a save in
    flight was kept alive until the process exited, its directory's lock
    with it: every later Checkpointer there (a retry, a notebook cell run
    again) was refused."""
    import gc

    ck = fastpersist.Checkpointer(tmp_path, every=1)
    fut = ck.step(1, state(1))
    del ck
    fut.result(timeout=60)
    gc.collect()
    again = fastpersist.Checkpointer(tmp_path, every=1)
    again.fence()
    again.step(2, state(2))
    again.close()
    assert steps_in(tmp_path)[-1] == 2


def test_a_fork_after_close_leaves_the_childs_descriptors_alone(tmp_path):
    """Found in review: close() let go of the writer lock but kept its
    descriptor number; a fork after it closed that number again in the
    child, whatever the child had opened there since (here: a pipe)."""
    ck = fastpersist.Checkpointer(tmp_path, every=1)
    ck.step(1, state(1))
    ck.close()
    r, w = os.pipe()  # (may get the lock's old number)
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, b"ok")
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    os.close(w)
    assert os.WEXITSTATUS(status) == 0 and os.read(r, 2) == b"ok"
    os.close(r)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small file system")
def test_a_first_save_that_fills_the_disk_does_not_lock_the_directory_for_good(tmp_path):
    """Found in review: a writer lock whose holder's name could not be
    written (ENOSPC) kept its descriptor, unreleased: every later save,
    with room again, was refused as another Checkpointer's."""
    with small_tmpfs(tmp_path, size="256k") as mnt:
        filler = os.path.join(mnt, "filler")
        with open(filler, "wb") as f:
            try:
                f.write(b"x" * (1 << 20))
            except OSError:
                pass
        ck = fastpersist.Checkpointer(os.path.join(mnt, "ck"), every=1)
        with pytest.raises(Exception):
            ck.save(1, state(1)).result(timeout=60)
        os.unlink(filler)
        ck.save(2, state(2)).result(timeout=60)
        ck.close()
        assert steps_in(os.path.join(mnt, "ck")) == [2]


def test_a_thread_still_training_at_exit_is_not_finished_under_it(tmp_path):
    """Found in review: the exit hooks ran with threading's exit callbacks,
    before threads that are not daemons are joined: a thread still
    checkpointing then had its save finished under it by the main thread
    (commit lines twice, later copies made inline)."""
    script = textwrap.dedent(
        """
        import sys, threading, time, torch, fastpersist
        ck = fastpersist.Checkpointer(sys.argv[1], every=1, keep_last=100)
        def train():
            for s in range(1, 30):
                ck.fence()
                ck.step(s, {"w": torch.full((1 << 16,), float(s))})
                time.sleep(0.01)
            ck.close()
        threading.Thread(target=train).start()
        """
    )
    for _ in range(2):
        d = tmp_path / f"r{_}"
        r = subprocess.run([sys.executable, "-c", script, str(d)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        events = [json.loads(line) for line in (d / "checkpoints.jsonl").read_text().splitlines()]
        commits = [e["step"] for e in events if e["event"] == "commit"]
        assert commits == list(range(1, 30)), commits


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small file system")
def test_a_first_save_on_a_read_only_file_system_fails_as_a_save_not_the_loop(tmp_path, caplog):
    """Found in the final read: the writer lock's file could not be made on
    a read-only file system, and that raised out of step(): a failed
    checkpoint must be logged, and the loop go on."""
    with small_tmpfs(tmp_path) as mnt:
        d = os.path.join(mnt, "ck")
        os.mkdir(d)
        subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
        ck = fastpersist.Checkpointer(d, every=1)
        fut = ck.step(1, state(1))  # no exception here
        with pytest.raises(OSError):
            fut.result(timeout=60)
        ck.close()
        subprocess.run(["mount", "-o", "remount,rw", mnt], check=True)


def test_tuner_with_a_fake_clock():
    t = FrequencyTuner("auto", max_overhead=0.035, profile_steps=3)
    for _ in range(6):  # 3 to settle, 3 measured
        assert not t.should_checkpoint()
        t.record_iteration(1.0, affected=False)
    assert t.should_checkpoint()  # the profiling checkpoint
    assert t.baseline == 1.0
    t.record_checkpoint(cost=0.35, write_seconds=2.0)
    assert t.interval == 10  # 0.35 / (0.035 * 1.0)
    t.record_checkpoint(cost=1.05, write_seconds=2.0)  # drift: EMA cost 0.7
    assert t.interval == 20
    t.record_checkpoint(cost=0.01, write_seconds=30.0)  # cheap but slow to write
    assert t.interval >= 16  # EMA write time 16 s: the next save must not queue
    fixed = FrequencyTuner(4)
    assert [fixed.should_checkpoint() for _ in range(8)] == [False, False, False, True] * 2
    with pytest.raises(ValueError):
        FrequencyTuner(0)


@pytest.mark.parametrize("max_overhead", [5e-324, 1e-320, 1e-300])
def test_a_tiny_max_overhead_gives_the_longest_interval(max_overhead):
    """Regression: a max_overhead so small that cost / (max_overhead x
    iteration) divided by zero or overflowed raised ZeroDivisionError or
    OverflowError out of every later step() (its checkpoints neither
    logged nor retained)."""
    t = FrequencyTuner("auto", max_overhead=max_overhead, profile_steps=3)
    for _ in range(6):
        t.should_checkpoint()
        t.record_iteration(1.0, affected=False)
    assert t.should_checkpoint()
    t.record_checkpoint(cost=0.35, write_seconds=2.0)
    assert t.interval == t.max_interval


def test_auto_interval_in_a_loop_with_fake_clock(tmp_path):
    now = [0.0]
    ck = fastpersist.Checkpointer(tmp_path, every="auto", max_overhead=0.05, clock=lambda: now[0])
    saved = []
    for s in range(60):
        now[0] += 1.0  # one second an iteration...
        if ck._inflight is not None:
            now[0] += 0.2  # ...plus 0.2 s while a save is in flight
        f = ck.step(s, state(s))
        if f is not None:
            saved.append(s)
            f.result()  # done in real time; the manager notices at the next step
    ck.close()
    gaps = [b - a for a, b in zip(saved, saved[1:])]
    # (the interval the last gap was taken at, or one step of the feedback from it)
    assert saved and ck.tuner.interval >= 4 and abs(gaps[-1] - ck.tuner.interval) <= 1, (saved, ck.tuner.interval)


def test_feedback_catches_costs_the_model_misses(tmp_path):
    """Each save slows the iteration it overlaps by 0.2 s and the next three
    by 0.1 s each (contention the in-flight cost model does not see). The
    feedback must raise the interval until the achieved overhead is within
    the bound."""
    now = [0.0]
    ck = fastpersist.Checkpointer(tmp_path, every="auto", max_overhead=0.035, clock=lambda: now[0], keep_last=1)
    since = 100
    durations = []
    for s in range(2000):
        since += 1
        extra = 0.2 if since == 1 else (0.1 if since <= 4 else 0.0)
        now[0] += 1.0 + extra
        durations.append(1.0 + extra)
        f = ck.step(s, {"i": s})
        if f is not None:
            since = 0
            f.result()
    ck.close()
    tail = durations[-600:]
    achieved = sum(tail) / len(tail) - 1.0
    assert ck.tuner.interval >= 13, ck.tuner.interval  # the model alone says 6
    assert achieved <= 0.035 * 1.15, achieved


def _simulate_tuner(
    seed: int,
    linger: float,
    n: int = 20000,
    t: float = 0.1,
    max_overhead: float = 0.035,
    drift: Optional[Tuple[int, float]] = None,
    noise: float = 0.03,
):
    """A training loop as the Checkpointer drives its tuner: 0.1 s
    iterations (±3% noise, or ``noise``); a save stalls the iteration it starts in by
    20 ms, slows the 10 it is in flight for (1 s) by 10 ms each, and the
    next 10 by ``linger`` each (contention the cost model does not see).
    ``drift`` ``(i, t2)``: from iteration ``i`` on, iterations take ``t2``
    (before the last half). Returns (overhead of the last half, the
    intervals of the last half)."""
    rnd = random.Random(seed)
    tu = FrequencyTuner("auto", max_overhead=max_overhead)
    now, inflight_end, linger_left, extra, stall_next = 0.0, -1.0, 0, 0.0, 0.0
    in_flight = False
    total, last, gaps = 0.0, 0, []
    for i in range(n):
        if drift is not None and i == drift[0]:
            t = drift[1]
        dur = t * (1 + rnd.uniform(-noise, noise)) + stall_next
        affected = now < inflight_end or stall_next > 0
        stall_next = 0.0
        if now < inflight_end:
            dur += 0.01
        elif linger_left:
            dur, linger_left = dur + linger, linger_left - 1
        tu.record_iteration(dur, affected)
        if affected and tu.clean_time:
            extra += max(0.0, dur - tu.clean_time)
        now += dur
        if i >= n // 2:
            total += dur
        if in_flight and now >= inflight_end:
            tu.record_checkpoint(max(extra, 0.02), 1.0)
            in_flight, linger_left = False, 10
        if tu.should_checkpoint():
            assert not in_flight  # the first interval waits for the first measure
            stall_next, inflight_end, extra, in_flight = 0.02, now + 1.0, 0.0, True
            if i >= n // 2:
                gaps.append(i - last)
            last = i
    return total / ((n - n // 2) * t) - 1.0, gaps


@pytest.mark.parametrize("linger", [0.0, 0.005])
@pytest.mark.parametrize("seed", [0, 1])
def test_auto_interval_settles_just_under_the_bound(seed, linger):
    """Regression: the feedback only raised the interval (a dead band from
    half the bound to the bound), so it settled 1.5-2x sparser than
    ``max_overhead`` allows; every 25th checkpoint a re-profile paused the
    schedule and then checkpointed 6 iterations after the last one (above
    the bound overall, 4.6-5% against 3.5%, in this loop), from a baseline
    of 3 noisy samples; and the iteration right after the first checkpoint
    checkpointed again, before its cost was known. Now the interval settles
    where the overhead is just under the bound, re-profiles use the quiet
    iterations of the intervals, and no interval is shorter than the
    model's."""
    overhead, gaps = _simulate_tuner(seed, linger)
    assert 0.7 * 0.035 <= overhead <= 0.035, (overhead, gaps[-10:])
    gaps.sort()
    assert gaps[0] >= 0.6 * gaps[len(gaps) // 2], gaps[:10]


@pytest.mark.parametrize("t2", [0.15, 0.3, 0.06])
@pytest.mark.parametrize("seed", [0, 1])
def test_auto_interval_follows_a_lasting_change_of_the_iteration_time(seed, t2):
    """Regression: after the iterations themselves got lastingly slower
    (0.1 s to 0.15 s: a longer sequence, a slower data path), the tuner
    took the difference for a checkpoint cost, raised the interval at
    every checkpoint, and ran away to max_interval: one checkpoint in
    thousands of iterations, the next re-profile never reached. (The
    re-profile's samples were also the first gathered, not the newest.)
    The baseline now follows the quiet iterations when they move by more
    than the bound."""
    overhead, gaps = _simulate_tuner(seed, 0.0, drift=(4000, t2))
    # The save's cost (its stall, and 10 ms in each iteration of its 1 s in
    # flight) over the bound's share of an iteration.
    ideal = (0.02 + 0.01 / t2) / (0.035 * t2)
    assert 0.7 * 0.035 <= overhead <= 0.035, (overhead, gaps[-10:])
    gaps.sort()
    assert 0.4 * ideal <= gaps[len(gaps) // 2] <= 1.5 * ideal, (ideal, gaps[len(gaps) // 2])
    assert gaps[-1] <= 4 * ideal, gaps[-10:]


@pytest.mark.parametrize("rise", [3.0, 12.0])
def test_auto_interval_follows_a_rise_past_the_stall_threshold(rise):
    """Regression (found in a hunt): quiet iterations over STALL times the
    baseline are taken for stalls (an evaluation, a wait for data) and
    left out of the measures, the samples that move the baseline included:
    after a lasting 12x rise of the iteration time, every iteration was a
    stall, the baseline never moved, and the interval ran away (10, 280,
    560, ... 2240). Such iterations are quiet samples all the same."""
    tu = FrequencyTuner("auto", max_overhead=0.05)
    t, cost, in_flight = 1.0, 0.5, False
    for i in range(6000):
        if i == 2000:
            t *= rise
        due = tu.should_checkpoint()
        if in_flight:  # the previous save was in flight during the last iteration
            tu.record_iteration(t + cost, affected=True)
            tu.record_checkpoint(cost, 0.2 * t)
            in_flight = False
        else:
            tu.record_iteration(t, affected=False)
        in_flight = due
    assert tu.baseline == pytest.approx(t)
    assert tu.interval == max(1, math.ceil(cost / (0.05 * t)))


@pytest.mark.parametrize("noise, bound", [(0.03, 0.01), (0.07, 0.035), (0.10, 0.035)])
@pytest.mark.parametrize("seed", [0, 1])
def test_auto_interval_stays_steady_when_iterations_are_noisier_than_the_bound(seed, noise, bound):
    """Regression (found in review of the fix above): the baseline was
    moved whenever the median of the newest seven quiet iterations was off
    it by more than the bound, which noise alone did when iterations vary
    by about as much as ``max_overhead``; each move reset the measured
    overhead and gaps of 8x the usual interval followed. The baseline is
    now taken again only when a second window in a row is over the bound,
    from every quiet iteration gathered since."""
    overhead, gaps = _simulate_tuner(seed, 0.0, max_overhead=bound, noise=noise)
    assert 0.7 * bound <= overhead <= bound, (overhead, gaps[-10:])
    gaps.sort()
    assert gaps[-1] <= 4 * gaps[len(gaps) // 2], gaps[-10:]


@pytest.mark.parametrize("how", ["raised", "forked"])
def test_auto_checkpoints_go_on_after_a_first_save_that_is_never_measured(tmp_path, how):
    """Regression (found in review): with ``every="auto"`` the tuner waits
    for the first checkpoint's cost before it takes another; a first save
    that raised at its start (a transient error), or one in flight in the
    parent of a forked child, was never measured, and no checkpoint was
    taken again."""
    now = [0.0]
    ck = fastpersist.Checkpointer(tmp_path, every="auto", clock=lambda: now[0], keep_last=2)
    if how == "raised":
        real, calls = ck._saver._save, [0]

        def flaky(*a, **k):
            calls[0] += 1
            if calls[0] == 1:
                raise OSError(errno.EIO, "transient (injected)")
            return real(*a, **k)

        ck._saver._save = flaky
    saves = 0
    for i in range(1, 101):
        now[0] += 1.0
        try:
            f = ck.step(i, {"w": torch.zeros(10)})
        except OSError:
            continue
        if f is not None:
            saves += 1
            if how == "forked" and saves == 1:
                ck._after_fork_in_child()  # as in a child forked while it is in flight
                f.result()
    ck.close()
    assert saves >= 2, saves


@pytest.mark.parametrize("in_flight", [False, True])
def test_one_stalled_iteration_does_not_stretch_the_interval(tmp_path, in_flight):
    """Regression: one 60 s iteration (an evaluation or a data stall not
    reported with pause()) among 0.1 s ones was charged to a save that had
    finished before it began, and the feedback multiplied the interval by
    4 at every checkpoint after it: 8,558 iterations without a checkpoint,
    and the cap (100,000) soon after. A stall is not the checkpoints' cost;
    one measurement moves the estimates a bounded amount."""
    now = [0.0]
    ck = fastpersist.Checkpointer(tmp_path, every="auto", clock=lambda: now[0], keep_last=1)
    saved, intervals = [], []
    for step in range(1, 1201):
        now[0] += 0.1
        if step == 200:
            if in_flight and ck._inflight is not None:
                ck._inflight.future.done_at = None  # the save is still running through the stall
            now[0] += 60.0
        f = ck.step(step, {"w": torch.zeros(10)})
        if f is not None:
            f.result()
            saved.append(step)
            intervals.append(ck.tuner.interval)
    ck.close()
    after = [s for s in saved if s > 200]
    assert after and after[0] - 200 <= 200, saved[-10:]
    assert max(intervals) <= (64 if in_flight else 4), intervals
    assert intervals[-1] <= 4, intervals[-10:]


def test_sampler_exactly_once_across_resume():
    full = fastpersist.ResumableSampler(50, seed=3)
    it = iter(full)
    first = [next(it) for _ in range(17)]
    saved = full.state_dict()
    resumed = fastpersist.ResumableSampler(50, seed=3)
    resumed.load_state_dict(saved)
    rest = list(resumed)
    assert sorted(first + rest) == list(range(50))
    assert resumed.epoch == 1 and resumed.position == 0
    assert list(resumed) != first + rest  # a new permutation for the next epoch
    with pytest.raises(ValueError):
        fastpersist.ResumableSampler(49, seed=3).load_state_dict(saved)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_exactly_once_through_a_prefetching_dataloader(workers, drop_last):
    """Regression: a DataLoader with workers draws indices ahead of the
    batches it yields (prefetch_factor per worker), and the sampler counted
    them as consumed: a run resumed from a state_dict() taken after 3
    batches of 4 skipped 16 samples. Iterated through track(), the position
    is that of the batches yielded, across the epoch's end too."""
    from torch.utils.data import DataLoader, TensorDataset

    ds = TensorDataset(torch.arange(42))

    def loader(s):
        return DataLoader(ds, batch_size=4, sampler=s, num_workers=workers, drop_last=drop_last)

    expected = list(range(40 if drop_last else 42))
    batches = len(expected) // 4 + (not drop_last)
    for stop in (2, batches - 2, batches - 1):  # mid-epoch, at the last batch yielded (a partial one without drop_last)
        s = fastpersist.ResumableSampler(42, seed=1)
        seen = []
        for i, (b,) in enumerate(s.track(loader(s))):
            seen += b.tolist()
            if i == stop:
                saved = s.state_dict()
                break
        resumed = fastpersist.ResumableSampler(42, seed=1)
        resumed.load_state_dict(saved)
        rest = [x for (b,) in resumed.track(loader(resumed)) for x in b.tolist()]
        got = seen + rest
        assert len(got) == len(set(got)), (stop, saved)
        if drop_last:
            assert len(got) == 40 and set(got) <= set(range(42)), (stop, saved)
        else:
            assert sorted(got) == expected, (stop, saved)
        assert resumed.epoch == 1 and resumed.position == 0
        nxt = [x for (b,) in resumed.track(loader(resumed)) for x in b.tolist()]
        assert len(nxt) == len(expected) and nxt != got  # the next epoch, a new order
    if workers:
        # Without track(), what the workers prefetched counts as consumed (documented).
        s = fastpersist.ResumableSampler(42, seed=1)
        for i, _ in enumerate(loader(s)):
            if i == 2:
                break
        assert s.position > 12


def test_sampler_track_refuses_what_it_cannot_count():
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

    ds = TensorDataset(torch.arange(10))
    s = fastpersist.ResumableSampler(10)
    with pytest.raises(TypeError, match="DataLoader"):
        next(s.track(iter([1, 2])))
    with pytest.raises(ValueError, match="does not draw from this sampler"):
        next(s.track(DataLoader(ds, batch_size=2)))
    with pytest.raises(ValueError, match="BatchSampler"):
        next(s.track(DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(range(10)), 2, False))))
    one = [x for (x,) in s.track(DataLoader(ds, batch_size=None, sampler=s))]
    assert sorted(int(x) for x in one) == list(range(10)) and s.epoch == 1
    for bad in ({"epoch": 0, "position": 11}, {"epoch": -1, "position": 0}, {"epoch": 0, "position": -3}):
        with pytest.raises(ValueError, match="position"):
            s.load_state_dict({**s.state_dict(), **bad})


def test_rng_state_round_trip(tmp_path):
    import numpy as np

    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    saved = fastpersist.capture_rng_state()
    fastpersist.write_state_dict(saved, tmp_path / "rng.pt")
    a = (random.random(), float(np.random.rand()), torch.rand(2))
    fastpersist.restore_rng_state(fastpersist.read_state_dict(tmp_path / "rng.pt"))  # weights_only
    b = (random.random(), float(np.random.rand()), torch.rand(2))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


@pytest.mark.parametrize("kind", ["PCG64", "Philox"])
def test_rng_state_round_trip_other_numpy_bit_generator(tmp_path, kind):
    # NumPy's global generator need not be MT19937 (np.random.set_bit_generator):
    # its state is a dict (Philox's with uint64 arrays), not the legacy tuple.
    np = pytest.importorskip("numpy")
    if not hasattr(np.random, "set_bit_generator"):
        pytest.skip("NumPy < 1.25 has one global bit generator")
    original = np.random.get_bit_generator()
    try:
        np.random.set_bit_generator(getattr(np.random, kind)(7))
        np.random.rand(3)
        saved = fastpersist.capture_rng_state()
        fastpersist.write_state_dict(saved, tmp_path / "rng.pt")
        a = np.random.rand(4)
        np.random.set_bit_generator(np.random.MT19937(1))  # restored whatever is global now
        fastpersist.restore_rng_state(fastpersist.read_state_dict(tmp_path / "rng.pt"))  # weights_only
        assert type(np.random.get_bit_generator()).__name__ == kind
        assert np.array_equal(np.random.rand(4), a)
    finally:
        np.random.set_bit_generator(original)


def test_ls_command(tmp_path):
    with fastpersist.Checkpointer(tmp_path, every=1) as ck:
        for s in range(1, 3):
            ck.step(s, state(s))
    r = subprocess.run([cli_exe(), "ls", str(tmp_path), "--verify"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "verified" in r.stdout and " 2 " in r.stdout


KILL_CHILD = textwrap.dedent("""
    import sys, torch, fastpersist
    d = sys.argv[1]
    ck = fastpersist.Checkpointer(d, every=1, keep_last=2, mode=sys.argv[2])
    w = torch.zeros(2_000_000)
    s = int(sys.argv[3])
    while True:
        s += 1
        ck.fence()
        w.fill_(float(s))  # the "optimizer step"
        ck.step(s, {"w": w, "s": s})
        print(s, flush=True)
""")


@pytest.mark.parametrize("trial", range(20))
def test_sigkill_at_random_points_never_breaks_latest(tmp_path, trial):
    rng = random.Random(trial)
    d = tmp_path / "ck"
    start = 0
    for attempt in range(2):  # kill, restart, kill again
        mode = rng.choice(["pipelined", "snapshot"])
        p = subprocess.Popen(
            [sys.executable, "-c", KILL_CHILD, str(d), mode, str(start)], stdout=subprocess.PIPE, text=True
        )
        time.sleep(rng.uniform(1.0, 2.5))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        got = fastpersist.Checkpointer(d).load_latest()
        if got is None:
            continue
        step, st_ = got
        assert st_["s"] == step and torch.all(st_["w"] == float(step)), (step, st_["w"][:3])
        start = step + 1000


@st.composite
def scenarios(draw):
    return (
        draw(
            st.lists(st.sampled_from(["save", "save", "save", "crash", "restart", "corrupt"]), min_size=1, max_size=14)
        ),
        draw(st.integers(1, 3)),
        draw(st.sampled_from([None, 2, 3])),
    )


@given(scenarios())
# Found by hypothesis: a file corrupted twice (the same byte flipped back) is whole again.
@example(scenario=(["save", "save", "corrupt", "corrupt", "save"], 2, None))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_retention_and_tiers_property(tmp_path_factory, scenario):
    ops, keep_last, keep_every = scenario
    base = tmp_path_factory.mktemp("prop")
    local, shared = base / "l", base / "s"
    ck = fastpersist.Checkpointer(local, every=1, keep_last=keep_last, keep_every=keep_every, stage_dir=shared)
    step = 0
    good = set()
    corrupted = set()  # damaged local copies: they do not count toward keep_last
    expect_local: set = set()  # the model: retention runs when a save commits
    for op in ops:
        if op == "save":
            step += 1
            ck.save(step, state(step))
            ck.wait()
            good.add(step)
            expect_local.add(step)
            valid = sorted(expect_local - corrupted)
            if len(valid) >= keep_last:
                cutoff = valid[-keep_last]
                expect_local = {s for s in expect_local if s >= cutoff or (keep_every and s % keep_every == 0)}
        elif op == "crash":  # a save that died half-way: only its temporary file is left
            torn = local / f".{ckpt_name(step + 1)}.999999999.7.fptmp"
            torn.write_bytes(b"torn")
            os.utime(torn, (time.time() - 86400, time.time() - 86400))  # left by a save long ago
        elif op == "corrupt" and steps_in(local):
            # The same byte is flipped: corrupting the same file twice
            # restores it (the model once counted it as still damaged).
            corrupted ^= {max(steps_in(local))}
            victim = local / ckpt_name(max(steps_in(local)))
            raw = bytearray(victim.read_bytes())
            raw[-30] ^= 0xFF  # the central directory
            victim.write_bytes(bytes(raw))
        else:  # restart
            ck.close()
            ck = fastpersist.Checkpointer(local, every=1, keep_last=keep_last, keep_every=keep_every, stage_dir=shared)
            assert not any(n.endswith(".fptmp") for n in os.listdir(local))
    ck.close()
    loc = steps_in(local)
    if good:
        newest = max(good)
        assert newest in loc and newest in steps_in(shared)  # never deleted, and staged
        assert set(loc) == expect_local
        got = ck.load_latest()
        assert got is not None and got[1]["i"] == got[0]
        # latest is the newest copy that verifies (the local one may be corrupted)
        assert got[0] == newest


def test_a_file_of_another_format_named_as_a_checkpoint_is_skipped(tmp_path):
    """A TorchScript archive (or any file fastpersist does not read) under a
    checkpoint's name is skipped by latest()/load_latest() and retention,
    not raised out of them."""
    ck = fastpersist.Checkpointer(tmp_path, every=1)
    ck.save(1, {"w": torch.ones(3)}).result()
    ck.close()
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(tmp_path / "ckpt-000000000002.pt"))
    ck = fastpersist.Checkpointer(tmp_path)
    assert ck.latest().step == 1
    step, state = ck.load_latest()
    assert step == 1 and torch.equal(state["w"], torch.ones(3))
    ck.close()


@pytest.mark.parametrize("keep_every", [None, 2])
def test_a_slow_tier_skips_checkpoints_overtaken_in_its_queue(tmp_path, monkeypatch, keep_every):
    """A tier slower than the checkpoints: while step 1 is being copied,
    steps 2..5 commit. Copying each in turn would fall further behind at
    every checkpoint (and keep every local copy for it); steps 2..4 are
    skipped (logged), 5 is copied, keep_every steps are still copied."""
    import threading

    from fastpersist import checkpoint_manager as cm

    gate, started = threading.Event(), threading.Event()
    copy = cm._copy_durably
    copied = []

    def slow_copy(src, dst):
        started.set()
        gate.wait(60)
        copied.append(os.path.basename(dst))
        copy(src, dst)

    monkeypatch.setattr(cm, "_copy_durably", slow_copy)
    local, shared = tmp_path / "local", tmp_path / "shared"
    ck = fastpersist.Checkpointer(local, every=1, keep_last=5, keep_every=keep_every, stage_dir=shared)
    try:
        ck.save(1, state(1))
        ck.save(2, state(2))  # commits step 1: its copy starts and is held
        assert started.wait(60)
        for s in range(3, 6):
            ck.save(s, state(s))
        ck._finish(ck._inflight, wait=True)  # step 5 committed and queued
        gate.set()
        ck.wait()
    finally:
        gate.set()
        ck.close()
    want = [1, 5] if keep_every is None else [1, 2, 4, 5]
    assert copied == [ckpt_name(s) for s in want]
    assert steps_in(shared) == want
    events = [json.loads(line) for line in (local / "checkpoints.jsonl").read_text().splitlines()]
    skipped = [e["step"] for e in events if e["event"] == "stage_skipped"]
    assert skipped == sorted(set(range(1, 6)) - set(want))


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"keep": 3}, TypeError, r"Checkpointer\(\) got unknown option\(s\) 'keep'"),
        ({"queue_depth": 0}, ValueError, "queue_depth must be positive"),
        ({"mode": "eventually"}, ValueError, "mode must be one of"),
        ({"on_change": "ignore"}, ValueError, "on_change must be one of"),
        ({"format": "safetensors"}, ValueError, "writes torch checkpoints"),
        ({"metadata": {"a": "b"}}, ValueError, "metadata is only stored"),
    ],
)
def test_a_bad_configuration_is_refused_when_made(tmp_path, options, error, match):
    """Regression: a Checkpointer took any options and raised only at its
    first save, which may be hours into a run; now it is refused at once
    and nothing is created."""
    d = tmp_path / "ck"
    with pytest.raises(error, match=match):
        fastpersist.Checkpointer(str(d), every=1, **options)
    assert not d.exists()


@pytest.mark.parametrize(
    "step, error",
    [(-1, ValueError), (10**20, ValueError), (1.5, TypeError), ("7", TypeError), (None, TypeError), (True, TypeError)],
)
def test_a_step_no_file_name_can_hold_is_refused(tmp_path, step, error):
    """Regression: save(-1) wrote ckpt--00000000001.pt, which latest() and
    retention never see (never loaded, never removed); 1.5 or "7" failed
    with a format-code error."""
    ck = fastpersist.Checkpointer(str(tmp_path), every=1)
    with pytest.raises(error, match="step must be"):
        ck.save(step, {"a": torch.ones(2)})
    with pytest.raises(error, match="step must be"):
        ck.step(step, {"a": torch.ones(2)})
    ck.save(10**20 - 1, {"a": torch.ones(2)}).result()
    assert ck.latest().step == 10**20 - 1
    ck.close()
    assert [n for n in os.listdir(tmp_path) if n.startswith("ckpt-")] == [ckpt_name(10**20 - 1)]


@pytest.mark.parametrize("kw", [{"keep_last": 2.5}, {"keep_last": True}, {"keep_every": 2.5}, {"keep_last": "3"}])
def test_retention_counts_must_be_whole(tmp_path, kw):
    """Regression: keep_last=2.5 was accepted and then never removed a
    checkpoint (the disk filled up)."""
    with pytest.raises(TypeError, match="keep_"):
        fastpersist.Checkpointer(str(tmp_path / "ck"), every=1, **kw)


@pytest.mark.parametrize("mode", ["pipelined", "snapshot"])
def test_a_closed_checkpointer_refuses_saves_and_frees_its_buffers(tmp_path, mode):
    """Regression: save() or step() after close() hung (the saver's threads
    had ended), and close() kept the snapshot buffers."""
    ck = fastpersist.Checkpointer(str(tmp_path), every=1, mode=mode)
    ck.save(1, {"a": torch.ones(1 << 16)}).result()
    ck.close()
    assert ck._saver.pool.nbytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        ck.save(2, {"a": torch.ones(2)})
    with pytest.raises(RuntimeError, match="closed"):
        ck.step(2, {"a": torch.ones(2)})
    ck.close()
    assert ck.latest().step == 1
    assert torch.equal(ck.load_latest()[1]["a"], torch.ones(1 << 16))


def test_directory_arguments_are_local_paths_and_not_empty(tmp_path, monkeypatch):
    """Regression: stage_dir="file:///abs/dir" staged into ./file:/abs/dir
    under the current directory; "" for either directory wrote into the
    current directory."""
    monkeypatch.chdir(tmp_path)
    shared = tmp_path / "shared"
    ck = fastpersist.Checkpointer(f"file://{tmp_path / 'local'}", stage_dir=f"file://{shared}", every=1)
    ck.save(1, {"a": torch.ones(2)}).result()
    ck.close()
    assert os.path.exists(tmp_path / "local" / ckpt_name(1))
    assert os.path.exists(shared / ckpt_name(1))
    assert not os.path.exists(tmp_path / "file:")
    with pytest.raises(ValueError, match="directory must name a directory"):
        fastpersist.Checkpointer("", every=1)
    with pytest.raises(ValueError, match="stage_dir must name a directory"):
        fastpersist.Checkpointer(str(tmp_path / "x"), stage_dir="", every=1)


def test_sharded_without_a_group_is_refused(tmp_path):
    """Regression: save_async(sharded=True) without group= silently wrote
    a plain file of the whole object (write_state_dict refuses it)."""
    with pytest.raises(ValueError, match="sharded=True needs group="):
        fastpersist.save_async({"a": torch.ones(2)}, tmp_path / "a.pt", sharded=True)
    with pytest.raises(ValueError, match="sharded=True needs group="):
        fastpersist.Checkpointer(str(tmp_path / "ck"), sharded=True)
    assert not os.path.exists(tmp_path / "a.pt")


@pytest.mark.parametrize(
    "kw, error, match",
    [
        ({"max_overhead": "0.1"}, TypeError, "max_overhead"),
        ({"max_overhead": None}, TypeError, "max_overhead"),
        ({"max_overhead": True}, TypeError, "max_overhead"),
        ({"every": True}, ValueError, "every"),
        ({"clock": None}, TypeError, "clock"),
    ],
)
def test_checkpointer_arguments_are_checked_at_construction(tmp_path, kw, error, match):
    """Regression: a string max_overhead raised TypeError "'<' not supported
    between instances of 'int' and 'str'" (no argument named), every=True
    and clock=None were taken (the latter failing at the first step), and
    the directory was made before the arguments were checked."""
    with pytest.raises(error, match=match):
        fastpersist.Checkpointer(tmp_path / "ck", **kw)
    assert not (tmp_path / "ck").exists()


def test_a_checkpointer_made_only_to_read_deletes_nothing(tmp_path):
    """Regression: a Checkpointer made on the training's directories only to
    read (an evaluator's load_latest, with its default keep_last and no
    keep_every) staged the training's newest, not yet staged, checkpoint
    and then ran retention with its own counts: the training's keep_every
    milestones were deleted from both tiers. Staging caught up at start
    no longer runs retention; only a Checkpointer's own saves do."""
    local, shared = tmp_path / "local", tmp_path / "shared"
    with fastpersist.Checkpointer(local, stage_dir=shared, every=1, keep_last=2, keep_every=10) as ck:
        for s in range(5, 45, 5):
            ck.save(s, {"x": torch.tensor([s])})
            ck.wait()
    # Step 45 committed locally; the process went before staging it.
    with fastpersist.Checkpointer(local, every=1, keep_last=100) as only_local:
        only_local.save(45, {"x": torch.tensor([45])})

    def steps(d):
        return sorted(int(n[5:-3]) for n in os.listdir(d) if n.startswith("ckpt-"))

    before = steps(local), steps(shared)
    assert before == ([10, 20, 30, 35, 40, 45], [10, 20, 30, 35, 40])
    reader = fastpersist.Checkpointer(local, stage_dir=shared)  # defaults: keep_last=3, no keep_every
    assert reader.load_latest()[0] == 45
    reader.close()  # the staging caught up is done
    assert steps(local) == before[0]
    assert steps(shared) == before[1] + [45]


def test_a_run_that_went_back_sets_the_later_checkpoints_aside(tmp_path):
    """Regression: after a rollback (run B resumed from step 200 while run
    A's step 300 was still there), retention kept run A's 300 and deleted
    run B's own checkpoints as it went (keep_last=2 left B's newest and
    A's 300), and load_latest returned run A's 300, throwing away run B.
    A commit of a step now sets later checkpoints aside (renamed
    ``.abandoned``, in the shared tier too): kept, but neither latest nor
    counted."""
    local, shared = tmp_path / "local", tmp_path / "shared"
    with fastpersist.Checkpointer(local, stage_dir=shared, every=1, keep_last=3) as ck:
        for s in (100, 200, 300):
            ck.save(s, {"run": "A", "x": torch.tensor([s])})
            ck.wait()
    left = {}
    with fastpersist.Checkpointer(local, stage_dir=shared, every=1, keep_last=2) as ck:
        for s in (210, 220, 230):
            ck.save(s, {"run": "B", "x": torch.tensor([s])})
            ck.wait()
            left[s] = sorted(n for n in os.listdir(local) if n.startswith("ckpt-") and n.endswith(".pt"))
    assert left[230] == [ckpt_name(220), ckpt_name(230)]
    for d in (local, shared):
        names = sorted(os.listdir(d))
        assert ckpt_name(300) + ".abandoned" in names, names
        assert ckpt_name(300) not in names
    again = fastpersist.Checkpointer(local, stage_dir=shared, every=1, keep_last=2)
    step, state = again.load_latest(weights_only=False)
    again.close()
    assert (step, state["run"]) == (230, "B")
    events = [json.loads(line) for line in open(local / "checkpoints.jsonl")]
    assert [e["step"] for e in events if e["event"] == "abandoned"] == [300, 300]


WENT_BACK_CHILD = textwrap.dedent(
    """
    import os, sys, torch, fastpersist
    local, shared, where = sys.argv[1], sys.argv[2], sys.argv[3]
    ck = fastpersist.Checkpointer(local, stage_dir=shared, every=1, keep_last=5)
    fut = ck.save(210, {"run": "B", "x": torch.tensor([210])})
    if where == "committed":
        fut.result()  # on disk, renamed in; the Checkpointer has not noticed it yet
    os._exit(0)
    """
)


@pytest.mark.parametrize("where", ["committed", "writing"])
def test_a_run_that_went_back_and_died_is_not_restored_from_the_run_it_left(tmp_path, where):
    """Regression: the checkpoints of the run a run went back on were set
    aside only when the new run's commit was noticed (at its next step()),
    not when it happened; a process killed in between (or while its first
    save was being written) was restored from the abandoned run's newest
    checkpoint. Going back is now recorded before the save begins and
    carried out at once (and by the next Checkpointer on the directory, for
    what a dying process left undone)."""
    local, shared = tmp_path / "local", tmp_path / "shared"
    with fastpersist.Checkpointer(local, stage_dir=shared, every=1, keep_last=5) as ck:
        for s in (100, 200, 300):
            ck.save(s, {"run": "A", "x": torch.tensor([s])})
            ck.wait()
    r = subprocess.run([sys.executable, "-c", WENT_BACK_CHILD, str(local), str(shared), where], capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    again = fastpersist.Checkpointer(local, stage_dir=shared, every=1, keep_last=5)
    step, state = again.load_latest(weights_only=False)
    again.close()
    assert (step, state["run"]) == ((210, "B") if where == "committed" else (200, "A"))
    for d in (local, shared):
        assert ckpt_name(300) not in os.listdir(d), sorted(os.listdir(d))
    assert not [n for n in os.listdir(local) if n.startswith(".went-back")]


def test_a_hostile_record_of_going_back_renames_nothing_but_its_own_checkpoints(tmp_path):
    """A record of going back is read from the directory, which others may
    write into: a record naming paths, or steps whose files are not the
    ones recorded, renames nothing; only this Checkpointer's checkpoint
    files whose identity matches the record are set aside."""
    d = tmp_path / "ck"
    outside = tmp_path / "precious.txt"
    outside.write_text("mine")
    with fastpersist.Checkpointer(d, every=1, keep_last=5) as ck:
        for s in (1, 2, 3):
            ck.save(s, {"x": torch.tensor([s])})
            ck.wait()
    (d / "notes.txt").write_text("notes")

    def ident(p):
        st = os.stat(p)
        return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]

    hostile = {
        ".went-back-1.json": {"step": 1, "later": [[str(outside), "local", 5, ident(outside)]], "staged": []},
        ".went-back-2.json": {
            "step": 1,
            "later": [[-1, 2, ident(outside)], [-1, 99, ident(d / "notes.txt")]],
            "staged": [],
        },
        ".went-back-3.json": "not a record",
        ".went-back-4.json": {"step": 1, "later": [[-1, -7, [0, 0, 0, 0]]], "staged": [-1]},
    }
    for name, entry in hostile.items():
        (d / name).write_text(json.dumps(entry))
    (d / ".went-back-5.json").write_text(
        json.dumps({"step": 2, "later": [[-1, 3, ident(d / ckpt_name(3))]], "staged": []})
    )
    before = sorted(os.listdir(d))
    fastpersist.Checkpointer(d).close()
    assert outside.read_text() == "mine" and (d / "notes.txt").read_text() == "notes"
    after = sorted(os.listdir(d))
    assert [n for n in after if n.startswith(".went-back")] == []
    assert set(after) == (set(before) - set(hostile) - {".went-back-5.json", ckpt_name(3)}) | {
        ckpt_name(3) + ".abandoned"
    }


def test_a_record_of_going_back_is_left_to_its_live_process_and_to_the_staging_tier(tmp_path):
    """Regression: every Checkpointer made on the directory carried out and
    removed the records of going back it found: one made only to read (an
    evaluator's, with no stage_dir) removed a record whose staged part it
    could not do, and the trainer, restarted after a crash, was restored
    from the abandoned run's staged checkpoint; a record whose process
    was alive and about to carry it out was taken from it. A record locked
    by a live process is now left alone, and the staged part is left for a
    Checkpointer that has the staging tier."""
    import fcntl

    local, shared = tmp_path / "local", tmp_path / "shared"
    with fastpersist.Checkpointer(local, stage_dir=shared, every=1, keep_last=5) as ck:
        for s in (10, 20, 30):
            ck.save(s, {"run": "A", "x": torch.tensor([s])})
            ck.wait()
    record = local / ".went-back-10.json"
    record.write_text(json.dumps({"step": 10, "later": [], "staged": [20, 30]}))
    fd = os.open(record, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # its process lives
    try:
        fastpersist.Checkpointer(local, stage_dir=shared).close()
        assert record.exists() and ckpt_name(30) in os.listdir(shared)
    finally:
        os.close(fd)  # ... and dies
    fastpersist.Checkpointer(local).close()  # an evaluator's: no staging tier
    assert record.exists() and ckpt_name(30) in os.listdir(shared)
    import fastpersist.checkpoint_manager as cm

    real_scan, shared_calls = cm._scan, []

    def failing(directory, tier):  # the shared tier's listings fail from the second on (ESTALE)
        if tier == "shared":
            shared_calls.append(directory)
            if len(shared_calls) >= 2:
                raise OSError(errno.ESTALE, "stale file handle (injected)", directory)
        return real_scan(directory, tier)

    cm._scan = failing
    try:
        fastpersist.Checkpointer(local, stage_dir=shared).close()
    finally:
        cm._scan = real_scan
    assert len(shared_calls) >= 2 and record.exists()  # kept for a Checkpointer that can list it
    os.unlink(local / ckpt_name(30))  # (the local copy lost, as the staged one is read then)
    os.unlink(local / ckpt_name(20))
    again = fastpersist.Checkpointer(local, stage_dir=shared)
    assert not record.exists()
    assert {ckpt_name(20), ckpt_name(30)}.isdisjoint(os.listdir(shared)), sorted(os.listdir(shared))
    step, _ = again.load_latest(weights_only=False)
    again.close()
    assert step == 10


def test_going_back_while_a_later_step_is_being_staged_sets_it_aside_too(tmp_path, monkeypatch):
    """Regression: a save that went back while the stager was copying a
    later step (in neither the staged steps nor the queue) set aside only
    what was staged already: the copy landed after, and the abandoned
    run's step was restored from the staging tier. Going back to the same
    step again while the first record was kept replaced that record (the
    first set-aside then removed the second's) and leaked its locked
    descriptor."""
    import threading

    import fastpersist.checkpoint_manager as cm

    local, shared = tmp_path / "local", tmp_path / "shared"
    copy, started, go = cm._copy_durably, threading.Event(), threading.Event()

    def gated(src, dst):
        copy(src, dst)
        if dst.endswith(ckpt_name(300)):  # copied; the stage not done yet
            started.set()
            assert go.wait(60)

    def records_held():
        fds = [os.path.join("/proc/self/fd", f) for f in os.listdir("/proc/self/fd")]
        return [t for t in (os.readlink(f) for f in fds if os.path.islink(f)) if ".went-back" in t]

    monkeypatch.setattr(cm, "_copy_durably", gated)
    ck = fastpersist.Checkpointer(local, stage_dir=shared, every=1, keep_last=10)
    for s in (100, 200, 300):
        ck.save(s, {"run": "A", "x": torch.tensor([s])}).result()
        ck._poll()  # committed: staged now
    assert started.wait(60)  # step 300's copy is in flight
    ck.save(100, {"run": "B", "x": torch.tensor([100])}).result()
    ck.save(110, {"run": "B", "x": torch.tensor([110])}).result()
    ck.save(100, {"run": "C", "x": torch.tensor([100])}).result()  # back to 100 again
    # The first record is kept until the staging tier's part is done (the
    # second, local only, was carried out at once, under a name of its own).
    records = sorted(n for n in os.listdir(local) if n.startswith(".went-back"))
    assert records == [".went-back-100.json"], records
    go.set()
    ck.close()
    assert records_held() == []
    assert not [n for n in os.listdir(local) if n.startswith(".went-back")]
    assert steps_in(shared) == [100], sorted(os.listdir(shared))
    assert steps_in(local) == [100], sorted(os.listdir(local))
    os.unlink(local / ckpt_name(100))  # the local copy lost: the staged one is read
    again = fastpersist.Checkpointer(local, stage_dir=shared)
    step, state = again.load_latest(weights_only=False)
    again.close()
    assert (step, state["run"]) == (100, "C")


def test_going_back_as_the_stager_moves_to_the_next_step_sets_that_one_aside(tmp_path, monkeypatch):
    """Regression (found in review): what the staging tier held past the
    step was read when the save began, and acted on after the record's
    write: a stage that landed (200) and the next one that began (300) in
    between were missed, and 300 stayed staged, restored once the local
    copy was lost. The staged steps are now read in the same hold of the
    lock as the stager's bookkeeping is changed, and a stage that lands
    after a going back past it is set aside by the stager itself."""
    import threading

    import fastpersist.checkpoint_manager as cm

    local, shared = tmp_path / "local", tmp_path / "shared"
    copy = cm._copy_durably
    go200, done300, release300 = threading.Event(), threading.Event(), threading.Event()

    def gated(src, dst):
        if dst.endswith(ckpt_name(200)):
            assert go200.wait(60)
        copy(src, dst)
        if dst.endswith(ckpt_name(300)):  # copied; the stage not done yet
            done300.set()
            assert release300.wait(60)

    monkeypatch.setattr(cm, "_copy_durably", gated)
    ck = fastpersist.Checkpointer(local, stage_dir=shared, every=1, keep_last=10)
    for s in (100, 200, 300):
        ck.save(s, {"run": "A", "x": torch.tensor([s])}).result()
        ck._poll()
    real = ck._went_back

    def went_back(step, later, *rest):
        go200.set()  # 200 lands, and the stager moves on to 300
        assert done300.wait(60)
        real(step, later, *rest)
        release300.set()

    ck._went_back = went_back
    ck.save(100, {"run": "B", "x": torch.tensor([100])}).result()
    ck.close()
    assert steps_in(shared) == [100], sorted(os.listdir(shared))
    os.unlink(local / ckpt_name(100))  # the local copy lost: the staged one is read
    step, state = fastpersist.Checkpointer(local, stage_dir=shared).load_latest(weights_only=False)
    assert (step, state["run"]) == (100, "B")


def test_an_interrupted_going_back_leaves_no_record_for_the_next_checkpointer(tmp_path, monkeypatch):
    """Regression (found in a hunt): a Ctrl-C while a save set a later run's
    checkpoints aside left the record of going back on disk, locked by the
    live process; the user retried, the run went on and staged new
    checkpoints of the same steps, and once the process ended, the next
    Checkpointer on the directory carried the stale record out: it set the
    new run's staged checkpoints aside. A record is now released when its
    going back raises in a process that lives on (a retry goes back again)."""
    import fastpersist.checkpoint_manager as cm

    local, shared = tmp_path / "local", tmp_path / "shared"
    ck = fastpersist.Checkpointer(local, stage_dir=shared, every=1, keep_last=10)
    for s in (1, 2, 3):
        ck.save(s, {"run": "A", "x": torch.tensor([s])})
        ck.wait()
    real, calls = cm.Checkpointer._set_aside, []

    def interrupted(self, *a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(cm.Checkpointer, "_set_aside", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ck.save(1, {"run": "B", "x": torch.tensor([1])})
    assert not [n for n in os.listdir(local) if n.startswith(".went-back")] and not ck._records
    ck.save(1, {"run": "B", "x": torch.tensor([1])})  # retried: it goes back again, staged part included
    ck.wait()
    assert steps_in(shared) == [1], sorted(os.listdir(shared))
    for s in (2, 3):  # the run goes on
        ck.save(s, {"run": "B", "x": torch.tensor([s])})
        ck.wait()
    ck.close()
    assert steps_in(shared) == [1, 2, 3]
    again = fastpersist.Checkpointer(local, stage_dir=shared)
    again.close()
    assert steps_in(shared) == [1, 2, 3], sorted(os.listdir(shared))
    for s in (1, 2, 3):
        os.unlink(local / ckpt_name(s))  # read from the shared tier
    step, state = fastpersist.Checkpointer(local, stage_dir=shared).load_latest(weights_only=False)
    assert (step, state["run"]) == (3, "B")


def test_folders_and_fifos_at_the_checkpointers_names_are_no_checkpoints(tmp_path):
    """Regression (found in a hunt): a folder named as a record of going
    back (``.went-back-1.json``) made the Checkpointer's construction raise
    IsADirectoryError (and leaked a descriptor); a FIFO at a checkpoint's
    name was listed as a checkpoint, and staging it hung the save's
    wait(); a folder at a checkpoint's name was renamed ``.abandoned``
    by a run that went back. Only regular files are checkpoints."""
    local, shared = tmp_path / "local", tmp_path / "shared"
    local.mkdir()
    (local / ".went-back-1.json").mkdir()
    os.mkfifo(local / ckpt_name(500))
    (local / ckpt_name(400)).mkdir()
    with fastpersist.Checkpointer(local, stage_dir=shared, every=1, keep_last=2) as ck:
        assert ck.latest() is None
        ck.save(5, {"x": torch.tensor([5])})
        ck.wait()
    assert (local / ".went-back-1.json").is_dir() and (local / ckpt_name(400)).is_dir()
    assert stat.S_ISFIFO(os.lstat(local / ckpt_name(500)).st_mode)
    assert steps_in(shared) == [5]


@pytest.mark.parametrize("mode", ["pipelined", "snapshot"])
def test_links_at_the_checkpointers_own_names_are_never_followed(tmp_path, mode):
    """Regression: a symbolic link at a checkpoint's name (``ckpt-<step>.pt``)
    or at the log's was followed: ``save(step)`` replaced the file outside
    the directory that the link named with the checkpoint (retention later
    removed only the link), ``latest()`` and retention read through it,
    and events were appended to the log's link target. The Checkpointer's
    names are its own: a save replaces such a link, a listing passes it
    by (neither read nor removed), and the log is not written through
    one."""
    outside = tmp_path / "outside"
    outside.mkdir()
    victim, foreign_log = outside / "thesis.txt", outside / "notes.log"
    victim.write_text("precious")
    foreign_log.write_text("mine\n")
    d = tmp_path / "ck"
    d.mkdir()
    os.symlink(victim, d / ckpt_name(5))
    os.symlink(victim, d / ckpt_name(9))  # a later step's name: not a checkpoint
    os.symlink(foreign_log, d / "checkpoints.jsonl")
    with fastpersist.Checkpointer(d, every=1, keep_last=1, mode=mode) as ck:
        assert ck.latest() is None  # the link is no checkpoint, and not read
        ck.save(5, {"w": torch.zeros(4)}).result()
        ck.save(6, {"w": torch.ones(4)}).result()
        ck.wait()
    assert victim.read_text() == "precious" and foreign_log.read_text() == "mine\n"
    assert sorted(os.listdir(outside)) == ["notes.log", "thesis.txt"]
    assert os.path.islink(d / ckpt_name(9)) and not (d / ckpt_name(5)).exists()  # retention took step 5
    assert fastpersist.Checkpointer(d).latest().step == 6


def test_staging_goes_on_after_a_run_went_back(tmp_path):
    """Regression: a commit that set a later run's checkpoints aside also
    stopped staging every later step for the rest of the process (a cut-off
    step was kept, not the stages queued then): the shared tier got nothing
    more, and local retention, which waits for the shared tier, kept every
    checkpoint."""
    local, shared = tmp_path / "local", tmp_path / "shared"
    with fastpersist.Checkpointer(local, stage_dir=shared, every=10, keep_last=2) as ck:
        for s in range(1, 101):
            ck.step(s, {"x": torch.tensor([s])})
    with fastpersist.Checkpointer(local, stage_dir=shared, every=10, keep_last=2) as ck:
        for s in range(55, 161):  # resumed from step 50
            ck.step(s, {"x": torch.tensor([s])})
    assert steps_in(shared) == [144, 154], sorted(os.listdir(shared))
    assert steps_in(local) == [144, 154], sorted(os.listdir(local))
    assert {n for n in os.listdir(shared) if n.endswith(".abandoned")} >= {ckpt_name(100) + ".abandoned"}


def test_a_file_of_a_checkpoints_name_that_a_checkpointer_did_not_write_is_skipped(tmp_path):
    """Regression: a newest ``ckpt-<step>.pt`` whose payload's step was not
    an int (``{"step": "two"}``) made load_latest() raise a bare ValueError
    from ``int()`` instead of going on to the older checkpoint."""
    with fastpersist.Checkpointer(tmp_path, every=1) as ck:
        ck.save(1, {"w": torch.ones(2)})
    for payload in ({"step": "two", "state": {}}, {"step": True, "state": {}}, [1, 2], {"step": 2}):
        torch.save(payload, tmp_path / ckpt_name(2))
        step, state = fastpersist.Checkpointer(tmp_path).load_latest()
        assert step == 1 and torch.equal(state["w"], torch.ones(2)), payload


def test_an_event_after_a_torn_log_line_is_a_line_of_its_own(tmp_path):
    """Regression: a crash mid-append leaves the log's last line cut short;
    the next event was appended to it, and both were lost to a reader."""
    with fastpersist.Checkpointer(tmp_path, every=1) as ck:
        ck.save(1, {"w": torch.ones(2)})
    log_path = tmp_path / "checkpoints.jsonl"
    with open(log_path, "a") as f:
        f.write('{"time": 1, "event": "comm')
    with fastpersist.Checkpointer(tmp_path, every=1) as ck:
        ck.save(2, {"w": torch.ones(2)})
        with pytest.raises(RuntimeError, match="closed"):
            ck.close()
            ck.prepare({"w": torch.ones(2)})
    lines = log_path.read_text().splitlines()
    assert lines[-2] == '{"time": 1, "event": "comm'
    assert json.loads(lines[-1])["event"] == "commit" and json.loads(lines[-1])["step"] == 2


def test_a_torch_file_that_is_no_checkpointers_is_neither_latest_nor_counted(tmp_path):
    """Regression (found in a hunt): a valid torch file at a checkpoint's
    name that a Checkpointer did not write (not ``{'step': int, 'state':
    ...}``) was ``latest()`` while ``load_latest()`` passed it by, and
    retention counted it as a kept checkpoint: with ``keep_last=2`` a real
    one was deleted in its place. Both now pass it by, as the load does."""
    d = tmp_path / "ck"
    with fastpersist.Checkpointer(d, every=1, keep_last=2) as ck:
        ck.save(100, {"x": torch.tensor([100])})
        ck.wait()
    torch.save({"w": torch.ones(3)}, d / ckpt_name(200))  # someone else's file
    ck = fastpersist.Checkpointer(d, every=1, keep_last=2)
    assert ck.latest().step == 100
    assert ck.load_latest()[0] == 100
    ck.save(300, {"x": torch.tensor([300])})  # (200 is not a checkpoint: no going back)
    ck.wait()
    ck.close()
    names = sorted(os.listdir(d))
    assert {ckpt_name(100), ckpt_name(200), ckpt_name(300)} <= set(names), names


@pytest.mark.parametrize(
    "text",
    ['{"step": Infinity, "later": [], "staged": [5]}', "[" * 200000, '{"step": -3, "later": [], "staged": null}'],
    ids=["infinity", "deep", "negative"],
)
@pytest.mark.parametrize("locked", [True, False])
def test_a_malformed_record_of_going_back_stops_nothing(tmp_path, text, locked):
    """Regression (found in review): records are read (another live
    process's too, without its lock) at every restore, retention and
    stage; one whose step is ``Infinity`` (OverflowError) or whose JSON
    nests too deep (RecursionError) made ``Checkpointer()`` and
    ``latest()`` raise, and a negative step was taken. Such a record is
    passed by (and, once it can be locked, removed)."""
    import fcntl

    d, shared = tmp_path / "ck", tmp_path / "shared"
    with fastpersist.Checkpointer(d, stage_dir=shared, every=1, keep_last=5) as ck:
        for s in (1, 2):
            ck.save(s, {"x": torch.tensor([s])})
            ck.wait()
    record = d / ".went-back-5.json"
    record.write_text(text)
    fd = os.open(record, os.O_RDONLY)
    if locked:
        fcntl.flock(fd, fcntl.LOCK_EX)  # (a live process's)
    try:
        with fastpersist.Checkpointer(d, stage_dir=shared, every=1, keep_last=5) as ck:
            assert ck.latest().step == 2
            ck.save(3, {"x": torch.tensor([3])})
            ck.wait()
            assert ck.load_latest()[0] == 3
        assert record.exists() == locked
        assert {ckpt_name(s) for s in (1, 2, 3)} <= set(os.listdir(shared))  # (nothing set aside for it)
    finally:
        os.close(fd)
