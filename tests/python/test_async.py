"""save_async: both modes, fencing, ordering, failures, memory, exit."""

from __future__ import annotations

import concurrent.futures
import errno
import os
import subprocess
import sys
import textwrap
import threading
import time

import fastpersist
import pytest
import torch
from fastpersist.async_save import AsyncSaver
from helpers import bits, make

MODES = ["pipelined", "snapshot"]


@pytest.mark.parametrize("mode", MODES)
def test_changes_after_wait_snapshot_never_reach_the_file(tmp_path, mode):
    big = make((8 << 20,), torch.float32, 1)  # 32 MiB: the write is still going when we mutate
    expect = big.clone()
    f = fastpersist.save_async({"big": big, "step": 3}, tmp_path / "a.pt", mode=mode)
    f.wait_snapshot()
    assert f.snapshot_done()
    big.fill_(0.5)
    st = f.result(timeout=120)
    assert f.done() and f.exception() is None
    assert st.bytes == os.path.getsize(tmp_path / "a.pt")
    got = torch.load(tmp_path / "a.pt")
    assert got["step"] == 3 and bits(got["big"]) == bits(expect)


@pytest.mark.parametrize("mode", MODES)
def test_many_saves_each_hold_their_own_values(tmp_path, mode):
    w = torch.zeros(300_000)
    futs = []
    for i in range(8):
        f = fastpersist.save_async({"w": w, "i": i}, tmp_path / f"{i}.pt", mode=mode)
        f.wait_snapshot()
        w.add_(1)  # the "optimizer step"
        futs.append(f)
    for i, f in enumerate(futs):
        f.result(timeout=120)
        got = torch.load(tmp_path / f"{i}.pt")
        assert got["i"] == i and torch.all(got["w"] == i)


@pytest.mark.parametrize("mode", MODES)
def test_io_error_surfaces_from_result_and_no_file(tmp_path, engine_fault, mode):
    engine_fault(1 << 20, errno.EIO)
    f = fastpersist.save_async({"t": make((1 << 20,), torch.float32)}, tmp_path / "x.pt", mode=mode)
    with pytest.raises(fastpersist.WriteError) as ei:
        f.result(timeout=120)
    assert ei.value.errno == errno.EIO
    assert isinstance(f.exception(), fastpersist.WriteError)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", MODES)
def test_unpicklable_fails_at_snapshot(tmp_path, mode):
    f = fastpersist.save_async({"f": lambda: 0}, tmp_path / "x.pt", mode=mode)
    with pytest.raises(fastpersist.SerializationError):
        f.wait_snapshot(timeout=60)
    with pytest.raises(fastpersist.SerializationError):
        f.result(timeout=60)
    assert os.listdir(tmp_path) == []


def test_future_protocol(tmp_path):
    seen = []
    called = threading.Event()
    f = fastpersist.save_async({"a": torch.ones(3)}, tmp_path / "f.pt")
    f.add_done_callback(lambda fut: (seen.append(fut.result().path), called.set()))
    st = f.result(timeout=60)
    assert isinstance(st, fastpersist.WriteStats) and f.done() and not f.cancelled()
    assert called.wait(60)  # (on fastpersist's callback thread: perhaps after result() returns)
    assert seen == [str(tmp_path / "f.pt")]
    late = []
    f.add_done_callback(lambda fut: late.append(threading.current_thread()))  # done already: at once, here
    assert late == [threading.current_thread()]
    # In the order added, also one added once the save is done while
    # earlier ones still wait their turn (found in review).
    order, gate = [], threading.Event()
    g = fastpersist.save_async({"a": torch.ones(3)}, tmp_path / "g.pt")
    g.add_done_callback(lambda fut: (gate.wait(60), order.append("first")))
    g.result(timeout=60)
    g.add_done_callback(lambda fut: order.append("second"))
    gate.set()
    fastpersist.wait_all()
    end = threading.Event()
    g.add_done_callback(lambda fut: end.set())
    assert end.wait(60) and order == ["first", "second"], order
    assert f.snapshot_seconds is not None and f.snapshot_seconds >= 0


def test_next_save_waits_for_previous_snapshot_and_pool_is_reused(tmp_path):
    saver = AsyncSaver(max_pending=1)
    t = make((1 << 20,), torch.float32)
    f1 = saver.save({"t": t}, tmp_path / "1.pt", mode="snapshot")
    f2 = saver.save({"t": t}, tmp_path / "2.pt", mode="snapshot")
    assert f1.snapshot_done()  # save 2 could only start after it
    f2.result(timeout=60)
    size = saver.pool.nbytes
    assert size >= 4 << 20
    for i in range(5):
        saver.save({"t": t}, tmp_path / f"r{i}.pt", mode="snapshot").result(timeout=60)
    assert saver.pool.nbytes == size  # reused, not grown
    saver.pool.release()
    assert saver.pool.nbytes == 0
    assert saver.wait_all() == []


