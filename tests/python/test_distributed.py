"""Parallel writes across ranks: 2 and 4 local processes over gloo."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import fastpersist
import pytest
import torch
from dist_worker import state
from helpers import assert_same

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, world: int, out, env=None) -> list:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, scenario, str(r), str(world), port, str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        for r in range(world)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    return [json.load(open(out / f"result-{r}.json")) for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_file_is_byte_identical(tmp_path, world):
    res = run_ranks("replicated", world, tmp_path)
    assert all(r["ok"] for r in res), res
    single = tmp_path / "single.pt"
    fastpersist.write_state_dict(state(0), single)
    assert (tmp_path / "ckpt.pt").read_bytes() == single.read_bytes()
    assert_same(state(0), torch.load(tmp_path / "ckpt.pt"))
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".fptmp")]


def test_replicated_device_storages_copy_only_their_part(tmp_path):
    """Storages taken as device storages (the CPU test hook): each rank copies
    only the bytes of its part; the file is still byte-identical."""
    res = run_ranks("replicated", 2, tmp_path, env={"FASTPERSIST_TEST_STAGE_CPU": "1"})
    assert all(r["ok"] for r in res), res
    fastpersist.write_state_dict(state(0), tmp_path / "single.pt")
    assert (tmp_path / "ckpt.pt").read_bytes() == (tmp_path / "single.pt").read_bytes()


def test_async_with_group(tmp_path):
    res = run_ranks("async", 2, tmp_path)
    assert all(r["ok"] for r in res), res
    assert_same(state(0), fastpersist.read_state_dict(tmp_path / "ckpt.pt"))


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_round_trip(tmp_path, world):
    res = run_ranks("sharded", world, tmp_path)
    assert all(r["ok"] for r in res), res
    assert [r["n"] for r in res] == [100 + r for r in range(world)]
    shards = fastpersist.read_state_dict(tmp_path / "sharded")
    assert len(shards) == world
    for r, sh in enumerate(shards):
        assert_same(state(100 + r), sh)
    # the first save's shards are gone; only the index and this save's shards remain
    names = sorted(os.listdir(tmp_path / "sharded"))
    assert "index.json" in names and len(names) == world + 1


@pytest.mark.parametrize("world", [2, 4])
def test_one_rank_failing_commits_nothing(tmp_path, world):
    (tmp_path / "ckpt.pt").write_bytes(b"previous")
    res = run_ranks("fail", world, tmp_path)
    assert not any(r["ok"] for r in res), res
    assert all(r["type"] == "DistributedCheckpointError" for r in res), res
    assert all("rank 1" in r["error"] for r in res), res
    assert (tmp_path / "ckpt.pt").read_bytes() == b"previous"
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith("result-")) == ["ckpt.pt"]


def test_sharded_failure_keeps_previous(tmp_path):
    res = run_ranks("sharded", 2, tmp_path)
    assert all(r["ok"] for r in res)
    before = sorted(os.listdir(tmp_path / "sharded"))
    for r in range(2):
        os.unlink(tmp_path / f"result-{r}.json")
    res = run_ranks("fail-sharded", 2, tmp_path)
    assert not any(r["ok"] for r in res) and all("rank 1" in r["error"] for r in res), res
    assert sorted(os.listdir(tmp_path / "sharded")) == before
    assert [s["n"] for s in fastpersist.read_state_dict(tmp_path / "sharded")] == [100, 101]


def test_different_objects_are_refused(tmp_path):
    res = run_ranks("mismatch", 2, tmp_path)
    assert not any(r["ok"] for r in res)
    assert all("different objects" in r["error"] for r in res), res
    assert not (tmp_path / "ckpt.pt").exists()


def test_ranks_given_different_directories_commit_nothing(tmp_path):
    """Regression (found in a hunt): ranks that passed different directories
    to a sharded save (or one path on disks of their own) all returned
    success; rank 0 committed an index naming a shard it had not got and
    removed the previous checkpoint's shards, so nothing could be read."""
    res = run_ranks("sharded", 2, tmp_path)
    assert all(r["ok"] for r in res), res
    before = sorted(os.listdir(tmp_path / "sharded"))
    res = run_ranks("sharded-apart", 2, tmp_path)
    assert all(r["ok"] for r in res), res
    assert all(r["raised"] and "every rank must pass the same directory" in r["raised"] for r in res), res
    assert sorted(os.listdir(tmp_path / "sharded")) == before
    assert [s["n"] for s in fastpersist.read_state_dict(tmp_path / "sharded")] == [100, 101]
    assert not [n for n in os.listdir(tmp_path / "elsewhere") if n.startswith("shard-")]


