"""Replicated and sharded checkpoints from 2 processes (torch.distributed, gloo).

    python examples/distributed_save.py [OUTPUT_DIR] [--world 2]

Starts ``--world`` local processes (torch.multiprocessing, no torchrun),
joined in a gloo process group on 127.0.0.1 at a free port. Then:

* replicated: every rank holds the same state dict; ``write_state_dict(obj,
  path, group=pg)`` has each rank write its own part of the one file, and
  rank 0 commits it once all parts are written. Every rank reads it back.
* sharded: every rank holds a different shard; ``write_state_dict(obj,
  dirpath, group=pg, sharded=True)`` writes one torch-loadable file per rank
  and ``index.json`` last. ``read_state_dict(dirpath, group=pg)`` gives each
  rank its own shard; without a group, the list of all shards.

Exits with status 1 on any mismatch (or when a rank fails).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from datetime import timedelta
from typing import Dict, List

import fastpersist
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def state(seed: int) -> Dict[str, torch.Tensor]:
    """A small model-like state dict; the same seed gives the same tensors on every rank."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(1000, 128, generator=g),
        "block.0.weight": torch.randn(512, 128, generator=g).to(torch.bfloat16),
        "block.0.bias": torch.randn(512, generator=g),
        "head.weight": torch.randn(10, 512, generator=g),
    }


def differences(what: str, expected: Dict[str, torch.Tensor], got) -> List[str]:
    if not isinstance(got, dict) or list(got) != list(expected):
        return [f"{what}: keys differ"]
    return [
        f"{what}: {k} differs" for k, t in expected.items() if got[k].dtype != t.dtype or not torch.equal(got[k], t)
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    pg = dist.group.WORLD
    errors: List[str] = []
    try:
        # Replicated: the same state on every rank, one file written by all.
        path = os.path.join(out_dir, "replicated.pt")
        st = fastpersist.write_state_dict(state(0), path, group=pg)
        dist.barrier()
        errors += differences(f"rank {rank}: replicated, read_state_dict", state(0), fastpersist.read_state_dict(path))
        errors += differences(f"rank {rank}: replicated, torch.load", state(0), torch.load(path, weights_only=True))
        print(f"rank {rank}: replicated: wrote its part of {path} ({st.bytes} bytes), read it all back", flush=True)

        # Sharded: a different shard per rank, a directory with an index.
        shards = os.path.join(out_dir, "sharded")
        fastpersist.write_state_dict(state(100 + rank), shards, group=pg, sharded=True)
        mine = fastpersist.read_state_dict(shards, group=pg)
        errors += differences(f"rank {rank}: sharded, own shard", state(100 + rank), mine)
        print(f"rank {rank}: sharded: wrote and read back its shard in {shards}", flush=True)
        if rank == 0:
            every = fastpersist.read_state_dict(shards)  # no group: every shard, in rank order
            if len(every) != world:
                errors.append(f"sharded: {len(every)} shards read, {world} written")
            for r, sh in enumerate(every):
                errors += differences(f"sharded, shard {r} read without a group", state(100 + r), sh)
            print(f"rank 0: read all {len(every)} shards without a group: {sorted(os.listdir(shards))}", flush=True)
    except Exception as e:
        errors.append(f"rank {rank}: {type(e).__name__}: {e}")
    # Agree on the outcome, so no rank leaves while another still talks to it.
    everyone: List = [None] * world
    dist.all_gather_object(everyone, errors)
    dist.barrier()
    if rank == 0:
        for e in (e for errs in everyone for e in errs):
            print("MISMATCH:", e, file=sys.stderr)
    # Leave without torch/gloo's C++ teardown: it can race the peer's closing
    # sockets and abort ("terminate called without an active exception") after
    # all the work is done. Everything this rank wrote is committed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if any(everyone) else 0)


def run(out_dir: str, world: int) -> int:
    port = free_port()
    print(f"starting {world} processes (gloo on 127.0.0.1:{port}), writing to {out_dir}")
    try:
        mp.spawn(worker, args=(world, port, out_dir), nprocs=world, join=True)
    except Exception as e:
        print(f"FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print("OK: replicated and sharded checkpoints read back identical on every rank")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?", help="where to write (default: a temporary directory, removed after)")
    ap.add_argument("--world", type=int, default=2, help="number of processes (default 2)")
    args = ap.parse_args()
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        return run(os.path.abspath(args.out_dir), args.world)
    with tempfile.TemporaryDirectory(prefix="fastpersist-example-") as d:
        return run(d, args.world)


if __name__ == "__main__":
    sys.exit(main())
