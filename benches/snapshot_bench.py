#!/usr/bin/env python3
"""First snapshot save of a process against the warm ones.

A snapshot-mode save blocks the training loop for its snapshot phase (the
copy of every tensor into host staging memory). The first one in a process
also makes that staging buffer; unless it is made ahead
(``AsyncSaver.prepare``, ``Checkpointer.prepare``) or made quickly (huge
pages, faulted in at once), the first save blocks far longer than the rest.

Each round runs a fresh process per variant, which builds a GPT-like state
dict (``--size``) and saves it ``--saves`` times with
``save(..., mode="snapshot")`` through one ``AsyncSaver``, timing the
blocking part (until ``wait_snapshot()`` returns) of each; every save is
completed before the next. Variants: ``cold`` (nothing prepared),
``prepared`` (``saver.prepare(state)`` first, its own time reported) and
``copy`` (prepared, with ``zero_copy=False``: the write phase copies the
snapshot into the staging arena again instead of writing from it). For each,
also the write phase (after the snapshot phase, until durable) and the
process's CPU seconds per warm save, and the share of bytes written straight
from the snapshot. Medians over ``--rounds``; the goal is a first snapshot
phase <= 2x a warm one.

    python benches/snapshot_bench.py [--size 1GiB] [--rounds 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from fastpersist.bench import median, parse_size


def child(variant: str, size: int, saves: int, directory: str) -> None:
    from fastpersist.async_save import AsyncSaver
    from fastpersist.bench import gpt_state_dict

    sd = gpt_state_dict(size)
    saver = AsyncSaver()
    prep = 0.0
    zero_copy = variant != "copy"
    if variant in ("prepared", "copy"):
        t = time.perf_counter()
        saver.prepare(sd)
        prep = time.perf_counter() - t
    blocks, writes, cpu = [], [], []
    lent = 0.0
    path = os.path.join(directory, f"snap-{variant}.pt")
    for _ in range(saves):
        c = time.process_time()
        t = time.perf_counter()
        fut = saver.save(sd, path, mode="snapshot", zero_copy=zero_copy)
        fut.wait_snapshot()
        blocks.append(time.perf_counter() - t)
        t = time.perf_counter()
        st = fut.result()
        writes.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        lent = st.zero_copy_bytes / st.bytes
    saver.close()
    print(json.dumps({"prepare": prep, "blocks": blocks, "writes": writes, "cpu": cpu, "lent": lent}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    size = parse_size(args.size)
    if args.child:
        child(args.child, size, args.saves, args.dir)
        return
    variants = ["cold", "prepared", "copy"]
    keys = ("first", "warm", "prepare", "write", "cpu", "lent")
    res = {v: {k: [] for k in keys} for v in variants}
    with tempfile.TemporaryDirectory(prefix="fastpersist-sbench-", dir=args.dir or os.getcwd()) as d:
        for r in range(args.rounds):
            for v in variants[r % 2 :] + variants[: r % 2]:
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        v,
                        "--size",
                        args.size,
                        "--saves",
                        str(args.saves),
                        "--dir",
                        d,
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                got = json.loads(out.stdout.strip().splitlines()[-1])
                res[v]["first"].append(got["blocks"][0])
                res[v]["warm"].append(median(got["blocks"][1:]))
                res[v]["prepare"].append(got["prepare"])
                res[v]["write"].append(median(got["writes"][1:]))
                res[v]["cpu"].append(median(got["cpu"][1:]))
                res[v]["lent"].append(got["lent"])
            print(
                f"  round {r + 1}: "
                + "  ".join(f"{v}: first {res[v]['first'][-1]:.3f}s warm {res[v]['warm'][-1]:.3f}s" for v in variants),
                flush=True,
            )
    print(f"{size / 2**30:.2f} GiB GPT-like, {args.rounds} rounds (fresh process each)")
    print(
        f"  {'variant':<10} {'first s':>8} {'warm s':>8} {'first/warm':>11} {'prepare s':>10}"
        f" {'write s':>8} {'GB/s':>6} {'cpu s':>6} {'lent':>5}"
    )
    for v in variants:
        f, w, p, wr, c, ln = (median(res[v][k]) for k in keys)
        print(
            f"  {v:<10} {f:>8.3f} {w:>8.3f} {f / w:>11.2f} {p:>10.3f} {wr:>8.3f} {size / wr / 1e9:>6.2f} {c:>6.3f} {ln:>5.2f}"
        )


if __name__ == "__main__":
    main()
