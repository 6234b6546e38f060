"""More integrity at the edges (issue 22, "also test"): what users do to a
running save that the other tests do not try: fork() in the training loop,
a file system that turns read-only or fills up while saves are queued, many
short-lived processes saving into one directory (some killed mid-save), a
directory removed while a save is queued.

Every scenario runs in a subprocess with a timeout: a hang is a failure,
never a stuck test run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import fastpersist
import pytest
import torch
from conftest import is_root
from fastpersist.checkpoint_manager import WRITER_LOCK

PRELUDE = """
import faulthandler, os, sys, time, warnings
import torch, fastpersist
if os.environ.get("EDGES_TIMEOUT"):
    faulthandler.dump_traceback_later(float(os.environ["EDGES_TIMEOUT"]), exit=True)  # a hang shows where
warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a multi-threaded process

def wait_child(pid, secs=60):
    t = time.time()
    while time.time() - t < secs:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hung"

def big(v, n=4):
    return {f"w{i}": torch.full((1 << 20,), float(v + i)) for i in range(n)}  # 4 MiB each
"""


def run_script(
    body: str, *args: str, timeout: float = 120, env: dict | None = None, watchdog: bool = True
) -> subprocess.CompletedProcess:
    """Run ``PRELUDE + body`` in a fresh interpreter. With ``watchdog``, a
    hang dumps every thread's stack before the timeout (not for scripts
    whose fork children exit through the interpreter: CPython's watchdog
    thread is not in the child, and the child's exit waits for it)."""
    code = PRELUDE + textwrap.dedent(body)
    r = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "EDGES_TIMEOUT": str(timeout - 10) if watchdog else "", **(env or {})},
    )
    return r


def temp_files(root) -> list:
    return sorted(os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".fptmp"))


def values(path) -> dict:
    return {k: float(v.flatten()[0]) for k, v in torch.load(path).items() if isinstance(v, torch.Tensor)}


# 1. os.fork() in the training loop while saves are in flight.

FORK = """
d, exit_mode = sys.argv[1], sys.argv[2]
opts = dict(arena_bytes=2 << 20, block_size=256 << 10)
futs = {
    "pipe": fastpersist.save_async(big(1), os.path.join(d, "pipe.pt"), **opts),
    "snap": fastpersist.save_async(big(2), os.path.join(d, "snap.pt"), mode="snapshot", **opts),
}
ck = fastpersist.Checkpointer(os.path.join(d, "ck"), every=1, **opts)
futs["ck"] = ck.save(1, big(3))
print("in flight at the fork:", sum(not f.done() for f in futs.values()), flush=True)
pid = os.fork()
if pid == 0:
    code = 1
    try:
        # The parent's saves: their futures end here (done, or failed with
        # InheritedSaveError), never hang; nothing waits for them.
        for f in futs.values():
            try:
                f.result(timeout=20)
            except fastpersist.InheritedSaveError:
                pass
        ck.wait()
        cd = os.path.join(d, "child")
        os.makedirs(cd)
        fastpersist.write_state_dict({"c": torch.ones(5)}, os.path.join(cd, "sync.pt"))
        fastpersist.save_async({"c": torch.ones(5) * 2}, os.path.join(cd, "async.pt")).result(timeout=20)
        fastpersist.save_async({"c": torch.ones(5) * 5}, os.path.join(cd, "snap.pt"), mode="snapshot").result(20)
        with fastpersist.Checkpointer(os.path.join(cd, "ck"), every=1) as cck:
            cck.save(7, {"c": torch.ones(5) * 3}).result(timeout=20)
        # The parent's Checkpointer saves into its directory: the child's
        # copy saving there too would be a second writer, refused as one.
        try:
            ck.save(9, {"c": torch.ones(5) * 4})
            raise AssertionError("a second writer was let in")
        except RuntimeError as e:
            assert "another Checkpointer" in str(e), e
        code = 0
    except BaseException as e:
        print("child:", repr(e), flush=True)
    if exit_mode == "exit":
        sys.exit(code)  # atexit handlers run: the parent's saves are not waited for
    os._exit(code)
status = wait_child(pid)
assert status == 0, f"child: {status}"
# Fork in a loop while saves are in flight, as DataLoader workers are made.
os.makedirs(os.path.join(d, "kids"))
loop = [fastpersist.save_async(big(10 + i, 1), os.path.join(d, f"loop{i}.pt"), **opts) for i in range(3)]
kids = []
for i in range(20):
    if i % 5 == 4:
        loop.append(fastpersist.save_async(big(20 + i, 1), os.path.join(d, f"loop{i % 3}.pt"), **opts))
    pid = os.fork()
    if pid == 0:
        try:
            fastpersist.write_state_dict({"i": torch.tensor(i)}, os.path.join(d, "kids", f"{i}.pt"))
            os._exit(0)
        except BaseException as e:
            print("kid:", repr(e), flush=True)
            os._exit(1)
    kids.append(pid)
assert [wait_child(k) for k in kids] == [0] * 20
for f in list(futs.values()) + loop:
    f.result(timeout=60)
ck.close()
print("PARENT OK", flush=True)
"""


