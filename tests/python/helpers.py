"""Shared helpers for the tests."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch


def bits(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor's values (bitwise equality, NaNs included)."""
    t = t.detach()
    if t.is_sparse:
        return bits(t.coalesce().indices()) + bits(t.coalesce().values())
    # A fresh, densely strided copy: contiguous() keeps odd strides of size-1 dims.
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))
    return flat.view(torch.uint8).numpy().tobytes()


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Structural, bit-for-bit equality of two saved objects."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, path
        assert a.shape == b.shape, path
        assert a.stride() == b.stride() or a.numel() <= 1, f"{path}: strides {a.stride()} {b.stride()}"
        assert a.layout == b.layout, path
        assert bits(a) == bits(b), f"{path}: values differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def all_dtypes() -> list:
    names = [
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "complex64",
        "complex128",
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    ]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def make(shape, dtype, seed: int = 0) -> torch.Tensor:
    """Random values of any dtype, made from random bytes."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def cli_exe() -> str:
    """The ``fastpersist`` console script: beside the interpreter (a
    virtualenv), else on PATH (a ``pip --target`` or ``--user`` install)."""
    import os
    import shutil
    import sys

    exe = os.path.join(os.path.dirname(sys.executable), "fastpersist")
    return exe if os.path.exists(exe) else (shutil.which("fastpersist") or exe)


def byte_runs(pieces) -> list:
    """(offset, bytes) pieces merged into maximal runs of contiguous bytes
    (how a file's bytes are cut into pieces aside); overlaps fail."""
    out: list = []
    for off, data in sorted(pieces):
        if out and out[-1][0] + len(out[-1][1]) == off:
            out[-1] = (out[-1][0], out[-1][1] + data)
        else:
            assert not out or out[-1][0] + len(out[-1][1]) <= off, "pieces overlap"
            out.append((off, data))
    return out


@contextlib.contextmanager
def gc_runs_inside_fastpersist():
    """Cyclic collections made frequent (threshold 50) for the block; yields
    the list of those that ran from inside fastpersist's own code, each as
    (generation, the fastpersist function on the stack)."""
    import gc
    import sys

    import fastpersist

    pkg = os.path.dirname(fastpersist.__file__) + os.sep
    runs: list = []

    def cb(phase, info):
        f = sys._getframe(1) if phase == "start" else None
        while f is not None:
            if f.f_code.co_filename.startswith(pkg):
                runs.append((info["generation"], f.f_code.co_name))
                break
            f = f.f_back

    old = gc.get_threshold()
    gc.set_threshold(50, 1, 1)
    gc.callbacks.append(cb)
    try:
        yield runs
    finally:
        gc.callbacks.remove(cb)
        gc.set_threshold(*old)


def first_part_sent(monkeypatch) -> Any:
    """A ``threading.Event`` set once the first part of a file is handed to
    an engine session (``writer.send`` and ``PartWriter.put``, which hands
    host parts to the session's write-behind thread, spied on for the
    test)."""
    import threading

    from fastpersist import writer

    sent = threading.Event()
    real_send = writer.send
    real_put = writer.PartWriter.put

    def send(*a, **kw):
        sent.set()
        return real_send(*a, **kw)

    def put(self, part):
        real_put(self, part)
        sent.set()

    monkeypatch.setattr(writer, "send", send)
    monkeypatch.setattr(writer.PartWriter, "put", put)
    return sent


def written_by_fastpersist(path) -> bool:
    """Whether fastpersist wrote the torch zip file at ``path``: its
    ``.data/serialization_id`` is the one fastpersist derives from the
    content (torch's is random), as fastpersist's reader tells them apart."""
    import zipfile

    from fastpersist.torch_zip import serialization_id

    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        sid = [n for n in names if n.endswith(".data/serialization_id")]
        if not pkl or not sid:
            return False
        prefix = pkl[0][: -len("data.pkl")]
        data = [i for i in z.infolist() if i.filename.startswith(prefix + "data/")]
        want = serialization_id(z.read(pkl[0]), len(data), sum(i.file_size for i in data))
        return z.read(sid[0]) == want.encode()


def full_device(directory: Any) -> str:
    """A character device like /dev/full (every write fails with ENOSPC)
    made in ``directory``, so a test never writes the system's own (and a
    defect that replaced it would replace only this one); skips the test
    where device nodes cannot be made (not root)."""
    import stat

    import pytest

    path = os.path.join(os.fspath(directory), "full")
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    except (PermissionError, OSError) as e:
        pytest.skip(f"cannot make a device node here: {e}")
    return path


@contextlib.contextmanager
def small_tmpfs(directory: Any, size: str = "2m"):
    """A tmpfs of ``size`` mounted at ``directory``/small for the length of
    the block (a real full file system: ENOSPC from the kernel); skips the
    test where it cannot be mounted (not root). The engine's background
    frees of replaced files are waited for before it is unmounted."""
    import subprocess

    import fastpersist
    import pytest

    mnt = os.path.join(os.fspath(directory), "small")
    os.makedirs(mnt, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mnt], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small file system: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        fastpersist._core.wait_for_frees(30.0)
        if subprocess.run(["umount", mnt], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", mnt], capture_output=True)
