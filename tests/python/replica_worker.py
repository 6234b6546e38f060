"""One rank of a peer-replica test (run by test_replicas.py as a process).

Rank ``r``'s node-local directory is ``<out>/node<r // 2>/rank-<r>``
(LOCAL_WORLD_SIZE=2: two "nodes" of two ranks each)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from datetime import timedelta


def state(step: int, rank: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(200_000, generator=g), "b": torch.arange(step, step + 7), "rank": rank, "step": step}


def rank_dir(out: str, rank: int) -> str:
    return os.path.join(out, f"node{rank // 2}", f"rank-{rank}")


def same(a: dict, b: dict) -> bool:
    import torch

    return (
        a.keys() == b.keys()
        and torch.equal(a["w"], b["w"])
        and torch.equal(a["b"], b["b"])
        and (a["rank"], a["step"]) == (b["rank"], b["step"])
    )


def _errors(rank: int, out: str) -> dict:
    """Bad arguments: each must raise a clear error before any collective."""
    import fastpersist
    import torch.distributed as dist

    d = rank_dir(out, rank)
    got = {}
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    cases = {
        "one_node": ({"LOCAL_WORLD_SIZE": "4"}, {"replicate": 1, "group": dist.group.WORLD}),
        "too_many": ({"LOCAL_WORLD_SIZE": "2"}, {"replicate": 2, "group": dist.group.WORLD}),
        "no_layout": ({}, {"replicate": 1, "group": dist.group.WORLD}),
        "nodes_len": ({}, {"replicate": 1, "group": dist.group.WORLD, "nodes": [0, 0, 1]}),
        "one_node_by_nodes": ({}, {"replicate": 1, "group": dist.group.WORLD, "nodes": ["a"] * 4}),
    }
    for name, (env, kw) in cases.items():
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        os.environ.update(env)
        try:
            fastpersist.Checkpointer(d, every=1, **kw).close()
            got[name] = None
        except (ValueError, TypeError) as e:
            got[name] = f"{type(e).__name__}: {e}"
    # An interleaved layout given by nodes= works (ring shift 1).
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    with fastpersist.Checkpointer(d, every=1, replicate=1, group=dist.group.WORLD, nodes=["a", "b", "a", "b"]) as ck:
        ck.step(1, state(1, rank))
    got["interleaved_held"] = sorted(os.listdir(os.path.join(d, "replicas")))
    shutil.rmtree(d)  # the rest starts afresh
    if saved is not None:
        os.environ["LOCAL_WORLD_SIZE"] = saved
    return got


def _steps(d: str) -> list:
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    return sorted(int(n[5:-3]) for n in names if n.startswith("ckpt-") and n.endswith(".pt"))


def _resume(ck, rank: int) -> dict:
    info = ck.latest()  # fetches a missing or damaged copy; load_latest then finds it here
    got = ck.load_latest()
    if got is None:
        return {"resumed": None, "latest": info}
    step, st = got
    assert info is not None and info.step == step and info.tier == "local", (info, step)
    return {"resumed": step, "right_bytes": same(st, state(step, rank))}


def _auto(rank: int, out: str) -> list:
    """every="auto": each rank's tuner would choose differently (rank 0's
    every third step, the others' never); the group's first rank decides
    for all. Returns the steps this rank checkpointed."""
    import fastpersist
    import torch.distributed as dist

    d = os.path.join(out, "auto", f"rank-{rank}")
    with fastpersist.Checkpointer(d, every="auto", keep_last=100, replicate=1, group=dist.group.WORLD) as ck:
        calls = iter(range(1, 100))
        ck.tuner.should_checkpoint = lambda: rank == 0 and next(calls) % 3 == 0
        saved = [s for s in range(1, 10) if ck.step(s, state(s, rank)) is not None]
    assert saved == _steps(d), (saved, _steps(d))
    return saved


def _nonblocking(rank: int, out: str) -> list:
    """Replication never blocks the training loop: rank 2 (the holder of
    rank 0) cannot write a replica until rank 0 has trained three
    checkpointed steps; were step() waiting for replication, rank 0 would
    never get there (the test times out)."""
    import time

    import fastpersist
    import fastpersist.replicas
    import torch.distributed as dist

    d = os.path.join(out, "nb", f"rank-{rank}")
    go = os.path.join(out, "nb", "go")
    if rank == 2:
        real = fastpersist.replicas._write_chunk

        def held_back(tmp, data, offset):
            while not os.path.exists(go):
                time.sleep(0.01)
            real(tmp, data, offset)

        fastpersist.replicas._write_chunk = held_back
    with fastpersist.Checkpointer(d, every=1, keep_last=3, replicate=1, group=dist.group.WORLD) as ck:
        for s in (1, 2, 3):
            ck.step(s, state(s, rank)).result()  # committed locally
        if rank == 0:
            open(go, "w").close()
    return _steps(os.path.join(d, "replicas", f"rank-{(rank + 2) % 4}"))


def _lifecycle(rank: int, out: str) -> dict:
    """Train, lose node 1 (ranks 2 and 3 delete their directories), restart
    (a new Checkpointer), train on, damage rank 1's newest file, restart."""
    import fastpersist
    import torch.distributed as dist

    d = rank_dir(out, rank)
    holder = (rank + 2) % 4
    res: dict = {}
    with fastpersist.Checkpointer(d, every=1, keep_last=2, replicate=1, group=dist.group.WORLD) as ck:
        res["fresh"] = _resume(ck, rank)
        for s in range(1, 5):
            ck.step(s, state(s, rank))
    dist.barrier()
    res["trained"] = {
        "own": _steps(d),
        "held": _steps(os.path.join(rank_dir(out, holder), "replicas", f"rank-{rank}")),
        "same": open(os.path.join(d, "ckpt-000000000004.pt"), "rb").read()
        == open(os.path.join(rank_dir(out, holder), "replicas", f"rank-{rank}", "ckpt-000000000004.pt"), "rb").read(),
    }
    dist.barrier()
    if rank in (2, 3):
        shutil.rmtree(os.path.join(out, "node1"), ignore_errors=True)
    dist.barrier()
    with fastpersist.Checkpointer(d, every=1, keep_last=2, replicate=1, group=dist.group.WORLD) as ck:
        res["after_node_loss"] = _resume(ck, rank)
        for s in range(res["after_node_loss"]["resumed"] + 1, 7):
            ck.step(s, state(s, rank))
    dist.barrier()
    if rank == 1:
        path = os.path.join(d, "ckpt-000000000006.pt")
        raw = bytearray(open(path, "rb").read())
        raw[len(raw) // 2] ^= 0xFF  # inside the tensor data: its CRC no longer matches
        with open(path, "wb") as f:
            f.write(raw)
    dist.barrier()
    with fastpersist.Checkpointer(d, every=1, keep_last=2, replicate=1, group=dist.group.WORLD) as ck:
        res["after_damage"] = _resume(ck, rank)
    return res


def _stage(rank: int, out: str) -> dict:
    """Every rank stages to one shared folder, then every node is lost."""
    import fastpersist
    import torch.distributed as dist

    d = rank_dir(out, rank)
    shared = os.path.join(out, "shared")
    with fastpersist.Checkpointer(d, every=1, keep_last=2, stage_dir=shared, group=dist.group.WORLD) as ck:
        for s in (1, 2):
            ck.step(s, state(s, rank))
            ck.wait()
    dist.barrier()
    shutil.rmtree(d)
    dist.barrier()
    with fastpersist.Checkpointer(d, every=1, stage_dir=shared, group=dist.group.WORLD) as ck:
        got = ck.load_latest(weights_only=False)
    assert got is not None
    return {"restored": {"step": got[0], "rank": got[1]["rank"]}, "same": same(got[1], state(2, rank))}


def _unloadable(rank: int, out: str) -> dict:
    """Only rank 1's state holds an object weights_only refuses."""
    import fractions

    import fastpersist
    import torch.distributed as dist

    d = rank_dir(out, rank)
    res = {}
    with fastpersist.Checkpointer(d, every=1, group=dist.group.WORLD) as ck:
        st = state(1, rank)
        if rank == 1:
            st["ratio"] = fractions.Fraction(1, 3)
        ck.step(1, st)
    with fastpersist.Checkpointer(d, every=1, group=dist.group.WORLD) as ck:
        try:
            ck.load_latest()
            res["first"] = "loaded"
        except fastpersist.DistributedCheckpointError as e:
            res["first"] = "DistributedCheckpointError: " + str(e)
        got = ck.load_latest(weights_only=False)  # every rank retries alike
        res["retry"] = got[0] if got is not None else None
    return res


def _retention(rank: int, out: str) -> dict:
    """keep_last=2 over a group whose rank 1 fails to save steps 3 to 6
    (an I/O error on its disk): the ranks must keep a step in common."""
    import fastpersist
    import torch.distributed as dist
    from fastpersist.options import EngineOptions, get_engine

    d = os.path.join(out, "retention", f"rank-{rank}")
    eng = get_engine(EngineOptions.resolve())[1]
    failed = []
    with fastpersist.Checkpointer(d, every=1, keep_last=2, group=dist.group.WORLD) as ck:
        for s in range(1, 7):
            eng.set_fault(8192 if rank == 1 and s >= 3 else None, 5)
            fut = ck.step(s, state(s, rank))
            ck.wait()
            if fut is not None and fut.exception() is not None:
                failed.append(s)
        eng.set_fault(None)
        kept = _steps(d)
        got = ck.load_latest()
    return {"failed": failed, "kept": kept, "restored": got[0] if got is not None else None}


def _second_holder(rank: int, out: str) -> dict:
    """replicate=2 over 4 one-rank nodes: rank 0 loses its checkpoints, its
    first holder's replica of the newest step is damaged, its second
    holder's is whole."""
    import fastpersist
    import torch.distributed as dist

    d = os.path.join(out, "second", f"rank-{rank}")
    kw = dict(every=1, keep_last=3, replicate=2, group=dist.group.WORLD, nodes=[0, 1, 2, 3])
    with fastpersist.Checkpointer(d, **kw) as ck:
        holders = ck._ring.holders_of(0)
        for s in (1, 2):
            ck.step(s, state(s, rank))
            ck.wait()
    dist.barrier()
    if rank == 0:
        for n in os.listdir(d):
            if n.startswith("ckpt-"):
                os.unlink(os.path.join(d, n))
    if rank == holders[0]:
        p = os.path.join(d, "replicas", "rank-0", "ckpt-000000000002.pt")
        with open(p, "r+b") as f:
            f.seek(os.path.getsize(p) // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
    dist.barrier()
    with fastpersist.Checkpointer(d, **kw) as ck:
        got = ck.load_latest(weights_only=False)
    return {
        "holders": holders,
        "restored": got[0] if got is not None else None,
        "right_bytes": got is not None and same(got[1], state(2, rank)),
    }


def main() -> None:
    scenario, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    args = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    import fastpersist
    import fastpersist.replicas
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    fastpersist.replicas.CHUNK_BYTES = args.get("chunk", 64 << 10)  # many chunks per file
    result: dict = {"rank": rank, "ok": True}
    d = rank_dir(out, rank)
    try:
        if scenario == "errors":
            result["errors"] = _errors(rank, out)
        elif scenario == "resume":
            with fastpersist.Checkpointer(d, every=1, replicate=1, group=dist.group.WORLD) as ck:
                result.update(_resume(ck, rank))
            result["auto"] = _auto(rank, out)
            result["nonblocking"] = _nonblocking(rank, out)
        elif scenario == "lifecycle":
            result["errors"] = _errors(rank, out)
            result.update(_lifecycle(rank, out))
        elif scenario == "retention":
            result.update(_retention(rank, out))
        elif scenario == "second_holder":
            result.update(_second_holder(rank, out))
        elif scenario in ("stage", "unloadable"):
            result.update((_stage if scenario == "stage" else _unloadable)(rank, out))
        elif scenario == "kill":
            # Steps 1 and 2 replicated in full; rank 2 (the holder of rank 0)
            # is killed half-way through receiving step 3.
            with fastpersist.Checkpointer(d, every=1, keep_last=3, replicate=1, group=dist.group.WORLD) as ck:
                for s in (1, 2):
                    ck.step(s, state(s, rank))
                    ck.wait()
                # Every rank's step 2 committed and replicated before any
                # rank starts step 3: a rank still finishing step 2 when the
                # job is taken down would leave step 1 the newest common one.
                dist.barrier()
                if rank == 2:
                    real = fastpersist.replicas._write_chunk

                    def write_then_die(tmp, data, offset):
                        real(tmp, data, offset)
                        if "ckpt-000000000003" in tmp.target and offset > 0:
                            os.kill(os.getpid(), signal.SIGKILL)

                    fastpersist.replicas._write_chunk = write_then_die
                ck.step(3, state(3, rank))
                ck.wait()
        else:
            raise SystemExit(f"unknown scenario {scenario}")
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = {"rank": rank, "ok": False, "type": type(e).__name__, "error": str(e)}
    with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
