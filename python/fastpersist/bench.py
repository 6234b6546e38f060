"""Benchmark building blocks: workloads, the fio limits, cache dropping,
timing, memory, progress. Used by ``benches/`` and ``fastpersist bench``."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import time
from typing import Any, Callable, Dict, List, Optional, Union

import torch

from . import _core
from .options import parse_size

MiB = 1 << 20
GiB = 1 << 30


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


# The configurations whose best is the honest device limit: large writes at
# a moderate depth and 1 MiB writes at a deep queue, each from normal 4 KiB
# pages and from huge-page-backed buffers (which spare the kernel the
# per-page pinning of O_DIRECT and often decide the result on virtual disks).
FIO_CONFIGS = (("4M", 16, False), ("4M", 16, True), ("1M", 32, False), ("1M", 32, True))
_HUGE_PAGE = 2 * MiB


def fio_config_name(bs: str, depth: int, huge: bool) -> str:
    return f"{bs}x{depth}{' huge' if huge else ''}"


class _HugeBuffers:
    """A hugetlbfs mount with enough reserved 2 MiB pages for fio's largest
    buffer set, made once per process (root only) and undone at exit."""

    def __init__(self) -> None:
        self.tried = False
        self.mount: Optional[str] = None
        self.why = ""
        self._added = 0
        self._made_dir: Optional[str] = None

    def path(self) -> Optional[str]:
        if self.tried:
            return self.mount
        self.tried = True
        if os.geteuid() != 0:
            self.why = "not root: no hugetlbfs mount, the limit may be low"
            return None
        need = max(parse_size(bs) * depth for bs, depth, _ in FIO_CONFIGS) // _HUGE_PAGE + 8
        try:
            existing = self._existing_mount()
            with open("/proc/meminfo") as f:
                free = next(int(line.split()[1]) for line in f if line.startswith("HugePages_Free:"))
            if free < need:
                with open("/proc/sys/vm/nr_hugepages") as f:
                    total = int(f.read())
                with open("/proc/sys/vm/nr_hugepages", "w") as f:
                    f.write(str(total + need - free))
                self._added = need - free
            if existing is None:
                import tempfile

                existing = tempfile.mkdtemp(prefix="fastpersist-hugetlbfs-")
                subprocess.run(["mount", "-t", "hugetlbfs", "none", existing], check=True, capture_output=True)
                self._made_dir = existing
            self.mount = existing
        except (OSError, subprocess.CalledProcessError, StopIteration, ValueError) as e:
            self.why = f"huge pages unavailable ({e}): the limit may be low"
            self.close()
        import atexit

        atexit.register(self.close)
        return self.mount

    @staticmethod
    def _existing_mount() -> Optional[str]:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and parts[2] == "hugetlbfs" and os.access(parts[1], os.W_OK):
                    return parts[1]
        return None

    def close(self) -> None:
        if self._made_dir is not None:
            subprocess.run(["umount", self._made_dir], check=False, capture_output=True)
            os.rmdir(self._made_dir)
            self._made_dir = None
        if self._added:
            try:
                with open("/proc/sys/vm/nr_hugepages") as f:
                    total = int(f.read())
                with open("/proc/sys/vm/nr_hugepages", "w") as f:
                    f.write(str(max(total - self._added, 0)))
            except OSError:
                pass
            self._added = 0
        self.mount = None


_HUGE = _HugeBuffers()


def _fio_job(path: str, size: int, bs: str, depth: int, huge: bool) -> Optional[List[str]]:
    """fio's command line for one job on ``path`` (O_DIRECT, io_uring,
    ``bs`` blocks at queue depth ``depth``, ``size`` rounded down to whole
    blocks; ``huge``: buffers on the hugetlbfs mount), without ``--rw``;
    None without fio, or without huge pages where they are asked for."""
    fio = ensure_fio()
    if fio is None:
        return None
    iomem = []
    if huge:
        mount = _HUGE.path()
        if mount is None:
            return None
        iomem = [f"--iomem=mmaphuge:{os.path.join(mount, f'fio-{os.getpid()}')}"]
    block = parse_size(bs)
    return [
        fio,
        "--name=limit",
        f"--filename={path}",
        f"--bs={bs}",
        f"--iodepth={depth}",
        "--ioengine=io_uring",
        "--direct=1",
        f"--size={max(size // block, 1) * block}",
        "--output-format=json",
        *iomem,
    ]


def _fio_gbps(cmd: List[str], rw: str) -> float:
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return float(job[rw]["bw_bytes"]) / 1e9


def fio_run(
    directory: str, size: int, rw: str = "write", bs: str = "4M", depth: int = 16, huge: bool = False
) -> Optional[float]:
    """GB/s of one fio run: O_DIRECT, io_uring, ``bs`` blocks at queue depth
    ``depth``, fsync at the end, one file of ``size`` bytes in ``directory``
    (for reads: laid out first, then read cold). ``huge``: buffers on a
    hugetlbfs mount (None when huge pages are unavailable)."""
    # The same directory the writers use (not a subdirectory: ext4 places
    # new directories in other block groups, i.e. elsewhere on the disk).
    path = os.path.join(directory, "fio-limit.dat")
    job = _fio_job(path, size, bs, depth, huge)
    if job is None:
        return None
    # Where fallocate writes every byte (tmpfs: it allocates and zeroes each
    # page), fio's default preallocation would do that work before its clock
    # starts, and the timed write would only overwrite pages already there.
    # A checkpoint is a new file, whose pages are allocated as it is written:
    # fio is made to allocate them the same way.
    if fio_allocates_as_it_writes(directory):
        job.append("--fallocate=none")
    try:
        if rw == "read":
            # Laid out with normal buffers (the read is the one timed).
            plain = [a for a in job if not a.startswith("--iomem=")]
            subprocess.run(plain + ["--rw=write", "--end_fsync=1"], check=True, stdout=subprocess.DEVNULL)
        return _fio_gbps(job + [f"--rw={rw}", "--end_fsync=1"], rw)
    finally:
        clear(path)


def fio_read_file(path: str, bs: str = "4M", depth: int = 16, huge: bool = False) -> Optional[float]:
    """GB/s of fio reading the existing file ``path`` (its whole blocks),
    read-only: the device's limit for those very blocks, wherever the file
    system put them. The file is neither written nor removed; the caller
    syncs it and drops it from the page cache first, as before any cold
    read."""
    size = os.path.getsize(path)
    job = _fio_job(path, size, bs, depth, huge) if size >= parse_size(bs) else None
    if job is None:
        return None
    return _fio_gbps(job + ["--readonly", "--rw=read"], "read")


def fio_read_file_limits(path: str) -> Dict[str, float]:
    """One read of the existing file ``path`` in every configuration of
    ``FIO_CONFIGS`` (see :func:`fio_read_file`): name -> GB/s."""
    out: Dict[str, float] = {}
    for bs, depth, huge in FIO_CONFIGS:
        bw = fio_read_file(path, bs, depth, huge)
        if bw is not None:
            out[fio_config_name(bs, depth, huge)] = bw
    return out


def fio_allocates_as_it_writes(directory: str) -> bool:
    """Whether fio's limit runs in ``directory`` go without preallocation:
    on file systems where ``fallocate`` writes every byte it reserves
    (tmpfs, hugetlbfs, FAT), so that fio, like any writer of a new file,
    pays for the allocation inside the timed write."""
    try:
        return _core.fallocate_zero_fills(directory)
    except OSError:
        return False


def fio_limits(directory: str, size: int, rw: str = "write") -> Dict[str, float]:
    """One run of every configuration in ``FIO_CONFIGS``: name -> GB/s
    (configurations that cannot run here are left out)."""
    out: Dict[str, float] = {}
    for bs, depth, huge in FIO_CONFIGS:
        bw = fio_run(directory, size, rw, bs, depth, huge)
        if bw is not None:
            out[fio_config_name(bs, depth, huge)] = bw
    return out


def fio_limit(directory: str, size: int, rw: str = "write") -> Optional[float]:
    """The best of one run of every configuration in ``FIO_CONFIGS`` (GB/s),
    or None without fio."""
    runs = fio_limits(directory, size, rw)
    return max(runs.values()) if runs else None


class Limit:
    """The honest device limit over several rounds: each configuration's
    median, and the best of those medians (``gbps``, won by ``config``)."""

    def __init__(self) -> None:
        self.rounds: Dict[str, List[float]] = {}
        # Whether fio ran without preallocation (see fio_allocates_as_it_writes).
        self.allocating = False

    def add(self, runs: Dict[str, float]) -> None:
        for k, v in runs.items():
            self.rounds.setdefault(k, []).append(v)

    def measure(self, directory: str, size: int, rw: str = "write") -> Dict[str, float]:
        runs = fio_limits(directory, size, rw)
        self.add(runs)
        self.allocating = self.allocating or (rw == "write" and fio_allocates_as_it_writes(directory))
        return runs

    def medians(self) -> Dict[str, float]:
        return {k: median(v) for k, v in self.rounds.items()}

    @property
    def gbps(self) -> float:
        m = self.medians()
        return max(m.values()) if m else float("nan")

    @property
    def config(self) -> str:
        m = self.medians()
        return max(m, key=lambda k: m[k]) if m else "none"

    def as_dict(self) -> Dict[str, Any]:
        """The limit, its configuration and every configuration's median,
        as the benchmarks' JSON records them."""
        return {
            "limit_gbps": self.gbps,
            "limit_config": self.config,
            "fio_medians": self.medians(),
            "fio_preallocates": not self.allocating,
        }

    def note(self) -> str:
        """A line naming the winner and every configuration's median, and
        why huge pages were not tried when they were not."""
        m = self.medians()
        if not m:
            return "fio unavailable: no limit"
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(m.items(), key=lambda kv: -kv[1]))
        why = f"; {_HUGE.why}" if _HUGE.why else ""
        if self.allocating:
            why += "; without preallocation (fallocate zero-fills here: fio allocates as it writes, as a new file must)"
        return f"limit {self.gbps:.2f} GB/s ({self.config}); fio medians: {parts}{why}"