@pytest.mark.parametrize("exit_mode,io_uring", [("_exit", "1"), ("exit", "0")])
def test_fork_while_saves_are_in_flight(tmp_path, exit_mode, io_uring):
    r = run_script(FORK, str(tmp_path), exit_mode, env={"FASTPERSIST_IO_URING": io_uring}, watchdog=False)
    assert r.returncode == 0 and "PARENT OK" in r.stdout, r.stdout + r.stderr
    assert temp_files(tmp_path) == []
    # The parent's saves, committed whole by the parent.
    assert values(tmp_path / "pipe.pt") == {f"w{i}": 1.0 + i for i in range(4)}
    assert values(tmp_path / "snap.pt") == {f"w{i}": 2.0 + i for i in range(4)}
    assert torch.load(tmp_path / "ck" / "ckpt-000000000001.pt")["state"]["w3"][0] == 6.0
    last = {i: 10.0 + i for i in range(3)}
    last.update({i % 3: 20.0 + i for i in range(4, 20, 5)})  # the last call to a path wins
    for i, v in last.items():
        assert values(tmp_path / f"loop{i}.pt") == {"w0": v}
    # The children's own saves.
    assert torch.all(torch.load(tmp_path / "child" / "sync.pt")["c"] == 1)
    assert torch.all(torch.load(tmp_path / "child" / "async.pt")["c"] == 2)
    assert torch.all(torch.load(tmp_path / "child" / "snap.pt")["c"] == 5)
    assert torch.load(tmp_path / "child" / "ck" / "ckpt-000000000007.pt")["state"]["c"][0] == 3
    assert not (tmp_path / "ck" / "ckpt-000000000009.pt").exists()  # (the child's, refused: a second writer)
    assert sorted(os.listdir(tmp_path / "kids")) == sorted(f"{i}.pt" for i in range(20))
    for i in range(20):
        assert int(torch.load(tmp_path / "kids" / f"{i}.pt")["i"]) == i


# 2. A file system that turns read-only, or fills up, while saves are queued.


