"""Writes straight from memory (``zero_copy``): an async save's snapshot is
written from where it lies, tensors read in place never are, and the file
is the same either way."""

from __future__ import annotations

import hashlib
import os

import fastpersist
import pytest
import torch
from fastpersist.async_save import AsyncSaver
from fastpersist.options import EngineOptions

SHM = "/dev/shm"


def _state(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 << 20, generator=g),  # 12 MiB
        "mid": torch.randn((1 << 18) + 5, generator=g),  # just over 1 MiB
        "small": torch.randn(100, generator=g),
        "ints": torch.arange(1 << 19, dtype=torch.int64),
    }


def _sha(p) -> str:
    with open(p, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_snapshot_saves_write_from_the_snapshot(tmp_path, fmt):
    # The snapshot pool places each big storage where its file offset falls
    # within a page, so its whole blocks are as aligned in memory as in the
    # file: on a disk whose O_DIRECT wants 512-byte aligned memory (this
    # machine's) they are written from the pool, not copied again.
    sd = _state()
    lent = {}
    for zc in (True, False):
        p = tmp_path / f"s{zc}.pt"
        st = fastpersist.save_async(sd, p, mode="snapshot", zero_copy=zc, format=fmt).result(timeout=120)
        lent[zc] = st.zero_copy_bytes
        assert _same(fastpersist.read_state_dict(p), sd)
    assert lent[False] == 0
    assert lent[True] >= 10 << 20, lent
    sync = tmp_path / "sync.pt"
    fastpersist.write_state_dict(sd, sync, format=fmt)
    assert _sha(tmp_path / "sTrue.pt") == _sha(tmp_path / "sFalse.pt") == _sha(sync)


def test_reused_snapshot_pool_writes_each_save_its_own_bytes(tmp_path):
    saver = AsyncSaver()
    try:
        futs = []
        states = [_state(i) for i in range(4)]
        for i, sd in enumerate(states):
            futs.append(saver.save(sd, tmp_path / f"{i}.pt", mode="snapshot"))
            futs[-1].wait_snapshot()
            for t in sd.values():  # the caller moves on: its tensors change
                t.zero_()
        for i, f in enumerate(futs):
            assert f.result(timeout=120).zero_copy_bytes > 0
            assert _same(torch.load(tmp_path / f"{i}.pt"), _state(i))
    finally:
        saver.close()


@pytest.mark.parametrize("mode", [None, "pipelined"])
def test_tensors_read_in_place_are_never_lent(mode):
    # A synchronous or pipelined save reads the caller's tensors under the
    # GIL; the kernel would read lent memory with the GIL given back. On
    # tmpfs (which takes writes from any address) nothing is lent either.
    if not os.path.isdir(SHM):
        pytest.skip("no /dev/shm")
    sd = _state(3)
    p = os.path.join(SHM, f"fastpersist-zc-test-{os.getpid()}.pt")
    try:
        if mode is None:
            st = fastpersist.write_state_dict(sd, p)
        else:
            st = fastpersist.save_async(sd, p, mode=mode).result(timeout=120)
        assert st.zero_copy_bytes == 0
        assert _same(torch.load(p), sd)
    finally:
        if os.path.exists(p):
            os.unlink(p)


def test_zero_copy_is_an_option_and_an_environment_default(monkeypatch):
    assert EngineOptions.resolve().zero_copy is True
    assert EngineOptions.resolve(zero_copy=False).zero_copy is False
    monkeypatch.setenv("FASTPERSIST_ZERO_COPY", "0")
    assert EngineOptions.resolve().zero_copy is False
    assert EngineOptions.resolve(zero_copy=True).zero_copy is True


def test_snapshot_without_zero_copy_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTPERSIST_ZERO_COPY", "0")
    sd = _state(5)
    st = fastpersist.save_async(sd, tmp_path / "e.pt", mode="snapshot").result(timeout=120)
    assert st.zero_copy_bytes == 0
    assert _same(torch.load(tmp_path / "e.pt"), sd)