#: The kernel's free page reporting (virtio-balloon): free blocks of
#: 2**order pages are handed back to the host a few seconds after they are
#: freed, and the first touch of such memory waits for the host to back it
#: again. Memory freed by one reader and allocated by the next is then slow
#: to fill, whatever the disk.
PAGE_REPORTING_ORDER = "/sys/module/page_reporting/parameters/page_reporting_order"
#: An order above the largest buddy block: nothing is reported.
_NO_REPORTING_ORDER = 11


def page_reporting_order(path: str = PAGE_REPORTING_ORDER) -> Optional[int]:
    """The order of the blocks this kernel reports to the host as free;
    None where it reports none (no free page reporting, or an order above
    any block)."""
    try:
        with open(path) as f:
            order = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return order if order < _NO_REPORTING_ORDER else None


class FreedMemoryKept:
    """Within ``with``: no free page reporting (root only), so memory one
    reader frees stays backed for the next; the order is set back after.
    ``note`` says what was done, or why not."""

    def __init__(self, path: str = PAGE_REPORTING_ORDER) -> None:
        self.path = path
        self._was: Optional[int] = None
        self.note = ""

    def __enter__(self) -> FreedMemoryKept:
        order = page_reporting_order(self.path)
        if order is None:
            self.note = "no free page reporting: freed memory stays with this machine"
        elif os.geteuid() != 0:
            self.note = (
                f"free page reporting is on (order {order}) and this is not root: memory freed between readers "
                "goes back to the host, and its first touch may be slow"
            )
        else:
            try:
                with open(self.path, "w") as f:
                    f.write(str(_NO_REPORTING_ORDER))
                self._was = order
                self.note = f"free page reporting turned off for the run (order {order} -> {_NO_REPORTING_ORDER})"
            except OSError as e:
                self.note = f"free page reporting is on (order {order}) and could not be turned off ({e})"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._was is not None:
            try:
                with open(self.path, "w") as f:
                    f.write(str(self._was))
            except OSError:
                pass
            self._was = None


