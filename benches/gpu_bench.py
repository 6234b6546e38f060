#!/usr/bin/env python3
"""GPU benchmark: end-to-end write of bf16 state dicts from GPU memory, and
read back to the GPU, against the D2H/H2D copy limits and the disk limits.

In one run, for each size (default 2 GiB and 8 GiB), medians of ``--rounds``:

* D2H limit: pinned device-to-host copy bandwidth of the same bytes;
* disk write limit: the best of fio's configurations (``fastpersist.bench.FIO_CONFIGS``:
  4 MiB x 16 and 1 MiB x 32, normal and huge-page buffers) on the same directory;
* fastpersist.write_state_dict from GPU tensors (each writer writes a new
  file, as fio does: the old one is removed before the timing);
* torch.save + fsync from GPU tensors;
* read: fastpersist.read_state_dict(map_location="cuda") and torch.load(map_location="cuda")
  against min(fio read, H2D) (cold: page cache dropped first).

Targets (issue 4): write at 0.9 of min(D2H, disk), read at 0.9 of min(disk
read, H2D). A virtual disk's speed drifts from minute to minute, so besides
the ratio of medians, the median of each round's own ratio (fastpersist
right after fio, on the same directory) is printed. ``--variants`` adds
fastpersist writes with other settings (``block``, ``arena``, ``qd``,
``chunk``: e.g. ``block=4MiB:arena=64MiB,chunk=64MiB``). DeepSpeed's
FastFileWriter is measured when ``deepspeed`` imports. Needs a CUDA device;
exits with a message otherwise.

    python benches/gpu_bench.py [--sizes 2GiB,8GiB] [--rounds 3] [--dir DIR] [--variants V,...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import fastpersist
import torch
from fastpersist.bench import drop_cache, fio_limit, median, parse_size


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
    """``block=4MiB:arena=64MiB:qd=32:chunk=64MiB`` -> (name, write options, stage chunk)."""
    keys = {"block": "block_size", "arena": "arena_bytes", "qd": "queue_depth"}
    kw, chunk = {}, None
    for part in spec.split(":"):
        k, _, v = part.partition("=")
        if k == "chunk":
            chunk = parse_size(v)
        elif k in keys:
            kw[keys[k]] = int(v) if k == "qd" else parse_size(v)
        else:
            raise SystemExit(f"gpu_bench: unknown variant setting {k!r} in {spec!r}")
    return spec, kw, chunk


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2GiB,8GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--variants", default="", help="extra fastpersist settings to time, comma-separated")
    args = ap.parse_args()
    variants = [("default", {}, None)] + [parse_variant(v) for v in args.variants.split(",") if v]
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device here; nothing measured")
        sys.exit(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, fastpersist {fastpersist.__version__}")
    with tempfile.TemporaryDirectory(prefix="fastpersist-gpu-", dir=args.dir or os.getcwd()) as d:
        for size in (parse_size(s) for s in args.sizes.split(",")):
            sd = gpu_state(size)
            nbytes = sum(t.numel() * t.element_size() for t in sd.values())
            fp, ts = os.path.join(d, "fp.pt"), os.path.join(d, "ts.pt")
            res: dict = {k: [] for k in ("d2h", "h2d", "fio_w", "fio_r", "ts_w", "fp_r", "ts_r", "ds_w")}
            for name, _, _ in variants:
                res["fp_w " + name] = []
                res["ratio " + name] = []
            stats = None
            for _ in range(args.rounds):
                res["d2h"].append(copy_limit(min(nbytes, 4 << 30), True))
                res["h2d"].append(copy_limit(min(nbytes, 4 << 30), False))
                for name, kw, chunk in variants:
                    res["fio_w"].append(fio_limit(d, nbytes) or float("nan"))
                    fresh(fp)
                    old = os.environ.get("FASTPERSIST_STAGE_CHUNK")
                    if chunk:
                        os.environ["FASTPERSIST_STAGE_CHUNK"] = str(chunk)
                    try:
                        t0 = time.perf_counter()
                        st = fastpersist.write_state_dict(sd, fp, **kw)
                        bw = nbytes / (time.perf_counter() - t0) / 1e9
                    finally:
                        if chunk:
                            os.environ.pop("FASTPERSIST_STAGE_CHUNK")
                            if old is not None:
                                os.environ["FASTPERSIST_STAGE_CHUNK"] = old
                    stats = stats or st
                    res["fp_w " + name].append(bw)
                    res["ratio " + name].append(bw / min(res["d2h"][-1], res["fio_w"][-1]))
                fresh(ts)
                t0 = time.perf_counter()
                with open(ts, "wb") as f:
                    torch.save(sd, f)
                    f.flush()
                    os.fsync(f.fileno())
                res["ts_w"].append(nbytes / (time.perf_counter() - t0) / 1e9)
                fresh(os.path.join(d, "ds.pt"))
                ds = deepspeed_write(sd, os.path.join(d, "ds.pt"))
                if ds is not None:
                    res["ds_w"].append(nbytes / ds / 1e9)
                res["fio_r"].append(fio_limit(d, nbytes, "read") or float("nan"))
                drop_cache(fp)
                t0 = time.perf_counter()
                fastpersist.read_state_dict(fp, map_location="cuda")
                torch.cuda.synchronize()
                res["fp_r"].append(nbytes / (time.perf_counter() - t0) / 1e9)
                res.setdefault("ratio read", []).append(res["fp_r"][-1] / min(res["h2d"][-1], res["fio_r"][-1]))
                drop_cache(ts)
                t0 = time.perf_counter()
                torch.load(ts, map_location="cuda", weights_only=True)
                torch.cuda.synchronize()
                res["ts_r"].append(nbytes / (time.perf_counter() - t0) / 1e9)
            m = {k: median(v) if v else float("nan") for k, v in res.items()}
            wl, rl = min(m["d2h"], m["fio_w"]), min(m["h2d"], m["fio_r"])
            print(
                f"\n{nbytes / 2**30:.1f} GiB bf16 on the GPU: D2H {m['d2h']:.1f}, H2D {m['h2d']:.1f}, "
                f"fio write {m['fio_w']:.2f}, fio read {m['fio_r']:.2f} GB/s "
                f"(fio write per run: {' '.join(f'{x:.2f}' for x in res['fio_w'])})"
            )
            if stats is not None:
                print(f"  fastpersist path: io_uring={stats.io_uring} direct={stats.direct} block={stats.block}")
            for name, _, _ in variants:
                print(
                    f"  write: fastpersist[{name}] {m['fp_w ' + name]:.2f} GB/s ({m['fp_w ' + name] / wl:.2f} "
                    f"of the limit; median of per-round ratios {m['ratio ' + name]:.2f})"
                )
            print(f"  write: torch.save+fsync {m['ts_w']:.2f} ({m['ts_w'] / wl:.2f})")
            if res["ds_w"]:
                print(f"  write: DeepSpeed FastFileWriter {m['ds_w']:.2f} ({m['ds_w'] / wl:.2f})")
            else:
                print("  write: DeepSpeed FastFileWriter not measured (deepspeed does not import here)")
            print(
                f"  read:  fastpersist {m['fp_r']:.2f} GB/s ({m['fp_r'] / rl:.2f} of the limit; median of "
                f"per-round ratios {m['ratio read']:.2f}), torch.load {m['ts_r']:.2f} ({m['ts_r'] / rl:.2f})"
            )
            del sd
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
