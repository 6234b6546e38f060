"""Benchmark building blocks: workloads, the fio limits, cache dropping,
timing, memory, progress. Used by ``benches/`` and ``fastpersist bench``."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import time
from typing import Callable, Dict, List, Optional

import torch

MiB = 1 << 20
GiB = 1 << 30


def parse_size(s: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?B)?\s*", s, re.I)
    if not m:
        raise ValueError(f"bad size {s!r} (use e.g. 2GiB, 512MiB)")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * mult)


def gpt_state_dict(total: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """GPT-like: per layer an fp32 4096x4096 matrix, two bf16 4096x4096
    matrices and odd-sized biases (about 128 MiB a layer at dim 4096); a
    smaller dim for small totals."""
    g = torch.Generator().manual_seed(seed)
    dim = 4096 if total >= 512 * MiB else 1024
    per_layer = dim * dim * (4 + 2 + 2)
    layers = max(1, round(total / per_layer))
    sd: Dict[str, torch.Tensor] = {}
    for i in range(layers):
        p = f"layers.{i}."
        sd[p + "attn.qkv.weight"] = torch.randn(dim, dim, generator=g)
        sd[p + "attn.qkv.bias"] = torch.randn(3 * dim + 1, generator=g)
        sd[p + "mlp.fc.weight"] = torch.randn(dim, dim, generator=g).to(torch.bfloat16)
        sd[p + "mlp.fc.bias"] = torch.randn(dim + 7, generator=g).to(torch.bfloat16)
        sd[p + "mlp.proj.weight"] = torch.randn(dim, dim, generator=g).to(torch.bfloat16)
        sd[p + "ln.weight"] = torch.randn(dim - 3, generator=g)
    return sd


def small_tensors_state_dict(count: int, total: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """``count`` fp32 tensors, 4 KiB to 1 MiB each (log-uniform, then scaled
    toward ``total`` bytes)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = math.log(4096), math.log(MiB)
    raw = torch.exp(torch.rand(count, generator=g, dtype=torch.float64) * (hi - lo) + lo)
    raw = raw * (total / raw.sum())
    sizes = raw.clamp(4096, MiB).to(torch.int64) // 4
    return {f"t{i}": torch.randn(int(n), generator=g) for i, n in enumerate(sizes.tolist())}


def nbytes(sd: Dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fsync_path(os.path.join(root, f))
        fsync_path(root)


def clear(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


def ensure_fio() -> Optional[str]:
    fio = shutil.which("fio")
    if fio is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(
            "apt-get update -qq && apt-get install -y -qq fio",
            shell=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
        fio = shutil.which("fio")
    return fio


def fio_limit(directory: str, size: int, rw: str = "write") -> Optional[float]:
    """GB/s of fio: O_DIRECT, io_uring, 4 MiB blocks, queue depth 16,
    fsync at the end, one file of ``size`` bytes in ``directory``."""
    fio = ensure_fio()
    if fio is None:
        return None
    size = max(size // (4 * MiB), 1) * 4 * MiB
    # The same directory the writers use (not a subdirectory: ext4 places
    # new directories in other block groups, i.e. elsewhere on the disk).
    path = os.path.join(directory, "fio-limit.dat")
    base = [
        fio,
        "--name=limit",
        f"--filename={path}",
        "--bs=4M",
        "--iodepth=16",
        "--ioengine=io_uring",
        "--direct=1",
        f"--size={size}",
        "--output-format=json",
    ]
    try:
        if rw == "read":
            # lay the file out first; the read itself is O_DIRECT (cold)
            subprocess.run(base + ["--rw=write", "--end_fsync=1"], check=True, stdout=subprocess.DEVNULL)
        out = subprocess.run(base + [f"--rw={rw}", "--end_fsync=1"], check=True, capture_output=True, text=True).stdout
    finally:
        clear(path)
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return job[rw]["bw_bytes"] / 1e9


def drop_cache(path: str) -> None:
    """Evict a file (or every file under a directory) from the page cache,
    so the next read comes from the device."""
    paths = [path]
    if os.path.isdir(path):
        paths = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Progress:
    """A one-line progress bar on stderr (only when it is a terminal, or
    when ``force``)."""

    def __init__(self, total: int, label: str = "", force: bool = False) -> None:
        import sys

        self.total = max(total, 1)
        self.done = 0
        self.label = label
        self.enabled = force or sys.stderr.isatty()
        self.stream = sys.stderr

    def step(self, what: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / self.total)
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {what:<24}"
        )
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def peak_rss_delta(fn: Callable[[], None]) -> int:
    """Peak resident memory added by ``fn`` (Linux: resets VmHWM first)."""

    def field(name: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = field("VmRSS")
    fn()
    return field("VmHWM") - base