class FreedMemoryReported:
    """The kernel's free page reporting left as it is; ``note`` says when
    it is on (see :func:`free_page_reporting_note`)."""

    def __init__(self, path: str = PAGE_REPORTING_ORDER) -> None:
        self.note = free_page_reporting_note(path)

    def __enter__(self) -> FreedMemoryReported:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def freed_memory(keep: Optional[bool], path: str = PAGE_REPORTING_ORDER) -> Union[FreedMemoryKept, FreedMemoryReported]:
    """What a benchmark that allocates what it reads does with the kernel's
    free page reporting for its run: ``keep`` True turns it off
    (:class:`FreedMemoryKept`), False leaves it, None turns it off where
    this is root (as the fio limit's huge pages are reserved where this is
    root). With the reporting on, a reader's time depends on how long ago
    the memory it fills was freed, not on the reader."""
    if keep is None:
        keep = os.geteuid() == 0
    return FreedMemoryKept(path) if keep else FreedMemoryReported(path)


def warm_memory(nbytes: int, chunk: int = 256 << 20) -> None:
    """Allocate ``nbytes`` in ``chunk``-sized storages, all alive at once,
    fill them once and free them: with free page reporting off, the memory
    the first round's readers get is then already backed by the host, as
    the later rounds' is, rather than only the first round paying for it."""
    held = []
    while nbytes > 0:
        st = torch.UntypedStorage(min(chunk, nbytes))
        torch.ByteTensor(st).fill_(0)
        held.append(st)
        nbytes -= st.nbytes()
    del held


def free_page_reporting_note(path: str = PAGE_REPORTING_ORDER) -> str:
    """A line for a benchmark's output when freed memory goes back to the
    host (else empty)."""
    order = page_reporting_order(path)
    if order is None:
        return ""
    return (
        f"free page reporting is on (order {order}): memory freed between readers goes back to the host and its "
        "first touch may be slow (--keep-freed-memory turns it off for the run, as root)"
    )


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


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes. What it returns is dropped after the clock
    stops: a reader's result (gigabytes of storages) is not freed inside
    its time, as a caller keeps what it read."""
    t0 = time.perf_counter()
    out = fn()
    t = time.perf_counter() - t0
    del out
    return t


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