def test_bad_mode_and_path(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        fastpersist.save_async({}, tmp_path / "x.pt", mode="eventually")
    with pytest.raises(TypeError):
        fastpersist.save_async({}, None)


def test_unknown_options_are_named_by_the_call(tmp_path):
    """Regression: an option no save takes surfaced as a TypeError about an
    internal function (EngineOptions.resolve)."""
    with pytest.raises(TypeError, match=r"save_async\(\) got unknown option\(s\) 'keep'; it takes .*queue_depth"):
        fastpersist.save_async({"a": torch.ones(2)}, tmp_path / "x.pt", keep=3)
    assert not os.path.exists(tmp_path / "x.pt")


def test_interpreter_exit_waits_for_saves(tmp_path):
    target = tmp_path / "exit.pt"
    code = textwrap.dedent(f"""
        import torch, fastpersist
        t = torch.arange(4 << 20, dtype=torch.float32)
        f = fastpersist.save_async({{"t": t}}, {str(target)!r}, mode="snapshot")
        f.wait_snapshot()
        # exit at once, with the write in flight
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = torch.load(target)
    assert torch.equal(got["t"], torch.arange(4 << 20, dtype=torch.float32))


def _thread_niceness(executor) -> int:
    return executor.submit(lambda: os.getpriority(os.PRIO_PROCESS, __import__("threading").get_native_id())).result()


@pytest.mark.parametrize("nice", [0, 7])
def test_background_threads_run_at_the_niceness_asked(tmp_path, nice):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    saver = AsyncSaver(nice=nice)
    try:
        assert saver.nice == nice
        for ex in (saver._snap, saver._write):
            assert _thread_niceness(ex) == max(base, nice)
        # the caller's own priority is untouched, and the save still works
        assert os.getpriority(os.PRIO_PROCESS, 0) == base
        t = torch.arange(1000.0)
        saver.save({"t": t}, tmp_path / "n.pt", mode="snapshot").result(60)
        assert torch.equal(torch.load(tmp_path / "n.pt")["t"], t)
    finally:
        saver.wait_all()


def test_niceness_from_environment_and_bad_values(monkeypatch):
    monkeypatch.setenv("FASTPERSIST_BACKGROUND_NICE", "3")
    saver = AsyncSaver()
    assert saver.nice == 3
    for bad in (-1, 20):
        with pytest.raises(ValueError, match="nice"):
            AsyncSaver(nice=bad)


@pytest.mark.parametrize("mode", MODES)
def test_safetensors_format(tmp_path, mode):
    from safetensors.torch import load_file, safe_open

    base = make((1000, 37), torch.float32, 2)
    tensors = {"slice": base[3:10], "i16": torch.arange(5, dtype=torch.int16), "empty": torch.ones(0)}
    expect = {k: v.clone() for k, v in tensors.items()}
    f = fastpersist.save_async(
        tensors, tmp_path / "m.safetensors", mode=mode, format="safetensors", metadata={"a": "b"}
    )
    f.wait_snapshot()
    base.fill_(0.5)
    f.result(timeout=120)
    got = load_file(tmp_path / "m.safetensors")
    assert {k: bits(v) for k, v in got.items()} == {k: bits(v) for k, v in expect.items()}
    with safe_open(tmp_path / "m.safetensors", "pt") as sf:
        assert sf.metadata() == {"a": "b"}
    with pytest.raises(ValueError, match="metadata"):
        fastpersist.save_async(tensors, tmp_path / "x.pt", mode=mode, metadata={"a": "b"})


def _resident_fraction(t: torch.Tensor) -> float:
    """Share of ``t``'s whole pages that are resident (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel()) // page * page
    n = (end - start) // page
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0
    return sum(b & 1 for b in vec) / n


def test_prepare_makes_the_first_snapshot_use_a_ready_buffer(tmp_path):
    """21.7: AsyncSaver.prepare(state) makes the snapshot buffer ahead of the
    first save (faulted in); the first snapshot save uses it, allocating
    nothing on its critical path."""
    sd = {"a": make((3 << 20,), torch.float32), "b": make((1000,), torch.bfloat16)}
    saver = AsyncSaver()
    try:
        assert saver.pool.nbytes == 0
        assert saver.prepare(sd) is None
        held = saver.pool.nbytes
        assert held >= (3 << 20) * 4
        (buf,) = saver.pool._free
        assert _resident_fraction(buf) > 0.99
        saver.save(sd, tmp_path / "p.pt", mode="snapshot").result()
        assert saver.pool.nbytes == held  # the prepared buffer, reused
        assert saver.pool._free == [buf] or saver.pool._free[0] is buf
        got = fastpersist.read_state_dict(tmp_path / "p.pt")
        assert bits(got["a"]) == bits(sd["a"]) and bits(got["b"]) == bits(sd["b"])
        # In the background: a future; a bigger state replaces the buffer.
        big = {"a": make((5 << 20,), torch.float32)}
        fut = saver.prepare(big, background=True)
        fut.result(timeout=60)
        assert saver.pool.nbytes >= (5 << 20) * 4 and len(saver.pool._free) == 1
        with pytest.raises(ValueError, match="format"):
            saver.prepare(sd, format="zip")
        with pytest.raises(ValueError, match="nbytes"):
            saver.pool.reserve(-1)
    finally:
        saver.close()


def test_new_pool_buffers_are_faulted_in():
    """21.7: a buffer the pool makes on demand is resident at once (huge-page
    advice and MADV_POPULATE_WRITE), not faulted page by page by the copy."""
    pool = fastpersist.SnapshotPool()
    buf = pool.acquire(16 << 20)
    assert _resident_fraction(buf) > 0.99
    pool.put_back(buf)


def test_pool_sizes_are_checked_in_every_call():
    """Regression: SnapshotPool.acquire(-1) (and a float or bool size)
    returned a buffer; reserve and reserve_many refused only negatives."""
    pool = fastpersist.SnapshotPool()
    for call in (pool.acquire, pool.reserve, lambda n: pool.reserve_many([(n, False)])):
        with pytest.raises(ValueError, match="nbytes must be >= 0"):
            call(-1)
        for bad in (2.5, True, "8"):
            with pytest.raises(TypeError, match="nbytes must be an int"):
                call(bad)
    assert pool.nbytes == 0
    import numpy as np

    pool.put_back(pool.acquire(np.int64(4096)))
    assert pool.nbytes >= 4096


def test_checkpointer_prepare_in_snapshot_mode(tmp_path):
    sd = {"w": make((1 << 20,), torch.float32)}
    ck = fastpersist.Checkpointer(tmp_path / "c", mode="snapshot", every=1)
    try:
        ck.prepare(sd, background=False)
        assert ck._saver.pool.nbytes >= (1 << 20) * 4
        held = ck._saver.pool.nbytes
        ck.save(1, sd).result()
        assert ck._saver.pool.nbytes == held
    finally:
        ck.close()
    ck = fastpersist.Checkpointer(tmp_path / "d")  # pipelined: nothing to stage
    try:
        ck.prepare(sd)
        assert ck._saver.pool.nbytes == 0
    finally:
        ck.close()


def test_checkpointer_step_prepares_in_the_background(tmp_path):
    sd = {"w": make((1 << 20,), torch.float32)}
    ck = fastpersist.Checkpointer(tmp_path / "c", mode="snapshot", every=1000)
    try:
        assert ck.step(0, sd) is None  # no checkpoint yet, but the buffer is being made
        ck._saver._snap.submit(lambda: None).result(timeout=60)  # behind the preparation
        assert ck._saver.pool.nbytes >= (1 << 20) * 4
    finally:
        ck.close()


@pytest.mark.parametrize(
    ("cores", "background", "foreground"), [(1, 1, 1), (2, 1, 2), (7, 1, 7), (16, 4, 8), (64, 8, 8)]
)
def test_background_saves_gather_on_a_quarter_of_the_cores(monkeypatch, cores, background, foreground):
    """A save that overlaps training gathers on a quarter of the usable
    cores (at least 1, at most 8), a synchronous one on all of them (at
    most 8); the environment and the option still decide where given."""
    from fastpersist import options

    monkeypatch.delenv("FASTPERSIST_GATHER_THREADS", raising=False)
    monkeypatch.setattr(options, "_usable_cores", lambda: cores)
    assert options.EngineOptions.resolve(background=True).gather_threads == background
    assert options.EngineOptions.resolve().gather_threads == foreground
    assert options.EngineOptions.resolve(background=True, gather_threads=3).gather_threads == 3
    monkeypatch.setenv("FASTPERSIST_GATHER_THREADS", "5")
    assert options.EngineOptions.resolve(background=True).gather_threads == 5


def test_async_saves_resolve_their_options_as_background_saves(tmp_path, monkeypatch):
    from fastpersist import async_save

    seen = []
    real = async_save.EngineOptions.resolve

    def resolve(*a, **k):
        opts = real(*a, **k)
        seen.append((k.get("background"), opts.gather_threads))
        return opts

    monkeypatch.delenv("FASTPERSIST_GATHER_THREADS", raising=False)
    monkeypatch.setattr(async_save.EngineOptions, "resolve", resolve)
    sd = {"w": torch.arange(1000.0)}
    fastpersist.save_async(sd, tmp_path / "a.pt").result()
    fastpersist.save_async(sd, tmp_path / "b.pt", gather_threads=2).result()
    assert seen[0] == (True, fastpersist.options.default_background_gather_threads())
    assert seen[1] == (True, 2)
    assert torch.equal(torch.load(tmp_path / "b.pt")["w"], sd["w"])


def test_background_and_synchronous_saves_share_one_engine(tmp_path):
    """The gather threads are set on each use of an engine, not made into
    another engine: background saves (fewer threads) and synchronous ones
    share one arena; each gets its own count, and a count the engine cannot
    take is a ValueError."""
    from fastpersist import options

    fg = options.EngineOptions.resolve(gather_threads=3)
    bg = options.EngineOptions.resolve(background=True, gather_threads=1)
    assert options.get_engine(fg)[1] is options.get_engine(bg)[1]
    sd = {f"t{i}": torch.full((300_000,), float(i)) for i in range(8)}
    fastpersist.write_state_dict(sd, tmp_path / "a.pt", gather_threads=3)
    fastpersist.save_async(sd, tmp_path / "b.pt", gather_threads=1).result()
    fastpersist.write_state_dict(sd, tmp_path / "c.pt", gather_threads=2)
    for name in ("a.pt", "b.pt", "c.pt"):
        got = fastpersist.read_state_dict(tmp_path / name)
        assert all(torch.equal(got[k], v) for k, v in sd.items())
    with pytest.raises(ValueError, match="gather_threads"):
        options.get_engine(fg)[1].set_gather_threads(0)


def test_a_closed_saver_refuses_saves_instead_of_hanging(tmp_path):
    """Regression: a save given to a closed AsyncSaver was queued for
    threads that had ended: its future never completed and the interpreter
    hung at exit waiting for it."""
    from fastpersist.async_save import AsyncSaver

    saver = AsyncSaver()
    saver.save({"a": torch.ones(2)}, tmp_path / "a.pt", mode="snapshot").result(timeout=60)
    assert saver.pool.nbytes > 0
    saver.close()
    assert saver.pool.nbytes == 0  # the snapshot buffers go with the threads
    with pytest.raises(RuntimeError, match="closed"):
        saver.save({"a": torch.ones(2)}, tmp_path / "b.pt")
    with pytest.raises(RuntimeError, match="closed"):
        saver.prepare({"a": torch.ones(2)})
    saver.close()  # again: nothing
    assert not os.path.exists(tmp_path / "b.pt")


@pytest.mark.parametrize("call", ["save", "snapshot", "prepare"])
def test_a_saver_closed_by_another_thread_during_a_call_refuses_it(tmp_path, monkeypatch, call):
    """Regression: a save (or a background prepare) that passed the check
    for a closed saver, then was overtaken by close() on another thread,
    was queued for threads that had ended: its future never completed."""
    import threading

    from fastpersist import async_save

    saver = AsyncSaver()
    inside, go = threading.Event(), threading.Event()
    real = async_save.record_ready if call != "prepare" else async_save._planner

    def paused(*a, **kw):
        inside.set()
        assert go.wait(60)
        return real(*a, **kw)

    monkeypatch.setattr(async_save, "record_ready" if call != "prepare" else "_planner", paused)
    result: dict = {}

    def run():
        try:
            sd = {"a": torch.ones(2)}
            if call == "prepare":
                result["fut"] = saver.prepare(sd, background=True)
            else:
                mode = "snapshot" if call == "snapshot" else "pipelined"
                result["fut"] = saver.save(sd, tmp_path / "a.pt", mode=mode)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    assert inside.wait(60)
    saver.close()  # nothing registered yet: returns at once, the threads end
    go.set()
    t.join(60)
    assert "fut" not in result, "a call the closed saver can never run was accepted"
    assert isinstance(result["error"], RuntimeError) and "closed" in str(result["error"])
    assert not os.path.exists(tmp_path / "a.pt")
    assert not fastpersist.options.has_pending(str(tmp_path / "a.pt"))


@pytest.mark.parametrize(
    "kw, error",
    [
        ({"nice": 2.5}, TypeError),
        ({"nice": "5"}, TypeError),
        ({"max_pending": 1.5}, TypeError),
        ({"nice": 20}, ValueError),
    ],
)
def test_saver_arguments_are_checked_when_made(kw, error):
    """Regression: nice=2.5 was accepted; both threads then died on
    os.setpriority and every save hung."""
    from fastpersist.async_save import AsyncSaver

    with pytest.raises(error):
        AsyncSaver(**kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"block_size": 3}, "block_size 3 must be a positive multiple"),
        ({"arena_bytes": 4096, "block_size": 8192}, "arena_bytes 4096 must hold at least one block"),
        ({"queue_depth": 5000}, "queue_depth must be in 1..=4096"),
        ({"gather_threads": 10000}, "gather_threads must be in 1..=256"),
        ({"arena_bytes": 1 << 60}, "more than this machine's memory"),
    ],
)
def test_engine_limits_are_checked_at_the_call(tmp_path, kw, match):
    """Regression: values only the engine refused (not a multiple of the
    page, an arena smaller than a block, ...) passed the call and failed
    in the save's future, or at a Checkpointer's first save."""
    with pytest.raises(ValueError, match=match):
        fastpersist.save_async({"a": torch.ones(2)}, tmp_path / "a.pt", **kw)
    with pytest.raises(ValueError, match=match):
        fastpersist.Checkpointer(str(tmp_path / "ck"), **kw)
    with pytest.raises(ValueError, match=match):
        fastpersist.patch(**kw)
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("mode", ["pipelined", "snapshot"])
def test_a_cancelled_save_writes_nothing_and_breaks_nothing(tmp_path, mode):
    """Regression: cancelling a queued save left its snapshot phase open
    for ever (``wait_snapshot()`` hung), and a Checkpointer whose save was
    cancelled raised CancelledError from every later call, close() too,
    leaving its threads running."""
    import concurrent.futures
    import threading

    saver = AsyncSaver(max_pending=2)
    gate = threading.Event()

    def busy(s):  # the thread that would start the save is busy until the gate opens
        return (s._snap if mode == "snapshot" else s._write).submit(gate.wait, 60)

    blocker = busy(saver)
    fut = saver.save({"a": torch.ones(4)}, tmp_path / "a.pt", mode=mode)
    assert fut.cancel()
    fut.wait_snapshot(timeout=5)  # returns: nothing will read the tensors
    gate.set()
    blocker.result(timeout=60)
    with pytest.raises(concurrent.futures.CancelledError):
        fut.result(timeout=60)
    assert saver.wait_all(timeout=60) == []  # cancelled, not failed
    saver.save({"a": torch.ones(4)}, tmp_path / "a.pt", mode=mode).result(timeout=60)  # the path is free
    saver.close()
    assert torch.equal(fastpersist.read_state_dict(tmp_path / "a.pt")["a"], torch.ones(4))

    ck = fastpersist.Checkpointer(tmp_path / "ck", every=1, mode=mode)
    gate.clear()
    blocker = busy(ck._saver)
    f = ck.save(2, {"w": torch.zeros(10)})
    assert f.cancel()
    ck.fence()
    gate.set()
    blocker.result(timeout=60)
    ck.save(3, {"w": torch.ones(10)}).result(timeout=60)
    ck.step(4, {"w": torch.ones(10)})
    ck.close()
    assert ck.latest() is not None and ck.latest().step in (3, 4)
    assert not ck._saver._snap._thread.is_alive() and not ck._saver._write._thread.is_alive()


