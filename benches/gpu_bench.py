#!/usr/bin/env python3
"""GPU benchmark: end-to-end write of bf16 state dicts from GPU memory, and
read back to the GPU, against the D2H/H2D copy limits and the disk limits.

In one run, for each size (default 2 GiB and 8 GiB), medians of ``--rounds``:

* D2H limit: pinned device-to-host copy bandwidth of the same bytes;
* disk limits (``fastpersist.bench.Limit``): every fio configuration
  (``FIO_CONFIGS``: 4 MiB x 16 and 1 MiB x 32, normal and huge-page
  buffers) once per round on the same directory; the limit is the best
  configuration's median, named in the output;
* fastpersist.write_state_dict from GPU tensors, and from the same bytes in
  host memory (the disk path alone, against the disk limit); each writer
  writes a new file, as fio does (the old one is removed before the timing);
* torch.save + fsync from GPU tensors;
* read: fastpersist.read_state_dict to the GPU and to host memory, and
  torch.load(map_location="cuda"), against min(disk read, H2D) (every
  file evicted from the page cache the same way right before its read).

Writers and readers run in a rotated order (each goes first in some round).

Targets (issue 4): write at 0.9 of min(D2H, disk), read at 0.9 of min(disk
read, H2D). A virtual disk's speed drifts from minute to minute, so besides
the ratio of medians, the median of each round's own ratio (fastpersist
right after fio, on the same directory) is printed. ``--variants`` adds
fastpersist writes with other settings (``block``, ``arena``, ``qd``,
``chunk``, ``into``: e.g. ``block=4MiB:arena=64MiB,chunk=64MiB,into=slots``;
``into=slots`` stages through the staging slots instead of copying straight
into the engine's arena). DeepSpeed's FastFileWriter is measured when
``deepspeed`` imports. Needs a CUDA device; exits with a message otherwise.

Reads run once per variant, with the variant's environment (``into`` and
``chunk`` apply; write options do not), all reading the default variant's
file: ``into=slots`` reads through the staging slots instead of copying
straight out of the engine's arena.

``--stand-in`` runs the device write and read paths on the CPU instead
(host tensors staged as device ones, a thread standing in for the copy
engine, whose copies then cost CPU time a GPU's do not), timing only the
fastpersist writers and readers against the disk: the data path's own cost
without a GPU, e.g. ``--stand-in --variants into=slots`` for arena copies
against staging slots. ``--copy-rate GBPS`` makes the stand-in's copies
take the time a copy engine of that speed would, sleeping instead of
copying (no CPU time, as DMA; the bytes then are not the tensors': timing
only), so the data path is timed without the stand-in's own memcpy.

As root the run turns the kernel's free page reporting off (and back on
after), as ``read_bench.py`` does: otherwise memory one reader frees goes
back to a virtual machine's host, and the next reader waits for it.

    python benches/gpu_bench.py [--sizes 2GiB,8GiB] [--rounds 3] [--dir DIR] [--variants V,...]
                                [--stand-in [--copy-rate GBPS]]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import fastpersist
import torch
from fastpersist.bench import Limit, drop_cache, freed_memory, median, parse_size


def copy_limit(nbytes: int, d2h: bool) -> float:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src, dst = (dev, host) if d2h else (host, dev)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return nbytes / (time.perf_counter() - t0) / 1e9


def fresh(path: str) -> None:
    """Remove the previous round's file, and let the file system finish
    freeing it, before a timed write: fio writes a new file each time, so
    every writer does too. (Replacing a large file is not free: with ext4's
    online discard, freeing a 4 GiB file took about a second on the lent
    H100 machine, charged to whichever call drops the old inode.)"""
    if os.path.exists(path):
        os.unlink(path)
    os.sync()


def parse_variant(spec: str) -> tuple:
    """``block=4MiB:arena=64MiB:qd=32:chunk=64MiB:into=slots`` -> (name,
    write options, environment)."""
    keys = {"block": "block_size", "arena": "arena_bytes", "qd": "queue_depth"}
    kw, env = {}, {}
    for part in spec.split(":"):
        k, _, v = part.partition("=")
        if k == "chunk":
            env["FASTPERSIST_STAGE_CHUNK"] = str(parse_size(v))
        elif k == "into" and v in ("arena", "slots"):
            env["FASTPERSIST_STAGE_INTO_ARENA"] = "1" if v == "arena" else "0"
        elif k in keys:
            kw[keys[k]] = int(v) if k == "qd" else parse_size(v)
        else:
            raise SystemExit(f"gpu_bench: unknown variant setting {k!r} in {spec!r}")
    return spec, kw, env


_DS: list = []  # write_bench's DeepSpeed writer (or None), made on first use


def deepspeed_write(sd: dict, path: str):
    """Seconds for DeepSpeed's FastFileWriter (write_bench's set-up) to
    write ``sd`` durably, or None where deepspeed is not available."""
    if not _DS:
        from write_bench import _deepspeed_writer

        _DS.append(_deepspeed_writer())
    if _DS[0] is None:
        return None
    t0 = time.perf_counter()
    _DS[0](sd, path)
    return time.perf_counter() - t0


def gpu_state(nbytes: int) -> dict:
    n = 4096 * 4096
    count = max(1, nbytes // (2 * n))
    return {f"layer{i}.weight": torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for i in range(count)}


def with_env(env: dict, call):
    """``call()`` with the environment variables ``env`` set for it."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return call()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def timed_write(sd: dict, path: str, kw: dict, env: dict) -> float:
    """Seconds of one fastpersist write of ``sd`` (a fresh file), with the
    environment variables ``env`` set for it."""
    fresh(path)

    def write() -> float:
        t0 = time.perf_counter()
        fastpersist.write_state_dict(sd, path, **kw)
        return time.perf_counter() - t0

    return with_env(env, write)


