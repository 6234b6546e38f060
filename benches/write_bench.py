#!/usr/bin/env python3
"""Write benchmark: fastpersist against the device limit and the peers.

In one run, alternating rounds (the order rotates each round), medians of
``--rounds`` runs, every writer durable (data fsynced), after ``--warmup``
untimed writes by each writer (its one-time set-up in the process; their
speed is printed apart):

* the device limit: the best of several fio configurations (O_DIRECT,
  io_uring; 4 MiB x 16 and 1 MiB x 32, each from normal and from huge-page
  buffers; ``fastpersist.bench.FIO_CONFIGS``), on the same directory, each
  configuration's median over the rounds, the winner named;
* fastpersist.write_state_dict;
* torch.save + fsync;
* safetensors save_file + fsync;
* torch DCP FileSystemWriter (2 threads, sync_files);
* DeepSpeed FastFileWriter, where deepspeed and its aio op are installed.

Two workloads: a GPT-like state dict (``--size``, default 2 GiB) and
``--small-count`` small tensors (4 KiB to 1 MiB, about ``--small-size`` in all).
Then the peak resident memory each writer adds, in a fresh process.

    python benches/write_bench.py [--size 2GiB] [--rounds 5] [--dir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Callable, Dict, List, Optional

import torch
from fastpersist import _core
from fastpersist.bench import (
    Limit,
    MiB,
    clear,
    fsync_path,
    fsync_tree,
    gpt_state_dict,
    median,
    nbytes,
    parse_size,
    peak_rss_delta,
    small_tensors_state_dict,
    timed,
)

Writer = Callable[[Dict[str, torch.Tensor], str], None]


def w_fastpersist(sd, path):
    import fastpersist

    fastpersist.write_state_dict(sd, path)


def w_torch_save(sd, path):
    with open(path, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())


def w_safetensors(sd, path):
    from safetensors.torch import save_file

    save_file(sd, path)
    fsync_path(path)


def w_dcp(sd, path):
    import torch.distributed.checkpoint as dcp

    os.makedirs(path, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, thread_count=2, sync_files=True))
    fsync_tree(path)


def _byte_views(x):
    """DeepSpeed's utils op cast_to_byte_tensor: zero-copy uint8 views."""
    one = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    return [one(t) for t in x] if isinstance(x, (list, tuple)) else one(x)


def _deepspeed_writer() -> Optional[Writer]:
    """DeepSpeed's FastFileWriter through torch.save (its default zip path),
    if deepspeed is installed and its async_io op builds (needs libaio-dev
    and ninja; the first build takes minutes). The CPU accelerator lacks the
    small "utils" op, whose only use here is cast_to_byte_tensor: we supply
    that (zero-copy uint8 views)."""
    try:
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        import deepspeed.io.fast_file_writer as ffw  # type: ignore
        from deepspeed.io import FastFileWriter, FastFileWriterConfig  # type: ignore
        from deepspeed.ops.op_builder import AsyncIOBuilder  # type: ignore

        if not AsyncIOBuilder().is_compatible(verbose=False):
            return None
        aio = AsyncIOBuilder().load(verbose=False)
        handle = aio.aio_handle(8 * MiB, 8, False, True, 1)
        pinned = handle.new_cpu_locked_tensor(64 * MiB, torch.empty(0, dtype=torch.uint8))

        class _Utils:
            def load(self):
                return self

            cast_to_byte_tensor = staticmethod(_byte_views)

        ffw.UtilsBuilder = _Utils
    except Exception as e:  # noqa: BLE001 - any failure means "not available here"
        print(f"DeepSpeed FastFileWriter unavailable: {type(e).__name__}: {e}")
        return None

    def write(sd, path):
        cfg = FastFileWriterConfig(
            dnvme_handle=handle, pinned_tensor=pinned, double_buffer=True, num_parallel_writers=1, writer_rank=0
        )
        f = FastFileWriter(file_path=path, config=cfg)
        try:
            torch.save(sd, f)
        finally:
            f.close()
        fsync_path(path)

    return write


WRITERS: Dict[str, Writer] = {
    "fastpersist": w_fastpersist,
    "torch.save": w_torch_save,
    "safetensors": w_safetensors,
    "torch DCP": w_dcp,
}


FIO = "fio (limit)"


def settle(seconds: float) -> None:
    """Let the previous writer's write-back and discards finish, so they do
    not land on the next measurement."""
    os.sync()
    time.sleep(seconds)


def write_once(writer: Writer, name: str, sd, directory: str, into: List[float], failed: str) -> None:
    """Time one write by ``writer`` into ``directory``, appended to ``into``;
    a failure is printed (``failed``) and the run goes on. The file is
    removed after."""
    path = os.path.join(directory, f"bench-{name.replace(' ', '_')}.out")
    try:
        into.append(timed(lambda: writer(sd, path)))
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"  {name}: {failed}: {type(e).__name__}: {e}", flush=True)
    clear(path)