def test_waiting_on_a_save_from_the_thread_that_runs_it_raises_instead_of_hanging(tmp_path):
    """A wait from one of the threads that run a save (code a save runs
    there, as a done-callback used to) for a save queued behind it on that
    same thread would never return: it raises."""
    saver = AsyncSaver()
    seen: dict = {}
    box: dict = {}
    gate = threading.Event()

    def on_the_write_thread():
        g = box["g"]
        for name, wait in (("result", g.result), ("exception", g.exception), ("wait_snapshot", g.wait_snapshot)):
            try:
                wait(timeout=30)
            except RuntimeError as e:
                seen[name] = str(e)

    saver._write.submit(lambda: gate.wait(60))  # (the write thread held until the save is queued)
    waiter = saver._write.submit(on_the_write_thread)
    box["g"] = saver.save({"a": torch.ones(2)}, tmp_path / "inner.pt")  # queued behind the waiter
    gate.set()
    waiter.result(timeout=60)
    assert set(seen) == {"result", "exception", "wait_snapshot"}, seen
    assert "would never return" in seen["result"]
    box["g"].result(timeout=60)  # from this thread it completes
    saver.close()


@pytest.mark.parametrize("call", ["result", "save to the same path", "write_state_dict", "wait_all", "close", "cancel"])
def test_a_done_callback_may_save_again_and_wait(tmp_path, call):
    """Regression: done-callbacks ran on the saver's write thread, and one
    that waited for a save queued behind it there hung the saver for ever
    (and the process at exit): a save started from it while another was
    queued, a write_state_dict to a path a later save was pending on,
    wait_all(), close(); cancel() ran them on the cancelling thread before
    the snapshot phase was ended, and one that waited for it hung cancel().
    Callbacks run on a thread of their own now, in order; their errors are
    logged."""
    code = textwrap.dedent(
        f"""
        import os, threading, torch, fastpersist
        from fastpersist.async_save import AsyncSaver
        d, call = {str(tmp_path)!r}, {call!r}
        saver = AsyncSaver()
        out = {{}}
        done = threading.Event()
        big = {{"w": torch.ones(4 << 20)}}

        def callback(f):
            try:
                if call == "result":
                    g = saver.save(big, os.path.join(d, "inner.pt"))
                    out["inner"] = g.result().bytes > 0
                elif call == "save to the same path":
                    g = saver.save({{"v": torch.full((4,), 2.0)}}, os.path.join(d, "later.pt"))
                    out["inner"] = g.result().bytes > 0
                elif call == "write_state_dict":
                    fastpersist.write_state_dict({{"v": torch.full((4,), 3.0)}}, os.path.join(d, "later.pt"))
                    out["inner"] = True
                elif call == "wait_all":
                    out["inner"] = saver.wait_all() == []
                elif call == "close":
                    saver.close()
                    out["inner"] = True
                else:
                    f.wait_snapshot()
                    out["inner"] = f.snapshot_done()
            finally:
                done.set()

        if call == "cancel":
            saver._write.submit(lambda: done.wait(60))  # (the save stays queued)
            f = saver.save(big, os.path.join(d, "c.pt"))
            f.add_done_callback(callback)
            assert f.cancel()
        else:
            f = saver.save(big, os.path.join(d, "outer.pt"))
            saver.save({{"v": torch.full((4,), 1.0)}}, os.path.join(d, "later.pt"))  # (queued behind)
            f.add_done_callback(callback)
        assert done.wait(60), "the callback never ended"
        assert out.get("inner") is True, out
        if call != "close":
            saver.close()
        print("OK")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
    if call in ("save to the same path", "write_state_dict"):
        # (the later call wins: it waited for the save queued before it)
        assert torch.load(tmp_path / "later.pt")["v"][0] == (2.0 if call == "save to the same path" else 3.0)


def test_a_save_made_inside_the_savers_own_step_is_written_at_once(tmp_path):
    """Regression (found in review): a signal handler runs on the thread
    it interrupted; one landing inside the saver's locked step (the lock
    reentrant, so its save entered the step) with no room for another
    save waited for a slot while holding the lock the saves in flight need
    to give theirs back: for ever. Such a save is written at once."""
    saver = AsyncSaver(max_pending=1)
    gate = threading.Event()
    saver._write.submit(lambda: gate.wait(60))
    first = saver.save({"a": torch.ones(2)}, tmp_path / "first.pt")  # in flight, held
    out = []

    def handler_like():
        with saver._lock:  # (as inside the step a signal interrupted)
            out.append(saver.save({"b": torch.full((2,), 2.0)}, tmp_path / "second.pt"))

    t = threading.Thread(target=handler_like, daemon=True)
    t.start()
    t.join(30)
    gate.set()
    assert not t.is_alive(), "the save inside the step never returned"
    assert out[0].done() and out[0].result().bytes > 0
    assert first.result(timeout=60).bytes > 0
    assert torch.load(tmp_path / "second.pt")["b"][0] == 2.0
    saver.close()


def test_a_save_a_done_callback_starts_at_exit_is_committed(tmp_path):
    """Regression: the exit drained the saves in flight once; a save a
    done-callback started meanwhile (copying to latest.pt when a save
    lands, say) was dropped without a word, or the process aborted with a
    temporary file left. The drain goes on until nothing new is in flight."""
    code = textwrap.dedent(
        f"""
        import os, torch, fastpersist
        d = {str(tmp_path)!r}
        def chain(f):
            fastpersist.save_async({{"w": torch.full((4 << 20,), 2.0)}}, os.path.join(d, "second.pt"))
        f = fastpersist.save_async({{"w": torch.full((4 << 20,), 1.0)}}, os.path.join(d, "first.pt"))
        f.add_done_callback(chain)
        """
    )
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        assert sorted(os.listdir(tmp_path)) == ["first.pt", "second.pt"], (os.listdir(tmp_path), r.stderr)
        assert torch.load(tmp_path / "second.pt")["w"][0] == 2.0
        for n in os.listdir(tmp_path):
            os.unlink(tmp_path / n)


@pytest.mark.parametrize("how", ["close", "dropped"])
def test_failures_nobody_read_are_logged_by_close_and_a_dropped_saver(tmp_path, how, caplog):
    """Regression: close() took the failures nobody had read from
    wait_all() and dropped them, and a saver dropped without close() lost
    them with it: a save that failed passed without a word. Both log them,
    as the exit does."""
    import gc
    import logging

    (tmp_path / "dir.pt").mkdir()  # a save there fails
    saver = AsyncSaver()
    f = saver.save({"a": torch.ones(2)}, tmp_path / "dir.pt")
    concurrent.futures.wait([f], timeout=60)
    concurrent.futures.wait(saver._write.jobs(), timeout=60)  # (the job's frame, which holds the saver, gone)
    del f
    with caplog.at_level(logging.ERROR, logger="fastpersist"):
        if how == "close":
            saver.close()
        else:
            del saver
            gc.collect()
    assert any("dir.pt was NOT saved" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.parametrize("mode", ["pipelined", "snapshot"])
def test_safetensors_metadata_is_taken_at_the_call(tmp_path, mode):
    """Regression: save_async kept the caller's metadata dict and read it
    in the background: a dict reused and updated right after the call put
    the new values in the file."""
    from safetensors import safe_open

    meta = {"step": "100"}
    gate = threading.Event()
    saver = AsyncSaver()
    saver._snap.submit(gate.wait)
    saver._write.submit(gate.wait)
    f = saver.save({"w": torch.ones(4)}, tmp_path / "m.safetensors", mode=mode, format="safetensors", metadata=meta)
    meta["step"] = "101"
    gate.set()
    f.result(timeout=60)
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as st:
        assert st.metadata() == {"step": "100"}
    saver.close()


def test_wait_all_reports_a_failure_nobody_read(tmp_path):
    """Regression: a background save that failed before wait_all() was
    called (its future never read) was not among wait_all()'s failures:
    the failure passed silently. Reported once; one whose outcome was read
    is the reader's."""
    saver = AsyncSaver()
    (tmp_path / "dir.pt").mkdir()  # a save there fails
    bad = saver.save({"a": torch.ones(2)}, tmp_path / "dir.pt")
    read = saver.save({"a": torch.ones(2)}, tmp_path / "dir.pt")
    with pytest.raises(fastpersist.WriteError):
        read.result(timeout=60)
    concurrent.futures.wait([bad], timeout=60)
    assert saver.wait_all(timeout=60) == [bad]
    assert saver.wait_all(timeout=60) == []  # once
    ok = saver.save({"a": torch.ones(2)}, tmp_path / "ok.pt")
    assert saver.wait_all(timeout=60) == [] and ok.result().bytes > 0
    saver.close()


