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
completed before the next. Variants: ``cold`` (nothing prepared) and
``prepared`` (``saver.prepare(state)`` first, its own time reported).
Medians over ``--rounds``; the goal is a first snapshot phase <= 2x a warm one.

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
    if variant == "prepared":
        t = time.perf_counter()
        saver.prepare(sd)
        prep = time.perf_counter() - t
    blocks = []
    path = os.path.join(directory, f"snap-{variant}.pt")
    for _ in range(saves):
        t = time.perf_counter()
        fut = saver.save(sd, path, mode="snapshot")
        fut.wait_snapshot()
        blocks.append(time.perf_counter() - t)
        fut.result()
    saver.close()
    print(json.dumps({"prepare": prep, "blocks": blocks}))


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
    variants = ["cold", "prepared"]
    res = {v: {"first": [], "warm": [], "prepare": []} for v in variants}
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
            print(
                f"  round {r + 1}: "
                + "  ".join(f"{v}: first {res[v]['first'][-1]:.3f}s warm {res[v]['warm'][-1]:.3f}s" for v in variants),
                flush=True,
            )
    print(f"{size / 2**30:.2f} GiB GPT-like, {args.rounds} rounds (fresh process each)")
    print(f"  {'variant':<10} {'first s':>8} {'warm s':>8} {'first/warm':>11} {'prepare s':>10}")
    for v in variants:
        f, w, p = (median(res[v][k]) for k in ("first", "warm", "prepare"))
        print(f"  {v:<10} {f:>8.3f} {w:>8.3f} {f / w:>11.2f} {p:>10.3f}")


if __name__ == "__main__":
    main()
