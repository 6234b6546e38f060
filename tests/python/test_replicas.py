"""The peer tier (issue 20, part 2): four gloo processes on the CPU, two
"nodes" of two ranks (LOCAL_WORLD_SIZE=2), each rank with its own
"node-local" directory under tmp_path (see replica_worker.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import fastpersist
import pytest
from fastpersist import cli
from fastpersist.checkpoint_manager import ckpt_name
from fastpersist.replicas import Ring, ring_shifts
from fastpersist.verify import verify_file
from replica_worker import rank_dir

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "replica_worker.py")
WORLD = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(scenario: str, out, args=None) -> list:
    port = str(_free_port())
    for r in range(WORLD):
        try:
            os.unlink(out / f"result-{r}.json")
        except FileNotFoundError:
            pass
    env = {**os.environ, "LOCAL_WORLD_SIZE": "2"}
    return [
        subprocess.Popen(
            [sys.executable, WORKER, scenario, str(r), str(WORLD), port, str(out), json.dumps(args or {})],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(WORLD)
    ]


def _run(scenario: str, out, args=None) -> list:
    procs = _start(scenario, out, args)
    try:
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
    finally:
        for p in procs:  # none is left behind when one fails or hangs
            if p.poll() is None:
                p.kill()
                p.communicate()
    res = [json.load(open(out / f"result-{r}.json")) for r in range(WORLD)]
    assert all(r["ok"] for r in res), res
    return res


def _steps(d) -> list:
    return sorted(int(n[5:-3]) for n in os.listdir(d) if n.startswith("ckpt-") and n.endswith(".pt"))


def _events(d, kind: str) -> list:
    with open(os.path.join(d, "checkpoints.jsonl")) as f:
        return [e for e in map(json.loads, f) if e["event"] == kind]


def test_ring_layouts():
    # two nodes of two ranks: each rank's holder is the same local rank on the other node
    assert ring_shifts([0, 0, 1, 1], 1) == [2]
    assert ring_shifts(["a", "b", "a", "b"], 1) == [1]
    assert ring_shifts([0, 0, 1, 1, 2, 2], 2) == [2, 4]
    ring = Ring.build([10, 11, 12, 13], 11, 1, [0, 0, 1, 1])
    assert ring.holders_of(11) == [13] and ring.sources() == [13]
    assert ring.holders_of(12) == [10]
    with pytest.raises(ValueError, match="one node"):
        ring_shifts([7, 7, 7], 1)
    with pytest.raises(ValueError, match="only 2 nodes"):
        ring_shifts([0, 0, 1, 1], 2)
    with pytest.raises(ValueError, match="no ring"):
        ring_shifts([0, 0, 0, 1], 1)


def test_bad_arguments_without_a_group(tmp_path):
    with pytest.raises(ValueError, match="group="):
        fastpersist.Checkpointer(tmp_path, replicate=1)
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="replicate must be"):
            fastpersist.Checkpointer(tmp_path, replicate=bad)
    with pytest.raises(ValueError, match="only with replicate"):
        fastpersist.Checkpointer(tmp_path, nodes=[0, 1])
    import torch.distributed as dist

    if not dist.is_initialized():
        with pytest.raises(ValueError, match="init_process_group"):
            fastpersist.Checkpointer(tmp_path, group=object())
    assert not os.listdir(tmp_path)  # nothing made before the arguments were checked


def test_node_loss_damaged_file_and_bad_arguments(tmp_path, capsys):
    """One launch of 4 ranks: bad arguments; train 4 steps; node 1's
    directories deleted, a new Checkpointer on every rank: all resume step 4
    (ranks 2 and 3 from their holders on node 0); train to step 6; rank 1's
    newest file damaged: all resume step 6, rank 1's from rank 3."""
    res = _run("lifecycle", tmp_path)
    for r in res:
        e = r["errors"]
        assert "on one node" in e["one_node"] and "LOCAL_WORLD_SIZE" in e["one_node"], e
        assert "spans only 2 nodes" in e["too_many"], e
        assert "LOCAL_WORLD_SIZE" in e["no_layout"] and "nodes=" in e["no_layout"], e
        assert "3 entries" in e["nodes_len"] and "4 ranks" in e["nodes_len"], e
        assert "on one node" in e["one_node_by_nodes"], e
    # nodes=["a", "b", "a", "b"]: rank r's replicas are held by r + 1
    for r in range(WORLD):
        assert res[r]["errors"]["interleaved_held"] == [f"rank-{(r - 1) % WORLD}"]
    assert [r["fresh"] for r in res] == [{"resumed": None, "latest": None}] * WORLD, res
    # retention keeps 2 steps, on the replicas too; a replica is byte-identical
    assert all(r["trained"] == {"own": [3, 4], "held": [3, 4], "same": True} for r in res), res
    assert [r["after_node_loss"] for r in res] == [{"resumed": 4, "right_bytes": True}] * WORLD, res
    assert [r["after_damage"] for r in res] == [{"resumed": 6, "right_bytes": True}] * WORLD, res
    for r in range(WORLD):
        d = rank_dir(str(tmp_path), r)
        holder = (r + 2) % WORLD
        ev = _events(d, "replicated")
        assert [e["step"] for e in ev] == [5, 6] if r >= 2 else [1, 2, 3, 4, 5, 6]
        assert ev[-1]["to_rank"] == holder and ev[-1]["bytes"] > 0 and ev[-1]["gbps"] > 0
        assert ev[-1]["lag_steps"] >= 0
        fetched = [(e["step"], e["from_rank"], e["tier"]) for e in _events(d, "fetched")]
        assert fetched == {0: [], 1: [(6, 3, "peer")], 2: [(4, 0, "peer")], 3: [(4, 1, "peer")]}[r], fetched
    d1 = rank_dir(str(tmp_path), 1)
    verify_file(os.path.join(d1, ckpt_name(6)))  # the damaged file was replaced
    # The CLI shows the peer tier: what this rank's holder has, what it holds.
    assert cli.main(["ls", "--verify", d1]) == 0
    out = capsys.readouterr().out
    assert "local+peer" in out and "replicas held for rank 3" in out and "CORRUPT" not in out, out