@pytest.mark.parametrize("owner", ["AsyncSaver", "Checkpointer"])
def test_a_saver_dropped_without_close_ends_its_threads(tmp_path, owner):
    """Regression: an AsyncSaver (or a Checkpointer) dropped without
    close() kept its two threads for the life of the process: each thread
    held its last job, whose bound methods held the saver, so the saver's
    finalizer (which ends them) never ran."""
    import gc

    if owner == "AsyncSaver":
        s = AsyncSaver()
        saver = s
        for mode in ("pipelined", "snapshot"):
            s.save({"a": torch.ones(4)}, tmp_path / f"{mode}.pt", mode=mode).result(timeout=60)
    else:
        s = fastpersist.Checkpointer(tmp_path / "ck", every=1)
        saver = s._saver
        s.save(1, {"a": torch.ones(4)}).result(timeout=60)
        s.wait()
    threads = [saver._snap._thread, saver._write._thread]
    assert all(t is not None and t.is_alive() for t in threads)
    del s, saver
    gc.collect()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)


def test_two_threads_saving_to_one_path_in_both_modes_both_commit(tmp_path, monkeypatch):
    """Regression: a pipelined save called on one thread as a snapshot
    save was called on another read the saver's last save before the
    snapshot save was registered and registered after it: its write, on
    the write thread, waited for the snapshot save, whose write is queued
    there when its snapshot ends, behind it: both hung for ever (and the
    exit with them). Now the check and the registration are one step."""
    import threading

    from fastpersist import async_save

    saver = AsyncSaver(max_pending=2)
    p = tmp_path / "x.pt"
    registered = threading.Event()
    real = async_save.TensorVersions

    def held_back(*a, **kw):
        """The pipelined thread (having looked at the saver's last save,
        where it once looked first) is held until the snapshot save is
        registered."""
        if threading.current_thread().name == "pipelined" and not registered.is_set():
            registered.wait(5)
        return real(*a, **kw)

    monkeypatch.setattr(async_save, "TensorVersions", held_back)
    big = {"w": torch.ones(16 << 20)}  # a snapshot of 64 MiB: its write is queued a while after its registration
    futs = {}

    def snap():
        futs["snapshot"] = saver.save(big, p, mode="snapshot")
        registered.set()

    t2 = threading.Thread(
        target=lambda: futs.setdefault("pipelined", saver.save({"w": torch.zeros(4)}, p)), name="pipelined"
    )
    t2.start()
    time.sleep(0.2)
    t1 = threading.Thread(target=snap)
    t1.start()
    t1.join(30)
    t2.join(30)
    assert set(futs) == {"snapshot", "pipelined"}
    done, _ = concurrent.futures.wait(list(futs.values()), timeout=60)
    assert len(done) == 2, "the two saves wait for each other"
    for f in futs.values():
        f.result()
    saver.close()