def test_sharded_needs_a_group(tmp_path):
    with pytest.raises(ValueError, match="group"):
        fastpersist.write_state_dict({}, tmp_path / "d", sharded=True)


_PEER_DIES = r"""
import contextlib, os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
import fastpersist, fastpersist.distributed as fd

def worker(rank, root, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    path = os.path.join(root, "ckpt.pt")
    fastpersist.write_state_dict({"w": torch.zeros(300_000)}, path, group=dist.group.WORLD)
    dist.barrier()
    if rank == 1:
        real = fd.use_engine

        @contextlib.contextmanager
        def dying(opts):
            with real(opts) as eng:
                class Dies:
                    def write_part(self, *a, **k):
                        eng.write_part(*a, **k)
                        os._exit(1)  # its part written, gone before it reports
                yield Dies()

        fd.use_engine = dying
    try:
        fastpersist.write_state_dict({"w": torch.ones(300_000)}, path, group=dist.group.WORLD)
        print("returned", flush=True)
    except fastpersist.DistributedCheckpointError as e:
        print("DistributedCheckpointError", flush=True)
    except Exception as e:
        print("other", type(e).__name__, e, flush=True)
    print("kept", float(fastpersist.read_state_dict(path)["w"].sum()) == 0.0, sorted(os.listdir(root)), flush=True)
    os._exit(0)

if __name__ == "__main__":
    root, port = sys.argv[1], int(sys.argv[2])
    ctx = mp.start_processes(worker, args=(root, port), nprocs=2, join=False, start_method="spawn")
    for p in ctx.processes:
        p.join(120)
"""


def test_a_peer_that_dies_is_a_distributed_checkpoint_error(tmp_path):
    """Regression: a rank that died during a distributed save gave the
    others gloo's own RuntimeError ("Connection reset by peer"), not the
    DistributedCheckpointError the README promises when a rank fails, so
    ``except DistributedCheckpointError`` missed it. Nothing was committed
    and the old checkpoint stayed, as now."""
    port = free_port()
    script = tmp_path / "peer_dies.py"
    script.write_text(_PEER_DIES)
    root = tmp_path / "out"
    root.mkdir()
    r = subprocess.run([sys.executable, str(script), str(root), str(port)], capture_output=True, text=True, timeout=300)
    lines = r.stdout.splitlines()
    assert "DistributedCheckpointError" in lines, r.stdout + r.stderr[-3000:]
    assert "kept True ['ckpt.pt']" in lines, r.stdout + r.stderr[-3000:]


_TIMEOUTS = r"""
import datetime, sys, torch.distributed as dist
from fastpersist.collectives import _timeout
kw = {} if sys.argv[2] == "default" else {"timeout": datetime.timedelta(seconds=7)}
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1, **kw)
print(_timeout())
"""