def torch_write(sd: dict, path: str) -> float:
    fresh(path)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def cold_read(path: str, read) -> float:
    """Seconds of ``read(path)`` from the device: every reader's file is
    evicted from the page cache the same way first."""
    drop_cache(path)
    t0 = time.perf_counter()
    out = read(path)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter() - t0
    del out  # freed after the clock stops, as bench.timed does
    return t


def rotated(items: list, r: int) -> list:
    """``items`` starting at ``r``: each writer (reader) goes first in some
    round, so none always runs on a disk the others have warmed or worn."""
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def bench_size(size: int, d: str, variants: list, rounds: int) -> None:
    """Every writer and reader, ``rounds`` times, on a ``size`` state dict."""
    sd = gpu_state(size)
    host = {k: v.cpu() for k, v in sd.items()}  # the same bytes in host memory
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    path = {name: os.path.join(d, f"{name}.pt") for name in ("fp", "host", "ts", "ds")}
    wlim, rlim = Limit(), Limit()
    res: dict = {}

    def add(key: str, seconds) -> None:
        if seconds is not None:
            res.setdefault(key, []).append(nbytes / seconds / 1e9)

    # Writers: (result key, call returning seconds or None).
    writers = [
        (f"fp_w {name}", lambda kw=kw, env=env: timed_write(sd, path["fp"], kw, env)) for name, kw, env in variants
    ]
    writers += [
        ("host_w", lambda: timed_write(host, path["host"], {}, {})),
        ("ts_w", lambda: torch_write(sd, path["ts"])),
        ("ds_w", lambda: (fresh(path["ds"]), deepspeed_write(sd, path["ds"]))[1]),
    ]
    # Readers: every variant's environment (its write options do not apply)
    # reading the default variant's file to the GPU.
    readers = [
        (
            f"fp_r {name}",
            lambda env=env: with_env(
                env, lambda: cold_read(path["fp"], lambda p: fastpersist.read_state_dict(p, map_location="cuda"))
            ),
        )
        for name, _, env in variants
    ]
    readers += [
        ("host_r", lambda: cold_read(path["host"], lambda p: fastpersist.read_state_dict(p))),
        (
            "ts_r",
            lambda: cold_read(path["ts"], lambda p: torch.load(p, map_location="cuda", weights_only=True)),
        ),
    ]
    for r in range(rounds):
        res.setdefault("d2h", []).append(copy_limit(min(nbytes, 4 << 30), True))
        res.setdefault("h2d", []).append(copy_limit(min(nbytes, 4 << 30), False))
        # The limit once per round (every fio configuration), on the
        # same directory, right before this round's writers.
        fio_w = wlim.measure(d, nbytes)
        for key, write in rotated(writers, r):
            add(key, write())
        # The default variant writes path["fp"] last when there are
        # variants: rewrite it so the GPU read reads the default file.
        if len(variants) > 1:
            timed_write(sd, path["fp"], {}, {})
        fio_r = rlim.measure(d, nbytes, "read")
        for key, read in rotated(readers, r):
            add(key, read())
        # This round's own ratios (the disk's speed drifts between rounds).
        wl = min(res["d2h"][-1], max(fio_w.values(), default=float("nan")))
        rl = min(res["h2d"][-1], max(fio_r.values(), default=float("nan")))
        for name, _, _ in variants:
            res.setdefault("ratio " + name, []).append(res["fp_w " + name][-1] / wl)
        res.setdefault("ratio host_w", []).append(res["host_w"][-1] / max(fio_w.values(), default=float("nan")))
        for name, _, _ in variants:
            res.setdefault("ratio r " + name, []).append(res["fp_r " + name][-1] / rl)
        res.setdefault("ratio host_r", []).append(res["host_r"][-1] / max(fio_r.values(), default=float("nan")))
    m = {k: median(v) if v else float("nan") for k, v in res.items()}
    dw, dr = wlim.gbps, rlim.gbps
    wl, rl = min(m["d2h"], dw), min(m["h2d"], dr)
    print(
        f"\n{nbytes / 2**20:.0f} MiB bf16 on the GPU: D2H {m['d2h']:.1f}, H2D {m['h2d']:.1f}, "
        f"disk write {dw:.2f}, disk read {dr:.2f} GB/s"
    )
    print(f"  write {wlim.note()}")
    print(f"  read  {rlim.note()}")
    for name, _, _ in variants:
        print(
            f"  write: fastpersist[{name}] from GPU {m['fp_w ' + name]:.2f} GB/s "
            f"({m['fp_w ' + name] / wl:.2f} of min(D2H, disk); median of per-round ratios "
            f"{m['ratio ' + name]:.2f})"
        )
    print(
        f"  write: fastpersist from host memory {m['host_w']:.2f} GB/s ({m['host_w'] / dw:.2f} of the disk; "
        f"median of per-round ratios {m['ratio host_w']:.2f})"
    )
    print(f"  write: torch.save+fsync {m['ts_w']:.2f} ({m['ts_w'] / wl:.2f})")
    if res.get("ds_w"):
        print(f"  write: DeepSpeed FastFileWriter {m['ds_w']:.2f} ({m['ds_w'] / wl:.2f})")
    else:
        print("  write: DeepSpeed FastFileWriter not measured (deepspeed does not import here)")
    for name, _, _ in variants:
        print(
            f"  read:  fastpersist[{name}] to GPU {m['fp_r ' + name]:.2f} GB/s ({m['fp_r ' + name] / rl:.2f} of "
            f"min(disk, H2D); median of per-round ratios {m['ratio r ' + name]:.2f})"
        )
    print(f"  read:  torch.load {m['ts_r']:.2f} ({m['ts_r'] / rl:.2f})")
    print(
        f"  read:  fastpersist to host memory {m['host_r']:.2f} GB/s ({m['host_r'] / dr:.2f} of the disk; "
        f"median of per-round ratios {m['ratio host_r']:.2f})"
    )


