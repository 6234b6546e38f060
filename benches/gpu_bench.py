#!/usr/bin/env python3
"""GPU benchmark: end-to-end write of bf16 state dicts from GPU memory, and
read back to the GPU, against the D2H/H2D copy limits and the disk limits.

In one run, for each size (default 2 GiB and 8 GiB), medians of ``--rounds``:

* D2H limit: pinned device-to-host copy bandwidth of the same bytes;
* disk write limit: fio O_DIRECT io_uring 4 MiB x 16 on the same directory;
* fastpersist.write_state_dict from GPU tensors;
* torch.save + fsync from GPU tensors;
* read: fastpersist.read_state_dict(map_location="cuda") and torch.load(map_location="cuda")
  against min(fio read, H2D) (cold: page cache dropped first).

Targets (issue 4): write at 0.9 of min(D2H, disk), read at 0.9 of min(disk
read, H2D). Needs a CUDA device; exits with a message otherwise.

    python benches/gpu_bench.py [--sizes 2GiB,8GiB] [--rounds 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

import fastpersist
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


def gpu_state(nbytes: int) -> dict:
    n = 4096 * 4096
    count = max(1, nbytes // (2 * n))
    return {f"layer{i}.weight": torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for i in range(count)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2GiB,8GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device here; nothing measured")
        sys.exit(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, fastpersist {fastpersist.__version__}")
    with tempfile.TemporaryDirectory(prefix="fastpersist-gpu-", dir=args.dir or os.getcwd()) as d:
        for size in (parse_size(s) for s in args.sizes.split(",")):
            sd = gpu_state(size)
            nbytes = sum(t.numel() * t.element_size() for t in sd.values())
            fp, ts = os.path.join(d, "fp.pt"), os.path.join(d, "ts.pt")
            res = {k: [] for k in ("d2h", "h2d", "fio_w", "fio_r", "fp_w", "ts_w", "fp_r", "ts_r")}
            for _ in range(args.rounds):
                res["d2h"].append(copy_limit(min(nbytes, 4 << 30), True))
                res["h2d"].append(copy_limit(min(nbytes, 4 << 30), False))
                res["fio_w"].append(fio_limit(d, nbytes) or float("nan"))
                res["fio_r"].append(fio_limit(d, nbytes, "read") or float("nan"))
                os.sync()
                t0 = time.perf_counter()
                fastpersist.write_state_dict(sd, fp)
                res["fp_w"].append(nbytes / (time.perf_counter() - t0) / 1e9)
                os.sync()
                t0 = time.perf_counter()
                with open(ts, "wb") as f:
                    torch.save(sd, f)
                    f.flush()
                    os.fsync(f.fileno())
                res["ts_w"].append(nbytes / (time.perf_counter() - t0) / 1e9)
                drop_cache(fp)
                t0 = time.perf_counter()
                fastpersist.read_state_dict(fp, map_location="cuda")
                torch.cuda.synchronize()
                res["fp_r"].append(nbytes / (time.perf_counter() - t0) / 1e9)
                drop_cache(ts)
                t0 = time.perf_counter()
                torch.load(ts, map_location="cuda", weights_only=True)
                torch.cuda.synchronize()
                res["ts_r"].append(nbytes / (time.perf_counter() - t0) / 1e9)
            m = {k: median(v) for k, v in res.items()}
            wl, rl = min(m["d2h"], m["fio_w"]), min(m["h2d"], m["fio_r"])
            print(f"\n{nbytes / 2**30:.1f} GiB bf16 on the GPU: D2H {m['d2h']:.1f}, H2D {m['h2d']:.1f}, "
                  f"fio write {m['fio_w']:.2f}, fio read {m['fio_r']:.2f} GB/s")
            print(f"  write: fastpersist {m['fp_w']:.2f} GB/s ({m['fp_w'] / wl:.2f} of the limit), "
                  f"torch.save {m['ts_w']:.2f} ({m['ts_w'] / wl:.2f})")
            print(f"  read:  fastpersist {m['fp_r']:.2f} GB/s ({m['fp_r'] / rl:.2f} of the limit), "
                  f"torch.load {m['ts_r']:.2f} ({m['ts_r'] / rl:.2f})")
            del sd
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
