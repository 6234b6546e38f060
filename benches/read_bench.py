#!/usr/bin/env python3
"""Read benchmark: cold reads of a checkpoint, fastpersist against the device
read limit and the peers.

Every reader's file is evicted from the page cache first (fsync, then
posix_fadvise DONTNEED). In one run, alternating rounds (the order rotates),
medians of ``--rounds``:

* the read limit: the best of several fio configurations (O_DIRECT,
  io_uring; 4 MiB x 16 and 1 MiB x 32, normal and huge-page buffers), a
  file of the same size in the same directory, the winner named;
* the same configurations reading fastpersist's own file (read-only): the
  limit for those very blocks, reported beside the first (where a file
  lies on a virtual disk moves its reads by a few percent);
* fastpersist.read_state_dict of its own file (CRC32 verified) and of a
  safetensors file;
* torch.load; torch.load(mmap=True) touching every byte (each tensor cloned);
* safetensors load_file, touching every byte (it may map the file lazily);
* not a reader: allocating and filling new storages of the checkpoint's
  sizes, the first touch of the memory every reader fills (on virtual
  machines that return freed memory to the host, a bound below the disk's).

Workloads: the GPT-like state dict of ``--size`` and, with
``--small-count N``, N small tensors (4 KiB to 1 MiB, ``--small-size`` in
all: per-record costs, the pickle of N tensors).

On a virtual machine whose kernel reports free pages to the host
(virtio-balloon free page reporting), memory one reader frees goes back to
the host a few seconds later, and the next reader's first touch of it waits
for the host, whatever the reader: as root, the benchmark turns the
reporting off for the run and sets it back after (``--no-keep-freed-memory``
leaves it on, and the benchmark says so). A reader's time ends when it
returns; what it read is freed after the clock stops.

    python benches/read_bench.py [--size 2GiB] [--small-count 10000] [--rounds 5] [--dir DIR] [--json out.json]
                                 [--[no-]keep-freed-memory]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Callable, Dict, List

import fastpersist
import torch
from fastpersist import _core
from fastpersist.bench import (
    Limit,
    drop_cache,
    fio_read_file_limits,
    freed_memory,
    gpt_state_dict,
    median,
    nbytes,
    parse_size,
    small_tensors_state_dict,
    timed,
    warm_memory,
)


def touch_all(obj) -> None:
    for v in obj.values():
        v.clone()


def fresh_memory(sizes: List[int]) -> List[torch.UntypedStorage]:
    """New storages of ``sizes`` bytes, each filled once and all kept (as a
    reader returns them all, so none reuses another's freed pages): what
    any reader pays for the memory it reads into, whatever the disk. On a
    virtual machine that hands freed guest memory back to the host, this
    first touch can be slower than the disk."""
    out = []
    for n in sizes:
        st = torch.UntypedStorage(n)
        torch.ByteTensor(st).fill_(1)
        out.append(st)
    return out


def run_workload(name: str, sd: Dict[str, torch.Tensor], d: str, rounds: int, settle: float) -> dict:
    """Every reader of ``sd``'s files, cold, in rotating order, ``rounds``
    times, with the read limit of the same size measured among them."""
    from safetensors.torch import load_file, save_file

    size = nbytes(sd)
    fp_file = os.path.join(d, "fp.pt")
    st_file = os.path.join(d, "st.safetensors")
    fastpersist.write_state_dict(sd, fp_file)
    save_file(sd, st_file)
    storage_sizes = [v.untyped_storage().nbytes() for v in sd.values()]
    readers: Dict[str, Callable[[], object]] = {
        "fastpersist": lambda: fastpersist.read_state_dict(fp_file),
        "fastpersist (safetensors file)": lambda: fastpersist.read_state_dict(st_file),
        "torch.load": lambda: torch.load(fp_file, weights_only=True),
        "torch.load(mmap) + touch": lambda: touch_all(torch.load(fp_file, mmap=True, weights_only=True)),
        # load_file may map the file lazily: touch every byte, like mmap.
        "safetensors load_file + touch": lambda: touch_all(load_file(st_file)),
        # Not a reader: the first touch of new storages of the same sizes
        # (every reader above fills new tensors), which bounds them all.
        "fresh memory (allocate + fill)": lambda: fresh_memory(storage_sizes),
    }
    print(f"{name}: {size / 2**30:.2f} GiB in {len(sd)} tensors, cold reads, {rounds} rounds")
    same_blocks = "fio on fastpersist's file"
    slots = ["fio (limit)", same_blocks] + list(readers)
    times: Dict[str, List[float]] = {k: [] for k in readers}
    limit = Limit()
    # The same configurations reading fastpersist's own file, read-only:
    # the limit for the very blocks that reader reads (where a file lies on
    # a virtual disk moves its reads by a few percent).
    own = Limit()
    for r in range(rounds):
        order = slots[r % len(slots) :] + slots[: r % len(slots)]
        for reader in order:
            os.sync()
            time.sleep(settle)
            if reader == "fio (limit)":
                limit.measure(d, size, rw="read")
                continue
            if reader == same_blocks:
                drop_cache(d)
                own.add(fio_read_file_limits(fp_file))
                continue
            # Every file of the run out of the page cache, not only the one
            # read: each reader starts from the same memory state.
            drop_cache(d)
            times[reader].append(timed(readers[reader]))
        print(
            f"  round {r + 1}: "
            + "  ".join(f"{k}={size / v[-1] / 1e9:.2f}" for k, v in times.items() if v)
            + f"  fio best so far={limit.gbps:.2f} GB/s",
            flush=True,
        )
    lim = limit.gbps
    print(f"  {limit.note()}")
    if own.rounds:
        fp_own = size / median(times["fastpersist"]) / 1e9 / own.gbps
        print(
            f"  fio reading fastpersist's own file: {own.gbps:.2f} GB/s ({own.config}); "
            f"fastpersist's share of it: {fp_own:.2f}"
        )
    print(f"  {'reader':<32} {'GB/s':>7} {'share of limit':>15}")
    print(f"  {'fio (limit)':<32} {lim:>7.2f} {1.0:>15.2f}")
    res: dict = {
        "workload": name,
        "bytes": size,
        "tensors": len(sd),
        **limit.as_dict(),
        "own_file_limit": own.as_dict() if own.rounds else None,
        "readers": {},
    }
    for k, v in times.items():
        g = size / median(v) / 1e9
        res["readers"][k] = {"gbps": g, "share": g / lim, "seconds": v}
        print(f"  {k:<32} {g:>7.2f} {g / lim:>15.2f}")
    for f in (fp_file, st_file):
        os.unlink(f)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB", help="the GPT-like state dict (0: skip)")
    ap.add_argument("--small-count", type=int, default=0, help="also a state of this many small tensors")
    ap.add_argument("--small-size", default="1GiB", help="total size of the small tensors")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--settle", type=float, default=1.0)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--keep-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="turn the kernel's free page reporting off for the run (root; set back after): memory one reader "
        "frees stays backed for the next, instead of going back to the host (default: on where this is root)",
    )
    args = ap.parse_args()
    print(
        f"fastpersist {fastpersist.__version__} (copy: {_core.copy_kernel() or 'two-pass'}), torch {torch.__version__}"
    )
    results = []
    with (
        freed_memory(args.keep_freed_memory) as kept,
        tempfile.TemporaryDirectory(prefix="fastpersist-rbench-", dir=args.dir or os.getcwd()) as d,
    ):
        if kept.note:
            print(f"memory: {kept.note}")
        # Twice the largest checkpoint: what one reader keeps while the
        # last one's memory is still being freed.
        warm_memory(2 * max(parse_size(args.size), parse_size(args.small_size) if args.small_count else 0))
        if parse_size(args.size):
            results.append(run_workload("GPT-like", gpt_state_dict(parse_size(args.size)), d, args.rounds, args.settle))
        if args.small_count:
            sd = small_tensors_state_dict(args.small_count, parse_size(args.small_size))
            results.append(run_workload("small tensors", sd, d, args.rounds, args.settle))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
