#!/usr/bin/env python3
"""DCP storage benchmark: ``torch.distributed.checkpoint`` saving and
loading through its own ``FileSystemWriter(thread_count=2)`` /
``FileSystemReader`` and through fastpersist's ``FastPersistWriter`` /
``FastPersistReader``, with 1 and N gloo ranks on one disk, for a GPT-like
state dict and for many small tensors, as ratios to the honest device limit
measured in the same run and directory: the best of several fio
configurations (O_DIRECT, io_uring; 4 MiB x 16 and 1 MiB x 32, normal and
huge-page buffers; reads cold), each a median of ``--rounds`` runs, the
winner named.

    python benches/dcp_bench.py [--size 2GiB] [--small-count 10000] [--small-size 1GiB]
                                [--ranks 1,2] [--rounds 3] [--dir DIR] [--json OUT]
                                [--[no-]keep-freed-memory]

As root, the kernel's free page reporting (virtio-balloon) is turned off
for the run and set back after, as in ``read_bench.py``: a load fills new
tensors, and memory freed a few seconds before would otherwise wait for the
host to back it again.

Every rank count runs as fresh processes. Each rank saves its share of the
state (every world-th tensor), so the checkpoint holds the whole state once.
A save is timed from a barrier to the slowest rank's return (DCP commits
before any rank returns; both writers fsync: ``sync_files=True``); a load
from a barrier after the page cache was dropped to the slowest rank's
return. Throughput counts tensor bytes. With ``--async``, also
``dcp.async_save`` through each writer (DCP's default stager for its own,
the writer's reusable staging pool for fastpersist's; one writer per rank
for every round, so the pools are warm after the first), timed from a
barrier to the slowest rank's durable result (``async``) and to the return
of the call (``block``: the staging copy the training loop waits for).

Each synchronous save and load also reports the share of its time spent in
the storage layer's calls (the writer's ``write_data`` and ``finish``, the
reader's ``read_metadata`` and ``read_data``, including the planner's
callbacks made from inside them; the slowest rank's): the rest is DCP's own
work (planning, its collectives, the pickles of its plans), which no
storage layer can shorten.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Dict, List

from fastpersist.bench import (
    Limit,
    drop_cache,
    freed_memory,
    gpt_state_dict,
    median,
    nbytes,
    parse_size,
    small_tensors_state_dict,
    warm_memory,
)

WRITERS = ("dcp", "fastpersist")
STORAGE_CALLS = {"save": ("write_data", "finish"), "load": ("read_metadata", "read_data")}


def timed_storage(cls: type, op: str) -> type:
    """``cls`` with the seconds spent in its storage calls added up in
    ``storage_seconds`` (per instance)."""

    def wrap(name: str):
        real = getattr(cls, name)

        def call(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(self, *args, **kwargs)
            finally:
                self.storage_seconds = getattr(self, "storage_seconds", 0.0) + time.perf_counter() - t0

        return call

    return type(cls.__name__, (cls,), {n: wrap(n) for n in STORAGE_CALLS[op]})


def worker(rank: int, world: int, port: str, cfg: Dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from fastpersist.dcp import FastPersistReader, FastPersistWriter

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=900)
    )
    if cfg["workload"] == "gpt":
        full = gpt_state_dict(cfg["size"])
    else:
        full = small_tensors_state_dict(cfg["count"], cfg["size"])
    mine = {k: v for i, (k, v) in enumerate(full.items()) if i % world == rank}
    del full
    total = [0] * world
    dist.all_gather_object(total, nbytes(mine))
    ops = ("save", "load", "async", "block") if cfg.get("async") else ("save", "load")
    res: Dict[str, List[float]] = {f"{w}-{op}": [] for w in WRITERS for op in ops}
    share: Dict[str, List[float]] = {f"{w}-{op}": [] for w in WRITERS for op in ("save", "load")}
    writers = {
        "dcp": timed_storage(dcp.FileSystemWriter, "save"),
        "fastpersist": timed_storage(FastPersistWriter, "save"),
    }
    readers = {
        "dcp": timed_storage(dcp.FileSystemReader, "load"),
        "fastpersist": timed_storage(FastPersistReader, "load"),
    }
    async_writers = {
        "dcp": dcp.FileSystemWriter(os.path.join(cfg["dir"], "async-dcp"), thread_count=2, sync_files=True),
        "fastpersist": FastPersistWriter(os.path.join(cfg["dir"], "async-fastpersist"), sync_files=True),
    }
    for r in range(cfg["rounds"]):
        order = WRITERS if r % 2 == 0 else WRITERS[::-1]
        for w in order:
            path = os.path.join(cfg["dir"], f"ckpt-{w}")
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
                os.sync()
                time.sleep(cfg["settle"])
            dist.barrier()
            writer = (
                writers[w](path, thread_count=2, sync_files=True) if w == "dcp" else writers[w](path, sync_files=True)
            )
            t0 = time.perf_counter()
            dcp.save(mine, storage_writer=writer)
            t_save = time.perf_counter() - t0
            dist.barrier()
            if rank == 0:
                drop_cache(path)
            dist.barrier()
            dest = {k: torch.empty_like(v) for k, v in mine.items()}
            reader = readers[w](path)
            t0 = time.perf_counter()
            dcp.load(dest, storage_reader=reader)
            t_load = time.perf_counter() - t0
            for k in list(mine)[:3]:
                assert torch.equal(dest[k], mine[k]), k
            del dest
            times = [None] * world
            dist.all_gather_object(times, (t_save, t_load))
            res[f"{w}-save"].append(sum(total) / max(t[0] for t in times) / 1e9)
            res[f"{w}-load"].append(sum(total) / max(t[1] for t in times) / 1e9)
            inside = [None] * world
            dist.all_gather_object(inside, (writer.storage_seconds, reader.storage_seconds))
            share[f"{w}-save"].append(max(t[0] for t in inside) / max(t[0] for t in times))
            share[f"{w}-load"].append(max(t[1] for t in inside) / max(t[1] for t in times))
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            if cfg.get("async"):
                if rank == 0:
                    shutil.rmtree(async_writers[w].path, ignore_errors=True)
                    os.sync()
                    time.sleep(cfg["settle"])
                dist.barrier()
                t0 = time.perf_counter()
                fut = dcp.async_save(mine, storage_writer=async_writers[w])
                t_block = time.perf_counter() - t0
                fut.result()
                t_async = time.perf_counter() - t0
                dist.all_gather_object(times, (t_async, t_block))
                res[f"{w}-async"].append(sum(total) / max(t[0] for t in times) / 1e9)
                res[f"{w}-block"].append(max(t[1] for t in times))
    stager = getattr(async_writers["fastpersist"], "_stager", None)
    pools = [None] * world  # staging memory each rank's writer holds after the rounds
    dist.all_gather_object(pools, stager.pool.nbytes if stager is not None else 0)
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump({"bytes": sum(total), "gbps": res, "storage_share": share, "staging_pool_bytes": pools}, f)
    dist.barrier()
    os._exit(0)  # skip gloo's C++ teardown, which can abort while a peer closes


def run(world: int, cfg: Dict) -> Dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    cfg = dict(cfg, out=os.path.join(cfg["dir"], f"res-{world}.json"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), port, json.dumps(cfg)], env=env)
        for r in range(world)
    ]
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"a rank failed with status {p.returncode}")
    with open(cfg["out"]) as f:
        return json.load(f)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        r, w, port, cfg = sys.argv[2:6]
        worker(int(r), int(w), port, json.loads(cfg))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB", help="GPT-like state dict size (0: skip)")
    ap.add_argument("--small-count", type=int, default=10_000, help="small tensors (0: skip)")
    ap.add_argument("--small-size", default="1GiB", help="total size of the small tensors")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of idle (after sync) before each save")
    ap.add_argument("--no-fio", action="store_true", help="skip the fio limit (ratios are then not reported)")
    ap.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir in the cwd)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--async", dest="async_", action="store_true", help="also time dcp.async_save (see above)")
    ap.add_argument(
        "--keep-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="turn the kernel's free page reporting off for the run (root; set back after), so a load's new "
        "tensors do not wait for the host to back memory freed a few seconds before (default: on where this is root)",
    )
    args = ap.parse_args()
    ranks = [int(x) for x in args.ranks.split(",")]
    workloads = [("gpt", parse_size(args.size), 0)] if parse_size(args.size) else []
    if args.small_count:
        workloads.append(("small", parse_size(args.small_size), args.small_count))
    if not workloads:
        ap.error("nothing to run: --size 0 and --small-count 0")
    report: Dict = {}
    with (
        freed_memory(args.keep_freed_memory) as kept,
        tempfile.TemporaryDirectory(prefix="fastpersist-dcpbench-", dir=args.dir or os.getcwd()) as d,
    ):
        size = max(s for _, s, _ in workloads)
        if kept.note:
            print(f"memory: {kept.note}")
        # Each rank holds its state, its load's new tensors and the stager's
        # pool: memory the host has backed before the first round, as later.
        warm_memory(3 * size)
        lim_w = lim_r = None
        if not args.no_fio:
            wlim, rlim = Limit(), Limit()
            for _ in range(args.rounds):
                wlim.measure(d, size, "write")
                rlim.measure(d, size, "read")
            lim_w, lim_r = wlim.gbps, rlim.gbps
            report["limit"] = {
                "write": {"gbps": lim_w, "config": wlim.config, "medians": wlim.medians()},
                "read": {"gbps": lim_r, "config": rlim.config, "medians": rlim.medians()},
            }
            print(f"write {wlim.note()}")
            print(f"read {rlim.note()}")
        print(
            f"{'workload':<8} {'ranks':>5} {'op':<5} {'dcp GB/s':>9} {'fp GB/s':>8} {'dcp/lim':>8} {'fp/lim':>7} {'fp/dcp':>7}"
        )
        for name, total, count in workloads:
            for world in ranks:
                cfg = {"workload": name, "size": total, "count": count, "rounds": args.rounds, "dir": d}
                cfg["settle"] = args.settle
                cfg["async"] = args.async_
                res = run(world, cfg)
                report[f"{name}-{world}"] = res
                for op, lim in (("save", lim_w), ("load", lim_r)) + ((("async", lim_w),) if args.async_ else ()):
                    a, b = median(res["gbps"][f"dcp-{op}"]), median(res["gbps"][f"fastpersist-{op}"])
                    ra = f"{a / lim:8.2f}" if lim else f"{'-':>8}"
                    rb = f"{b / lim:7.2f}" if lim else f"{'-':>7}"
                    print(f"{name:<8} {world:>5} {op:<5} {a:9.2f} {b:8.2f} {ra} {rb} {b / a:7.2f}", flush=True)
                shares = {k: median(v) for k, v in res.get("storage_share", {}).items() if v}
                if shares:
                    print(
                        f"{name:<8} {world:>5} time in the storage calls: "
                        + ", ".join(f"{w} {op} {shares[f'{w}-{op}']:.0%}" for op in ("save", "load") for w in WRITERS)
                    )
                if args.async_:
                    a, b = median(res["gbps"]["dcp-block"]), median(res["gbps"]["fastpersist-block"])
                    print(f"{name:<8} {world:>5} block  dcp {a:.3f} s, fastpersist {b:.3f} s (async_save's return)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
