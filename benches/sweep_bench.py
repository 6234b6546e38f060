#!/usr/bin/env python3
"""Engine-option sweep: fastpersist's write and cold read of a GPT-like state
dict under each combination of write size (``block_size``), writes in flight
(``queue_depth``), staging arena size (``arena_bytes``) and gather/scatter
threads, as ratios to the honest device limit measured in the same run (the
best of several fio configurations, huge-page buffers included, same
directory). What the defaults should be is read off this table.

    python benches/sweep_bench.py [--size 1GiB] [--rounds 3] [--dir DIR]
        [--blocks 1MiB,4MiB,8MiB] [--depths 8,16,32] [--arenas 32MiB,128MiB]
        [--threads 1,2] [--no-read] [--no-fio] [--json OUT]

Every configuration runs once per round, the order rotating each round
(``sync`` and ``--settle`` seconds of idle before each run); each figure is
the median over the rounds. An arena smaller than ``block_size x
queue_depth`` caps the writes in flight at what it holds: such combinations
are skipped, and the table says how many buffers each configuration has.
Each configuration's engine (its arena allocated and faulted in) is made
before its timed calls, as a long-running process reuses one.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import tempfile
import time
from typing import Dict, Iterator, List, NamedTuple, Tuple

import fastpersist
from fastpersist.bench import Limit, drop_cache, gpt_state_dict, median, nbytes, parse_size
from fastpersist.options import (
    DEFAULT_ARENA_BYTES,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_QUEUE_DEPTH,
    EngineOptions,
    get_engine,
)

MiB = 1 << 20


class Config(NamedTuple):
    block_size: int
    queue_depth: int
    arena_bytes: int
    gather_threads: int

    @property
    def name(self) -> str:
        return (
            f"{self.block_size // MiB}MiB x {self.queue_depth}, arena {self.arena_bytes // MiB}MiB "
            f"({self.arena_bytes // self.block_size} bufs), {self.gather_threads} thr"
        )

    def options(self) -> Dict[str, int]:
        return dict(self._asdict())

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        """These options as the ``FASTPERSIST_*`` environment defaults."""
        old = dict(os.environ)
        os.environ.update({f"FASTPERSIST_{k.upper()}": str(v) for k, v in self.options().items()})
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(old)


def sizes(arg: str) -> List[int]:
    return [parse_size(s) for s in arg.split(",") if s]


def configs(args: argparse.Namespace) -> Tuple[List[Config], Config]:
    out = []
    for b, d, a, t in itertools.product(
        sizes(args.blocks),
        [int(x) for x in args.depths.split(",")],
        sizes(args.arenas),
        [int(x) for x in args.threads.split(",")],
    ):
        if a < b * d or a % b:
            continue  # fewer buffers than writes in flight: the depth would not be reached
        out.append(Config(b, d, a, t))
    default = Config(
        DEFAULT_BLOCK_SIZE, DEFAULT_QUEUE_DEPTH, DEFAULT_ARENA_BYTES, EngineOptions.resolve().gather_threads
    )
    if default not in out:
        out.insert(0, default)
    return out, default


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--blocks", default="1MiB,4MiB,8MiB")
    ap.add_argument("--depths", default="8,16,32")
    ap.add_argument("--arenas", default="32MiB,128MiB,256MiB")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--settle", type=float, default=0.5)
    ap.add_argument("--no-read", action="store_true", help="writes only")
    ap.add_argument("--no-fio", action="store_true", help="no device limit (smoke runs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfgs, default = configs(args)
    with tempfile.TemporaryDirectory(prefix="fastpersist-sweep-", dir=args.dir or os.getcwd()) as d:
        sd = gpt_state_dict(parse_size(args.size))
        size = nbytes(sd)
        path = os.path.join(d, "sweep.pt")
        wlimit, rlimit = Limit(), Limit()
        writes: Dict[Config, List[float]] = {c: [] for c in cfgs}
        reads: Dict[Config, List[float]] = {c: [] for c in cfgs}
        for r in range(args.rounds):
            if not args.no_fio:
                wlimit.measure(d, size, "write")
                if not args.no_read:
                    rlimit.measure(d, size, "read")
            k = r % len(cfgs)
            for c in cfgs[k:] + cfgs[:k]:
                # Engines are made once per process and reused; more option
                # sets than the engine cache holds would make (and fault in)
                # an arena inside every timed call: made here, untimed.
                get_engine(EngineOptions.resolve(**c.options()))
                os.sync()
                time.sleep(args.settle)
                t0 = time.perf_counter()
                fastpersist.write_state_dict(sd, path, **c.options())
                writes[c].append(size / (time.perf_counter() - t0) / 1e9)
                if not args.no_read:
                    drop_cache(path)
                    time.sleep(args.settle)
                    with c.environment():  # reads take the engine options from the environment
                        get_engine(EngineOptions.resolve())
                        t0 = time.perf_counter()
                        back = fastpersist.read_state_dict(path)
                    reads[c].append(size / (time.perf_counter() - t0) / 1e9)
                    del back
                os.unlink(path)
        print(f"GPT-like {size / 2**30:.2f} GiB, medians of {args.rounds} rounds, {len(cfgs)} configurations")
        if not args.no_fio:
            print(f"write {wlimit.note()}")
            if not args.no_read:
                print(f"read {rlimit.note()}")
        wl = wlimit.gbps if not args.no_fio else float("nan")
        rl = rlimit.gbps if not (args.no_fio or args.no_read) else float("nan")
        rows = sorted(cfgs, key=lambda c: -median(writes[c]))
        print("| configuration | write GB/s | share of write limit | read GB/s | share of read limit |")
        print("| --- | --- | --- | --- | --- |")
        for c in rows:
            w = median(writes[c])
            rd = median(reads[c]) if reads[c] else float("nan")
            mark = " (default)" if c == default else ""
            print(f"| {c.name}{mark} | {w:.2f} | {w / wl:.2f} | {rd:.2f} | {rd / rl:.2f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "bytes": size,
                        "write_limit": {"gbps": wl, "config": wlimit.config, "medians": wlimit.medians()},
                        "read_limit": {"gbps": rl, "config": rlimit.config, "medians": rlimit.medians()},
                        "configs": [{**c.options(), "write_gbps": writes[c], "read_gbps": reads[c]} for c in cfgs],
                    },
                    f,
                    indent=1,
                )


if __name__ == "__main__":
    main()
