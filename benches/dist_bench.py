#!/usr/bin/env python3
"""Distributed write benchmark: aggregate throughput of 1 and N ranks
writing one replicated checkpoint into one file on one disk (gloo, local
processes), against the fio limit in the same run.

    python benches/dist_bench.py [--size 2GiB] [--ranks 1,2] [--rounds 3] [--dir DIR]

Each configuration runs as fresh processes; a round is: fio, then each rank
count (the order rotates). The time is from a barrier before the save to the
slowest rank's return (the commit happens before any rank returns).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

from fastpersist.bench import Limit, gpt_state_dict, median, parse_size


def worker(rank: int, world: int, port: str, size: int, path: str, out: str) -> None:
    import fastpersist
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    sd = gpt_state_dict(size)
    group = dist.group.WORLD if world > 1 else None
    if group is not None:
        fastpersist.distributed.checkpoint_group(group)
    dist.barrier()
    t0 = time.perf_counter()
    st = fastpersist.write_state_dict(sd, path, group=group)
    t = time.perf_counter() - t0
    times = [None] * world
    dist.all_gather_object(times, t)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"seconds": max(times), "bytes": st.bytes}, f)
    dist.barrier()
    os._exit(0)  # skip gloo's C++ teardown, which can abort while a peer closes


def run(world: int, size: int, d: str) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    path = os.path.join(d, f"ckpt-{world}.pt")
    out = os.path.join(d, f"res-{world}.json")
    procs = [
        subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), port, str(size), path, out])
        for r in range(world)
    ]
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"rank failed with status {p.returncode}")
    with open(out) as f:
        res = json.load(f)
    os.unlink(path)
    return res["bytes"] / res["seconds"] / 1e9


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        r, w, port, size, path, out = sys.argv[2:8]
        worker(int(r), int(w), port, int(size), path, out)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    size = parse_size(args.size)
    ranks = [int(x) for x in args.ranks.split(",")]
    file_size = size
    with tempfile.TemporaryDirectory(prefix="fastpersist-dbench-", dir=args.dir or os.getcwd()) as d:
        slots = ["fio"] + ranks
        res = {k: [] for k in slots}
        limit = Limit()
        for r in range(args.rounds):
            order = slots[r % len(slots) :] + slots[: r % len(slots)]
            for k in order:
                os.sync()
                time.sleep(1)
                if k == "fio":
                    runs = limit.measure(d, file_size)
                    if runs:
                        res[k].append(max(runs.values()))
                else:
                    res[k].append(run(k, size, d))
            print(
                f"  round {r + 1}: "
                + "  ".join(f"{k if k == 'fio' else f'{k} rank(s)'}={v[-1]:.2f}" for k, v in res.items() if v)
                + " GB/s",
                flush=True,
            )
        lim = limit.gbps
        print(limit.note())
        print(f"{'writers':<12} {'GB/s':>6} {'share of limit':>15}")
        print(f"{'fio (limit)':<12} {lim:>6.2f} {1.0:>15.2f}")
        for k in ranks:
            g = median(res[k])
            print(f"{f'{k} rank(s)':<12} {g:>6.2f} {g / lim:>15.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({str(k): v for k, v in res.items()}, f, indent=2)


if __name__ == "__main__":
    main()
