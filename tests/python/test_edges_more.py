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

import pytest
import torch

PRELUDE = """
import os, sys, time, warnings
import torch, fastpersist
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


def run_script(body: str, *args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    r = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
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
        ck.save(9, {"c": torch.ones(5) * 4}).result(timeout=20)
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
    r = run_script(FORK, str(tmp_path), exit_mode, env={"FASTPERSIST_IO_URING": io_uring})
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
    assert torch.load(tmp_path / "ck" / "ckpt-000000000009.pt")["state"]["c"][0] == 4
    assert sorted(os.listdir(tmp_path / "kids")) == sorted(f"{i}.pt" for i in range(20))
    for i in range(20):
        assert int(torch.load(tmp_path / "kids" / f"{i}.pt")["i"]) == i