def test_kill_during_replication_keeps_the_previous_replica(tmp_path, capsys):
    procs = _start("kill", tmp_path)
    procs[2].wait(timeout=120)
    assert procs[2].returncode == -signal.SIGKILL, procs[2].stderr.read()
    for p in procs:  # the launcher takes the job down
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.communicate()
    held = os.path.join(rank_dir(str(tmp_path), 2), "replicas", "rank-0")
    names = os.listdir(held)
    assert _steps(held) == [1, 2], names
    assert any(n.startswith(".ckpt-000000000003.pt.") and n.endswith(".fptmp") for n in names), names
    assert cli.main(["ls", rank_dir(str(tmp_path), 2)]) == 0
    out = capsys.readouterr().out
    assert "replicas held for rank 0" in out and "temporary (an unfinished transfer)" in out, out
    # Rank 0's node-local directory is lost too: all ranks resume step 2.
    shutil.rmtree(rank_dir(str(tmp_path), 0))
    res = _run("resume", tmp_path)
    assert [r["resumed"] for r in res] == [2] * WORLD and all(r["right_bytes"] for r in res), res
    assert _steps(rank_dir(str(tmp_path), 0)) == [2]
    # replication in the background: rank 0 trained on while its holder was held back
    assert [r["nonblocking"] for r in res] == [[1, 2, 3]] * WORLD, res
    # every="auto": all ranks checkpoint the steps the group's first rank chose
    assert [r["auto"] for r in res] == [[3, 6, 9]] * WORLD, res
    assert _steps(tmp_path / "auto" / "rank-1" / "replicas" / "rank-3") == [3, 6, 9]


def test_ranks_of_a_group_stage_to_places_of_their_own(tmp_path):
    """Regression: every rank of a group staged to ``<stage_dir>/ckpt-<step>.pt``,
    the same name, so the last rank to copy won, and after a node loss (or
    a damaged local copy) every rank restored that one rank's state,
    silently. Each rank now stages into ``<stage_dir>/rank-<global rank>/``
    and gets its own state back."""
    res = _run("stage", tmp_path)
    assert [r["restored"] for r in res] == [{"step": 2, "rank": r} for r in range(WORLD)]
    assert all(r["same"] for r in res)
    shared = tmp_path / "shared"
    assert sorted(os.listdir(shared)) == [f"rank-{r}" for r in range(WORLD)]
    assert all(_steps(shared / f"rank-{r}") == [1, 2] for r in range(WORLD))


def test_a_rank_whose_checkpoint_will_not_load_fails_every_rank_alike(tmp_path):
    """Regression: in a group's load_latest, a rank whose checkpoint raised
    an error other than damage (weights_only refusing a class in its state)
    left the restore's collectives, out of step with the other ranks: they
    waited, or paired its next call with their error gather and all failed
    with a TypeError. Every rank now raises DistributedCheckpointError
    naming the rank and the error, and a retry on every rank works."""
    res = _run("unloadable", tmp_path)
    for r in res:
        assert r["first"].startswith("DistributedCheckpointError") and "rank 1" in r["first"], r
        assert r["retry"] == 1, r


def test_group_retention_keeps_a_step_every_rank_has(tmp_path):
    """Regression: each rank counted keep_last over its own commits, so a
    rank whose saves failed (rank 1, steps 3 to 6) kept only steps 1 and 2
    while the others kept 5 and 6: no step in common, and load_latest()
    found nothing to resume from. Retention now counts only the steps
    every rank committed."""
    res = _run("retention", tmp_path)
    assert res[1]["failed"] == [3, 4, 5, 6]
    assert res[1]["kept"] == [1, 2]
    for r in (0, 2, 3):
        assert res[r]["failed"] == []
        assert 2 in res[r]["kept"], res[r]
    assert [r["restored"] for r in res] == [2, 2, 2, 2]


def test_a_restore_tries_the_next_holder_when_the_first_one_fails(tmp_path):
    """Regression: with replicate=2, a group restore asked only a rank's
    first holder; when that replica was damaged every rank went back a step
    (or further), although the second holder had the newest step whole."""
    res = _run("second_holder", tmp_path)
    assert len(res[0]["holders"]) == 2, res
    assert [(r["restored"], r["right_bytes"]) for r in res] == [(2, True)] * WORLD, res
    d0 = os.path.join(tmp_path, "second", "rank-0")
    fetched = [(e["step"], e["from_rank"]) for e in _events(d0, "fetched")]
    assert fetched == [(2, res[0]["holders"][1])], fetched