def test_an_interrupt_as_a_save_registers_leaves_no_save_that_never_runs(tmp_path, monkeypatch):
    """Regression: a Ctrl-C landing while save_async registered its save
    (in the path's pending list, not yet with the saver) left a save that
    never runs: every later save to the path waited for it for ever. A
    save that cannot be registered whole is taken back."""
    import signal

    from fastpersist import async_save

    saver = AsyncSaver(max_pending=2)
    p = tmp_path / "x.pt"
    real = async_save.note_pending

    def interrupted(path, fut):
        real(path, fut)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, right here

    monkeypatch.setattr(async_save, "note_pending", interrupted)
    with pytest.raises(KeyboardInterrupt):
        saver.save({"w": torch.ones(4)}, p)
    monkeypatch.undo()
    later = saver.save({"w": torch.zeros(4)}, p)
    done, _ = concurrent.futures.wait([later], timeout=30)
    assert done, "the later save waits for one that never runs"
    later.result()
    saver.close()
    assert torch.equal(torch.load(p)["w"], torch.zeros(4))


def test_an_interrupt_once_a_save_is_queued_and_begun_leaves_it_tracked(tmp_path, monkeypatch):
    """Regression (found in a hunt): a Ctrl-C landing in save_async right
    after its save was queued, once its thread had begun it, took the save
    back: it was dropped from the saver's list (``pending()``, ``wait_all()``
    and ``close()`` no longer waited for it) and its version counters were
    let go while it still wrote. A save its thread has begun stays tracked."""
    import signal

    from fastpersist import async_save

    saver = AsyncSaver(max_pending=2)
    p = tmp_path / "x.pt"
    begun, release = threading.Event(), threading.Event()
    real_wait, real_submit = async_save.wait_for_earlier, async_save._Worker.submit

    def held_back(path, fut):
        begun.set()
        release.wait(30)
        return real_wait(path, fut)

    def submit(worker, fn, *args):
        done = real_submit(worker, fn, *args)
        assert begun.wait(30)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, right here
        return done

    monkeypatch.setattr(async_save, "wait_for_earlier", held_back)
    monkeypatch.setattr(async_save._Worker, "submit", submit)
    with pytest.raises(KeyboardInterrupt):
        saver.save({"w": torch.ones(4)}, p)
    monkeypatch.setattr(async_save._Worker, "submit", real_submit)
    tracked = saver.pending()
    release.set()
    assert len(tracked) == 1 and not tracked[0].cancelled()
    saver.wait_all(timeout=30)
    assert tracked[0].done() and tracked[0].exception() is None
    saver.close()
    assert torch.equal(torch.load(p)["w"], torch.ones(4))


