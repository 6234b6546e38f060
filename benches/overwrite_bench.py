#!/usr/bin/env python3
"""Overwrite latency: how long a save takes when it replaces an existing
checkpoint of the same size, against a save to a new path.

Replacing a file means freeing the old one's blocks (with online discard,
also discarding them). fastpersist holds the old file across the rename
and frees it on a thread of its own, so an overwrite should cost what a
save to a new path costs. Also timed, for reference: a plain
``os.replace`` of one same-size file by another (what freeing costs inside
the rename on this file system) and torch.save + fsync over an existing
file. Medians of ``--rounds``, alternating.

    python benches/overwrite_bench.py [--size 2GiB] [--rounds 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import fastpersist
import torch
from fastpersist.bench import clear, gpt_state_dict, median, nbytes, parse_size, timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--settle", type=float, default=1.0)
    args = ap.parse_args()
    sd = gpt_state_dict(parse_size(args.size))
    size = nbytes(sd)
    res = {"new path": [], "overwrite": [], "os.replace alone": [], "torch.save overwrite": []}
    with tempfile.TemporaryDirectory(prefix="fastpersist-obench-", dir=args.dir or os.getcwd()) as d:
        print(f"fastpersist {fastpersist.__version__}, {size / 2**30:.2f} GiB GPT-like, {args.rounds} rounds, dir {d}")
        over = os.path.join(d, "over.pt")
        fastpersist.write_state_dict(sd, over)
        for r in range(args.rounds):
            for k in list(res)[r % len(res) :] + list(res)[: r % len(res)]:
                os.sync()
                time.sleep(args.settle)
                if k == "new path":
                    p = os.path.join(d, f"new-{r}.pt")
                    res[k].append(timed(lambda p=p: fastpersist.write_state_dict(sd, p)))
                    clear(p)
                elif k == "overwrite":
                    res[k].append(timed(lambda: fastpersist.write_state_dict(sd, over)))
                elif k == "os.replace alone":
                    a, b = os.path.join(d, "a.dat"), os.path.join(d, "b.dat")
                    for p in (a, b):
                        with open(p, "wb") as f:
                            f.truncate(0)
                            os.posix_fallocate(f.fileno(), 0, size)
                            f.flush()
                            os.fsync(f.fileno())
                    os.sync()
                    res[k].append(timed(lambda a=a, b=b: os.replace(a, b)))
                    clear(b)
                else:
                    p = os.path.join(d, "ts.pt")
                    if not os.path.exists(p):
                        torch.save(sd, p)

                    def ts(p=p):
                        with open(p + ".tmp", "wb") as f:
                            torch.save(sd, f)
                            f.flush()
                            os.fsync(f.fileno())
                        os.replace(p + ".tmp", p)

                    res[k].append(timed(ts))
            print(f"  round {r + 1}: " + "  ".join(f"{k}={v[-1]:.3f}s" for k, v in res.items() if v), flush=True)
        fastpersist._core.wait_for_frees(60.0)
    m = {k: median(v) for k, v in res.items()}
    print(f"  {'save':<22} {'median s':>9} {'vs new path':>12}")
    for k, v in m.items():
        print(f"  {k:<22} {v:>9.3f} {v / m['new path']:>12.2f}")


if __name__ == "__main__":
    main()