def run_workload(
    name: str, sd, directory: str, rounds: int, writers: Dict[str, Writer], settle_s: float, warmup: int = 1
) -> dict:
    size = nbytes(sd)
    print(f"\n== {name}: {len(sd)} tensors, {size / 2**30:.2f} GiB, {rounds} rounds ==", flush=True)
    times: Dict[str, List[float]] = {k: [] for k in writers}
    limit = Limit()
    names = list(writers)
    # Each writer's first writes in this process, not in the medians: its
    # one-time set-up (fastpersist's staging arena, first touched here: 0.3
    # s on this VM; torch's and the others' allocations) is paid once by a
    # training run, and the rounds measure the writes it makes after.
    first: Dict[str, List[float]] = {k: [] for k in names}
    for _ in range(warmup):
        for w in names:
            settle(settle_s)
            write_once(writers[w], w, sd, directory, first[w], "warm-up failed")
    if warmup:
        line = "  ".join(f"{w}={size / t[0] / 1e9:.2f}" for w, t in first.items() if t)
        print(f"  warm-up, not in the medians (first writes in this process): {line} GB/s", flush=True)
    slots = [FIO] + names
    for r in range(rounds):
        # The fio run takes its turn in the rotation like every writer.
        order = slots[r % len(slots) :] + slots[: r % len(slots)]
        for w in order:
            settle(settle_s)
            if w == FIO:
                limit.measure(directory, size)
                continue
            write_once(writers[w], w, sd, directory, times[w], "failed")
        line = "  ".join(f"{w}={size / times[w][-1] / 1e9:.2f}" for w in names if times[w])
        print(f"  round {r + 1}: fio best so far={limit.gbps:.2f}  {line} GB/s", flush=True)
    lim = limit.gbps
    print(f"  {limit.note()}")
    res = {
        "workload": name,
        "bytes": size,
        "tensors": len(sd),
        **limit.as_dict(),
        "writers": {},
    }
    print(f"  {'writer':<14} {'GB/s':>7} {'share of limit':>15}")
    print(f"  {'fio (limit)':<14} {lim:>7.2f} {1.0:>15.2f}")
    for w in names:
        if not times[w]:
            continue
        gbps = size / median(times[w]) / 1e9
        res["writers"][w] = {
            "gbps": gbps,
            "share": gbps / lim if lim == lim else None,
            "seconds": times[w],
            "warmup_seconds": first[w],
        }
        print(f"  {w:<14} {gbps:>7.2f} {gbps / lim:>15.2f}")
    return res


def child_memory(writer: str, size: int, directory: str) -> None:
    """In a fresh process: build the state dict, then measure the peak
    resident memory the write adds."""
    sd = gpt_state_dict(size)
    w = WRITERS[writer] if writer in WRITERS else _deepspeed_writer()
    path = os.path.join(directory, "mem.out")
    delta = peak_rss_delta(lambda: w(sd, path))
    clear(path)
    print(json.dumps({"writer": writer, "peak_rss_delta": delta}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB", help="GPT-like state dict size (default 2GiB)")
    ap.add_argument("--small-count", type=int, default=10_000, help="small tensors (0: skip)")
    ap.add_argument("--small-size", default="1GiB", help="total size of the small tensors")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir in the cwd)")
    ap.add_argument("--only", default=None, help="comma-separated writers to run")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of idle (after sync) before each measurement")
    ap.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed writes by each writer before the rounds, reported apart (default 1; 0: none)",
    )
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--child-memory", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    size = parse_size(args.size)

    base = args.dir or os.getcwd()
    if args.child_memory:
        child_memory(args.child_memory, size, base)
        return

    writers = dict(WRITERS)
    ds = _deepspeed_writer()
    if ds is not None:
        writers["DeepSpeed FFW"] = ds
    else:
        print(
            "DeepSpeed FastFileWriter: not installed or its aio op does not build here; skipped "
            "(pip install deepspeed ninja, apt-get install libaio-dev)"
        )
    if args.only:
        keep = [w.strip() for w in args.only.split(",")]
        writers = {k: v for k, v in writers.items() if k in keep}

    results = []
    with tempfile.TemporaryDirectory(prefix="fastpersist-bench-", dir=base) as d:
        import fastpersist

        print(
            f"fastpersist {fastpersist.__version__} (copy: {_core.copy_kernel() or 'two-pass'}), "
            f"torch {torch.__version__}, dir {d}"
        )
        sd = gpt_state_dict(size)
        results.append(run_workload("GPT-like", sd, d, args.rounds, writers, args.settle, args.warmup))
        del sd
        if args.small_count:
            sd = small_tensors_state_dict(args.small_count, parse_size(args.small_size))
            results.append(run_workload("small tensors", sd, d, args.rounds, writers, args.settle, args.warmup))
            del sd

        print("\n== peak resident memory added by one write (GPT-like, fresh process) ==")
        mem = {}
        for w in [w for w in ("fastpersist", "torch.save", "safetensors") if w in writers]:
            out = subprocess.run(
                [sys.executable, __file__, "--child-memory", w, "--size", args.size, "--dir", d],
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                print(f"  {w}: failed: {out.stderr.strip().splitlines()[-1:]}")
                continue
            delta = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_delta"]
            mem[w] = delta
            print(f"  {w:<14} {delta / MiB:>8.1f} MiB")
        results.append({"workload": "memory", "peak_rss_delta": mem})

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