_FORKED_WORKER = textwrap.dedent(
    """
    import json, multiprocessing as mp, os, sys, torch, fastpersist

    def work(d, how):
        sd = {f"w{k}": torch.full((256, 1024), float(k)) for k in range(16)}
        if how == "checkpointer":
            ck = fastpersist.Checkpointer(d, every=1)
            ck.step(1, sd)
        else:
            fastpersist.save_async(sd, os.path.join(d, "p.pt"), mode=how)
        # returns with the save in flight: the process ends in os._exit

    if __name__ == "__main__":
        p = mp.get_context("fork").Process(target=work, args=sys.argv[1:])
        p.start()
        p.join(120)
        print(p.exitcode)
    """
)


@pytest.mark.parametrize("how", ["pipelined", "snapshot", "checkpointer"])
def test_a_save_in_flight_when_a_forked_worker_returns_is_committed(tmp_path, how):
    """Regression: a process multiprocessing forks ends in os._exit after
    threading's exit callbacks, never running atexit's: a save_async (or a
    Checkpointer's save) still in flight when its target returned was
    dropped without a word (status 0, no file)."""
    r = subprocess.run(
        [sys.executable, "-c", _FORKED_WORKER, str(tmp_path), how], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and r.stdout.strip() == "0", r.stdout + r.stderr[-3000:]
    if how == "checkpointer":
        got = fastpersist.Checkpointer(tmp_path).load_latest()
        assert got is not None and got[0] == 1 and torch.all(got[1]["w3"] == 3)
    else:
        assert torch.all(fastpersist.read_state_dict(tmp_path / "p.pt")["w3"] == 3)


_DAEMON_AT_EXIT = textwrap.dedent(
    """
    import os, sys, threading, time, torch, fastpersist
    d, how = sys.argv[1], sys.argv[2]
    sd = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(96)}  # 384 MiB
    kept = []
    if how == "read":
        fastpersist.write_state_dict(sd, os.path.join(d, "x.pt"))
        work = lambda: kept.append(fastpersist.read_state_dict(os.path.join(d, "x.pt")))  # noqa: E731
    else:
        work = lambda: fastpersist.write_state_dict(sd, os.path.join(d, "x.pt"))  # noqa: E731
    threading.Thread(target=work, daemon=True).start()
    t = time.monotonic()
    while time.monotonic() - t < 30 and not (how == "write" and [n for n in os.listdir(d) if n.endswith(".fptmp")]):
        if how == "read":
            time.sleep(0.05)
            break
        time.sleep(0.001)
    # exits with the daemon thread's call in progress
    """
)


@pytest.mark.parametrize("how", ["write", "read"])
def test_a_daemon_threads_call_in_progress_at_exit_ends_cleanly(tmp_path, how):
    """Regression: a daemon thread inside write_state_dict or read_state_dict
    as the interpreter finalized was ended by unwinding through the core
    (CPython ends a daemon thread that takes the GIL back then): the
    process aborted (SIGABRT) with a temporary file left. The exit now
    waits for such a call (a save is committed), and any thread still in
    the core stops there instead of taking the GIL back."""
    for _ in range(3):
        for n in os.listdir(tmp_path):
            os.unlink(tmp_path / n)
        r = subprocess.run(
            [sys.executable, "-c", _DAEMON_AT_EXIT, str(tmp_path), how], capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
        assert os.listdir(tmp_path) == ["x.pt"]
        got = fastpersist.read_state_dict(tmp_path / "x.pt")
        assert len(got) == 96 and all(torch.all(got[f"w{i}"] == i) for i in (0, 47, 95))


def test_an_import_as_the_interpreter_shuts_down_registers_its_exit_hooks(monkeypatch):
    """Found in review: threading refuses new exit callbacks once the
    interpreter shuts down (RuntimeError), and an import of fastpersist
    then (a thread's lazy import) failed: atexit alone takes them."""
    import threading

    from fastpersist.async_save import register_exit

    def refused(fn):
        raise RuntimeError("can't register atexit after shutdown")

    monkeypatch.setattr(threading, "_register_atexit", refused, raising=False)
    register_exit(lambda: None)