@pytest.mark.parametrize("given", ["default", "7s"])
def test_checkpoint_groups_take_the_timeout_the_user_gave(tmp_path, given):
    """Review: fastpersist's gloo groups took torch's 30-minute default
    whatever init_process_group was given (a stuck peer held the others far
    past the user's timeout); a timeout the user did not give (torch's own
    default, NCCL's shorter one) is not carried over."""
    r = subprocess.run(
        [sys.executable, "-c", _TIMEOUTS, str(tmp_path / "store"), given], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    want = "{}" if given == "default" else "{'timeout': datetime.timedelta(seconds=7)}"
    assert r.stdout.strip() == want


_SHARDED_RACE = r"""
import os, sys, time, torch, torch.distributed as dist
import fastpersist, fastpersist.distributed as fd
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
d = sys.argv[2]
g = dist.group.WORLD
fastpersist.write_state_dict({"v": torch.zeros(1000)}, d, sharded=True, group=g)
real, order = fd._commit_index, []

def a_commits_late(*args):
    if not order:  # save A: its shard written, its index not yet; save B runs whole now
        order.append("B")
        fastpersist.write_state_dict({"v": torch.full((1000,), 2.0)}, d, sharded=True, group=g)
    order.append("A")
    return real(*args)

fd._commit_index = a_commits_late
fastpersist.write_state_dict({"v": torch.ones(1000)}, d, sharded=True, group=g)
fd._commit_index = real
print(order, fastpersist.read_state_dict(d)[0]["v"][0].item(), len(os.listdir(d)))
old = time.time() - fastpersist.options.ABANDONED_SAVE_AGE - 60
for n in os.listdir(d):
    os.utime(os.path.join(d, n), (old, old))
fastpersist.write_state_dict({"v": torch.full((1000,), 3.0)}, d, sharded=True, group=g)
print(fastpersist.read_state_dict(d)[0]["v"][0].item(), len(os.listdir(d)))
"""


def test_two_sharded_saves_to_one_directory_never_remove_each_others_shards(tmp_path):
    """Regression: a sharded save's commit removed every shard of another
    save's name; two saves to one directory (two jobs given one path) then
    removed each other's committed shards, and the index committed last
    named a shard that was gone: both checkpoints lost. A commit now
    removes the shards of the index it replaces, and others only once
    untouched for ABANDONED_SAVE_AGE (a failed save removes its own at once)."""
    r = subprocess.run(
        [sys.executable, "-c", _SHARDED_RACE, str(tmp_path / "store"), str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["['B', 'A', 'A'] 1.0 3", "3.0 2"], r.stdout + r.stderr[-3000:]


_SHARDED_LATE_ERROR = r"""
import errno, os, sys, torch, torch.distributed as dist
import fastpersist, fastpersist.distributed as fd
from fastpersist import _core
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
d, how = sys.argv[2], sys.argv[3]
g = dist.group.WORLD
fastpersist.write_state_dict({"v": torch.zeros(1000)}, d, sharded=True, group=g)
real = fd._commit_index

def late(dirpath, *args):
    real(dirpath, *args)  # the index is renamed in; then:
    if how == "interrupt":
        raise KeyboardInterrupt()
    raise _core.DurabilityError(errno.EIO, "directory fsync failed", os.path.join(dirpath, fd.INDEX_NAME))

fd._commit_index = late
try:
    fastpersist.write_state_dict({"v": torch.ones(1000)}, d, sharded=True, group=g)
except fastpersist.DistributedCheckpointError as e:
    print("raised", "it is in place" in str(e), type(e.__cause__).__name__)
fd._commit_index = real
print(fastpersist.read_state_dict(d)[0]["v"][0].item(), len(os.listdir(d)))
"""


@pytest.mark.parametrize("how", ["interrupt", "durability"])
def test_an_error_after_the_index_is_renamed_in_keeps_the_new_checkpoint(tmp_path, how):
    """Regression: an interrupt (Ctrl-C) after the index was renamed in,
    before the commit returned, was taken for a failed commit: every rank
    removed its new shard, which the committed index names, and the
    checkpoint could not be read."""
    r = subprocess.run(
        [sys.executable, "-c", _SHARDED_LATE_ERROR, str(tmp_path / "store"), str(tmp_path / "ck"), how],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    cause = "KeyboardInterrupt" if how == "interrupt" else "DurabilityError"
    assert r.stdout.splitlines() == [f"raised True {cause}", "1.0 2"], r.stdout + r.stderr[-3000:]