def dma_stand_in(gbps: float) -> None:
    """The stand-in copier's copies sleep as long as a copy engine of
    ``gbps`` GB/s would take, copying nothing (timing only)."""
    from fastpersist.cuda_staging import ThreadCopier

    def later(self, n: int):
        return self._pool.submit(time.sleep, n / (gbps * 1e9))

    ThreadCopier.copy = lambda self, dst, storage, start, end: later(self, end - start)
    ThreadCopier.copy_in = lambda self, storage, start, src: later(self, src.numel())


def bench_stand_in(size: int, d: str, variants: list, rounds: int) -> None:
    """The device write and read paths on the CPU: each variant against the
    disk (the stand-in copier's copies take CPU time a GPU's would not)."""
    n = 4096 * 4096
    sd = {f"layer{i}.weight": torch.randn(4096, 4096).to(torch.bfloat16) for i in range(max(1, size // (2 * n)))}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    path = os.path.join(d, "fp.pt")
    wlim, rlim = Limit(), Limit()
    res: dict = {}
    staged = {"FASTPERSIST_TEST_STAGE_CPU": "1"}
    writers = [(name, kw, {**staged, **env}) for name, kw, env in variants] + [("host memory", {}, {})]
    readers = [(name, {**staged, **env}) for name, _, env in variants] + [("host memory", {})]
    for r in range(rounds):
        fio = max(wlim.measure(d, nbytes).values(), default=float("nan"))
        for name, kw, env in rotated(writers, r):
            gbps = nbytes / timed_write(sd, path, kw, env) / 1e9
            res.setdefault("w " + name, []).append(gbps)
            res.setdefault("w ratio " + name, []).append(gbps / fio)
        fio = max(rlim.measure(d, nbytes, "read").values(), default=float("nan"))
        for name, env in rotated(readers, r):
            gbps = nbytes / with_env(env, lambda: cold_read(path, fastpersist.read_state_dict)) / 1e9
            res.setdefault("r " + name, []).append(gbps)
            res.setdefault("r ratio " + name, []).append(gbps / fio)
    print(
        f"\n{nbytes / 2**20:.0f} MiB bf16, device paths on the CPU (stand-in copier): disk write {wlim.gbps:.2f}, "
        f"read {rlim.gbps:.2f} GB/s"
    )
    print(f"  write {wlim.note()}")
    print(f"  read  {rlim.note()}")
    for op, lim, names in (("write", wlim, [w[0] for w in writers]), ("read", rlim, [x[0] for x in readers])):
        for name in names:
            got = median(res[f"{op[0]} {name}"])
            print(
                f"  {op}: fastpersist[{name}] {got:.2f} GB/s ({got / lim.gbps:.2f} of the disk; "
                f"median of per-round ratios {median(res[f'{op[0]} ratio {name}']):.2f})"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2GiB,8GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--variants", default="", help="extra fastpersist settings to time, comma-separated")
    ap.add_argument("--stand-in", action="store_true", help="the device paths on the CPU (no GPU needed)")
    ap.add_argument(
        "--copy-rate", type=float, default=None, help="with --stand-in: copies sleep as a copy engine of GBPS would"
    )
    args = ap.parse_args()
    if args.copy_rate is not None:
        if not args.stand_in or args.copy_rate <= 0:
            raise SystemExit("gpu_bench: --copy-rate needs --stand-in and a positive rate")
        dma_stand_in(args.copy_rate)
    variants = [("default", {}, {})] + [parse_variant(v) for v in args.variants.split(",") if v]
    if args.stand_in:
        how = f"copies sleeping as at {args.copy_rate:g} GB/s" if args.copy_rate else "copies by a CPU thread"
        print(f"stand-in for a GPU ({how}), torch {torch.__version__}, fastpersist {fastpersist.__version__}")
    elif not torch.cuda.is_available():
        print("gpu_bench: no CUDA device here; nothing measured")
        sys.exit(0)
    else:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, fastpersist {fastpersist.__version__}")
    with (
        freed_memory(None) as kept,
        tempfile.TemporaryDirectory(prefix="fastpersist-gpu-", dir=args.dir or os.getcwd()) as d,
    ):
        if kept.note:
            print(f"memory: {kept.note}")
        for size in (parse_size(s) for s in args.sizes.split(",")):
            if args.stand_in:
                bench_stand_in(size, d, variants, args.rounds)
            else:
                bench_size(size, d, variants, args.rounds)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