@pytest.fixture
def ext4(tmp_path):
    """Make and mount a small loop-mounted ext4 (root only); unmounted at the end."""
    if not is_root():
        pytest.skip("needs root to mount a loop file system")
    mounted = []

    def make(name: str, size: str = "32M", features: str = "") -> str:
        img, mnt = tmp_path / f"{name}.img", tmp_path / name
        mnt.mkdir()
        subprocess.run(["truncate", "-s", size, str(img)], check=True)
        r = subprocess.run(["mkfs.ext4", "-q", *(["-O", features] if features else []), str(img)], capture_output=True)
        if r.returncode == 0:
            r = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot make a loop ext4: {r.stderr.decode().strip()}")
        mounted.append(str(mnt))
        return str(mnt)

    try:
        yield make
    finally:
        for m in reversed(mounted):
            if subprocess.run(["umount", m], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", m], capture_output=True)


# A save to a FIFO in snapshot mode holds the write thread until the FIFO
# is read: the saves called after it are queued, not started (snapshot
# saves, then at most one pipelined save: the call after a pipelined save
# waits for its snapshot phase, which is its write).
GATE = """
import errno, logging, subprocess, threading
from fastpersist.async_save import AsyncSaver
logging.basicConfig(level=logging.ERROR)
saver = AsyncSaver(max_pending=4)  # save_async's, with room for three saves behind the gate

def gate(d):
    fifo = os.path.join(d, "gate")
    os.mkfifo(fifo)
    f = saver.save({"g": torch.ones(4)}, fifo, mode="snapshot")
    def open_gate():
        with open(fifo, "rb") as r:
            r.read()
        f.result(timeout=30)
        os.unlink(fifo)
    return open_gate

def fails_with(fut, code):
    try:
        fut.result(timeout=60)
    except fastpersist.WriteError as e:
        assert e.errno == code, e
        assert isinstance(e, OSError) and e.filename, e
        return
    raise AssertionError("the save did not fail")
"""

READ_ONLY = """
mnt, healthy = sys.argv[1], sys.argv[2]
p = os.path.join(mnt, "model.pt")
fastpersist.write_state_dict({"prev": torch.ones(3)}, p)
ck = fastpersist.Checkpointer(os.path.join(mnt, "ck"), every=1)
ck.save(1, {"prev": torch.ones(3)}).result()
open_gate = gate(healthy)
queued = [saver.save({"new": torch.zeros(3)}, p, mode=m) for m in ("snapshot", "pipelined")]
subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
ck.save(2, {"new": torch.zeros(3)})
for s in range(3, 6):
    ck.step(s, {"new": torch.zeros(3)})  # failures are logged, training goes on
open_gate()
for f in queued:
    fails_with(f, errno.EROFS)
ck.close()  # the failure is logged; its telemetry cannot be written here, and that is no error either
fastpersist.save_async({"after": torch.ones(2)}, os.path.join(healthy, "after.pt")).result(timeout=30)
print("OK", flush=True)
"""


def test_queued_saves_to_a_file_system_turned_read_only(tmp_path, ext4):
    mnt = ext4("ro")
    r = run_script(GATE + READ_ONLY, mnt, str(tmp_path), timeout=90)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    assert "checkpoint of step 2 failed" in r.stderr and "Read-only" in r.stderr
    assert torch.all(torch.load(os.path.join(mnt, "model.pt"))["prev"] == 1)
    assert sorted(set(os.listdir(os.path.join(mnt, "ck"))) - {"checkpoints.jsonl", WRITER_LOCK}) == [
        "ckpt-000000000001.pt"
    ]
    assert temp_files(tmp_path) == []
    assert torch.all(torch.load(tmp_path / "after.pt")["after"] == 1)


FULL = """
mnt, healthy = sys.argv[1], sys.argv[2]
p = os.path.join(mnt, "model.pt")
fastpersist.write_state_dict({"prev": torch.ones(3)}, p)
ck = fastpersist.Checkpointer(os.path.join(mnt, "ck"), every=1)
ck.save(1, {"prev": torch.ones(3)}).result()
big = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(10)}  # 40 MiB, more than the file system holds
# Full mid-save: this file system has no fallocate (no extents), so nothing
# is reserved up front and a write half-way through fails.
open_gate = gate(healthy)
queued = [saver.save(big, p, mode=m, io_uring=u) for m, u in [("snapshot", True), ("snapshot", False), ("pipelined", False)]]
open_gate()
for f in queued:
    fails_with(f, errno.ENOSPC)
ck.save(2, big)
ck.wait()
# Full before the save starts: nothing left at all.
open_gate = gate(healthy)
queued = saver.save({"new": torch.zeros(1 << 18)}, p)
with open(os.path.join(mnt, "filler"), "wb", buffering=0) as f:
    try:
        while True:
            f.write(bytes(1 << 16))
    except OSError as e:
        assert e.errno == errno.ENOSPC
open_gate()
fails_with(queued, errno.ENOSPC)
ck.save(3, {"new": torch.zeros(1 << 18)})
ck.step(4, {"new": torch.zeros(1 << 18)})
ck.close()  # failures logged, telemetry not written: no error
os.unlink(os.path.join(mnt, "filler"))
fastpersist.save_async({"after": torch.ones(2)}, p).result(timeout=30)  # space again: the path works
print("OK", flush=True)
"""


def test_queued_saves_to_a_file_system_that_fills_up(tmp_path, ext4):
    mnt = ext4("full", "32M", "^extent,^64bit")
    r = run_script(GATE + FULL, mnt, str(tmp_path), timeout=90)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    assert "checkpoint of step 2 failed" in r.stderr and "No space left" in r.stderr
    assert torch.all(torch.load(os.path.join(mnt, "model.pt"))["after"] == 1)
    assert torch.all(torch.load(os.path.join(mnt, "ck", "ckpt-000000000001.pt"))["state"]["prev"] == 1)
    assert sorted(set(os.listdir(os.path.join(mnt, "ck"))) - {"checkpoints.jsonl", WRITER_LOCK}) == [
        "ckpt-000000000001.pt"
    ]
    assert temp_files(tmp_path) == []


# 3. Many short-lived processes saving into one directory, some killed.

MANY = """
import json, signal
d = sys.argv[1]

def worker(i):
    for j in range(10):
        path = os.path.join(d, "shared.pt" if j % 2 == 0 else f"own{i}.pt")
        obj = {"proc": i, "save": j, "w": torch.full((1000 * (1 + j),), float(100 * i + j))}
        if j % 3 == 0:
            fastpersist.save_async(obj, path, mode="snapshot" if j % 2 else "pipelined").result(timeout=60)
        else:
            fastpersist.write_state_dict(obj, path)

def victim(i):
    big = {"proc": 100 + i, "w": torch.full((16 << 20,), float(100 + i))}  # 64 MiB
    if i == 0:
        while True:
            fastpersist.write_state_dict(big, os.path.join(d, "shared.pt"))
    ck = fastpersist.Checkpointer(d, every=1, keep_last=1000)
    for s in range(10**6):
        ck.save(s, big).result()

def start(fn, i):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn(i)
            code = 0
        finally:
            os._exit(code)
    return pid

workers = [start(worker, i) for i in range(8)]
victims = [start(victim, i) for i in range(2)]
# Each victim is killed while a save of it is under way: once its temporary file is there.
for pid in victims:
    t = time.time()
    while not any(f".{pid}." in n and n.endswith(".fptmp") for n in os.listdir(d)):
        assert time.time() - t < 60, "no save of the victim started"
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
codes = [wait_child(p) for p in workers + victims]
assert codes == [0] * 8 + [-9, -9], codes
left = sorted(n for n in os.listdir(d) if any(f".{p}." in n for p in victims))
assert len(left) >= 2 and all(fastpersist._core.is_temp_name(n) for n in left), left
print(json.dumps(left), flush=True)
# Leftovers old enough to be over: the next save to that path, and the next
# Checkpointer, remove those of the dead processes, and only those.
old = time.time() - 3600
for n in left:
    os.utime(os.path.join(d, n), (old, old))
fastpersist.write_state_dict({"proc": -1, "save": 0, "w": torch.zeros(1)}, os.path.join(d, "shared.pt"))
fastpersist.Checkpointer(d).close()
print("OK", flush=True)
"""


def test_many_short_lived_processes_save_into_one_directory(tmp_path):
    import json

    from fastpersist import _core

    d = tmp_path
    others = {
        "notes.txt": b"notes",
        ".shared.pt.fptmp": b"a lookalike",
        "shared.pt.1.2.fptmp": b"no leading dot",
        ".other.pt.4000000.1.fptmp": b"another target's leftover",
        ".ckpt-000000000001.pt.4000000.1.fptmp.bak": b"a lookalike",
    }
    for n, data in others.items():
        (d / n).write_bytes(data)
        os.utime(d / n, (1e9, 1e9))
    before = {n: os.stat(d / n) for n in others}
    held = _core.TempFile(str(d / "shared.pt"))  # a live writer's file: locked, however old
    os.utime(held.temp_path, (1e9, 1e9))
    try:
        r = run_script(MANY, str(d), timeout=110)
        assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
        left = json.loads(r.stdout.splitlines()[0])
        assert any(n.startswith(".shared.pt.") for n in left) and any(n.startswith(".ckpt-") for n in left), left
        names = set(os.listdir(d))
        assert not names & set(left), "leftovers of the killed processes were not swept"
        assert os.path.basename(held.temp_path) in names
        assert _core.temp_file_in_use(held.temp_path)
    finally:
        held.abort()
    for n, st in before.items():
        now = os.stat(d / n)
        assert (now.st_ino, now.st_mtime, now.st_size) == (st.st_ino, st.st_mtime, st.st_size), n
    names = set(os.listdir(d))
    assert not [n for n in names if _core.is_temp_name(n) and n not in others], names
    # Every file is whole, and holds one of the saves made to its path.
    assert torch.load(d / "shared.pt")["proc"] == -1
    for i in range(8):
        got = torch.load(d / f"own{i}.pt")
        assert (got["proc"], got["save"]) == (i, 9)
        assert torch.all(got["w"] == 100 * i + 9) and got["w"].numel() == 10_000
    ckpts = sorted(n for n in names if n.startswith("ckpt-"))
    for n in ckpts:
        got = torch.load(d / n)["state"]
        assert got["proc"] == 101 and torch.all(got["w"] == 101)


# 4. Ctrl-C during a save, and a directory removed or renamed under queued saves.

INTERRUPTS = """
import errno, shutil, signal, threading
d = sys.argv[1]
state = {f"w{i}": torch.full((2 << 20,), float(i)) for i in range(8)}  # 64 MiB
p = os.path.join(d, "k.pt")
fastpersist.write_state_dict({"prev": torch.ones(2)}, p)
for delay in (0.001, 0.01, 0.03, 0.1):
    threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        fastpersist.write_state_dict(state, p)
        time.sleep(1)  # the interrupt lands here instead
    except KeyboardInterrupt:
        pass
    # Whole: the previous checkpoint or the new one, never a temporary file.
    assert not [n for n in os.listdir(d) if n.endswith(".fptmp")], os.listdir(d)
    assert sorted(torch.load(p)) in (["prev"], sorted(state)), delay
fastpersist.write_state_dict({"after": torch.ones(2)}, p)
for how in ("removed", "renamed"):
    sub = os.path.join(d, how)
    os.makedirs(sub)
    ahead = fastpersist.save_async(state, os.path.join(d, "ahead.pt"))
    queued = fastpersist.save_async({"x": torch.ones(2)}, os.path.join(sub, "x.pt"))
    if how == "removed":
        shutil.rmtree(sub)
    else:
        os.rename(sub, sub + "-moved")
    try:
        queued.result(timeout=60)
        raise AssertionError("saved into a directory that is gone")
    except fastpersist.WriteError as e:
        # The directory gone before the queued save began (its temporary file
        # cannot be made), or as it wrote (its rename finds no directory).
        assert e.errno == errno.ENOENT and e.filename in (sub, os.path.join(sub, "x.pt")), e
    ahead.result(timeout=60)
assert os.listdir(os.path.join(d, "renamed-moved")) == []
fastpersist.save_async({"x": torch.ones(2)}, os.path.join(d, "x.pt")).result(timeout=60)
print("OK", flush=True)
"""


def test_interrupted_save_and_directory_gone_under_a_queued_save(tmp_path):
    r = run_script(INTERRUPTS, str(tmp_path), timeout=90)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    assert sorted(os.listdir(tmp_path)) == ["ahead.pt", "k.pt", "renamed-moved", "x.pt"]
    assert list(torch.load(tmp_path / "k.pt")) == ["after"]


def test_forked_child_stages_with_its_own_buffers(tmp_path):
    """Staging memory (and every engine arena) is not inherited by a fork
    child (MADV_DONTFORK: registered memory is not copied into each
    DataLoader worker); a child's staged save makes its own buffers and
    never touches the parent's idle ones."""
    code = textwrap.dedent(
        f"""
        import os, sys, torch, fastpersist
        os.environ["FASTPERSIST_TEST_STAGE_CPU"] = "1"
        os.environ["FASTPERSIST_STAGE_CHUNK"] = str(3 * 4096)
        sd = {{"a": torch.arange(50_000.0), "b": torch.ones(7, dtype=torch.int8)}}
        fastpersist.write_state_dict(sd, {str(tmp_path / "parent.pt")!r})  # leaves an idle staging buffer
        pid = os.fork()
        if pid == 0:
            try:
                fastpersist.write_state_dict(sd, {str(tmp_path / "child.pt")!r})
                ok = True
            except BaseException as e:
                print(repr(e), file=sys.stderr)
                ok = False
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr.decode()[-2000:])
    # Checked here (torch's own thread pool is not fork-safe in the child).
    got = torch.load(tmp_path / "child.pt")
    assert torch.equal(got["a"], torch.arange(50_000.0)) and torch.equal(got["b"], torch.ones(7, dtype=torch.int8))


def test_an_interrupt_as_a_save_pauses_the_collector_leaves_it_running(tmp_path):
    """Regression: a KeyboardInterrupt landing right after gc_paused
    disabled the collector (before it counted the pause) left Python's
    cyclic GC off for the rest of the process. An interrupt before each
    statement of the pause's entry leaves it on."""
    import gc
    import inspect
    import sys

    from fastpersist import options

    code = inspect.unwrap(options.gc_paused).__code__
    lines, first = inspect.getsourcelines(code)
    until = first + next(i for i, s in enumerate(lines) if "yield" in s)
    seen: list = []  # the lines of the entry that run, in order

    def watch(frame, event, arg):
        if event == "line" and frame.f_lineno < until and frame.f_lineno not in seen:
            seen.append(frame.f_lineno)
        return watch

    sys.settrace(lambda frame, event, arg: watch if frame.f_code is code else None)
    try:
        with options.gc_paused():
            pass
    finally:
        sys.settrace(None)
    entry = list(seen)
    assert len(entry) >= 3, entry
    sd = {"w": torch.ones(4)}
    for line in entry:
        fired = []

        def local(frame, event, arg, line=line, fired=fired):
            if event == "line" and frame.f_lineno == line and not fired:
                fired.append(line)
                raise KeyboardInterrupt(f"before line {line}")
            return local

        def tracer(frame, event, arg, local=local):
            return local if frame.f_code is code else None

        sys.settrace(tracer)
        try:
            with pytest.raises(KeyboardInterrupt):
                fastpersist.write_state_dict(sd, tmp_path / "x.pt")
        finally:
            sys.settrace(None)
        assert fired == [line]
        assert gc.isenabled() and options._gc_depth == 0, line
    fastpersist.write_state_dict(sd, tmp_path / "x.pt")
    assert gc.isenabled()


def test_a_child_forked_while_a_save_pauses_the_collector_has_it_running(tmp_path):
    """Regression: os.fork() while another thread's save had the collector
    paused (a DataLoader worker started during a background save) left the
    child's cyclic GC off for ever."""
    import gc

    from fastpersist import options

    with options.gc_paused():
        assert not gc.isenabled()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.write(w, f"{gc.isenabled()} {options._gc_depth}".encode())
            os._exit(0)
        os.close(w)
        got = os.read(r, 100).decode()
        os.close(r)
        os.waitpid(pid, 0)
    assert got == "True 0"
    assert gc.isenabled()


def test_ctrl_c_while_the_exit_waits_for_saves_ends_the_process_cleanly(tmp_path):
    """Regression: Ctrl-C while the exit's drain waited for a save in flight
    aborted the process (SIGABRT: finalization ended an engine thread
    inside the core by unwinding through it) or ended it with status 0 and
    the save silently dropped. Now the saves given up are logged as NOT
    saved and the process ends with status 130; the file at the path is
    the old one or the new one, whole."""
    import signal

    p = tmp_path / "ckpt.pt"
    child = textwrap.dedent(
        f"""
        import sys, torch, fastpersist
        state = {{f"t{{i}}": torch.full((65536,), 1.0) for i in range(400)}}
        fastpersist.save_async(state, {str(p)!r}, mode=sys.argv[1])
        print("exiting", flush=True)
        """
    )
    for i, mode in enumerate(["snapshot", "pipelined", "snapshot", "pipelined"]):
        fastpersist.write_state_dict({"t0": torch.zeros(65536)}, p)
        pr = subprocess.Popen([sys.executable, "-c", child, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert pr.stdout.readline() == b"exiting\n"
        time.sleep(0.02 * i)
        pr.send_signal(signal.SIGINT)
        _, err = pr.communicate(timeout=120)
        assert pr.returncode in (0, 130, -signal.SIGINT), (pr.returncode, err.decode()[-2000:])
        value = float(fastpersist.read_state_dict(p)["t0"][0])
        if pr.returncode == 130:
            assert b"NOT saved" in err
            assert value in (0.0, 1.0)
        else:  # the interrupt came before or after the drain: the save was not dropped
            assert value == 1.0, (pr.returncode, err.decode()[-2000:])


def test_an_interrupted_wait_for_the_engine_leaves_another_threads_hold_alone(tmp_path):
    """Regression (of this change's first fix): the release after an
    interrupted acquire let go of the engine's lock whoever held it, so a
    Ctrl-C while the main thread waited for a background save's engine
    freed that save's lock for a third thread to take."""
    import signal
    import threading

    from fastpersist.options import EngineOptions, get_engine

    lock, _ = get_engine(EngineOptions.resolve())
    holding, done = threading.Event(), threading.Event()

    def holder():
        lock.acquire()
        holding.set()
        done.wait(30)
        lock.release()

    t = threading.Thread(target=holder)
    t.start()
    assert holding.wait(10)
    threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            fastpersist.write_state_dict({"w": torch.ones(4)}, tmp_path / "x.pt")
        assert not lock.acquire(blocking=False), "the other thread's hold was let go"
    finally:
        done.set()
        t.join(30)
    fastpersist.write_state_dict({"w": torch.ones(4)}, tmp_path / "x.pt")


_PREPARE_THEN_EXIT = r"""
import sys, torch
from fastpersist.async_save import AsyncSaver
s = AsyncSaver()
f = s.prepare_many([[torch.zeros(3_000_000)], [torch.zeros(1_000_000)]], background=True)
if sys.argv[1] == "wait":
    f.result()
print("exiting", flush=True)
"""


@pytest.mark.parametrize("wait", ["wait", "no wait"])
def test_the_process_exits_normally_with_a_snapshot_buffer_made_in_the_background(wait):
    """Regression (found through every adapter's default, which prepares
    the snapshot buffers in the background after the first optimizer
    step): a process ending while prepare(background=True) ran, or just
    after it finished, aborted (SIGABRT, status 134): the daemon thread
    was inside the core, or still dropping the job's tensors, as the
    interpreter finalized. The exit now waits for every background job,
    and a job lets go of what it holds before its future resolves."""
    for _ in range(5):
        r = subprocess.run(
            [sys.executable, "-c", _PREPARE_THEN_EXIT, wait], capture_output=True, text=True, timeout=120
        )
        assert (r.returncode, r.stdout) == (0, "exiting\n"), r.stderr[-2000:]


def test_leftovers_that_fill_the_disk_are_removed_before_the_save_needs_the_room(ext4):
    """Regression: leftovers of killed saves were swept only after a
    commit; once they filled the disk every later save to that path failed
    with ENOSPC and none ever reached the sweep. The sweep now comes before
    the save reserves its room."""
    import fastpersist.options as fo

    mnt = ext4("full", "24M")
    path = os.path.join(mnt, "model.pt")
    sd = {"a": torch.full((1_500_000,), 1.0)}  # 6 MB
    fastpersist.write_state_dict(sd, path)
    old = time.time() - 3 * 3600
    left = []
    for pid in (999_999_991, 999_999_992):
        p = os.path.join(mnt, f".model.pt.{pid}.0.fptmp")
        with open(p, "wb") as f:
            f.write(b"\0" * (6 << 20))
        os.utime(p, (old, old))
        left.append(p)
    st = os.statvfs(mnt)
    assert st.f_bavail * st.f_frsize < 6 << 20  # no room for another copy beside the file
    sd["a"] += 1
    fo._swept.clear()  # (a process that has not swept there yet)
    fastpersist.write_state_dict(sd, path)
    assert not any(os.path.exists(p) for p in left)
    assert torch.equal(fastpersist.read_state_dict(path)["a"], sd["a"])


def test_a_long_running_process_removes_leftovers_that_were_young_at_its_first_save(tmp_path, monkeypatch):
    """Regression: a process swept a target's leftovers once, at its first
    commit there; a leftover then younger than TEMP_MIN_AGE stayed for as
    long as the process ran (a Checkpointer's, until a new Checkpointer was
    made). Both sweep again, at most once every SWEEP_EVERY seconds."""
    import fastpersist.options as fo
    from fastpersist.checkpoint_manager import ckpt_name

    monkeypatch.setattr(fo, "SWEEP_EVERY", 0.0, raising=False)
    path = tmp_path / "model.pt"
    ck_dir = tmp_path / "ck"
    ck_dir.mkdir()
    young = [tmp_path / ".model.pt.999999991.0.fptmp", ck_dir / f".{ckpt_name(1)}.999999991.0.fptmp"]
    for p in young:
        p.write_bytes(b"a killed save's")
    with fastpersist.Checkpointer(ck_dir, every=1, keep_last=2) as ck:
        ck.save(2, {"w": torch.ones(4)})
        ck.wait()
        fastpersist.write_state_dict({"w": torch.ones(4)}, path)
        assert all(p.exists() for p in young)  # too young then
        old = time.time() - fo.TEMP_MIN_AGE - 60
        for p in young:
            os.utime(p, (old, old))
        ck.save(3, {"w": torch.ones(4)})
        ck.wait()
        fastpersist.write_state_dict({"w": torch.ones(4)}, path)
        assert not any(p.exists() for p in young)


@pytest.mark.parametrize("length", [216, 217, 250])
def test_leftovers_of_a_target_with_a_long_name_are_swept(tmp_path, length):
    """Regression: the temporary files of a target whose name is over 216
    bytes carry the name cut and hashed; the sweep before a save matched
    only the whole name and never removed them (a killed save's leftover
    stayed for ever). A leftover of another long name that shares the cut
    prefix is not this target's, and stays."""
    from fastpersist import _core

    name = ("m" * (length - 3)) + ".pt"
    other = ("m" * (length - 3)) + ".PT"
    old = time.time() - 7200
    left = []
    for target in (name, other):
        t = _core.TempFile(str(tmp_path / target))
        keep = tmp_path / ("kept-" + str(len(left)))
        os.link(t.temp_path, keep)  # the temporary name, unlocked once the writer is gone
        t.abort()
        os.rename(keep, t.temp_path)
        os.utime(t.temp_path, (old, old))
        left.append(os.path.basename(t.temp_path))
    if length > _core.TEMP_NAME_PART_MAX:
        assert left[0] != left[1] and left[0][:100] == left[1][:100]
    fastpersist.write_state_dict({"w": torch.ones(2)}, tmp_path / name)
    names = set(os.listdir(tmp_path))
    assert left[0] not in names and left[1] in names, names


@pytest.mark.skipif(not is_root(), reason="drops to another user: needs root")
def test_make_dirs_in_a_directory_one_may_write_but_not_list():
    """Regression (found in review): options.make_dirs fsynced each parent
    it made a directory in by opening it; in a drop box (mode 1733: write
    and enter, not list) that raised PermissionError after the directory
    was made, and every save that makes its folder failed there, where
    os.makedirs had worked."""
    import shutil
    import tempfile
    from pathlib import Path

    base = Path(tempfile.mkdtemp(dir="/tmp"))  # (pytest's own folders are root's alone)
    os.chmod(base, 0o755)
    drop = base / "dropbox"
    drop.mkdir()
    os.chmod(drop, 0o1733)
    code = textwrap.dedent(
        """
        import os, sys
        from fastpersist.options import make_dirs  # (imported first: the venv is root's)
        os.setgid(65534); os.setuid(65534)
        make_dirs(os.path.join(sys.argv[1], "run1", "ckpts"))
        print("ok")
        """
    )
    try:
        r = subprocess.run([sys.executable, "-c", code, str(drop)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "ok" in r.stdout, r.stderr
        assert (drop / "run1" / "ckpts").is_dir()
    finally:
        shutil.rmtree(base)
